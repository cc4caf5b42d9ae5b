"""The prover critic as a verl single-controller worker: each worker holds a critic replica and scores its shard
of a ``DataProto`` (data parallel, ``Dispatch.DP_COMPUTE_PROTO``).

Driver side (a trainer, or a test on CPU)::

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl_prm.integrations.verl.critic_worker import ProverCriticWorker, compute_step_values

    pool = RayResourcePool(process_on_nodes=[n_gpus], use_gpu=True, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(ProverCriticWorker), model_path=..., critic_kwargs={...},
                               policy_tokenizer_path=None)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls)   # device_name="cpu" on CPU pools
    group.init_model()
    scores = compute_step_values(group, batch)   # pads to a multiple of the world size, unpads the result

Each worker is a Ray actor that verl starts with ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``/``MASTER_PORT`` in its
environment (``RayWorkerGroup._create_worker``); ``Worker.__init__`` reads them. On a GPU pool each actor gets one
GPU through ``CUDA_VISIBLE_DEVICES`` (``num_gpus = 1 / max_colocate_count``), so the critic runs on ``cuda``
(device 0 of what the actor sees); on a CPU pool (``use_gpu=False``) there is no GPU resource and the critic runs
on CPU. The critic needs no process group: replicas are independent (pure data parallelism), so no
``torch.distributed`` initialisation happens here (``verl_prm.integrations.verl.sharded_critic`` holds the
FSDP-sharded worker, ``verl_prm.placement.shard=fsdp``).

``offload="cpu"`` (``verl_prm.placement.offload``) keeps the weights in host memory between scorings: moved to
the accelerator at the start of ``compute_step_values`` and back after it; each worker reports the seconds in its
output's ``meta_info["metrics"][OFFLOAD_SECONDS_KEY]``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch
from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from verl_prm.choices import OFFLOAD_MODES
from verl_prm.critic.exact import ExactCritic
from verl_prm.critic import ProverCritic
from verl_prm.integrations.verl.critic_placement import balanced_row_order, inverse_order
from verl_prm.steps import StepSplit, decode_with_char_ends

__all__ = ["ProverCriticWorker", "compute_step_values", "move_critic", "INPUT_KEYS", "OUTPUT_KEYS", "ROW_INDEX_KEY",
           "OFFLOAD_SECONDS_KEY"]

# Input batch keys (verl layout + the step split of the responses):
#   prompts [B, P] left-padded, responses [B, T], attention_mask [B, P + T],
#   step_ends [B, S] (response position of each step's last token, -1 padded), num_steps [B];
#   optional: step_ids [B, T], merged_steps [B] (carried into the StepSplit);
#   with a critic tokenizer other than the policy's: step_char_ends [B, S] (StepSplit.step_char_ends), the mask
#   the split decoded the responses with (step_text_mask [B, T], default: the response attention) and,
#   optionally, non_tensor_batch["critic_prompts"] (B prompt texts exactly as the critic reads them; default:
#   the policy prompts decoded with special tokens kept as text).
INPUT_KEYS = ("prompts", "responses", "attention_mask", "step_ends", "num_steps")
OUTPUT_KEYS = ("prompt_values", "step_values", "num_steps")
# Each row's index in the padded batch, set by compute_step_values (rows are reordered for token balance).
ROW_INDEX_KEY = "verl_prm_row_index"
# meta_info["metrics"] key of each worker's output: seconds spent moving the weights (both ways) in this call.
OFFLOAD_SECONDS_KEY = "pav_critic_offload_s"


class ProverCriticWorker(Worker):
    """A verl worker holding one ``ProverCritic`` replica (or an ``ExactCritic``: no checkpoint).

    Args:
        model_path: critic checkpoint; None: no checkpoint, ``critic_kwargs`` are an exact prover's options
            (``verl_prm.critic.source=exact``).
        critic_kwargs: keyword arguments of ``ProverCritic.from_pretrained`` (format, best_of_k, dtype, ...);
            ``device`` defaults to the worker's accelerator (``cuda`` when a GPU is visible, else ``cpu``).
            Without a checkpoint: ``prover`` (``"module:Class"``) and the exact prover's options
            (``ExactCritic.from_options``).
        policy_tokenizer_path: the policy's tokenizer when it differs from the critic's (then responses are
            re-tokenised for the critic with ``align_to_critic``); None when the critic reads the policy's ids.
            Required for an exact prover: it reads the text (at the split's ``step_char_ends``).
    """

    def __init__(self, model_path: str | None, critic_kwargs: dict[str, Any] | None = None,
                 policy_tokenizer_path: str | None = None, offload: str = "none"):
        super().__init__()
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"ProverCriticWorker: offload must be one of {OFFLOAD_MODES}, got {offload!r}")
        self.model_path = model_path
        self.critic_kwargs = dict(critic_kwargs or {})
        self.policy_tokenizer_path = policy_tokenizer_path
        self.offload = offload
        self.critic = None
        self.policy_tokenizer = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the critic replica on this worker's device; returns a short description (rank, device)."""
        kwargs = dict(self.critic_kwargs)
        if self.model_path is None and self.offload != "none":
            raise ValueError("ProverCriticWorker: an exact prover has no weights to offload; use offload='none'")
        if self.model_path is None:
            if self.policy_tokenizer_path is None:
                raise ValueError(
                    "ProverCriticWorker: an exact prover reads the response text, so it needs policy_tokenizer_path "
                    "(the trainer passes the policy's tokenizer)"
                )
            self.critic = ExactCritic.from_options(**kwargs)
        else:
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
            self.critic = self._load_critic(kwargs)
            if self.offload == "cpu":
                move_critic(self.critic.adapter, torch.device("cpu"))  # held on the host until the first scoring
        if self.policy_tokenizer_path is not None:
            from transformers import AutoTokenizer

            self.policy_tokenizer = AutoTokenizer.from_pretrained(self.policy_tokenizer_path, trust_remote_code=False)
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.critic.device),
                "packing": self.critic.packing, "offload": self.offload,
                "calibration": self.critic.calibration.describe() if getattr(self.critic, "calibration", None) else None}

    def _load_critic(self, kwargs: dict[str, Any]):
        """The checkpoint critic of this worker (a full replica; ``ShardedProverCriticWorker``: its shard)."""
        return ProverCritic.from_pretrained(self.model_path, **kwargs)

    def _score(self, prompts, responses, attention_mask, split, prompt_texts, with_features: bool = False):
        # only a checkpoint critic has features (the refresh asks for them; ExactCritic has no value head)
        extra = {"with_features": True} if with_features else {}
        return self.critic.score_policy_batch(prompts, responses, attention_mask, split, self.policy_tokenizer,
                                              prompt_texts=prompt_texts, sample_offset=0, **extra)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_value_head(self, weight: list[float], bias: float) -> None:
        """Replace the value head of this worker's replica (``ProverCritic.set_value_head``; the refresh's refit)."""
        if self.critic is None:
            raise RuntimeError("ProverCriticWorker: call init_model() on the worker group before set_value_head")
        self.critic.set_value_head(torch.tensor(weight, dtype=torch.float32), torch.tensor(float(bias)))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_step_values(self, data: DataProto) -> DataProto:
        """Score this worker's shard.

        Input ``data.batch``: ``INPUT_KEYS`` (see module). Output ``batch``: ``prompt_values`` [b] fp32,
        ``step_values`` [b, S] fp32 (S = the input's ``step_ends.shape[1]``, so shards concatenate),
        ``num_steps`` [b] int64; with ``data.meta_info["with_features"]`` also ``features`` [b, S + 1, d] fp32 (what
        the value head read: ``CriticScores.features``).
        """
        if self.critic is None:
            raise RuntimeError("ProverCriticWorker: call init_model() on the worker group before compute_step_values")

        batch = data.batch
        missing = [k for k in INPUT_KEYS if k not in batch.keys()]
        if missing:
            raise KeyError(f"compute_step_values: the batch lacks {missing}; it needs {list(INPUT_KEYS)}")
        prompts, responses, attention_mask = batch["prompts"], batch["responses"], batch["attention_mask"]
        num_steps = batch["num_steps"]
        split = StepSplit(
            step_ids=batch["step_ids"] if "step_ids" in batch.keys() else torch.full_like(responses, -1),
            num_steps=num_steps,
            step_ends=batch["step_ends"],
            merged_steps=batch["merged_steps"] if "merged_steps" in batch.keys() else torch.zeros_like(num_steps),
        )
        prompt_texts = None
        if self.policy_tokenizer is not None:
            # Another tokenizer: the critic re-reads the text; the step split must say where steps end in it.
            if "step_char_ends" not in batch.keys():
                raise KeyError(
                    "compute_step_values: the critic's tokenizer differs from the policy's, so the batch needs "
                    "'step_char_ends' (StepSplit.step_char_ends of split_steps) to find the steps in the text"
                )
            # decode with the mask the split used (the trainer sends it), else the response attention
            if "step_text_mask" in batch.keys():
                response_mask = batch["step_text_mask"]
            else:
                response_mask = attention_mask[:, prompts.shape[1]:]
            split.texts = decode_with_char_ends(self.policy_tokenizer, responses, response_mask).texts
            split.step_char_ends = batch["step_char_ends"].cpu()
            if "critic_prompts" in data.non_tensor_batch:
                prompt_texts = [str(t) for t in data.non_tensor_batch["critic_prompts"]]
        # DP_COMPUTE_PROTO hands out equal chunks in rank order; compute_step_values reorders the rows by tokens
        # and sends each row's index in the padded batch as ROW_INDEX_KEY.
        first = self.rank * len(data)
        rows = batch[ROW_INDEX_KEY].tolist() if ROW_INDEX_KEY in batch.keys() else list(range(first, first + len(data)))
        offloads = self.offload == "cpu" and hasattr(self.critic, "adapter")
        offload_seconds = move_critic(self.critic.adapter, self.critic.device) if offloads else 0.0
        try:
            scores = self._score(prompts, responses, attention_mask, split, prompt_texts,
                                 with_features=bool(data.meta_info.get("with_features", False)))
        except (ValueError, FloatingPointError) as error:
            # say which rows of the whole batch this shard holds (messages of verl_prm.steps use shard indices)
            raise type(error)(
                f"prover critic worker rank {self.rank} (samples {sorted(rows)} of the batch, padded to a multiple "
                f"of {self.world_size}): {batch_sample_numbers(str(error), rows)}"
            ) from error
        finally:
            if offloads:
                offload_seconds += move_critic(self.critic.adapter, torch.device("cpu"))
        if str(self.critic.device).startswith("cuda"):
            torch.cuda.empty_cache()  # give the scoring activations back to the colocated actor and rollout
        return DataProto.from_dict(tensors=scores.as_dict(),
                                   meta_info={"metrics": {OFFLOAD_SECONDS_KEY: offload_seconds}})


def move_critic(adapter, device: torch.device) -> float:
    """Move the critic's weights (backbone and head) to ``device``; returns the seconds it took. On CUDA the copy
    is awaited (``synchronize``) so the seconds are the transfer's, and a move to the host gives the freed blocks
    back to the colocated rollout and actor (``empty_cache``)."""
    start = time.perf_counter()
    with torch.no_grad():
        adapter.backbone.to(device)
        adapter.head.to(device)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        if device.type == "cpu":
            torch.cuda.empty_cache()
    return time.perf_counter() - start


_SAMPLE_NUMBER = re.compile(r"\bsample (\d+)\b")


def batch_sample_numbers(message: str, rows: list[int]) -> str:
    """The critic names a shard's rows "sample i" (0-based in the shard); the shard's row i is row ``rows[i]``
    of the whole (padded, reordered) batch, so the message is rewritten to name that row."""
    return _SAMPLE_NUMBER.sub(lambda m: f"sample {rows[int(m.group(1))]}" if int(m.group(1)) < len(rows)
                              else m.group(0), message)


def compute_step_values(worker_group, data: DataProto) -> DataProto:
    """Score ``data`` on a ``ProverCriticWorker`` group: pad to a multiple of the world size (repeating the first
    samples, ``pad_dataproto_to_divisor``), reorder the rows so each worker's equal-count shard holds about the
    same number of tokens (``balanced_row_order`` on the attention mask), dispatch, restore the order and drop
    the padded rows again."""
    padded, pad_size = pad_dataproto_to_divisor(data, worker_group.world_size)
    lengths = padded.batch["attention_mask"].sum(-1).tolist()
    order = balanced_row_order(lengths, worker_group.world_size)
    shards = padded.select_idxs(torch.tensor(order))
    shards.batch[ROW_INDEX_KEY] = torch.tensor(order)
    output = worker_group.compute_step_values(shards)
    restored = output.select_idxs(torch.tensor(inverse_order(order)))
    return unpad_dataproto(restored, pad_size)

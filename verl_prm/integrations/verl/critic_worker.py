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
``torch.distributed`` initialisation happens here.
"""

from __future__ import annotations

from typing import Any

import torch
from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

__all__ = ["ProverCriticWorker", "compute_step_values", "INPUT_KEYS", "OUTPUT_KEYS"]

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


class ProverCriticWorker(Worker):
    """A verl worker holding one ``ProverCritic`` replica (or an ``ExactCritic``: ``format="exact"``).

    Args:
        model_path: critic checkpoint; None with ``format="exact"`` (no checkpoint).
        critic_kwargs: keyword arguments of ``ProverCritic.from_pretrained`` (format, best_of_k, dtype, ...);
            ``device`` defaults to the worker's accelerator (``cuda`` when a GPU is visible, else ``cpu``).
            With ``format="exact"``: ``prover`` (``"module:Class"``) and the exact prover's options
            (``ExactCritic.from_options``).
        policy_tokenizer_path: the policy's tokenizer when it differs from the critic's (then responses are
            re-tokenised for the critic with ``align_to_critic``); None when the critic reads the policy's ids.
            Required with ``format="exact"``: the exact critic reads the text (at the split's
            ``step_char_ends``).
    """

    def __init__(self, model_path: str | None, critic_kwargs: dict[str, Any] | None = None,
                 policy_tokenizer_path: str | None = None):
        super().__init__()
        self.model_path = model_path
        self.critic_kwargs = dict(critic_kwargs or {})
        self.policy_tokenizer_path = policy_tokenizer_path
        self.critic = None
        self.policy_tokenizer = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the critic replica on this worker's device; returns a short description (rank, device)."""
        from verl_prm.critic.exact import EXACT_FORMAT, ExactCritic
        from verl_prm.critic.scorer import ProverCritic

        kwargs = dict(self.critic_kwargs)
        if kwargs.get("format") == EXACT_FORMAT:
            if self.policy_tokenizer_path is None:
                raise ValueError(
                    "ProverCriticWorker: format 'exact' reads the response text, so it needs policy_tokenizer_path "
                    "(the trainer passes the policy's tokenizer)"
                )
            kwargs.pop("format")
            self.critic = ExactCritic.from_options(**kwargs)
        else:
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
            self.critic = ProverCritic.from_pretrained(self.model_path, **kwargs)
        if self.policy_tokenizer_path is not None:
            from transformers import AutoTokenizer

            self.policy_tokenizer = AutoTokenizer.from_pretrained(self.policy_tokenizer_path, trust_remote_code=False)
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.critic.device),
                "packing": self.critic.packing}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_step_values(self, data: DataProto) -> DataProto:
        """Score this worker's shard.

        Input ``data.batch``: ``INPUT_KEYS`` (see module). Output ``batch``: ``prompt_values`` [b] fp32,
        ``step_values`` [b, S] fp32 (S = the input's ``step_ends.shape[1]``, so shards concatenate),
        ``num_steps`` [b] int64.
        """
        if self.critic is None:
            raise RuntimeError("ProverCriticWorker: call init_model() on the worker group before compute_step_values")
        from verl_prm.steps import StepSplit, decode_with_char_ends

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
        # DP_COMPUTE_PROTO hands out equal chunks in rank order, so this shard starts at rank * len(data).
        first = self.rank * len(data)
        try:
            scores = self.critic.score_policy_batch(
                prompts, responses, attention_mask, split, self.policy_tokenizer,
                prompt_texts=prompt_texts, sample_offset=first,
            )
        except (ValueError, FloatingPointError) as error:
            # say which rows of the whole batch this shard holds (messages of verl_prm.steps use shard indices)
            raise type(error)(
                f"prover critic worker rank {self.rank} (samples {first}..{first + len(data) - 1} of the batch, "
                f"padded to a multiple of {self.world_size}): {error}"
            ) from error
        return DataProto.from_dict(tensors=scores.as_dict())


def compute_step_values(worker_group, data: DataProto) -> DataProto:
    """Score ``data`` on a ``ProverCriticWorker`` group: pad to a multiple of the world size (repeating the first
    samples, ``pad_dataproto_to_divisor``), dispatch, and drop the padded rows again."""
    padded, pad_size = pad_dataproto_to_divisor(data, worker_group.world_size)
    output = worker_group.compute_step_values(padded)
    return unpad_dataproto(output, pad_size)

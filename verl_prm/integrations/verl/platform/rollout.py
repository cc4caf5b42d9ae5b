"""A rollout server on transformers ``generate``, plugged into verl 0.9.1 as ``actor_rollout_ref.rollout.name=hf``.

verl's agent loop asks rollout *servers* for tokens (``server.generate(prompt_ids, sampling_params,
request_id) -> TokenOutput``) and keeps their weights in sync through a ``BaseRollout`` adapter that lives in
each training worker (``rollout.update_weights(named_tensors)``). vLLM and SGLang provide both on GPUs; this
module provides both on CPU with transformers, through verl's own extension points:

- ``HFRolloutServer``: a Ray actor holding the policy as a ``AutoModelForCausalLM`` (safetensors,
  ``trust_remote_code=False``) behind ``verl_prm.generation.GenerationEngine``: requests are decoded as one
  batch whatever their lengths and sampling settings (temperature, top-p, top-k, length limit, the model's EOS
  ids), a request that arrives while others decode joins them before the next token (continuous batching, so a
  tree branch starts as soon as its root ends, not when the root's whole batch does), in the precision
  ``rollout.dtype`` names (``auto``: bfloat16 where the CPU has native bf16 instructions), and a request that
  extends a sequence the server generated since the last weight update (a tree branch, its root's response
  prefix) copies that prefix's keys and values instead of computing them again. Log-probabilities, when asked
  for, are those of the sampled tokens under the raw logits (float32);
- ``HFReplica`` (``RolloutReplica``, registered in ``RolloutReplicaRegistry`` as ``hf``): starts one server per
  replica next to the hybrid engine's workers;
- ``HFServerAdapter`` (``BaseRollout``, registered in verl's rollout registry as ``("hf", "async")``): verl's
  training worker calls ``update_weights`` with the actor's full parameters after each step (verl's ``naive``
  checkpoint engine, the same call it makes to vLLM); the adapter of the replica's first rank sends them to its
  server, which loads them into the model.

Only verl's hybrid mode (actor and rollout in the same workers, ``trainer.v1.trainer_mode=sync``/``pav_sync``)
is supported; LoRA adapters and multi-modal inputs are not.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Generator, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from verl_prm.generation import ContinuousBatcher, GenerationEngine, GenerationRequest
from verl_prm.precision import resolve_dtype
from verl_prm.integrations.verl.import_hooks import run_deferred_registration
from verl_prm.special_tokens import policy_eos_token_ids

logger = logging.getLogger(__name__)

__all__ = ["HFReplica", "HFRolloutServer", "HFServerAdapter", "ROLLOUT_NAME", "register_rollout"]

ROLLOUT_NAME = "hf"


def _server_name(rollout_name: str, replica_rank: int) -> str:
    return f"{rollout_name}_server_{replica_rank}_0"


class HFRolloutServer:
    """Token-in-token-out generation with a transformers causal LM (see the module docstring)."""

    def __init__(self, config, model_config, replica_rank: int, max_batch_size: int):
        self.config = config
        self.model_config = model_config
        self.replica_rank = replica_rank
        self.max_batch_size = max(1, int(max_batch_size))
        self.global_steps: Optional[int] = None
        self.model = None
        self.engine: Optional[GenerationEngine] = None
        self.batcher: Optional[ContinuousBatcher] = None

    def load(self) -> dict[str, Any]:
        """Load the policy from ``model_config.path``; returns a description."""
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from verl.utils.fs import copy_to_local

        # verl hands replicas the model section as a DictConfig (no HFModelConfig.local_path yet)
        path = copy_to_local(self.model_config.path)
        dtype = resolve_dtype(str(self.config.dtype), "cpu")  # the startup check refused what cannot run
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False,
                                                          use_safetensors=True)
        self.model.eval()
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:
            generation = self.model.generation_config
        if generation.eos_token_id is None:
            generation.eos_token_id = self.model.config.eos_token_id
        # the policy's EOS ids, as the trainer hook reads them: the tokenizer's and the generation config's
        tokenizer_path = copy_to_local(getattr(self.model_config, "tokenizer_path", None) or self.model_config.path)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
        self.eos_token_ids = sorted(policy_eos_token_ids(tokenizer, generation, source=f"hf rollout: the policy {path}"))
        pad = generation.pad_token_id if generation.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        if getattr(self.config, "seed", None) is not None:
            torch.manual_seed(int(self.config.seed) + self.replica_rank)
        self.engine = GenerationEngine(self.model, eos_token_ids=self.eos_token_ids,
                                       max_batch_size=self.max_batch_size)
        self.batcher = ContinuousBatcher(self.engine)
        return {"replica_rank": self.replica_rank, "parameters": sum(p.numel() for p in self.model.parameters()),
                "dtype": str(dtype), "eos_token_ids": self.eos_token_ids}

    # ---------------------------------------------------------------- generation
    def _request(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        params = dict(sampling_params)
        max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        room = int(max_model_len) - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                             f"max_model_len={max_model_len}: raise actor_rollout_ref.rollout.max_model_len")
        if "max_tokens" in params:
            max_tokens = int(params.pop("max_tokens"))
        elif "max_new_tokens" in params:
            max_tokens = int(params.pop("max_new_tokens"))
        else:
            max_tokens = min(self.config.response_length,
                             self.config.prompt_length + self.config.response_length - len(prompt_ids))
        top_k = params.get("top_k", -1)
        return {
            "prompt_ids": [int(t) for t in prompt_ids],
            "temperature": float(params.get("temperature", 1.0)),
            "top_p": float(params.get("top_p", 1.0)),
            "top_k": int(top_k) if top_k is not None else -1,
            "max_tokens": max(1, min(max_tokens, room)),
            "logprobs": bool(params.get("logprobs", False)),
            "repetition_penalty": float(params.get("repetition_penalty", 1.0)),
        }

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       **kwargs) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("the hf rollout generates from token ids only (no multi-modal inputs)")
        request = self._request(prompt_ids, sampling_params)
        if request["repetition_penalty"] != 1.0:
            raise NotImplementedError("the hf rollout does not apply repetition_penalty; set it to 1.0")
        output = await self.batcher.generate(GenerationRequest(
            request["prompt_ids"], max_tokens=request["max_tokens"], temperature=request["temperature"],
            top_p=request["top_p"], top_k=request["top_k"], logprobs=request["logprobs"]))
        return TokenOutput(token_ids=output.token_ids, log_probs=output.log_probs, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps, "prefill_tokens": output.prefill_tokens,
                                         "prefill_tokens_saved": len(request["prompt_ids"]) - output.prefill_tokens})

    def engine_stats(self) -> dict[str, float]:
        """The engine's running totals (prompt, computed, reused and shared prefill tokens; generated tokens)."""
        return self.engine.stats.as_dict()

    # ---------------------------------------------------------------- weights and control calls
    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        """Load the actor's parameters (Hugging Face names); returns how many tensors were loaded."""
        state = self.model.state_dict()
        unknown = sorted(set(named_tensors) - set(state))
        if unknown:
            raise KeyError(f"hf rollout: the actor sent parameters the rollout model does not have: {unknown[:8]}")
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(state) - set(named_tensors) - tied)
        if missing:
            raise KeyError(f"hf rollout: the weight update lacks parameters of the rollout model: {missing[:8]}")
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                state[name].copy_(tensor.to(state[name].dtype))
        self.engine.weights_changed()  # cached prefixes were computed with the old weights
        return len(named_tensors)

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self, tags: list[str] | None = None) -> None:  # weights stay in host memory
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        self.engine.weights_changed()

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self.batcher.busy:
            await asyncio.sleep(0.05)

    async def abort_all_requests(self, reject_request: bool = False, **kwargs) -> dict[str, Any]:
        # generation of a batch is not interruptible: wait for it (sync training never aborts)
        await self.wait_for_requests_to_drain()
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """One ``HFRolloutServer`` per replica, next to verl's hybrid workers (see the module docstring)."""

    async def launch_servers(self) -> None:
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(
                f"the hf rollout runs in verl's hybrid mode only (actor and rollout in the same workers), got "
                f"{self.rollout_mode}: use trainer.v1.trainer_mode=sync (or pav_sync) with "
                "actor_rollout_ref.hybrid_engine=True"
            )
        name = _server_name(self.config.name, self.replica_rank)
        server = ray.remote(HFRolloutServer).options(
            name=name, num_cpus=0, max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank,
                 max_batch_size=self.config.max_num_seqs)
        info = await server.load.remote()
        logger.info("hf rollout server %s ready: %s", name, info)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-rollout://{name}"


class HFServerAdapter(BaseRollout):
    """The training worker's side of the hf rollout: forwards the actor's weights to the replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        rollout_world_size = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                              * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self._has_server = rank % rollout_world_size == 0
        self.server_handle = None

    def _server(self):
        if self.server_handle is None:
            self.server_handle = ray.get_actor(_server_name(self.config.name, self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             global_steps: int = None, wire_format: str = "named_tensors", **kwargs) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes wire_format='named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the hf rollout does not load LoRA adapters: set actor_rollout_ref.model.lora_rank=0")
        start = time.perf_counter()
        named: dict[str, torch.Tensor] = {}
        from verl.workers.rollout.utils import ensure_async_iterator

        async for name, tensor in ensure_async_iterator(weights):
            # every rank iterates (gathering a sharded tensor is collective); the server's rank keeps them
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if self._has_server:
                named[name] = tensor.detach().to("cpu", copy=True)
        if not self._has_server:
            return
        server = self._server()
        await server.load_weights.remote(named)
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)
        logger.info("hf rollout: %d tensors synced in %.2f s", len(named), time.perf_counter() - start)

    def generate_sequences(self, prompts):
        raise NotImplementedError("the hf rollout serves verl's agent loop (async server mode) only")


def _load_replica():
    return HFReplica


def register_rollout() -> None:
    """Register the ``hf`` rollout in verl's replica and rollout registries (idempotent)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"


# verl's plugin loader may have asked for the registration while this module was still executing.
run_deferred_registration(__name__)

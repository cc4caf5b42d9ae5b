"""Text generators behind one interface: Hugging Face transformers, vLLM, and a Ray pool of engines.

A generator turns prompt texts into ``n`` sampled completions each::

    generator.generate(texts: list[str], n: int, seeds: list[int]) -> list[list[Completion]]

``texts[i]`` is the full text the model continues (rendered prompt + response prefix, special tokens of a
chat template included: tokenised without adding special tokens). ``seeds[i]`` seeds the samples of
``texts[i]``: vLLM and the scripted generator honour it per text, so results do not depend on batching; the
transformers back end seeds each micro-batch from the seeds in it (reproducible for the same batches).
Completions are returned in input order; a completion ends at an EOS token (``finished=True``, the EOS is not
part of ``text``) or at ``max_new_tokens`` (``finished=False``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

from verl_prm.special_tokens import ensure_pad_token, policy_eos_token_ids

__all__ = [
    "Completion",
    "Generator",
    "HFGenerator",
    "VLLMGenerator",
    "RayGeneratorPool",
    "derive_seed",
    "trim_at_eos",
]


@dataclass(frozen=True)
class Completion:
    """One sampled continuation: its text, whether it ended at EOS, and its number of generated tokens."""

    text: str
    finished: bool
    num_tokens: int


@runtime_checkable
class Generator(Protocol):
    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        """``len(texts)`` lists of ``n`` completions each, in input order."""
        ...


def derive_seed(*parts: object) -> int:
    """A 31-bit seed from any parts (run seed, prompt index, rollout, step, purpose); stable across runs."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def trim_at_eos(token_ids: Sequence[int], eos_token_ids: set[int], pad_token_id: int | None) -> tuple[list[int], bool]:
    """Generated ids -> (ids before the first EOS, ended at EOS).

    ``generate`` pads sequences that stopped early with ``pad_token_id``; those only appear after an EOS, so
    cutting at the first EOS drops them. Without an EOS the sequence hit ``max_new_tokens``: trailing pads
    can then only be real pad tokens the model sampled, and they are kept.
    """
    ids = list(token_ids)
    for position, token in enumerate(ids):
        if token in eos_token_ids:
            return ids[:position], True
    return ids, False


class HFGenerator:
    """Sampling with a Hugging Face causal LM: batched, left padded, temperature/top-p, stops at EOS.

    Args:
        model: a ``PreTrainedModel`` with a LM head (on its device, eval mode is set here).
        tokenizer: its tokenizer (one without a pad token gets one: ``ensure_pad_token``); responses end at
            ``policy_eos_token_ids`` (the tokenizer's EOS and the generation config's).
        max_new_tokens: cap on generated tokens per completion.
        temperature: 0 means greedy decoding (then all n completions are equal).
        top_p: nucleus sampling threshold (1.0 = off).
        batch_size: number of sequences (texts x n) per ``model.generate`` call.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_new_tokens: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch_size: int = 32,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"HFGenerator: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.batch_size = int(batch_size)
        generation = getattr(model, "generation_config", None)
        self.eos_token_ids = set(policy_eos_token_ids(tokenizer, generation, source="HFGenerator"))
        self.pad_token_id = ensure_pad_token(tokenizer, generation, source="HFGenerator")

    @classmethod
    def from_pretrained(cls, path: str, *, device: str | None = None, dtype: str = "auto", **kwargs) -> "HFGenerator":
        """Load a causal LM and its tokenizer from a local Hugging Face directory."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        if torch_dtype == "auto" and device == "cpu":
            torch_dtype = torch.float32  # bf16 matmuls are slow on most CPUs
        from verl_prm.checkpoints import from_pretrained_kwargs, resolve_checkpoint

        path = resolve_checkpoint(path, "policy")  # no such directory / no weights / pickle-only: named errors
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **from_pretrained_kwargs()).to(device)
        return cls(model, tokenizer, **kwargs)

    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        import torch

        if len(seeds) != len(texts):
            raise ValueError(f"HFGenerator.generate: {len(texts)} texts but {len(seeds)} seeds")
        if n < 1:
            raise ValueError(f"HFGenerator.generate: n must be >= 1, got {n}")
        # Expand to one sequence per sample; long and short texts are batched in input order (callers group
        # prefixes of the same rollout together, so lengths within a batch are similar).
        flat = [(i, text) for i, text in enumerate(texts) for _ in range(n)]
        results: list[list[Completion]] = [[] for _ in texts]
        device = next(self.model.parameters()).device
        saved_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        try:
            for begin in range(0, len(flat), self.batch_size):
                chunk = flat[begin : begin + self.batch_size]
                encoded = self.tokenizer(
                    [text for _, text in chunk], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(device)
                batch_seed = derive_seed(*(seeds[i] for i, _ in chunk), begin)
                torch.manual_seed(batch_seed)
                sampling = dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0)
                if self.temperature <= 0:
                    sampling = dict(do_sample=False)
                with torch.inference_mode():
                    output = self.model.generate(
                        **encoded,
                        max_new_tokens=self.max_new_tokens,
                        pad_token_id=self.pad_token_id,
                        eos_token_id=sorted(self.eos_token_ids),
                        **sampling,
                    )
                generated = output[:, encoded["input_ids"].shape[1] :].tolist()
                for (i, _), ids in zip(chunk, generated):
                    kept, finished = trim_at_eos(ids, self.eos_token_ids, self.pad_token_id)
                    text = self.tokenizer.decode(kept, skip_special_tokens=True)
                    results[i].append(Completion(text=text, finished=finished, num_tokens=len(kept) + finished))
        finally:
            self.tokenizer.padding_side = saved_side
        return results


class VLLMGenerator:
    """Sampling with vLLM (GPU): continuous batching, and prefix caching so that the n_mc continuations of
    every prefix of a rollout reuse the KV cache of the shared prompt and steps.

    vLLM is optional; it is imported when this class is constructed.
    """

    def __init__(
        self,
        model: str,
        *,
        max_new_tokens: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        try:
            import vllm
        except ImportError as error:
            raise ImportError(
                "the vLLM back end needs the optional package vllm (GPU only): `pip install 'verl-prm[gpu]'` or "
                "`pip install vllm`; on CPU use --backend hf"
            ) from error
        self._vllm = vllm
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        kwargs = dict(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            enable_prefix_caching=enable_prefix_caching,
            trust_remote_code=False,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.llm = vllm.LLM(**kwargs)

    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        if len(seeds) != len(texts):
            raise ValueError(f"VLLMGenerator.generate: {len(texts)} texts but {len(seeds)} seeds")
        params = [
            self._vllm.SamplingParams(
                n=n,
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=self.max_new_tokens,
                seed=int(seed),
                skip_special_tokens=True,
            )
            for seed in seeds
        ]
        prompts = [{"prompt": text} for text in texts]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        return [
            [
                Completion(text=out.text, finished=out.finish_reason == "stop", num_tokens=len(out.token_ids))
                for out in request.outputs
            ]
            for request in outputs
        ]


class _GeneratorActor:
    """Ray actor body: builds its generator once (on the GPU Ray assigned to it) and serves requests."""

    def __init__(self, factory: Callable[[], Generator]) -> None:
        self.generator = factory()

    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        return self.generator.generate(texts, n, seeds)


class RayGeneratorPool:
    """One generator engine per GPU (or per CPU slot) as Ray actors; requests are split into contiguous
    chunks, one per engine, and the results are returned in input order.

    Args:
        factory: a picklable zero-argument callable that builds the engine inside the actor (for example
            ``functools.partial(VLLMGenerator, model_path, max_new_tokens=...)``).
        num_workers: number of engines.
        num_gpus_per_worker: GPUs Ray reserves for each engine (Ray sets CUDA_VISIBLE_DEVICES); 0 on CPU.
        num_cpus_per_worker: CPUs Ray reserves for each engine.
    """

    def __init__(
        self,
        factory: Callable[[], Generator],
        num_workers: int,
        *,
        num_gpus_per_worker: float = 1.0,
        num_cpus_per_worker: float = 1.0,
    ) -> None:
        import ray

        if num_workers < 1:
            raise ValueError(f"RayGeneratorPool: num_workers must be >= 1, got {num_workers}")
        if not ray.is_initialized():
            ray.init()
        actor_class = ray.remote(num_gpus=num_gpus_per_worker, num_cpus=num_cpus_per_worker)(_GeneratorActor)
        self._ray = ray
        self.actors = [actor_class.remote(factory) for _ in range(num_workers)]

    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        if len(seeds) != len(texts):
            raise ValueError(f"RayGeneratorPool.generate: {len(texts)} texts but {len(seeds)} seeds")
        if not texts:
            return []
        chunk = math.ceil(len(texts) / len(self.actors))
        refs = [
            actor.generate.remote(list(texts[begin : begin + chunk]), n, list(seeds[begin : begin + chunk]))
            for actor, begin in zip(self.actors, range(0, len(texts), chunk))
        ]
        results: list[list[Completion]] = []
        for part in self._ray.get(refs):
            results.extend(part)
        return results

    def shutdown(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors = []

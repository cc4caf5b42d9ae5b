"""Text generators behind one interface: vLLM, a Ray pool of engines, and Hugging Face transformers
(``verl_prm.labeling.hf_generator``: it imports torch, which `verl-prm label --help` does not load).

A generator turns prompt texts into ``n`` sampled completions each::

    generator.generate(texts: list[str], n: int, seeds: list[int]) -> list[list[Completion]]

``texts[i]`` is the full text the model continues (rendered prompt + response prefix, special tokens of a
chat template included: tokenised without adding special tokens). ``seeds[i]`` seeds the samples of
``texts[i]``: every back end honours it per text, so results do not depend on batching.
Completions are returned in input order; a completion ends at an EOS token (``finished=True``, the EOS is not
part of ``text``) or at ``max_new_tokens`` (``finished=False``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

__all__ = [
    "Completion",
    "Generator",
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

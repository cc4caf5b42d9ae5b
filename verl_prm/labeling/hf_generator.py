"""The Hugging Face back end of the labeler's generators (``verl_prm.labeling.generators``): a causal LM on
:class:`verl_prm.generation.GenerationEngine`. Apart from the other back ends because it imports torch and
transformers, which `verl-prm label --help` does not load."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_prm.checkpoints import from_pretrained_kwargs, resolve_checkpoint
from verl_prm.generation import GenerationEngine, GenerationRequest
from verl_prm.labeling.generators import Completion, derive_seed, trim_at_eos
from verl_prm.precision import resolve_dtype
from verl_prm.special_tokens import ensure_pad_token, policy_eos_token_ids

__all__ = ["HFGenerator"]


class HFGenerator:
    """Sampling with a Hugging Face causal LM through :class:`verl_prm.generation.GenerationEngine`: bfloat16
    where the CPU has native bf16 instructions, a static cache, shared prefixes computed once (the ``n``
    samples of a text, and every step prefix of a rollout the engine generated before), stops at EOS.

    Args:
        model: a ``PreTrainedModel`` with a LM head, on its device and in the dtype to compute in.
        tokenizer: its tokenizer (one without a pad token gets one: ``ensure_pad_token``); responses end at
            ``policy_eos_token_ids`` (the tokenizer's EOS and the generation config's).
        max_new_tokens: cap on generated tokens per completion.
        temperature: 0 means greedy decoding (then all n completions are equal).
        top_p: nucleus sampling threshold (1.0 = off).
        batch_size: number of sequences (texts x n) decoded together.
        prefix_cache_tokens: tokens of earlier sequences kept for prefix reuse (0: off).

    Sample ``j`` of ``texts[i]`` is seeded by ``derive_seed(seeds[i], j)``: the same completions whichever
    batch it shares.
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
        prefix_cache_tokens: int = 32768,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"HFGenerator: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        generation = getattr(model, "generation_config", None)
        self.eos_token_ids = set(policy_eos_token_ids(tokenizer, generation, source="HFGenerator"))
        self.pad_token_id = ensure_pad_token(tokenizer, generation, source="HFGenerator")
        self.engine = GenerationEngine(model, eos_token_ids=sorted(self.eos_token_ids), max_batch_size=int(batch_size),
                                       prefix_cache_tokens=int(prefix_cache_tokens))
        self.model = self.engine.model

    @classmethod
    def from_pretrained(cls, path: str, *, device: str | None = None, dtype: str = "auto", **kwargs) -> "HFGenerator":
        """Load a causal LM and its tokenizer from a local Hugging Face directory; ``dtype`` is a precision of
        ``verl_prm.generation.resolve_dtype`` ("auto": bfloat16 where the CPU has native bf16 instructions)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = resolve_dtype(dtype, device)
        path = resolve_checkpoint(path, "policy")  # no such directory / no weights / pickle-only: named errors
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **from_pretrained_kwargs()).to(device)
        return cls(model, tokenizer, **kwargs)

    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        if len(seeds) != len(texts):
            raise ValueError(f"HFGenerator.generate: {len(texts)} texts but {len(seeds)} seeds")
        if n < 1:
            raise ValueError(f"HFGenerator.generate: n must be >= 1, got {n}")
        encoded = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        for i, ids in enumerate(encoded):
            if not ids:
                raise ValueError(f"HFGenerator.generate: text {i} encodes to no token ({texts[i][:60]!r})")
        greedy = self.temperature <= 0
        requests = [
            GenerationRequest(ids, max_tokens=self.max_new_tokens, temperature=max(self.temperature, 0.0),
                              top_p=self.top_p, seed=derive_seed(seeds[i], j))
            for i, ids in enumerate(encoded) for j in range(1 if greedy else n)
        ]
        outputs = iter(self.engine.generate(requests))
        results: list[list[Completion]] = []
        for _ in texts:
            samples = [next(outputs)] if greedy else [next(outputs) for _ in range(n)]
            completions = []
            for output in samples:
                kept, finished = trim_at_eos(output.token_ids, self.eos_token_ids, self.pad_token_id)
                text = self.tokenizer.decode(kept, skip_special_tokens=True)
                completions.append(Completion(text=text, finished=finished, num_tokens=len(kept) + finished))
            results.append(completions * n if greedy else completions)
        return results

"""Next-token sampling, row by row settings, in float32: the pure functions the engine calls each decode step.

Each row of a batch carries its own temperature, top-k and top-p, applied in the order and with the semantics
of transformers' ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper`` (and vLLM's sampler):

- temperature t > 0: ``logits / t``; t = 0 is greedy (the arg-max of the raw logits);
- top-k k > 0: keep the tokens whose logit is >= the k-th largest (ties at the threshold kept); k <= 0 is off;
- top-p p < 1: sort ascending, drop the tokens whose cumulative probability is <= 1 - p, always keep the most
  probable one; p = 1 is off.

A token is then drawn from ``p = softmax(warped logits)`` by inversion: with ``C_v = p_1 + ... + p_v`` (float64)
and one ``U ~ U[0, 1)`` per row, the token is the first ``v`` with ``C_v > U * C_V``, which is ``v`` with
probability ``p_v`` exactly (up to float32 ``p``), and never a removed token (``p_v = 0`` adds nothing to ``C``). The
exponential race (``argmax_v p_v / E_v``) is exact too but needs a random number per vocabulary entry: 49,152 of them
per row and step for SmolLM2, a fifth of a bf16 decode step on the CPU. ``U`` comes from the row's own
``torch.Generator`` when it has one, so a seeded request draws the same tokens whichever batch it shares.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["sample_next_tokens", "sampled_log_probs", "warp_logits"]


def warp_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[B, V]`` -> warped logits ``[B, V]`` (removed tokens at ``-inf``), per-row settings ``[B]``.

    Rows with temperature 0 are returned divided by 1 (their token is the raw arg-max anyway).
    """
    logits = logits.float()
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits.dtype)
    warped = logits / scale[:, None]
    vocabulary = warped.shape[-1]
    k = top_k.clamp(max=vocabulary)
    if bool((k > 0).any()):
        largest = torch.topk(warped, int(k.max()), dim=-1).values                  # [B, kmax], descending
        threshold = largest.gather(-1, (k.clamp(min=1) - 1)[:, None])              # the k-th largest
        remove = (warped < threshold) & (k > 0)[:, None]
        warped = warped.masked_fill(remove, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, sorted_indices = torch.sort(warped, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p.to(cumulative.dtype))[:, None]
        remove_sorted[:, -1] = False                                               # keep the most probable
        remove_sorted &= (top_p < 1)[:, None]
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        warped = warped.masked_fill(remove, float("-inf"))
    return warped


def sample_next_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row ``[B]`` (long) from raw logits ``[B, V]`` under each row's settings (module docstring)."""
    logits = logits.float()
    greedy = temperature <= 0
    if bool(greedy.all()):
        return torch.argmax(logits, dim=-1)
    warped = warp_logits(logits, temperature, top_k, top_p)
    uniform = torch.empty(warped.shape[0], dtype=torch.float64, device=warped.device)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=warped.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(1, generator=generator, dtype=torch.float64, device=warped.device)[0]
    cumulative = torch.softmax(warped, dim=-1).double().cumsum_(dim=-1)           # C_v, [B, V]
    threshold = uniform * cumulative[:, -1]
    sampled = torch.searchsorted(cumulative, threshold[:, None], right=True).squeeze(-1)
    sampled = sampled.clamp_(max=warped.shape[-1] - 1)  # U * C_V < C_V: only rounding could reach past the end
    if not bool(greedy.any()):
        return sampled
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def sampled_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(raw logits)[token]`` per row ``[B]``: the rollout log-probabilities verl compares with the
    actor's (taken before the sampling warpers, as vLLM reports them by default)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)

"""Training math of a PAV: soft-label cross-entropy at step ends, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["gather_step_logits", "soft_label_bce", "warmup_cosine_factor"]


def gather_step_logits(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits at the labelled positions of each sequence.

    Args:
        logits: [B, T] (or [B, T, 1]) per-token logits of the value head.
        positions: [B, S] token index of each labelled step's last token; padding entries may hold any index
            in [0, T) (they are masked by the caller).
    Returns:
        [B, S] logits.
    """
    if logits.dim() == 3:
        if logits.shape[-1] != 1:
            raise ValueError(f"gather_step_logits: expected one logit per token, got {logits.shape[-1]}")
        logits = logits[..., 0]
    return torch.gather(logits, 1, positions)


def soft_label_bce(step_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of sigmoid(logit) against soft labels q, averaged over the labelled steps:

        L = - sum_{b,s} m_bs [ q_bs log sigmoid(z_bs) + (1 - q_bs) log(1 - sigmoid(z_bs)) ] / sum_{b,s} m_bs

    Minimised at sigmoid(z) = q (the Monte-Carlo value), so the critic regresses Q in the calibrated sense.

    Args:
        step_logits, targets: any shape (e.g. [B, S]); mask: the same shape, booleans (True = a labelled step)
            or non-negative weights (e.g. class-balancing weights).
    Returns:
        scalar loss (0 when nothing is labelled, still attached to the graph).
    """
    mask = mask.to(torch.float32)
    per_step = F.binary_cross_entropy_with_logits(step_logits.float(), targets.float(), reduction="none")
    return (per_step * mask).sum() / mask.sum().clamp_min(torch.finfo(torch.float32).tiny)


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to ``min_ratio``.

        f(t) = (t + 1) / W                                           for t < W
             = r + (1 - r) * (1 + cos(pi * (t - W) / max(1, T - W))) / 2   for W <= t < T
             = r                                                     for t >= T

    ``t`` is the number of optimizer steps taken before this one (0-based).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

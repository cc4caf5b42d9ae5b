"""The ``pav/*`` metrics of one batch, the same names and meaning in verl's trainer hook and in TRL."""

from __future__ import annotations

import torch

from verl_prm.advantages import best_of_k, valid_steps

__all__ = ["pav_metrics"]


def pav_metrics(scores: torch.Tensor, prompt_values: torch.Tensor, num_steps: torch.Tensor, truncated: torch.Tensor,
                best_of_k_k: int, critic_seconds: float) -> dict[str, float]:
    """The per-batch ``pav/*`` metrics of the responses given (the caller leaves padding rows out).

    ``scores`` [B, S] are the process scores p_h the estimator adds (times alpha) to the tokens of step h
    (``verl_prm.advantages.process_scores``: progress of the Best-of-K values, clipped, normalised as configured),
    ``prompt_values`` [B] the prover's raw values of the prompts, ``num_steps`` [B], ``truncated`` [B] bool.

    - ``pav/steps_per_response``: mean H;  ``pav/zero_step_share``: share of responses with H = 0;
    - ``pav/process_term/mean`` and ``/std``: of p over all real steps;
    - ``pav/v0_mean``: mean prover value of the prompt after Best-of-K; ``pav/critic_seconds``;
    - ``pav/truncated_share``: share of responses without EOS.

    Every metric is 0 for an empty batch (and the std with fewer than two real steps).
    """
    real_steps = scores[valid_steps(num_steps, scores.shape[1])]
    count = len(num_steps)
    return {
        "pav/steps_per_response": num_steps.float().mean().item() if count else 0.0,
        "pav/zero_step_share": (num_steps == 0).float().mean().item() if count else 0.0,
        "pav/process_term/mean": real_steps.mean().item() if real_steps.numel() else 0.0,
        "pav/process_term/std": real_steps.std().item() if real_steps.numel() > 1 else 0.0,
        "pav/v0_mean": best_of_k(prompt_values.float(), best_of_k_k).mean().item() if count else 0.0,
        "pav/critic_seconds": float(critic_seconds),
        "pav/truncated_share": truncated.float().mean().item() if count else 0.0,
    }

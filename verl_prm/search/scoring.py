"""Pure scoring rules of the searches: the beam score ``Q + alpha * A``, greedy acceptance, top-k per group,
and best-of-N ranking scores."""

from __future__ import annotations

from typing import Literal

import torch

from verl_prm.advantages import aggregate_step_scores, best_of_k, step_progress

Rank = Literal["orm", "min", "max", "mean", "sum", "product", "last"]


def beam_scores(
    q_values: torch.Tensor,
    prover_values: torch.Tensor | None,
    parent_prover_values: torch.Tensor | None,
    alpha: float,
    best_of_k_k: int = 1,
) -> torch.Tensor:
    """The PAV paper's beam score (its Eq. 5 at test time): ``Q^pi(s, a) + alpha * A^mu(s, a)``.

    ``A^mu = BoK(v^mu(s, a)) - BoK(v^mu(s))`` with ``BoK(v) = 1 - (1 - v)^K`` (``best_of_k``): the progress
    of the candidate step under the (Best-of-K) prover. ``alpha = 0`` ranks by Q alone (beam on Q).

    Args:
        q_values: [C] Q^pi of each candidate (the base policy's value critic after the step).
        prover_values: [C] prover value after the step; parent_prover_values: [C] before it.
        alpha: weight of the progress.
        best_of_k_k: K of the Best-of-K prover (1: the critic's values as they are).

    Returns:
        [C] scores.
    """
    if alpha == 0:
        return q_values
    if prover_values is None or parent_prover_values is None:
        raise ValueError("beam_scores: alpha != 0 needs prover values of the candidates and of their parents")
    progress = best_of_k(prover_values, best_of_k_k) - best_of_k(parent_prover_values, best_of_k_k)
    return q_values + alpha * progress


def step_accepted(
    values: torch.Tensor,
    parent_values: torch.Tensor,
    threshold: float,
    accept_on: Literal["value", "progress"] = "value",
    best_of_k_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy step search's test: a step is accepted iff its score >= ``threshold``.

    The score is ``BoK(v(s, a))`` (``accept_on="value"``, Ma et al.'s PRM score) or the progress
    ``BoK(v(s, a)) - BoK(v(s))`` (``"progress"``, the PAV reading).

    Returns:
        ``(accepted [C] bool, scores [C])``.
    """
    values = best_of_k(values, best_of_k_k)
    if accept_on == "value":
        scores = values
    elif accept_on == "progress":
        scores = values - best_of_k(parent_values, best_of_k_k)
    else:
        raise ValueError(f"accept_on must be 'value' or 'progress', got {accept_on!r}")
    return scores >= threshold, scores


def top_per_group(scores: torch.Tensor, groups: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores within each group (ties: earlier index first), groups in order.

    Args:
        scores: [C]; groups: [C] int group id (e.g. the problem); k: how many to keep per group.

    Returns:
        1-D int64 indices into ``scores``, sorted by group then by descending score.
    """
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    # Sort by (group, -score, index): a stable sort on score, then a stable sort on group.
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(groups[by_score], stable=True).indices]
    sorted_groups = groups[order]
    first_of_group = torch.ones_like(sorted_groups, dtype=torch.bool)
    first_of_group[1:] = sorted_groups[1:] != sorted_groups[:-1]
    starts = torch.cummax(torch.where(first_of_group, torch.arange(len(order)), torch.zeros_like(order)), 0).values
    rank = torch.arange(len(order)) - starts
    return order[rank < k]

def response_scores(
    prompt_values: torch.Tensor,
    step_values: torch.Tensor,
    num_steps: torch.Tensor,
    rank: Rank,
    scores: Literal["values", "progress"] = "values",
    best_of_k_k: int = 1,
) -> torch.Tensor:
    """One ranking score per response.

    ``v = BoK(values)``; ``rank="orm"``: ``v_H`` (``v_0`` for a response without steps: the verifier's value
    of the bare prompt); otherwise ``aggregate_step_scores(s, num_steps, rank)`` with ``s = v`` or
    ``s = step_progress(v, v_0)``.

    Args:
        prompt_values: [B]; step_values: [B, S]; num_steps: [B].

    Returns:
        [B] scores.
    """
    values = best_of_k(step_values, best_of_k_k)
    prompt = best_of_k(prompt_values, best_of_k_k)
    if rank == "orm":
        last = aggregate_step_scores(values, num_steps, "last")
        return torch.where(num_steps > 0, last, prompt)
    step_scores = values if scores == "values" else step_progress(values, prompt, num_steps)
    return aggregate_step_scores(step_scores, num_steps, rank)

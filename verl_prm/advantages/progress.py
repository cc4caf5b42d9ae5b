"""Progress and the effective reward (PAV paper Eq. 5): the Best-of-K prover's values, the process scores of
each step, the token advantages, and the aggregation of step scores into one score per response. Shapes as in
:mod:`verl_prm.advantages`.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_prm.advantages.contract import KEEP_ARGUMENT, check_finite_argument, check_per_response, valid_steps
from verl_prm.advantages.fused import lookup, masked_lookup
from verl_prm.choices import AGGREGATIONS, COMPILE_MODES, Aggregation


MIN_NORMALIZE_STD = 1e-3


def best_of_k(q: torch.Tensor, k: int) -> torch.Tensor:
    """Value of the Best-of-K policy of a prover whose value is ``q``: ``1 - (1 - q)^k``.

    The Best-of-K policy of pi_b succeeds if any of K independent samples of pi_b succeeds, so a critic trained
    on Monte-Carlo labels of pi_b gives the BoK prover's value through this transform (PAV paper, Sec. 4; its
    best provers were Bo4). ``k = 1`` returns ``q`` unchanged.

    This is the one description of Best-of-K; every setting of it refers here. It must be applied once to a
    critic's raw values: the estimators and the search apply it (``algorithm.pav.best_of_k``, ``--best-of-k``), so
    a critic that already gives Best-of-K values keeps K = 1 there: one loaded with
    ``ProverCritic(best_of_k=K)``, or one trained by ``verl-prm train --best-of-k K`` (whose labels were
    transformed from their counts, ``verl_prm.labeling.format.best_of_k_from_counts``). The verl hook therefore
    loads its critic with K = 1, and the TRL trainer refuses a critic and ``pav.best_of_k`` that both apply it.

    Args:
        q: values in [0, 1], any shape.
        k: integer >= 1.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"best_of_k: k must be an integer >= 1, got {k!r}")
    if k == 1:
        return q
    return 1.0 - _integer_power(1.0 - q, int(k))


def _integer_power(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x ** k`` for an integer ``k >= 1`` by repeated squaring: log2(k) multiplies (``torch.pow`` with an integer
    exponent above 3 runs a scalar loop on CPU, measured ~20x a multiply on a [2048, 32] tensor)."""
    result = None
    while True:
        if k & 1:
            result = x if result is None else result * x
        k >>= 1
        if not k:
            return result
        x = x * x


def step_progress(step_values: torch.Tensor, prompt_values: torch.Tensor, num_steps: torch.Tensor) -> torch.Tensor:
    """Process advantage (progress) of each step: ``A_h = v_h - v_{h-1}`` with ``v_{-1} = prompt_values``.

    Indices are 0-based: ``A[i, 0] = step_values[i, 0] - prompt_values[i]``. The sum over the H real steps
    telescopes to ``v_{H-1} - v_0``. Entries at ``h >= num_steps[i]`` are 0 (whatever ``step_values`` holds
    there, NaN included).

    Args:
        step_values: [B, S] prover values after each step.
        prompt_values: [B] prover value of the prompt.
        num_steps: [B] number of real steps per response.

    Returns:
        [B, S] progress, 0 outside the real steps.
    """
    previous = torch.cat([prompt_values[:, None].to(step_values.dtype), step_values[:, :-1]], dim=1)
    progress = step_values - previous
    return torch.where(valid_steps(num_steps, step_values.shape[1]), progress, torch.zeros_like(progress))


def step_scores_per_token(step_scores: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """Broadcast per-step scores to the tokens of each step: ``out[i, t] = step_scores[i, step_ids[i, t]]``.

    Tokens in no step (``step_ids == -1``) get 0. ``step_ids`` must lie in [-1, S - 1]; an id outside is clamped
    into it (it reads its own row, never another response's).

    Args:
        step_scores: [B, S] one score per step.
        step_ids: [B, T] step of each token, -1 for none.

    Returns:
        [B, T] score of the step each token belongs to.
    """
    return lookup(torch.nn.functional.pad(step_scores, (1, 0)), step_ids)


def process_scores(
    step_values: torch.Tensor,
    prompt_values: torch.Tensor,
    num_steps: torch.Tensor,
    *,
    best_of_k_k: int = 1,
    use_values: bool = False,
    clip: float | None = None,
    normalize: bool = False,
    keep: torch.Tensor | None = None,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Per-step process scores: progress of the (Best-of-K transformed) prover values, with the safeguards.

    In order:
      1. ``v = best_of_k(step_values, K)``, ``v_0 = best_of_k(prompt_values, K)``;
      2. ``p_h = v_h - v_{h-1}`` (``step_progress``), or ``p_h = v_h`` when ``use_values`` (the reward-hackable
         Q-as-reward ablation of the paper's App. G);
      3. ``clip``: ``p_h <- clamp(p_h, -clip, clip)``;
      4. ``keep`` [B] bool: responses where it is False get no process score (e.g. truncated responses);
      5. ``normalize``: ``p_h <- p_h / (std + epsilon)``, std the unbiased std of p over the real steps of the
         kept responses in the batch; left unscaled when there are fewer than two such steps or
         ``std < MIN_NORMALIZE_STD`` (a constant term has no scale, and dividing by ~0 would blow it up).

    Returns:
        [B, S] scores, 0 at ``h >= num_steps`` and for responses not kept.
    """
    values = best_of_k(step_values, best_of_k_k)
    if use_values:
        valid = valid_steps(num_steps, values.shape[1])
        scores = torch.where(valid, values, torch.zeros_like(values))
    else:
        scores = step_progress(values, best_of_k(prompt_values, best_of_k_k), num_steps)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    if keep is not None:
        check_per_response(keep, scores.shape[0], KEEP_ARGUMENT)
        scores = scores * keep[:, None].to(scores.dtype)
    if normalize:
        counted = valid_steps(num_steps, scores.shape[1])
        if keep is not None:
            counted = counted & keep[:, None].bool()
        counted = counted.to(scores.dtype)
        n = counted.sum()
        mean = (scores * counted).sum() / n.clamp_min(1)
        variance = (((scores - mean) * counted) ** 2).sum() / (n - 1).clamp_min(1)
        std = torch.sqrt(variance)
        # A (nearly) constant process term has no scale to normalise: dividing by ~0 would blow it up.
        usable = (n > 1) & (std >= MIN_NORMALIZE_STD)
        scores = scores / torch.where(usable, std + epsilon, torch.ones_like(std))
    return scores


def process_advantage(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    compile: str = "auto",
) -> torch.Tensor:
    """Token advantages of the effective reward (PAV paper Eq. 5).

    ``adv[i, t] = (out_i + alpha * p_{i, step_ids[i, t]}) * response_mask[i, t]``, where tokens in no step
    (``step_ids = -1``) get ``out_i * response_mask[i, t]``. The process score of step h enters only the tokens
    of step h; it is not summed into a return over later steps.

    Args:
        outcome_advantage: [B] out_i (GRPO, RLOO or batch-baseline outcome advantage).
        step_scores: [B, S] process score of each step (``process_scores``).
        step_ids: [B, T]; response_mask: [B, T].
        alpha: weight of the process term.
        compile: how the per-token lookup runs. ``"never"``: eager PyTorch (five passes over [B, T]).
            ``"always"``: one fused kernel: on a CPU with AVX-512 the C kernel of ``verl_prm.advantages.native``
            (built once per machine; needs a C compiler), elsewhere ``torch.compile`` (compiled once per process
            and input dtypes; a C++ compiler on CPU, Triton on GPU). ``"auto"``: the fused kernel for batches of
            at least ``verl_prm.advantages.fused.FUSED_MIN_TOKENS`` tokens, eager below; if the build fails it
            warns once and stays eager.
            All three give the same numbers.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    return process_advantage_and_bad_rows(outcome_advantage, step_scores, step_ids, response_mask, alpha,
                                          compile=compile)[0]


def process_advantage_and_bad_rows(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    checked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    compile: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``process_advantage``, and with ``checked = (step_values, prompt_values, num_steps, outcome_rewards)`` the
    responses that break the tensor contract (``bad_input_rows``).

    Returns ``(advantages [B, T], bad_rows [B] bool or None)``. The fused kernel computes the flags in the pass
    that reads ``step_ids`` for the lookup, so the estimators' input check costs no pass of its own and no extra
    small kernels (``check_step_inputs(bad_rows=...)``); the eager path computes them with ``bad_input_rows``.
    Without ``checked`` the fused kernel computes no flags.
    """
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    check_finite_argument("alpha", alpha)
    # Column 0 of the table is the "no step" entry: out_i alone.
    table = torch.add(outcome_advantage[:, None], torch.nn.functional.pad(step_scores, (1, 0)), alpha=alpha)
    table = table.to(outcome_advantage.dtype)
    return masked_lookup(table, step_ids, response_mask, checked, compile)


def aggregate_step_scores(step_scores: torch.Tensor, num_steps: torch.Tensor, how: Aggregation) -> torch.Tensor:
    """One score per response from its step scores (Pan et al. 2023's aggregation functions).

    Over the real steps h < H of response i: ``min``, ``max``, ``mean``, ``sum``, ``product`` or ``last``
    (the score of step H-1). A response with no steps gets 0 for every aggregation (no process evidence).

    Args:
        step_scores: [B, S]; num_steps: [B]; how: one of ``AGGREGATIONS``.

    Returns:
        [B] aggregated score.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    batch, max_steps = step_scores.shape
    zeros = step_scores.new_zeros(batch)
    if max_steps == 0:
        return zeros
    valid = valid_steps(num_steps, max_steps)
    if how in ("sum", "mean"):
        total = torch.where(valid, step_scores, torch.zeros_like(step_scores)).sum(dim=1)
        result = total if how == "sum" else total / num_steps.clamp_min(1).to(step_scores.dtype)
    elif how == "min":
        result = torch.where(valid, step_scores, torch.full_like(step_scores, float("inf"))).amin(dim=1)
    elif how == "max":
        result = torch.where(valid, step_scores, torch.full_like(step_scores, float("-inf"))).amax(dim=1)
    elif how == "product":
        result = torch.where(valid, step_scores, torch.ones_like(step_scores)).prod(dim=1)
    else:  # last
        last = (num_steps - 1).clamp(min=0, max=max_steps - 1)
        result = torch.gather(step_scores, 1, last[:, None].long()).squeeze(1)
    return torch.where(num_steps > 0, result, zeros)

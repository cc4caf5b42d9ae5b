"""Credit assignment of the anchors: PURE's min-form (Cheng et al. 2025) and PRIME's leave-one-out process
returns (Cui et al. 2025), over the process scores p [B, S] of
:func:`~verl_prm.advantages.progress.process_scores`. Both place step h's reward at the last token of step h and
sum rewards over later tokens (returns, gamma = 1), unlike ``process_advantage``, whose process term of step h
enters only the tokens of step h. Shapes as in :mod:`verl_prm.advantages`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from verl_prm.advantages.contract import KEEP_ARGUMENT, check_finite_argument, check_per_response, valid_steps
from verl_prm.advantages.outcome import group_sums
from verl_prm.choices import MIN_FORM_BASELINES, PRIME_REWARD_MASKS

# Smallest positive softmin temperature: the logits -p/T stay finite in float32 (max 3.4e38) for |p| <= 1000, the
# bound of the estimators' process scores (progress or values in [-1, 1], divided by a std >= 1e-3 when
# pav.normalize is on): 1000 / 1e-30 = 1e33.
MIN_SOFTMIN_TEMPERATURE = 1e-30


def step_end_positions(step_ids: torch.Tensor, max_steps: int) -> torch.Tensor:
    """Position of the last token of each step: ``ends[i, h] = max{t : step_ids[i, t] = h}``, -1 for a step with
    no token (and for h >= H). Exact when a step's tokens are interrupted by tokens in no step. Ids outside
    ``[-1, S-1]`` are clamped into it (they pass unchecked only with ``check_inputs=false``).

    Args:
        step_ids: [B, T] step of each token, -1 for none; max_steps: S.

    Returns:
        [B, S] int64.
    """
    batch, length = step_ids.shape
    positions = torch.arange(length, device=step_ids.device).expand(batch, length)
    # column 0 collects the tokens in no step (-1) and is dropped
    ends = torch.full((batch, max_steps + 1), -1, dtype=torch.long, device=step_ids.device)
    # ids outside [-1, S-1] (possible only with check_inputs=false) are clamped, as in process_advantage: a bad
    # id then lands in its own row, never out of bounds
    columns = step_ids.long().clamp(-1, max_steps - 1) + 1
    ends = ends.scatter_reduce(1, columns, positions, reduce="amax", include_self=True)
    return ends[:, 1:]


def step_end_rewards(step_rewards: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """Token rewards ``d[i, t] = step_rewards[i, h]`` at the last token t of step h (``step_end_positions``), 0
    elsewhere: [B, T]. A step with no token has nowhere to go (``verl_prm.steps.split_steps`` makes none)."""
    ends = step_end_positions(step_ids, step_rewards.shape[1])
    has_token = ends >= 0
    rewards = torch.zeros(step_ids.shape, dtype=step_rewards.dtype, device=step_rewards.device)
    placed = torch.where(has_token, step_rewards, torch.zeros_like(step_rewards))
    return rewards.scatter_add_(1, ends.clamp(min=0), placed)


def rewards_to_go(token_rewards: torch.Tensor) -> torch.Tensor:
    """Undiscounted returns ``G[i, t] = sum_{t' >= t} d[i, t']`` (gamma = 1), the reverse cumulative sum: [B, T]."""
    return token_rewards.flip(1).cumsum(1).flip(1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased variance over the tokens where ``mask``
    is set (verl's ``masked_whiten``, which PRIME applies to its returns); 0 where ``mask`` is not set. With fewer
    than two such tokens there is no variance: the values are only centred."""
    weights = mask.to(values.dtype)
    count = weights.sum()
    mean = (values * weights).sum() / count.clamp_min(1)
    variance = (((values - mean) ** 2) * weights).sum() / (count - 1).clamp_min(1)
    scale = torch.where(count > 1, torch.rsqrt(variance + 1e-8), torch.ones_like(variance))
    return (values - mean) * scale * weights


def check_softmin_temperature(what: str, temperature: float) -> None:
    """``temperature`` is 0 (the hard minimum) or a finite number >= ``MIN_SOFTMIN_TEMPERATURE``."""
    number = not isinstance(temperature, bool) and isinstance(temperature, (int, float, np.floating, np.integer))
    if not number or not (temperature == 0 or MIN_SOFTMIN_TEMPERATURE <= temperature < math.inf):
        raise ValueError(
            f"{what} must be 0 (the hard minimum) or a finite number >= {MIN_SOFTMIN_TEMPERATURE:g} (below it the "
            f"softmin logits -p/T overflow float32 and the weights become NaN), got {temperature!r}"
        )


def softmin_weights(step_scores: torch.Tensor, num_steps: torch.Tensor, temperature: float) -> torch.Tensor:
    """PURE's min-form weights over the real steps of each response (Cheng et al. 2025, "Stop Summation").

    ``w[i, h] = exp(-p[i, h] / T) / sum_{k < H_i} exp(-p[i, k] / T)`` for h < H_i, 0 beyond. ``T = 0`` is the
    limit T -> 0: ``w = 1/m`` on the m steps that attain ``min_h p[i, h]``, 0 elsewhere. A response with no step
    has no weights.

    The softmax runs in at least float32 (a float16 ``-p / T`` would overflow already at ``|p| / T > 65504``).

    Args:
        step_scores: [B, S] p; num_steps: [B] H; temperature: T = 0 or ``MIN_SOFTMIN_TEMPERATURE`` <= T < inf
            (PURE uses 0.1). Below the bound ``-p / T`` overflows float32 (for ``|p| <= 1000``) and the softmax
            would be NaN: a ``ValueError`` says so.

    Returns:
        [B, S] weights in the dtype of ``step_scores``; each row with H_i > 0 sums to 1.
    """
    check_softmin_temperature("temperature", temperature)
    valid = valid_steps(num_steps, step_scores.shape[1])
    zeros = torch.zeros_like(step_scores)
    if step_scores.shape[1] == 0:
        return zeros
    if temperature > 0:
        wide = step_scores.to(torch.promote_types(step_scores.dtype, torch.float32))
        logits = torch.where(valid, -wide / temperature, torch.full_like(wide, float("-inf")))
        # a row without steps is NaN here and is zeroed below
        weights = torch.softmax(logits, dim=1).to(step_scores.dtype)
    else:
        masked = torch.where(valid, step_scores, torch.full_like(step_scores, float("inf")))
        at_min = valid & (masked == masked.amin(dim=1, keepdim=True))
        weights = at_min.to(step_scores.dtype) / at_min.sum(dim=1, keepdim=True).clamp_min(1).to(step_scores.dtype)
    return torch.where(valid, weights, zeros)


def min_form_step_rewards(step_scores: torch.Tensor, num_steps: torch.Tensor, temperature: float) -> torch.Tensor:
    """PURE's min-form process rewards: ``r[i, h] = w[i, h] * p[i, h]`` with ``w = softmin_weights``.

    Their sum over a response's steps is a soft minimum of its step scores (the hard minimum at ``T = 0``), so the
    return of every token is governed by the worst step instead of the sum of all steps. 0 at h >= H_i.
    """
    valid = valid_steps(num_steps, step_scores.shape[1])
    scores = torch.where(valid, step_scores, torch.zeros_like(step_scores))
    return softmin_weights(step_scores, num_steps, temperature) * scores


def _leave_one_out_counts(step_rewards, num_steps, groups, num_groups, keep):
    """Per response: its mean step reward m_i, whether it is counted (H_i > 0 and kept), and the group's count
    and sum of m over counted responses (broadcast to the response)."""
    valid = valid_steps(num_steps, step_rewards.shape[1])
    totals = torch.where(valid, step_rewards, torch.zeros_like(step_rewards)).sum(dim=1)
    means = totals / num_steps.clamp_min(1).to(step_rewards.dtype)
    counted = num_steps > 0
    if keep is not None:
        check_per_response(keep, step_rewards.shape[0], KEEP_ARGUMENT)
        counted = counted & keep.bool()
    counted_f = counted.to(step_rewards.dtype)
    group_count = group_sums(counted_f, groups, num_groups)[groups]
    group_total = group_sums(means * counted_f, groups, num_groups)[groups]
    return means, counted, counted_f, group_count, group_total


def leave_one_out_step_mean(
    step_rewards: torch.Tensor,
    num_steps: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PURE's "step" baseline: the mean, over the other responses of the same prompt, of their mean step reward.

    ``b_i = (1 / |O_i|) sum_{j in O_i} m_j`` with ``m_j = (1 / H_j) sum_{h < H_j} r[j, h]`` and O_i the responses
    of i's group other than i that have steps (and are kept, when ``keep`` [B] bool is given); ``b_i = 0`` when
    O_i is empty.

    Returns:
        [B] baseline.
    """
    means, counted, counted_f, group_count, group_total = _leave_one_out_counts(step_rewards, num_steps, groups,
                                                                               num_groups, keep)
    others = group_count - counted_f
    baseline = (group_total - means * counted_f) / others.clamp_min(1)
    return torch.where(others > 0, baseline, torch.zeros_like(baseline))


def leave_one_out_token_baseline(
    step_rewards: torch.Tensor,
    step_ids: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PURE's "token" baseline (its README's fix of the "step" baseline, its training script's choice): the
    other responses' process reward per token, times the tokens of the step.

    ``b[i, h] = n[i, h] * (sum_{j in O_i} R_j) / (sum_{j in O_i} L_j)`` with ``R_j = sum_{h < H_j} r[j, h]``,
    ``L_j`` the response tokens of j (``response_mask``), ``n[i, h]`` the response tokens of step h of i
    (``step_ids == h``) and O_i the responses of i's group other than i that have steps (and are kept, when
    ``keep`` [B] bool is given); ``b = 0`` when O_i is empty. A longer step carries a larger baseline, so writing
    fewer, longer steps earns nothing (the "step" baseline favours fewer steps).

    Returns:
        [B, S] baseline, 0 at h >= H_i.
    """
    batch, max_steps = step_rewards.shape
    valid = valid_steps(num_steps, max_steps)
    in_response = response_mask != 0
    totals = torch.where(valid, step_rewards, torch.zeros_like(step_rewards)).sum(dim=1)
    lengths = in_response.sum(dim=1).to(step_rewards.dtype)
    counted = num_steps > 0
    if keep is not None:
        check_per_response(keep, batch, KEEP_ARGUMENT)
        counted = counted & keep.bool()
    counted_f = counted.to(step_rewards.dtype)
    others_reward = group_sums(totals * counted_f, groups, num_groups)[groups] - totals * counted_f
    others_tokens = group_sums(lengths * counted_f, groups, num_groups)[groups] - lengths * counted_f
    per_token = torch.where(others_tokens > 0, others_reward / others_tokens.clamp_min(1), torch.zeros_like(totals))
    # tokens of each step; column 0 collects the tokens in no step and is dropped (ids clamped as everywhere)
    columns = step_ids.long().clamp(-1, max_steps - 1) + 1
    step_tokens = torch.zeros((batch, max_steps + 1), dtype=step_rewards.dtype, device=step_rewards.device)
    step_tokens = step_tokens.scatter_add_(1, columns, in_response.to(step_rewards.dtype))[:, 1:]
    return torch.where(valid, step_tokens * per_token[:, None], torch.zeros_like(step_rewards))


def response_end_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: the last position t with ``response_mask[i, t]`` set (the response's EOS, or its last token when
    it was cut at the length limit); ``T - 1`` for an empty row (where every advantage is 0 anyway)."""
    length = response_mask.shape[1]
    return (length - 1) - (response_mask != 0).flip(1).to(torch.uint8).argmax(dim=1)


def pure_whiten(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """PURE's advantage whitening (CJReinforce/PURE, ``replay_buffer.py`` ``normalize``, on by default there).

    With Z the response tokens whose advantage is exactly 0 (step separators, EOS when zeroed) and
    ``n = |response tokens| - |Z|``: ``mean = sum(adv) / n``, ``var = sum_{response tokens} (adv - mean)^2 / n``
    (Z left out of the count but kept in the variance, as PURE does), ``out = (adv - mean) / sqrt(max(var, 1e-8))``
    on the counted tokens, 0 on Z and outside the mask. With n = 0 everything stays 0. PURE whitens its replay
    buffer's items after removing their padding, so its n also counts response tokens only.
    """
    weights = (response_mask != 0).to(advantages.dtype)
    counted = (response_mask != 0) & (advantages != 0)
    n = counted.sum().to(advantages.dtype)
    mean = (advantages * weights).sum() / n.clamp_min(1)
    variance = (((advantages - mean) * weights) ** 2).sum() / n.clamp_min(1)
    whitened = (advantages - mean) * torch.rsqrt(variance.clamp_min(1e-8))
    return torch.where(counted, whitened, torch.zeros_like(whitened))


def min_form_advantage(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    groups: torch.Tensor,
    num_groups: int,
    temperature: float = 0.1,
    baseline: str = "token",
    zero_separators: bool = True,
    zero_eos: bool = False,
    whiten: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PURE's min-form credit assignment (Cheng et al. 2025) with the process scores p as the PRM's rewards.

    1. ``r = min_form_step_rewards(p, T)`` (softmin-weighted step rewards);
    2. ``q[i, h] = r[i, h] - b[i, h]`` for the real steps h < H_i, with b PURE's ``reward_baseline``:
       ``"token"`` (``leave_one_out_token_baseline``), ``"step"`` (``leave_one_out_step_mean``, the same for
       every step) or ``"none"`` (b = 0); ``q = 0`` for responses not in ``keep``;
    3. ``d[i, t] = q[i, h]`` at the last token t of step h (``step_end_rewards``);
    4. ``adv[i, t] = (out_i + alpha * sum_{t' >= t} d[i, t']) * response_mask[i, t]``;
    5. ``zero_separators``: ``adv[i, t] = 0`` at the last token of every step h < H_i - 1 (the token that holds
       the step delimiter; PURE gives its step-separator tokens no loss). The last step's last token is answer
       text and keeps its advantage;
    6. ``zero_eos``: ``adv = 0`` also at the response's last token (``response_end_positions``), as PURE, whose
       reward mask (which it also zeroes) includes the EOS;
    7. ``whiten``: ``adv = pure_whiten(adv, response_mask)``.

    Unchecked: NaN or inf in a tensor argument reaches the result (the estimator ``pav_pure`` checks its inputs).

    Args:
        outcome_advantage: [B] out_i (RLOO of the outcome in the ``pav_pure`` estimator, as in PURE).
        step_scores: [B, S] p; step_ids: [B, T]; num_steps: [B]; response_mask: [B, T].
        alpha: weight of the process return. groups, num_groups: prompt groups (``group_ids``).
        temperature: T of the softmin (PURE: 0.1; 0: the hard minimum; see ``softmin_weights``).
        baseline: one of ``MIN_FORM_BASELINES``.
        keep: [B] bool, responses that get a process term (and enter the baseline); default all.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    check_finite_argument("alpha", alpha)
    if baseline not in MIN_FORM_BASELINES:
        raise ValueError(f"baseline must be one of {MIN_FORM_BASELINES}, got {baseline!r}")
    valid = valid_steps(num_steps, step_scores.shape[1])
    rewards = min_form_step_rewards(step_scores, num_steps, temperature)
    if baseline == "step":
        rewards = rewards - leave_one_out_step_mean(rewards, num_steps, groups, num_groups, keep)[:, None]
    elif baseline == "token":
        rewards = rewards - leave_one_out_token_baseline(rewards, step_ids, num_steps, response_mask, groups,
                                                         num_groups, keep)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    if keep is not None:
        check_per_response(keep, rewards.shape[0], KEEP_ARGUMENT)
        rewards = rewards * keep[:, None].to(rewards.dtype)
    returns = rewards_to_go(step_end_rewards(rewards, step_ids))
    advantages = (outcome_advantage[:, None] + alpha * returns).to(outcome_advantage.dtype)
    advantages = advantages * response_mask.to(advantages.dtype)
    if zero_separators:
        advantages = advantages * (~_separator_tokens(step_ids, num_steps, step_scores.shape[1])).to(advantages.dtype)
    if zero_eos:
        advantages = advantages.scatter(1, response_end_positions(response_mask)[:, None], 0.0)
    if whiten:
        advantages = pure_whiten(advantages, response_mask)
    return advantages


def _separator_tokens(step_ids: torch.Tensor, num_steps: torch.Tensor, max_steps: int) -> torch.Tensor:
    """[B, T] bool: the last token of every step h < H_i - 1."""
    batch, length = step_ids.shape
    ends = step_end_positions(step_ids, max_steps)
    marked = (torch.arange(max_steps, device=step_ids.device)[None, :] < (num_steps[:, None] - 1)) & (ends >= 0)
    # distinct steps end at distinct tokens; unmarked steps write False into the spare column `length`
    target = torch.where(marked, ends, torch.full_like(ends, length))
    tokens = torch.zeros((batch, length + 1), dtype=torch.bool, device=step_ids.device)
    return tokens.scatter_(1, target, marked)[:, :length]


def leave_one_out_step_rewards(
    step_scores: torch.Tensor,
    num_steps: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's leave-one-out on process rewards (Cui et al. 2025, ``compute_rloo_returns``), one reward per step
    (PRIME's reward mask restricted to the step-end tokens).

    ``q[i, h] = p[i, h] * n / (n - 1) - (sum_{j in g} m_j) / (n - 1)`` for the real steps h < H_i, with
    ``m_j = (1 / H_j) sum_{h < H_j} p[j, h]`` and the sum and n over the responses j of i's group g that have
    steps (and are kept, when ``keep`` [B] bool is given). Equivalently
    ``q[i, h] = p[i, h] - (sum_{j != i} m_j + m_i - p[i, h]) / (n - 1)``. A group with n = 1 keeps ``q = p`` (no
    other response to compare with); responses not counted get ``q = 0``.

    Returns:
        [B, S] transformed step rewards, 0 at h >= H_i.
    """
    valid = valid_steps(num_steps, step_scores.shape[1])
    scores = torch.where(valid, step_scores, torch.zeros_like(step_scores))
    _, counted, _, group_count, group_total = _leave_one_out_counts(scores, num_steps, groups, num_groups, keep)
    n = group_count[:, None]
    loo = (scores * n - group_total[:, None]) / (n - 1).clamp_min(1)
    rewards = torch.where(n > 1, loo, scores)
    return torch.where(valid & counted[:, None], rewards, torch.zeros_like(rewards))


def leave_one_out_response_rewards(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's leave-one-out with its own reward mask, the whole response (``compute_rloo_returns`` with
    ``reward_mask = eos_mask``), over token rewards d [B, T] (here: the step scores at the step ends, 0 elsewhere).

    ``q[i, t] = d[i, t] * n / (n - 1) - (sum_{j in g} m_j) / (n - 1)`` at every response token t, with
    ``m_j = sum_t d[j, t] / L_j`` the mean over j's L_j response tokens and n the kept responses of the group
    with at least one token. The baseline is subtracted at every token, so a token's return carries
    ``-(tokens from t on) * baseline``: a length term PRIME's implicit PRM (a reward at every token) expects and
    step-level scores do not have. n = 1 keeps ``q = d``; responses not counted get ``q = 0``.

    Returns:
        [B, T], 0 outside ``response_mask``.
    """
    in_response = response_mask != 0
    lengths = in_response.sum(dim=1)
    rewards = torch.where(in_response, token_rewards, torch.zeros_like(token_rewards))
    means = rewards.sum(dim=1) / lengths.clamp_min(1).to(rewards.dtype)
    counted = lengths > 0
    if keep is not None:
        check_per_response(keep, rewards.shape[0], KEEP_ARGUMENT)
        counted = counted & keep.bool()
    counted_f = counted.to(rewards.dtype)
    n = group_sums(counted_f, groups, num_groups)[groups][:, None]
    total = group_sums(means * counted_f, groups, num_groups)[groups][:, None]
    loo = torch.where(n > 1, (rewards * n - total) / (n - 1).clamp_min(1), rewards)
    return torch.where(in_response & counted[:, None], loo, torch.zeros_like(loo))


def leave_one_out_process_advantage(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    groups: torch.Tensor,
    num_groups: int,
    whiten: bool = True,
    reward_mask: str = "step_end",
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's advantage (Cui et al. 2025, ``compute_rloo_returns``) with the process scores p as the process
    rewards in place of the implicit PRM's.

    1. the leave-one-out step rewards, placed at the last token t of step h: with ``reward_mask="step_end"``
       ``d[i, t] = q[i, h]``, ``q = leave_one_out_step_rewards(p)`` (one reward per step); with
       ``"response"`` (PRIME's own mask, the whole response) ``d = leave_one_out_response_rewards(p at the step
       ends)``, the baseline at every response token;
    2. ``G[i, t] = out_i + alpha * sum_{t' >= t} d[i, t']`` (gamma = 1; out_i is PRIME's leave-one-out outcome,
       whose reward sits at the last token, so its return reaches every token of the response);
    3. ``adv = masked_whiten(G, response_mask)`` when ``whiten`` (PRIME whitens the summed returns over the
       batch's response tokens), else ``G * response_mask``.

    Unchecked: NaN or inf in a tensor argument reaches the result (the estimator ``pav_prime`` checks its inputs).

    Args:
        outcome_advantage: [B] out_i (``leave_one_out_outcome`` of the outcome in the ``pav_prime`` estimator).
        step_scores: [B, S]; step_ids: [B, T]; num_steps: [B]; response_mask: [B, T]; alpha: process weight.
        groups, num_groups: prompt groups. reward_mask: one of ``PRIME_REWARD_MASKS``.
        keep: [B] bool, responses that get a process term; default all.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    check_finite_argument("alpha", alpha)
    if reward_mask not in PRIME_REWARD_MASKS:
        raise ValueError(f"reward_mask must be one of {PRIME_REWARD_MASKS}, got {reward_mask!r}")
    if reward_mask == "step_end":
        token_rewards = step_end_rewards(leave_one_out_step_rewards(step_scores, num_steps, groups, num_groups, keep),
                                         step_ids)
    else:
        valid = valid_steps(num_steps, step_scores.shape[1])
        scores = torch.where(valid, step_scores, torch.zeros_like(step_scores))
        if keep is not None:
            check_per_response(keep, scores.shape[0], KEEP_ARGUMENT)
            scores = scores * keep[:, None].to(scores.dtype)
        token_rewards = leave_one_out_response_rewards(step_end_rewards(scores, step_ids), response_mask, groups,
                                                       num_groups, keep)
    returns = outcome_advantage[:, None] + alpha * rewards_to_go(token_rewards)
    returns = returns.to(outcome_advantage.dtype)
    if whiten:
        return masked_whiten(returns, response_mask)
    return returns * response_mask.to(returns.dtype)

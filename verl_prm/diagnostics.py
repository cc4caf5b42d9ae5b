"""Where a learned process term loses the prover's gain (docs: critic.md, "Calibrated critics"): small pure
functions over the process terms A_h = v_h - v_{h-1} (``verl_prm.advantages.step_progress``) of a batch.

Shapes as in ``verl_prm.advantages``: ``advantages`` [B, S] (0 beyond each response's steps), ``num_steps`` [B],
``slipped`` [B, S] bool (step h of response i is a wrong step: the exact prover's value falls there, or a
task's own checker says so), ``outcomes`` [B], ``groups`` [B] ids in [0, G). These are metrics: each function
reads its result back to the host once (a float), unlike the estimators.

Metric names for a trainer's log (``process_term_diagnostics``):

    pav/process_corr          Pearson correlation of the learned and the exact A_h over all real steps
    pav/abs_adv_right         mean |A_h| (learned) over the real steps that did not slip
    pav/abs_adv_slipped       mean |A_h| (learned) over the slipped steps
    pav/exact_abs_adv_right, pav/exact_abs_adv_slipped   the same for the exact A_h (the scale to reach)
    pav/zero_outcome_groups   share of the groups whose responses all have one outcome (no outcome signal)
    pav/zero_outcome_groups_with_signal   share of those groups where some real step has |A_h| > threshold
"""

from __future__ import annotations

import math

import torch

from verl_prm.advantages import valid_steps, zero_signal_groups

__all__ = ["process_term_correlation", "process_term_scale", "zero_outcome_groups_with_signal",
           "process_term_diagnostics", "slipped_steps"]


def _check_same_shape(what: str, tensor: torch.Tensor, reference: torch.Tensor) -> None:
    if tensor.shape != reference.shape:
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} "
                         "(one entry per response and step slot)")


def slipped_steps(step_values: torch.Tensor, prompt_values: torch.Tensor, num_steps: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the real step at which an exact prover's value drops to 0 (the step that loses the success):

        slipped[i, h] = h < num_steps[i]  and  v_{h-1} > 0  and  v_h == 0,   v_{-1} = prompt_values[i]

    At most one step per response slips; the steps after it (already at 0) and every step of a response whose
    prompt value is 0 do not. ``step_values`` [B, S] and ``prompt_values`` [B] are the exact prover's.
    """
    if prompt_values.shape != step_values.shape[:1]:
        raise ValueError(f"prompt_values has shape {tuple(prompt_values.shape)}, expected ({step_values.shape[0]},) "
                         "(one value per response)")
    before = torch.cat([prompt_values[:, None].to(step_values.dtype), step_values], dim=1)[:, :-1]  # v_{h-1}
    return valid_steps(num_steps, step_values.shape[1]) & (before > 0) & (step_values == 0)


def process_term_correlation(learned: torch.Tensor, exact: torch.Tensor, num_steps: torch.Tensor) -> float:
    """Pearson correlation of two process terms over the N real steps (h < num_steps[i]) of the batch:

        r = sum (a - mean a)(e - mean e) / sqrt(sum (a - mean a)^2 * sum (e - mean e)^2)

    NaN when there are fewer than 2 real steps or either term is constant over them.
    """
    _check_same_shape("exact", exact, learned)
    mask = valid_steps(num_steps, learned.shape[1])
    a, e = learned[mask].double(), exact[mask].double()
    if a.numel() < 2:
        return math.nan
    a, e = a - a.mean(), e - e.mean()
    denominator = torch.sqrt((a * a).sum() * (e * e).sum())
    return float((a * e).sum() / denominator) if float(denominator) > 0 else math.nan


def process_term_scale(advantages: torch.Tensor, num_steps: torch.Tensor, slipped: torch.Tensor) -> tuple[float, float]:
    """(mean |A_h| over the real steps that did not slip, mean |A_h| over the real slipped steps); NaN for none.

    A critic that ranks well but squashes its values has both far below the exact prover's.
    """
    _check_same_shape("slipped", slipped, advantages)
    mask = valid_steps(num_steps, advantages.shape[1])
    slipped = slipped.bool()
    size = advantages.abs().double()

    def mean_over(where: torch.Tensor) -> float:
        count = int(where.sum())
        return float(size[where].sum() / count) if count else math.nan

    return mean_over(mask & ~slipped), mean_over(mask & slipped)


def zero_outcome_groups_with_signal(advantages: torch.Tensor, num_steps: torch.Tensor, outcomes: torch.Tensor,
                                    groups: torch.Tensor, num_groups: int, threshold: float) -> tuple[float, float]:
    """(share of the non-empty groups with no outcome signal, share of those that get a process signal).

    A group has no outcome signal when all its responses share one outcome (``zero_signal_groups``: GRPO gives
    it zero advantage). It gets a process signal when some real step of some response has |A_h| > threshold.
    NaN for the second share when no group lacks an outcome signal (and for both when there is no group).
    """
    if not math.isfinite(threshold) or threshold < 0:
        raise ValueError(f"threshold must be finite and >= 0, got {threshold}")
    mask = valid_steps(num_steps, advantages.shape[1])
    signal = ((advantages.abs() > threshold) & mask).any(dim=1)  # [B]
    present = torch.zeros(num_groups, dtype=torch.bool, device=groups.device).index_fill_(0, groups, True)
    flat = zero_signal_groups(outcomes.double(), groups, num_groups) & present
    with_signal = torch.zeros(num_groups, dtype=torch.long, device=groups.device).index_add_(0, groups, signal.long()) > 0
    num_present, num_flat = int(present.sum()), int(flat.sum())
    share_flat = num_flat / num_present if num_present else math.nan
    return share_flat, (int((flat & with_signal).sum()) / num_flat if num_flat else math.nan)


def process_term_diagnostics(learned: torch.Tensor, num_steps: torch.Tensor, slipped: torch.Tensor,
                             outcomes: torch.Tensor, groups: torch.Tensor, num_groups: int, threshold: float,
                             exact: torch.Tensor | None = None) -> dict[str, float]:
    """The ``pav/*`` metrics of the module docstring (the exact-term ones only when ``exact`` is given)."""
    right, slip = process_term_scale(learned, num_steps, slipped)
    flat, flat_with_signal = zero_outcome_groups_with_signal(learned, num_steps, outcomes, groups, num_groups,
                                                             threshold)
    metrics = {"pav/abs_adv_right": right, "pav/abs_adv_slipped": slip, "pav/zero_outcome_groups": flat,
               "pav/zero_outcome_groups_with_signal": flat_with_signal}
    if exact is not None:
        exact_right, exact_slip = process_term_scale(exact, num_steps, slipped)
        metrics.update({"pav/process_corr": process_term_correlation(learned, exact, num_steps),
                        "pav/exact_abs_adv_right": exact_right, "pav/exact_abs_adv_slipped": exact_slip})
    return metrics

"""The trainer hook's ``pav/*`` metrics of one batch, from its ``StepBatch`` and the sources' ``StepValues``.

All read the real rows (verl's padding rows left out; every row when none is real: ``StepBatch.metric_rows``).
The per-batch metrics TRL logs too are ``verl_prm.metrics.pav_metrics``; the diagnostics are
``verl_prm.diagnostics``'; this module only selects the rows and the values.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_prm.advantages import group_ids, step_progress, zero_signal_groups
from verl_prm.config import PavConfig
from verl_prm.diagnostics import process_term_diagnostics, slipped_steps, zero_outcome_groups_with_signal
from verl_prm.integrations.verl.step_batch import StepBatch, StepValues
from verl_prm.metrics import pav_metrics

__all__ = ["batch_metrics", "diagnostics_metrics", "outcome_zero_signal_share", "step_metrics"]


def batch_metrics(batch: StepBatch, values: StepValues, pav: PavConfig, signal_threshold: float,
                  reference: StepValues | None = None) -> dict[str, float]:
    """Every ``pav/*`` metric of the advantage phase: the source's own (``values.metrics``), ``step_metrics``,
    ``pav/merged_steps_share``, ``pav/outcome_zero_signal_groups`` and ``diagnostics_metrics``."""
    rows = batch.metric_rows
    metrics = dict(values.metrics)
    metrics.update(step_metrics(values.step_values[rows], values.prompt_values[rows], batch.split.num_steps[rows],
                                batch.truncated[rows], pav, values.seconds))
    real = batch.real_rows
    merged = batch.split.merged_steps[real]
    metrics["pav/merged_steps_share"] = (merged > 0).float().mean().item() if real.any() else 0.0
    metrics["pav/outcome_zero_signal_groups"] = outcome_zero_signal_share(batch)
    # the reference's values end here: only the metrics read them, never the advantages
    metrics.update(diagnostics_metrics(batch, values, signal_threshold, reference))
    return metrics


def step_metrics(step_values: torch.Tensor, prompt_values: torch.Tensor, num_steps: torch.Tensor,
                 truncated: torch.Tensor, pav: PavConfig, critic_seconds: float) -> dict[str, float]:
    """``verl_prm.metrics.pav_metrics`` of the process scores the estimator adds (``algorithm.pav``: Best-of-K,
    progress or value, clip, truncated responses dropped, normalised over these rows)."""
    keep = ~truncated.bool() if pav.drop_truncated else None
    scores = pav.process_scores(step_values.float(), prompt_values.float(), num_steps, keep)
    return pav_metrics(scores, prompt_values, num_steps, truncated, pav.best_of_k, critic_seconds)


def _outcomes_and_groups(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(outcomes [N], group ids [N] of the prompts (``uid``), G) of the metric rows."""
    keep = batch.metric_rows
    outcomes = batch.outcomes[keep]
    kept = [uid for uid, k in zip(batch.uids, keep.tolist()) if k]
    if not kept:
        return outcomes, torch.zeros(0, dtype=torch.long), 0
    groups, count = group_ids(np.array(kept, dtype=object))
    return outcomes, groups, count


def outcome_zero_signal_share(batch: StepBatch) -> float:
    """Share of the batch's prompt groups (``uid``) whose outcome rewards are all equal: groups where GRPO's
    advantage is zero everywhere (``verl_prm.advantages.zero_signal_groups``)."""
    outcomes, groups, count = _outcomes_and_groups(batch)
    if not count:
        return 0.0
    return zero_signal_groups(outcomes, groups, count).float().mean().item()


def diagnostics_metrics(batch: StepBatch, values: StepValues, threshold: float,
                        reference: StepValues | None = None) -> dict[str, float]:
    """The ``verl_prm.diagnostics`` metrics of a batch.

    The critic's process term is its progress A_h = v_h - v_{h-1} (``step_progress`` of the raw values, before
    Best-of-K, clip and normalisation). Always ``pav/zero_outcome_groups_with_signal`` (|A_h| > ``threshold``).
    With ``reference`` (the exact prover ``verl_prm.diagnostics.reference`` on the same steps) also
    ``pav/process_corr``, ``pav/abs_adv_right``/``_slipped`` and ``pav/exact_abs_adv_right``/``_slipped``, a
    step slipping where the reference value drops to 0 (``verl_prm.diagnostics.slipped_steps``). The share of
    groups without outcome signal is ``pav/outcome_zero_signal_groups`` (logged once, there).
    """
    keep = batch.metric_rows
    outcomes, groups, count = _outcomes_and_groups(batch)
    num_steps = batch.split.num_steps[keep]
    learned = step_progress(values.step_values[keep].float(), values.prompt_values[keep].float(), num_steps)
    if reference is None:
        _, with_signal = zero_outcome_groups_with_signal(learned, num_steps, outcomes, groups, count, threshold)
        return {"pav/zero_outcome_groups_with_signal": with_signal}
    exact_values, exact_prompt = reference.step_values[keep].float(), reference.prompt_values[keep].float()
    exact = step_progress(exact_values, exact_prompt, num_steps)
    metrics = process_term_diagnostics(learned, num_steps, slipped_steps(exact_values, exact_prompt, num_steps),
                                       outcomes, groups, count, threshold, exact=exact)
    del metrics["pav/zero_outcome_groups"]  # == pav/outcome_zero_signal_groups
    return metrics

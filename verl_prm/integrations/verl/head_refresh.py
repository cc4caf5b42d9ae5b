"""``verl_prm.refresh``: the learned PAV's step values, its value head refitted every ``every`` steps to values
sampled from the rollout replicas (the math and the store: ``verl_prm.critic.refresh``).

:class:`HeadRefresh` is a source of step values (``values(batch) -> StepValues``) over a critic worker group and
the rollout sampler: on a refresh step it scores the batch with the PAV as it is (those are the step's values),
samples the batch's values, compares, writes them as labels to the run's :class:`RefreshStore`, refits the head
to the labels of the last ``window`` refreshes and sets it on every worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from verl_prm.config.hook import ConfigError, HookConfig
from verl_prm.critic.refresh import (
    RefreshStore,
    labelled_rows,
    refit_value_head,
    refresh_label_rows,
    refresh_metrics,
    refresh_targets,
)
from verl_prm.critic.sampled import shrink_labels
from verl_prm.integrations.verl.step_batch import StepBatch, StepValues
from verl_prm.integrations.verl.value_sources import CriticWorkerValues, RolloutSampledValues, Timer, no_timer

logger = logging.getLogger(__name__)

__all__ = ["HeadRefresh", "open_refresh_store"]


def open_refresh_store(hook: HookConfig, default_local_dir: str) -> RefreshStore:
    """The run's refresh directory (``verl_prm.refresh.directory``, default ``<trainer.default_local_dir>/
    pav_refresh``), locked for the run; a resume must have the same refresh and sampling settings."""
    refresh, critic = hook.refresh, hook.critic
    directory = refresh.directory or os.path.join(default_local_dir, "pav_refresh")
    settings = {"critic_path": str(critic.path), "every": refresh.every, "window": refresh.window,
                "n_mc": critic.n_mc, "prefix_rule": critic.prefix_rule,
                "prefixes_per_response": critic.prefixes_per_response,
                "mc_token_budget": critic.mc_token_budget, "success_threshold": critic.success_threshold,
                "pool_group_samples": critic.pool_group_samples, "group_prior_strength": critic.group_prior_strength,
                "prior_strength": refresh.prior_strength}
    try:
        return RefreshStore(directory, settings)
    except ValueError as error:
        raise ConfigError(f"verl_prm.refresh.directory: {error}") from None


class HeadRefresh:
    """The PAV of ``critic`` (format value_head), refitted every ``hook.refresh.every`` steps (module docstring)."""

    def __init__(self, critic: CriticWorkerValues, sampler: RolloutSampledValues, store: RefreshStore,
                 hook: HookConfig, tokenizer, timer: Timer = no_timer) -> None:
        self.critic, self.sampler, self.store = critic, sampler, store
        self.every, self.window = hook.refresh.every, hook.refresh.window
        self.prefix_rule, self.prior_strength = hook.critic.prefix_rule, hook.refresh.prior_strength
        self.tokenizer = tokenizer
        self.timer = timer
        self._restored = False

    def values(self, batch: StepBatch) -> StepValues:
        """The PAV's values of ``batch``; on a refresh step (``step % every == 0``) with the ``pav/refresh/*``
        metrics of the refresh that follows them."""
        self.restore(batch.step)
        if batch.step % self.every:
            return self.critic.values(batch)
        values = self.critic.values(batch, with_features=True)
        with self.timer("pav_refresh"):
            metrics = self.refresh(batch, values)
        return dataclasses.replace(values, metrics={**values.metrics, **metrics})

    def restore(self, step: int) -> None:
        """Once, at the run's first advantage phase: a resumed run sets the head its last refresh before this step
        fitted (the checkpoint holds the actor, not the critic's refitted head)."""
        if self._restored:
            return
        self._restored = True
        done = self.store.steps(step - 1)
        if done:
            _, weight, bias = self.store.read(done[-1])
            self.critic.group.set_value_head(weight.tolist(), bias)
            logger.info("verl_prm.refresh: resumed with the value head refitted at step %d", done[-1])

    def refresh(self, batch: StepBatch, scored: StepValues) -> dict[str, float]:
        """Sample the batch's step values, compare the PAV's values ``scored`` (with its features) with them,
        write them as labels, refit the value head to the labels of the last ``window`` refreshes and set it on
        every worker (``verl_prm.critic.refresh``); with ``verl_prm.refresh.prior_strength`` s > 0 a sampled
        step's label of t samples is shrunk toward the PAV's value with t + s trials
        (``verl_prm.critic.sampled.shrink_labels``: the refit is then pulled toward the PAV it refits). Returns
        the ``pav/refresh/*`` and ``pav/mc_*`` metrics."""
        step = batch.step
        sampled = self.sampler.values(batch)
        real = batch.real_rows.tolist()
        targets, trials = refresh_targets(sampled.sampled, batch.uids, real)
        critic_values = torch.cat([scored.prompt_values[:, None], scored.step_values], dim=1)
        metrics = refresh_metrics(critic_values, targets.float(), trials)
        metrics.update(sampled.metrics)
        # verl_prm.refresh.prior_strength: the sampled steps' labels shrunk toward the PAV's values (the prompt's
        # group rate and the outcome stay), metered above on the plain labels
        if self.prior_strength:
            mask = sampled.sampled.sampled & (trials[:, 1:] > 0)
            targets[:, 1:], trials[:, 1:] = shrink_labels(targets[:, 1:], trials[:, 1:],
                                                          critic_values[:, 1:].to(targets.dtype), mask,
                                                          self.prior_strength)
        rows = labelled_rows(step, scored.features, targets, trials)
        window = self.store.window(step - 1, self.window - 1) + [rows] if self.window > 1 else [rows]
        if not len(rows.targets):
            return metrics  # nothing labelled (every response empty): the head stays
        fit = refit_value_head(window)
        self.store.write(rows, self._label_rows(batch, sampled), fit.weight, fit.bias)
        self.critic.group.set_value_head(fit.weight.tolist(), fit.bias)
        metrics.update({
            "pav/refresh/window_labels": float(sum(len(r.targets) for r in window)),
            "pav/refresh/fit_loss": float(fit.loss), "pav/refresh/fit_iterations": float(fit.iterations),
            "pav/refresh/fit_converged": float(fit.converged),
        })
        return metrics

    def _label_rows(self, batch: StepBatch, sampled: StepValues) -> list[dict]:
        """The sampled values as label rows (``verl_prm.labeling.format``), texts decoded from the batch."""
        prompt_texts = [self.tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=False)
                        for row, mask in zip(batch.prompts, batch.prompt_mask)]
        return refresh_label_rows(
            sampled.sampled, batch.uids, self.sampler.successes(batch), batch.step, prompts=prompt_texts,
            responses=batch.split.texts, step_char_ends=batch.split.step_char_ends,
            outcome_scores=batch.outcomes.tolist(), finished=(~batch.truncated).tolist(),
            data_sources=batch.data_sources, ground_truths=batch.ground_truths, strategy=self.prefix_rule,
            source=f"verl-prm refresh: the policy at step {batch.step}",
            real_rows=batch.real_rows.tolist())

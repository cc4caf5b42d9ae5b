"""The sources of step values in the trainer hook, each behind one interface: ``values(batch) -> StepValues``.

- :class:`CriticWorkerValues`: a critic worker group (``verl_prm.critic.format`` value_head, a public PRM's
  format, or exact with the prover in the workers);
- :class:`RolloutSampledValues`: Monte-Carlo values from the run's rollout replicas (format ``rollout``);
- :class:`ExactReferenceValues`: the exact prover of ``verl_prm.diagnostics.reference``, in the driver (for the
  diagnostics only, never the advantages).

The refitted learned PAV (``verl_prm.refresh``) is ``head_refresh.HeadRefresh``, a source over the first two.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Protocol

from verl.protocol import DataProto

from verl_prm.integrations.verl.critic_worker import OFFLOAD_SECONDS_KEY, compute_step_values
from verl_prm.integrations.verl.rollout_critic import RolloutCritic, mc_metrics
from verl_prm.integrations.verl.step_batch import StepBatch, StepValues

__all__ = ["CriticWorkerValues", "ExactReferenceValues", "RolloutSampledValues", "StepValueSource", "Timer"]

# name -> a context that times the phase into verl's timing_s/<name> (the trainer's marked_timer), or no-op
Timer = Callable[[str], ContextManager[Any]]


def no_timer(name: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


class StepValueSource(Protocol):
    def values(self, batch: StepBatch) -> StepValues:
        """The values of ``batch``'s steps (``batch.split``) and prompts."""


# CriticScores' per-response flags of public PRM formats -> the metric that counts them
TEXT_FLAG_METRICS = {"separator_text": "pav/critic_separator_text_responses",
                     "special_text": "pav/critic_special_text_responses"}


class CriticWorkerValues:
    """Step values from a ``ProverCriticWorker`` group (``critic_worker.compute_step_values``): the batch's steps
    scored in one forward pass per response, on the workers' devices."""

    def __init__(self, group, reports_offload: bool = False) -> None:
        self.group = group  # a RayWorkerGroup of ProverCriticWorker (or one with its methods)
        self.reports_offload = reports_offload

    def values(self, batch: StepBatch, with_features: bool = False) -> StepValues:
        """The critic's values; with ``with_features`` also what its value head read (``StepValues.features``)."""
        split = batch.split
        critic_input = DataProto.from_dict(tensors={
            "prompts": batch.prompts, "responses": batch.responses, "attention_mask": batch.attention_mask,
            "step_ends": split.step_ends, "num_steps": split.num_steps, "step_ids": split.step_ids,
            "merged_steps": split.merged_steps,
            # for a critic with another tokenizer: where the steps end in the text, and the mask the text was
            # decoded with (the split's), so the critic re-reads exactly the split's text
            "step_char_ends": split.step_char_ends, "step_text_mask": batch.response_mask.long(),
        })
        if with_features:
            critic_input.meta_info["with_features"] = True
        start = time.perf_counter()
        scores = compute_step_values(self.group, critic_input)
        seconds = time.perf_counter() - start
        scored = scores.batch["num_steps"].cpu()
        if not scored.equal(split.num_steps.cpu()):
            bad = (scored != split.num_steps.cpu()).nonzero().flatten().tolist()
            raise RuntimeError(
                f"the critic scored a different number of steps than the split for samples {bad[:8]} "
                f"(keys {[batch.keys[i] for i in bad[:8]]}): critic and step split disagree"
            )
        timing = {}
        offload_seconds = scores.meta_info.get("metrics", {}).get(OFFLOAD_SECONDS_KEY)
        if self.reports_offload and offload_seconds:
            # the workers move in parallel: the phase waits for the slowest (verl logs timing_s/pav_critic_offload)
            timing["pav_critic_offload"] = max(offload_seconds)
        # public PRM formats flag responses whose step text held special-token or separator text (read as plain
        # text, the separator removed): counted, never a failed batch
        metrics = {name: float(scores.batch[flag].sum()) for flag, name in TEXT_FLAG_METRICS.items()
                   if flag in scores.batch.keys()}
        return StepValues(scores.batch["step_values"].float(), scores.batch["prompt_values"].float(), seconds,
                          metrics=metrics, timing=timing,
                          features=scores.batch["features"].float() if with_features else None)


class RolloutSampledValues:
    """Monte-Carlo step values sampled from the rollout replicas (``RolloutCritic``), between a wake-up with the
    actor's weights (not yet updated in this step: those that generated the batch) and a sleep."""

    def __init__(self, critic: RolloutCritic, checkpoint_manager, success_threshold: float,
                 timer: Timer = no_timer) -> None:
        self.critic = critic
        self.checkpoint_manager = checkpoint_manager
        self.success_threshold = float(success_threshold)
        self.timer = timer

    def successes(self, batch: StepBatch) -> list[bool]:
        """Each response's success: its outcome above ``verl_prm.critic.mc_success_threshold``."""
        return [bool(value > self.success_threshold) for value in batch.outcomes.tolist()]

    def values(self, batch: StepBatch) -> StepValues:
        if batch.data_sources is None:
            raise ValueError("RolloutSampledValues needs the batch's data_source, reward_model and extra_info "
                             "(read_step_batch of step_batch.SAMPLING_FIELDS)")
        start = time.perf_counter()
        with self.timer("pav_mc"):
            # the replicas sleep after generation (on_sample_end); wake them with the batch's weights, whose
            # version is the previous step's
            self.checkpoint_manager.update_weights(max(batch.step - 1, 0))
            try:
                sampled = self.critic.step_values(
                    batch.prompt_ids(), batch.response_ids(), batch.split.step_ends, batch.split.num_steps,
                    self.successes(batch), batch.uids, batch.data_sources, batch.ground_truths, batch.extra_infos,
                    sample_rows=batch.real_rows.tolist(), request_tag=str(batch.step),
                )
            finally:
                self.checkpoint_manager.sleep_replicas()
        seconds = time.perf_counter() - start
        return StepValues(sampled.step_values.float(), sampled.prompt_values.float(), seconds,
                          metrics=mc_metrics(sampled, batch.response_mask, batch.metric_rows), sampled=sampled)


class ExactReferenceValues:
    """The exact prover of ``verl_prm.diagnostics.reference`` (an ``ExactCritic``), in the driver: it reads the
    split's texts with the policy's tokenizer, as a format=exact critic worker does."""

    def __init__(self, critic, tokenizer) -> None:
        self.critic = critic
        self.tokenizer = tokenizer

    def values(self, batch: StepBatch) -> StepValues:
        start = time.perf_counter()
        try:
            scores = self.critic.score_policy_batch(batch.prompts, batch.responses, batch.attention_mask,
                                                    batch.split, self.tokenizer)
        except ValueError as error:
            raise ValueError(f"verl_prm.diagnostics.reference: {error}") from error
        return StepValues(scores.step_values.float(), scores.prompt_values.float(), time.perf_counter() - start)

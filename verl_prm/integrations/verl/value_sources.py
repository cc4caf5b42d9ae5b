"""The sources of step values in the trainer hook, each behind one interface: ``values(batch) -> StepValues``.

- :class:`CriticWorkerValues`: a critic worker group (``verl_prm.critic.source`` checkpoint: a learned PAV or a
  public PRM; or exact, with the prover in the workers);
- :class:`RolloutSampledValues`: Monte-Carlo values from the run's rollout replicas (source ``sampled``);
- :class:`TreeNodeValues`: the node values of tree-shaped groups (source ``tree``): each step's value is the mean
  outcome of the group's leaves below its node (``verl_prm.trees.tree_step_values``), sampled by the agent loop
  ``pav_tree`` (``tree_rollout``) at no extra cost;
- :class:`ExactReferenceValues`: the exact prover of ``verl_prm.diagnostics.reference``, in the driver (for the
  diagnostics only, never the advantages).

The refitted learned PAV (``verl_prm.refresh``) is ``head_refresh.HeadRefresh``, a source over the first two.
Which of them a run uses, and how it is built, is its entry in the registry ``sources.SOURCES``.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any, Callable, ContextManager, Protocol

import torch

from verl.protocol import DataProto

from verl_prm.critic.sampled import shrink_success_rates
from verl_prm.integrations.verl.critic_worker import OFFLOAD_SECONDS_KEY, compute_step_values
from verl_prm.integrations.verl.rollout_sampler import RolloutSampler, mc_metrics
from verl_prm.integrations.verl.step_batch import StepBatch, StepValues
from verl_prm.trees import tree_step_values

__all__ = ["CriticWorkerValues", "ExactReferenceValues", "RolloutSampledValues", "StepValueSource", "Timer",
           "TreeNodeValues", "tree_metrics"]

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
    """Monte-Carlo step values sampled from the rollout replicas (``RolloutSampler``), between a wake-up with the
    actor's weights (not yet updated in this step: those that generated the batch) and a sleep."""

    def __init__(self, sampler: RolloutSampler, checkpoint_manager, success_threshold: float,
                 timer: Timer = no_timer) -> None:
        self.sampler = sampler
        self.checkpoint_manager = checkpoint_manager
        self.success_threshold = float(success_threshold)
        self.timer = timer

    def successes(self, batch: StepBatch) -> list[bool]:
        """Each response's success: its outcome above ``verl_prm.critic.success_threshold``."""
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
                sampled = self.sampler.step_values(
                    batch.prompt_ids(), batch.response_ids(), batch.split.step_ends, batch.split.num_steps,
                    self.successes(batch), batch.uids, batch.data_sources, batch.ground_truths, batch.extra_infos,
                    sample_rows=batch.real_rows.tolist(), request_tag=str(batch.step),
                )
            finally:
                self.checkpoint_manager.sleep_replicas()
        seconds = time.perf_counter() - start
        return StepValues(sampled.step_values.float(), sampled.prompt_values.float(), seconds,
                          metrics=mc_metrics(sampled, batch.response_mask, batch.metric_rows), sampled=sampled)


def tree_metrics(batch: StepBatch, roots: int, leaf_counts: torch.Tensor) -> dict[str, float]:
    """The cost of one step's trees (``pav/tree_*``, the real rows): tokens generated (roots, branches), tokens
    trained (every leaf's response tokens), their ratio (a GRPO step with the same n: 1.0), branch leaves, groups
    that fell back to extra independent roots (responses with no step boundary left to branch at), and the mean
    leaves below a step's node."""
    rows = batch.metric_rows.tolist()
    fields = batch.agent_fields or [{} for _ in rows]
    missing = [batch.keys[i] for i, (row, keep) in enumerate(zip(fields, rows)) if keep and
               "pav_tree_generated_tokens" not in row]
    if missing:
        raise RuntimeError(f"responses {missing[:4]} were not sampled by the tree agent loop (no pav_tree_* fields): "
                           "tree-shaped groups need every training prompt sampled by agent loop pav_tree")
    real = [(uid, row) for uid, row, keep in zip(batch.uids, fields, rows) if keep]
    generated = [int(row["pav_tree_generated_tokens"]) for _, row in real]
    is_root = [int(row["pav_tree_parent"]) < 0 for _, row in real]
    trained = int(batch.response_lengths[batch.metric_rows].sum())
    groups = {uid for uid, _ in real}
    roots_per_group = Counter(uid for (uid, _), root in zip(real, is_root) if root)
    steps = batch.split.num_steps[batch.metric_rows]
    counts = leaf_counts[batch.metric_rows]
    valid = torch.arange(counts.shape[1])[None, :] < steps[:, None]
    return {
        "pav/tree_generated_tokens": float(sum(generated)),
        # prompt tokens the rollout engine copied from its prefix cache instead of computing (hf rollout)
        "pav/tree_prefill_tokens_saved": float(sum(int(row.get("pav_tree_prefill_tokens_saved", 0)) for _, row in real)),
        "pav/tree_root_tokens": float(sum(g for g, root in zip(generated, is_root) if root)),
        "pav/tree_branch_tokens": float(sum(g for g, root in zip(generated, is_root) if not root)),
        "pav/tree_trained_tokens": float(trained),
        "pav/tree_generated_share": sum(generated) / trained if trained else 0.0,
        "pav/tree_branch_leaves": float(sum(not root for root in is_root)),
        "pav/tree_fallback_groups": float(sum(count > roots for count in roots_per_group.values())),
        "pav/tree_groups": float(len(groups)),
        "pav/tree_mean_node_leaves": float(counts[valid].float().mean()) if bool(valid.any()) else 0.0,
    }


class TreeNodeValues:
    """Step values of tree-shaped groups (source ``tree``): a step's value is the mean success of the group's
    leaves whose response begins with the tokens up to that step's end (``verl_prm.trees.tree_step_values``);
    a prompt's value is its group's success rate. With ``prior_strength`` s > 0
    (``verl_prm.critic.group_prior_strength``) a node of L leaves, k of them
    successes, is valued (k + s v_0) / (L + s) (``verl_prm.critic.sampled.shrink_success_rates``, v_0 the
    group's rate). Nothing is sampled here: the agent loop sampled the tree."""

    def __init__(self, success_threshold: float, roots: int, prior_strength: float = 0.0) -> None:
        self.success_threshold = float(success_threshold)
        self.roots = int(roots)
        self.prior_strength = float(prior_strength)

    def values(self, batch: StepBatch) -> StepValues:
        start = time.perf_counter()
        split = batch.split
        real = batch.real_rows.tolist()
        # verl's padding rows get a group of their own, so they are no leaf of a real prompt's tree
        groups = [uid if keep else f"padding-{row}" for row, (uid, keep) in enumerate(zip(batch.uids, real))]
        ends = [[int(end) + 1 for end in split.step_ends[b, : int(split.num_steps[b])].tolist()]
                for b in range(len(groups))]
        successes = (batch.outcomes > self.success_threshold).float()
        tree = tree_step_values(groups, batch.response_ids(), ends, successes, width=split.step_ends.shape[1])
        step_values, leaf_counts, prompt_values = tree.step_values, tree.leaf_counts, tree.prompt_values
        response_values, response_leaf_counts = tree.response_values, tree.response_leaf_counts
        if self.prior_strength > 0:
            shrunk = shrink_success_rates(step_values * leaf_counts, leaf_counts, prompt_values[:, None],
                                          self.prior_strength)
            step_values = torch.where(leaf_counts > 0, shrunk, step_values)
            # a leaf's own node is a node like the others: shrunk alike
            response_values = shrink_success_rates(response_values * response_leaf_counts, response_leaf_counts,
                                                   prompt_values, self.prior_strength)
        return StepValues(step_values.float(), prompt_values.float(), time.perf_counter() - start,
                          metrics=tree_metrics(batch, self.roots, leaf_counts), leaf_counts=leaf_counts,
                          response_values=response_values.float(), response_leaf_counts=response_leaf_counts)


class ExactReferenceValues:
    """The exact prover of ``verl_prm.diagnostics.reference`` (an ``ExactCritic``), in the driver: it reads the
    split's texts with the policy's tokenizer, as an exact critic worker (source ``exact``) does."""

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

"""The verl trainer hook: verl 0.9.1's synchronous PPO trainer plus the step values in the advantage phase.

Select it with ``trainer.v1.trainer_mode=pav_sync`` (the ``verl_prm`` config group sets it). This class only
orchestrates; compared with verl's ``PPOTrainerSync`` it changes:

1. worker initialisation (``_setup``): after verl has built its worker groups, the source of the step values
   (``verl_prm.critic.source``) is built by its entry in the registry ``sources.SOURCES``: a
   ``ProverCriticWorker`` group (``critic_group``) on verl's ``global_pool`` (``verl_prm.placement.pool=
   colocated``) or a pool of its own (``pool=own``, added to verl's ``ResourcePoolManager`` before verl creates
   its pools, so verl's GPU-availability check counts it) for a source with critic workers; the rollout sampler
   over verl's rollout replicas; the node values of tree-shaped groups; with ``verl_prm.refresh.every = k``, the
   critic group whose value head ``head_refresh.HeadRefresh`` refits every k-th step;
2. for a source whose groups are trees, the training batches it submits name verl's agent loop ``pav_tree``
   (``_next_train_batch``; ``tree_rollout``), which samples each prompt's group as a tree through the rollout
   replicas (validation batches keep the default agent loop);
3. the advantage phase (``_compute_advantage``): the batch is read from TransferQueue and split into steps
   (``step_batch.read_step_batch``), its steps are valued by the source (``StepValues``; with
   ``verl_prm.diagnostics.reference`` also by that exact prover, for the metrics only), the ``pav/*`` metrics are
   added to the step's metrics (``batch_metrics``), then verl's own advantage phase runs unchanged inside
   ``advantage.estimator_step_inputs(StepInputs(...))``. Between this hook and the estimator run only verl's
   functions: ``verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage`` (reads the batch from
   TransferQueue, applies the KL-in-reward penalty and the rollout correction when configured, writes the
   advantages back) calls ``verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories``, which calls
   ``verl.trainer.ppo.ray_trainer.compute_advantage``, which looks the estimator up with
   ``verl.trainer.ppo.core_algos.get_adv_estimator_fn`` and calls it with the rewards, mask, uid and config
   only. The registered step estimator (pav_*, prm_aggregate; ``advantage.verl_estimator``) reads the step
   tensors verl does not pass from the context.

verl compares ``self.trainer_mode == "sync"`` in several places (replay-buffer class, dataloader refill,
checkpoint save/load of TransferQueue, re-issuing in-flight prompts, prompt persistence). ``trainer_mode`` is
therefore a read-only "sync" on this class: verl's constructor assigns the configured name, which is kept as
``registered_trainer_mode``, and every check sees "sync". The config section verl reads for the mode's options
(``trainer.v1.<mode>``, e.g. ``parameter_sync_step``) is thus ``trainer.v1.sync``, as for the sync trainer.
"""

from __future__ import annotations

import contextlib
import logging
import os

import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.debug import marked_timer

from verl_prm.config.hook import HOOK_TRAINER_NAME, TREE_AGENT_LOOP_NAME, build_exact_critic
from verl_prm.estimators import ESTIMATORS
from verl_prm.integrations.verl.advantage import StepInputs, estimator_step_inputs
from verl_prm.integrations.verl.batch_metrics import batch_metrics
from verl_prm.integrations.verl.critic_group import CRITIC_POOL_NAME
from verl_prm.integrations.verl.import_hooks import run_deferred_registration
from verl_prm.integrations.verl.run_config import scores_steps, validate_run_config
from verl_prm.integrations.verl.sources import ValueSource, value_source
from verl_prm.integrations.verl.step_batch import (
    SAMPLING_FIELDS,
    STEP_FIELDS,
    TREE_FIELDS,
    StepBatch,
    read_step_batch,
)
from verl_prm.integrations.verl.value_sources import ExactReferenceValues, StepValueSource
from verl_prm.special_tokens import policy_eos_token_ids

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = ["PavSyncTrainer", "register_trainer_hook"]


class PavSyncTrainer(PPOTrainerSync):
    """verl's synchronous PPO trainer with the step values in the advantage phase (module docstring)."""

    def __init__(self, config):
        # The run checks again (the startup check ran them in the driver before Ray); no model is loaded yet.
        self.hook_config, self.pav_config = validate_run_config(config)
        self.value_source: StepValueSource | None = None
        self.reference: ExactReferenceValues | None = None
        # verl_prm.diagnostics.reference: the exact prover of the diagnostics, in the driver (it reads text)
        reference = self.hook_config.diagnostics.reference
        self.reference_critic = (build_exact_critic(reference, "verl_prm.diagnostics.reference")
                                 if reference is not None else None)
        super().__init__(config)

    @property
    def source(self) -> ValueSource:
        """The registry entry of the run's value source (``verl_prm.critic.source``)."""
        return value_source(self.hook_config)

    # verl checks `trainer_mode == "sync"`; this trainer is sync in every such check.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        self.registered_trainer_mode = value

    # ------------------------------------------------------------------ worker initialisation
    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        placement = self.hook_config.placement
        if self._scores_steps() and self.source.critic_workers and placement.pool == "own":
            self.resource_pool_manager.resource_pool_spec[CRITIC_POOL_NAME] = (
                [placement.n_gpus_per_node] * placement.nnodes
            )

    def _setup(self):
        super()._setup()
        if self._scores_steps():
            self.init_value_sources()

    def init_value_sources(self) -> None:
        """The source of the step values and the diagnostics' reference (verl's workers must exist)."""
        self.value_source = self.source.build(self)
        if self.reference_critic is not None:
            self.reference = ExactReferenceValues(self.reference_critic, self.tokenizer)

    def _scores_steps(self) -> bool:
        """Whether the hook values the batch's steps (``run_config.scores_steps``); false: verl's own phase."""
        return scores_steps(self.hook_config, self.config.algorithm.adv_estimator)

    def _next_train_batch(self, num_prompts: int | None = None):
        """verl's next training batch; for a source of tree-shaped groups it names the tree agent loop for every
        prompt."""
        batch = super()._next_train_batch(num_prompts)
        if self.source.tree_agent_loop:
            if "agent_name" in batch.keys():
                raise ValueError(
                    f"verl_prm.critic.source={self.source.name} samples every training prompt with agent loop "
                    f"{TREE_AGENT_LOOP_NAME}, but the training data names its own agent loop (column agent_name): "
                    "drop that column or use another verl_prm.critic.source"
                )
            tu.assign_non_tensor_data(batch, "agent_name", TREE_AGENT_LOOP_NAME)
        return batch

    # ------------------------------------------------------------------ advantage phase
    def _timer(self, name: str):
        """verl's ``marked_timer`` into this step's ``timing_s/<name>`` (none outside a training step)."""
        timing_raw = getattr(self, "timing_raw", None)
        return marked_timer(name, timing_raw, color="purple") if timing_raw is not None else contextlib.nullcontext()

    def _eos_token_ids(self) -> list[int]:
        """EOS ids a finished response ends with: the tokenizer's and the generation config's
        (``verl_prm.special_tokens.policy_eos_token_ids``: Qwen2.5 instruct models stop at either <|im_end|> or
        <|endoftext|>; a disagreement is logged)."""
        if getattr(self, "_eos_ids", None) is None:
            from verl.utils.fs import copy_to_local
            from verl.utils.model import get_generation_config

            path = self.config.actor_rollout_ref.model.path
            try:
                generation = get_generation_config(copy_to_local(path))
            except (OSError, ValueError) as error:  # a directory without a model config: the tokenizer's EOS
                logger.warning("no generation config for the policy (%s): EOS is the tokenizer's only", error)
                generation = None
            self._eos_ids = sorted(policy_eos_token_ids(self.tokenizer, generation, source=f"the policy {path}"))
        return self._eos_ids

    def read_step_batch(self, batch) -> StepBatch:
        """The ``StepBatch`` of verl's ``KVBatchMeta`` ``batch`` (its fields read from TransferQueue)."""
        fields = list(STEP_FIELDS) + (list(SAMPLING_FIELDS) if self.source.samples_with_rollout(self.hook_config) else [])
        fields += list(TREE_FIELDS) if self.source.tree_agent_loop else []
        raw = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        return read_step_batch(raw, batch.keys, batch.tags, self.global_steps, self.tokenizer,
                               self.hook_config.steps, self._eos_token_ids())

    def _compute_advantage(self, batch, metrics: dict):
        """The step values and their metrics, then verl's own advantage phase (``PPOTrainer._compute_advantage``
        -> ``compute_advantage_for_multi_trajectories`` -> ``compute_advantage`` -> the registered estimator),
        whose step estimator reads the step tensors from ``estimator_step_inputs`` (module docstring)."""
        if not self._scores_steps():
            return super()._compute_advantage(batch, metrics)
        step_estimator = self.config.algorithm.adv_estimator in ESTIMATORS
        if step_estimator:
            _check_single_output_sessions(batch.keys)
        with self._timer("pav_critic"):
            step_batch = self.read_step_batch(batch)
            reference = self.reference.values(step_batch) if self.reference is not None else None
            values = self.value_source.values(step_batch)
        timing_raw = getattr(self, "timing_raw", None)
        if timing_raw is not None:
            timing_raw.update(values.timing)
        metrics.update(batch_metrics(step_batch, values, self.pav_config,
                                     self.hook_config.diagnostics.signal_threshold, reference))
        if not step_estimator:
            # outcome-only estimator (the grpo baseline): verl's advantages, unchanged; metrics only
            return super()._compute_advantage(batch, metrics)
        split = step_batch.split
        inputs = StepInputs(split.step_ids, values.step_values, values.prompt_values, split.num_steps,
                            step_batch.truncated, leaf_counts=values.leaf_counts,
                            response_values=values.response_values,
                            response_leaf_counts=values.response_leaf_counts)
        with estimator_step_inputs(inputs):
            return super()._compute_advantage(batch, metrics)


def _check_single_output_sessions(keys) -> None:
    """Step estimators score each TransferQueue row as one response; a session with several outputs
    (multi-turn agent loops write ``{uid}_{session}_{index}`` with index > 0) would be mis-grouped."""
    multi = [key for key in keys if key.rsplit("_", 2)[-1] not in ("0",)]
    if multi:
        raise NotImplementedError(
            f"verl-prm step estimators support one output per trajectory (single-turn rollouts), but the batch has "
            f"outputs {multi[:4]} with index > 0 (multi-output agent loops); use a single-turn agent loop"
        )


def register_trainer_hook() -> None:
    """Register ``PavSyncTrainer`` as verl's trainer ``pav_sync`` (idempotent)."""
    if TRAINER_REGISTRY.get(HOOK_TRAINER_NAME) is not PavSyncTrainer:
        register_trainer(HOOK_TRAINER_NAME)(PavSyncTrainer)


# verl's plugin loader may have asked for the registration while this module was still executing.
run_deferred_registration(__name__)

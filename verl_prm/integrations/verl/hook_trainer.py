"""The verl trainer hook: verl 0.9.1's synchronous PPO trainer plus the step values in the advantage phase.

Select it with ``trainer.v1.trainer_mode=pav_sync`` (the ``verl_prm`` config group sets it). This class only
orchestrates; compared with verl's ``PPOTrainerSync`` it changes:

1. worker initialisation (``_setup``): after verl has built its worker groups, the source of the step values is
   set up (``value_sources``): a ``ProverCriticWorker`` group (``critic_group``) on verl's ``global_pool``
   (``verl_prm.placement.pool=colocated``) or a pool of its own (``pool=own``, added to verl's
   ``ResourcePoolManager`` before verl creates its pools, so verl's GPU-availability check counts it); or, with
   format "rollout", the rollout sampler over verl's rollout replicas; with format "tree", the node values of
   tree-shaped groups (``value_sources.TreeNodeValues``); with ``verl_prm.refresh.every = k``, the critic group
   whose value head ``head_refresh.HeadRefresh`` refits every k-th step;
2. with format "tree", the training batches it submits name verl's agent loop ``pav_tree``
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
from verl.utils.debug import marked_timer

from verl_prm.config.hook import (
    HOOK_TRAINER_NAME,
    ROLLOUT_CRITIC_FORMAT,
    TREE_AGENT_LOOP_NAME,
    TREE_CRITIC_FORMAT,
    build_exact_critic,
)
from verl_prm.estimators import ESTIMATORS
from verl_prm.integrations.verl.advantage import StepInputs, estimator_step_inputs
from verl_prm.integrations.verl.batch_metrics import batch_metrics
from verl_prm.integrations.verl.critic_group import CRITIC_POOL_NAME, create_critic_group, policy_tokenizer_path
from verl_prm.integrations.verl.head_refresh import HeadRefresh, open_refresh_store
from verl_prm.integrations.verl.import_hooks import run_deferred_registration
from verl_prm.integrations.verl.rollout_critic import (
    RolloutCritic,
    check_rollout_critic_run,
    run_reward_function,
    sampling_params,
)
from verl_prm.integrations.verl.run_config import validate_run_config
from verl_prm.integrations.verl.step_batch import (
    SAMPLING_FIELDS,
    STEP_FIELDS,
    TREE_FIELDS,
    StepBatch,
    read_step_batch,
)
from verl_prm.integrations.verl.tree_rollout import check_tree_run
from verl_prm.integrations.verl.value_sources import (
    CriticWorkerValues,
    ExactReferenceValues,
    RolloutSampledValues,
    StepValueSource,
    TreeNodeValues,
)
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.special_tokens import policy_eos_token_ids

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = ["PavSyncTrainer", "register_trainer_hook"]


class PavSyncTrainer(PPOTrainerSync):
    """verl's synchronous PPO trainer with the step values in the advantage phase (module docstring)."""

    def __init__(self, config):
        # Startup validation before verl builds anything (no model is loaded before init()).
        self.hook_config, self.pav_config = validate_run_config(config)
        if self._samples_values() or self.hook_config.refresh.every:
            check_rollout_critic_run(config)
        if self._samples_trees():
            check_tree_run(config, self.hook_config)
        self.value_source: StepValueSource | None = None
        self.reference: ExactReferenceValues | None = None
        # verl_prm.diagnostics.reference: the exact prover of the diagnostics, in the driver (it reads text)
        reference = self.hook_config.diagnostics.reference
        self.reference_critic = (build_exact_critic(reference, "verl_prm.diagnostics.reference")
                                 if reference is not None else None)
        super().__init__(config)

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
        if self._runs_critic() and not self._samples_values() and placement.pool == "own":
            self.resource_pool_manager.resource_pool_spec[CRITIC_POOL_NAME] = (
                [placement.n_gpus_per_node] * placement.nnodes
            )

    def _setup(self):
        super()._setup()
        if self._runs_critic():
            self.init_value_sources()

    def init_value_sources(self) -> None:
        """The source of the step values and the diagnostics' reference (verl's workers must exist)."""
        hook = self.hook_config
        if self._samples_values():
            self.value_source = self._rollout_sampler()
        elif self._samples_trees():
            self.value_source = TreeNodeValues(hook.critic.mc_success_threshold, hook.tree.roots,
                                               hook.critic.prior_strength)
        else:
            critic = CriticWorkerValues(self._init_prover_critic(), reports_offload=hook.placement.offload != "none")
            self.value_source = critic
            if hook.refresh.every:
                store = open_refresh_store(hook, self.config.trainer.default_local_dir)
                self.value_source = HeadRefresh(critic, self._rollout_sampler(), store, hook, self.tokenizer,
                                                self._timer)
        if self.reference_critic is not None:
            self.reference = ExactReferenceValues(self.reference_critic, self.tokenizer)

    def _runs_critic(self) -> bool:
        estimator = self.config.algorithm.adv_estimator
        return estimator in ESTIMATORS or self.hook_config.score_outcome_estimators

    def _samples_values(self) -> bool:
        """format "rollout": the values are sampled from the rollout replicas (no critic worker group)."""
        return self.hook_config.critic.format == ROLLOUT_CRITIC_FORMAT

    def _samples_trees(self) -> bool:
        """format "tree": each training group is sampled as a tree (agent loop pav_tree), valued by its nodes."""
        return self.hook_config.critic.format == TREE_CRITIC_FORMAT

    def _next_train_batch(self, num_prompts: int | None = None):
        """verl's next training batch; with format "tree" it names the tree agent loop for every prompt."""
        batch = super()._next_train_batch(num_prompts)
        if self._samples_trees():
            if "agent_name" in batch.keys():
                raise ValueError(
                    "verl_prm.critic.format=tree samples every training prompt with agent loop "
                    f"{TREE_AGENT_LOOP_NAME}, but the training data names its own agent loop (column agent_name): "
                    "drop that column or use another verl_prm.critic.format"
                )
            from verl.utils import tensordict_utils as tu

            tu.assign_non_tensor_data(batch, "agent_name", TREE_AGENT_LOOP_NAME)
        return batch

    def _rollout_sampler(self) -> RolloutSampledValues:
        """The sampling critic over verl's LLM server client (the agent loop's) and the run's reward function."""
        rollout = self.config.actor_rollout_ref.rollout
        critic = self.hook_config.critic
        sampler = RolloutCritic(critic, self.get_llm_client(), self.tokenizer,
                                OutcomeScorer(run_reward_function(self.config), critic.mc_success_threshold),
                                sampling_params(rollout), int(rollout.response_length))
        return RolloutSampledValues(sampler, self.checkpoint_manager, critic.mc_success_threshold, self._timer)

    def _init_prover_critic(self):
        """The critic worker group on its verl resource pool, the critic replicas loaded."""
        name = CRITIC_POOL_NAME if self.hook_config.placement.pool == "own" else "global_pool"
        tokenizer_path = policy_tokenizer_path(self.hook_config, self.config.actor_rollout_ref.model, self.tokenizer)
        return create_critic_group(self.hook_config, self.resource_pool_manager.resource_pool_dict[name],
                                   self.config.trainer.device, tokenizer_path)

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
        sampling = self._samples_values() or self.hook_config.refresh.every
        fields = list(STEP_FIELDS) + (list(SAMPLING_FIELDS) if sampling else [])
        fields += list(TREE_FIELDS) if self._samples_trees() else []
        raw = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        return read_step_batch(raw, batch.keys, batch.tags, self.global_steps, self.tokenizer,
                               self.hook_config.steps, self._eos_token_ids())

    def _compute_advantage(self, batch, metrics: dict):
        """The step values and their metrics, then verl's own advantage phase (``PPOTrainer._compute_advantage``
        -> ``compute_advantage_for_multi_trajectories`` -> ``compute_advantage`` -> the registered estimator),
        whose step estimator reads the step tensors from ``estimator_step_inputs`` (module docstring)."""
        if not self._runs_critic():
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

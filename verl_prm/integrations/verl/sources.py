"""The registry of value sources: where a verl run's step values come from (``verl_prm.critic.source``).

Each source is one ``ValueSource`` entry that declares everything the rest of the plugin asks about it:

==========  =================================================================  ========  ========  ==========  ====
source      values                                                             critic    rollout   tree agent  ckpt
                                                                               workers   replicas  loop
==========  =================================================================  ========  ========  ==========  ====
checkpoint  a critic checkpoint (a learned PAV or a public PRM, ``format``)     yes       refresh   no          yes
exact       the closed-form values of an exact prover (``options.prover``)      yes       no        no          no
sampled     Monte-Carlo values sampled from the rollout replicas                no        yes       no          no
tree        the node values of tree-shaped groups                               no        no        yes         no
==========  =================================================================  ========  ========  ==========  ====

``settings`` names the ``verl_prm.critic`` keys the source reads; the checks of a run follow from the
declarations (``verl_prm.integrations.verl.run_config.check_source``: a checkpoint to load, a prover to build, a
reward that can score continuations, a tree shape that fits ``rollout.n``, ...); ``build`` makes the source of
values (``value_sources.StepValueSource``) once verl's workers exist. The trainer hook, the run checks and the
worker-group code ask ``value_source(hook)``; none of them compares source names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from verl.utils.fs import copy_to_local

from verl_prm.choices import VALUE_SOURCES
from verl_prm.config.hook import CriticSection, HookConfig
from verl_prm.integrations.verl.critic_group import CRITIC_POOL_NAME, create_critic_group, policy_tokenizer_path
from verl_prm.integrations.verl.head_refresh import HeadRefresh, open_refresh_store
from verl_prm.integrations.verl.rollout_sampler import RolloutSampler, run_reward_function, sampling_params
from verl_prm.integrations.verl.value_sources import (
    CriticWorkerValues,
    RolloutSampledValues,
    StepValueSource,
    TreeNodeValues,
)
from verl_prm.labeling.scoring import OutcomeScorer

__all__ = ["SOURCES", "ValueSource", "critic_worker_kwargs", "rollout_sampled_values", "value_source"]

# A ``PavSyncTrainer`` once verl's workers exist (``hook_config``, ``config``, ``tokenizer``,
# ``resource_pool_manager``, ``get_llm_client()``, ``checkpoint_manager``, ``_timer``).
Trainer = Any

# the sampling keys of verl_prm.critic (source sampled, and verl_prm.refresh with source checkpoint)
SAMPLING_SETTINGS = ("n_mc", "prefix_rule", "prefixes_per_response", "mc_token_budget", "success_threshold",
                     "pool_group_samples")


@dataclass(frozen=True)
class ValueSource:
    """One value source (module docstring)."""

    name: str
    doc: str
    settings: tuple[str, ...]  # the verl_prm.critic keys it reads
    critic_workers: bool  # a ProverCriticWorker group on a verl resource pool (verl_prm.placement)
    checkpoint: bool  # it loads critic weights (path, calibration, offload, shard, refresh apply)
    rollout_replicas: bool  # it samples through the rollout replicas, scored by the run's reward function
    tree_agent_loop: bool  # the training groups are sampled by the agent loop pav_tree
    exact_prover: bool  # verl_prm.critic.options name an exact prover, built once at startup
    build: Callable[[Trainer], StepValueSource]
    worker_kwargs: Callable[[CriticSection], dict[str, Any]] | None = None  # with critic_workers

    def samples_with_rollout(self, hook: HookConfig) -> bool:
        """Whether the run samples through the rollout replicas: the source itself, or verl_prm.refresh."""
        return self.rollout_replicas or bool(hook.refresh.every)


def rollout_sampled_values(trainer: Trainer) -> RolloutSampledValues:
    """The sampler over verl's LLM server client (the agent loop's) and the run's reward function."""
    rollout = trainer.config.actor_rollout_ref.rollout
    critic = trainer.hook_config.critic
    sampler = RolloutSampler(critic, trainer.get_llm_client(), trainer.tokenizer,
                             OutcomeScorer(run_reward_function(trainer.config), critic.success_threshold),
                             sampling_params(rollout), int(rollout.response_length))
    return RolloutSampledValues(sampler, trainer.checkpoint_manager, critic.success_threshold, trainer._timer)


def _critic_group(trainer: Trainer):
    """The critic worker group on its verl resource pool, the critic replicas loaded."""
    hook = trainer.hook_config
    name = CRITIC_POOL_NAME if hook.placement.pool == "own" else "global_pool"
    tokenizer_path = policy_tokenizer_path(hook.critic.path, trainer.config.actor_rollout_ref.model,
                                           trainer.tokenizer)
    model_path = copy_to_local(hook.critic.path) if hook.critic.path else None
    return create_critic_group(hook, trainer.resource_pool_manager.resource_pool_dict[name],
                               trainer.config.trainer.device, tokenizer_path, model_path,
                               critic_worker_kwargs(hook))


def _build_checkpoint(trainer: Trainer) -> StepValueSource:
    hook = trainer.hook_config
    critic = CriticWorkerValues(_critic_group(trainer), reports_offload=hook.placement.offload != "none")
    if not hook.refresh.every:
        return critic
    store = open_refresh_store(hook, trainer.config.trainer.default_local_dir)
    return HeadRefresh(critic, rollout_sampled_values(trainer), store, hook, trainer.tokenizer, trainer._timer)


def _build_exact(trainer: Trainer) -> StepValueSource:
    return CriticWorkerValues(_critic_group(trainer))


def _build_tree(trainer: Trainer) -> StepValueSource:
    hook = trainer.hook_config
    return TreeNodeValues(hook.critic.success_threshold, hook.tree.roots, hook.critic.group_prior_strength)


def _checkpoint_worker_kwargs(critic: CriticSection) -> dict[str, Any]:
    """``ProverCritic.from_pretrained`` keyword arguments. Best-of-K stays 1 here: the estimators apply
    ``algorithm.pav.best_of_k`` to the raw values (applying it in the critic too would transform twice)."""
    kwargs: dict[str, Any] = {
        "format": critic.format,
        "best_of_k": 1,
        "max_tokens_per_batch": critic.max_tokens_per_batch,
        "truncation": critic.truncation,
        "allow_pickle": critic.allow_pickle,
        "calibration": critic.calibration,
    }
    if critic.dtype != "auto":
        kwargs["dtype"] = critic.dtype
    kwargs.update(dict(critic.options))
    return kwargs


def _exact_worker_kwargs(critic: CriticSection) -> dict[str, Any]:
    """``ExactCritic.from_options`` keyword arguments: ``prover`` and the prover's options."""
    return dict(critic.options)


_CHECKPOINT_SETTINGS = ("path", "format", "options", "max_tokens_per_batch", "dtype", "truncation",
                        "allow_pickle", "calibration")

SOURCES: dict[str, ValueSource] = {source.name: source for source in (
    ValueSource("checkpoint", "a critic checkpoint: a learned PAV or a public PRM, in verl_prm.critic.format",
                settings=_CHECKPOINT_SETTINGS + SAMPLING_SETTINGS, critic_workers=True, checkpoint=True,
                rollout_replicas=False, tree_agent_loop=False, exact_prover=False, build=_build_checkpoint,
                worker_kwargs=_checkpoint_worker_kwargs),
    ValueSource("exact", "the closed-form values of the exact prover verl_prm.critic.options.prover",
                settings=("options",), critic_workers=True, checkpoint=False, rollout_replicas=False,
                tree_agent_loop=False, exact_prover=True, build=_build_exact, worker_kwargs=_exact_worker_kwargs),
    ValueSource("sampled", "Monte-Carlo values sampled from the run's rollout replicas",
                settings=SAMPLING_SETTINGS + ("group_prior_strength",), critic_workers=False, checkpoint=False,
                rollout_replicas=True, tree_agent_loop=False, exact_prover=False, build=rollout_sampled_values),
    ValueSource("tree", "the node values of tree-shaped groups (the mean outcome of the leaves below a node)",
                settings=("success_threshold", "group_prior_strength"), critic_workers=False, checkpoint=False,
                rollout_replicas=False, tree_agent_loop=True, exact_prover=False, build=_build_tree),
)}
if tuple(SOURCES) != VALUE_SOURCES:  # the typed setting's choices (verl_prm.choices.ValueSourceName)
    raise ImportError(f"verl_prm.choices.VALUE_SOURCES {VALUE_SOURCES} and the registry {tuple(SOURCES)} differ")


def value_source(hook: HookConfig) -> ValueSource:
    """The registry entry of the run's ``verl_prm.critic.source`` (a choice checked when the config is read)."""
    return SOURCES[hook.critic.source]


def critic_worker_kwargs(hook: HookConfig) -> dict[str, Any]:
    """The keyword arguments a ``ProverCriticWorker`` builds its critic with, from ``verl_prm.critic``."""
    source = value_source(hook)
    if source.worker_kwargs is None:
        raise ValueError(f"verl_prm.critic.source={source.name} runs no critic workers")
    return source.worker_kwargs(hook.critic)

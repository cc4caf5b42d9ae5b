"""Every startup check of a verl run that uses verl-prm, in one module: the typed sections, what the value source
needs of the run (``verl_prm.integrations.verl.sources``), the estimator name against verl's registry, the trainer
hook, the critic (checkpoint or exact prover), the reward and the rollout settings a sampling or tree source
depends on, and the training data's sources.

``validate_run_config`` runs them all. The startup check (``startup.StartupCheck``, a Hydra callback) calls it in
the driver before verl's ``main`` starts Ray; the trainer hook calls it again when verl builds it. The typed
sections and their own checks are the library's (``verl_prm.config``, ``verl_prm.config.hook``).
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

from verl_prm.checkpoints import CheckpointError, resolve_checkpoint
from verl_prm.checks import is_class_path
from verl_prm.config import PavConfig, read_pav_config
from verl_prm.config.hook import (
    HOOK_TRAINER_NAME,
    REWARD_MANAGER_NAME,
    TREE_AGENT_LOOP_NAME,
    ConfigError,
    CriticSection,
    DiagnosticsSection,
    HookConfig,
    build_exact_critic,
    check_finite_floats,
    read_hook_config,
    select_key,
)
from verl_prm.estimators import ESTIMATORS, TREE_ESTIMATORS
from verl_prm.integrations.verl.data_sources import default_scorer_data_sources, file_data_sources
from verl_prm.integrations.verl.rollout_sampler import run_reward_function
from verl_prm.integrations.verl.sources import ValueSource, value_source
from verl_prm.training.calibration import CalibrationError, checkpoint_calibration, read_calibration

__all__ = [
    "check_continuation_context",
    "check_critic_path",
    "check_default_scorer_data_sources",
    "check_exact_prover",
    "check_reference_prover",
    "check_sampling_run",
    "check_source_settings",
    "check_tree_run",
    "known_estimators",
    "validate_run_config",
]

# reward managers whose reward is the reward function of one response (so a continuation is scored the same way)
FUNCTION_REWARD_MANAGERS = (REWARD_MANAGER_NAME, "naive")
ROLLOUT = "actor_rollout_ref.rollout"


def known_estimators() -> set[str]:
    """The advantage estimators a verl run can name: verl's registry plus this plugin's."""
    return set(ADV_ESTIMATOR_REGISTRY) | set(ESTIMATORS)


def _check_estimator(estimator: Any) -> None:
    if estimator is None:
        return
    known = known_estimators()
    if str(estimator) in known:
        return
    close = difflib.get_close_matches(str(estimator), sorted(known), n=1)
    raise ConfigError(
        f"algorithm.adv_estimator={estimator!r} is not a registered advantage estimator"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; known: {', '.join(sorted(known))}"
    )


# ---------------------------------------------------------------------------------------------- the value source
def _unset(value: Any) -> bool:
    return value is None or str(value).strip() == ""


def check_source_settings(hook: HookConfig) -> None:
    """What the value source declares (``sources.SOURCES``) against the ``verl_prm`` settings: a checkpoint's
    settings (``path``, a ``calibration`` file) only with a source that reads them; an own pool only with critic
    workers; offload and sharding only with critic weights; an exact prover named; a refresh only of a learned
    PAV's value head. Each ``ConfigError`` names the key and the fix."""
    source, critic, placement = value_source(hook), hook.critic, hook.placement
    named = f"verl_prm.critic.source={source.name}"
    if "path" not in source.settings and not _unset(critic.path):
        raise ConfigError(f"verl_prm.critic.path={critic.path!r} is unused with {named} (the values: {source.doc}, "
                          "not a checkpoint): set verl_prm.critic.path=null")
    if "calibration" not in source.settings and critic.calibration != CriticSection.calibration:
        raise ConfigError(f"verl_prm.critic.calibration={critic.calibration!r} is unused with {named} (no "
                          "checkpoint's values to calibrate): remove the override")
    if not source.critic_workers and placement.pool != "colocated":
        raise ConfigError(f"verl_prm.placement.pool=own is unused with {named} (no critic workers): set "
                          "verl_prm.placement.pool=colocated")
    if not source.checkpoint and (placement.offload != "none" or placement.shard != "none"):
        raise ConfigError(f"verl_prm.placement.offload/shard are unused with {named} (no critic weights): set "
                          "verl_prm.placement.offload=none and verl_prm.placement.shard=none")
    if source.exact_prover and not is_class_path(critic.options.get("prover")):
        raise ConfigError(
            f"{named} needs verl_prm.critic.options.prover, the 'module:Class' of the exact prover that gives the "
            f"values (got {critic.options.get('prover')!r}): add +verl_prm.critic.options.prover=module:Class "
            "(e.g. verl_prm.apps.arithmetic.prover:ArithmeticProver)"
        )
    _check_refresh(hook, source)


def _check_refresh(hook: HookConfig, source: ValueSource) -> None:
    """A refresh refits a value head: a checkpoint of format value_head, one replica per worker, no calibration
    file for the old head."""
    refresh, critic = hook.refresh, hook.critic
    if not refresh.every:
        return
    if not source.checkpoint or critic.format != "value_head":
        raise ConfigError(
            f"verl_prm.refresh.every={refresh.every} refits the value head of a learned PAV (verl_prm.critic.source="
            f"checkpoint, format value_head), got verl_prm.critic.source={critic.source} (format {critic.format}): "
            "set verl_prm.refresh.every=0"
        )
    if hook.placement.shard != "none":
        raise ConfigError("verl_prm.refresh sets the value head on every critic worker's replica: set "
                          "verl_prm.placement.shard=none, or verl_prm.refresh.every=0")
    if critic.calibration not in ("auto", "none"):
        raise ConfigError(
            f"verl_prm.critic.calibration={critic.calibration!r} maps the values of the checkpoint's head, which "
            "verl_prm.refresh refits to the sampled values: set verl_prm.critic.calibration=none"
        )


def check_critic_path(critic: CriticSection) -> None:
    """``verl_prm.critic.path`` names a loadable checkpoint (a local directory with safetensors weights, or pickle
    ones with ``allow_pickle``; a cached hub id when offline); a remote ``scheme://`` path is copied by verl."""
    path = critic.path
    if _unset(path):
        raise ConfigError(
            "verl_prm.critic.path is required with verl_prm.critic.source=checkpoint: set "
            "verl_prm.critic.path=/path/to/prover_critic (a Hugging Face checkpoint; `verl-prm train` writes one)"
        )
    path = str(path)
    if "://" in path:  # hdfs:// and the like: verl copies it to a local directory when the worker starts
        return
    try:
        resolve_checkpoint(path, "critic", allow_pickle=critic.allow_pickle)
    except (FileNotFoundError, CheckpointError) as error:
        raise ConfigError(f"verl_prm.critic.path: {error}") from None


def _check_calibration(hook: HookConfig) -> None:
    """Read and check the calibration a checkpoint critic will apply, with the function its workers load it with
    (``checkpoint_calibration``): a broken, flat or non-monotone file, a directory without calibration.json and a
    file fitted for other weights stop the run here, and so does a refresh of a calibrated critic."""
    critic = hook.critic
    path = str(critic.path)
    if critic.calibration not in ("auto", "none") and not Path(critic.calibration).exists():
        raise ConfigError(f"verl_prm.critic.calibration={critic.calibration!r} does not exist: name a calibration.json "
                          "written by `verl-prm train` for this critic's weights, or use auto / none")
    try:
        if "://" in path:  # a remote checkpoint is copied when the workers start: only a named file can be read now
            calibration = None if critic.calibration in ("auto", "none") else read_calibration(critic.calibration)
        else:
            local = resolve_checkpoint(path, "critic", allow_pickle=critic.allow_pickle)
            calibration = checkpoint_calibration(local, critic.calibration)
    except (CalibrationError, CheckpointError) as error:
        raise ConfigError(f"verl_prm.critic.calibration={critic.calibration}: {error}") from None
    if calibration is not None and hook.refresh.every:
        raise ConfigError(
            f"verl_prm.refresh.every={hook.refresh.every} refits the value head of {path}, but "
            f"verl_prm.critic.calibration={critic.calibration} applies {calibration.describe()}, a map fitted for the "
            "checkpoint's head: set verl_prm.critic.calibration=none"
        )


def check_exact_prover(critic: CriticSection) -> None:
    """Build the exact prover of ``verl_prm.critic.options`` once, so that a prover that cannot be imported or a bad
    prover option fails at startup; errors name the option's key."""
    build_exact_critic(critic.options, "verl_prm.critic.options")


def check_reference_prover(diagnostics: DiagnosticsSection) -> None:
    """The same for ``verl_prm.diagnostics.reference`` (nothing to check when it is null)."""
    if diagnostics.reference is not None:
        build_exact_critic(diagnostics.reference, "verl_prm.diagnostics.reference")


# ---------------------------------------------------------------------------------------------- the rest of the run
def check_sampling_run(config: Any, sampler: str = "verl_prm.critic.source=sampled") -> None:
    """A run that samples step values through the rollout replicas (``sampler``: the source or
    ``verl_prm.refresh``); raises ``ConfigError`` naming the key.

    A reward that cannot score a continuation (a reward model, a reward manager other than pav/naive, an async
    reward function), a rollout context (``actor_rollout_ref.rollout.max_model_len``) shorter than a prompt plus a
    full response, more than one update per weight sync (``trainer.v1.sync.parameter_sync_step``: the values
    would be of older weights than the actor's), or, without a custom reward function, training data whose
    ``data_source`` verl's default scorer does not know (``check_default_scorer_data_sources``).
    """
    if select_key(config, "reward.reward_model.enable", False):
        raise ConfigError(
            f"{sampler} scores continuations with the run's reward function, but reward.reward_model.enable=True (a "
            "reward model) cannot score them: set reward.reward_model.enable=False or use another "
            "verl_prm.critic.source"
        )
    manager = select_key(config, "reward.reward_manager.name", "naive")
    origin = select_key(config, "reward.reward_manager.source", "register")
    if origin != "register" or manager not in FUNCTION_REWARD_MANAGERS:
        raise ConfigError(
            f"{sampler} scores continuations with the reward function alone, but reward.reward_manager.name="
            f"{manager!r} (source {origin!r}) may reward a response otherwise: set reward.reward_manager.name to one "
            f"of {FUNCTION_REWARD_MANAGERS}"
        )
    if inspect.iscoroutinefunction(run_reward_function(_attribute_config(config))):
        raise ConfigError(
            f"{sampler} calls the reward function synchronously, but reward.custom_reward_function is an async "
            "function: give it a synchronous function"
        )
    check_default_scorer_data_sources(config)
    response_length = int(select_key(config, f"{ROLLOUT}.response_length", 0) or 0)
    if response_length < 1:
        raise ConfigError(f"{ROLLOUT}.response_length must be >= 1 with {sampler}, got {response_length}")
    check_continuation_context(config, sampler)
    sync_step = select_key(config, "trainer.v1.sync.parameter_sync_step", 1)
    if int(sync_step) != 1:
        raise ConfigError(
            f"{sampler} samples from the replicas with the actor's current weights, but "
            f"trainer.v1.sync.parameter_sync_step={sync_step} updates the actor between weight syncs, so the values "
            "would not be of the policy that generated the batch: set trainer.v1.sync.parameter_sync_step=1"
        )


def _attribute_config(config: Any) -> Any:
    """``config`` as verl's reward loader reads it (``config.reward.get(...)``): a DictConfig."""
    return config if OmegaConf.is_config(config) else OmegaConf.create(config)


def check_continuation_context(config: Any, who: str) -> None:
    """A source that continues step prefixes of responses (``who``: sampled, tree, the refresh) sends the rollout
    prompts of up to ``prompt_length + response_length`` tokens (prompt + response prefix + continuation): a
    ``max_model_len`` below that is a ``ConfigError`` naming the key."""
    prompt_length = int(select_key(config, f"{ROLLOUT}.prompt_length", 0) or 0)
    response_length = int(select_key(config, f"{ROLLOUT}.response_length", 0) or 0)
    max_model_len = select_key(config, f"{ROLLOUT}.max_model_len", None)
    if max_model_len is not None and int(max_model_len) < prompt_length + response_length:
        raise ConfigError(
            f"{ROLLOUT}.max_model_len={max_model_len} cannot take a step prefix of a full-length response: "
            f"{who} sends prompts of up to {ROLLOUT}.prompt_length + response_length = "
            f"{prompt_length + response_length} tokens (prompt + response prefix + continuation): raise "
            f"{ROLLOUT}.max_model_len to {prompt_length + response_length} or null"
        )


def check_tree_run(config: Any, hook: HookConfig) -> None:
    """A run with tree-shaped groups (``verl_prm.critic.source=tree``); raises ``ConfigError`` naming the key.

    ``actor_rollout_ref.rollout.n`` that the shape cannot reach (n < roots, (n - roots) not a multiple of
    branch_width, no branch point at all, or for branch_rule fixed not roots x (1 + branches_per_response x
    branch_width)); a rollout context (``max_model_len``) that cannot hold a branch (prompt + a full response);
    a reward that cannot score a leaf (training data whose ``data_source`` verl's default scorer does not know,
    without a custom reward function: ``check_default_scorer_data_sources``); and a default agent loop of
    ``pav_tree``, which would sample the validation groups as trees too.
    """
    n = int(select_key(config, f"{ROLLOUT}.n", 1))
    try:
        hook.tree.shape().branch_points(n)
    except ValueError as error:
        raise ConfigError(f"verl_prm.tree with {ROLLOUT}.n={n}: {error}") from None
    check_continuation_context(config, "verl_prm.critic.source=tree")
    check_default_scorer_data_sources(config)
    default_loop = select_key(config, f"{ROLLOUT}.agent.default_agent_loop", "single_turn_agent")
    if default_loop == TREE_AGENT_LOOP_NAME:
        raise ConfigError(
            f"{ROLLOUT}.agent.default_agent_loop={TREE_AGENT_LOOP_NAME} would sample the validation groups as "
            "trees too: keep the default (single_turn_agent); the trainer hook names the tree agent loop for the "
            "training batches when verl_prm.critic.source=tree"
        )


def check_default_scorer_data_sources(config: Any, function: Any = None) -> None:
    """Without ``reward.custom_reward_function``, refuse training files (``data.train_files``) whose
    ``data_source`` values verl's default scorer does not know (``ConfigError`` naming the file, the values and
    the key to set). Files that cannot be read here are left to verl."""
    if select_key(config, "reward.custom_reward_function.path", None):
        return
    names, prefixes = default_scorer_data_sources(function)
    if not names and not prefixes:
        return  # the scorer's source gave no names: nothing to check against
    files = select_key(config, "data.train_files", None)
    files = [files] if isinstance(files, str) else list(files or [])
    for path in files:
        sources = file_data_sources(str(path))
        unknown = sorted(s for s in sources or () if s not in names and not s.startswith(prefixes))
        if unknown:
            raise ConfigError(
                f"data.train_files {path} holds data_source values that verl's default reward function does not "
                f"score ({', '.join(map(repr, unknown[:5]))}{', ...' if len(unknown) > 5 else ''}; it knows "
                f"{', '.join(sorted(names))} and the prefixes {', '.join(prefixes) or 'none'}): set "
                "reward.custom_reward_function.path and .name to a function that scores them"
            )


def validate_run_config(config: Any) -> tuple[HookConfig, PavConfig]:
    """Check the verl-prm parts of a composed verl run config; return the typed hook and estimator configs.

    Checks, in order (each a ``ConfigError`` naming the key):
    unknown, renamed or mistyped keys under ``verl_prm`` and ``algorithm.pav``, and values out of their declared
    bounds; what the value source declares (``check_source_settings``); a NaN or infinite float anywhere under
    them; an ``algorithm.adv_estimator`` that neither verl nor the plugin registers; a step estimator (pav_*,
    prm_aggregate) without ``trainer.v1.trainer_mode=pav_sync`` (the hook); a tree estimator (``tree_rl``,
    ``spo_tree``) without ``verl_prm.critic.source=tree``. When the hook scores steps: with source checkpoint a
    ``verl_prm.critic.path`` that is missing, does not exist, is a file, has no weights or only pickle weights
    (``verl_prm.critic.allow_pickle``), or is a hub id that is not cached while offline, and the calibration file
    it would apply (``verl_prm.critic.calibration``: unreadable, malformed, flat, non-monotone, fitted for other
    weights, or applied to a head ``verl_prm.refresh`` refits); with source exact a prover that cannot be
    imported or a bad prover option (the prover is built once); with ``verl_prm.diagnostics.reference`` the same
    for its exact prover, and a reference in a run that scores no steps. When the hook runs: with a source that
    samples through the rollout replicas (sampled, or a refresh) the reward, rollout and sync settings
    (``check_sampling_run``); with tree-shaped groups the shape against ``rollout.n`` (``check_tree_run``); both
    refuse training data that verl's default scorer cannot score.
    """
    hook = read_hook_config(select_key(config, "verl_prm"))
    check_source_settings(hook)
    source = value_source(hook)
    algorithm = select_key(config, "algorithm")
    try:
        pav = read_pav_config(algorithm)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
    # after the typed checks (their messages give the range): the floats no typed knob covers
    check_finite_floats(select_key(config, "verl_prm"), "verl_prm")
    check_finite_floats(select_key(config, "algorithm.pav"), "algorithm.pav")
    estimator = select_key(config, "algorithm.adv_estimator")
    _check_estimator(estimator)
    trainer_mode = select_key(config, "trainer.v1.trainer_mode")
    hook_selected = trainer_mode == HOOK_TRAINER_NAME
    if estimator in ESTIMATORS and not hook_selected:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} needs the step tensors that only the verl-prm trainer hook "
            f"computes, but trainer.v1.trainer_mode={trainer_mode}: set trainer.v1.trainer_mode={HOOK_TRAINER_NAME} "
            "(or add +verl_prm=pav with hydra.searchpath=[pkg://verl_prm.config], which sets it)"
        )
    if estimator in TREE_ESTIMATORS and not source.tree_agent_loop:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} reads the node values and leaf counts of tree-shaped groups, but "
            f"verl_prm.critic.source={source.name}: set verl_prm.critic.source=tree (and verl_prm.tree.*), "
            "or use pav_grpo, pav_rloo, ... with these step values"
        )
    if hook_selected and scores_steps(hook, estimator):
        if source.exact_prover:
            check_exact_prover(hook.critic)
        if source.checkpoint:
            check_critic_path(hook.critic)
            _check_calibration(hook)
        check_reference_prover(hook.diagnostics)
    elif hook.diagnostics.reference is not None:
        raise ConfigError(
            "verl_prm.diagnostics.reference is set, but this run scores no steps (the trainer hook "
            f"trainer.v1.trainer_mode={HOOK_TRAINER_NAME} with a step estimator or "
            "verl_prm.score_outcome_estimators=true): set verl_prm.diagnostics.reference=null"
        )
    if hook_selected and source.samples_with_rollout(hook):
        check_sampling_run(config, f"verl_prm.critic.source={source.name}" if source.rollout_replicas
                           else "verl_prm.refresh")
    if hook_selected and source.tree_agent_loop:
        check_tree_run(config, hook)
    return hook, pav


def scores_steps(hook: HookConfig, estimator: Optional[str]) -> bool:
    """Whether the trainer hook values the batch's steps: a step estimator reads them, and with an outcome-only
    estimator ``verl_prm.score_outcome_estimators`` still logs the ``pav/*`` metrics."""
    return estimator in ESTIMATORS or hook.score_outcome_estimators

"""The startup validation of a whole verl run config that uses verl-prm: the typed sections, the estimator name
against verl's registry, the trainer hook, and the critic (checkpoint or exact prover).

The typed sections and their checks are the library's (``verl_prm.config``, ``verl_prm.config.hook``); this module
adds what needs verl: the registered estimators and where verl's config keeps each setting.
"""

from __future__ import annotations

import difflib
from typing import Any, Optional

from verl_prm.checkpoints import CheckpointError, resolve_checkpoint
from verl_prm.config import PavConfig, read_pav_config
from verl_prm.config.hook import (
    EXACT_CRITIC_FORMAT,
    HOOK_TRAINER_NAME,
    ROLLOUT_CRITIC_FORMAT,
    TREE_CRITIC_FORMAT,
    ConfigError,
    HookConfig,
    check_critic_path,
    check_exact_prover,
    check_reference_prover,
    check_finite_floats,
    select_key,
    read_hook_config,
)
from verl_prm.estimators import ESTIMATORS, TREE_ESTIMATORS
from verl_prm.training.calibration import CalibrationError, checkpoint_calibration, read_calibration

__all__ = ["known_estimators", "validate_run_config"]


def known_estimators() -> Optional[set[str]]:
    """The advantage estimators a verl run can name: verl's registry plus this plugin's (None without verl)."""
    try:
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    except ImportError:
        return None
    return set(ADV_ESTIMATOR_REGISTRY) | set(ESTIMATORS)


def _check_estimator(estimator: Any) -> None:
    if estimator is None:
        return
    known = known_estimators()
    if known is None or str(estimator) in known:
        return
    close = difflib.get_close_matches(str(estimator), sorted(known), n=1)
    raise ConfigError(
        f"algorithm.adv_estimator={estimator!r} is not a registered advantage estimator"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; known: {', '.join(sorted(known))}"
    )


def _check_calibration(hook: HookConfig) -> None:
    """Read and check the calibration a checkpoint critic will apply, with the function its workers load it with
    (``checkpoint_calibration``): a broken, flat or non-monotone file, a directory without calibration.json and a
    file fitted for other weights stop the run here, and so does a refresh of a calibrated critic."""
    critic = hook.critic
    path = str(critic.path)
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


def validate_run_config(config: Any) -> tuple[HookConfig, PavConfig]:
    """Check the verl-prm parts of a composed verl run config; return the typed hook and estimator configs.

    Checks, in order (each a ``ConfigError`` naming the key):
    unknown or mistyped keys under ``verl_prm`` and ``algorithm.pav``; a NaN or infinite float anywhere under
    them; out-of-range estimator knobs (``alpha < 0``, ``best_of_k < 1``, ...); an ``algorithm.adv_estimator``
    that neither verl nor the plugin registers; a step estimator (pav_*, prm_aggregate) without
    ``trainer.v1.trainer_mode=pav_sync`` (the hook); the hook without ``verl_prm.critic.path``, or with a path
    that does not exist, is a file, has no weights or only pickle weights (``verl_prm.critic.allow_pickle``), or
    is a hub id that is not cached while offline; the calibration file it would apply (``verl_prm.critic.calibration``:
    unreadable, malformed, flat, non-monotone, fitted for other weights, or applied to a head
    ``verl_prm.refresh`` refits); with ``verl_prm.critic.format=exact``: a path set, no
    ``options.prover``, a prover that cannot be imported or a bad prover option (the prover is built once);
    with ``verl_prm.diagnostics.reference``: the same for its exact prover, and a run that scores no steps;
    out-of-range step, critic, placement and diagnostics settings; a tree estimator (``tree_rl``, ``spo_tree``)
    without ``verl_prm.critic.format=tree``.
    """
    hook = read_hook_config(select_key(config, "verl_prm"))
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
    if estimator in TREE_ESTIMATORS and hook.critic.format != TREE_CRITIC_FORMAT:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} reads the node values and leaf counts of tree-shaped groups, but "
            f"verl_prm.critic.format={hook.critic.format}: set verl_prm.critic.format=tree (and verl_prm.tree.*), "
            "or use pav_grpo, pav_rloo, ... with these step values"
        )
    if hook_selected and (estimator in ESTIMATORS or hook.score_outcome_estimators):
        if hook.critic.format == EXACT_CRITIC_FORMAT:
            check_exact_prover(hook.critic)
        elif hook.critic.format in (ROLLOUT_CRITIC_FORMAT, TREE_CRITIC_FORMAT):
            pass  # no checkpoint; the rollout and reward settings are checked by the trainer (rollout_critic, tree_rollout)
        else:
            check_critic_path(hook.critic.path, hook.critic.allow_pickle)
            _check_calibration(hook)
        check_reference_prover(hook.diagnostics)
    elif hook.diagnostics.reference is not None:
        raise ConfigError(
            "verl_prm.diagnostics.reference is set, but this run scores no steps (the trainer hook "
            f"trainer.v1.trainer_mode={HOOK_TRAINER_NAME} with a step estimator or "
            "verl_prm.score_outcome_estimators=true): set verl_prm.diagnostics.reference=null"
        )
    return hook, pav

"""Entry point of the "verl.plugins" group: ``import verl`` imports this module in every process.

It registers every name the plugin adds to verl: the estimators and the CPU platform (``verl_prm.integrations.verl.platform``;
selected only on a host without an accelerator or with ``VERL_PLATFORM=cpu``) at once, the ``hf`` rollout when
verl imports its rollout registries, and the trainer hook ``pav_sync``
(``verl_prm.integrations.verl.hook_trainer``) and the reward manager ``pav`` (``verl_prm.integrations.verl.reward_manager``) as soon as verl imports the registry
they go into (``verl.trainer.ppo.v1`` and ``verl.experimental.reward_loop.reward_manager``; the agent loop
``pav_tree`` of tree-shaped groups into ``verl.experimental.agent_loop.agent_loop``): importing those
verl modules costs seconds, and most processes of a run (rollout servers, actor workers) never need them. A
meta-path finder wraps the loader of exactly those two packages and registers right after the package has
executed, before the importer gets it back; a package that is already imported is registered at once.

verl only logs a plugin's import failure at DEBUG level, so a failure here is logged at ERROR level and every
name of the plugin is registered as a stub that raises the original error when used: a run that asks for
``pav_grpo``, trainer ``pav_sync`` or reward manager ``pav`` then says why it is missing instead of "Unknown ...".
"""

from __future__ import annotations

import logging
import traceback
from typing import Callable

from verl_prm import SUPPORTED_VERL_VERSION
from verl_prm.config.names import HOOK_TRAINER_NAME, REWARD_MANAGER_NAME, TREE_AGENT_LOOP_NAME
from verl_prm.estimators import ESTIMATORS
from verl_prm.integrations.verl.attention import register_attention_resolvers
from verl_prm.integrations.verl.import_hooks import register_or_defer, register_when_imported
from verl_prm.integrations.verl.platform import register_platform, register_rollout_when_imported
from verl_prm.integrations.verl.trl_fix import install_trl_fix

logger = logging.getLogger("verl_prm")

# verl package -> the registration that must run once it is imported
TRAINER_REGISTRY_MODULE = "verl.trainer.ppo.v1"
REWARD_REGISTRY_MODULE = "verl.experimental.reward_loop.reward_manager"
AGENT_LOOP_REGISTRY_MODULE = "verl.experimental.agent_loop.agent_loop"

load_error: BaseException | None = None


class PluginLoadError(RuntimeError):
    """verl-prm could not register itself in verl."""


def check_verl_version(version: str) -> None:
    if version != SUPPORTED_VERL_VERSION:
        raise PluginLoadError(
            f"verl-prm supports verl {SUPPORTED_VERL_VERSION} (it uses verl internals), but verl {version} is "
            f"installed: pip install 'verl[verl-core]=={SUPPORTED_VERL_VERSION}'"
        )


def _register_trainer() -> None:
    register_or_defer("verl_prm.integrations.verl.hook_trainer", "register_trainer_hook")


def _register_reward_manager() -> None:
    register_or_defer("verl_prm.integrations.verl.reward_manager", "register_reward_manager")


def _register_tree_agent_loop() -> None:
    """verl's agent loop ``pav_tree`` (tree-shaped groups), by class path: the module loads when a worker runs it."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    _agent_loop_registry.setdefault(
        TREE_AGENT_LOOP_NAME, {"_target_": "verl_prm.integrations.verl.tree_rollout.PavTreeAgentLoop"})


def _guarded(name: str, register: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        global load_error
        try:
            register()
        except Exception as error:  # keep verl importable; make the failure loud and the name explain it
            load_error = error
            logger.error("verl-prm failed to register %s with verl: %s\n%s", name, error, traceback.format_exc())
            _register_failure(error)

    return run


def register_all() -> None:
    """Register everything the plugin adds to verl. Idempotent."""
    import verl

    check_verl_version(verl.__version__)
    from verl.trainer.ppo.core_algos import register_adv_est

    # These modules import verl, and this runs while `import verl` loads its plugins: imported here, when verl's
    # package has finished (module top would import verl's submodules into a half-initialised verl).
    from verl_prm.integrations.verl.advantage import VERL_ESTIMATORS

    # each estimator of ESTIMATORS, reading the trainer hook's step tensors when verl calls it (advantage.py)
    for name, estimator in VERL_ESTIMATORS.items():
        register_adv_est(name)(estimator)
    register_attention_resolvers()
    register_platform()
    register_rollout_when_imported()
    install_trl_fix()
    register_when_imported(TRAINER_REGISTRY_MODULE, _guarded("trainer " + HOOK_TRAINER_NAME, _register_trainer))
    register_when_imported(
        REWARD_REGISTRY_MODULE, _guarded("reward manager " + REWARD_MANAGER_NAME, _register_reward_manager)
    )
    register_when_imported(AGENT_LOOP_REGISTRY_MODULE, _guarded("agent loop pav_tree", _register_tree_agent_loop))


def _register_failure(error: BaseException) -> None:
    try:
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    except Exception:  # verl itself is broken: nothing to register into
        return

    def failed_estimator(*args, **kwargs):
        raise PluginLoadError(f"verl-prm failed to load, so its estimators are unavailable: {error}") from error

    for name in ESTIMATORS:
        ADV_ESTIMATOR_REGISTRY.setdefault(name, failed_estimator)

    message = f"verl-prm failed to load, so its trainer {HOOK_TRAINER_NAME!r} and reward manager " \
        f"{REWARD_MANAGER_NAME!r} are unavailable: {error}"

    def register_trainer_stub() -> None:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

        class FailedPavTrainer(PPOTrainerSync):
            def __init__(self, *args, **kwargs):
                raise PluginLoadError(message) from error

        TRAINER_REGISTRY.setdefault(HOOK_TRAINER_NAME, FailedPavTrainer)

    def register_reward_stub() -> None:
        from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
        from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

        class FailedPavRewardManager(RewardManagerBase):
            def __init__(self, *args, **kwargs):
                raise PluginLoadError(message) from error

            async def run_single(self, data):
                raise PluginLoadError(message) from error

        REWARD_MANAGER.setdefault(REWARD_MANAGER_NAME, FailedPavRewardManager)

    for module_name, stub in ((TRAINER_REGISTRY_MODULE, register_trainer_stub),
                              (REWARD_REGISTRY_MODULE, register_reward_stub)):
        try:
            register_when_imported(module_name, stub)
        except Exception:  # verl's registries themselves are broken: nothing to register into
            logger.exception("verl-prm could not register a failure stub in %s", module_name)


def load() -> None:
    global load_error
    try:
        register_all()
        load_error = None
    except Exception as error:  # verl swallows plugin errors: make ours loud
        load_error = error
        logger.error("verl-prm failed to register with verl: %s\n%s", error, traceback.format_exc())
        _register_failure(error)


load()

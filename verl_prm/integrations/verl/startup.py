"""Startup check of a verl run that uses verl-prm, as a Hydra callback.

The ``verl_prm`` config group (``+verl_prm=pav`` with ``hydra.searchpath=[pkg://verl_prm.config]``) installs
``StartupCheck`` as a Hydra callback whose arguments are interpolations of the sections of the run config that
the checks read (``verl_prm``, ``algorithm``, ``trainer``, ``actor_rollout_ref.rollout``, ``reward``, ``data``).
Hydra builds its callbacks in the driver right after composing the config, before verl's ``main`` starts Ray or
loads any model, so every check (``run_config.validate_run_config``) runs in the constructor: Hydra
reports an exception raised there as the run's error (an exception in ``on_run_start`` would only be turned
into a warning). It also runs when verl did not load the plugin (``VERL_USE_EXTERNAL_PLUGINS=none``, or the
plugin failed to import), which verl itself would only report later as an unknown trainer or estimator.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from verl_prm.config.hook import HOOK_TRAINER_NAME, REWARD_MANAGER_NAME, ConfigError
from verl_prm.integrations.verl.run_config import validate_run_config

__all__ = ["PluginNotLoadedError", "StartupCheck", "check_plugin_loaded"]


class PluginNotLoadedError(RuntimeError):
    """verl did not load the verl-prm plugin, so the names the run config asks for are not registered."""


def check_plugin_loaded() -> None:
    """Raise ``PluginNotLoadedError`` unless verl has loaded the verl-prm plugin without error."""
    plugin = sys.modules.get("verl_prm.integrations.verl.plugin")
    if plugin is None:
        policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto")
        if policy.strip().lower() != "auto":
            reason = (
                f"VERL_USE_EXTERNAL_PLUGINS={policy!r} excludes it: unset it, or add verl_prm to the list "
                "(VERL_USE_EXTERNAL_PLUGINS=verl_prm)"
            )
        else:
            reason = (
                "its entry point was not found: reinstall the package (pip install verl-prm) in the environment "
                "that runs verl"
            )
        raise PluginNotLoadedError(
            f"this run uses verl-prm (the verl_prm config group: trainer {HOOK_TRAINER_NAME}, reward manager "
            f"{REWARD_MANAGER_NAME}, estimator pav_*), but verl did not load the verl-prm plugin: {reason}"
        )
    if getattr(plugin, "load_error", None) is not None:
        raise PluginNotLoadedError(f"the verl-prm plugin failed to load: {plugin.load_error}") from plugin.load_error


class StartupCheck(Callback):
    """Hydra callback: the plugin is loaded and the verl-prm config is valid, checked when Hydra builds it."""

    def __init__(self, verl_prm: Any = None, algorithm: Any = None, trainer: Any = None, rollout: Any = None,
                 reward: Any = None, data: Any = None) -> None:
        self.check(OmegaConf.create({"verl_prm": verl_prm, "algorithm": algorithm, "trainer": trainer,
                                     "actor_rollout_ref": {"rollout": rollout}, "reward": reward, "data": data}))

    @staticmethod
    def check(config: Any) -> None:
        """Raise ``PluginNotLoadedError`` or ``ConfigError`` (with "verl-prm startup check failed: ...")."""
        if "verl" in sys.modules:  # inside a verl entry point: the plugin must have been loaded with it
            check_plugin_loaded()
        try:
            validate_run_config(config)
        except ConfigError as error:
            raise ConfigError(f"verl-prm startup check failed: {error}") from None

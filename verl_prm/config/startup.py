"""Startup check of a verl run that uses verl-prm, as a Hydra callback.

The ``verl_prm`` config group (``+verl_prm=pav`` with ``hydra.searchpath=[pkg://verl_prm.config]``) installs
``StartupCheck`` as a Hydra callback. Hydra calls ``on_run_start`` in the driver, after composing the config and
before verl's ``main`` starts Ray or loads any model, so a misconfigured run fails in seconds with one message.
It also runs when verl did not load the plugin (``VERL_USE_EXTERNAL_PLUGINS=none``, or the plugin failed to
import), which verl itself would only report later as an unknown trainer or estimator.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from verl_prm.config.hook import ConfigError, validate_run_config

__all__ = ["PluginNotLoadedError", "StartupCheck", "check_plugin_loaded"]


class PluginNotLoadedError(RuntimeError):
    """verl did not load the verl-prm plugin, so the names the run config asks for are not registered."""


def check_plugin_loaded() -> None:
    """Raise ``PluginNotLoadedError`` unless verl has loaded the verl-prm plugin without error."""
    plugin = sys.modules.get("verl_prm.plugin")
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
            "this run uses verl-prm (the verl_prm config group: trainer pav_sync, reward manager pav, estimator "
            f"pav_*), but verl did not load the verl-prm plugin: {reason}"
        )
    if getattr(plugin, "load_error", None) is not None:
        raise PluginNotLoadedError(f"the verl-prm plugin failed to load: {plugin.load_error}") from plugin.load_error


class StartupCheck(Callback):
    """Hydra callback: plugin loaded and verl-prm config valid, before verl's main runs."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.check(config)

    @staticmethod
    def check(config: DictConfig) -> None:
        if "verl" in sys.modules:  # inside a verl entry point: the plugin must have been loaded with it
            check_plugin_loaded()
        try:
            validate_run_config(config)
        except ConfigError as error:
            # Hydra prints only the message of an error raised here; keep it a full sentence.
            raise ConfigError(f"verl-prm startup check failed: {error}") from None

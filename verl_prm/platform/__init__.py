"""verl's training loop on CPU: a CPU platform for verl and a transformers rollout, shipped by the plugin.

- ``verl_prm.platform.cpu``: the ``cpu`` platform (``PlatformRegistry``), chosen on a host without an
  accelerator or with ``VERL_PLATFORM=cpu``;
- ``verl_prm.platform.fixes``: runtime fixes of verl 0.9.1 for CPU, applied only in a process whose platform
  is the CPU platform (each one also a diff in ``patches/``);
- ``verl_prm.platform.rollout``: ``actor_rollout_ref.rollout.name=hf``, a rollout server on transformers
  ``generate`` registered in verl's rollout registries;
- ``verl_prm.platform.checks``: the startup check of a ``trainer.device=cpu`` run (settings that need a GPU);
- ``verl_prm.platform.loop``: the CPU loop's tiny model, data and ``main_ppo`` command (``examples/cpu_loop``,
  the end-to-end tests, ``verl-prm bench loop``).

The plugin entry point (``verl_prm.plugin``) calls :func:`register_platform` in every process verl starts; it
registers names only, and nothing of it runs unless the CPU platform is selected or the ``hf`` rollout asked for.
See docs/cpu_loop.md.
"""

from __future__ import annotations

__all__ = ["PLATFORM_NAME", "register_platform", "register_rollout_when_imported"]

PLATFORM_NAME = "cpu"
ROLLOUT_REGISTRY_MODULE = "verl.workers.rollout.replica"


def register_platform() -> None:
    """Register the ``cpu`` platform in verl's ``PlatformRegistry`` and attach its runtime fixes to the import
    of the verl modules they fix (they apply only where the CPU platform is selected). Idempotent."""
    from verl_prm.platform.fixes import install_cpu_fixes
    from verl_prm.plugin import _register_or_defer

    # a process that imports verl_prm.platform.cpu before verl: it registers at the end of its own import
    _register_or_defer("verl_prm.platform.cpu", "register_cpu_platform")
    install_cpu_fixes()


def register_rollout_when_imported() -> None:
    """Register the ``hf`` rollout as soon as verl imports its rollout registries (now if it has)."""
    from verl_prm.plugin import _register_or_defer, register_when_imported

    def register() -> None:
        # a process that unpickles the rollout server imports verl_prm.platform.rollout first: it registers
        # itself at the end of its import then
        _register_or_defer("verl_prm.platform.rollout", "register_rollout")

    register_when_imported(ROLLOUT_REGISTRY_MODULE, register)

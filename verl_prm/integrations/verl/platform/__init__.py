"""verl's training loop on CPU: a CPU platform for verl and a transformers rollout, shipped by the plugin.

- ``verl_prm.integrations.verl.platform.cpu``: the ``cpu`` platform (``PlatformRegistry``), chosen on a host without an
  accelerator or with ``VERL_PLATFORM=cpu``;
- ``verl_prm.integrations.verl.platform.fixes``: runtime fixes of verl 0.9.1 for CPU, applied only in a process
  whose platform is the CPU platform (each one also a diff in ``patches/``);
- ``verl_prm.integrations.verl.platform.rollout``: ``actor_rollout_ref.rollout.name=hf``, a rollout server on transformers
  ``generate`` registered in verl's rollout registries;
- ``verl_prm.integrations.verl.platform.checks``: the startup check of a ``trainer.device=cpu`` run (settings that need a GPU);

The plugin entry point (``verl_prm.integrations.verl.plugin``) calls :func:`register_platform` in every process
verl starts; it registers names only, and nothing of it runs unless the CPU platform is selected or the ``hf``
rollout asked for. The CPU loop's launcher (tiny model, data, ``main_ppo`` command) is an application:
``verl_prm.apps.cpu_loop``. Docs: verl on CPU.
"""

from __future__ import annotations

from verl_prm.integrations.verl.import_hooks import register_or_defer, register_when_imported

__all__ = ["register_platform", "register_rollout_when_imported"]

ROLLOUT_REGISTRY_MODULE = "verl.workers.rollout.replica"


def register_platform() -> None:
    """Register the ``cpu`` platform in verl's ``PlatformRegistry`` and attach its runtime fixes to the import
    of the verl modules they fix (they apply only where the CPU platform is selected). Idempotent."""
    # kept inside on purpose: tests/unit/test_layers.py shows that the import reader sees imports in functions
    from verl_prm.integrations.verl.platform.fixes import install_cpu_fixes

    # a process that imports verl_prm.integrations.verl.platform.cpu before verl: it registers at the end of its
    # own import
    register_or_defer("verl_prm.integrations.verl.platform.cpu", "register_cpu_platform")
    install_cpu_fixes()


def register_rollout_when_imported() -> None:
    """Register the ``hf`` rollout as soon as verl imports its rollout registries (now if it has)."""
    def register() -> None:
        # a process that unpickles the rollout server imports verl_prm.integrations.verl.platform.rollout first: it registers
        # itself at the end of its import then
        register_or_defer("verl_prm.integrations.verl.platform.rollout", "register_rollout")

    register_when_imported(ROLLOUT_REGISTRY_MODULE, register)

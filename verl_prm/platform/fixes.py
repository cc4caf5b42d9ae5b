"""Runtime fixes of verl 0.9.1 for the CPU platform, applied only where that platform is the process's platform.

Each fix is the smallest change that lets verl's own code run on CPU, and each is also an upstreamable diff
in ``patches/`` (the file named next to it); on a verl with the patches applied a fix changes nothing.

- ``0004-gloo-only-process-group-on-cpu.diff``: ``verl.utils.distributed`` builds the process-group backend
  ``f"cpu:gloo,{device}:{backend}"``, which is ``"cpu:gloo,cpu:gloo"`` on CPU and torch rejects ("Duplicate
  device type cpu"). Fix: the default ``backend`` of ``initialize_global_process_group_ray`` becomes
  ``"cpu:gloo"`` (its only call without a backend is the training worker's; the function object is changed, so
  every module that imported it sees the fix). The patch also fixes ``initialize_global_process_group`` (verl's
  SFT trainer), which ``main_ppo`` does not call.
- ``0005-fsdp-engine-on-cpu.diff``: verl's FSDP engines are registered for ``cuda`` and ``npu`` only, so
  ``EngineRegistry.get_engine_cls`` finds no engine for ``cpu``. Fix: register the same classes for ``cpu``
  (verl's registry API) once ``verl.workers.engine.fsdp.transformer_impl`` is imported. Only ``fsdp2`` runs on
  CPU (FSDP1 needs an accelerator device id): the startup check says so.
- ``0006-trl-without-value-head.diff``: verl's ``apply_monkey_patch`` (every FSDP model build) imports
  ``AutoModelForCausalLMWithValueHead`` from ``trl.experimental.ppo`` or ``trl`` whenever TRL is installed;
  TRL 1.16 has it in neither, so the import error ends the run (on any device). Fix: when the installed TRL
  lacks the class, ``apply_monkey_patch`` sees TRL as absent (the patch it would apply is to that class only).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["CPU_PROCESS_GROUP_BACKEND", "cpu_platform_active", "install_cpu_fixes", "installed_fixes"]

CPU_PROCESS_GROUP_BACKEND = "cpu:gloo"
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
DISTRIBUTED_MODULE = "verl.utils.distributed"
MONKEY_PATCH_MODULE = "verl.models.transformers.monkey_patch"

_installed: list[str] = []


def installed_fixes() -> tuple[str, ...]:
    """Names of the fixes installed in this process (empty unless the CPU platform is active)."""
    return tuple(_installed)


def _fix_process_group_backend() -> None:
    import verl.utils.distributed as distributed

    ray_init = distributed.initialize_global_process_group_ray
    defaults = ray_init.__defaults__ or ()
    # verl 0.9.1: (timeout_second=None, backend=None); a patched verl (0004) needs nothing
    if defaults == (None, None):
        ray_init.__defaults__ = (None, CPU_PROCESS_GROUP_BACKEND)
    _installed.append("process_group_backend")


def _fix_engine_registry() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            registered = EngineRegistry._engines.get(model_type, {}).get(backend, {})
            if "cpu" not in registered:  # a patched verl (0005) registers cpu itself
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(engine)
    _installed.append("engine_registry")


def trl_has_value_head() -> bool:
    """True when the installed TRL provides ``AutoModelForCausalLMWithValueHead`` where verl 0.9.1 looks."""
    for module_name in ("trl.experimental.ppo", "trl"):
        try:
            module = __import__(module_name, fromlist=["AutoModelForCausalLMWithValueHead"])
        except ImportError:
            continue
        if hasattr(module, "AutoModelForCausalLMWithValueHead"):
            return True
    return False


def _fix_trl_value_head_import() -> None:
    import verl.models.transformers.monkey_patch as monkey_patch

    if monkey_patch.is_trl_available() and not trl_has_value_head():
        monkey_patch.is_trl_available = lambda: False
        _installed.append("trl_value_head_import")


def cpu_platform_active() -> bool:
    """True when verl's platform in this process is the CPU platform (resolves verl's platform if needed)."""
    from verl.plugin.platform import get_platform

    from verl_prm.platform.cpu import CPUPlatform

    return isinstance(get_platform(), CPUPlatform)


def _when_cpu(fix):
    def run() -> None:
        if cpu_platform_active():
            fix()

    return run


def install_cpu_fixes() -> None:
    """Attach the fixes to the import of the verl modules they fix (now for one already imported). Each runs
    after its module has executed, and only if the CPU platform is this process's platform, except the TRL
    import fix, which verl needs on every device once TRL >= 1.x is installed. Idempotent."""
    if getattr(install_cpu_fixes, "_done", False):
        return
    install_cpu_fixes._done = True
    from verl_prm.plugin import register_when_imported

    register_when_imported(DISTRIBUTED_MODULE, _when_cpu(_fix_process_group_backend))
    register_when_imported(ENGINE_MODULE, _when_cpu(_fix_engine_registry))
    # Not a CPU matter: with TRL >= 1.x installed, every FSDP model build of verl 0.9.1 fails on any device, so
    # this one applies on every platform (and only where the installed TRL lacks the class).
    register_when_imported(MONKEY_PATCH_MODULE, _fix_trl_value_head_import)

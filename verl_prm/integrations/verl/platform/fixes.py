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
- ``0007-vectorised-validation-bootstrap.diff``: ``verl.trainer.ppo.metric_utils.bootstrap_metric`` reduces each
  of its 1,000 bootstrap samples in a Python loop, for every prompt, every numeric ``reward_extra_info`` key and
  every subset size, in the driver: the metrics of a validation of 256 prompts x 4 samples with the ``pav`` reward
  manager's four numeric keys took 51-102 s on a 2-core CPU machine (docs: benchmarks, verl's validation metrics). Fix: for ``np.max``/``np.min``
  on numbers (best@n/worst@n, verl's only use of them) the same bootstrap indices are drawn and reduced along an
  axis: the same values, a few milliseconds; anything else (majority voting) goes to verl's loop.

The TRL import fix (``0006``), which verl needs on every device, is ``verl_prm.integrations.verl.trl_fix``.
"""

from __future__ import annotations

import logging

from verl_prm.integrations.verl.import_hooks import register_when_imported

logger = logging.getLogger(__name__)

__all__ = ["CPU_PROCESS_GROUP_BACKEND", "cpu_platform_active", "install_cpu_fixes", "installed_fixes",
           "vectorised_bootstrap_metric"]

CPU_PROCESS_GROUP_BACKEND = "cpu:gloo"
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
DISTRIBUTED_MODULE = "verl.utils.distributed"
METRIC_MODULE = "verl.trainer.ppo.metric_utils"

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


def vectorised_bootstrap_metric(loop_bootstrap_metric):
    """verl's ``bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42)``, with each reduction
    of ``np.max``/``np.min`` over numeric ``data`` computed on all bootstrap samples at once. The indices are
    drawn exactly as verl draws them (``np.random.seed(seed)``, then one ``np.random.choice`` of shape
    ``(n_bootstrap, subset_size)``), so the result is verl's; other reductions or data call
    ``loop_bootstrap_metric``, verl's own function."""
    import numpy as np

    axis_reductions = (np.max, np.min)

    def bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
        if not all(any(fn is reduction for reduction in axis_reductions) for fn in reduce_fns):
            return loop_bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=n_bootstrap, seed=seed)
        try:
            values = np.asarray(data, dtype=np.float64)
        except (TypeError, ValueError):
            return loop_bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=n_bootstrap, seed=seed)
        if values.ndim != 1:
            return loop_bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=n_bootstrap, seed=seed)
        np.random.seed(seed)
        samples = values[np.random.choice(len(values), size=(n_bootstrap, subset_size), replace=True)]
        reduced = [fn(samples, axis=1) for fn in reduce_fns]
        return [(float(np.mean(r)), float(np.std(r))) for r in reduced]

    bootstrap_metric.__doc__ = loop_bootstrap_metric.__doc__
    bootstrap_metric.loop_bootstrap_metric = loop_bootstrap_metric
    return bootstrap_metric


def _fix_validation_bootstrap() -> None:
    import verl.trainer.ppo.metric_utils as metric_utils

    # a patched verl (0007) vectorises it itself; process_validation_metrics looks the name up in its module
    if not getattr(metric_utils, "BOOTSTRAP_AXIS_REDUCTIONS", None) and not hasattr(
            metric_utils.bootstrap_metric, "loop_bootstrap_metric"):
        metric_utils.bootstrap_metric = vectorised_bootstrap_metric(metric_utils.bootstrap_metric)
    _installed.append("validation_bootstrap")


def cpu_platform_active() -> bool:
    """True when verl's platform in this process is the CPU platform (resolves verl's platform if needed)."""
    from verl.plugin.platform import get_platform

    # cpu.py imports verl's platform base: at module top it would import verl while verl loads this plugin
    from verl_prm.integrations.verl.platform.cpu import CPUPlatform

    return isinstance(get_platform(), CPUPlatform)


def _when_cpu(fix):
    def run() -> None:
        if cpu_platform_active():
            fix()

    return run


def install_cpu_fixes() -> None:
    """Attach the fixes to the import of the verl modules they fix (now for one already imported). Each runs
    after its module has executed, and only if the CPU platform is this process's platform. Idempotent."""
    if getattr(install_cpu_fixes, "_done", False):
        return
    install_cpu_fixes._done = True
    register_when_imported(DISTRIBUTED_MODULE, _when_cpu(_fix_process_group_backend))
    register_when_imported(ENGINE_MODULE, _when_cpu(_fix_engine_registry))
    register_when_imported(METRIC_MODULE, _when_cpu(_fix_validation_bootstrap))

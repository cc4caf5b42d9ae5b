"""verl's CPU platform: ``PlatformRegistry`` name ``cpu``, selected when the host has no accelerator.

verl 0.9.1 ships platforms for NVIDIA, ROCm and Ascend only; with none of them present it falls back to
``nvidia`` and turns ``trainer.device=cpu`` into ``cuda``. This platform lets verl's own training loop run on
CPU:

- device ``cpu`` with the device module ``CPU_DEVICE_MODULE``: ``torch.cpu`` plus the calls verl makes on an
  accelerator module (memory statistics, caches, RNG state, device names), as no-ops or their CPU equivalents;
- a device id (``CPU_DEVICE_ID``) that *is* the CPU for ``model.to(get_device_id())`` and
  ``torch.device(get_device_id())``, and formats as ``0`` where verl writes ``f"{device_name}:{device_id}"``;
- collectives over ``gloo``; no CUDA IPC (``is_ipc_supported`` False);
- Ray resources: verl's worker pools ask Ray for ``"GPU"`` bundles, so a CPU run gives Ray logical GPUs
  (``ray_kwargs.ray_init.num_gpus`` = ``trainer.n_gpus_per_node`` x ``trainer.nnodes``): each one is a slot for
  one training process, nothing more.

Selection (``verl.plugin.platform.platform_manager``): ``VERL_PLATFORM=cpu``, or auto-detection on a host where
no accelerator is found (:func:`accelerator_present`). verl probes its built-in platforms first, so on a GPU
host ``nvidia`` wins before this class is asked. The runtime fixes of verl 0.9.1 for CPU
(``verl_prm.integrations.verl.platform.fixes``) are applied only in a process whose platform this is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import types
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase

from verl_prm.integrations.verl.import_hooks import run_deferred_registration

__all__ = [
    "CPU_DEVICE_ID", "CPU_DEVICE_MODULE", "CPUPlatform", "PLATFORM_NAME", "TOOL_DIRECTORIES", "accelerator_present", "find_tool",
    "register_cpu_platform",
]

PLATFORM_NAME = "cpu"
# Command-line tools whose presence marks a host with an accelerator verl supports (NVIDIA, AMD, Ascend).
ACCELERATOR_TOOLS = ("nvidia-smi", "rocm-smi", "npu-smi")


class _CPUDeviceId(str):
    """The CPU as a device (``"cpu"`` for ``torch.device`` and ``Tensor.to``) that formats as ``0``.

    verl uses ``get_device_id()`` both as a device (``model.to(get_device_id())``; an int would mean
    ``cuda:<int>``) and inside ``f"{get_device_name()}:{get_device_id()}"`` (``cpu:0``)."""

    def __format__(self, spec: str) -> str:
        return format(0, spec)


CPU_DEVICE_ID = _CPUDeviceId("cpu")


def _zero(*args, **kwargs) -> int:
    return 0


def _none(*args, **kwargs) -> None:
    return None


def _mem_get_info(*args, **kwargs) -> tuple[int, int]:
    """(free, total) bytes of host memory, as ``torch.cuda.mem_get_info`` reports device memory."""
    pages = os.sysconf("SC_PHYS_PAGES")
    page_size = os.sysconf("SC_PAGE_SIZE")
    available = os.sysconf("SC_AVPHYS_PAGES")
    return available * page_size, pages * page_size


def _device_module() -> types.ModuleType:
    module = types.ModuleType("verl_prm.integrations.verl.platform.cpu_device", "torch.cpu plus the accelerator calls verl makes")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    module.current_device = lambda: CPU_DEVICE_ID
    module.device_count = lambda: 1
    module.is_available = lambda: True
    module.set_device = _none
    module.synchronize = _none
    module.empty_cache = _none
    module.ipc_collect = _none
    module.set_per_process_memory_fraction = _none
    module.reset_peak_memory_stats = _none
    module.memory_allocated = _zero
    module.memory_reserved = _zero
    module.max_memory_allocated = _zero
    module.max_memory_reserved = _zero
    module.mem_get_info = _mem_get_info
    module.get_device_name = lambda *args, **kwargs: "CPU"
    module.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    return module


CPU_DEVICE_MODULE = _device_module()


# Where verl 0.9.1 looks for a vendor tool that is not on the PATH (PlatformBase.check_smi_command).
TOOL_DIRECTORIES = ("/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin")


def find_tool(name: str) -> Optional[str]:
    """The vendor tool's path as verl finds it: on the PATH, else an executable file in ``TOOL_DIRECTORIES``."""
    found = shutil.which(name)
    if found is not None:
        return found
    for directory in TOOL_DIRECTORIES:
        path = os.path.join(directory, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def accelerator_present() -> bool:
    """True when this host has an accelerator verl supports: a CUDA/ROCm device visible to torch, torch_npu, or
    one of the vendor tools (``nvidia-smi``, ``rocm-smi``, ``npu-smi``) found as verl finds them (:func:`find_tool`:
    the PATH, then /usr/bin, /usr/local/bin, /usr/local/cuda/bin). A CPU-only Ray actor on a GPU host sees no
    device, but the tools are there."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        return True
    return any(find_tool(tool) is not None for tool in ACCELERATOR_TOOLS)


class CPUPlatform(PlatformBase):
    """verl platform backend for hosts without an accelerator (module docstring)."""

    # ---- core device management
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return not accelerator_present()

    def current_device(self) -> Any:
        return CPU_DEVICE_ID

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    # ---- random number generator
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    # ---- memory
    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    # ---- distributed communication
    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray assigns the logical GPUs of a CPU run through this variable; torch's CPU build ignores it.
        return "CUDA_VISIBLE_DEVICES"

    # ---- profiling
    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    # ---- Ray
    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    # ---- IPC, runtime
    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_cpu_platform() -> None:
    """Register ``CPUPlatform`` as verl's platform ``cpu`` (idempotent; selects nothing)."""
    from verl.plugin.platform import PlatformRegistry

    if PlatformRegistry.get(PLATFORM_NAME) is not CPUPlatform:
        PlatformRegistry.register(platform=PLATFORM_NAME)(CPUPlatform)


# verl's plugin loader may have asked for the registration while this module was still executing.
run_deferred_registration(__name__)

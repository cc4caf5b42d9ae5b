"""Which floating-point type the generation engine, the CPU training loop and critic training compute in.

bfloat16 halves memory traffic and, on CPUs with native bf16 matrix instructions (Intel AMX-BF16, AVX512-BF16 on
Intel and AMD), runs matrix products 2-5x faster than float32 (oneDNN accumulates in float32). Without such
instructions PyTorch emulates bf16 through float32 conversions, which is slower than float32 itself: there the
engine computes in float32. The choice is made once, from the CPU's own flags, and a setting overrides it:

- ``"auto"``: bfloat16 where :func:`native_bf16_instructions` finds AMX-BF16 or AVX512-BF16 (x86) or the BF16
  extension (Arm), float32 elsewhere;
- ``"bfloat16"`` / ``"float32"``: as named; bfloat16 on a CPU without native bf16 is refused with the reason
  (it would run several times slower than float32), unless ``allow_emulated=True``.

Logits are always upcast to float32 before temperature, top-k, top-p and the softmax (as vLLM's sampler does
with bf16 models), so sampling never works on a distribution quantised below bf16.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
import torch

from verl_prm.choices import PRECISIONS, Precision

__all__ = ["PRECISIONS", "Precision", "cpu_bf16_flags", "mixed_precision_for", "native_bf16_instructions",
           "resolve_dtype"]


# /proc/cpuinfo flags of native bf16 matrix instructions: x86 (Intel AMX, AVX512-BF16 on Intel and AMD Zen 4+)
# and Arm (the BF16 extension, "bf16" in the Features line).
_X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
_ARM_BF16_FLAGS = ("bf16",)


@functools.lru_cache(maxsize=None)
def cpu_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The native bf16 instruction flags this CPU reports (empty when none, or when /proc/cpuinfo is absent)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.is_file():
            return ()
        cpuinfo = path.read_text(errors="replace")
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    machine = platform.machine().lower()
    candidates = _ARM_BF16_FLAGS if machine in ("aarch64", "arm64") else _X86_BF16_FLAGS
    return tuple(flag for flag in candidates if flag in words)


def native_bf16_instructions() -> bool:
    """Whether this CPU has native bf16 matrix instructions (see :func:`cpu_bf16_flags`)."""
    return bool(cpu_bf16_flags())


def resolve_dtype(precision: str, device: str | torch.device = "cpu", *, allow_emulated: bool = False,
                  native: bool | None = None) -> torch.dtype:
    """The compute dtype for ``precision`` on ``device``.

    Args:
        precision: ``"auto"``, ``"bfloat16"`` or ``"float32"`` (the module docstring says how ``auto`` chooses).
        device: on a GPU, ``auto`` means bfloat16 where the GPU supports it (every GPU verl targets).
        allow_emulated: accept ``bfloat16`` on a CPU without native bf16 instructions.
        native: the CPU's answer, for tests that simulate another CPU; ``None`` reads this CPU's flags.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if torch.device(device).type != "cpu":
        if precision == "auto":
            return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
        return getattr(torch, precision)
    has_native = native_bf16_instructions() if native is None else native
    if precision == "auto":
        return torch.bfloat16 if has_native else torch.float32
    if precision == "bfloat16" and not has_native and not allow_emulated:
        raise ValueError(
            "precision='bfloat16' on a CPU without native bf16 instructions (no amx_bf16 / avx512_bf16 / bf16 flag "
            "in /proc/cpuinfo): PyTorch would emulate it, several times slower than float32. Use precision='auto' "
            "or 'float32'"
        )
    return getattr(torch, precision)


def mixed_precision_for(setting: str, device: str | torch.device) -> str:
    """accelerate's / FSDP's mixed-precision name for a training setting: ``"auto"`` is ``"bf16"`` where
    :func:`resolve_dtype` picks bfloat16 on ``device`` (float32 master weights, bf16 autocast) and ``"no"``
    elsewhere; any other setting (``no``, ``bf16``, ``fp16``) is returned as it is."""
    if setting != "auto":
        return setting
    return "bf16" if resolve_dtype("auto", device) == torch.bfloat16 else "no"

"""The CPU's fused per-token lookup: ``lookup.c``, built once per machine with its C compiler and called through
ctypes. Shapes as in :mod:`verl_prm.advantages`; what the kernel computes is in ``lookup.c``'s header.

The library is built at first use with ``$CC`` (else ``cc``, else ``gcc``) and ``-O3 -march=native`` into
``$VERL_PRM_CACHE/kernels`` (default ``~/.cache/verl-prm/kernels``), named by a hash of the source, the compiler
and the CPU, so a change of any of them builds anew; the build writes a temporary file and renames it, so
concurrent first calls cannot load a half-written library. ctypes releases the GIL during the call, so the rows
are split over ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["NativeLookupError", "native_lookup", "native_lookup_supported", "vectorised"]

_SOURCE = Path(__file__).with_name("lookup.c")
_FLAGS = ["-O3", "-march=native", "-std=c99", "-shared", "-fPIC"]
_ID_TYPES = {torch.int64: "i64", torch.int32: "i32"}
_MASK_TYPES = {torch.float32: "f32", torch.int64: "i64", torch.int32: "i32", torch.bool: "u8", torch.uint8: "u8"}
# Below this many tokens a row range is not worth a thread of its own.
_MIN_TOKENS_PER_THREAD = 1 << 16


class NativeLookupError(RuntimeError):
    """The C kernel could not be built or loaded (no C compiler, a compiler error)."""


def native_lookup_supported(table: torch.Tensor, step_ids: torch.Tensor, response_mask: torch.Tensor) -> bool:
    """Whether the C kernel takes these inputs: CPU tensors, a float32 table, int64/int32 ids and a float32,
    int64, int32 or bool mask."""
    return (table.device.type == step_ids.device.type == response_mask.device.type == "cpu"
            and table.dtype == torch.float32 and step_ids.dtype in _ID_TYPES and response_mask.dtype in _MASK_TYPES)


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeLookupError("no C compiler found (set $CC, or install gcc)")
    return compiler


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform's description."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() + platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    return Path(os.environ.get("VERL_PRM_CACHE", Path.home() / ".cache" / "verl-prm")) / "kernels"


@functools.lru_cache(maxsize=None)
def _library(compiler: str, cache_dir: str) -> ctypes.CDLL:
    source = _SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeLookupError(f"the C compiler {compiler!r} does not run: {error}") from error
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu_identity().encode(),
                                     " ".join(_FLAGS).encode()])).hexdigest()[:20]
    path = Path(cache_dir) / f"lookup-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".lookup-", suffix=".so", dir=path.parent)
        os.close(handle)
        try:
            built = subprocess.run([compiler, *_FLAGS, "-o", temporary, str(_SOURCE), "-lm"], capture_output=True,
                                   text=True, timeout=300)
            if built.returncode != 0:
                raise NativeLookupError(f"{compiler} could not build {_SOURCE.name}: {built.stderr.strip()[-2000:]}")
            os.chmod(temporary, 0o777 & ~_umask())  # mkstemp makes it 0600; a shared cache keeps the user's umask
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeLookupError(f"cannot load {path}: {error}; delete it to rebuild") from error
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    for ids in _ID_TYPES.values():
        for mask in set(_MASK_TYPES.values()):
            function = getattr(library, f"lookup_{ids}_{mask}")
            function.restype = None
            function.argtypes = [pointer] * 6 + [integer] * 4 + [pointer] * 3
    library.lookup_vectorised.restype = ctypes.c_int
    return library


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _kernel() -> ctypes.CDLL:
    return _library(_compiler(), str(_cache_dir()))


def vectorised() -> bool:
    """Whether the built kernel has its AVX-512 path (else the compiler's code for the plain loop)."""
    return bool(_kernel().lookup_vectorised())


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="verl-prm-lookup")
        return _pools[threads]


def native_lookup(table: torch.Tensor, step_ids: torch.Tensor, response_mask: torch.Tensor, num_steps: torch.Tensor,
                  small: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, T] float32, bad [B] bool)`` of ``lookup.c`` for inputs that ``native_lookup_supported`` accepts.

    ``bad`` flags the rows whose step ids leave ``[-1, num_steps - 1]``; with ``small = (step_values [B, S],
    prompt_values [B], outcome_rewards [B])`` in float32 also the checks of ``bad_small_input_rows``. Raises
    :class:`NativeLookupError` when the kernel cannot be built."""
    library = _kernel()
    batch, length = step_ids.shape
    table, step_ids = table.contiguous(), step_ids.contiguous()
    mask = response_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    num_steps = num_steps.to(torch.int64).contiguous()
    small = tuple(x.contiguous() for x in small) if small is not None else None
    out = torch.empty((batch, length), dtype=torch.float32)
    bad = torch.empty(batch, dtype=torch.uint8)
    function = getattr(library, f"lookup_{_ID_TYPES[step_ids.dtype]}_{_MASK_TYPES[response_mask.dtype]}")
    fixed = [table.data_ptr(), step_ids.data_ptr(), mask.data_ptr(), num_steps.data_ptr(), out.data_ptr(),
             bad.data_ptr()]
    checks = [x.data_ptr() for x in small] if small is not None else [None, None, None]

    def rows(start: int, stop: int) -> None:
        function(*fixed, start, stop, length, table.shape[1], *checks)

    threads = max(1, min(torch.get_num_threads(), batch, (batch * length) // _MIN_TOKENS_PER_THREAD))
    if threads == 1:
        rows(0, batch)
    else:
        bounds = [batch * k // threads for k in range(threads + 1)]
        for future in [_pool(threads).submit(rows, bounds[k], bounds[k + 1]) for k in range(threads)]:
            future.result()
    return out, bad.view(torch.bool)

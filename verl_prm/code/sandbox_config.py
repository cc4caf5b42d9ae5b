"""What a sandbox run is given and what it returns: ``SandboxConfig`` (the limits, each field checked when the
config is built), ``RunResult`` and its ``REASONS``, and ``Isolation`` (what a level isolates by). The runner
is ``verl_prm.code.sandbox``; the isolation set-up ``verl_prm.code.sandbox_setup``."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["LIMIT_MINIMUMS", "REASONS", "Isolation", "RunResult", "SandboxConfig"]

REASONS = (
    "passed",
    "syntax_error",
    "assertion_failed",
    "runtime_error",
    "timeout",
    "memory",
    "network_blocked",
    "permission_denied",
    "early_exit",
    "killed",
    "sandbox_error",
)

# The integer limits of SandboxConfig, each with the smallest value that still lets an interpreter start and run
# a program; below it every correct program would end ``sandbox_error``/``memory`` and score 0. Measured: a
# ``python -I -S`` probe runs with 4 descriptors and 16 MiB of address space here; the minimums leave room for
# the modules and pipes a test program uses.
LIMIT_MINIMUMS = {
    "cpu_s": (1, "CPU seconds: RLIMIT_CPU counts whole seconds"),
    "memory_mb": (64, "MiB of address space: the interpreter and its imports"),
    "max_output_bytes": (0, "bytes of stdout and of stderr kept"),
    "file_mb": (1, "MiB: the program file itself is written under this limit, and 0 would make the tmpfs unbounded"),
    "max_files": (16, "file descriptors: the interpreter, its status pipe, the program and a few modules"),
    "nproc": (1, "processes: the program itself is one"),
}
_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one run; every field is checked when the config is built (a ValueError naming the field and its
    range: ``LIMIT_MINIMUMS``), and ``isolation`` runs its start-up probe under these very limits.

    Attributes:
        timeout_s: wall-clock limit (seconds) of the whole run, start-up included.
        cpu_s: CPU-time limit (RLIMIT_CPU, whole seconds, >= 1) of each process.
        memory_mb: address-space limit (RLIMIT_AS) of each process, MiB.
        max_output_bytes: bytes of stdout and of stderr kept (each); the rest is discarded.
        file_mb: largest file the program may write (RLIMIT_FSIZE), and the size of the private tmpfs.
        max_files: open file descriptors (RLIMIT_NOFILE).
        nproc: processes the run may have at once (RLIMIT_NPROC on the run's own uid under bwrap as root).
        mode: "bwrap" (namespaces by bubblewrap; a RuntimeError naming the package where it is missing) or
            "basic" (no namespaces: asked for by name, it logs a warning); probed the same way (`isolation`
            raises RuntimeError if that level cannot run Python here).
        site_packages: let the program import installed third-party packages (numpy...); default off
            (``python -S``: the standard library only, which is what HumanEval and MBPP need).
        python: the interpreter that runs the program (default: this one). Under bwrap its files (and,
            with ``site_packages``, its site-packages) are shown read-only even where the sandbox masks their
            directory (an interpreter or venv under ``/tmp``).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_output_bytes: int = 64 * 1024
    file_mb: int = 16
    max_files: int = 256
    nproc: int = 32
    mode: Literal["bwrap", "basic"] = "bwrap"
    site_packages: bool = False
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.mode not in ("bwrap", "basic"):
            raise ValueError(f"SandboxConfig.mode must be 'bwrap' or 'basic', got {self.mode!r}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"SandboxConfig.timeout_s must be a finite number of seconds > 0, got {timeout!r}")
        for name, (low, why) in LIMIT_MINIMUMS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _INT_MAX:
                raise ValueError(f"SandboxConfig.{name} must be a whole number in [{low}, {_INT_MAX}] ({why}), got "
                                 f"{value!r}")
        if not isinstance(self.site_packages, bool):
            raise ValueError(f"SandboxConfig.site_packages must be True or False, got {self.site_packages!r}")
        if not isinstance(self.python, str) or not self.python:
            raise ValueError(f"SandboxConfig.python must be the path of an interpreter, got {self.python!r}")

    def limits(self) -> dict[str, int]:
        """The integer limits (``LIMIT_MINIMUMS``' fields) by name."""
        return {name: getattr(self, name) for name in LIMIT_MINIMUMS}


@dataclass(frozen=True)
class Isolation:
    """What a run is isolated by on this machine (``isolation()``)."""

    mode: str  # "bwrap" or "basic"
    network: str  # "namespace+audit-hook" or "audit-hook"
    filesystem: str
    processes: str
    note: str = ""


@dataclass
class RunResult:
    """The outcome of one run.

    Attributes:
        reason: one of ``REASONS`` (module docstring).
        detail: the exception type and message, the signal, or the limit that ended the run.
        returncode: the exit status (negative: killed by that signal; None: never started).
        stdout, stderr: the first ``max_output_bytes`` of each, decoded (invalid UTF-8 replaced).
        stdout_truncated, stderr_truncated: more was written than kept.
        wall_s: seconds from start to the end of the run (clean-up included).
        isolation: the isolation level of the run ("bwrap" or "basic").
    """

    reason: str
    detail: str = ""
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    isolation: str = ""

    @property
    def passed(self) -> bool:
        return self.reason == "passed"

    def as_dict(self) -> dict:
        return asdict(self)



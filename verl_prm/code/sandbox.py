"""Run untrusted Python programs: one process per run, limits, isolation, and a failure reason for every run.

``run_program(source, config)`` writes ``source`` to a root-only staging directory and starts
``python -I -S -B verl_prm/code/_boot.py`` as the leader of a new session (``setsid``) with an environment
of a few fixed variables (nothing of the caller's environment). The boot script (``_boot.py``) sets up the
isolation before any program code runs. Three isolation levels. ``isolation()`` runs a probe program once per
level asked for, interpreter and ``site_packages`` setting (lazily imported standard-library modules, the
executable, every directory of the interpreter's ``sys.path``): ``SandboxConfig.mode="auto"`` takes the
strongest level that runs it; an explicit mode that cannot run it is a RuntimeError (never a run that scores a
correct program 0):

* **full isolation** (the process runs as root and may create namespaces):
  enters a new **network namespace** (only a loopback device that is down: no route anywhere) and a new
  **mount namespace** in which a fresh, size-capped tmpfs is mounted over every world-writable directory
  (``/tmp``, ``/var/tmp``, ``/dev/shm``); the working directory is a new directory inside that tmpfs, so it and
  everything the program writes there vanish with the namespace (when the last process of the run exits), and
  the host's files in those directories (Ray's sockets in ``/tmp/ray``, other users' files) are invisible;
  the interpreter's files that this hides (an interpreter, virtual environment or site-packages under ``/tmp``;
  a pyenv install under ``/root``, which other uids cannot traverse) are bound back at their own paths,
  **read-only** (``_interpreter_layout``: the executable's directory, ``base_prefix``, every ``sys.path``
  directory, with ``site_packages`` also ``prefix`` and what ``.pth`` files add); a path that cannot be shown
  without undoing the private tmpfs (``/tmp`` itself on ``sys.path``) is refused with a ValueError;
  then it drops to an **unprivileged uid** of its own (a number with no passwd entry, unique per run slot of
  this process: ``uid_for_slot``), so every other path of the file system is read-only or unreadable by
  ordinary Unix permissions, and ``RLIMIT_NPROC`` counts exactly this run's processes;
* **user isolation** (root, but namespaces refused, e.g. a container without CAP_SYS_ADMIN): the same
  unprivileged uid (so the file system outside world-writable directories is protected by Unix permissions,
  ``RLIMIT_NPROC`` counts the run's processes, and every process of the uid is killed at the end) and a fresh
  working directory owned by it (removed afterwards); network access is refused by the audit hook only; ``/tmp``
  and other world-writable directories stay writable and shared. The interpreter's installation must be
  readable by other uids (the probe checks it; a pyenv Python under ``/root`` fails it: use full isolation);
* **basic isolation** (not root, or the uid switch failed): the working directory is a fresh directory (removed
  afterwards); network access is refused by an audit hook (see below) only; writes elsewhere are limited by the
  caller's own file permissions only; ``RLIMIT_NPROC`` is set to the caller's current process count + ``nproc``
  (the kernel does not enforce it for root); processes that leave the process group (``setsid``) survive the
  run.

At every level: ``no_new_privs`` (``prctl``: executing a setuid/setgid binary raises no privileges); resource
limits ``RLIMIT_CPU`` (CPU seconds; SIGXCPU then SIGKILL), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE``
(largest file written), ``RLIMIT_NOFILE``, ``RLIMIT_CORE = 0``; an audit hook that
raises ``PermissionError("sandbox: network access is blocked")`` when the program creates an IPv4/IPv6 (any
non-Unix) socket or connects/binds/sends to a network address (a clear failure reason; in full isolation the
namespace is the barrier, the hook only names the cause); a wall-clock deadline after which the whole process
group is killed (``killpg(SIGKILL)``), and in full and user isolation every process of the run's uid is killed
as well (``/proc`` scan, repeated until none is left), which also gets processes that left the process group
(``setsid``, double fork). Stdout and stderr are read concurrently and at most ``max_output_bytes`` of each is
kept (the rest is read and discarded, so a chatty program cannot block or fill memory).

The outcome of a run (`RunResult.reason`) is one of ``REASONS``, decided from the boot script's status
record (written to a private pipe), the exit status and the deadline:

    passed            the program ran to its end (exit status 0 and the boot script's "done" record)
    syntax_error      the program does not compile (SyntaxError, IndentationError, ...)
    assertion_failed  an AssertionError escaped (a failed test)
    runtime_error     any other exception escaped (or a non-zero exit status without a record)
    timeout           the wall-clock deadline passed, or the CPU limit killed it (SIGXCPU)
    memory            MemoryError (RLIMIT_AS refused an allocation)
    permission_denied a PermissionError escaped (EACCES/EPERM: e.g. a write outside the working directory)
    network_blocked   the exception escaping was the network audit hook's PermissionError, or an OSError of a
                      refused connection (ENETUNREACH, ...) in the network namespace
    early_exit        the program called exit()/sys.exit() (SystemExit) or os._exit() before the end: the
                      tests did not all run, so it is no pass even with exit status 0
    killed            a signal ended it (SIGKILL from RLIMIT_NPROC-bounded fork bombs hitting the deadline is
                      "timeout"; SIGSEGV, SIGABRT, an external SIGKILL are "killed")
    sandbox_error     the sandbox could not be set up (names the step; the program did not run)

Limits of the guarantees (read before trusting a reward): the program runs in the same interpreter as the boot
script, so a program written against this harness can find the status pipe and forge a "done" record, or
return objects whose ``__eq__`` is always true; the sandbox contains the machine (files, network,
processes, memory, time), not reward hacking inside the interpreter. ``/proc`` is the host's: command lines of
other processes are readable (their environments, memory and files are not: other uids). The probe checks the
interpreter's ``sys.path`` and executable, not the shared libraries it links: in user isolation a program that
starts ``sys.executable`` of a pyenv-style build (``libpython`` under ``/root``) fails. Without root, see
"basic isolation" above.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

__all__ = [
    "REASONS",
    "Isolation",
    "RunResult",
    "SandboxConfig",
    "isolation",
    "run_many",
    "run_program",
    "uid_for_slot",
]

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

BOOT = Path(__file__).with_name("_boot.py")
NETWORK_MARKER = "sandbox: network access is blocked"
# Directories any uid may write to on a usual Linux host; the first one holds the working directory.
MASK_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")
_NETWORK_ERRNOS = {"ENETUNREACH", "ECONNREFUSED", "EHOSTUNREACH", "EADDRNOTAVAIL", "EAI_AGAIN", "gaierror"}
# uids of run slots: 200000 + (pid mod 100000) * 64 + slot, unique among the processes of this host that run
# sandboxes at the same time (pids are unique while alive), far above any uid a distribution hands out.
_UID_BASE = 200_000
_SLOTS_PER_PROCESS = 64


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one run.

    Attributes:
        timeout_s: wall-clock limit (seconds) of the whole run, start-up included.
        cpu_s: CPU-time limit (RLIMIT_CPU, whole seconds, >= 1) of each process.
        memory_mb: address-space limit (RLIMIT_AS) of each process, MiB.
        max_output_bytes: bytes of stdout and of stderr kept (each); the rest is discarded.
        file_mb: largest file the program may write (RLIMIT_FSIZE), and the size of the private tmpfs.
        max_files: open file descriptors (RLIMIT_NOFILE).
        nproc: processes the run may have at once (RLIMIT_NPROC on the run's own uid in full isolation).
        mode: "auto" (the strongest level that runs Python here), or "full", "user", "basic" (probed the same
            way: `isolation` raises RuntimeError if that level cannot run Python here).
        site_packages: let the program import installed third-party packages (numpy...); default off
            (``python -S``: the standard library only, which is what HumanEval and MBPP need).
        python: the interpreter that runs the program (default: this one). In full isolation its files (and,
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
    mode: str = "auto"
    site_packages: bool = False
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "full", "user", "basic"):
            raise ValueError(f"SandboxConfig.mode must be 'auto', 'full', 'user' or 'basic', got {self.mode!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0) or self.cpu_s < 1 or self.memory_mb < 64 or (
                self.nproc < 1):
            raise ValueError(
                f"SandboxConfig: need a finite timeout_s > 0, cpu_s >= 1, memory_mb >= 64, nproc >= 1; got "
                f"{self.timeout_s}, {self.cpu_s}, {self.memory_mb}, {self.nproc}"
            )


@dataclass(frozen=True)
class Isolation:
    """What a run is isolated by on this machine (``isolation()``)."""

    mode: str  # "full", "user" or "basic"
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
        isolation: the isolation level of the run ("full", "user" or "basic").
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


def uid_for_slot(slot: int, pid: int | None = None) -> int:
    """The uid of run slot ``slot`` (0..63) of process ``pid`` (module constants)."""
    if not 0 <= slot < _SLOTS_PER_PROCESS:
        raise ValueError(f"slot must be in [0, {_SLOTS_PER_PROCESS}), got {slot}")
    return _UID_BASE + ((os.getpid() if pid is None else pid) % 100_000) * _SLOTS_PER_PROCESS + slot


class _Slots:
    """Run slots of this process (each with its own uid), handed out to concurrent runs.

    First in, first out, and a slot whose run had processes killed rests ``rest_s`` before it is handed out
    again (unless no other slot is free): the zombies of a killed fork bomb count towards RLIMIT_NPROC of their
    uid until init reaps them, which can take a moment."""

    def __init__(self, rest_s: float = 2.0) -> None:
        self._lock = threading.Condition()
        self._pid = os.getpid()
        self._free: list[tuple[int, float]] = [(slot, 0.0) for slot in range(_SLOTS_PER_PROCESS)]
        self.rest_s = rest_s

    def acquire(self) -> int:
        with self._lock:
            if self._pid != os.getpid():  # forked: a new process, new uids
                self._pid, self._free = os.getpid(), [(slot, 0.0) for slot in range(_SLOTS_PER_PROCESS)]
            while not self._free:  # more than 64 concurrent runs in this process: wait for one to end
                self._lock.wait()
            now = time.monotonic()
            ready = [i for i, (_, not_before) in enumerate(self._free) if not_before <= now]
            index = ready[0] if ready else min(range(len(self._free)), key=lambda i: self._free[i][1])
            return self._free.pop(index)[0]

    def release(self, slot: int, killed: bool) -> None:
        with self._lock:
            self._free.append((slot, time.monotonic() + self.rest_s if killed else 0.0))
            self._lock.notify()


_SLOTS = _Slots()
_ISOLATION_LOCK = threading.Lock()


LEVELS = ("full", "user", "basic")
# The working directory of a run in full isolation (inside the private tmpfs over MASK_DIRS[0]).
FULL_WORKDIR = MASK_DIRS[0] + "/sandbox"
_QUERY = (
    "import json, sys\n"
    "print(json.dumps({'executable': sys.executable, 'prefix': sys.prefix, 'exec_prefix': sys.exec_prefix, "
    "'base_prefix': sys.base_prefix, 'base_exec_prefix': sys.base_exec_prefix, 'path': sys.path}))\n"
)


@dataclass(frozen=True)
class _Layout:
    """What the sandboxed interpreter reads after the uid switch (``_interpreter_layout``).

    Attributes:
        paths: existing absolute paths: the directory of the executable, ``base_prefix``/``base_exec_prefix``,
            every entry of the interpreter's ``sys.path`` (with ``site_packages``: site-packages, what ``.pth``
            files add, and ``prefix``), each also as its real path.
        expose: ``(path, closed_ancestor)`` for each of ``paths`` hidden in full isolation: under a directory the
            private tmpfs masks (closed_ancestor None), or below a directory other uids cannot traverse (that
            directory, e.g. ``/root`` of a pyenv install); nested paths dropped (their parent carries them).
        closed: ``(path, closed_ancestor)`` for each of ``paths`` other uids cannot read (user isolation has no
            mount namespace to fix that).
    """

    executable: str
    paths: tuple[str, ...]
    expose: tuple[tuple[str, str | None], ...]
    closed: tuple[tuple[str, str], ...]


_LAYOUTS: dict[tuple[str, bool], _Layout] = {}
_LAYOUTS_LOCK = threading.Lock()


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _closed_ancestor(path: str) -> str | None:
    """The topmost directory on the way to ``path`` (``path`` itself included) that other uids cannot traverse
    (no o+x bit), or None."""
    current = ""
    for part in os.path.abspath(path).split(os.sep)[1:]:
        current = current + os.sep + part
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return current
    return None


def _interpreter_layout(python: str, site_packages: bool) -> _Layout:
    """The interpreter's files the sandbox must keep readable (`_Layout`), from the interpreter itself run with
    the sandbox's flags (``-I``, and ``-S`` without ``site_packages``); cached per (python, site_packages).

    Raises RuntimeError if the interpreter does not run, ValueError if one of its paths cannot be exposed without
    undoing the private tmpfs (a path that is a masked directory itself, or the run's working directory)."""
    key = (python, site_packages)
    with _LAYOUTS_LOCK:
        if key in _LAYOUTS:
            return _LAYOUTS[key]
    flags = ["-I"] + ([] if site_packages else ["-S"])
    try:
        completed = subprocess.run([python, *flags, "-c", _QUERY], capture_output=True, text=True, timeout=120,
                                   stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"SandboxConfig(python={python!r}): the interpreter does not start: {error}") from None
    if completed.returncode != 0:
        raise RuntimeError(f"SandboxConfig(python={python!r}): the interpreter failed (exit status "
                           f"{completed.returncode}): {completed.stderr.strip()[-500:]}")
    found = json.loads(completed.stdout.strip().splitlines()[-1])
    executable = found["executable"]
    # the executable's directory (a program may start sys.executable) and the real one (a symlinked venv)
    candidates = [os.path.dirname(executable), os.path.dirname(os.path.realpath(executable)), found["base_prefix"],
                  found["base_exec_prefix"], *found["path"]]
    if site_packages:
        candidates += [found["prefix"], found["exec_prefix"]]  # pyvenv.cfg: a child `sys.executable` is the venv
    paths: list[str] = []
    for candidate in candidates:
        if not candidate or not os.path.isabs(candidate):
            continue  # "" (the working directory) is the run's own
        for path in (os.path.normpath(candidate), os.path.realpath(candidate)):
            if os.path.exists(path) and path not in paths:  # sys.path names a missing python3X.zip: nothing to keep
                paths.append(path)
    for path in paths:
        refused = [d for d in MASK_DIRS if path == d] + ([FULL_WORKDIR] if _under(path, FULL_WORKDIR) else [])
        if refused:
            raise ValueError(
                f"SandboxConfig(python={python!r}, site_packages={site_packages}): the interpreter needs {path}, "
                f"which the sandbox cannot show read-only without undoing its private {refused[0]}; install the "
                f"interpreter (or its packages) elsewhere, or drop {path} from its sys.path (.pth files)")
    hidden = []
    for path in paths:
        masked = [d for d in MASK_DIRS if _under(path, d)]
        closed = None if masked else _closed_ancestor(path)
        if masked or closed:
            hidden.append((path, closed))
    hidden.sort(key=lambda entry: len(entry[0]))
    expose: list[tuple[str, str | None]] = []
    for path, closed in hidden:
        if not any(_under(path, outer) for outer, _ in expose):
            expose.append((path, closed))
    closed_paths = tuple((p, c) for p in paths for c in [_closed_ancestor(p)] if c)
    layout = _Layout(executable, tuple(paths), tuple(expose), closed_paths)
    with _LAYOUTS_LOCK:
        _LAYOUTS[key] = layout
    return layout


def _probe_source(layout: _Layout) -> bytes:
    """A program that passes only where the interpreter works: lazily imported standard-library modules, the
    executable (a program may start ``sys.executable``) and every directory of its ``sys.path``."""
    return (
        "import heapq, json, os, sys, textwrap\n"
        "assert json.loads('[1]') == [1]\n"
        "if not os.access(sys.executable, os.X_OK):\n"
        "    raise PermissionError('cannot execute the interpreter ' + sys.executable)\n"
        f"for path in {list(layout.paths)!r}:\n"
        "    os.listdir(path) if os.path.isdir(path) else open(path, 'rb').close()\n"
    ).encode()


def _isolation_of(level: str, note: str = "") -> Isolation:
    if level == "full":
        return Isolation("full", "namespace+audit-hook",
                         "private tmpfs over " + ", ".join(MASK_DIRS) + " (cwd inside it); the interpreter's "
                         "files read-only; unprivileged uid elsewhere",
                         "setsid + killpg + kill-all-of-the-run's-uid; RLIMIT_NPROC on the run's uid; no_new_privs",
                         note)
    if level == "user":
        return Isolation("user", "audit-hook",
                         "fresh temporary cwd (removed); unprivileged uid elsewhere (world-writable directories such "
                         "as /tmp stay writable and shared)",
                         "setsid + killpg + kill-all-of-the-run's-uid; RLIMIT_NPROC on the run's uid; no_new_privs",
                         note)
    return Isolation("basic", "audit-hook", "fresh temporary cwd (removed); caller's permissions elsewhere",
                     "setsid + killpg; RLIMIT_NPROC = caller's processes + nproc (not enforced for root); "
                     "no_new_privs", note)


_PROBES: dict[tuple[str, bool, str], str] = {}  # (python, site_packages, level) -> "" (runs) or why not


def _probe(python: str, site_packages: bool, level: str) -> str:
    """Why ``level`` cannot run Python with this interpreter here ("" if it can): a probe program (`_probe_source`)
    run once at that level; cached. Call with ``_ISOLATION_LOCK`` held."""
    key = (python, site_packages, level)
    if key not in _PROBES:
        if level in ("full", "user") and (not hasattr(os, "geteuid") or os.geteuid() != 0):
            why = "not running as root: no namespaces, no uid switch"
        else:
            layout = _interpreter_layout(python, site_packages)
            config = SandboxConfig(timeout_s=30.0, python=python, site_packages=site_packages)
            result = _run(_probe_source(layout), config, level=level)
            why = "" if result.passed else f"the probe program ended with {result.reason}: {result.detail[:300]}"
            if why and level == "user" and layout.closed:
                path, closed = layout.closed[0]
                why += (f" (the interpreter's {path} is not readable by other uids: {closed} has no o+x bit, and user "
                        f"isolation has no mount namespace to show it; use mode='full' or 'auto', or an interpreter "
                        f"other uids can read, e.g. chmod o+rx {closed})")
        _PROBES[key] = why
    return _PROBES[key]


def isolation(config: SandboxConfig | None = None) -> Isolation:
    """The isolation runs get with ``config`` on this machine. Each level is probed once per (interpreter,
    site_packages) by running a probe program at that level (`_probe`): "auto" takes the strongest level that
    runs it, an explicit mode must run it. Raises RuntimeError (with each failure) where no level asked for can
    run Python: an error, never a run that scores a correct program 0."""
    config = config or SandboxConfig()
    levels = LEVELS if config.mode == "auto" else (config.mode,)
    failures = []
    with _ISOLATION_LOCK:
        for level in levels:
            why = _probe(config.python, config.site_packages, level)
            if not why:
                note = f"mode={config.mode!r} requested" if config.mode != "auto" else "; ".join(failures)
                return _isolation_of(level, note)
            failures.append(f"{level} isolation: {why}")
    raise RuntimeError(f"SandboxConfig(mode={config.mode!r}, python={config.python!r}, site_packages="
                       f"{config.site_packages}) cannot run Python here: " + "; ".join(failures))


def _user_process_count(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def _processes_of(uid: int) -> tuple[list[int], int]:
    """(pids of live processes whose real uid is ``uid``, number of its zombies) from a ``/proc`` scan."""
    live, zombies = [], 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        state, real_uid = "", None
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("State:"):
                        state = line.split()[1]
                    elif line.startswith("Uid:"):
                        real_uid = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue
        if real_uid == uid:
            if state in ("Z", "X"):
                zombies += 1  # dead already; init (or its parent) reaps it
            else:
                live.append(int(entry))
    return live, zombies


def _kill_uid(uid: int, timeout_s: float = 5.0, zombie_wait_s: float = 0.0) -> int:
    """SIGKILL every process whose real uid is ``uid`` until none is left (a fork bomb races the scan), then
    wait up to ``zombie_wait_s`` for their zombies to be reaped (zombies count towards RLIMIT_NPROC; run slots
    rest instead, see ``_Slots``). Returns the number of kill signals sent."""
    killed = 0
    start = time.monotonic()
    zombies_since = None
    while time.monotonic() - start < timeout_s:
        live, zombies = _processes_of(uid)
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        if not live:
            if not zombies:
                break
            zombies_since = zombies_since or time.monotonic()
            if time.monotonic() - zombies_since >= zombie_wait_s - 1e-9:
                break
        time.sleep(0.005)
    return killed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(status: list[dict], returncode: int | None, timed_out: bool, cpu_s: int) -> tuple[str, str]:
    """(reason, detail) from the boot's status records, the exit status and the deadline (module docstring)."""
    records = {r.get("event"): r for r in status}
    if "setup_error" in records:
        r = records["setup_error"]
        return "sandbox_error", f"{r.get('type')}: {r.get('message')}"
    if timed_out:
        return "timeout", "wall-clock limit"
    if returncode is not None and returncode < 0:
        signum = -returncode
        if signum == signal.SIGXCPU:
            return "timeout", f"CPU-time limit of {cpu_s} s (SIGXCPU)"
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        return "killed", f"signal {name}"
    if "error" in records:
        r = records["error"]
        kind, message = r.get("type", ""), r.get("message", "")
        detail = f"{kind}: {message}"
        if kind in _SYNTAX_ERRORS or (r.get("phase") == "compile" and kind != "MemoryError"):
            return "syntax_error", detail
        if kind == "AssertionError":
            return "assertion_failed", detail
        if kind == "MemoryError":
            return "memory", detail
        if kind == "SystemExit":
            return "early_exit", f"SystemExit({message}) before the end of the program"
        if NETWORK_MARKER in message or NETWORK_MARKER in r.get("traceback", ""):
            return "network_blocked", detail
        if kind in ("OSError", "ConnectionRefusedError", "gaierror", "TimeoutError") and any(
            token in message for token in ("Network is unreachable", "Connection refused", "No route to host",
                                           "Temporary failure in name resolution", "Name or service not known",
                                           "Cannot assign requested address")
        ):
            return "network_blocked", detail
        if kind == "PermissionError":
            return "permission_denied", detail
        return "runtime_error", detail
    if "done" in records and returncode == 0:
        return "passed", ""
    if "started" not in records:
        return "sandbox_error", f"the boot script ended (exit status {returncode}) before starting the program"
    if returncode == 0:
        return "early_exit", "exit status 0 before the end of the program (os._exit)"
    return "runtime_error", f"exit status {returncode} without an exception (os._exit)"


def _program_env(site_packages: bool) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    return env


def _run(source: bytes, config: SandboxConfig, *, level: str) -> RunResult:
    """One run at isolation ``level`` (module docstring)."""
    full = level == "full"
    switch_uid = level in ("full", "user")
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix="verl_prm_sandbox_"))  # 0700, the caller's
    slot = _SLOTS.acquire() if switch_uid else None
    uid = uid_for_slot(slot) if slot is not None else None
    status_r, status_w = os.pipe()
    process = None
    killed = [0]
    try:
        (staging / "program.py").write_bytes(source)
        if level == "user":  # the working directory is the staging directory: the run's uid owns it
            os.chown(staging, uid, uid)
            os.chown(staging / "program.py", uid, uid)
        env = _program_env(config.site_packages)
        if switch_uid:
            nproc = config.nproc
        elif hasattr(os, "geteuid") and os.geteuid() != 0:
            nproc = _user_process_count(os.geteuid()) + config.nproc
        else:
            nproc = None  # root ignores RLIMIT_NPROC: the deadline and killpg bound a fork bomb
        boot_config = dict(
            status_fd=status_w,
            program_path=str(staging / "program.py"),
            mount_namespace=full,
            network_namespace=full,
            mask_dirs=list(MASK_DIRS),
            tmpfs_kb=config.file_mb * 1024 * 2,
            workdir=str(staging),
            uid=uid,
            gid=uid,
            cpu_s=int(config.cpu_s),
            memory_bytes=int(config.memory_mb) * 1024 * 1024,
            file_bytes=int(config.file_mb) * 1024 * 1024,
            max_files=int(config.max_files),
            nproc=nproc,
            env=dict(env, HOME=FULL_WORKDIR if full else str(staging), TMPDIR=FULL_WORKDIR if full else str(staging)),
            audit_network=True,
            workdir_full=FULL_WORKDIR,
            expose=[list(entry) for entry in _interpreter_layout(config.python, config.site_packages).expose],
        )
        flags = ["-I", "-B"] + ([] if config.site_packages else ["-S"])
        process = subprocess.Popen(
            [config.python, *flags, str(BOOT), json.dumps(boot_config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            cwd=str(staging),
            env=env,
        )
        os.close(status_w)
        status_w = -1
        out, timed_out = _collect(process, status_r, config, uid, killed)
        returncode = process.returncode
        status = []
        for line in out["status"][0].decode("utf-8", "replace").splitlines():
            try:
                status.append(json.loads(line))
            except ValueError:
                pass
        reason, detail = _classify(status, returncode, timed_out, config.cpu_s)
        return RunResult(
            reason=reason,
            detail=detail,
            returncode=returncode,
            stdout=out["stdout"][0].decode("utf-8", "replace"),
            stderr=out["stderr"][0].decode("utf-8", "replace"),
            stdout_truncated=out["stdout"][1],
            stderr_truncated=out["stderr"][1],
            wall_s=time.perf_counter() - started,
            isolation=level,
        )
    finally:
        if process is not None and process.poll() is None:
            _kill_group(process.pid)
            process.wait()
        if uid is not None:
            killed[0] += _kill_uid(uid)
        for fd in (status_r, status_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(staging, ignore_errors=True)
        if slot is not None:
            _SLOTS.release(slot, killed[0] > 0)


def _collect(process: subprocess.Popen, status_fd: int, config: SandboxConfig, uid: int | None, killed: list[int]):
    """Read stdout, stderr and the status pipe until the run ends or the deadline passes; kill what is left.

    Returns ``({name: (bytes kept, truncated)}, timed_out)``."""
    deadline = time.monotonic() + config.timeout_s
    keep = {"stdout": config.max_output_bytes, "stderr": config.max_output_bytes, "status": 1 << 16}
    data = {name: bytearray() for name in keep}
    truncated = {name: False for name in keep}
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "stdout")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    status_file = os.fdopen(os.dup(status_fd), "rb", buffering=0)
    selector.register(status_file, selectors.EVENT_READ, "status")
    open_streams = 3
    timed_out = False
    leader_done_at = None
    try:
        while open_streams:
            now = time.monotonic()
            if now >= deadline:
                timed_out = process.poll() is None or leader_done_at is None
                break
            if leader_done_at is None and process.poll() is not None:
                leader_done_at = now
                # The program's main process ended: whatever it left behind (background children holding the
                # pipes) is killed now rather than waited for.
                _kill_group(process.pid)
                if uid is not None:
                    killed[0] += _kill_uid(uid)
            for key, _ in selector.select(timeout=min(0.05, max(deadline - now, 0.0))):
                chunk = os.read(key.fileobj.fileno(), 65536)
                name = key.data
                if not chunk:
                    selector.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                room = keep[name] - len(data[name])
                if room > 0:
                    data[name] += chunk[:room]
                if len(chunk) > max(room, 0):
                    truncated[name] = True
    finally:
        selector.close()
        status_file.close()
    if process.poll() is None:
        _kill_group(process.pid)
    if uid is not None:
        killed[0] += _kill_uid(uid)
    process.wait()
    for stream in (process.stdout, process.stderr):
        stream.close()
    return {name: (bytes(data[name]), truncated[name]) for name in keep}, timed_out


def run_program(source: str | bytes, config: SandboxConfig | None = None) -> RunResult:
    """Run the Python program ``source`` in the sandbox (module docstring) and classify its outcome."""
    config = config or SandboxConfig()
    level = isolation(config).mode
    data = source.encode("utf-8") if isinstance(source, str) else bytes(source)
    return _run(data, config, level=level)


def run_many(
    sources: Sequence[str | bytes],
    config: SandboxConfig | None = None,
    *,
    max_workers: int | None = None,
    progress: bool = False,
) -> list[RunResult]:
    """``run_program`` over many programs with at most ``max_workers`` runs at once (default: the CPU count,
    at most 32); results in input order."""
    config = config or SandboxConfig()
    isolation(config)  # probe once, before the threads start
    workers = max(1, min(max_workers or min(os.cpu_count() or 1, 32), _SLOTS_PER_PROCESS, max(len(sources), 1)))
    results: list[RunResult | None] = [None] * len(sources)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(sources), unit="run", desc="sandbox")
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        futures = {pool.submit(run_program, source, config): i for i, source in enumerate(sources)}
        from concurrent.futures import as_completed

        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return [r for r in results if r is not None]

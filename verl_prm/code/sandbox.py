"""Run untrusted Python programs: one process per run, limits, isolation, and a failure reason for every run.

``run_program(source, config)`` writes ``source`` to a root-only staging directory and starts
``python -I -S -B verl_prm/code/_boot.py`` as the leader of a new session (``setsid``) with an environment
of a few fixed variables (nothing of the caller's environment). The boot script (``_boot.py``) sets up the
isolation before any program code runs. The modules: ``sandbox_config`` (``SandboxConfig``, every field
checked; ``RunResult``, ``REASONS``), ``sandbox_setup`` (uids, the directories masked, the interpreter's files,
the probe program), this one (probing, running, collecting, classifying). Three isolation levels.
``isolation()`` runs a probe program once per level asked for, interpreter, ``site_packages`` setting and set of
limits, under the configured limits (lazily imported standard-library modules, the executable, every directory
of the interpreter's ``sys.path``): ``SandboxConfig.mode="auto"`` takes the strongest level that runs it; an
explicit mode that cannot run it is a RuntimeError, a limit too small to run it a ValueError naming the limit
(never a run that scores a correct program 0):

* **full isolation** (the process runs as root and may create namespaces):
  enters a new **network namespace** (only a loopback device that is down: no route anywhere), a new **IPC
  namespace** and a new **mount namespace** in which a fresh, size-capped tmpfs is mounted over each of
  ``sandbox_setup.mask_dirs()``: ``/tmp``, ``/var/tmp``, ``/dev/shm`` and every other world-writable directory
  that other uids can reach, found by walking the file tree once per process (``world_writable_dirs``); the
  working directory is a new directory inside the tmpfs over ``/tmp``, so it and everything the program writes
  vanish with the namespace (when the last process of the run exits), and the host's files in those directories
  (Ray's sockets in ``/tmp/ray``, other users' files) are invisible;
  the interpreter's files that this hides (an interpreter, virtual environment or site-packages under ``/tmp``;
  a pyenv install under ``/root``, which other uids cannot traverse) are bound back at their own paths,
  **read-only** (``interpreter_layout``: the executable's directory, ``base_prefix``, every ``sys.path``
  directory, with ``site_packages`` also ``prefix`` and what ``.pth`` files add); a path that cannot be shown
  without undoing the private tmpfs (``/tmp`` itself on ``sys.path``) is refused with a ValueError;
  **every other mount is made read-only** in the namespace (a world-writable directory created after the walk,
  a world-writable file: EROFS); a **seccomp filter** refuses ``socket(AF_UNIX, ...)`` (EAFNOSUPPORT), so no
  Unix-domain socket of the host is reachable, whatever its mode (``socketpair`` stays); then it drops to an
  **unprivileged uid** of its own (a number with no passwd entry, unique per run slot of this process:
  ``uid_for_slot``), so what is readable follows ordinary Unix permissions, and ``RLIMIT_NPROC`` counts exactly
  this run's processes;
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
namespace and the seccomp filter are the barrier, the hook only names the cause); a wall-clock deadline after
which the whole process group is killed (``killpg(SIGKILL)``), and in full and user isolation every process of
the run's uid is killed as well (``/proc`` scan, repeated until none is left), which also gets processes that
left the process group (``setsid``, double fork). Stdout and stderr are read concurrently and at most
``max_output_bytes`` of each is kept (the rest is read and discarded, so a chatty program cannot block or fill
memory).

The outcome of a run (`RunResult.reason`) is one of ``sandbox_config.REASONS``, decided from the boot script's
status record (written to a private pipe), the exit status and the deadline:

    passed            the program ran to its end (exit status 0 and the boot script's "done" record)
    syntax_error      the program does not compile (SyntaxError, IndentationError, ...)
    assertion_failed  an AssertionError escaped (a failed test)
    runtime_error     any other exception escaped (or a non-zero exit status without a record)
    timeout           the wall-clock deadline passed, or the CPU limit killed it (SIGXCPU)
    memory            MemoryError (RLIMIT_AS refused an allocation)
    permission_denied a PermissionError escaped (EACCES/EPERM: e.g. a write outside the working directory), or
                      an OSError EROFS (a write to a mount that full isolation made read-only)
    network_blocked   the exception escaping was the network audit hook's PermissionError, or an OSError of a
                      refused connection (ENETUNREACH, ...) in the network namespace, or EAFNOSUPPORT (the
                      seccomp filter's answer to a Unix-domain socket in full isolation)
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
"basic isolation" above. In full isolation, what needs a Unix-domain socket (``multiprocessing.Manager``, the
``forkserver`` start method) fails with EAFNOSUPPORT, and the walk for world-writable directories costs time in
proportion to the directories other uids can reach (once per process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Sequence

from verl_prm.code.sandbox_config import Isolation, RunResult, SandboxConfig
from verl_prm.code.sandbox_setup import (
    RUN_SLOTS,
    FULL_WORKDIR,
    LEVELS,
    SLOTS_PER_PROCESS,
    interpreter_layout,
    isolation_of,
    mask_dirs,
    probe_source,
    uid_for_slot,
)

__all__ = ["isolation", "run_many", "run_program"]

BOOT = Path(__file__).with_name("_boot.py")
NETWORK_MARKER = "sandbox: network access is blocked"
_SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")
_ISOLATION_LOCK = threading.Lock()
_PROBES: dict[tuple, str] = {}  # (python, site_packages, level, limits) -> "" (runs) or why not


def _probe_config(config: SandboxConfig, **limits: int) -> SandboxConfig:
    """The probe's config: ``config``'s limits (or ``limits`` instead), a wall-clock limit of at least 30 s (a
    loaded machine's interpreter start-up must not read as a failure), auto mode (the level is ``_run``'s)."""
    return dataclasses.replace(config, timeout_s=max(config.timeout_s, 30.0), mode="auto", **limits)


def _probe(config: SandboxConfig, level: str) -> str:
    """Why ``level`` cannot run Python with ``config``'s interpreter here ("" if it can): a probe program
    (`probe_source`) run at that level under ``config``'s limits; cached per (interpreter, site_packages, level,
    limits). Call with ``_ISOLATION_LOCK`` held.

    Raises ValueError where the probe fails under the configured limits but passes under the defaults: that limit
    (the first one that makes the probe pass when raised to its default alone) would fail every program."""
    python, site_packages = config.python, config.site_packages
    key = (python, site_packages, level, tuple(config.limits().items()))
    if key not in _PROBES:
        if level in ("full", "user") and (not hasattr(os, "geteuid") or os.geteuid() != 0):
            _PROBES[key] = "not running as root: no namespaces, no uid switch"
            return _PROBES[key]
        layout = interpreter_layout(python, site_packages)
        source = probe_source(layout)
        result = _run(source, _probe_config(config), level=level)
        why = "" if result.passed else f"the probe program ended with {result.reason}: {result.detail[:300]}"
        defaults = SandboxConfig().limits()
        lowered = {name: defaults[name] for name, value in config.limits().items() if value < defaults[name]}
        if why and lowered and _run(source, _probe_config(config, **lowered), level=level).passed:
            culprits = [name for name in lowered
                        if _run(source, _probe_config(config, **{name: defaults[name]}), level=level).passed]
            named = culprits[:1] or list(lowered)
            raise ValueError(
                "SandboxConfig(" + ", ".join(f"{name}={getattr(config, name)}" for name in named) + ") is too small "
                f"to start {python} in {level} isolation: the start-up probe {why[len('the probe program '):]}, and "
                "passes with " + ", ".join(f"{name}={defaults[name]}" for name in named) + " (the default); raise "
                + " and ".join(named))
        if why and level == "user" and layout.closed:
            path, closed = layout.closed[0]
            why += (f" (the interpreter's {path} is not readable by other uids: {closed} has no o+x bit, and user "
                    f"isolation has no mount namespace to show it; use mode='full' or 'auto', or an interpreter "
                    f"other uids can read, e.g. chmod o+rx {closed})")
        _PROBES[key] = why
    return _PROBES[key]


def isolation(config: SandboxConfig | None = None) -> Isolation:
    """The isolation runs get with ``config`` on this machine. Each level is probed once per (interpreter,
    site_packages, limits) by running a probe program at that level under the configured limits (`_probe`):
    "auto" takes the strongest level that runs it, an explicit mode must run it. Raises RuntimeError (with each
    failure) where no level asked for can run Python, ValueError where a configured limit is what stops it: an
    error, never a run that scores a correct program 0."""
    config = config or SandboxConfig()
    levels = LEVELS if config.mode == "auto" else (config.mode,)
    failures = []
    with _ISOLATION_LOCK:
        for level in levels:
            why = _probe(config, level)
            if not why:
                note = f"mode={config.mode!r} requested" if config.mode != "auto" else "; ".join(failures)
                return isolation_of(level, note)
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
                                           "Cannot assign requested address", "Address family not supported")
        ):
            return "network_blocked", detail
        if kind == "PermissionError" or (kind == "OSError" and "[Errno 30] Read-only file system" in message):
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
    slot = RUN_SLOTS.acquire() if switch_uid else None
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
            mask_dirs=list(mask_dirs()) if full else [],
            remount_readonly=full,
            deny_unix_sockets=full,
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
            expose=[list(entry) for entry in interpreter_layout(config.python, config.site_packages).expose],
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
            RUN_SLOTS.release(slot, killed[0] > 0)


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
    workers = max(1, min(max_workers or min(os.cpu_count() or 1, 32), SLOTS_PER_PROCESS, max(len(sources), 1)))
    results: list[RunResult | None] = [None] * len(sources)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(sources), unit="run", desc="sandbox")
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        futures = {pool.submit(run_program, source, config): i for i, source in enumerate(sources)}

        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return [r for r in results if r is not None]

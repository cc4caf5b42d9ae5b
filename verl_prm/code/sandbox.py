"""Run untrusted Python programs: one process per run, limits, isolation, and a failure reason for every run.

``run_program(source, config)`` starts ``bwrap`` (bubblewrap, as Flatpak uses it) as the leader of a new session
with a fixed environment (nothing of the caller's), and in it ``python -I -S -B -c <_boot.py> CONFIG``; the
program's text reaches the boot script through a memfd. The modules: ``sandbox_config`` (``SandboxConfig``, every
field checked; ``RunResult``, ``REASONS``), ``sandbox_setup`` (the bwrap command line, the directories masked,
the interpreter's files, the seccomp filter, the run's uid, the probe program), ``_boot`` (the child: uid,
limits, audit hook, the program) and this one (probing, running, collecting, classifying). Two levels,
``SandboxConfig.mode``:

* **bwrap** (the default): ``bwrap`` gives the run new PID, network (no route), IPC, UTS and cgroup namespaces
  and a mount namespace in which the host's file tree is read-only, ``/dev`` is fresh, ``/proc`` shows the
  run's processes only, a private size-capped tmpfs covers each of ``sandbox_setup.mask_dirs()`` (``/tmp``,
  ``/var/tmp``, ``/dev/shm`` and every other world-writable directory that other uids can reach, found by one
  walk of the file tree per process; the working directory is ``/tmp/sandbox`` inside it), and the interpreter's
  files that this hides (an interpreter or venv under ``/tmp``, a pyenv install under ``/root``) are bound back
  read-only at their own paths (``interpreter_layout``; a path that cannot be shown without undoing the private
  tmpfs, ``/tmp`` itself on ``sys.path``, is a ValueError). A seccomp filter (libseccomp) refuses
  ``socket(AF_UNIX, ...)`` with EAFNOSUPPORT, so no Unix-domain socket of the host is reachable whatever its
  mode (``socketpair`` stays). As root, bwrap keeps no capability but CAP_SETUID/CAP_SETGID, with which the boot
  script drops to an **unprivileged uid** of the run's own (``uid_for_slot``), so ``RLIMIT_NPROC`` counts exactly
  this run's processes and what is readable follows Unix permissions; not root, bwrap makes a user namespace and
  the program keeps the caller's uid. When the program's first process ends, or at the deadline, the PID
  namespace ends and every process of the run with it (``setsid`` and double forks included). Without ``bwrap``
  (or libseccomp) ``isolation`` raises a RuntimeError naming the package to install.
* **basic** (asked for by name only; it logs a warning when first probed): no namespaces. The working directory
  is a fresh directory (removed afterwards); network access is refused by the audit hook only; writes elsewhere
  are limited by the caller's own permissions; ``RLIMIT_NPROC`` is the caller's current process count +
  ``nproc`` (the kernel does not enforce it for root); processes that leave the process group survive the run.

``isolation()`` runs a probe program once per level, interpreter, ``site_packages`` setting and set of limits,
under the configured limits (lazily imported standard-library modules, the executable, every directory of the
interpreter's ``sys.path``): a level that cannot run it is a RuntimeError, a limit too small to run it a
ValueError naming the limit (never a run that scores a correct program 0).

At every level: ``no_new_privs`` (executing a setuid/setgid binary raises no privileges); resource limits
``RLIMIT_CPU`` (CPU seconds; SIGXCPU then SIGKILL), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (largest
file written), ``RLIMIT_NOFILE``, ``RLIMIT_CORE = 0``; an audit hook that raises
``PermissionError("sandbox: network access is blocked")`` when the program creates an IPv4/IPv6 (any non-Unix)
socket or connects/binds/sends to a network address (a clear failure reason; under bwrap the namespace and the
seccomp filter are the barrier, the hook only names the cause); a wall-clock deadline after which the run is
killed. Stdout and stderr are read concurrently and at most ``max_output_bytes`` of each is kept (the rest is read
and discarded, so a chatty program cannot block or fill memory).

The outcome of a run (`RunResult.reason`) is one of ``sandbox_config.REASONS``, decided from the boot script's
status record (written to a private pipe), the exit status and the deadline:

    passed            the program ran to its end (exit status 0 and the boot script's "done" record)
    syntax_error      the program does not compile (SyntaxError, IndentationError, ...)
    assertion_failed  an AssertionError escaped (a failed test)
    runtime_error     any other exception escaped (or a non-zero exit status without a record)
    timeout           the wall-clock deadline passed, or the CPU limit killed it (SIGXCPU)
    memory            MemoryError (RLIMIT_AS refused an allocation)
    permission_denied a PermissionError escaped (EACCES/EPERM), or an OSError EROFS (a write to the read-only
                      file tree under bwrap)
    network_blocked   the exception escaping was the network audit hook's PermissionError, or an OSError of a
                      refused connection (ENETUNREACH, ...) in the network namespace, or EAFNOSUPPORT (the
                      seccomp filter's answer to a Unix-domain socket)
    early_exit        the program called exit()/sys.exit() (SystemExit) or os._exit() before the end: the
                      tests did not all run, so it is no pass even with exit status 0
    killed            a signal ended it (SIGSEGV, SIGABRT, an external SIGKILL; bwrap reports signal N as exit
                      status 128 + N, so an ``os._exit(128 + N)`` reads as that signal too)
    sandbox_error     the sandbox could not be set up (names the step, or bwrap's message; the program did not run)

Limits of the guarantees (read before trusting a reward): the program runs in the same interpreter as the boot
script, so a program written against this harness can find the status pipe and forge a "done" record, or
return objects whose ``__eq__`` is always true; the sandbox contains the machine (files, network,
processes, memory, time), not reward hacking inside the interpreter. Files outside the masks stay readable
wherever Unix permissions let the run's uid read them. What needs a Unix-domain socket
(``multiprocessing.Manager``, the ``forkserver`` start method) fails with EAFNOSUPPORT under bwrap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
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
    SLOTS_PER_PROCESS,
    WORKDIR,
    bwrap_command,
    bwrap_executable,
    interpreter_layout,
    isolation_of,
    probe_source,
    uid_for_slot,
    unix_socket_filter,
)

__all__ = ["isolation", "run_many", "run_program"]

NETWORK_MARKER = "sandbox: network access is blocked"
_SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")
_ISOLATION_LOCK = threading.Lock()
_PROBES: dict[tuple, str] = {}  # (python, site_packages, level, limits, bwrap) -> "" (runs) or why not
logger = logging.getLogger(__name__)
# passed with -c: the file itself may sit under a directory the sandbox masks (a clone under /tmp)
BOOT_SOURCE = Path(__file__).with_name("_boot.py").read_text()


def _probe_config(config: SandboxConfig, **limits: int) -> SandboxConfig:
    """The probe's config: ``config``'s limits (or ``limits`` instead) and a wall-clock limit of at least 30 s (a
    loaded machine's interpreter start-up must not read as a failure)."""
    return dataclasses.replace(config, timeout_s=max(config.timeout_s, 30.0), **limits)


def _probe(config: SandboxConfig) -> str:
    """Why ``config.mode`` cannot run Python with ``config``'s interpreter here ("" if it can): a probe program
    (`probe_source`) run under ``config``'s limits; cached per (interpreter, site_packages, level, limits). Call
    with ``_ISOLATION_LOCK`` held.

    Raises ValueError where the probe fails under the configured limits but passes under the defaults: that limit
    (the first one that makes the probe pass when raised to its default alone) would fail every program."""
    python, site_packages, level = config.python, config.site_packages, config.mode
    key = (python, site_packages, level, tuple(config.limits().items()), bwrap_executable() if level == "bwrap" else "")
    if key not in _PROBES:
        source = probe_source(interpreter_layout(python, site_packages))
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
        if not why and level == "basic":
            logger.warning("sandbox: SandboxConfig(mode='basic') runs programs WITHOUT isolation: no namespaces, "
                           "network refused by an audit hook only, the caller's file permissions, no private /tmp; "
                           "use mode='bwrap' (install bubblewrap) for untrusted code")
        _PROBES[key] = why
    return _PROBES[key]


def isolation(config: SandboxConfig | None = None) -> Isolation:
    """The isolation runs get with ``config`` on this machine, checked once per (interpreter, site_packages,
    limits) by running a probe program under the configured limits (`_probe`). Raises RuntimeError where bwrap or
    libseccomp is missing (naming the package) or the level cannot run Python here (with the probe's failure),
    ValueError where a configured limit is what stops it: an error, never a run that scores a correct program 0.
    ``mode='basic'`` logs a warning when first probed (it isolates little)."""
    config = config or SandboxConfig()
    if config.mode == "bwrap":
        bwrap_executable()
        unix_socket_filter()
    with _ISOLATION_LOCK:
        why = _probe(config)
    if why:
        hint = "; bwrap needs namespaces (root, or unprivileged user namespaces)" if config.mode == "bwrap" else ""
        raise RuntimeError(f"SandboxConfig(mode={config.mode!r}, python={config.python!r}, site_packages="
                           f"{config.site_packages}) cannot run Python here: {why}{hint}")
    return isolation_of(config.mode, f"mode={config.mode!r}")


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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(status: list[dict], returncode: int | None, timed_out: bool, cpu_s: int,
              stderr: str) -> tuple[str, str]:
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
        said = "".join(f": {line}" for line in stderr.strip().splitlines()[-1:])  # bwrap's own message, if any
        return "sandbox_error", f"the boot script ended (exit status {returncode}) before starting the program{said}"
    if returncode == 0:
        return "early_exit", "exit status 0 before the end of the program (os._exit)"
    return "runtime_error", f"exit status {returncode} without an exception (os._exit)"


def _program_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _boot_config(config: SandboxConfig, level: str, uid: int | None, workdir: str, fds: dict[str, int]) -> dict:
    """What ``_boot.py`` is told: the descriptors, the working directory, the uid to drop to and the limits.
    ``RLIMIT_NPROC`` counts processes per uid: under bwrap as root the run's own uid holds the program's
    processes only; in a user namespace bwrap's init process counts too; basic mode shares the caller's uid."""
    if level == "bwrap":
        nproc = config.nproc if uid is not None else config.nproc + 1
    elif os.geteuid() != 0:
        nproc = _user_process_count(os.geteuid()) + config.nproc
    else:
        nproc = None  # root ignores RLIMIT_NPROC: the deadline and killpg bound a fork bomb
    return dict(
        status_fd=fds["status"], source_fd=fds["source"], workdir=workdir, make_workdir=level == "bwrap", uid=uid,
        no_new_privs=level == "basic", cpu_s=int(config.cpu_s), memory_bytes=int(config.memory_mb) << 20,
        file_bytes=int(config.file_mb) << 20, max_files=int(config.max_files), nproc=nproc,
        env=dict(_program_env(), HOME=workdir, TMPDIR=workdir),
    )


def _start(config: SandboxConfig, level: str, uid: int | None, workdir: str, fds: dict[str, int]) -> subprocess.Popen:
    """Start the run's leader: ``bwrap ... -- python ... -c BOOT CONFIG`` (basic mode: ``python ...`` itself)."""
    boot = json.dumps(_boot_config(config, level, uid, workdir, fds))
    python = [config.python, "-I", "-B", *([] if config.site_packages else ["-S"]), "-c", BOOT_SOURCE, boot]
    prefix = bwrap_command(config, uid, fds["seccomp"], fds["bwrap"]) if level == "bwrap" else []
    return subprocess.Popen(prefix + python, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, pass_fds=tuple(fds.values()), start_new_session=True,
                            cwd="/" if level == "bwrap" else workdir, env=_program_env())


def _run(source: bytes, config: SandboxConfig, *, level: str) -> RunResult:
    """One run at isolation ``level`` (module docstring)."""
    started = time.perf_counter()
    staging = None if level == "bwrap" else tempfile.mkdtemp(prefix="verl_prm_sandbox_")  # 0700, the caller's
    slot = RUN_SLOTS.acquire() if level == "bwrap" and os.geteuid() == 0 else None
    status_r, status_w = os.pipe()
    ours, theirs = [status_r], {"status": status_w, "source": os.memfd_create("verl_prm_program")}
    process = None
    try:
        os.write(theirs["source"], source)
        if level == "bwrap":
            theirs["seccomp"], seccomp_w = os.pipe()  # a pipe holds 64 KiB: the filter is a few hundred bytes
            os.write(seccomp_w, unix_socket_filter())
            os.close(seccomp_w)
            bwrap_r, theirs["bwrap"] = os.pipe()
            ours.append(bwrap_r)
        process = _start(config, level, None if slot is None else uid_for_slot(slot), staging or WORKDIR, theirs)
        for fd in theirs.values():
            os.close(fd)
        theirs = {}
        out, timed_out = _collect(process, ours, config)
        returncode = process.returncode
        if level == "bwrap" and returncode is not None and 128 < returncode <= 128 + 64:
            returncode = -(returncode - 128)  # bwrap's exit status for "killed by signal N"
        stderr = out["stderr"][0].decode("utf-8", "replace")
        status = []
        for line in out["status"][0].decode("utf-8", "replace").splitlines():
            try:
                status.append(json.loads(line))
            except ValueError:
                pass
        reason, detail = _classify(status, returncode, timed_out, config.cpu_s, stderr)
        return RunResult(reason=reason, detail=detail, returncode=returncode,
                         stdout=out["stdout"][0].decode("utf-8", "replace"), stderr=stderr,
                         stdout_truncated=out["stdout"][1], stderr_truncated=out["stderr"][1],
                         wall_s=time.perf_counter() - started, isolation=level)
    finally:
        if process is not None and process.poll() is None:
            _kill_group(process.pid)
            process.wait()
        for fd in ours + list(theirs.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if slot is not None:
            RUN_SLOTS.release(slot)


def _stop(process: subprocess.Popen, bwrap_status: bytes) -> None:
    """Kill the run. Under bwrap: its PID namespace's init (``child-pid`` of bwrap's status), whose end kills every
    process of the namespace and returns only once they are gone (so the run's uid is free again when bwrap has
    exited); then, or in basic mode, the leader's process group."""
    found = re.search(rb'"child-pid": (\d+)', bwrap_status)
    if found and process.poll() is None:  # bwrap has not reaped its child yet: the pid is still that child's
        try:
            os.kill(int(found.group(1)), signal.SIGKILL)
            process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if process.poll() is None:
        _kill_group(process.pid)


def _collect(process: subprocess.Popen, fds: list[int], config: SandboxConfig):
    """Read stdout, stderr, the status pipe and bwrap's status until the run ends or the deadline passes; kill
    what is left.

    Returns ``({name: (bytes kept, truncated)}, timed_out)``."""
    deadline = time.monotonic() + config.timeout_s
    keep = {"stdout": config.max_output_bytes, "stderr": config.max_output_bytes, "status": 1 << 16, "bwrap": 4096}
    data = {name: bytearray() for name in keep}
    truncated = {name: False for name in keep}
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "stdout")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    for fd, name in zip(fds, ("status", "bwrap")):
        selector.register(fd, selectors.EVENT_READ, name)
    open_streams = 2 + len(fds)
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
                # The leader ended: whatever it left behind (basic mode: background children holding the pipes)
                # is killed now rather than waited for.
                _kill_group(process.pid)
            for key, _ in selector.select(timeout=min(0.05, max(deadline - now, 0.0))):
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
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
    if not timed_out:  # the streams closed: the leader is ending (or basic mode's leftovers were killed)
        try:
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    _stop(process, bytes(data["bwrap"]))
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

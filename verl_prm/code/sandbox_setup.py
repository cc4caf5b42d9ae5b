"""The isolation set-up on the caller's side (``verl_prm.code.sandbox`` runs it, ``_boot.py`` applies it in the
child): the run's unprivileged uid (``uid_for_slot``, run slots), the directories the private tmpfs masks, the
interpreter's files that must stay readable (``interpreter_layout``), the probe program, and what each level
isolates by (``isolation_of``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from dataclasses import dataclass

from verl_prm.code.sandbox_config import Isolation

__all__ = ["FULL_WORKDIR", "LEVELS", "RUN_SLOTS", "SLOTS_PER_PROCESS", "TEMP_DIRS", "interpreter_layout",
           "isolation_of", "mask_dirs", "mount_table", "probe_source", "uid_for_slot", "world_writable_dirs"]

# Temporary directories: always masked where they exist (whatever their mode); the first holds the working
# directory. Every other world-writable directory is found by `world_writable_dirs`.
TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# File systems not walked for world-writable directories: kernel interfaces, where no directory takes new files
# from an unprivileged uid. (Network file systems are walked too: a world-writable NFS directory is one.)
_KERNEL_FS = frozenset({"proc", "sysfs", "devpts", "securityfs", "debugfs", "tracefs", "pstore", "efivarfs",
                        "configfs", "fusectl", "binfmt_misc", "bpf", "autofs"})
# uids of run slots: 200000 + (pid mod 100000) * 64 + slot, unique among the processes of this host that run
# sandboxes at the same time (pids are unique while alive), far above any uid a distribution hands out.
_UID_BASE = 200_000
SLOTS_PER_PROCESS = 64


def uid_for_slot(slot: int, pid: int | None = None) -> int:
    """The uid of run slot ``slot`` (0..63) of process ``pid`` (module constants)."""
    if not 0 <= slot < SLOTS_PER_PROCESS:
        raise ValueError(f"slot must be in [0, {SLOTS_PER_PROCESS}), got {slot}")
    return _UID_BASE + ((os.getpid() if pid is None else pid) % 100_000) * SLOTS_PER_PROCESS + slot


class _Slots:
    """Run slots of this process (each with its own uid), handed out to concurrent runs.

    First in, first out, and a slot whose run had processes killed rests ``rest_s`` before it is handed out
    again (unless no other slot is free): the zombies of a killed fork bomb count towards RLIMIT_NPROC of their
    uid until init reaps them, which can take a moment."""

    def __init__(self, rest_s: float = 2.0) -> None:
        self._lock = threading.Condition()
        self._pid = os.getpid()
        self._free: list[tuple[int, float]] = [(slot, 0.0) for slot in range(SLOTS_PER_PROCESS)]
        self.rest_s = rest_s

    def acquire(self) -> int:
        with self._lock:
            if self._pid != os.getpid():  # forked: a new process, new uids
                self._pid, self._free = os.getpid(), [(slot, 0.0) for slot in range(SLOTS_PER_PROCESS)]
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


RUN_SLOTS = _Slots()


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo (space, tab, newline and backslash are written as octal escapes)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_table() -> list[tuple[str, str]]:
    """``(mount point, file system type)`` of every mount of this process's mount namespace, in mount order."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            mounts.append((_unescape(fields[4]), fields[separator + 1]))
    return mounts


def world_writable_dirs() -> tuple[str, ...]:
    """Every directory that an unprivileged uid can create files in: mode o+w, reached through directories that
    all have o+x (a directory other uids cannot traverse hides everything below it). A walk of the whole file
    tree from ``/``, every mount included except kernel interfaces (``_KERNEL_FS``: /proc, /sys, ...); symbolic
    links are not followed, and nothing below a world-writable directory is walked (its mask hides it). Sorted."""
    skip = {mount for mount, fstype in mount_table() if fstype in _KERNEL_FS and mount != "/"}
    found, stack = [], ["/"]
    while stack:
        directory = stack.pop()
        try:
            entries = os.scandir(directory)
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    if not entry.is_dir(follow_symlinks=False) or entry.path in skip:
                        continue
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue
                if mode & stat.S_IWOTH:
                    found.append(entry.path)
                elif mode & stat.S_IXOTH:
                    stack.append(entry.path)
    return tuple(sorted(found))


_MASKS: list[tuple[str, ...]] = []
_MASKS_LOCK = threading.Lock()


def mask_dirs() -> tuple[str, ...]:
    """The directories a run in full isolation gets a private tmpfs over: ``TEMP_DIRS`` (where they exist) and
    `world_writable_dirs`, found once per process (the first call walks the file tree), outermost only (a
    directory inside another one is masked with it), ``TEMP_DIRS[0]`` first (it holds the working directory)."""
    with _MASKS_LOCK:
        if not _MASKS:
            candidates = [d for d in TEMP_DIRS if os.path.isdir(d)] + list(world_writable_dirs())
            outermost = []
            for path in sorted(set(candidates), key=len):
                if not any(_under(path, outer) for outer in outermost):
                    outermost.append(path)
            _MASKS.append(tuple(sorted(outermost, key=lambda d: (d != TEMP_DIRS[0], d))))
        return _MASKS[0]


LEVELS = ("full", "user", "basic")
# The working directory of a run in full isolation (inside the private tmpfs over TEMP_DIRS[0]).
FULL_WORKDIR = TEMP_DIRS[0] + "/sandbox"
_QUERY = (
    "import json, sys\n"
    "print(json.dumps({'executable': sys.executable, 'prefix': sys.prefix, 'exec_prefix': sys.exec_prefix, "
    "'base_prefix': sys.base_prefix, 'base_exec_prefix': sys.base_exec_prefix, 'path': sys.path}))\n"
)


@dataclass(frozen=True)
class _Layout:
    """What the sandboxed interpreter reads after the uid switch (``interpreter_layout``).

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


def interpreter_layout(python: str, site_packages: bool) -> _Layout:
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
    masks = mask_dirs()
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
        refused = [d for d in masks if path == d] + ([FULL_WORKDIR] if _under(path, FULL_WORKDIR) else [])
        if refused:
            raise ValueError(
                f"SandboxConfig(python={python!r}, site_packages={site_packages}): the interpreter needs {path}, "
                f"which the sandbox cannot show read-only without undoing its private {refused[0]}; install the "
                f"interpreter (or its packages) elsewhere, or drop {path} from its sys.path (.pth files)")
    hidden = []
    for path in paths:
        masked = [d for d in masks if _under(path, d)]
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


def probe_source(layout: _Layout) -> bytes:
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


def isolation_of(level: str, note: str = "") -> Isolation:
    if level == "full":
        return Isolation("full", "namespace+audit-hook",
                         "private tmpfs over " + ", ".join(mask_dirs()) + " (cwd inside it); every other mount "
                         "read-only; the interpreter's files read-only; unprivileged uid; no Unix sockets",
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

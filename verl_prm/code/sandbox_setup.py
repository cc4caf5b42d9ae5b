"""The caller's side of the sandbox (``verl_prm.code.sandbox`` runs it, ``_boot.py`` runs in the child): the
``bwrap`` command line of a run (`bwrap_command`: the directories it masks, the interpreter's files it shows
read-only, the seccomp filter against Unix-domain sockets), the run's unprivileged uid (`RUN_SLOTS`), the probe
program, and what each level isolates by (`isolation_of`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import stat
import subprocess
import threading
from dataclasses import dataclass
from pathlib import PurePath

from verl_prm.code.sandbox_config import Isolation, SandboxConfig

__all__ = ["LEVELS", "RUN_SLOTS", "SLOTS_PER_PROCESS", "TEMP_DIRS", "WORKDIR", "bwrap_command", "bwrap_executable",
           "interpreter_layout", "isolation_of", "mask_dirs", "mount_table", "probe_source", "uid_for_slot",
           "unix_socket_filter", "world_writable_dirs"]

LEVELS = ("bwrap", "basic")
# Temporary directories: always masked where they exist (whatever their mode); the first holds the working
# directory. Every other world-writable directory is found by `world_writable_dirs`.
TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# The working directory of a run under bwrap (inside the private tmpfs over TEMP_DIRS[0]).
WORKDIR = TEMP_DIRS[0] + "/sandbox"
# File systems not walked for world-writable directories: kernel interfaces, where no directory takes new files
# from an unprivileged uid. (Network file systems are walked too: a world-writable NFS directory is one.)
_KERNEL_FS = frozenset({"proc", "sysfs", "devpts", "securityfs", "debugfs", "tracefs", "pstore", "efivarfs",
                        "configfs", "fusectl", "binfmt_misc", "bpf", "autofs"})
# uids of run slots: 200000 + (pid mod 100000) * 64 + slot, unique among the processes of this host that run
# sandboxes at the same time (pids are unique while alive), far above any uid a distribution hands out.
_UID_BASE = 200_000
SLOTS_PER_PROCESS = 64
_INSTALL = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap; "
            "version 0.8.0 or newer)")


def uid_for_slot(slot: int, pid: int | None = None) -> int:
    """The uid of run slot ``slot`` (0..63) of process ``pid`` (module constants)."""
    if not 0 <= slot < SLOTS_PER_PROCESS:
        raise ValueError(f"slot must be in [0, {SLOTS_PER_PROCESS}), got {slot}")
    return _UID_BASE + ((os.getpid() if pid is None else pid) % 100_000) * SLOTS_PER_PROCESS + slot


class _Slots:
    """Run slots of this process, each with its own uid, handed out to concurrent runs (lowest free first), so
    that ``RLIMIT_NPROC`` counts one run's processes. A slot is free again when its run's ``bwrap`` has exited:
    the run's PID namespace, and with it every process of the uid, is gone by then."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pid = os.getpid()
        self._free = list(range(SLOTS_PER_PROCESS))

    def acquire(self) -> int:
        with self._lock:
            if self._pid != os.getpid():  # forked: a new process, new uids
                self._pid, self._free = os.getpid(), list(range(SLOTS_PER_PROCESS))
            while not self._free:  # more than 64 concurrent runs in this process: wait for one to end
                self._lock.wait()
            return self._free.pop(self._free.index(min(self._free)))

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
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
    """The directories a run under bwrap gets a private tmpfs over: ``TEMP_DIRS`` (where they exist) and
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


_QUERY = (
    "import json, sys\n"
    "print(json.dumps({'executable': sys.executable, 'prefix': sys.prefix, 'exec_prefix': sys.exec_prefix, "
    "'base_prefix': sys.base_prefix, 'base_exec_prefix': sys.base_exec_prefix, 'path': sys.path}))\n"
)


@dataclass(frozen=True)
class _Layout:
    """What the sandboxed interpreter reads as the run's uid (``interpreter_layout``).

    Attributes:
        paths: existing absolute paths: the directory of the executable, ``base_prefix``/``base_exec_prefix``,
            every entry of the interpreter's ``sys.path`` (with ``site_packages``: site-packages, what ``.pth``
            files add, and ``prefix``), each also as its real path.
        expose: ``(path, closed_ancestor)`` for each of ``paths`` a run under bwrap would not see: under a
            directory the private tmpfs masks (closed_ancestor None), or below a directory other uids cannot
            traverse (that directory, e.g. ``/root`` of a pyenv install); nested paths dropped (their parent
            carries them).
    """

    executable: str
    paths: tuple[str, ...]
    expose: tuple[tuple[str, str | None], ...]


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
    # and what bwrap starts: ``python`` itself (a launcher script may sit anywhere, e.g. under /tmp)
    candidates = [os.path.abspath(shutil.which(python) or python), os.path.dirname(executable),
                  os.path.dirname(os.path.realpath(executable)), found["base_prefix"], found["base_exec_prefix"],
                  *found["path"]]
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
        refused = [d for d in masks if path == d] + ([WORKDIR] if _under(path, WORKDIR) else [])
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
    layout = _Layout(executable, tuple(paths), tuple(expose))
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


_BWRAP: list[str] = []


def bwrap_executable() -> str:
    """The path of ``bwrap``. Raises RuntimeError naming the package where it is missing or older than 0.8.0 (no
    ``--size``, which caps the private tmpfs)."""
    if not _BWRAP:
        path = shutil.which("bwrap")
        if path is None:
            raise RuntimeError(f"SandboxConfig(mode='bwrap') needs bwrap, which is not installed: {_INSTALL}; or ask "
                               f"for the weaker SandboxConfig(mode='basic') (no namespaces: docs/sandbox.md)")
        usage = subprocess.run([path, "--help"], capture_output=True, text=True).stdout
        if "--size" not in usage:
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
            raise RuntimeError(f"{path} ({version or 'unknown version'}) has no --size option to cap the sandbox's "
                               f"private tmpfs: {_INSTALL}")
        _BWRAP.append(path)
    return _BWRAP[0]


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


_FILTER: list[bytes] = []


def unix_socket_filter() -> bytes:
    """A seccomp BPF program (compiled by libseccomp, for ``bwrap --seccomp``) under which ``socket(AF_UNIX, ...)``
    fails with EAFNOSUPPORT, so no Unix-domain socket of the host is reachable whatever its path and mode, by the
    program, ``ctypes`` or a child (``socketpair`` stays); ``io_uring_setup`` (io_uring can open sockets itself)
    and system calls of another ABI (x32, i386) fail with ENOSYS. The family is compared on its low 32 bits (the
    kernel reads an int). Built once per process; RuntimeError naming the package where libseccomp is missing."""
    if _FILTER:
        return _FILTER[0]
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise RuntimeError("the sandbox's seccomp filter needs libseccomp, which is not installed (Debian/Ubuntu: "
                           "apt-get install libseccomp2; Fedora/RHEL: dnf install libseccomp)")
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    allow, errno_action, bad_arch_attr, masked_eq = 0x7FFF0000, 0x00050000, 2, 7  # <seccomp.h>
    context = lib.seccomp_init(allow)
    fd = os.memfd_create("verl_prm_seccomp")
    try:
        rules = [(b"socket", errno_action | 97, 1, ctypes.byref(_ArgCmp(0, masked_eq, 0xFFFFFFFF, 1))),  # AF_UNIX
                 (b"io_uring_setup", errno_action | 38, 0, None)]  # EAFNOSUPPORT, ENOSYS
        codes = [lib.seccomp_attr_set(context, bad_arch_attr, errno_action | 38)]
        codes += [lib.seccomp_rule_add_array(context, action, lib.seccomp_syscall_resolve_name(call), count, arg)
                  for call, action, count, arg in rules]
        codes.append(lib.seccomp_export_bpf(context, fd))
        if any(codes):
            raise RuntimeError(f"libseccomp ({name}) failed to build the sandbox's filter: return codes {codes}")
        _FILTER.append(os.pread(fd, 1 << 20, 0))
    finally:
        os.close(fd)
        lib.seccomp_release(context)
    return _FILTER[0]


def bwrap_command(config: SandboxConfig, uid: int | None, seccomp_fd: int, json_fd: int) -> list[str]:
    """The ``bwrap`` arguments of one run (up to ``--``): the host's file tree read-only; a fresh ``/dev`` and a
    ``/proc`` of the run's own PID namespace; a private tmpfs (``2 * file_mb`` MiB) over each of `mask_dirs`;
    an empty tmpfs over each directory closed to other uids on the way to the interpreter, then the
    interpreter's files (`interpreter_layout`) bound back read-only at their own paths; new IPC, PID, network
    (no route), UTS and cgroup namespaces; ``--die-with-parent``; the seccomp filter (`unix_socket_filter`).

    As root (``uid`` given) no user namespace: every capability is dropped except CAP_SETUID/CAP_SETGID, with
    which the boot script switches to ``uid`` before the program runs. Not root: a user namespace, the caller's
    uid. bwrap always sets no_new_privs."""
    layout = interpreter_layout(config.python, config.site_packages)
    args = [bwrap_executable(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for directory in mask_dirs():
        args += ["--perms", "1777", "--size", str(config.file_mb * 2 << 20), "--tmpfs", directory]
    for closed in dict.fromkeys(closed for _, closed in layout.expose if closed is not None):
        args += ["--perms", "0755", "--size", str(64 << 10), "--tmpfs", closed]
    for path, closed in layout.expose:  # bwrap would create the missing parents 0700: closed to the run's uid
        top = closed or next(d for d in mask_dirs() if _under(path, d))
        parents = [str(p) for p in reversed(PurePath(path).parents) if _under(str(p), top) and str(p) != top]
        args += [arg for parent in parents for arg in ("--perms", "0755", "--dir", parent)]
        args += ["--ro-bind", path, path]
    args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if uid is None:
        args += ["--unshare-user"]
    else:
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return args + ["--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd), "--json-status-fd",
                   str(json_fd), "--chdir", "/", "--"]


def isolation_of(level: str, note: str = "") -> Isolation:
    if level == "bwrap":
        who = ("an unprivileged uid of its own" if os.geteuid() == 0 else
               "the caller's uid in a user namespace (reads what the caller can read)")
        return Isolation("bwrap", "network namespace (no route) + audit hook; Unix-domain sockets refused (seccomp)",
                         "private tmpfs over " + ", ".join(mask_dirs()) + " (cwd inside it); everything else "
                         f"read-only; the interpreter's files read-only; fresh /dev; {who}",
                         "PID namespace (every process ends with the run); RLIMIT_NPROC on the run; no_new_privs",
                         note)
    return Isolation("basic", "audit hook only", "fresh temporary cwd (removed); the caller's permissions elsewhere",
                     "setsid + killpg; RLIMIT_NPROC = caller's processes + nproc (not enforced for root); "
                     "no_new_privs", note)

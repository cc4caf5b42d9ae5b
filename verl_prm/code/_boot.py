"""Child side of the sandbox (run as ``python -I -S -B _boot.py CONFIG_JSON``); see ``sandbox.py`` and
``sandbox_setup.py``.

Runs as the first process of a new session (the parent starts it with ``start_new_session=True``). In order:
read the program (still privileged), enter new network, IPC and mount namespaces (root), mount a fresh
size-capped tmpfs over every directory of ``mask_dirs`` (the temporary directories and every world-writable
directory, ``sandbox_setup.mask_dirs``) and use a directory inside the first as the working directory, show the
interpreter's files that this hid read-only again, make every other mount read-only, set no_new_privs, drop to
the sandbox uid, set the resource limits, install the seccomp filter against Unix-domain sockets (full
isolation) and the network audit hook, then compile and run the program in this interpreter. The outcome goes
to the status pipe as one JSON line; stdout/stderr are the program's.

Nothing here may import anything heavy: it runs once per program.
"""

import json
import os
import sys


def _text(value, limit=2000):
    try:
        return str(value)[:limit]
    except BaseException:  # a hostile __str__
        return "<unprintable>"


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _status(fd, record):
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags):
    import ctypes

    if _libc().unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare(0x%x) failed: %s" % (flags, os.strerror(ctypes.get_errno())))


def _mount(source, target, fstype, flags, data):
    import ctypes

    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    result = libc.mount(
        source.encode() if source else None, target.encode(), fstype.encode() if fstype else None, flags,
        data.encode() if data else None,
    )
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "mount %s on %s failed: %s" % (fstype or source, target, os.strerror(errno)))


CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_NOSUID = 2
MS_NODEV = 4

MS_BIND = 4096
MS_RDONLY = 1
MS_REMOUNT = 32
MS_NOEXEC = 8
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_RELATIME = 1 << 21
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
# seccomp: (audit arch, socket, io_uring_setup) per machine; seccomp_data is {int nr; u32 arch; u64 ip; u64 args[6]}
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EAFNOSUPPORT = 97
ENOSYS = 38
AF_UNIX = 1

NETWORK_MARKER = "sandbox: network access is blocked"


def _open_exposed(expose):
    """O_PATH descriptors of the paths to expose, opened before anything masks them (in the new mount namespace:
    a bind mount takes its source from the caller's own namespace only)."""
    fds = []
    for path, _ in expose:
        fds.append(os.open(path, os.O_PATH | os.O_CLOEXEC | (os.O_DIRECTORY if os.path.isdir(path) else 0)))
    return fds


def _expose(expose, fds):
    """Show each path of ``expose`` (the interpreter's files, ``sandbox.interpreter_layout``) at its own place,
    read-only, although a private tmpfs masks it (a path under /tmp) or an ancestor is closed to other uids
    (``/root`` of a pyenv install): mask a closed ancestor with an empty tmpfs (which also hides whatever else it
    holds), create the path in the tmpfs and bind the descriptor opened before the masking onto it."""
    masked = set()
    for (path, closed), fd in zip(expose, fds):
        if closed is not None and closed not in masked:
            _mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
            masked.add(closed)
        if os.path.isdir("/proc/self/fd/%d" % fd):
            os.makedirs(path, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
            open(path, "ab").close()
        _mount("/proc/self/fd/%d" % fd, path, None, MS_BIND | MS_REC, None)
        _mount("none", path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        os.close(fd)


def _remount_readonly(writable):
    """Make every mount of the run's mount namespace read-only except the private tmpfs masks (``writable``):
    whatever else the program could write by its permissions (a world-writable directory created after the
    masks were found, a world-writable file, a directory of a network file system) gives EROFS. Keeps each
    mount's nosuid/nodev/noexec/atime flags. A mount hidden under a later one (EINVAL/ENOENT at its path) is
    invisible to the program already; autofs mount points are not touched (a lookup would trigger the mount)."""
    import errno as errnos

    flag_of = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
    writable = set(writable)
    with open("/proc/self/mountinfo") as f:
        mounts = []
        for line in f:
            fields = line.split()
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace(
                "\\134", "\\")
            mounts.append((point, fields[fields.index("-") + 1]))
    for point, fstype in mounts:
        if point in writable or fstype == "autofs":
            continue
        try:
            vfs = os.statvfs(point)
        except OSError:
            continue
        if vfs.f_flag & os.ST_RDONLY:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for st_flag, ms_flag in flag_of:
            if vfs.f_flag & st_flag:
                flags |= ms_flag
        try:
            _mount("none", point, None, flags, None)
        except OSError as error:
            if error.errno not in (errnos.EINVAL, errnos.ENOENT):
                raise


def _deny_unix_sockets():
    """A seccomp filter (this process and every child, across exec; no_new_privs is set): ``socket(AF_UNIX, ...)``
    fails with EAFNOSUPPORT, so no Unix-domain socket file of the host (a 0777 listener anywhere) can be
    connected to, by the program, ctypes or a child; ``socketpair`` stays (a connected pair reaches nothing
    outside). io_uring (which can create and connect sockets itself) and system calls of another ABI (x32, i386)
    fail with ENOSYS. Needs x86_64 or aarch64: elsewhere a setup error (full isolation then fails its probe)."""
    import ctypes
    import struct

    machine = os.uname().machine
    if machine not in SECCOMP_ARCH:
        raise OSError(ENOSYS, "no seccomp filter for machine %s (x86_64 and aarch64 only)" % machine)
    arch, socket_nr, io_uring_nr = SECCOMP_ARCH[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    program = [  # jump offsets count from the next instruction
        (ld, 0, 0, 4),                                   # 0: A = arch
        (jeq, 0, 9, arch),                               # 1: another ABI -> 11
        (ld, 0, 0, 0),                                   # 2: A = system call number
        (jge, 7, 0, 0x40000000),                         # 3: x32 numbers -> 11
        (jeq, 2, 0, socket_nr),                          # 4: socket -> 7
        (jeq, 5, 0, io_uring_nr),                        # 5: io_uring_setup -> 11
        (ret, 0, 0, SECCOMP_RET_ALLOW),                  # 6
        (ld, 0, 0, 16),                                  # 7: A = low 32 bits of args[0], the address family
        (jeq, 1, 0, AF_UNIX),                            # 8: AF_UNIX -> 10
        (ret, 0, 0, SECCOMP_RET_ALLOW),                  # 9
        (ret, 0, 0, SECCOMP_RET_ERRNO | EAFNOSUPPORT),   # 10
        (ret, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),         # 11
    ]
    code = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    libc = _libc()
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "prctl(PR_SET_SECCOMP) failed: %s" % os.strerror(errno))


def _set_no_new_privs():
    """prctl(PR_SET_NO_NEW_PRIVS): execve of a setuid/setgid binary (or one with file capabilities) no longer
    raises privileges, for this process and every child."""
    import ctypes

    if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "prctl(PR_SET_NO_NEW_PRIVS) failed: %s" % os.strerror(errno))


def _network_hook(event, args):
    # Defence in depth and a clear failure reason; the network namespace is the real barrier (ctypes or a child
    # process bypasses an audit hook, not a namespace). Unix-domain sockets (AF_UNIX = 1) pass here: socketpair
    # (asyncio, multiprocessing.Pipe) needs them; in full isolation the seccomp filter refuses socket(AF_UNIX).
    if event == "socket.__new__" and len(args) > 1 and args[1] not in (1, -1):
        raise PermissionError(NETWORK_MARKER)
    if event in ("socket.connect", "socket.bind", "socket.sendto") and len(args) > 1:
        address = args[1]
        if not isinstance(address, (str, bytes)):
            raise PermissionError(NETWORK_MARKER)


def main():
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    try:
        with open(config["program_path"], "rb") as f:
            source = f.read()
        os.set_inheritable(status_fd, False)
        if config["mount_namespace"] or config["network_namespace"]:
            flags = (CLONE_NEWNS | CLONE_NEWIPC if config["mount_namespace"] else 0) | (
                CLONE_NEWNET if config["network_namespace"] else 0
            )
            _unshare(flags)
        if config["mount_namespace"]:
            _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
            fds = _open_exposed(config["expose"])
            options = "size=%dk,mode=1777" % config["tmpfs_kb"]
            for target in config["mask_dirs"]:
                if os.path.isdir(target):
                    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options)
            workdir = config["workdir_full"]
            os.mkdir(workdir, 0o700)
            if config["uid"] is not None:
                os.chown(workdir, config["uid"], config["gid"])
            _expose(config["expose"], fds)
            if config["remount_readonly"]:
                _remount_readonly(config["mask_dirs"])
        else:
            workdir = config["workdir"]
        program_path = os.path.join(workdir, "program.py")
        os.chdir(workdir)
        import resource
        import traceback  # imported while the interpreter's files are surely readable (before the uid switch)

        limits = [
            (resource.RLIMIT_CPU, config["cpu_s"], config["cpu_s"] + 1),
            (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
            (resource.RLIMIT_FSIZE, config["file_bytes"], config["file_bytes"]),
            (resource.RLIMIT_NOFILE, config["max_files"], config["max_files"]),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        if config["nproc"] is not None:
            limits.append((resource.RLIMIT_NPROC, config["nproc"], config["nproc"]))
        _set_no_new_privs()  # before the uid switch: ctypes is surely readable then (setuid() is not an exec)
        if config["uid"] is not None:
            os.setgroups([])
            os.setgid(config["gid"])
            os.setuid(config["uid"])
        for kind, soft, hard in limits:
            resource.setrlimit(kind, (soft, hard))
        with open(program_path, "wb") as f:
            f.write(source)
        os.environ.clear()
        os.environ.update(config["env"])
        sys.path[:] = [workdir] + [p for p in sys.path if p]
        sys.argv = [program_path]
        if config["deny_unix_sockets"]:
            _deny_unix_sockets()
        if config["audit_network"]:
            sys.addaudithook(_network_hook)
    except BaseException as error:  # the sandbox itself failed: never run the program then
        _status(status_fd, {"event": "setup_error", "type": type(error).__name__, "message": _text(error)})
        os._exit(70)
    _status(status_fd, {"event": "started"})
    try:
        code = compile(source, program_path, "exec", dont_inherit=True)
    except BaseException as error:
        _status(status_fd, {"event": "error", "phase": "compile", "type": type(error).__name__,
                            "message": _text(error)})
        os._exit(1)
    namespace = {"__name__": "__main__", "__file__": program_path, "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except BaseException as error:
        try:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
        except BaseException:
            text = ""
        _status(status_fd, {"event": "error", "phase": "run", "type": type(error).__name__,
                            "message": _text(error), "traceback": text})
        _flush()
        os._exit(1)
    _flush()
    _status(status_fd, {"event": "done"})
    os._exit(0)


if __name__ == "__main__":
    main()

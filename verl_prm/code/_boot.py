"""Child side of the sandbox, run as ``python -I -S -B -c <this file's text> CONFIG_JSON`` (under ``bwrap``, or
directly in basic mode); see ``sandbox.py`` and ``sandbox_setup.py``.

``bwrap`` has set up the namespaces, the private tmpfs masks, the read-only file tree and the seccomp filter
before this runs. In order: read the program from its descriptor (a memfd), create the working directory (under
bwrap: inside the private tmpfs over /tmp), drop to the run's uid where one is given (root under bwrap keeps
CAP_SETUID/CAP_SETGID for this only), set no_new_privs in basic mode (bwrap sets it), set the resource limits,
write the program, clear the environment, install the network audit hook, then compile and run the program in
this interpreter. The outcome goes to the status pipe as one JSON line; stdout/stderr are the program's.

Nothing here may import anything heavy: it runs once per program.
"""

import json
import os
import sys

NETWORK_MARKER = "sandbox: network access is blocked"


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


def _set_no_new_privs():
    """prctl(PR_SET_NO_NEW_PRIVS): execve of a setuid/setgid binary (or one with file capabilities) no longer
    raises privileges, for this process and every child (basic mode; bwrap sets it itself)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        errno = ctypes.get_errno()
        raise OSError(errno, "prctl(PR_SET_NO_NEW_PRIVS) failed: %s" % os.strerror(errno))


def _network_hook(event, args):
    # Defence in depth and a clear failure reason; under bwrap the network namespace is the real barrier (ctypes
    # or a child process bypasses an audit hook, not a namespace). Unix-domain sockets (AF_UNIX = 1) pass here:
    # socketpair (asyncio, multiprocessing.Pipe) needs them; under bwrap the seccomp filter refuses socket(AF_UNIX).
    if event == "socket.__new__" and len(args) > 1 and args[1] not in (1, -1):
        raise PermissionError(NETWORK_MARKER)
    if event in ("socket.connect", "socket.bind", "socket.sendto") and len(args) > 1:
        address = args[1]
        if not isinstance(address, (str, bytes)):
            raise PermissionError(NETWORK_MARKER)


def _read_all(fd):
    chunks, offset = [], 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _setup(config):
    """Everything before the program's first line; returns (source, program_path)."""
    source = _read_all(config["source_fd"])
    os.set_inheritable(config["status_fd"], False)
    import resource

    limits = [
        (resource.RLIMIT_CPU, config["cpu_s"], config["cpu_s"] + 1),
        (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_bytes"], config["file_bytes"]),
        (resource.RLIMIT_NOFILE, config["max_files"], config["max_files"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if config["nproc"] is not None:
        limits.append((resource.RLIMIT_NPROC, config["nproc"], config["nproc"]))
    if config["no_new_privs"]:
        _set_no_new_privs()
    if config["uid"] is not None:
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])  # from root to another uid: every capability is gone
    workdir = config["workdir"]
    if config["make_workdir"]:
        os.mkdir(workdir, 0o700)
    os.chdir(workdir)
    for kind, soft, hard in limits:
        resource.setrlimit(kind, (soft, hard))
    program_path = os.path.join(workdir, "program.py")
    with open(program_path, "wb") as f:
        f.write(source)
    os.close(config["source_fd"])  # only now: until the program is written, the run holds what it will hold
    os.environ.clear()
    os.environ.update(config["env"])
    sys.path[:] = [workdir] + [p for p in sys.path if p]
    sys.argv = [program_path]
    sys.addaudithook(_network_hook)
    return source, program_path


def main():
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    try:
        source, program_path = _setup(config)
    except BaseException as error:  # the sandbox itself failed: never run the program then
        _status(status_fd, {"event": "setup_error", "type": type(error).__name__, "message": _text(error)})
        os._exit(70)
    import traceback

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

"""One writer per output directory: a lock that the kernel releases when its holder dies.

Every output directory that a rerun resumes (``verl-prm label``/``label convert`` shards, ``verl-prm train``
checkpoints, the arithmetic recipe's stage directories) holds a lock file ``.verl-prm.lock``. A writer takes
an exclusive ``flock`` on it for as long as it writes and records who it is (pid, host, command, start time)
in the file. A second writer is refused at once with :class:`DirectoryLockedError`, which names the directory
and the holder. The lock belongs to the open file, so the kernel drops it when the holder exits for any reason,
kill -9 included: a dead holder never blocks a rerun, and nothing has to be cleaned up by hand. (A child
process forked without exec inherits the open file and keeps the lock until it exits too.)

Within one process the lock is re-entrant: the recipe locks a stage directory and then runs ``verl-prm
label`` on it in the same process. Where the filesystem has no locks (some network filesystems answer
``flock`` with ENOLCK/ENOSYS), the writer goes on with a warning on stderr that a second writer would go
undetected.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file: a symbolic link (or a directory, FIFO,
socket) at the lock path is refused with :class:`LockFileError` naming the path, never followed.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import threading
from pathlib import Path

__all__ = ["LOCK_FILE", "DirectoryLock", "DirectoryLockedError", "LockFileError", "lock_holder"]

LOCK_FILE = ".verl-prm.lock"
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}

# resolved directory -> [file descriptor or None (filesystem without locks), nesting count]
_held: dict[str, list] = {}
_held_guard = threading.Lock()


class DirectoryLockedError(RuntimeError):
    """Another live process writes to the directory."""


class LockFileError(ValueError):
    """The lock path holds something other than a regular file (a symbolic link, a directory, a FIFO, ...)."""


def lock_holder(directory: str | Path) -> dict:
    """What the current (or last) holder wrote into the lock file: pid, host, purpose, command, since ({} if
    nothing readable)."""
    try:  # never through a symbolic link (``DirectoryLock._open``)
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            record = json.loads(f.read(1 << 16))
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)


class DirectoryLock:
    """Exclusive writer lock on ``directory`` (created if missing); use as a context manager or call
    :meth:`acquire` / :meth:`release`. ``purpose`` goes into the holder record and the error of a second
    writer (e.g. "verl-prm label")."""

    def __init__(self, directory: str | Path, purpose: str) -> None:
        self.directory = Path(directory)
        self.purpose = purpose
        self._key: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / LOCK_FILE

    def acquire(self) -> "DirectoryLock":
        self.directory.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.directory)
        with _held_guard:
            if key in _held:  # this process holds it already: nest
                _held[key][1] += 1
                self._key = key
                return self
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DirectoryLockedError(self._locked_message()) from None
                if error.errno not in _NO_LOCKS:
                    raise
                print(f"verl-prm: WARNING: cannot lock {self.directory} (the filesystem has no file locks: "
                      f"{os.strerror(error.errno)}); a second writer to this directory would not be detected",
                      file=sys.stderr)
                fd = None
            if fd is not None:
                record = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                          "command": " ".join(sys.argv),
                          "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
                data = (json.dumps(record) + "\n").encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
            _held[key] = [fd, 1]
            self._key = key
        return self

    def _open(self) -> int:
        """The lock file, opened for writing without following a symlink: a link planted at the lock path
        (``ln -s ~/notes.txt DIR/.verl-prm.lock``) would otherwise have its target truncated and overwritten
        with the holder record. Anything but a regular file there is refused."""
        fix = f"remove it (rm {self.path}) and rerun; verl-prm creates the lock file itself"
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise LockFileError(f"{self.path} is a symbolic link (to {os.readlink(self.path)}), not a lock "
                                    f"file: the lock never follows a link (it would empty the target); {fix}") from None
            if error.errno in (errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):  # a directory, a socket
                raise LockFileError(f"{self.path} is not a regular file; {fix}") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device (O_NONBLOCK: opening it did not hang)
            os.close(fd)
            raise LockFileError(f"{self.path} is not a regular file; {fix}")
        os.set_blocking(fd, True)
        return fd

    def release(self) -> None:
        if self._key is None:
            return
        with _held_guard:
            entry = _held[self._key]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[self._key]
                fd = entry[0]
                if fd is not None:
                    # The file stays (deleting it would let two writers lock two different files); clearing
                    # it says that nobody holds the lock now.
                    os.ftruncate(fd, 0)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
        self._key = None

    def _locked_message(self) -> str:
        holder = lock_holder(self.directory)
        if holder:
            who = (f"pid {holder.get('pid')} on host {holder.get('host')} ({holder.get('purpose')}, since "
                   f"{holder.get('since')}: {holder.get('command')})")
        else:
            who = "a process that has not yet recorded itself"
        return (f"{self.directory} is being written by another process: {who}. Two writers would duplicate or "
                f"corrupt its contents; wait for that process to finish (the lock is released when it exits, even "
                f"if killed) or use another output directory")

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

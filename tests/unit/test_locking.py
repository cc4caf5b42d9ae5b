"""One writer per output directory (verl_prm.locking): a second live writer is refused with an error naming the
directory and the holder; a holder killed with SIGKILL never blocks a rerun; the lock nests within a process;
the arithmetic recipe locks its stage directories. Holders are real subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from verl_prm.locking import LOCK_FILE, DirectoryLock, DirectoryLockedError, LockFileError, lock_holder

HOLD = ("import sys, time\n"
        "from verl_prm.locking import DirectoryLock\n"
        "DirectoryLock(sys.argv[1], sys.argv[2]).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n")


@contextlib.contextmanager
def holder_process(directory: Path, purpose: str = "verl-prm label"):
    """A live process that holds the lock of ``directory``; killed with SIGKILL on exit."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), purpose], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        yield child
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    with holder_process(tmp_path / "out", "verl-prm train") as child:
        with pytest.raises(DirectoryLockedError) as error:
            DirectoryLock(tmp_path / "out", "verl-prm train").acquire()
        message = str(error.value)
        assert message.startswith(f"{tmp_path / 'out'} is being written by another process: pid {child.pid} on host "
                                   f"{socket.gethostname()} (verl-prm train, since ")
        assert "use another output directory" in message
        assert lock_holder(tmp_path / "out")["pid"] == child.pid


def test_a_holder_killed_with_sigkill_does_not_block_a_rerun(tmp_path):
    with holder_process(tmp_path / "out") as child:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert json.loads((tmp_path / "out" / LOCK_FILE).read_text())["pid"] == child.pid  # stale record left behind
    with DirectoryLock(tmp_path / "out", "rerun"):
        assert lock_holder(tmp_path / "out")["pid"] == os.getpid()
    assert lock_holder(tmp_path / "out") == {}  # released: the record is cleared, the file stays


def test_lock_nests_within_a_process_and_is_released_by_the_outermost(tmp_path):
    probe = ("import sys\nfrom verl_prm.locking import DirectoryLock, DirectoryLockedError\n"
             "try:\n    DirectoryLock(sys.argv[1], 'probe').acquire()\nexcept DirectoryLockedError:\n    sys.exit(3)\n")

    def other_process_can_lock() -> bool:
        code = subprocess.run([sys.executable, "-c", probe, str(tmp_path)]).returncode
        assert code in (0, 3)
        return code == 0

    outer = DirectoryLock(tmp_path, "recipe stage").acquire()
    with DirectoryLock(tmp_path, "verl-prm label"):  # the CLI inside the recipe, same process
        assert lock_holder(tmp_path)["purpose"] == "recipe stage"
    assert not other_process_can_lock()  # the inner release did not free it
    outer.release()
    assert other_process_can_lock()




def test_a_lock_path_that_is_a_symlink_or_not_a_regular_file_is_refused_and_never_followed(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(notes)
    with pytest.raises(LockFileError) as error:
        DirectoryLock(out, "verl-prm label").acquire()
    assert str(error.value) == (f"{out / LOCK_FILE} is a symbolic link (to {notes}), not a lock file: the lock never "
                                f"follows a link (it would empty the target); remove it (rm {out / LOCK_FILE}) and "
                                f"rerun; verl-prm creates the lock file itself")
    assert notes.read_text() == "my notes\n"  # the target is untouched
    assert lock_holder(out) == {}  # nor read through the link
    (out / LOCK_FILE).unlink()
    (out / LOCK_FILE).symlink_to(tmp_path / "missing")  # a dangling link is not created through either
    with pytest.raises(LockFileError, match="is a symbolic link"):
        DirectoryLock(out, "verl-prm label").acquire()
    assert not (tmp_path / "missing").exists()
    for make in (os.mkfifo, os.mkdir):  # a FIFO (opening it must not hang) and a directory
        (out / LOCK_FILE).unlink() if (out / LOCK_FILE).is_symlink() or (out / LOCK_FILE).is_fifo() else None
        make(out / LOCK_FILE)
        with pytest.raises(LockFileError, match=f"^{out / LOCK_FILE} is not a regular file; remove it"):
            DirectoryLock(out, "verl-prm label").acquire()
    (out / LOCK_FILE).rmdir()
    with DirectoryLock(out, "verl-prm label"):  # the fix the message names works
        assert lock_holder(out)["purpose"] == "verl-prm label"

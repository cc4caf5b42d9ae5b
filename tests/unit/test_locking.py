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

from verl_prm.locking import LOCK_FILE, DirectoryLock, DirectoryLockedError, lock_holder

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



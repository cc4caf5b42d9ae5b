"""The arithmetic recipe locks each stage directory it writes (verl_prm.locking), as the library's commands do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from verl_prm.locking import DirectoryLockedError

HOLD = ("import sys, time\n"
        "from verl_prm.locking import DirectoryLock\n"
        "DirectoryLock(sys.argv[1], sys.argv[2]).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n")


def test_recipe_refuses_a_stage_directory_that_another_process_writes(tmp_path):
    from verl_prm.apps.arithmetic.pipeline import SCALES, run

    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "work" / "data"),
                              "arithmetic recipe stage data"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryLockedError, match=f"work/data is being written by another process: pid {child.pid}"):
            run(SCALES["micro"], tmp_path / "work", ["data"], progress=False, log=lambda *_: None)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert not (tmp_path / "work" / "data" / "DONE.json").exists()

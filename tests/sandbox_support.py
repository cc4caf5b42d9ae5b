"""What the code tests share (tests/unit/test_sandbox.py, tests/unit/test_code.py). On sys.path through pytest's
``pythonpath`` setting."""

from __future__ import annotations

import os

from verl_prm.code.sandbox_setup import SLOTS_PER_PROCESS, uid_for_slot


def sandbox_processes() -> list[int]:
    """Pids of live processes whose real uid is one of this process's run uids (none may outlive a run). Only
    this process's: other test sessions on the machine run sandboxes of their own."""
    ours = {uid_for_slot(slot) for slot in range(SLOTS_PER_PROCESS)}
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                uid = int(fields["Uid"].split()[0])
                if uid in ours and fields["State"].split()[0] not in ("Z", "X"):
                    pids.append(int(entry))
            except (OSError, KeyError, ValueError):
                pass
    return pids

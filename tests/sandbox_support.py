"""What the code tests share (tests/unit/test_sandbox.py, tests/unit/test_code.py). On sys.path through pytest's
``pythonpath`` setting."""

from __future__ import annotations

import os


def sandbox_processes() -> list[int]:
    """Pids of live processes whose real uid is in the sandbox's uid range (none may outlive a run)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                uid = int(fields["Uid"].split()[0])
                if uid >= 200_000 and fields["State"].split()[0] not in ("Z", "X"):
                    pids.append(int(entry))
            except (OSError, KeyError, ValueError):
                pass
    return pids

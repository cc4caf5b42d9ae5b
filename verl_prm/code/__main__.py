"""``python -m verl_prm.code``: report the sandbox's isolation on this machine and verify every HumanEval
canonical solution (and a mutant of each) in parallel; prints JSON with pass counts and runs per second.

    python -m verl_prm.code [--workers N] [--limit K]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from verl_prm.code.data import humaneval_task, read_humaneval
from verl_prm.code.sandbox import isolation
from verl_prm.code.sandbox_config import SandboxConfig
from verl_prm.code.verifier import verify_many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_prm.code", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=None, help="sandboxes at once (default: CPU count)")
    parser.add_argument("--limit", type=int, default=None, help="only the first K problems")
    parser.add_argument("--mode", choices=("bwrap", "basic"), default="bwrap",
                        help="isolation (bwrap: namespaces by bubblewrap; basic: without, asked for by name)")
    args = parser.parse_args(argv)
    config = SandboxConfig(mode=args.mode)
    problems = read_humaneval()[: args.limit]
    pairs = [(humaneval_task(p), p["canonical_solution"]) for p in problems]
    pairs += [(humaneval_task(p), "    return None\n") for p in problems]
    started = time.perf_counter()
    verdicts = verify_many(pairs, config, max_workers=args.workers, progress=True)
    seconds = time.perf_counter() - started
    canonical, mutants = verdicts[: len(problems)], verdicts[len(problems) :]
    report = {
        "isolation": asdict(isolation(config)),
        "problems": len(problems),
        "canonical_passed": sum(v.passed for v in canonical),
        "stub_failed": sum(not v.passed for v in mutants),
        "failures": [(v.task_id, v.reason, v.detail[:120]) for v in canonical if not v.passed],
        "seconds": round(seconds, 2),
        "runs_per_s": round(len(pairs) / seconds, 1),
    }
    print(json.dumps(report, indent=1))
    return 0 if report["canonical_passed"] == len(problems) else 1


if __name__ == "__main__":
    sys.exit(main())

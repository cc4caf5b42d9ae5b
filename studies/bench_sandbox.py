"""``python -m studies.bench_sandbox``: the code sandbox's cost per run, side by side in one process.

Times ``--runs`` trivial programs (``pass``) one after another (milliseconds per run: median and mean) and the
same number two at a time (``run_many(max_workers=2)``: runs per second), for each implementation named, in
alternating rounds so that both see the same machine load:

* ``bwrap``: ``verl_prm.code.sandbox`` with ``SandboxConfig(mode="bwrap")`` (bubblewrap);
* ``basic``: the same with ``mode="basic"`` (no namespaces: a floor for the cost of the interpreter itself);
* ``old``: a copy of the sandbox before bubblewrap (its own namespaces, mounts and seccomp filter from Python),
  imported as the package ``old_sandbox`` from ``--old DIR`` (make the copy from commit 3110179:
  ``for f in sandbox sandbox_setup sandbox_config _boot; do git show 3110179:verl_prm/code/$f.py | sed
  's/verl_prm\\.code\\./old_sandbox./g' > DIR/old_sandbox/$f.py; done; touch DIR/old_sandbox/__init__.py``).

The first probe of each (the walk for world-writable directories, the interpreter query) is not timed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time


def _implementations(names: list[str], old_dir: str | None) -> dict:
    """``{name: (run_program, run_many, config)}`` for each name."""
    found = {}
    for name in names:
        if name == "old":
            if not old_dir or not os.path.isdir(os.path.join(old_dir, "old_sandbox")):
                raise SystemExit(f"--old {old_dir!r} holds no old_sandbox package (see the module docstring)")
            sys.path.insert(0, old_dir)
            package = "old_sandbox"
            config = importlib.import_module(f"{package}.sandbox_config").SandboxConfig()
        else:
            package = "verl_prm.code"
            config = importlib.import_module(f"{package}.sandbox_config").SandboxConfig(mode=name)
        sandbox = importlib.import_module(f"{package}.sandbox")
        found[name] = (sandbox.run_program, sandbox.run_many, config, sandbox.isolation(config).mode)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.bench_sandbox", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="trivial programs per implementation and way")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds the runs are split into")
    parser.add_argument("--impl", nargs="+", default=["old", "bwrap", "basic"], choices=("old", "bwrap", "basic"))
    parser.add_argument("--old", default="/tmp/old_sandbox_pkg", help="directory holding the old_sandbox package")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 1 or args.runs % args.rounds:
        parser.error("--runs and --rounds must be >= 1, and --rounds must divide --runs")
    impls = _implementations(args.impl, args.old)
    per_round = args.runs // args.rounds
    sequential = {name: [] for name in impls}
    parallel_s = {name: 0.0 for name in impls}
    for _ in range(args.rounds):
        for name, (run_program, run_many, config, _) in impls.items():
            for _ in range(per_round):
                started = time.perf_counter()
                result = run_program("pass\n", config)
                sequential[name].append(time.perf_counter() - started)
                assert result.passed, result
            started = time.perf_counter()
            results = run_many(["pass\n"] * per_round, config, max_workers=2)
            parallel_s[name] += time.perf_counter() - started
            assert all(r.passed for r in results), results
    report = {
        "runs": args.runs,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "results": {name: {
            "isolation": impls[name][3],
            "ms_per_run_median": round(1000 * statistics.median(sequential[name]), 1),
            "ms_per_run_mean": round(1000 * statistics.fmean(sequential[name]), 1),
            "runs_per_s_two_at_once": round(args.runs / parallel_s[name], 1),
        } for name in impls},
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

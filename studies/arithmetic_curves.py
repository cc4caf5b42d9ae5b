"""The RL runs' curves kept apart from their work directory: exported, merged across directories, summarised.

A finished RL run of the recipe records its held-out curve and its per-step training metrics in
``rl/<arm>_seed<seed>/DONE.json`` (with its settings and the machine's environment). This module

* **exports** those records to one JSON file (``--export``): a few kilobytes per run, small enough to keep beside
  the docs, so that a table can be recomputed after the work directory (its checkpoints) is gone;
* **merges** runs from work directories and exported files (``--runs``): seeds of one arm made in different
  directories or sessions are combined only if their settings are the same except for the seed;
* **summarises** them with the recipe's statistics (``evaluate.summarise_arms``: the level L, steps to L, the area
  under the curve, bootstrap errors over seeds) before the ``evaluate`` stage exists. The "final accuracy" of these
  summaries is the curve's last point (verl's validation at the last step), not the evaluate stage's fresh samples
  of the final policy.

    python -m studies.arithmetic_curves --runs runs/arith/mod7 docs/arithmetic/runs.json [--export F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["export_runs", "main", "read_runs", "summary_table"]

FORMAT = "verl-prm arithmetic runs v1"


def _records_of(source: Path, reread_scale=None) -> list[dict]:
    """The run records of a work directory (``rl/*/DONE.json``) or of an exported file. With ``reread_scale``, a
    work directory's training metrics are read again from each run's verl log by the current
    ``verl_rl.read_run`` (for records made before it read a metric, e.g. a tree's generated tokens); the curve read
    again must equal the recorded one."""
    if source.is_dir():
        markers = sorted((source / "rl").glob("*_seed*/DONE.json"))
        records = [json.loads(marker.read_text()) for marker in markers]
        if reread_scale is not None:
            records = [_reread(record, marker.parent, reread_scale) for record, marker in zip(records, markers)]
        return records
    data = json.loads(source.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("runs"), list):
        raise ValueError(f"{source} is not an export of this module (format {FORMAT!r}); export runs with --export")
    return data["runs"]


def _reread(record: dict, run_dir: Path, scale) -> dict:
    from verl_prm.apps.arithmetic.verl_rl import read_run

    fresh = read_run(run_dir, scale)
    if [list(point) for point in fresh["curve"]] != [list(point) for point in record["outputs"]["curve"]]:
        raise ValueError(f"{run_dir}: the held-out curve read again from its verl log differs from the one in "
                         "DONE.json (another scale, or a log changed since): summarise it without --reread")
    return {**record, "outputs": {**record["outputs"], "training": fresh["training"]}}


def read_runs(sources: Sequence[str | Path], arms: Sequence[str] | None = None,
              reread_scale=None) -> dict[str, dict[int, dict]]:
    """``{arm: {seed: record}}`` of every finished run in ``sources`` (work directories and exported files),
    restricted to ``arms`` when given. A run found twice must be the same run (same settings and curve); the seeds
    of one arm must share every setting but the seed, and every run the machine kind (``machine.machine_line``: the
    numbers depend on the float kernels, so one table holds one kind): otherwise an error names the difference.
    ``reread_scale``: see :func:`_records_of`."""
    from verl_prm.apps.arithmetic.machine import machine_line
    from verl_prm.resume import settings_differences

    runs: dict[str, dict[int, dict]] = {}
    first_machine: tuple[str, str] | None = None
    for source in map(Path, sources):
        if not source.exists():
            raise FileNotFoundError(f"{source} does not exist (a recipe work directory or an exported runs file)")
        for record in _records_of(source, reread_scale):
            arm, seed = record["settings"]["arm"], int(record["settings"]["seed"])
            if arms is not None and arm not in arms:
                continue
            machine = machine_line(record.get("environment") or {})
            if first_machine is None:
                first_machine = (machine, f"{arm} seed {seed} ({source})")
            elif machine != first_machine[0]:
                raise ValueError(f"{arm} seed {seed} ({source}) ran on {machine}, {first_machine[1]} on "
                                 f"{first_machine[0]}: one table holds runs of one machine kind; summarise each apart")
            seeds = runs.setdefault(arm, {})
            if seed in seeds:
                if seeds[seed]["settings"] != record["settings"] or seeds[seed]["outputs"]["curve"] != record["outputs"]["curve"]:
                    raise ValueError(f"{arm} seed {seed} is in more than one source with other settings or curves; "
                                     f"keep one of them ({source})")
                continue
            for other_seed, other in seeds.items():
                mine = {k: v for k, v in record["settings"].items() if k != "seed"}
                theirs = {k: v for k, v in other["settings"].items() if k != "seed"}
                if mine != theirs:
                    changed = "; ".join(settings_differences(theirs, mine)[:6])
                    raise ValueError(f"{arm} seed {seed} ({source}) was run with other settings than seed {other_seed} "
                                     f"({changed}): they are not seeds of one arm")
            seeds[seed] = record
    missing = sorted(set(arms or ()) - set(runs))
    if missing:
        raise ValueError(f"no finished run of {', '.join(missing)} in {', '.join(map(str, sources))}")
    return runs


def export_runs(runs: dict[str, dict[int, dict]], path: str | Path) -> Path:
    """Write the run records (settings, curve, training metrics, environment; no checkpoint paths needed) to
    ``path``."""
    records = []
    for arm in runs:
        for seed in sorted(runs[arm]):
            record = runs[arm][seed]
            outputs = {k: v for k, v in record["outputs"].items() if k in ("curve", "training")}
            records.append({"settings": record["settings"], "outputs": outputs, "seconds": record.get("seconds"),
                            "environment": record.get("environment")})
    path = Path(path)
    path.write_text(json.dumps({"format": FORMAT, "runs": records}, indent=1))
    return path


def summary_table(runs: dict[str, dict[int, dict]], scale) -> tuple[list[str], dict]:
    """Markdown lines (the machines, the held-out curve of each arm with its statistics, the process table) and
    ``evaluate.summarise_arms``'s summaries, GRPO the reference when present."""
    from verl_prm.apps.arithmetic import evaluate as ev
    from verl_prm.apps.arithmetic.machine import machine_line

    prepared = {arm: {seed: {"curve": [tuple(p) for p in r["outputs"]["curve"]], "training": r["outputs"]["training"],
                             "final": {"accuracy": r["outputs"]["curve"][-1][2]}}
                      for seed, r in seeds.items()} for arm, seeds in runs.items()}
    arms = ev.summarise_arms(prepared, budget=scale.rl.steps, reference="grpo", level_fraction=scale.level_fraction,
                             resamples=scale.bootstrap_resamples, seed=scale.bootstrap_seed)
    machines = sorted({machine_line(r.get("environment") or {}) for seeds in runs.values() for r in seeds.values()})
    lines = [f"Machine{'s' if len(machines) > 1 else ''}: {'; '.join(machines)}.", ""]
    reference = arms.get("grpo")
    if reference is not None:
        lines += [f"Level L = {reference['level']:.3f} (GRPO's seed-mean held-out accuracy at step "
                  f"{reference['level_step']:g} of {reference['budget']}).", ""]
    steps = [int(p[0]) for p in next(iter(arms.values()))["curve"]]
    lines += [f"| arm | seeds | held-out accuracy, seed mean, steps {', '.join(map(str, steps))} | at step {steps[-1]} | "
              "area / steps | steps to L | vs GRPO (steps to L) |", "|---|---:|---|---:|---:|---:|---:|"]
    for arm, s in arms.items():
        curve = " ".join(f"{p[2]:.3f}".lstrip("0") for p in s["curve"])
        if "level" in s:
            to_level = ev._reached(s["steps_to_level"], s["steps_to_level_se"], s["steps_to_level_undefined_share"], 1)
            speed = "1x" if arm == "grpo" else ev._reached(s["efficiency"], s["efficiency_se"],
                                                          s["efficiency_undefined_share"], 2, suffix="x",
                                                          never="never" if s["steps_to_level"] is None else "n/a",
                                                          undefined_as="undefined")
        else:
            to_level = speed = "-"
        lines.append(f"| {ev._arm_label(arm)} | {len(s['seeds'])} | {curve} | "
                     f"{ev._pm(s['curve'][-1][2], s['curve_se'][-1])} | {ev._pm(s['auc'], s['auc_se'])} | {to_level} | "
                     f"{speed} |")
    lines += ["", *ev.process_table(arms)]
    refresh = ev.refresh_table(arms)
    lines += ["", *refresh] if refresh else []
    return lines, arms


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.arithmetic_curves", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="recipe work directories and exported runs files")
    parser.add_argument("--arms", default=None, help="comma-separated arms (default: every arm found)")
    parser.add_argument("--scale", default="cpu", help="the scale whose statistics settings apply (default cpu)")
    parser.add_argument("--export", default=None, help="write the runs found to this JSON file")
    parser.add_argument("--plot", default=None, type=Path,
                        help="write accuracy against generated tokens and against training seconds (PNGs) here")
    parser.add_argument("--reread", action="store_true",
                        help="read each work-directory run's training metrics again from its verl log (records made "
                             "before a metric was read, e.g. a tree's generated tokens)")
    args = parser.parse_args(argv)
    from verl_prm.apps.arithmetic.pipeline import SCALES

    if args.scale not in SCALES:
        parser.error(f"--scale must be one of {', '.join(SCALES)}")
    runs = read_runs(args.runs, args.arms.split(",") if args.arms else None,
                     reread_scale=SCALES[args.scale] if args.reread else None)
    if not runs:
        parser.error(f"no finished RL run in {', '.join(args.runs)}")
    if args.export:
        print(f"written: {export_runs(runs, args.export)}")
    lines, _ = summary_table(runs, SCALES[args.scale])
    print("\n".join(lines))
    if args.plot:
        from verl_prm.apps.arithmetic.evaluate import plot_cost_curves

        args.plot.mkdir(parents=True, exist_ok=True)
        for path in plot_cost_curves({arm: {seed: r["outputs"] for seed, r in seeds.items()}
                                      for arm, seeds in runs.items()}, args.plot):
            print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

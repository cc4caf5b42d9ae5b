"""The runs of ``studies.word_problems_rl`` side by side: markdown tables, a plot, and the ``runs.json`` export.

* **Per run**: the held-out accuracy at each evaluated step (± the standard error over its problems,
  sqrt(p (1 - p) / problems)), the mean training reward over the first and the second half of its steps, the
  seconds a step (verl's ``timing_s/step``), the tokens a step generates and trains on (a tree generates its shared
  prefixes once: ``pav/tree_generated_tokens``), the run's seconds and the machine's load average while it ran
  (above the run's own ~1-2 on 2 cores: other work shared the cores).
* **Per step**: each arm's held-out accuracy, seed mean ± standard error over seeds, and Welch's p against GRPO
  over seeds (``studies.arithmetic_significance.welch``; blank with fewer than 2 seeds in either arm).
* **At equal cost**: each arm's accuracy against GRPO's at equal cumulative generated tokens and at equal training
  seconds: each run's held-out curve against its cumulative cost (``evaluate.cost_curve``), read at k/K of the
  largest budget every run of both arms reached (``stats.interpolate``; K evaluations after step 0), Welch's p.
* **Final held-out accuracy** with a bootstrap interval over problems (``stats.bootstrap``: the held-out problems
  resampled, each problem's accuracy the mean over seeds of verl's ``validation/<step>.jsonl``), and the
  difference from GRPO, paired by problem.

With ``--export`` the finished runs go to one JSON file in the arithmetic recipe's ``verl-prm arithmetic runs v1``
format (``studies.arithmetic_curves.read_runs`` and ``studies.arithmetic_significance`` read it).

    python -m studies.word_problems_rl_report --runs docs/real_model/rl40_runs runs/wp_rl40 \\
        --plot docs/real_model/rl_curves_40.png --export docs/real_model/runs.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from studies.arithmetic_curves import FORMAT
from studies.arithmetic_significance import format_mean_se, format_p, welch
from studies.word_problems_rl import VALIDATION_KEY
from verl_prm.apps.arithmetic.stats import bootstrap, interpolate

__all__ = ["COSTS", "PILOT_SETTINGS", "accuracy_at_costs", "arm_table", "cost_table", "export_runs", "final_table",
           "main", "per_problem_accuracy", "plot", "problem_interval", "read_runs", "run_measures", "run_table",
           "step_table"]

RUN_DIR = re.compile(r"^(?P<arm>[a-z_]+)_seed(?P<seed>\d+)$")
# a run directory without settings.json was made by the study before it wrote one: the 20-step pilot's settings
PILOT_SETTINGS = {"steps": 20, "prompts_per_step": 4, "responses_per_prompt": 4, "val_problems": 64, "skip": 48}
COSTS = {"generated_tokens": "generated tokens", "step_seconds": "training seconds"}
REFERENCE = "grpo"


def _same_finished_run(first: Path, second: Path) -> bool:
    done = [first / "DONE.json", second / "DONE.json"]
    return all(path.exists() for path in done) and done[0].read_bytes() == done[1].read_bytes()


def _seeds(count: int) -> str:
    return f"{count} seed" + ("" if count == 1 else "s")


def read_runs(*roots: str | Path) -> dict[str, dict[int, dict]]:
    """``{arm: {seed: run}}`` of ``<root>/<arm>_seed<seed>`` over every root (the study's ``--out``, its
    ``--archive``; each must exist, and one of them hold a run): ``settings`` (``settings.json``, else :data:`PILOT_SETTINGS`), ``outputs``
    (``verl_rl.run_curves`` of every start's records), ``starts`` (``starts.jsonl``), ``finished`` (trained every
    step), ``run_dir``. A run directory without records, or one arm and seed in two roots (other than a finished
    run and its archived copy: the same ``DONE.json``), is refused, naming them."""
    from verl_prm.apps.arithmetic.verl_rl import read_records, run_curves

    runs: dict[str, dict[int, dict]] = {}
    missing = [str(root) for root in roots if not Path(root).is_dir()]
    if missing:
        raise ValueError(f"--runs {' '.join(missing)}: no such directory; pass the study's --out or --archive")
    run_dirs = [p for root in map(Path, roots) for p in sorted(Path(root).iterdir())
                if p.is_dir() and RUN_DIR.match(p.name)]
    if not run_dirs:
        raise ValueError(f"--runs {' '.join(map(str, roots))}: no <arm>_seed<seed> run directory there; run "
                         "studies.word_problems_rl first")
    for run_dir in run_dirs:
        match = RUN_DIR.match(run_dir.name)
        if int(match["seed"]) in runs.get(match["arm"], {}):
            first = runs[match["arm"]][int(match["seed"])]["run_dir"]
            if _same_finished_run(first, run_dir):  # a finished run and its archived copy
                continue
            raise ValueError(f"{run_dir} and {first} hold the same arm and seed, not one finished run and its "
                             "archived copy: pass one of them")
        records = read_records(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if not records:
            raise ValueError(f"{run_dir}: no metrics.jsonl records; run studies.word_problems_rl for it first")
        path = run_dir / "settings.json"
        settings = json.loads(path.read_text()) if path.exists() else {
            **PILOT_SETTINGS, "arm": match["arm"], "seed": int(match["seed"])}
        outputs = run_curves(records, VALIDATION_KEY, settings["prompts_per_step"] * settings["responses_per_prompt"])
        starts_path = run_dir / "starts.jsonl"
        starts = [json.loads(line) for line in starts_path.read_text().splitlines()] if starts_path.exists() else []
        trained = [row["step"] for row in outputs["training"]]
        runs.setdefault(match["arm"], {})[int(match["seed"])] = {
            "settings": settings, "outputs": outputs, "starts": starts, "run_dir": run_dir,
            "finished": bool(trained) and trained[-1] == settings["steps"]}
    if not runs:
        raise ValueError(f"{', '.join(map(str, roots))}: no <arm>_seed<seed> run directories")
    return runs


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def run_measures(run: dict) -> dict:
    """One run's numbers: ``curve`` [(step, held-out accuracy)], ``reward_first`` / ``reward_second`` (mean batch
    reward over the first / second half of the trained steps), ``step_s``, ``generated`` and ``trained`` (tokens a
    step), ``seconds`` (every start's), ``load_max`` (the highest 1-minute load average sampled; nan unrecorded)."""
    training = run["outputs"]["training"]
    if not training:
        raise ValueError(f"{run.get('run_dir', 'a run')}: no trained step (no critic/score/mean)")
    half = (len(training) + 1) // 2
    rewards = [t["batch_accuracy"] for t in training]
    starts = run.get("starts", [])
    return {"curve": [(int(s), float(a)) for s, _, a in run["outputs"]["curve"]], "steps": len(training),
            "reward_first": _mean(rewards[:half]), "reward_second": _mean(rewards[half:]),
            "step_s": _mean([t["step_seconds"] for t in training if math.isfinite(t["step_seconds"])]),
            "generated": _mean([t["generated_tokens"] for t in training]),
            "trained": _mean([t["response_tokens"] for t in training]),
            "seconds": sum(s["seconds"] for s in starts) if starts else math.nan,
            "load_max": max((s["load_1min_max"] for s in starts), default=math.nan)}


def _number(value: float, spec: str) -> str:
    return "-" if not math.isfinite(value) else format(value, spec)


def _compute_dtype(run: dict) -> str:
    """The run's ``compute_dtype``; for a run that predates that record, ``auto`` resolved where its starts' CPU
    flags decide it: float32 on a CPU without AVX-512 (native bf16 on x86, AVX512-BF16 or AMX, comes with it),
    else "-" (the environment records no bf16 flag)."""
    settings = run["settings"]
    if settings.get("compute_dtype"):
        return settings["compute_dtype"]
    precision = settings.get("precision", "auto")
    if precision != "auto":
        return precision
    environments = [start.get("environment", {}) for start in run.get("starts", [])]
    x86_without_avx512 = [env.get("machine") == "x86_64" and "avx512f" not in env.get("cpu_flags", ["avx512f"])
                          for env in environments]
    return "float32" if x86_without_avx512 and all(x86_without_avx512) else "-"


def _policy(settings: dict) -> str:
    """The start policy's weights, the first 12 hex digits of ``policy_sha256`` ("-" before runs recorded it)."""
    digest = settings.get("policy_sha256")
    return f"`{digest[:12]}`" if digest else "-"


def run_table(runs: dict[str, dict[int, dict]]) -> list[str]:
    lines = ["| arm | seed | steps | held-out accuracy by step (± s.e. over problems) | training reward, first / "
             "second half | s / step | tokens a step: generated (trained) | run s | peak load | policy | dtype |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for arm, seeds in runs.items():
        for seed, run in sorted(seeds.items()):
            m, problems = run_measures(run), run["settings"]["val_problems"]
            curve = ", ".join(f"{step}: {acc:.3f} ± {math.sqrt(acc * (1 - acc) / problems):.3f}"
                              for step, acc in m["curve"])
            lines.append(f"| {arm} | {seed} | {m['steps']}/{run['settings']['steps']} | {curve or '-'} | "
                         f"{m['reward_first']:.3f} / {m['reward_second']:.3f} | {m['step_s']:.1f} | "
                         f"{m['generated']:,.0f} ({m['trained']:,.0f}) | {_number(m['seconds'], ',.0f')} | "
                         f"{_number(m['load_max'], '.1f')} | {_policy(run['settings'])} | {_compute_dtype(run)} |")
    return lines


def _welch_p(mine: Sequence[float], theirs: Sequence[float]) -> str:
    """Welch's two-sided p formatted, blank with fewer than 2 values a group, "n/a" where both are constant."""
    if min(len(mine), len(theirs)) < 2:
        return ""
    try:
        return format_p(welch(mine, theirs)[2])
    except ValueError:
        return "n/a"


def step_table(runs: dict[str, dict[int, dict]], reference: str = REFERENCE) -> list[str]:
    """Rows of evaluated steps; per arm the held-out accuracy's seed mean ± s.e. over the seeds evaluated there and,
    for the other arms, Welch's p against ``reference`` at that step."""
    curves = {arm: {seed: dict(run_measures(run)["curve"]) for seed, run in seeds.items()}
              for arm, seeds in runs.items()}
    steps = sorted({step for seeds in curves.values() for curve in seeds.values() for step in curve})
    arms = sorted(runs, key=lambda arm: arm != reference)
    lines = ["| step | " + " | ".join(f"{arm} ({_seeds(len(runs[arm]))})" for arm in arms) + " |",
             "|---:|" + "---|" * len(arms)]
    for step in steps:
        values = {arm: [c[step] for c in curves[arm].values() if step in c] for arm in arms}
        cells = []
        for arm in arms:
            cell = format_mean_se(values[arm]) if values[arm] else "-"
            p = _welch_p(values[arm], values.get(reference, [])) if arm != reference else ""
            cells.append(f"{cell} (p {p})" if p else cell)
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def arm_table(runs: dict[str, dict[int, dict]], reference: str = REFERENCE) -> list[str]:
    """Per arm, over seeds: training reward over the second half (Welch's p against ``reference``), generated
    tokens and seconds a step, and the run's seconds."""
    measures = {arm: [run_measures(run) for _, run in sorted(seeds.items())] for arm, seeds in runs.items()}
    lines = ["| arm | seeds | training reward, first half | second half | Welch p vs grpo (second half) | "
             "generated tokens a step | s / step | run s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = [m["reward_second"] for m in measures.get(reference, [])]
    for arm, seeds in measures.items():
        second = [m["reward_second"] for m in seeds]
        p = _welch_p(second, base) if arm != reference else ""
        lines.append(f"| {arm} | {', '.join(map(str, sorted(runs[arm])))} | "
                     f"{format_mean_se([m['reward_first'] for m in seeds])} | {format_mean_se(second)} | {p} | "
                     f"{_mean([m['generated'] for m in seeds]):,.0f} | {_mean([m['step_s'] for m in seeds]):.1f} | "
                     f"{_number(_mean([m['seconds'] for m in seeds]), ',.0f')} |")
    return lines


def accuracy_at_costs(points: Sequence[tuple[float, float]], budgets: Sequence[float]) -> list[float]:
    """A run's held-out accuracy at each cost in ``budgets``, on the piecewise-linear curve through its
    ``(cumulative cost, accuracy)`` points (``stats.interpolate``: ``a_i + (b - c_i) / (c_{i+1} - c_i)
    (a_{i+1} - a_i)`` on the segment c_i <= b <= c_{i+1}); a budget beyond the run's last point is an error."""
    costs, accuracies = [p[0] for p in points], [p[1] for p in points]
    return [interpolate(costs, accuracies, budget) for budget in budgets]


def cost_table(runs: dict[str, dict[int, dict]], key: str, reference: str = REFERENCE) -> list[str]:
    """Each arm against ``reference`` at equal cumulative ``key`` (``COSTS``): at k/K of the largest budget B
    every finished run of both arms reached (K: the reference's evaluations after step 0), each run's accuracy
    interpolated (:func:`accuracy_at_costs`), the seed means ± s.e. and Welch's p."""
    from verl_prm.apps.arithmetic.evaluate import cost_curve

    finished = {arm: [r for _, r in sorted(seeds.items()) if r["finished"]] for arm, seeds in runs.items()}
    if not finished.get(reference):
        return [f"(no finished {reference} run: no comparison at equal {COSTS[key]})"]
    points = {arm: [cost_curve(r["outputs"]["curve"], r["outputs"]["training"], key) for r in rs]
              for arm, rs in finished.items() if rs}
    evaluations = len(points[reference][0]) - 1
    lines = [f"| arm | {COSTS[key]} (share of B) | {reference} | arm | Welch p |", "|---|---:|---:|---:|---:|"]
    for arm in points:
        if arm == reference or evaluations < 1:
            continue
        budget = min(p[-1][0] for p in points[arm] + points[reference])
        budgets = [budget * k / evaluations for k in range(1, evaluations + 1)]
        mine = np.array([accuracy_at_costs(p, budgets) for p in points[arm]])
        theirs = np.array([accuracy_at_costs(p, budgets) for p in points[reference]])
        for k, value in enumerate(budgets):
            lines.append(f"| {arm} | {value:,.0f} ({(k + 1) / evaluations:.2f}) | {format_mean_se(theirs[:, k])} | "
                         f"{format_mean_se(mine[:, k])} | {_welch_p(mine[:, k].tolist(), theirs[:, k].tolist())} |")
    return lines


def per_problem_accuracy(path: str | Path) -> dict[str, float]:
    """{problem: accuracy} of one evaluation's dump (verl's ``validation_data_dir/<step>.jsonl``: a line per
    sample with its prompt ``input``, ground truth ``gts`` and ``acc``, else ``score``); a problem sampled more
    than once gets its mean."""
    sums: dict[str, list[float]] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        value = row.get("acc", row.get("score"))
        if value is None or "input" not in row:
            raise ValueError(f"{path}:{number} has no input and acc/score: not a verl validation dump")
        sums.setdefault(f"{row['input']}\x00{row.get('gts')}", []).append(float(value))
    return {problem: sum(values) / len(values) for problem, values in sums.items()}


def problem_interval(values: Sequence[float], *, resamples: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of per-problem values: the mean, and the ``level`` percentile interval of the mean over
    ``resamples`` bootstrap resamples of the problems (``stats.bootstrap``: P problems drawn P times with
    replacement; numpy's linear percentiles at (1 - level) / 2 and (1 + level) / 2)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    values = [float(v) for v in values]
    draws = bootstrap(lambda sample: [_mean(sample["problems"])], {"problems": values}, resamples=resamples,
                      seed=seed)[:, 0]
    low, high = np.percentile(draws, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return _mean(values), float(low), float(high)


def _final_problems(seeds: dict[int, dict]) -> tuple[int, dict[str, float]] | None:
    """(last evaluated step, {problem: mean accuracy over seeds}) of the finished seeds that dumped their last
    evaluation; None when any finished seed did not."""
    finished = [run for run in seeds.values() if run["finished"] and run["outputs"]["curve"]]
    if not finished:
        return None
    step = int(finished[0]["outputs"]["curve"][-1][0])
    dumps = [run["run_dir"] / "validation" / f"{step}.jsonl" for run in finished]
    if not all(path.exists() for path in dumps):
        return None
    tables = [per_problem_accuracy(path) for path in dumps]
    common = set.intersection(*(set(t) for t in tables))
    return (step, {problem: _mean([t[problem] for t in tables]) for problem in sorted(common)}) if common else None


def final_table(runs: dict[str, dict[int, dict]], reference: str = REFERENCE, resamples: int = 2000) -> list[str]:
    """Per arm: the final held-out accuracy (seed mean per problem, then over problems) with its 95% bootstrap
    interval over problems (:func:`problem_interval`), and the difference from ``reference`` on the problems both
    evaluated, paired by problem."""
    finals = {arm: _final_problems(seeds) for arm, seeds in runs.items()}
    lines = ["| arm | step | problems | final held-out accuracy [95% interval over problems] | minus "
             f"{reference} [95%] |", "|---|---:|---:|---:|---:|"]
    for arm, final in finals.items():
        if final is None:
            lines.append(f"| {arm} | - | - | (no validation/<step>.jsonl of every finished seed) | |")
            continue
        step, problems = final
        mean, low, high = problem_interval(list(problems.values()), resamples=resamples)
        difference = ""
        base = finals.get(reference)
        if arm != reference and base is not None:
            shared = sorted(set(problems) & set(base[1]))
            if shared:
                d, d_low, d_high = problem_interval([problems[p] - base[1][p] for p in shared], resamples=resamples)
                difference = f"{d:+.3f} [{d_low:+.3f}, {d_high:+.3f}] ({len(shared)} problems)"
        lines.append(f"| {arm} | {step} | {len(problems)} | {mean:.3f} [{low:.3f}, {high:.3f}] | {difference} |")
    return lines


def export_runs(runs: dict[str, dict[int, dict]], path: str | Path) -> tuple[Path, list[str]]:
    """The finished runs, one record each in the ``verl-prm arithmetic runs v1`` format (``settings`` with ``arm``
    and ``seed``, ``outputs.curve`` / ``outputs.training``, ``seconds``, ``environment`` of the last start) plus
    ``starts`` (each start's seconds, exit status and load average), to ``path``; returns it and the runs left
    out (unfinished)."""
    records, left_out = [], []
    for arm, seeds in runs.items():
        for seed, run in sorted(seeds.items()):
            if not run["finished"]:
                left_out.append(f"{arm} seed {seed}")
                continue
            starts = run["starts"]
            records.append({"settings": run["settings"], "outputs": run["outputs"],
                            "seconds": sum(s["seconds"] for s in starts) if starts else None,
                            "environment": starts[-1]["environment"] if starts else None,
                            "starts": [{k: v for k, v in s.items() if k != "environment"} for s in starts]})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "runs": records}, indent=1))
    return path, left_out


def plot(runs: dict[str, dict[int, dict]], path: str | Path) -> Path:
    """Four panels: held-out accuracy against the step (each seed thin, the seed mean thick), the training reward
    a step (seed mean), and the held-out accuracy (seed mean of the finished runs) against cumulative generated
    tokens and training seconds (``evaluate.cost_curve``, each point at the seeds' mean cost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_prm.apps.arithmetic.evaluate import cost_curve

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    held_out, training, by_tokens, by_seconds = axes.flat
    for index, (arm, seeds) in enumerate(sorted(runs.items())):
        color = f"C{index}"
        curves = [run_measures(run)["curve"] for run in seeds.values()]
        for curve in curves:
            if curve:
                held_out.plot(*zip(*curve), color=color, alpha=0.35, linewidth=1)
        common = sorted(set.intersection(*(set(s for s, _ in c) for c in curves))) if curves else []
        if common:
            means = [_mean([dict(c)[s] for c in curves]) for s in common]
            held_out.plot(common, means, color=color, linewidth=2.5, marker="o", label=f"{arm} ({_seeds(len(curves))})")
        trainings = [{t["step"]: t["batch_accuracy"] for t in run["outputs"]["training"]} for run in seeds.values()]
        steps = sorted(set.intersection(*(set(t) for t in trainings)))
        training.plot(steps, [_mean([t[s] for t in trainings]) for s in steps], color=color, label=arm)
        finished = [run for run in seeds.values() if run["finished"]]
        for axis, key in ((by_tokens, "generated_tokens"), (by_seconds, "step_seconds")):
            if finished:
                points = np.array([cost_curve(r["outputs"]["curve"], r["outputs"]["training"], key) for r in finished])
                axis.plot(points[..., 0].mean(0), points[..., 1].mean(0), color=color, marker="o",
                          label=f"{arm} ({_seeds(len(finished))})")
    held_out.set(xlabel="RL step", ylabel="held-out accuracy (T=1, one sample)", title="held-out problems")
    training.set(xlabel="RL step", ylabel="mean outcome reward of the batch", title="training batches (seed mean)")
    by_tokens.set(xlabel="generated tokens (cumulative)", ylabel="held-out accuracy", title="against generated tokens")
    by_seconds.set(xlabel="training seconds (timing_s/step, cumulative)", ylabel="held-out accuracy",
                   title="against training seconds")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # runs without held-out evaluations draw nothing there
            axis.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(runs: dict[str, dict[int, dict]], resamples: int = 2000) -> str:
    """Every table of the module docstring, with headings."""
    sections = [("Runs", run_table(runs)), ("Held-out accuracy by step, seed mean ± s.e. (Welch p vs grpo)",
                                            step_table(runs)),
                ("Training reward and costs, per arm", arm_table(runs))]
    sections += [(f"Held-out accuracy at equal {name}", cost_table(runs, key)) for key, name in COSTS.items()]
    sections.append(("Final held-out accuracy, bootstrap over problems", final_table(runs, resamples=resamples)))
    return "\n\n".join(f"### {title}\n\n" + "\n".join(lines) for title, lines in sections)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.word_problems_rl_report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True,
                        help="the --out (and --archive) directories of studies.word_problems_rl")
    parser.add_argument("--plot", type=Path, default=None, help="also write the curves to this PNG")
    parser.add_argument("--export", type=Path, default=None,
                        help="write the finished runs to this JSON file (verl-prm arithmetic runs v1)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples over problems")
    args = parser.parse_args(argv)
    if args.resamples < 2:
        parser.error(f"--resamples must be >= 2, got {args.resamples}")
    try:
        runs = read_runs(*args.runs)
    except ValueError as error:
        parser.error(str(error))
    print(report(runs, args.resamples))
    if args.plot is not None:
        print(f"written: {plot(runs, args.plot)}")
    if args.export is not None:
        path, left_out = export_runs(runs, args.export)
        print(f"written: {path}" + (f" (left out, unfinished: {', '.join(left_out)})" if left_out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The runs of ``studies.word_problems_rl`` side by side: a markdown table and, optionally, a plot.

Per run: the held-out accuracy at each evaluated step (``--val-problems`` test problems, one sample each at
temperature 1; ± the standard error over problems, sqrt(p (1 - p) / problems)), the mean training reward over the
first and the second half of its steps, the mean seconds a step (verl's ``timing_s/step``) and the tokens a step
generates and trains on (a tree generates its shared prefixes once: ``pav/tree_generated_tokens``). Per arm: the
seed means (± the standard error over seeds) and, with 2 or more seeds in both arms, Welch's p against GRPO
(``studies.arithmetic_significance.welch``).

    python -m studies.word_problems_rl_report --runs runs/wp_rl --problems 64 --plot runs/wp_rl/curves.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Sequence

from studies.arithmetic_significance import format_mean_se, format_p, welch
from studies.word_problems_rl import SIZE
from verl_prm.apps.cpu_loop import read_metrics

__all__ = ["read_runs", "run_measures", "table", "plot", "main"]

RUN_DIR = re.compile(r"^(?P<arm>[a-z_]+)_seed(?P<seed>\d+)$")
BATCH = SIZE.prompts_per_step * SIZE.responses_per_prompt


def read_runs(root: str | Path) -> dict[str, dict[int, dict[int, dict]]]:
    """{arm: {seed: {step: {metric: value}}}} from ``<root>/<arm>_seed<seed>/metrics.jsonl`` (a resumed run logs a
    step again: its last record counts). A run directory without metrics is refused, naming it."""
    root = Path(root)
    runs: dict[str, dict[int, dict[int, dict]]] = {}
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and RUN_DIR.match(p.name)):
        steps: dict[int, dict] = {}
        for record in read_metrics(run_dir / "metrics.jsonl"):
            steps.setdefault(int(record["step"]), {}).update(record["data"])
        if not steps:
            raise ValueError(f"{run_dir}: no metrics.jsonl records; run studies.word_problems_rl for it first")
        match = RUN_DIR.match(run_dir.name)
        runs.setdefault(match["arm"], {})[int(match["seed"])] = steps
    if not runs:
        raise ValueError(f"{root}: no <arm>_seed<seed> run directories")
    return runs


def run_measures(steps: dict[int, dict], val_key: str) -> dict:
    """One run's numbers: ``curve`` [(step, held-out accuracy)], ``reward_first`` / ``reward_second`` (mean
    ``critic/score/mean`` over the first / second half of the trained steps), ``step_s``, ``generated`` and
    ``trained`` (tokens a step)."""
    trained_steps = sorted(s for s, data in steps.items() if "critic/score/mean" in data)
    if not trained_steps:
        raise ValueError("the run logged no trained step (no critic/score/mean)")
    half = (len(trained_steps) + 1) // 2

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else math.nan

    rewards = [steps[s]["critic/score/mean"] for s in trained_steps]
    trained = [steps[s]["response_length/mean"] * BATCH for s in trained_steps]
    generated = [steps[s].get("pav/tree_generated_tokens", t) for s, t in zip(trained_steps, trained)]
    return {"curve": sorted((s, data[val_key]) for s, data in steps.items() if val_key in data),
            "steps": len(trained_steps), "reward_first": mean(rewards[:half]), "reward_second": mean(rewards[half:]),
            "step_s": mean([steps[s]["timing_s/step"] for s in trained_steps if "timing_s/step" in steps[s]]),
            "generated": mean(generated), "trained": mean(trained)}


def table(runs: dict[str, dict[int, dict[int, dict]]], problems: int, reference: str = "grpo",
          val_key: str = "val-core/word_problems/acc/mean@1") -> str:
    """Per-run rows, then per-arm rows with Welch's p against ``reference`` on the last held-out accuracy and on
    the second half's training reward."""
    measures = {arm: {seed: run_measures(steps, val_key) for seed, steps in sorted(seeds.items())}
                for arm, seeds in runs.items()}
    lines = ["| arm | seed | held-out accuracy by step (± s.e. over problems) | training reward, first / second half "
             "of the steps | s / step | tokens a step: generated (trained) |", "|---|---:|---|---:|---:|---:|"]
    for arm, seeds in measures.items():
        for seed, m in seeds.items():
            curve = ", ".join(f"{step}: {acc:.3f} ± {math.sqrt(acc * (1 - acc) / problems):.3f}"
                              for step, acc in m["curve"])
            lines.append(f"| {arm} | {seed} | {curve or '-'} | {m['reward_first']:.3f} / {m['reward_second']:.3f} | "
                         f"{m['step_s']:.1f} | {m['generated']:,.0f} ({m['trained']:,.0f}) |")
    lines += ["", f"| arm | seeds | held-out accuracy, first -> last evaluation | training reward, second half | "
                  f"Welch p vs {reference}: last accuracy / reward |", "|---|---|---|---:|---:|"]

    def finals(arm: str) -> tuple[list[float], list[float], list[float]]:
        seeds = [m for m in measures[arm].values() if m["curve"]]
        return ([m["curve"][0][1] for m in seeds], [m["curve"][-1][1] for m in seeds],
                [m["reward_second"] for m in measures[arm].values()])

    _, base_last, base_reward = finals(reference) if reference in measures else ([], [], [])
    for arm in measures:
        first, last, reward = finals(arm)
        p = ""
        if arm != reference and reference in measures:
            if min(len(last), len(base_last), len(reward), len(base_reward)) >= 2:
                p = " / ".join(format_p(welch(mine, theirs)[2])
                               for mine, theirs in ((last, base_last), (reward, base_reward)))
        accuracy = f"{format_mean_se(first)} -> {format_mean_se(last)}" if last else "-"
        lines.append(f"| {arm} | {', '.join(map(str, measures[arm]))} | {accuracy} | {format_mean_se(reward)} | {p} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict[int, dict]]], path: str | Path,
         val_key: str = "val-core/word_problems/acc/mean@1") -> Path:
    """Two panels: held-out accuracy at the evaluated steps (each seed thin, the seed mean thick) and the training
    reward a step (seed mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held_out, training) = plt.subplots(1, 2, figsize=(10, 4))
    for index, (arm, seeds) in enumerate(sorted(runs.items())):
        color = f"C{index}"
        curves = [run_measures(steps, val_key)["curve"] for steps in seeds.values()]
        for curve in curves:
            held_out.plot(*zip(*curve), color=color, alpha=0.35, linewidth=1)
        common = sorted(set.intersection(*(set(s for s, _ in c) for c in curves))) if curves else []
        if common:
            means = [sum(dict(c)[s] for c in curves) / len(curves) for s in common]
            held_out.plot(common, means, color=color, linewidth=2.5, marker="o", label=f"{arm} ({len(curves)} seeds)")
        steps = sorted(set.intersection(*(set(s for s, d in run.items() if "critic/score/mean" in d)
                                          for run in seeds.values())))
        training.plot(steps, [sum(run[s]["critic/score/mean"] for run in seeds.values()) / len(seeds) for s in steps],
                      color=color, label=arm)
    held_out.set(xlabel="RL step", ylabel="held-out accuracy (T=1, one sample)", title="held-out problems")
    training.set(xlabel="RL step", ylabel="mean outcome reward of the batch", title="training batches (seed mean)")
    for axis in (held_out, training):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # runs without held-out evaluations draw nothing on the left
            axis.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.word_problems_rl_report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="the --out directory of studies.word_problems_rl")
    parser.add_argument("--problems", type=int, default=64, help="held-out problems a run evaluated on")
    parser.add_argument("--plot", type=Path, default=None, help="also write the curves to this PNG")
    args = parser.parse_args(argv)
    if args.problems < 1:
        parser.error(f"--problems must be >= 1, got {args.problems}")
    runs = read_runs(args.runs)
    print(table(runs, args.problems))
    if args.plot is not None:
        print(f"written: {plot(runs, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's analysis and printed report: iterations to 90%, the sample-efficiency line, Pass@N levels, and
the tables ``verl-prm demo`` prints (see ``verl_prm.apps.demo.demo``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from verl_prm.apps.demo.settings import DemoSettings

PAPER_CLAIMS = (
    "effective reward (PAV) reached 100% accuracy in about 350 iterations at gamma = 10 while outcome-only RL "
    "stayed low; effective rewards help only for gamma in about [8, 15]; Pass@N after 100 iterations grows about "
    "5x faster with N than outcome-only RL"
)
PASS_AT_N_SAMPLES = 2048
PASS_AT_N_NS = [2**i for i in range(11)]  # 1..1024
ACCURACY_WINDOW = 10


def iterations_to_90(accuracy: list[float]) -> int | None:
    from verl_prm.apps.demo.policy_gradient import iterations_to

    return iterations_to(np.asarray(accuracy), 0.9, ACCURACY_WINDOW)


def censored_mean(hits: list[int | None], budget: int) -> tuple[float, bool]:
    """Mean of the iterations to 90%, a miss counting as ``budget``; and whether any run missed."""
    values = [budget if h is None else h for h in hits]
    return float(np.mean(values)), any(h is None for h in hits)


def sample_efficiency_line(outcome_hits: list[int | None], pav_hits: list[int | None], budget: int) -> str:
    """The demo's last line (see the module docstring for the bounds)."""
    prefix = "sample efficiency (iterations to 90% accuracy, outcome-only / PAV): "
    outcome_mean, outcome_missed = censored_mean(outcome_hits, budget)
    pav_mean, pav_missed = censored_mean(pav_hits, budget)
    if outcome_missed and pav_missed:
        all_missed = all(h is None for h in outcome_hits + pav_hits)
        why = "neither method" if all_missed else "runs of both methods did not"
        return prefix + f"n/a ({why} reach 90% within {budget} iterations)"
    ratio = outcome_mean / pav_mean
    qualifier = ">" if outcome_missed else "<" if pav_missed else ""
    return prefix + f"{qualifier}{ratio:.1f}x"


def trailing_accuracy(accuracy: list[float], at: int) -> float:
    """Mean batch accuracy of iterations at-10..at-1."""
    window = accuracy[max(0, at - ACCURACY_WINDOW) : at]
    return float(np.mean(window))


def n_for_pass(successes: int, level: float = 0.5) -> int | None:
    """Smallest N <= PASS_AT_N_SAMPLES with unbiased Pass@N >= level, None if none."""
    from verl_prm.apps.demo.policy_gradient import pass_at_n

    ns = list(range(1, PASS_AT_N_SAMPLES + 1))
    values = pass_at_n(PASS_AT_N_SAMPLES, successes, ns)
    hits = np.nonzero(values >= level)[0]
    return int(ns[hits[0]]) if hits.size else None


def _fmt_hits(hits: list[int | None], budget: int) -> str:
    return " ".join(f">{budget}" if h is None else str(h) for h in hits)


def _fmt_mean(hits: list[int | None], budget: int) -> str:
    mean, missed = censored_mean(hits, budget)
    return f"{'>' if missed else ''}{mean:.0f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def print_report(report: dict[str, Any], settings: DemoSettings, files: list[str], out: Path) -> None:
    budget = settings.iterations
    planted = " ".join(map(str, settings.planted))
    base_rate = np.mean(report["pass_at_n"]["base_successes"]) / PASS_AT_N_SAMPLES
    print()
    print(f"task: length 10, tokens 1..14 (14 = EOS), planted y* = {planted}; reward 1 iff y* occurs before EOS")
    print(f"base policy: MADE MLP (3 x 128) warm-started on 3,200 samples of mu_5 for {settings.warm_iterations} "
          f"iterations; its accuracy {100 * base_rate:.2f}%")
    print(f"RL: batch 64, Adam 1e-3, estimator pav_grpo (norm_adv_by_std_in_grpo={settings.norm_adv_by_std}), "
          f"alpha={settings.alpha:g} (outcome-only: 0), verl vanilla policy loss ({settings.loss_agg_mode}), "
          f"every token a step; prover values: {'learned critic' if settings.learned_critic else 'exact'}")
    print()
    print(f"1. outcome-only vs PAV (prover mu_{settings.gamma:g}), {settings.seeds} seeds, {budget} iterations")
    rows = []
    for name, c in report["comparison"].items():
        rows.append([name, _fmt_hits(c["iterations_to_90"], budget), _fmt_mean(c["iterations_to_90"], budget),
                     f"{100 * np.mean(c['final_accuracy']):.1f}%"])
    print(_table(rows, ["method", "iterations to 90% (per seed)", "mean", f"accuracy at {budget}"]))
    print()
    sweep = report["sweep"]
    at, end = sweep["accuracy_at"], sweep["iterations"]
    print(f"2. prover sweep: PAV with mu_gamma, {settings.sweep_seeds} seed(s), {end} iterations")
    rows = [["outcome-only", "-", "-", f"{100 * sweep['outcome_accuracy']:.1f}%",
             f"{100 * sweep['outcome_accuracy_at_end']:.1f}%", _fmt_hits(sweep["outcome_iterations_to_90"], end)]]
    if settings.learned_critic:
        rows[0].append("-")
    for row in sweep["rows"]:
        cells = [f"{row['gamma']:g}", f"{100 * row['prover_success']:.1f}%", f"{row['mean_abs_progress_base']:.4f}",
                 f"{100 * row['accuracy_mean']:.1f}%", f"{100 * np.mean(row['accuracy_at_end']):.1f}%",
                 _fmt_hits(row["iterations_to_90"], end)]
        if row["critic"]:
            cells.append(f"{row['critic']['value_mae']:.4f} / {row['critic']['progress_mae']:.4f}")
        rows.append(cells)
    header = ["gamma", "V^mu(start)", "mean |A^mu| (base)", f"accuracy at {at}", f"accuracy at {end}",
              "iterations to 90%"]
    if settings.learned_critic:
        header.append("critic MAE value / progress")
    print(_table(rows, header))
    print()
    pn = report["pass_at_n"]
    print(f"3. Pass@N after {pn['iteration']} iterations (unbiased, {PASS_AT_N_SAMPLES} samples per seed, mean "
          "over seeds)")
    shown = [1, 4, 16, 64, 256, 1024]
    rows = [[name] + [f"{values[PASS_AT_N_NS.index(n)]:.3f}" for n in shown] for name, values in pn["curves"].items()]
    print(_table(rows, ["policy"] + [f"N={n}" for n in shown]))
    n50 = pn["n_for_pass_0.5"]
    outcome_n, pav_n = n50["outcome-only"], n50["PAV"]
    print("N for Pass@N >= 0.5 (per seed): outcome-only " + " ".join(f">{PASS_AT_N_SAMPLES}" if n is None else str(n)
          for n in outcome_n) + "; PAV " + " ".join(f">{PASS_AT_N_SAMPLES}" if n is None else str(n) for n in pav_n))
    print()
    print(f"paper: {PAPER_CLAIMS}.")
    print(f"plots: {', '.join(str(out / f) for f in files)}; numbers: {out / 'results.json'}")
    print(f"wall time: {report['wall_seconds']:.0f} s")
    print(report["line"])

"""``verl-prm demo``: outcome-only RL against RL with PAV progress rewards on the planted sub-sequence task.

What it runs (defaults; ``--quick`` is a smaller version of the same):

1. comparison: outcome-only RL (alpha = 0) and PAV RL (alpha = 1, exact values of the prover mu_10) from the
   same warm-started policy, over several seeds; accuracy = success rate of each on-policy batch of 64;
2. prover sweep: PAV RL with mu_gamma for gamma in 1..100, accuracy after a fixed number of iterations;
3. Pass@N of the policies after 100 iterations (unbiased estimator from 2,048 samples).

It prints tables, writes ``accuracy_vs_iterations.png``, ``accuracy_vs_gamma.png``, ``pass_at_n.png`` and
``results.json`` into ``--out``, and ends with one line::

    sample efficiency (iterations to 90% accuracy, outcome-only / PAV): N.Nx

"iterations to 90%" of a run is the first iteration count at which the mean accuracy of its last 10 batches is
>= 0.9; the line divides the mean over seeds. A run that never gets there counts as the iteration budget B, and
the ratio is then a bound: ``>N.Nx`` when only outcome-only runs missed (a lower bound), ``<N.Nx`` when only PAV
runs missed (an upper bound), ``n/a`` when runs of both methods missed.

Every RL update goes through the plugin: the advantages come from the registered ``pav_grpo`` estimator, which
verl's ``compute_advantage_for_multi_trajectories`` calls on a verl ``DataProto`` inside
``verl_prm.integrations.verl.advantage.estimator_step_inputs``, the path of the trainer hook (alpha = 0:
outcome-only); the loss from verl's ``compute_policy_loss_vanilla`` (see ``verl_prm.apps.demo.policy_gradient``).

Modules: this one (the command and the experiments' orchestration), ``settings`` (``DemoSettings``), ``runs``
(one RL run and the process pool), ``report`` (analysis and printed tables), ``plots`` (the three PNGs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from verl_prm.cli_types import finite_float, finite_floats
from verl_prm.apps.demo.plots import write_plots
from verl_prm.apps.demo.report import (
    PAPER_CLAIMS,
    PASS_AT_N_NS,
    PASS_AT_N_SAMPLES,
    print_report,
    iterations_to_90,
    n_for_pass,
    sample_efficiency_line,
    trailing_accuracy,
)
from verl_prm.apps.demo.settings import DEFAULT_PLANTED, QUICK, DemoSettings

if TYPE_CHECKING:
    from verl_prm.apps.demo.runs import RunSpec

__all__ = ["main", "run_demo", "settings_from_args"]


def settings_from_args(argv: list[str]) -> DemoSettings:
    parser = argparse.ArgumentParser(
        prog="verl-prm demo",
        description="The PAV paper's planted sub-sequence experiment: outcome-only RL vs RL with progress rewards "
        "from a prover (exact values, or a learned critic with --learned-critic), on CPU.",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller run (<= 1 minute on 2 cores)")
    parser.add_argument("--out", default="demo_out", help="output directory for the plots and results.json")
    parser.add_argument("--learned-critic", action="store_true",
                        help="replace the exact prover values by a critic trained on Monte-Carlo labels")
    parser.add_argument("--seeds", type=int, help="seeds of the comparison (default 5; quick 2)")
    parser.add_argument("--iterations", type=int, help="RL iterations of the comparison (default 600; quick 300)")
    parser.add_argument("--gamma", type=finite_float(0.0, low_open=True), default=10.0, help="prover strength of the comparison (default 10)")
    parser.add_argument("--alpha", type=finite_float(0.0), default=1.0, help="weight of the progress term (default 1)")
    parser.add_argument("--gammas", type=finite_floats(0.0, low_open=True), help="comma-separated prover sweep (default 1,3,5,10,15,30,100)")
    parser.add_argument("--sweep-seeds", type=int, help="seeds per gamma in the sweep (default 3; quick 1)")
    parser.add_argument("--sweep-iterations", type=int, help="RL iterations per sweep run (default 300; quick 150)")
    parser.add_argument("--planted", type=str, help=f"planted sequence, e.g. '{' '.join(map(str, DEFAULT_PLANTED))}'")
    parser.add_argument("--no-std-norm", action="store_true",
                        help="norm_adv_by_std_in_grpo=false: out_i = R_i - mean R (the paper's REINFORCE baseline)")
    parser.add_argument("--loss-agg-mode", default="token-mean", help="verl loss_agg_mode (default token-mean)")
    parser.add_argument("--warm-iterations", type=int, default=50, help="supervised warm-start iterations (50)")
    parser.add_argument("--workers", type=int,
                        help="processes for independent runs (default: min(2, CPUs), 1 with --quick, where starting "
                        "a process and importing verl in it costs more than it saves); 1 runs in this process")
    args = parser.parse_args(argv)
    settings = DemoSettings()
    if args.quick:
        settings = replace(settings, quick=True, **QUICK)
    overrides: dict[str, Any] = {
        "out": args.out,
        "learned_critic": args.learned_critic,
        "gamma": args.gamma,
        "alpha": args.alpha,
        "norm_adv_by_std": not args.no_std_norm,
        "loss_agg_mode": args.loss_agg_mode,
        "warm_iterations": args.warm_iterations,
        "workers": max(1, args.workers if args.workers is not None else 1 if args.quick else
                       min(2, os.cpu_count() or 1)),
    }
    for name in ("seeds", "iterations", "sweep_seeds", "sweep_iterations"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.gammas:
        overrides["sweep_gammas"] = args.gammas
    if args.planted:
        overrides["planted"] = tuple(int(a) for a in args.planted.replace(",", " ").split())
    settings = replace(settings, **overrides)
    if settings.iterations < settings.pass_at_iteration:
        parser.error(f"--iterations must be >= {settings.pass_at_iteration} (Pass@N is taken there)")
    if settings.sweep_iterations < settings.sweep_accuracy_at:
        parser.error(f"--sweep-iterations must be >= {settings.sweep_accuracy_at} (the sweep's accuracy is read there)")
    if settings.seeds < 1 or settings.sweep_seeds < 1:
        parser.error("--seeds and --sweep-seeds must be >= 1")
    # the sweep reuses the comparison's runs for outcome-only and for gamma = --gamma
    if settings.sweep_iterations > settings.iterations or settings.sweep_seeds > settings.seeds:
        parser.error("use --sweep-iterations <= --iterations and --sweep-seeds <= --seeds (the sweep reuses the "
                     "comparison's runs for outcome-only and for gamma = --gamma)")
    from verl_prm.apps.demo.env import PlantedTask  # after parsing: --help answers without loading torch

    PlantedTask(planted=settings.planted)  # validates the planted sequence early
    return settings


# a method of the comparison: (its name in the report, RunSpec.method, RunSpec.values)
Method = tuple[str, str, str]
RunsByName = dict[str, list[tuple["RunSpec", dict]]]


def run_demo(settings: DemoSettings) -> dict[str, Any]:
    """Run every experiment; return the report (also what results.json holds)."""
    from verl_prm.apps.demo.policy_gradient import import_verl
    from verl_prm.apps.demo.runs import execute_run, run_all

    started = time.perf_counter()
    if settings.workers == 1:
        import_verl()  # fails early, with the fix, if the plugin is not registered (workers check it themselves)
    gammas = sorted(set(settings.sweep_gammas) | {settings.gamma})
    critics = train_critics(settings, gammas) if settings.learned_critic else {}
    methods = comparison_methods(settings)
    specs = plan_runs(settings, methods, gammas, critics)
    results = run_all(settings, [(execute_run, settings, s) for _, s in specs], "RL runs",
                      [s.iterations for _, s in specs])
    by_name: RunsByName = {}
    for (name, s), r in zip(specs, results):
        by_name.setdefault(name, []).append((s, r))

    report: dict[str, Any] = {"settings": {k: v for k, v in asdict(settings).items()}, "paper": PAPER_CLAIMS}
    report["settings"]["planted"] = list(settings.planted)
    report["settings"]["sweep_gammas"] = list(settings.sweep_gammas)
    report["curves"] = {name: [r["accuracy"] for _, r in by_name[name]] for name, _, _ in methods}
    comparison = report["comparison"] = comparison_report(settings, methods, by_name)
    report["sweep"] = sweep_report(settings, gammas, by_name, critics)
    base_successes = [r["base_successes"] for _, r in by_name["outcome-only"]]
    report["pass_at_n"] = pass_at_n_report(settings, methods, comparison, base_successes)
    report["critics"] = {str(g): q for g, (_, q) in critics.items()}
    report["line"] = sample_efficiency_line(
        comparison["outcome-only"]["iterations_to_90"], comparison["PAV"]["iterations_to_90"], settings.iterations
    )
    report["wall_seconds"] = time.perf_counter() - started
    return report


def train_critics(settings: DemoSettings, gammas: list[float]) -> dict[float, tuple[dict, dict]]:
    """``--learned-critic``: a critic per prover gamma (its state dict and its quality)."""
    from verl_prm.apps.demo.runs import run_all, train_critic_job

    jobs = [(train_critic_job, settings, g) for g in gammas]
    return dict(zip(gammas, run_all(settings, jobs, "critics (MC labels + training)", [1] * len(jobs))))


def comparison_methods(settings: DemoSettings) -> list[Method]:
    methods = [("outcome-only", "outcome", "exact"), ("PAV", "pav", "learned" if settings.learned_critic else "exact")]
    if settings.learned_critic:
        methods.append(("PAV (exact values)", "pav", "exact"))
    return methods


def plan_runs(settings: DemoSettings, methods: list[Method], gammas: list[float],
              critics: dict[float, tuple[dict, dict]]) -> list[tuple[str, RunSpec]]:
    """Every RL run, named by the report entry it serves: the comparison's runs of each method and seed, then the
    sweep's; the comparison's PAV runs (same seeds, a prefix of their iterations) serve gamma = ``--gamma``."""
    from verl_prm.apps.demo.runs import RunSpec

    def spec(method: str, gamma: float, seed: int, iterations: int, kind: str, pass_at=None) -> RunSpec:
        state = critics[gamma][0] if (method == "pav" and kind == "learned") else None
        return RunSpec(method, gamma, seed, iterations, kind, pass_at, state)

    values_kind = "learned" if settings.learned_critic else "exact"
    specs: list[tuple[str, RunSpec]] = []
    for name, method, kind in methods:
        for seed in range(settings.seeds):
            specs.append((name, spec(method, settings.gamma, seed, settings.iterations, kind,
                                     settings.pass_at_iteration)))
    for g in gammas:
        if g != settings.gamma:
            for seed in range(settings.sweep_seeds):
                specs.append((f"sweep:{g}", spec("pav", g, seed, settings.sweep_iterations, values_kind)))
    return specs


def comparison_report(settings: DemoSettings, methods: list[Method], by_name: RunsByName) -> dict[str, dict]:
    """Per method: iterations to 90% and final accuracy of each seed, and its Pass@N success counts."""
    comparison = {}
    for name, _, _ in methods:
        runs = by_name[name]
        comparison[name] = {
            "iterations_to_90": [iterations_to_90(r["accuracy"]) for _, r in runs],
            "final_accuracy": [trailing_accuracy(r["accuracy"], settings.iterations) for _, r in runs],
            "pass_successes": [r["pass_successes"] for _, r in runs],
        }
    return comparison


def sweep_report(settings: DemoSettings, gammas: list[float], by_name: RunsByName,
                 critics: dict[float, tuple[dict, dict]]) -> dict[str, Any]:
    """The prover sweep: per gamma, accuracy of the PAV runs and the prover's mean |A^mu| on base-policy
    samples; outcome-only RL on the same seeds for reference."""
    import torch

    from verl_prm.apps.demo.env import PlantedTask
    from verl_prm.apps.demo.policy_gradient import exact_values
    from verl_prm.apps.demo.runs import base_policy

    task = PlantedTask(planted=settings.planted)
    sweep_seeds = list(range(settings.sweep_seeds))

    def sweep_runs(g: float) -> list[dict]:
        if g == settings.gamma:
            return [r for s, r in by_name["PAV"] if s.seed in sweep_seeds]
        return [r for _, r in by_name[f"sweep:{g}"]]

    warm_policy = base_policy(settings, task, 0)
    base_samples = warm_policy.sample(4096, torch.Generator().manual_seed(4242), task.eos)
    mask = task.response_mask(base_samples).float()
    rows = []
    for g in gammas:
        runs = sweep_runs(g)
        acc = [trailing_accuracy(r["accuracy"], settings.sweep_accuracy_at) for r in runs]
        acc_end = [trailing_accuracy(r["accuracy"], settings.sweep_iterations) for r in runs]
        step_values, prompt_values = exact_values(task, g)(base_samples)
        progress = torch.diff(torch.cat([prompt_values[:, None], step_values], dim=1), dim=1)
        rows.append({
            "gamma": g,
            "prover_success": float(task.value_table(g)[0, 0]),
            "mean_abs_progress_base": float((progress.abs() * mask).sum() / mask.sum()),
            "accuracy": acc,
            "accuracy_mean": float(np.mean(acc)),
            "accuracy_min": float(np.min(acc)),
            "accuracy_max": float(np.max(acc)),
            "accuracy_at_end": acc_end,
            "iterations_to_90": [iterations_to_90(r["accuracy"][: settings.sweep_iterations]) for r in runs],
            "critic": critics[g][1] if g in critics else None,
        })
    outcome_runs = [r for s, r in by_name["outcome-only"] if s.seed in sweep_seeds]
    outcome_sweep = [trailing_accuracy(r["accuracy"], settings.sweep_accuracy_at) for r in outcome_runs]
    outcome_end = [trailing_accuracy(r["accuracy"], settings.sweep_iterations) for r in outcome_runs]
    return {"iterations": settings.sweep_iterations, "accuracy_at": settings.sweep_accuracy_at,
            "rows": rows, "outcome_accuracy": float(np.mean(outcome_sweep)),
            "outcome_accuracy_at_end": float(np.mean(outcome_end)),
            "outcome_iterations_to_90": [iterations_to_90(r["accuracy"][: settings.sweep_iterations])
                                         for r in outcome_runs]}


def pass_at_n_report(settings: DemoSettings, methods: list[Method], comparison: dict[str, dict],
                     base_successes: list[int]) -> dict[str, Any]:
    """Pass@N curves pooled over seeds (each seed's 2,048 samples) and the N where Pass@N reaches 0.5."""
    from verl_prm.apps.demo.policy_gradient import pass_at_n

    curves = {"base policy (iteration 0)": np.mean(
        [pass_at_n(PASS_AT_N_SAMPLES, c, PASS_AT_N_NS) for c in base_successes], axis=0).tolist()}
    n50 = {}
    for name, _, _ in methods:
        per_seed = [pass_at_n(PASS_AT_N_SAMPLES, c, PASS_AT_N_NS) for c in comparison[name]["pass_successes"]]
        curves[name] = np.mean(per_seed, axis=0).tolist()
        n50[name] = [n_for_pass(c) for c in comparison[name]["pass_successes"]]
    return {"iteration": settings.pass_at_iteration, "ns": PASS_AT_N_NS, "curves": curves,
            "n_for_pass_0.5": n50, "base_successes": base_successes, "samples": PASS_AT_N_SAMPLES}


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    previous_threads = torch.get_num_threads()
    # The MLP is tiny: one thread per run is fastest, and makes every run bitwise reproducible.
    torch.set_num_threads(1)
    try:
        report = run_demo(settings)
    finally:
        torch.set_num_threads(previous_threads)
    files = write_plots(out, report)
    with open(out / "results.json", "w") as f:
        json.dump(report, f, indent=1, default=float)
    print_report(report, settings, files, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

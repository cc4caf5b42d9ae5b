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

Every RL update goes through the plugin: the advantages come from the registered ``pav_grpo`` estimator via
``verl_prm.estimators.compute_advantage_with_steps`` on a verl ``DataProto`` (alpha = 0: outcome-only), the loss
from verl's ``compute_policy_loss_vanilla`` (see ``verl_prm.toy.rl``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_prm.toy.env import DEFAULT_PLANTED, PlantedTask

__all__ = ["DemoSettings", "RunSpec", "execute_run", "main", "sample_efficiency_line", "settings_from_args"]

PAPER_CLAIMS = (
    "effective reward (PAV) reached 100% accuracy in about 350 iterations at gamma = 10 while outcome-only RL "
    "stayed low; effective rewards help only for gamma in about [8, 15]; Pass@N after 100 iterations grows about "
    "5x faster with N than outcome-only RL"
)
PASS_AT_N_SAMPLES = 2048
PASS_AT_N_NS = [2**i for i in range(11)]  # 1..1024
ACCURACY_WINDOW = 10


@dataclass
class DemoSettings:
    planted: tuple[int, ...] = DEFAULT_PLANTED
    seeds: int = 5
    iterations: int = 600  # comparison budget B
    gamma: float = 10.0  # the comparison's prover
    alpha: float = 1.0
    sweep_gammas: tuple[float, ...] = (1.0, 3.0, 5.0, 10.0, 15.0, 30.0, 100.0)
    sweep_seeds: int = 3
    sweep_iterations: int = 300
    # the sweep's plot shows accuracy here: early enough to separate the provers (most runs are done by 300)
    sweep_accuracy_at: int = 100
    pass_at_iteration: int = 100
    norm_adv_by_std: bool = True
    loss_agg_mode: str = "token-mean"
    warm_iterations: int = 50
    learned_critic: bool = False
    critic_seed: int = 0
    workers: int = 2
    out: str = "demo_out"
    quick: bool = False


QUICK = dict(seeds=2, iterations=300, sweep_gammas=(1.0, 10.0, 100.0), sweep_seeds=1, sweep_iterations=150)


@dataclass
class RunSpec:
    """One RL run: ``method`` is "outcome" (alpha = 0) or "pav"; ``values`` is "exact" or "learned"."""

    method: str
    gamma: float
    seed: int
    iterations: int
    values: str = "exact"
    pass_at: int | None = None
    critic_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)


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
    parser.add_argument("--gamma", type=float, default=10.0, help="prover strength of the comparison (default 10)")
    parser.add_argument("--alpha", type=float, default=1.0, help="weight of the progress term (default 1)")
    parser.add_argument("--gammas", type=str, help="comma-separated prover sweep (default 1,3,5,10,15,30,100)")
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
        overrides["sweep_gammas"] = tuple(float(g) for g in args.gammas.split(","))
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
    PlantedTask(planted=settings.planted)  # validates the planted sequence early
    return settings


# ------------------------------------------------------------------------------------------------ one run
_BASE_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def _base_policy(settings: DemoSettings, task: PlantedTask, seed: int):
    """The warm-started policy of ``seed`` (cached per process: every run of a seed starts from it)."""
    from verl_prm.toy.policy import MadePolicy
    from verl_prm.toy.rl import make_base_policy

    key = (task.planted, settings.warm_iterations, seed)
    if key not in _BASE_CACHE:
        _BASE_CACHE[key] = make_base_policy(task, seed, warm_iterations=settings.warm_iterations).state_dict()
    policy = MadePolicy(task.length, task.vocab)
    policy.load_state_dict(_BASE_CACHE[key])
    return policy


def _success_count(task: PlantedTask, policy, seed: int, num: int = PASS_AT_N_SAMPLES) -> int:
    samples = policy.sample(num, torch.Generator().manual_seed(777_000 + seed), task.eos)
    return int(task.rewards(samples).sum())


def execute_run(settings: DemoSettings, spec: RunSpec, progress=None) -> dict[str, Any]:
    """Run one RL run (deterministic in ``spec.seed``; single-threaded). Returns its curves and counts."""
    from verl_prm.toy.critic import ToyCritic, critic_values
    from verl_prm.toy.policy import MadePolicy
    from verl_prm.toy.rl import RLConfig, train_rl

    task = PlantedTask(planted=settings.planted)
    base = _base_policy(settings, task, spec.seed)
    values = None
    if spec.method == "pav" and spec.values == "learned":
        critic = ToyCritic(task.length, task.vocab)
        critic.load_state_dict(spec.critic_state)
        values = critic_values(critic, task)
    cfg = RLConfig(
        alpha=0.0 if spec.method == "outcome" else settings.alpha,
        gamma=spec.gamma,
        iterations=spec.iterations,
        norm_adv_by_std=settings.norm_adv_by_std,
        loss_agg_mode=settings.loss_agg_mode,
        snapshots=(spec.pass_at,) if spec.pass_at is not None else (),
    )
    result = train_rl(task, base, cfg, spec.seed, values=values, progress=progress)
    out: dict[str, Any] = {"accuracy": result.accuracy.tolist()}
    if spec.pass_at is not None:
        policy = MadePolicy(task.length, task.vocab)
        policy.load_state_dict(result.snapshots[spec.pass_at])
        out["pass_successes"] = _success_count(task, policy, spec.seed)
        out["base_successes"] = _success_count(task, base, spec.seed)
    return out


def _train_critic_job(settings: DemoSettings, gamma: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from verl_prm.toy.critic import CriticConfig, train_toy_critic

    task = PlantedTask(planted=settings.planted)
    base = _base_policy(settings, task, settings.critic_seed)
    critic, quality = train_toy_critic(task, base, gamma, CriticConfig(), seed=settings.critic_seed)
    return critic.state_dict(), quality


def _worker_init() -> None:
    torch.set_num_threads(1)
    from verl_prm.toy.rl import import_verl

    import_verl()


def _run_all(settings: DemoSettings, jobs: list[tuple], description: str, units: list[int]) -> list[Any]:
    """Run ``jobs`` ((function, *args) tuples) in ``settings.workers`` processes, or here when 1.

    ``units``: progress units per job (RL iterations). A broken pool (e.g. no permission to start processes)
    falls back to running here, with a warning.
    """
    from tqdm.auto import tqdm

    results: list[Any] = [None] * len(jobs)
    with tqdm(total=sum(units), desc=description, unit="it", leave=True, dynamic_ncols=True) as bar:
        if settings.workers > 1 and len(jobs) > 1:
            try:
                context = multiprocessing.get_context("spawn")
                with concurrent.futures.ProcessPoolExecutor(
                    max_workers=min(settings.workers, len(jobs)), mp_context=context, initializer=_worker_init
                ) as pool:
                    futures = {pool.submit(job[0], *job[1:]): i for i, job in enumerate(jobs)}
                    for future in concurrent.futures.as_completed(futures):
                        i = futures[future]
                        results[i] = future.result()
                        bar.update(units[i])
                return results
            except (concurrent.futures.process.BrokenProcessPool, OSError, PermissionError) as error:
                warnings.warn(f"worker processes failed ({error}); running in this process instead")
                bar.reset()
        for i, job in enumerate(jobs):
            if job[0] is execute_run:
                results[i] = execute_run(*job[1:], progress=bar.update)
            else:
                results[i] = job[0](*job[1:])
                bar.update(units[i])
    return results


# ------------------------------------------------------------------------------------------------ analysis
def iterations_to_90(accuracy: list[float]) -> int | None:
    from verl_prm.toy.rl import iterations_to

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
    from verl_prm.toy.rl import pass_at_n

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


# ------------------------------------------------------------------------------------------------ plots
def _plots(out: Path, report: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    colors = {"outcome-only": "tab:gray", "PAV": "tab:blue", "PAV (exact values)": "tab:green"}
    # 1. accuracy vs iterations
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, curves in report["curves"].items():
        smooth = np.array([np.convolve(c, np.ones(ACCURACY_WINDOW) / ACCURACY_WINDOW, mode="valid") for c in curves])
        x = np.arange(ACCURACY_WINDOW, ACCURACY_WINDOW + smooth.shape[1])
        ax.plot(x, smooth.mean(0), label=name, color=colors.get(name))
        ax.fill_between(x, smooth.min(0), smooth.max(0), alpha=0.2, color=colors.get(name))
    ax.axhline(0.9, ls=":", color="k", lw=0.8)
    ax.set_xlabel("RL iteration (batch 64)")
    ax.set_ylabel(f"accuracy (mean of last {ACCURACY_WINDOW} batches)")
    ax.set_title(f"planted sub-sequence: outcome-only vs PAV (gamma={report['settings']['gamma']:g})")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_iterations.png", dpi=120)
    plt.close(fig)
    files.append("accuracy_vs_iterations.png")
    # 2. accuracy vs gamma
    sweep = report["sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    gammas = [row["gamma"] for row in sweep["rows"]]
    mean = [row["accuracy_mean"] for row in sweep["rows"]]
    low = [row["accuracy_min"] for row in sweep["rows"]]
    high = [row["accuracy_max"] for row in sweep["rows"]]
    ax.plot(gammas, mean, "o-", color="tab:blue", label="PAV")
    ax.fill_between(gammas, low, high, alpha=0.2, color="tab:blue")
    ax.axhline(sweep["outcome_accuracy"], ls="--", color="tab:gray", label="outcome-only")
    ax.set_xscale("log")
    ax.set_xlabel("prover strength gamma (mu_gamma)")
    ax.set_ylabel(f"accuracy after {sweep['accuracy_at']} iterations")
    ax.set_ylim(-0.02, 1.02)
    ax2 = ax.twinx()
    ax2.plot(gammas, [row["mean_abs_progress_base"] for row in sweep["rows"]], "s:", color="tab:orange",
             label="mean |A^mu| on base-policy samples")
    ax2.set_ylabel("mean |A^mu| (base policy)", color="tab:orange")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="center right", fontsize=8)
    ax.set_title("prover sweep")
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_gamma.png", dpi=120)
    plt.close(fig)
    files.append("accuracy_vs_gamma.png")
    # 3. Pass@N
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in report["pass_at_n"]["curves"].items():
        ax.plot(PASS_AT_N_NS, values, "o-", label=name, color=colors.get(name, "k"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N")
    ax.set_ylabel("Pass@N")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"Pass@N after {report['pass_at_n']['iteration']} RL iterations")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(out / "pass_at_n.png", dpi=120)
    plt.close(fig)
    files.append("pass_at_n.png")
    return files


# ------------------------------------------------------------------------------------------------ main
def run_demo(settings: DemoSettings) -> dict[str, Any]:
    """Run every experiment; return the report (also what results.json holds)."""
    from verl_prm.toy.rl import exact_values, import_verl, pass_at_n

    started = time.perf_counter()
    if settings.workers == 1:
        import_verl()  # fails early, with the fix, if the plugin is not registered (workers check it themselves)
    task = PlantedTask(planted=settings.planted)
    gammas = sorted(set(settings.sweep_gammas) | {settings.gamma})
    values_kind = "learned" if settings.learned_critic else "exact"

    critics: dict[float, tuple[dict, dict]] = {}
    if settings.learned_critic:
        jobs = [(_train_critic_job, settings, g) for g in gammas]
        for g, result in zip(gammas, _run_all(settings, jobs, "critics (MC labels + training)", [1] * len(jobs))):
            critics[g] = result

    def spec(method: str, gamma: float, seed: int, iterations: int, kind: str, pass_at=None) -> RunSpec:
        state = critics[gamma][0] if (method == "pav" and kind == "learned") else None
        return RunSpec(method, gamma, seed, iterations, kind, pass_at, state)

    seeds = list(range(settings.seeds))
    sweep_seeds = list(range(settings.sweep_seeds))
    methods = [("outcome-only", "outcome", "exact"), ("PAV", "pav", values_kind)]
    if settings.learned_critic:
        methods.append(("PAV (exact values)", "pav", "exact"))
    specs: list[tuple[str, RunSpec]] = []
    for name, method, kind in methods:
        for seed in seeds:
            specs.append((name, spec(method, settings.gamma, seed, settings.iterations, kind,
                                     settings.pass_at_iteration)))
    # sweep runs; the comparison's PAV runs (same seeds, a prefix of their iterations) serve gamma = --gamma
    for g in gammas:
        if g != settings.gamma:
            for seed in sweep_seeds:
                specs.append((f"sweep:{g}", spec("pav", g, seed, settings.sweep_iterations, values_kind)))
    jobs = [(execute_run, settings, s) for _, s in specs]
    results = _run_all(settings, jobs, "RL runs", [s.iterations for _, s in specs])

    by_name: dict[str, list[tuple[RunSpec, dict]]] = {}
    for (name, s), r in zip(specs, results):
        by_name.setdefault(name, []).append((s, r))

    report: dict[str, Any] = {"settings": {k: v for k, v in asdict(settings).items()}, "paper": PAPER_CLAIMS}
    report["settings"]["planted"] = list(settings.planted)
    report["settings"]["sweep_gammas"] = list(settings.sweep_gammas)
    # ---- comparison
    comparison = {}
    report["curves"] = {}
    for name, _, _ in methods:
        runs = by_name[name]
        hits = [iterations_to_90(r["accuracy"]) for _, r in runs]
        comparison[name] = {
            "iterations_to_90": hits,
            "final_accuracy": [trailing_accuracy(r["accuracy"], settings.iterations) for _, r in runs],
            "pass_successes": [r["pass_successes"] for _, r in runs],
        }
        report["curves"][name] = [r["accuracy"] for _, r in runs]
    report["comparison"] = comparison
    base_successes = [r["base_successes"] for _, r in by_name["outcome-only"]]
    # ---- sweep
    def sweep_runs(g: float) -> list[dict]:
        if g == settings.gamma:
            return [r for s, r in by_name["PAV"] if s.seed in sweep_seeds]
        return [r for _, r in by_name[f"sweep:{g}"]]

    base_policy = _base_policy(settings, task, 0)
    base_samples = base_policy.sample(4096, torch.Generator().manual_seed(4242), task.eos)
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
    report["sweep"] = {"iterations": settings.sweep_iterations, "accuracy_at": settings.sweep_accuracy_at,
                       "rows": rows, "outcome_accuracy": float(np.mean(outcome_sweep)),
                       "outcome_accuracy_at_end": float(np.mean(outcome_end)),
                       "outcome_iterations_to_90": [iterations_to_90(r["accuracy"][: settings.sweep_iterations])
                                                    for r in outcome_runs]}
    # ---- Pass@N: pooled over seeds (each seed's 2,048 samples)
    curves = {"base policy (iteration 0)": np.mean(
        [pass_at_n(PASS_AT_N_SAMPLES, c, PASS_AT_N_NS) for c in base_successes], axis=0).tolist()}
    n50 = {}
    for name, _, _ in methods:
        per_seed = [pass_at_n(PASS_AT_N_SAMPLES, c, PASS_AT_N_NS) for c in comparison[name]["pass_successes"]]
        curves[name] = np.mean(per_seed, axis=0).tolist()
        n50[name] = [n_for_pass(c) for c in comparison[name]["pass_successes"]]
    report["pass_at_n"] = {"iteration": settings.pass_at_iteration, "ns": PASS_AT_N_NS, "curves": curves,
                           "n_for_pass_0.5": n50, "base_successes": base_successes,
                           "samples": PASS_AT_N_SAMPLES}
    report["critics"] = {str(g): q for g, (_, q) in critics.items()}
    report["line"] = sample_efficiency_line(
        comparison["outcome-only"]["iterations_to_90"], comparison["PAV"]["iterations_to_90"], settings.iterations
    )
    report["wall_seconds"] = time.perf_counter() - started
    return report


def _print_report(report: dict[str, Any], settings: DemoSettings, files: list[str], out: Path) -> None:
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


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    # The MLP is tiny: one thread per run is fastest, and makes every run bitwise reproducible.
    torch.set_num_threads(1)
    try:
        report = run_demo(settings)
    finally:
        torch.set_num_threads(previous_threads)
    files = _plots(out, report)
    with open(out / "results.json", "w") as f:
        json.dump(report, f, indent=1, default=float)
    _print_report(report, settings, files, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

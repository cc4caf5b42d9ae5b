"""``verl-prm bench loop``: PAV's cost inside a real verl step, GRPO vs PAV-GRPO side by side on CPU.

Two ``python -m verl.trainer.main_ppo`` runs of the CPU loop (``verl_prm.apps.cpu_loop``: tiny Qwen2 policy
and critic, the launcher's batch), one after the other on the same data, seeds and settings:

- **grpo**: ``algorithm.adv_estimator=grpo`` with ``verl_prm.score_outcome_estimators=false`` (plain GRPO:
  the hook does not call the critic);
- **pav_grpo**: ``algorithm.adv_estimator=pav_grpo`` (the critic scores every step, the PAV estimator runs).

verl's ``timing_s/*`` of each step comes from its file logger; the table shows their means over the steps
after the first (the first includes warm-up) for both runs, with the ratio PAV-GRPO / GRPO, and PAV's phases as
a share of PAV-GRPO's step: ``timing_s/adv`` (the advantage phase, which contains the critic call
``timing_s/pav_critic``). Target: advantage phase (critic included) <= 10% of a step. verl 0.9.1's sync trainer
polls its replay buffer for finished rollouts every 2.0 s, so ``timing_s/gen`` is at least 2.0 s however fast the
generation is; the share of the step without ``gen`` is printed as well.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from verl_prm.cli_types import finite_float
from verl_prm.apps.cpu_loop import LoopSize, main_ppo_args, prepare, run_main_ppo

TARGET_PAV_SHARE = 0.10
PHASES = ("gen", "old_log_prob", "pav_critic", "adv", "update_actor", "update_weights", "step")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm bench loop", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--steps", type=int, default=5, help="training steps per run (the first is not averaged)")
    p.add_argument("--work-dir", default=None, help="model, data, logs (default: a temporary directory)")
    p.add_argument("--timeout", type=finite_float(0.0, low_open=True), default=900, help="seconds per main_ppo run")
    p.add_argument("--check", action="store_true", help="exit with 1 when the target is missed")
    return p


def phase_means(metrics: list[dict], skip_first: bool = True) -> dict[str, float]:
    """Mean of each ``timing_s/<phase>`` over the logged steps (without the first when there are others)."""
    records = [m["data"] for m in sorted(metrics, key=lambda m: m["step"])]
    if skip_first and len(records) > 1:
        records = records[1:]
    means = {}
    for phase in PHASES:
        values = [r[f"timing_s/{phase}"] for r in records if f"timing_s/{phase}" in r]
        if values:
            means[phase] = statistics.fmean(values)
    return means


def table(grpo: dict[str, float], pav: dict[str, float]) -> str:
    lines = [f"{'phase':<16}{'grpo s':>10}{'pav_grpo s':>12}{'pav/grpo':>10}{'share of pav step':>19}",
             "-" * 67]
    for phase in PHASES:
        if phase not in grpo and phase not in pav:
            continue
        g, p = grpo.get(phase), pav.get(phase)
        ratio = f"{p / g:.2f}" if g and p is not None else "-"
        share = f"{p / pav['step']:.1%}" if p is not None and pav.get("step") else "-"
        g_text = f"{g:.3f}" if g is not None else "-"
        p_text = f"{p:.3f}" if p is not None else "-"
        lines.append(f"{phase:<16}{g_text:>10}{p_text:>12}{ratio:>10}{share:>19}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="verl_prm_bench_loop_"))
    size = LoopSize()
    prepare(work, size)
    runs = {
        "grpo": ["verl_prm.score_outcome_estimators=false"],
        "pav_grpo": [],
    }
    means = {}
    for estimator, extra in runs.items():
        name = f"bench_{estimator}"
        print(f"running main_ppo {estimator} for {args.steps} steps (log: {work / (name + '.log')}) ...", flush=True)
        result = run_main_ppo(main_ppo_args(work, estimator, steps=args.steps, run_name=name, size=size, extra=extra),
                              work / f"{name}.jsonl", work / f"{name}.log", timeout=args.timeout)
        if result.returncode != 0 or len(result.metrics) != args.steps:
            print(f"main_ppo {estimator} failed (exit {result.returncode}, {len(result.metrics)} of {args.steps} "
                  f"steps logged); last lines of {result.log_path}:\n{result.tail()}")
            return 1
        means[estimator] = phase_means(result.metrics)
        print(f"  {estimator}: {result.seconds:.0f} s wall, mean step {means[estimator]['step']:.2f} s, peak resident "
              f"memory {result.peak_rss_gib:.1f} GiB over {result.peak_processes} processes", flush=True)
    batch = size.prompts_per_step * size.responses_per_prompt
    print(f"\nverl main_ppo on CPU, batch {size.prompts_per_step} prompts x {size.responses_per_prompt} responses "
          f"= {batch}, up to {size.max_response_length} response tokens; means over steps 2..{args.steps}\n")
    print(table(means["grpo"], means["pav_grpo"]))
    pav = means["pav_grpo"]
    share = pav.get("adv", 0.0) / pav["step"]
    status = "met" if share <= TARGET_PAV_SHARE else "MISSED"
    print(f"\nPAV phases (advantage phase incl. critic) = {share:.1%} of a PAV-GRPO step "
          f"(target <= {TARGET_PAV_SHARE:.0%}: {status}); critic alone {pav.get('pav_critic', 0.0) / pav['step']:.1%}")
    # verl 0.9.1's sync trainer waits for rollouts by polling its replay buffer every 2.0 s (ReplayBuffer.poll_interval),
    # so timing_s/gen is at least 2.0 s whatever the generation costs: the share of the rest of the step as well
    rest = pav["step"] - pav.get("gen", 0.0)
    if rest > 0:
        print(f"share of the step without timing_s/gen (>= 2.0 s: verl's replay-buffer poll): "
              f"{pav.get('adv', 0.0) / rest:.1%} ({pav.get('adv', 0.0):.3f} s of {rest:.3f} s)")
    return 1 if args.check and share > TARGET_PAV_SHARE else 0

"""``verl-prm bench loop``: PAV's cost inside a real verl step, GRPO vs PAV-GRPO (learned and sampled critic) on CPU.

Three ``python -m verl.trainer.main_ppo`` runs of the CPU loop (``verl_prm.apps.cpu_loop``: tiny Qwen2 policy
and critic, the launcher's batch), one after the other on the same data, seeds, reward and settings:

- **grpo**: ``algorithm.adv_estimator=grpo`` with ``verl_prm.score_outcome_estimators=false`` (plain GRPO:
  the hook does not call the critic);
- **pav_grpo**: ``algorithm.adv_estimator=pav_grpo`` with the learned critic (``value_head``: the critic scores
  every step, the PAV estimator runs);
- **sampled**: ``pav_grpo`` with ``verl_prm.critic.source=sampled`` (Monte-Carlo step values: ``n_mc``
  continuations per step prefix from the run's own rollout replicas, ``timing_s/pav_mc``);
- **tree**: ``pav_grpo`` with ``verl_prm.critic.source=tree`` (each group of n responses sampled as a tree of
  ``--tree-roots`` roots and branches of ``--tree-width`` continuations; the node values come from the leaves:
  nothing is sampled beyond the group).

The reward of all three is ``parity_score`` of this module (1 for a response of even length): the untrained
policy never solves the CPU loop's arithmetic task, so with its reward every sampled value would be 0; this one
it meets about half the time, so the sampled values and the advantages vary as in a real run.

verl's ``timing_s/*`` of each step comes from its file logger; the table shows their means over the steps
after the first (the first includes warm-up) for each run, the ratio to GRPO, and the phases as a share of each
PAV run's step: ``timing_s/adv`` (the advantage phase, which contains the critic call ``timing_s/pav_critic``,
which with the sampled critic is ``timing_s/pav_mc``: wake-up, sampling, scoring, sleep). Target (learned critic):
advantage phase (critic included) <= 10% of a step. For the sampled arm it prints the continuation tokens per step
(``pav/mc_tokens``) and their ratio to the batch's response tokens (``pav/mc_token_ratio``); for the tree arm
the tokens generated per step (roots, branches) against the tokens trained (``pav/tree_*``; a GRPO step
generates every token it trains on). verl 0.9.1's sync
trainer polls its replay buffer for finished rollouts every 2.0 s, so ``timing_s/gen`` is at least 2.0 s however
fast the generation is; the share of the step without ``gen`` is printed as well.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from verl_prm.choices import PREFIX_RULES
from verl_prm.cli_types import finite_float
from verl_prm.apps.cpu_loop import LoopSize, main_ppo_args, prepare, run_main_ppo

TARGET_PAV_SHARE = 0.10
PHASES = ("gen", "old_log_prob", "pav_critic", "pav_mc", "adv", "update_actor", "update_weights", "step")
ARMS = ("grpo", "pav_grpo", "sampled", "tree")
MC_METRICS = ("pav/mc_tokens", "pav/mc_token_ratio", "pav/mc_continuations", "pav/mc_prefixes_evaluated",
              "pav/mc_prefixes_skipped", "response_length/mean")
TREE_METRICS = ("pav/tree_generated_tokens", "pav/tree_root_tokens", "pav/tree_branch_tokens",
                "pav/tree_trained_tokens", "pav/tree_generated_share", "pav/tree_fallback_groups")


def parity_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The bench's reward (``reward.custom_reward_function``): 1.0 iff the decoded response has an even number of
    characters, which an untrained policy meets about half the time (module docstring)."""
    return float(len(solution_str) % 2 == 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm bench loop", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--steps", type=int, default=5, help="training steps per run (the first is not averaged)")
    p.add_argument("--n-mc", type=int, default=4, help="sampled arm: verl_prm.critic.n_mc (continuations per prefix)")
    p.add_argument("--prefix-rule", choices=PREFIX_RULES, default="every",
                   help="sampled arm: verl_prm.critic.prefix_rule (which step prefixes are sampled)")
    p.add_argument("--tree-roots", type=int, default=2, help="tree arm: verl_prm.tree.roots (of the 4 responses)")
    p.add_argument("--tree-width", type=int, default=2, help="tree arm: verl_prm.tree.branch_width")
    p.add_argument("--work-dir", default=None, help="model, data, logs (default: a temporary directory)")
    p.add_argument("--timeout", type=finite_float(0.0, low_open=True), default=900, help="seconds per main_ppo run")
    p.add_argument("--check", action="store_true", help="exit with 1 when the learned critic's target is missed")
    return p


def arm_overrides(arm: str, n_mc: int = 4, prefix_rule: str = "every", tree_roots: int = 2,
                  tree_width: int = 2) -> tuple[str, list[str]]:
    """The estimator and the ``main_ppo`` overrides (beyond ``main_ppo_args``') of one arm of the bench."""
    reward = [f"reward.custom_reward_function.path={Path(__file__).resolve()}",
              "reward.custom_reward_function.name=parity_score"]
    if arm == "grpo":
        return "grpo", ["verl_prm.score_outcome_estimators=false", *reward]
    if arm == "pav_grpo":
        return "pav_grpo", reward
    if arm == "sampled":
        return "pav_grpo", ["verl_prm.critic.source=sampled", "verl_prm.critic.path=null",
                            f"verl_prm.critic.n_mc={n_mc}", f"verl_prm.critic.prefix_rule={prefix_rule}", *reward]
    if arm == "tree":
        return "pav_grpo", ["verl_prm.critic.source=tree", "verl_prm.critic.path=null",
                            f"verl_prm.tree.roots={tree_roots}", f"verl_prm.tree.branch_width={tree_width}", *reward]
    raise ValueError(f"unknown bench loop arm {arm!r}: use one of {ARMS}")


def metric_means(metrics: list[dict], keys, skip_first: bool = True) -> dict[str, float]:
    """Mean of each metric of ``keys`` over the logged steps (without the first when there are others); a metric
    no step logged is left out."""
    records = [m["data"] for m in sorted(metrics, key=lambda m: m["step"])]
    if skip_first and len(records) > 1:
        records = records[1:]
    means = {}
    for key in keys:
        values = [r[key] for r in records if key in r]
        if values:
            means[key] = statistics.fmean(values)
    return means


def phase_means(metrics: list[dict], skip_first: bool = True) -> dict[str, float]:
    """Mean of each ``timing_s/<phase>`` over the logged steps (without the first when there are others)."""
    means = metric_means(metrics, [f"timing_s/{phase}" for phase in PHASES], skip_first)
    return {key.removeprefix("timing_s/"): value for key, value in means.items()}


def table(means: dict[str, dict[str, float]], baseline: str = "grpo") -> str:
    """Phase seconds of each arm (``means``: arm -> phase means), each other arm's ratio to ``baseline`` and
    each other arm's phases as a share of its step."""
    others = [arm for arm in means if arm != baseline]
    columns = ([f"{arm} s" for arm in means] + [f"{arm}/{baseline}" for arm in others]
               + [f"share {arm}" for arm in others])
    widths = [max(12, len(c) + 2) for c in columns]
    lines = [f"{'phase':<16}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths))]
    lines.append("-" * len(lines[0]))
    base = means.get(baseline, {})
    for phase in PHASES:
        if not any(phase in m for m in means.values()):
            continue
        cells = [f"{m[phase]:.3f}" if phase in m else "-" for m in means.values()]
        for arm in others:
            value = means[arm].get(phase)
            cells.append(f"{value / base[phase]:.2f}" if value is not None and base.get(phase) else "-")
        for arm in others:
            value, step = means[arm].get(phase), means[arm].get("step")
            cells.append(f"{value / step:.1%}" if value is not None and step else "-")
        lines.append(f"{phase:<16}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    return "\n".join(lines)


def sampled_summary(phases: dict[str, float], mc: dict[str, float], batch: int) -> str:
    """The sampled arm's cost: ``timing_s/pav_mc`` as a share of its step, the continuation tokens per step and
    their ratio to the batch's response tokens (``mc``: means of ``MC_METRICS``; ``batch``: responses per step)."""
    step = phases["step"]
    response_tokens = mc.get("response_length/mean", 0.0) * batch
    return (f"sampled critic: timing_s/pav_mc = {phases.get('pav_mc', 0.0) / step:.1%} of a step "
            f"({phases.get('pav_mc', 0.0):.3f} s of {step:.3f} s; advantage phase incl. sampling "
            f"{phases.get('adv', 0.0) / step:.1%}); per step {mc.get('pav/mc_tokens', 0.0):.0f} continuation tokens "
            f"({mc.get('pav/mc_continuations', 0.0):.0f} continuations of {mc.get('pav/mc_prefixes_evaluated', 0.0):.0f} "
            f"prefixes, {mc.get('pav/mc_prefixes_skipped', 0.0):.0f} refused by the budget) for {response_tokens:.0f} "
            f"response tokens: pav/mc_token_ratio {mc.get('pav/mc_token_ratio', 0.0):.2f}")


def tree_summary(phases: dict[str, float], tree: dict[str, float]) -> str:
    """The tree arm's cost (``tree``: means of ``TREE_METRICS``): tokens generated per step against tokens trained
    (a GRPO step with the same n generates every token it trains on)."""
    return (f"tree groups: per step {tree.get('pav/tree_generated_tokens', 0.0):.0f} generated tokens "
            f"({tree.get('pav/tree_root_tokens', 0.0):.0f} roots, {tree.get('pav/tree_branch_tokens', 0.0):.0f} "
            f"branches) for {tree.get('pav/tree_trained_tokens', 0.0):.0f} trained: "
            f"{tree.get('pav/tree_generated_share', 0.0):.2f} of a GRPO step's generation; "
            f"{tree.get('pav/tree_fallback_groups', 0.0):.1f} groups fell back to extra roots; timing_s/gen "
            f"{phases.get('gen', 0.0):.3f} s of a {phases['step']:.3f} s step")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--n-mc", args.n_mc), ("--tree-roots", args.tree_roots),
                        ("--tree-width", args.tree_width)):
        if value < 1:
            parser.error(f"argument {flag}: must be >= 1, got {value}")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="verl_prm_bench_loop_"))
    size = LoopSize()
    prepare(work, size)
    means, mc, tree = {}, {}, {}
    for arm in ARMS:
        estimator, extra = arm_overrides(arm, args.n_mc, args.prefix_rule, args.tree_roots, args.tree_width)
        name = f"bench_{arm}"
        print(f"running main_ppo {arm} for {args.steps} steps (log: {work / (name + '.log')}) ...", flush=True)
        result = run_main_ppo(main_ppo_args(work, estimator, steps=args.steps, run_name=name, size=size, extra=extra),
                              work / f"{name}.jsonl", work / f"{name}.log", timeout=args.timeout)
        if result.returncode != 0 or len(result.metrics) != args.steps:
            print(f"main_ppo {arm} failed (exit {result.returncode}, {len(result.metrics)} of {args.steps} "
                  f"steps logged); last lines of {result.log_path}:\n{result.tail()}")
            return 1
        means[arm] = phase_means(result.metrics)
        if arm == "sampled":
            mc = metric_means(result.metrics, MC_METRICS)
        if arm == "tree":
            tree = metric_means(result.metrics, TREE_METRICS)
        print(f"  {arm}: {result.seconds:.0f} s wall, mean step {means[arm]['step']:.2f} s, peak resident "
              f"memory {result.peak_rss_gib:.1f} GiB over {result.peak_processes} processes", flush=True)
    batch = size.prompts_per_step * size.responses_per_prompt
    print(f"\nverl main_ppo on CPU, batch {size.prompts_per_step} prompts x {size.responses_per_prompt} responses "
          f"= {batch}, up to {size.max_response_length} response tokens; sampled arm n_mc={args.n_mc}, "
          f"prefix_rule={args.prefix_rule}; means over steps 2..{args.steps}\n")
    print(table(means))
    pav = means["pav_grpo"]
    share = pav.get("adv", 0.0) / pav["step"]
    status = "met" if share <= TARGET_PAV_SHARE else "MISSED"
    print(f"\nlearned critic: PAV phases (advantage phase incl. critic) = {share:.1%} of a PAV-GRPO step "
          f"(target <= {TARGET_PAV_SHARE:.0%}: {status}); critic alone {pav.get('pav_critic', 0.0) / pav['step']:.1%}")
    # verl 0.9.1's sync trainer waits for rollouts by polling its replay buffer every 2.0 s (ReplayBuffer.poll_interval),
    # so timing_s/gen is at least 2.0 s whatever the generation costs: the share of the rest of the step as well
    rest = pav["step"] - pav.get("gen", 0.0)
    if rest > 0:
        print(f"share of the step without timing_s/gen (>= 2.0 s: verl's replay-buffer poll): "
              f"{pav.get('adv', 0.0) / rest:.1%} ({pav.get('adv', 0.0):.3f} s of {rest:.3f} s)")
    print(sampled_summary(means["sampled"], mc, batch))
    print(tree_summary(means["tree"], tree))
    return 1 if args.check and share > TARGET_PAV_SHARE else 0

"""Evaluation stage of the arithmetic recipe: policies, the critic's step AUROC, search, the table and plots.

- **Policies** (base SFT, GRPO, PAV-GRPO): sampled accuracy (temperature 1, the policy RL trains) on held-out
  problems, ``samples`` samples each, with the same seeds for every policy.
- **Critic**: AUROC of its raw value after each step for "every step so far is right" (the truth, from
  ``task.prefix_is_correct``) on base-policy samples of held-out problems. This is the step-level detection
  of slips by a critic that was trained on Monte-Carlo labels only.
- **Search** with the base policy (``verl_prm.search``): best-of-N re-ranked by the critic's final value (an
  outcome verifier), and the PAV paper's beam search on ``Q + alpha * A`` (Q: the critic; A: progress of its
  Best-of-K prover). Compute is the mean number of generated tokens per problem.
- **Sample efficiency** of each PAV-GRPO arm against GRPO from the seed-mean evaluation curves of verl's runs:
  the steps at which the arm reaches GRPO's final held-out accuracy, against the steps GRPO itself needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from verl_prm.apps.arithmetic.task import DATA_SOURCE, STEP_REGEX, Problem, compute_score, prefix_is_correct

__all__ = ["steps_to_reach", "mean_curve", "summarise_arms", "critic_step_auroc", "search_sweep", "write_table",
           "plot_all", "learned_prefix_critic", "exact_prefix_critic"]


def steps_to_reach(curve: Sequence[tuple[int, int, float]], target: float) -> float | None:
    """Steps at which a held-out accuracy curve ((step, samples, accuracy) rows, by step) first reaches
    ``target``, interpolated linearly between the two evaluations around the crossing; None if it never does."""
    previous = None
    for step, _, accuracy in curve:
        if accuracy >= target - 1e-12:
            if previous is None or previous[1] >= accuracy:
                return float(step)
            (s0, a0), (s1, a1) = previous, (step, accuracy)
            return float(s0 + (target - a0) / (a1 - a0) * (s1 - s0))
        previous = (step, accuracy)
    return None


def mean_curve(curves: Sequence[Sequence[tuple[int, int, float]]]) -> tuple[list[tuple[int, int, float]], list[float]]:
    """The mean curve over seeds and the standard error at each evaluation step (the steps every seed has)."""
    by_step = [dict((int(c[0]), (int(c[1]), float(c[2]))) for c in curve) for curve in curves]
    steps = sorted(set.intersection(*(set(d) for d in by_step)))
    mean, se = [], []
    for step in steps:
        values = np.array([d[step][1] for d in by_step])
        mean.append((step, by_step[0][step][0], float(values.mean())))
        se.append(float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan"))
    return mean, se


def _speedup(reference_curves, arm_curves) -> tuple[float | None, float | None, float | None, float]:
    """(target, reference steps, arm steps, ratio) on the seed-mean curves; the target is the reference's mean
    final held-out accuracy. The ratio is inf when the arm starts at the target, nan when it never gets there."""
    target = float(np.mean([c[-1][2] for c in reference_curves]))
    ref_steps = steps_to_reach(mean_curve(reference_curves)[0], target)
    arm_steps = steps_to_reach(mean_curve(arm_curves)[0], target)
    if ref_steps is None or arm_steps is None:
        ratio = float("nan")
    else:
        ratio = float("inf") if arm_steps == 0 else ref_steps / arm_steps
    return target, ref_steps, arm_steps, ratio


def summarise_arms(runs: dict, reference: str = "grpo", bootstrap: int = 2000) -> dict:
    """Per arm over its seeds: the mean curve and its standard error, the final accuracy of the trained policies
    (mean and standard error), and the sample-efficiency ratio against ``reference``: the steps the reference
    needs to reach its own final held-out accuracy over the steps the arm needs (seed-mean curves, interpolated).
    Its standard error is the standard deviation over a bootstrap of the seeds (each arm resampled), over the
    resamples where both reach the target; ``never_share`` is the share of resamples where the arm does not."""
    rng = np.random.default_rng(0)
    out = {}
    reference_curves = [runs[reference][seed]["curve"] for seed in sorted(runs[reference])] if reference in runs else None
    for arm, seeds in runs.items():
        curves = [seeds[seed]["curve"] for seed in sorted(seeds)]
        mean, se = mean_curve(curves)
        finals = np.array([seeds[seed]["final"]["accuracy"] for seed in sorted(seeds)])
        zero = [np.mean([t["zero_signal_groups"] for t in seeds[seed]["training"]]) for seed in sorted(seeds)
                if seeds[seed]["training"]]
        summary = {"seeds": sorted(seeds), "curve": mean, "curve_se": se,
                   "final_accuracy": float(finals.mean()),
                   "final_accuracy_se": float(finals.std(ddof=1) / np.sqrt(len(finals))) if len(finals) > 1 else float("nan"),
                   "final_accuracy_by_seed": finals.tolist(),
                   "zero_signal_groups": float(np.mean(zero)) if zero else float("nan")}
        if reference_curves is not None:
            target, ref_steps, arm_steps, ratio = _speedup(reference_curves, curves)
            ratios, never = [], 0
            for _ in range(bootstrap):
                ref_sample = [reference_curves[i] for i in rng.integers(0, len(reference_curves), len(reference_curves))]
                arm_sample = [curves[i] for i in rng.integers(0, len(curves), len(curves))]
                r = _speedup(ref_sample, arm_sample)[3]
                if np.isnan(r):
                    never += 1
                elif np.isfinite(r):
                    ratios.append(r)
            summary.update({"target_accuracy": target, "reference_steps_to_target": ref_steps,
                            "steps_to_target": arm_steps, "speedup": ratio,
                            "speedup_se": float(np.std(ratios, ddof=1)) if len(ratios) > 1 else float("nan"),
                            "speedup_never_share": never / bootstrap})
        out[arm] = summary
    return out


def critic_step_auroc(critic, tokenizer, model, prompt_texts: Sequence[str], problems: Sequence[Problem], *,
                      samples: int, max_new_tokens: int, seed: int) -> dict:
    """AUROC of the critic's value after each step against the truth of the prefix (all lines right so far)."""
    from verl_prm.apps.arithmetic.batch import step_tensors
    from verl_prm.apps.arithmetic.rollout import sample
    from verl_prm.training.metrics import auroc

    rollouts = sample(model, tokenizer, prompt_texts, samples, max_new_tokens=max_new_tokens, seed=seed)
    tensors, split = step_tensors(critic, rollouts, tokenizer, return_split=True)
    scores, labels = [], []
    first_wrong_drop = []
    for row, (text, index) in enumerate(zip(rollouts.texts, rollouts.prompt_index)):
        H = int(tensors["num_steps"][row])
        ends = split.step_char_ends[row, :H].tolist()
        truth = [prefix_is_correct(problems[index], text[:end], complete=h == H - 1) for h, end in enumerate(ends)]
        values = tensors["step_values"][row, :H].tolist()
        scores += values
        labels += truth
        if False in truth:  # the value drop at the first wrong step
            h = truth.index(False)
            before = float(tensors["prompt_values"][row]) if h == 0 else values[h - 1]
            first_wrong_drop.append(before - values[h])
    return {"step_auroc": auroc(np.array(scores), np.array(labels)), "steps_scored": len(scores),
            "wrong_step_share": float(1 - np.mean(labels)) if labels else float("nan"),
            "mean_value_drop_at_first_wrong_step": float(np.mean(first_wrong_drop)) if first_wrong_drop else float("nan")}


def learned_prefix_critic(critic, prompt_texts: Sequence[str]):
    """A ``ProverCritic`` as the search's prefix critic (``verl_prm.search.generation.TextCritic``)."""
    from verl_prm.search.generation import TextCritic

    return TextCritic(critic, prompt_texts)


def exact_prefix_critic(prover, prompt_texts: Sequence[str]):
    """The exact prover as the search's prefix critic (``verl_prm.critic.exact.ExactPrefixCritic``)."""
    from verl_prm.critic.exact import ExactPrefixCritic

    return ExactPrefixCritic(prover, prompt_texts)


def search_sweep(model, tokenizer, prefix_critic, prompt_texts: Sequence[str], problems: Sequence[Problem], *,
                 best_of_n: Sequence[int], beam_widths: Sequence[int], samples_per_beam: int, alpha: float,
                 best_of_k: int, max_new_tokens: int, max_steps: int, seed: int) -> list[dict]:
    """Best-of-N (the critic's final value as the ranker) and PAV beam search (Q and A from the same critic)
    with the base policy; one row per (method, N): accuracy and mean generated / critic tokens per problem.
    Each search run gets a fresh cache, so its critic tokens are its own."""
    from verl_prm.search import BeamConfig, BestOfNConfig, CachedCritic, beam_search, best_of_n as run_best_of_n
    from verl_prm.search.generation import HFStepSampler

    sampler = HFStepSampler(model, tokenizer, list(prompt_texts), delimiter=None, regex=STEP_REGEX, max_step_tokens=24,
                            max_response_tokens=max_new_tokens, temperature=1.0, batch_size=512)
    ids = list(range(len(problems)))
    rows = []

    def record(method: str, n: int, results) -> None:
        correct = [compute_score(DATA_SOURCE, "".join(r.node.steps), problems[r.problem].answer) for r in results]
        rows.append({"method": method, "n": n, "accuracy": float(np.mean(correct)),
                     "accuracy_se": float(np.std(correct, ddof=1) / np.sqrt(len(correct))) if len(correct) > 1 else float("nan"),
                     "generated_tokens": float(np.mean([r.compute.generated_tokens for r in results])),
                     "critic_tokens": float(np.mean([r.compute.critic_tokens for r in results]))})

    for n in best_of_n:
        results = run_best_of_n(ids, sampler, CachedCritic(prefix_critic), BestOfNConfig(n=n, rank="orm", seed=seed))
        record("best_of_n", n, results)
    for n in beam_widths:
        config = BeamConfig(beam_width=n, samples_per_beam=samples_per_beam, alpha=alpha, best_of_k=best_of_k,
                            max_steps=max_steps, seed=seed)
        results = beam_search(ids, sampler, CachedCritic(prefix_critic), None, config)
        record("beam_pav", n, results)
    return rows


ARM_LABELS = {"grpo": "GRPO (outcome only)", "pav_exact": "PAV-GRPO, exact prover",
              "pav_learned": "PAV-GRPO, learned PAV"}


def _pm(value: float, se: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}" if se is None or np.isnan(se) else f"{value:.{digits}f} ± {se:.{digits}f}"


def write_table(results: dict, path_md: str | Path, path_json: str | Path) -> str:
    """The results as markdown (returned and written) and JSON."""
    Path(path_json).write_text(json.dumps(results, indent=2))
    arms, prover = results["arms"], results["prover"]
    lines = [
        f"SFT policy (label prompts, {prover['group_size']} samples each): success {prover['success']:.3f}, "
        f"groups with no outcome signal {prover['zero_signal_groups']:.3f} (all wrong: {prover['all_fail_groups']:.3f}), "
        f"per-step accuracy p = {prover['step_accuracy']:.3f} (the exact prover's p).",
        "",
        "| policy | seeds | final accuracy (T=1, test) | held-out accuracy at the last RL step | steps to GRPO's final "
        "accuracy | sample efficiency vs GRPO | groups with no outcome signal (mean over steps) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| SFT base | - | {results['policies']['base']['accuracy']:.3f} | - | - | - | - |",
    ]
    for arm, summary in arms.items():
        steps = summary.get("steps_to_target")
        ratio = summary.get("speedup", float("nan"))
        if ratio is None or np.isnan(ratio):
            speed = f"never reached ({summary.get('speedup_never_share', float('nan')):.0%} of bootstraps)"
        else:
            speed = f"{_pm(ratio, summary.get('speedup_se'), 2)}x"
            if summary.get("speedup_never_share"):
                speed += f" (never in {summary['speedup_never_share']:.0%} of bootstraps)"
        lines.append(
            f"| {ARM_LABELS.get(arm, arm)} | {len(summary['seeds'])} | "
            f"{_pm(summary['final_accuracy'], summary['final_accuracy_se'])} | "
            f"{_pm(summary['curve'][-1][2], summary['curve_se'][-1])} | "
            f"{'never' if steps is None else f'{steps:.1f}'} | {speed} | {summary['zero_signal_groups']:.3f} |")
    target = next((s["target_accuracy"] for s in arms.values() if "target_accuracy" in s), float("nan"))
    critic = results["critic"]
    lines += [
        "",
        f"Target: GRPO's mean held-out accuracy at its last RL step, {target:.3f}. Mean ± standard error over seeds; "
        "the sample-efficiency ratio is GRPO's steps to the target over the arm's (seed-mean curves, interpolated "
        "between evaluations), its error from a bootstrap over seeds.",
        "",
        f"Learned PAV: held-out label AUROC {critic['label_auroc']:.3f}; step AUROC against the true prefix "
        f"correctness {critic['step_auroc']:.3f} on {critic['steps_scored']} steps of base-policy samples "
        f"({critic['wrong_step_share']:.1%} of them wrong); mean value drop at the first wrong step "
        f"{critic['mean_value_drop_at_first_wrong_step']:.3f}.",
        "",
        "| search (base policy) | critic | N | accuracy | generated tokens / problem | critic tokens / problem |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for critic_name, rows in results["search"].items():
        for row in rows:
            lines.append(f"| {row['method']} | {critic_name} | {row['n']} | {_pm(row['accuracy'], row.get('accuracy_se'))} | "
                         f"{row['generated_tokens']:.1f} | {row['critic_tokens']:.1f} |")
    text = "\n".join(lines) + "\n"
    Path(path_md).write_text(text)
    return text


def plot_all(results: dict, output_dir: str | Path) -> list[str]:
    """PNGs: held-out accuracy against RL steps and against sampled responses (seed mean ± standard error), the
    share of groups with no outcome signal per step, and search accuracy against generated tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    paths = []
    arms = results["arms"]
    target = next((s["target_accuracy"] for s in arms.values() if "target_accuracy" in s), None)
    for column, name, xlabel in ((0, "accuracy_vs_rl_steps.png", "RL steps"),
                                 (1, "accuracy_vs_rl_samples.png", "sampled responses (RL)")):
        figure, axis = plt.subplots(figsize=(6.4, 4.2))
        for arm, summary in arms.items():
            x = np.array([c[column] for c in summary["curve"]])
            y = np.array([c[2] for c in summary["curve"]])
            se = np.nan_to_num(np.array(summary["curve_se"]))
            axis.plot(x, y, marker="o", markersize=3, label=f"{ARM_LABELS.get(arm, arm)} ({len(summary['seeds'])} seeds)")
            axis.fill_between(x, y - se, y + se, alpha=0.2)
        if target is not None:
            axis.axhline(target, color="gray", linestyle=":", linewidth=1, label="GRPO's final accuracy")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("held-out accuracy (T=1), mean ± s.e.")
        axis.set_title("arithmetic recipe on verl's main_ppo: GRPO vs PAV-GRPO", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
        figure.tight_layout()
        figure.savefig(output_dir / name, dpi=120)
        plt.close(figure)
        paths.append(str(output_dir / name))
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for arm, seeds in results["runs"].items():
        steps = sorted({t["step"] for s in seeds.values() for t in s["training"]})
        per_step = [np.mean([t["zero_signal_groups"] for s in seeds.values() for t in s["training"] if t["step"] == step])
                    for step in steps]
        axis.plot(steps, per_step, label=ARM_LABELS.get(arm, arm))
    axis.set_xlabel("RL step")
    axis.set_ylabel("share of prompt groups with no outcome signal")
    axis.set_title("groups whose samples all fail or all succeed (GRPO advantage 0)", fontsize=9)
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(output_dir / "zero_signal_groups.png", dpi=120)
    plt.close(figure)
    paths.append(str(output_dir / "zero_signal_groups.png"))
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for critic_name, rows_all in results["search"].items():
        for method, label in (("best_of_n", "best-of-N"), ("beam_pav", "beam on Q + alpha*A")):
            rows = sorted((r["generated_tokens"], r["accuracy"], r["n"]) for r in rows_all if r["method"] == method)
            if rows:
                axis.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=f"{label}, {critic_name} critic",
                          linestyle="-" if critic_name == "exact" else "--")
                for x, y, n in rows:
                    axis.annotate(str(n), (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
    base = results["policies"]["base"]
    axis.scatter([base["response_tokens"]], [base["accuracy"]], marker="s", label="SFT base, 1 sample", zorder=3)
    axis.set_xscale("log")
    axis.set_xlabel("generated tokens per problem (log scale)")
    axis.set_ylabel("held-out accuracy")
    axis.set_title("test-time search with the base policy", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    figure.tight_layout()
    figure.savefig(output_dir / "search_accuracy_vs_compute.png", dpi=120)
    plt.close(figure)
    paths.append(str(output_dir / "search_accuracy_vs_compute.png"))
    return paths


def policy_accuracy(path: str | Path, prompt_texts_of, problems: Sequence[Problem], *, samples: int,
                    max_new_tokens: int, seed: int, device: str = "cpu") -> dict:
    """Sampled accuracy and mean response tokens of the policy at ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.apps.arithmetic.batch import outcome_rewards
    from verl_prm.apps.arithmetic.rollout import sample

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False)
    model = model.to(device).eval()
    rollouts = sample(model, tokenizer, prompt_texts_of(tokenizer), samples, max_new_tokens=max_new_tokens, seed=seed)
    rewards = outcome_rewards(rollouts, problems)
    return {"accuracy": float(rewards.mean()), "response_tokens": float(rollouts.response_mask.sum(dim=1).mean()),
            "samples_per_problem": samples}

"""Evaluation stage of the arithmetic recipe: policies, the critic's step AUROC, search, the table and plots.

- **Policies** (base SFT, GRPO, PAV-GRPO): sampled accuracy (temperature 1, the policy RL trains) on held-out
  problems, ``samples`` samples each, with the same seeds for every policy.
- **Critic**: AUROC of its raw value after each step for "every step so far is right" (the truth, from
  ``task.prefix_is_correct``) on base-policy samples of held-out problems. This is the step-level detection
  of slips by a critic that was trained on Monte-Carlo labels only.
- **Search** with the base policy (``verl_prm.search``): best-of-N re-ranked by the critic's final value (an
  outcome verifier), and the PAV paper's beam search on ``Q + alpha * A`` (Q: the critic; A: progress of its
  Best-of-K prover). Compute is the mean number of generated tokens per problem.
- **Sample efficiency** of PAV-GRPO against GRPO from the evaluation curves: the first evaluation step at which
  PAV-GRPO reaches GRPO's final accuracy, against the first step at which GRPO itself does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from verl_prm.recipes.arithmetic.task import DATA_SOURCE, STEP_REGEX, Problem, compute_score, prefix_is_correct

__all__ = ["steps_to_reach", "sample_efficiency", "critic_step_auroc", "search_sweep", "write_table", "plot_all"]


def steps_to_reach(curve: Sequence[tuple[int, int, float]], target: float) -> int | None:
    """First evaluation step whose accuracy is >= ``target`` (curve: (step, samples, accuracy) rows); None if never."""
    for step, _, accuracy in curve:
        if accuracy >= target - 1e-12:
            return int(step)
    return None


def sample_efficiency(grpo_curve, pav_curve) -> dict:
    """Steps (and samples) each run needs to reach GRPO's final accuracy, and their ratio (GRPO / PAV-GRPO).

    A ratio > 1 means PAV-GRPO got there in fewer steps. When PAV-GRPO never reaches it the ratio is None.
    """
    target = float(grpo_curve[-1][2])
    grpo_steps, pav_steps = steps_to_reach(grpo_curve, target), steps_to_reach(pav_curve, target)
    per_step = grpo_curve[-1][1] / max(grpo_curve[-1][0], 1)
    ratio = None
    if pav_steps is not None and grpo_steps is not None:
        ratio = grpo_steps / pav_steps if pav_steps > 0 else float("inf")
    return {"target_accuracy": target, "grpo_steps_to_target": grpo_steps, "pav_grpo_steps_to_target": pav_steps,
            "grpo_samples_to_target": None if grpo_steps is None else int(grpo_steps * per_step),
            "pav_grpo_samples_to_target": None if pav_steps is None else int(pav_steps * per_step),
            "speedup": ratio}


def critic_step_auroc(critic, tokenizer, model, prompt_texts: Sequence[str], problems: Sequence[Problem], *,
                      samples: int, max_new_tokens: int, seed: int) -> dict:
    """AUROC of the critic's value after each step against the truth of the prefix (all lines right so far)."""
    from verl_prm.recipes.arithmetic.rl import step_tensors
    from verl_prm.recipes.arithmetic.rollout import sample
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


def search_sweep(model, tokenizer, critic, prompt_texts: Sequence[str], problems: Sequence[Problem], *,
                 best_of_n: Sequence[int], beam_widths: Sequence[int], samples_per_beam: int, alpha: float,
                 best_of_k: int, max_new_tokens: int, max_steps: int, seed: int) -> list[dict]:
    """Best-of-N (critic final value as the ranker) and PAV beam search with the base policy; one row per
    (method, N): accuracy and mean generated / critic tokens per problem."""
    from verl_prm.search import BeamConfig, BestOfNConfig, CachedCritic, beam_search, best_of_n as run_best_of_n
    from verl_prm.search.generation import HFStepSampler, TextCritic

    sampler = HFStepSampler(model, tokenizer, list(prompt_texts), delimiter=None, regex=STEP_REGEX, max_step_tokens=24,
                            max_response_tokens=max_new_tokens, temperature=1.0, batch_size=512)
    ids = list(range(len(problems)))
    rows = []

    def record(method: str, n: int, results) -> None:
        correct = [compute_score(DATA_SOURCE, "".join(r.node.steps), problems[r.problem].answer) for r in results]
        rows.append({"method": method, "n": n, "accuracy": float(np.mean(correct)),
                     "generated_tokens": float(np.mean([r.compute.generated_tokens for r in results])),
                     "critic_tokens": float(np.mean([r.compute.critic_tokens for r in results]))})

    for n in best_of_n:
        results = run_best_of_n(ids, sampler, CachedCritic(TextCritic(critic, prompt_texts)),
                                BestOfNConfig(n=n, rank="orm", seed=seed))
        record("best_of_n", n, results)
    for n in beam_widths:
        config = BeamConfig(beam_width=n, samples_per_beam=samples_per_beam, alpha=alpha, best_of_k=best_of_k,
                            max_steps=max_steps, seed=seed)
        results = beam_search(ids, sampler, CachedCritic(TextCritic(critic, prompt_texts)), None, config)
        record("beam_pav", n, results)
    return rows


def write_table(results: dict, path_md: str | Path, path_json: str | Path) -> str:
    """The results as markdown (returned and written) and JSON."""
    Path(path_json).write_text(json.dumps(results, indent=2))
    p = results["policies"]
    eff = results["sample_efficiency"]
    lines = [
        "| policy | accuracy (T=1) | RL steps | RL samples |",
        "|---|---:|---:|---:|",
    ]
    for name, label in (("base", "SFT base"), ("grpo", "GRPO"), ("pav_grpo", "PAV-GRPO")):
        lines.append(f"| {label} | {p[name]['accuracy']:.3f} | {p[name]['steps']} | {p[name]['samples']} |")
    speed = "PAV-GRPO never reached it" if eff["speedup"] is None else f"{eff['speedup']:.2f}x"
    at = lambda step: "never" if step is None else f"at step {step}"  # noqa: E731
    lines += [
        "",
        f"Sample efficiency: GRPO's final accuracy {eff['target_accuracy']:.3f} (held-out evaluation during RL) is "
        f"reached by GRPO {at(eff['grpo_steps_to_target'])} and by PAV-GRPO {at(eff['pav_grpo_steps_to_target'])} "
        f"(speed-up {speed}; paper: 5-6x). Final accuracy PAV-GRPO - GRPO: "
        f"{p['pav_grpo']['accuracy'] - p['grpo']['accuracy']:+.3f} (paper: about +6%).",
        "",
        f"Critic: held-out label AUROC {results['critic']['label_auroc']:.3f} (q >= 0.5 vs < 0.5 on held-out "
        f"prefixes of `verl-prm train`); step AUROC against the true prefix correctness "
        f"{results['critic']['step_auroc']:.3f} on {results['critic']['steps_scored']} steps of base-policy samples "
        f"({results['critic']['wrong_step_share']:.1%} of them wrong); mean value drop at the first wrong step "
        f"{results['critic']['mean_value_drop_at_first_wrong_step']:.3f}.",
        "",
        "| search (base policy) | N | accuracy | generated tokens / problem | critic tokens / problem |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in results["search"]:
        lines.append(f"| {row['method']} | {row['n']} | {row['accuracy']:.3f} | {row['generated_tokens']:.1f} | "
                     f"{row['critic_tokens']:.1f} |")
    text = "\n".join(lines) + "\n"
    Path(path_md).write_text(text)
    return text


def plot_all(results: dict, output_dir: str | Path) -> list[str]:
    """Three PNGs: accuracy vs RL steps, accuracy vs RL samples, search accuracy vs generated tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    paths = []
    curves = {"GRPO": results["curves"]["grpo"], "PAV-GRPO": results["curves"]["pav_grpo"]}
    for column, name, xlabel in ((0, "accuracy_vs_rl_steps.png", "RL steps"),
                                 (1, "accuracy_vs_rl_samples.png", "sampled responses (RL)")):
        figure, axis = plt.subplots(figsize=(6.0, 4.0))
        for label, curve in curves.items():
            axis.plot([c[column] for c in curve], [c[2] for c in curve], marker="o", label=label)
        target = results["sample_efficiency"]["target_accuracy"]
        axis.axhline(target, color="gray", linestyle=":", linewidth=1, label="GRPO final")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("held-out accuracy (T=1)")
        axis.set_title("arithmetic recipe: GRPO vs PAV-GRPO", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(output_dir / name, dpi=120)
        plt.close(figure)
        paths.append(str(output_dir / name))
    figure, axis = plt.subplots(figsize=(6.0, 4.0))
    for method, label in (("best_of_n", "best-of-N (critic as ORM)"), ("beam_pav", "beam search on Q + alpha*A")):
        rows = sorted((r["generated_tokens"], r["accuracy"], r["n"]) for r in results["search"] if r["method"] == method)
        if rows:
            axis.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=label)
            for x, y, n in rows:
                axis.annotate(str(n), (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
    for name, label, marker in (("base", "SFT base, 1 sample", "s"), ("grpo", "GRPO, 1 sample", "^"),
                                ("pav_grpo", "PAV-GRPO, 1 sample", "v")):
        policy = results["policies"][name]
        axis.scatter([policy["response_tokens"]], [policy["accuracy"]], marker=marker, label=label, zorder=3)
    axis.set_xscale("log")
    axis.set_xlabel("generated tokens per problem (log scale)")
    axis.set_ylabel("held-out accuracy")
    axis.set_title("search with the base policy vs RL-trained policies", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(output_dir / "search_accuracy_vs_compute.png", dpi=120)
    plt.close(figure)
    paths.append(str(output_dir / "search_accuracy_vs_compute.png"))
    return paths


def policy_accuracy(path: str | Path, prompt_texts_of, problems: Sequence[Problem], *, samples: int,
                    max_new_tokens: int, seed: int, device: str = "cpu") -> dict:
    """Sampled accuracy and mean response tokens of the policy at ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.recipes.arithmetic.rl import outcome_rewards
    from verl_prm.recipes.arithmetic.rollout import sample

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False)
    model = model.to(device).eval()
    rollouts = sample(model, tokenizer, prompt_texts_of(tokenizer), samples, max_new_tokens=max_new_tokens, seed=seed)
    rewards = outcome_rewards(rollouts, problems)
    return {"accuracy": float(rewards.mean()), "response_tokens": float(rollouts.response_mask.sum(dim=1).mean()),
            "samples_per_problem": samples}

"""Evaluation stage of the arithmetic recipe: policies, the critic's step AUROC, search, the table and plots.

- **Policies** (base SFT, GRPO, PAV-GRPO): sampled accuracy (temperature 1, the policy RL trains) on held-out
  problems, ``samples`` samples each, with the same seeds for every policy.
- **Critic**: AUROC of its raw value after each step for "every step so far is right" (the truth, from
  ``task.prefix_is_correct``) on base-policy samples of held-out problems. This is the step-level detection
  of slips by a critic that was trained on Monte-Carlo labels only.
- **Search** with the base policy (``verl_prm.search``): best-of-N re-ranked by the critic's final value (an
  outcome verifier), and the PAV paper's beam search on ``Q + alpha * A`` (Q: the critic; A: progress of its
  Best-of-K prover). Compute is the mean number of generated tokens per problem.
- **Sample efficiency** of each arm against GRPO from the seed-mean held-out curves of verl's runs
  (:func:`efficiency_statistics`): the steps (and sampled responses) to reach GRPO's accuracy at two thirds of
  its budget, against GRPO's own, and the area under each curve; standard errors from a bootstrap over seeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from verl_prm.apps.arithmetic.machine import machine_line
from verl_prm.apps.arithmetic.stats import bootstrap, bootstrap_se, first_crossing, interpolate, mean_curve, normalised_auc
from verl_prm.apps.arithmetic.task import DATA_SOURCE, STEP_REGEX, Problem, compute_score, prefix_is_correct
from verl_prm.apps.arithmetic.verl_rl import ARMS
from verl_prm.apps.arithmetic.batch import outcome_rewards, step_tensors
from verl_prm.apps.arithmetic.rollout import sample
from verl_prm.critic.exact import ExactPrefixCritic
from verl_prm.search import BeamConfig, BestOfNConfig, CachedCritic, beam_search, best_of_n as run_best_of_n
from verl_prm.search.generation import HFStepSampler, TextCritic
from verl_prm.training.metrics import auroc

__all__ = ["efficiency_statistics", "summarise_arms", "critic_step_auroc", "search_sweep", "write_table",
           "plot_all", "learned_prefix_critic", "exact_prefix_critic"]


def efficiency_statistics(reference_curves: Sequence, arm_curves: Sequence, *, budget: int,
                          level_fraction: float) -> dict:
    """Sample efficiency and area on the seed-mean curves (:func:`.stats.mean_curve`) of the reference (GRPO)
    and of an arm, every curve of ``(step, samples, accuracy)`` rows from step 0 to ``budget``:

    - ``level`` L: the reference's seed-mean accuracy at step ``level_fraction * budget`` (interpolated);
    - ``steps_to_level`` / ``samples_to_level``: where the arm's seed-mean curve first reaches L
      (:func:`.stats.first_crossing` against steps / sampled responses; None if never), and the same for the
      reference (``reference_steps_to_level``, at most ``level_fraction * budget`` by construction);
    - ``efficiency``: reference steps to L over the arm's (inf if only the arm starts at L, nan if the arm never
      reaches it or both start there);
    - ``auc``: the arm's normalised area under its seed-mean curve (:func:`.stats.normalised_auc`, its mean
      accuracy over the budget), ``auc_gain`` = ``auc`` minus the reference's.
    """
    ref_mean, _ = mean_curve(reference_curves)
    arm_mean, _ = mean_curve(arm_curves)
    ref_steps, ref_acc = [r[0] for r in ref_mean], [r[2] for r in ref_mean]
    arm_steps, arm_acc = [r[0] for r in arm_mean], [r[2] for r in arm_mean]
    level = interpolate(ref_steps, ref_acc, level_fraction * budget)
    ref_to_level = first_crossing(ref_steps, ref_acc, level)
    to_level = first_crossing(arm_steps, arm_acc, level)
    samples_to_level = first_crossing([r[1] for r in arm_mean], arm_acc, level)
    if to_level is None or ref_to_level is None or (to_level == 0 and ref_to_level == 0):
        efficiency = float("nan")
    else:
        efficiency = float("inf") if to_level == 0 else ref_to_level / to_level
    auc = normalised_auc(arm_steps, arm_acc, budget)
    return {"level": level, "reference_steps_to_level": ref_to_level, "steps_to_level": to_level,
            "samples_to_level": samples_to_level, "efficiency": efficiency, "auc": auc,
            "auc_gain": auc - normalised_auc(ref_steps, ref_acc, budget)}


def _mean_curve_auc(curves: Sequence, budget: int) -> float:
    mean, _ = mean_curve(curves)
    return normalised_auc([r[0] for r in mean], [r[2] for r in mean], budget)


# the statistics whose bootstrap standard errors the summary reports, in efficiency_statistics' names
BOOTSTRAPPED = ("level", "steps_to_level", "samples_to_level", "efficiency", "auc", "auc_gain")


# per training step of verl_rl.read_run: the diagnostics and costs process_summary averages
PROCESS_KEYS = ("process_corr", "abs_adv_right", "abs_adv_slipped", "exact_abs_adv_right", "exact_abs_adv_slipped",
                "zero_outcome_groups_with_signal", "mc_seconds", "mc_tokens", "response_tokens", "generated_tokens",
                "step_seconds")


def process_summary(trainings: Sequence[Sequence[dict]]) -> dict:
    """Mean over seeds of each seed's mean over its training steps (``PROCESS_KEYS``; a metric a run did not log
    is None), plus ``tokens_per_step`` (generated tokens: the responses', fewer for tree-shaped groups, plus the
    continuations'; runs recorded before ``generated_tokens`` existed count their responses) and
    ``seconds_per_step`` (verl's ``timing_s/step``, the continuations' sampling included)."""
    out = {}
    for key in PROCESS_KEYS:
        per_seed = [np.nanmean([t.get(key, np.nan) for t in steps]) if any(np.isfinite(t.get(key, np.nan))
                                                                           for t in steps) else np.nan
                    for steps in trainings if steps]
        finite = [v for v in per_seed if np.isfinite(v)]
        out[key] = float(np.mean(finite)) if finite else None
    generated = out["generated_tokens"] if out["generated_tokens"] is not None else out["response_tokens"]
    out["tokens_per_step"] = None if generated is None else generated + (out["mc_tokens"] or 0.0)
    out["seconds_per_step"] = out["step_seconds"]
    return out


REFRESH_KEYS = ("refresh_labels", "refresh_mse", "refresh_mse_constant", "refresh_auroc", "refresh_seconds")


def refresh_summary(trainings: Sequence[Sequence[dict]]) -> list[dict]:
    """Per refresh step of a learned PAV's refresh (a step that logged ``refresh_labels``), the mean over the seeds
    that refreshed at it of each of ``REFRESH_KEYS`` (a seed that did not log a metric at that step, e.g. the AUROC
    of labels of one class, is skipped; None when no seed did) and ``seeds``, the number of seeds that refreshed
    there. Empty for an arm that never refreshed."""
    by_step: dict[int, list[dict]] = {}
    for steps in trainings:
        for t in steps:
            if np.isfinite(t.get("refresh_labels", np.nan)):
                by_step.setdefault(int(t["step"]), []).append(t)
    out = []
    for step in sorted(by_step):
        rows = by_step[step]
        entry = {"step": step, "seeds": len(rows)}
        for key in REFRESH_KEYS:
            finite = [r[key] for r in rows if np.isfinite(r.get(key, np.nan))]
            entry[key] = float(np.mean(finite)) if finite else None
        out.append(entry)
    return out


def summarise_arms(runs: dict, *, budget: int, reference: str = "grpo", level_fraction: float = 2 / 3,
                   resamples: int = 2000, seed: int = 0) -> dict:
    """Per arm over its seeds: the seed-mean held-out curve and its standard error per point, the final accuracy
    of the trained policies (mean, standard error over seeds), the share of groups without an outcome signal,
    and :func:`efficiency_statistics` against ``reference`` (without the reference arm: the area only).

    Each statistic's standard error (``<name>_se``) is the bootstrap's (:func:`.stats.bootstrap`, ``resamples``
    resamples from ``seed``): the seeds of the arm and of the reference resampled independently, the seed-mean
    curves and the statistic recomputed; ``<name>_undefined_share`` is the share of resamples where it is
    undefined (the level never reached). With fewer than 2 seeds in an arm involved the errors are nan."""
    if not (np.isfinite(level_fraction) and 0 < level_fraction <= 1):
        raise ValueError(f"level_fraction must be in (0, 1], got {level_fraction!r}")
    out = {}
    ordered = {arm: [seeds[s]["curve"] for s in sorted(seeds)] for arm, seeds in runs.items()}
    for arm, seeds in runs.items():
        curves = ordered[arm]
        for s, curve in zip(sorted(seeds), curves):
            if not curve or curve[0][0] != 0 or curve[-1][0] != budget:
                raise ValueError(f"the held-out curve of {arm} seed {s} spans steps "
                                 f"{[row[0] for row in curve]}; the statistics need steps 0 to {budget} "
                                 "(an incomplete run, or one with another budget)")
        mean, se = mean_curve(curves)
        finals = np.array([seeds[s]["final"]["accuracy"] for s in sorted(seeds)])
        zero = [np.mean([t["zero_signal_groups"] for t in seeds[s]["training"]]) for s in sorted(seeds)
                if seeds[s]["training"]]
        summary = {"seeds": sorted(seeds), "curve": mean, "curve_se": se,
                   "final_accuracy": float(finals.mean()),
                   "final_accuracy_se": float(finals.std(ddof=1) / np.sqrt(len(finals))) if len(finals) > 1 else float("nan"),
                   "final_accuracy_by_seed": finals.tolist(),
                   "auc_by_seed": [normalised_auc([r[0] for r in c], [r[2] for r in c], budget) for c in curves],
                   "zero_signal_groups": float(np.mean(zero)) if zero else float("nan")}
        if reference in runs:
            # the arm's seeds and the reference's resampled independently (the same resample for the reference)
            groups = {reference: ordered[reference]} if arm == reference else {reference: ordered[reference], arm: curves}
            point = efficiency_statistics(ordered[reference], curves, budget=budget, level_fraction=level_fraction)
            names = BOOTSTRAPPED

            def statistic(sample: dict, arm=arm) -> list[float]:
                values = efficiency_statistics(sample[reference], sample[arm], budget=budget,
                                               level_fraction=level_fraction)
                return [float("nan") if values[name] is None else values[name] for name in BOOTSTRAPPED]
        else:
            groups, names = {arm: curves}, ("auc",)
            point = {"auc": _mean_curve_auc(curves, budget)}

            def statistic(sample: dict, arm=arm) -> list[float]:
                return [_mean_curve_auc(sample[arm], budget)]

        draws = bootstrap(statistic, groups, resamples=resamples, seed=seed)
        too_few = min(len(items) for items in groups.values()) < 2
        summary.update(point)
        for column, name in enumerate(names):
            se, undefined = bootstrap_se(draws[:, column])
            summary[f"{name}_se"] = float("nan") if too_few else se
            summary[f"{name}_undefined_share"] = undefined
        if reference in runs:
            summary.update({"reference": reference, "level_fraction": level_fraction,
                            "level_step": level_fraction * budget})
        summary.update({"budget": budget, "bootstrap": {"resamples": resamples, "seed": seed}})
        summary["process"] = process_summary([seeds[s]["training"] for s in sorted(seeds)])
        summary["refresh"] = refresh_summary([seeds[s]["training"] for s in sorted(seeds)])
        steps = summary.get("steps_to_level")
        for name, per_step in (("tokens_to_level", "tokens_per_step"), ("seconds_to_level", "seconds_per_step")):
            cost = summary["process"][per_step]
            summary[name] = None if steps is None or cost is None else steps * cost
        out[arm] = summary
    return out


def critic_step_auroc(critic, tokenizer, model, prompt_texts: Sequence[str], problems: Sequence[Problem], *,
                      samples: int, max_new_tokens: int, seed: int) -> dict:
    """AUROC of the critic's value after each step against the truth of the prefix (all lines right so far)."""
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
    return TextCritic(critic, prompt_texts)


def exact_prefix_critic(prover, prompt_texts: Sequence[str]):
    """The exact prover as the search's prefix critic (``verl_prm.critic.exact.ExactPrefixCritic``)."""
    return ExactPrefixCritic(prover, prompt_texts)


def search_sweep(model, tokenizer, prefix_critic, prompt_texts: Sequence[str], problems: Sequence[Problem], *,
                 best_of_n: Sequence[int], beam_widths: Sequence[int], samples_per_beam: int, alpha: float,
                 best_of_k: int, max_new_tokens: int, max_steps: int, seed: int) -> list[dict]:
    """Best-of-N (the critic's final value as the ranker) and PAV beam search (Q and A from the same critic)
    with the base policy; one row per (method, N): accuracy and mean generated / critic tokens per problem.
    Each search run gets a fresh cache, so its critic tokens are its own."""
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


def search_table(search: dict[str, list[dict]]) -> list[str]:
    """The markdown lines of :func:`search_sweep`'s rows of each critic (``{critic name: rows}``)."""
    lines = ["| search (base policy) | critic | N | accuracy | generated tokens / problem | critic tokens / problem |",
             "|---|---|---:|---:|---:|---:|"]
    for critic_name, rows in search.items():
        for row in rows:
            lines.append(f"| {row['method']} | {critic_name} | {row['n']} | {_pm(row['accuracy'], row.get('accuracy_se'))} | "
                         f"{row['generated_tokens']:.1f} | {row['critic_tokens']:.1f} |")
    return lines


def _arm_label(arm: str) -> str:
    return ARMS[arm].label if arm in ARMS else arm


def _pm(value: float, se: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}" if se is None or np.isnan(se) else f"{value:.{digits}f} ± {se:.{digits}f}"


MIN_REPORTED_SEEDS = 3  # a table with fewer seeds in an arm says so


def _reached(value, se, undefined: float, digits: int, suffix: str = "", never: str = "never",
             undefined_as: str = "never") -> str:
    """A statistic of the level: ``value ± se``, "never" (None: not reached; nan), "inf" (an arm at L from step
    0), with the share of bootstrap resamples where it is undefined (the level not reached)."""
    if value is None or np.isnan(value):
        text = never
    elif np.isinf(value):
        text = "inf (at L from step 0)"
    else:
        text = f"{_pm(value, se, digits)}{suffix}"
    return text + (f" ({undefined_as} in {undefined:.0%} of bootstraps)" if undefined else "")


def write_table(results: dict, path_md: str | Path, path_json: str | Path) -> str:
    """The results as markdown (returned and written) and JSON."""
    Path(path_json).write_text(json.dumps(results, indent=2))
    arms, prover = results["arms"], results["prover"]
    reference = next((s for s in arms.values() if "level" in s), None)
    level = (f"Level L = {reference['level']:.3f}, GRPO's seed-mean held-out accuracy at step {reference['level_step']:g} "
             f"({reference['level_fraction']:.3g} of its {reference['budget']} steps)" if reference else
             "No GRPO arm: no level L to compare at")
    lines = [
        f"Machine: {machine_line(results['environment'])}.",
        "",
        f"SFT policy (label prompts, {prover['group_size']} samples each): success {prover['success']:.3f}, "
        f"groups with no outcome signal {prover['zero_signal_groups']:.3f} (all wrong: {prover['all_fail_groups']:.3f}), "
        f"per-step accuracy p = {prover['step_accuracy']:.3f} (the exact prover's p).",
        "",
        f"| policy | seeds | final accuracy (T=1, test, {results['policies']['base']['samples_per_problem']} "
        "samples) | "
        "held-out accuracy at the last RL step | area under the held-out curve / steps | steps to L | "
        "sampled responses to L | sample efficiency vs GRPO (steps to L) | groups with no outcome signal "
        "(mean over steps) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| SFT base | - | {results['policies']['base']['accuracy']:.3f} | - | - | - | - | - | - |",
    ]
    for arm, summary in arms.items():
        if "level" in summary:
            to_level = _reached(summary["steps_to_level"], summary["steps_to_level_se"],
                                summary["steps_to_level_undefined_share"], 1)
            samples = _reached(summary["samples_to_level"], summary["samples_to_level_se"],
                               summary["samples_to_level_undefined_share"], 0)
            speed = "1x (the reference)" if arm == summary["reference"] else _reached(
                summary["efficiency"], summary["efficiency_se"], summary["efficiency_undefined_share"], 2, suffix="x",
                never="never" if summary["steps_to_level"] is None else "n/a", undefined_as="undefined")
        else:
            to_level = samples = speed = "-"
        lines.append(
            f"| {_arm_label(arm)} | {len(summary['seeds'])} | "
            f"{_pm(summary['final_accuracy'], summary['final_accuracy_se'])} | "
            f"{_pm(summary['curve'][-1][2], summary['curve_se'][-1])} | {_pm(summary['auc'], summary['auc_se'])} | "
            f"{to_level} | {samples} | {speed} | {summary['zero_signal_groups']:.3f} |")
    few = {arm: len(s["seeds"]) for arm, s in arms.items() if len(s["seeds"]) < MIN_REPORTED_SEEDS}
    bootstrap_settings = next(iter(arms.values()))["bootstrap"] if arms else {"resamples": 0, "seed": 0}
    lines += [
        "",
        f"{level}. Held-out accuracy: verl's validation, "
        f"{results['settings']['rl']['eval_samples']} samples per test prompt per evaluation. Steps and responses to "
        "L on the seed-mean curve, interpolated linearly between evaluations; the area is the trapezoid under the "
        "seed-mean curve over the budget, divided by it (the mean held-out accuracy during training). Final "
        "accuracy: mean ± standard error over seeds; every other ± is a bootstrap over seeds "
        f"({bootstrap_settings['resamples']} resamples, seed {bootstrap_settings['seed']}: each arm's seeds resampled, "
        "the seed-mean curves and the statistic recomputed), with the share of resamples that never reach L.",
    ]
    if few:
        lines += ["", f"**Fewer than {MIN_REPORTED_SEEDS} seeds** ({', '.join(f'{a}: {n}' for a, n in few.items())}): "
                  "not a result to report; the bootstrap needs several seeds per arm."]
    lines += ["", *process_table(arms)]
    refresh = refresh_table(arms)
    lines += ["", *refresh] if refresh else []
    critic = results["critic"]
    lines += [
        "",
        f"Learned PAV: held-out label AUROC {critic['label_auroc']:.3f}; step AUROC against the true prefix "
        f"correctness {critic['step_auroc']:.3f} on {critic['steps_scored']} steps of base-policy samples "
        f"({critic['wrong_step_share']:.1%} of them wrong); mean value drop at the first wrong step "
        f"{critic['mean_value_drop_at_first_wrong_step']:.3f}"
        + (f"; with its calibration ({critic['calibration']}) {critic['calibrated_mean_value_drop_at_first_wrong_step']:.3f}, "
           f"held-out label MSE {critic['label_mse']:.3f} -> {critic['calibrated_label_mse']:.3f}"
           if "calibration" in critic else "") + ".",
    ]
    if "refined" in critic:
        refined = critic["refined"]
        lines += ["", f"Learned PAV on the refined check (pav_refined): held-out label AUROC {refined['label_auroc']:.3f}, "
                      f"MSE {refined['label_mse']:.3f}; step AUROC {refined['step_auroc']:.3f}; mean value drop at the "
                      f"first wrong step {refined['mean_value_drop_at_first_wrong_step']:.3f}."]
    lines += ["", *search_table(results["search"])]
    text = "\n".join(lines) + "\n"
    Path(path_md).write_text(text)
    return text


def _num(value, digits: int = 3) -> str:
    """A table cell: the value to ``digits`` decimals, n/a when it is missing or not finite."""
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.{digits}f}"


def process_table(arms: dict) -> list[str]:
    """Markdown lines: per arm, its process term against the exact prover's on the same RL batches (the
    diagnostics; n/a where the arm has no reference) and what a step costs, with the steps to L turned into
    generated tokens and seconds."""
    lines = ["| policy | corr(A, exact A) per step | mean abs A right / slipped steps | exact prover's | zero-outcome "
             "groups with a process signal | generated tokens / step (continuations) | s / step | tokens to L | "
             "s to L |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, summary in arms.items():
        p = summary["process"]
        mc = f" ({_num(p['mc_tokens'], 0)})" if p["mc_tokens"] else ""
        lines.append(
            f"| {_arm_label(arm)} | {_num(p['process_corr'])} | {_num(p['abs_adv_right'])} / {_num(p['abs_adv_slipped'])} | "
            f"{_num(p['exact_abs_adv_right'])} / {_num(p['exact_abs_adv_slipped'])} | "
            f"{_num(p['zero_outcome_groups_with_signal'])} | {_num(p['tokens_per_step'], 0)}{mc} | "
            f"{_num(p['seconds_per_step'], 1)} | {_num(summary.get('tokens_to_level'), 0)} | "
            f"{_num(summary.get('seconds_to_level'), 0)} |")
    lines += ["", "Process columns: verl_prm.diagnostics against the exact prover on each arm's own RL batches, mean "
              "over steps and seeds (A = the process term before alpha; right: steps whose exact value stays > 0, "
              "slipped: the step where it falls to 0). Tokens and seconds to L: steps to L times the arm's mean per "
              "step (verl's timing_s/step, on the cores as the runs shared them: see each run's environment)."]
    return lines


def refresh_table(arms: dict) -> list[str]:
    """Markdown lines for the arms whose learned PAV was refreshed from samples: per refresh step, how stale the PAV
    was against the step's fresh labels before its refit (its MSE, the labels' own spread as the MSE of their mean,
    its AUROC) and what the refresh cost. Empty when no arm refreshed."""
    refreshed = {arm: s["refresh"] for arm, s in arms.items() if s.get("refresh")}
    if not refreshed:
        return []
    lines = ["| policy | refresh at step | seeds | labels | PAV's MSE before the refit | MSE of the labels' mean | "
             "AUROC (labels >= 0.5) | s (sampling and refit) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, rows in refreshed.items():
        for r in rows:
            lines.append(f"| {_arm_label(arm)} | {r['step']} | {r['seeds']} | {_num(r['refresh_labels'], 0)} | "
                         f"{_num(r['refresh_mse'])} | {_num(r['refresh_mse_constant'])} | {_num(r['refresh_auroc'])} | "
                         f"{_num(r['refresh_seconds'], 1)} |")
    lines += ["", "Refresh columns: the PAV as it scored the step (refitted at the previous refresh) against that "
              "step's sampled labels, which it has not seen; mean over the seeds that refreshed at the step."]
    return lines


def cost_curve(curve: Sequence, training: Sequence[dict], key: str) -> list[tuple[float, float]]:
    """(cost, held-out accuracy) at each evaluation of one run: for the evaluation after step s,

        cost(s) = sum over the run's training steps t <= s of training[t][key]

    (0 before training), e.g. ``generated_tokens`` (tokens sampled) or ``step_seconds`` (verl's ``timing_s/step``).
    ``curve`` holds (step, samples, accuracy); a step without a training record is an error naming it."""
    per_step = {int(t["step"]): float(t[key]) for t in training}
    steps = sorted(per_step)
    points = []
    for step, _, accuracy in curve:
        missing = [t for t in range(1, int(step) + 1) if t not in per_step]
        if missing:
            raise ValueError(f"cost_curve: training steps {missing[:5]} have no record of {key!r} "
                             f"(recorded: {steps[:3]}..{steps[-3:]})")
        points.append((sum(per_step[t] for t in range(1, int(step) + 1)), float(accuracy)))
    return points


def _save_accuracy_plot(figure, axis, xlabel: str, title: str, path: Path) -> str:
    """Label a held-out accuracy plot (its legend below the axes), save it as a PNG and close it."""
    import matplotlib.pyplot as plt

    axis.set_xlabel(xlabel)
    axis.set_ylabel("held-out accuracy (T=1), mean ± s.e.")
    axis.set_title(f"arithmetic recipe on verl's main_ppo: {title}", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)


def plot_cost_curves(runs: dict, output_dir: str | Path) -> list[str]:
    """PNGs of held-out accuracy (seed mean ± standard error) against what the runs spent (``cost_curve``):
    generated tokens and training seconds, each point at the seeds' mean cost. ``runs``: arm -> seed -> a run's
    ``curve`` and ``training``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    paths = []
    for key, name, xlabel in (("generated_tokens", "accuracy_vs_generated_tokens.png", "generated tokens (RL, cumulative)"),
                              ("step_seconds", "accuracy_vs_seconds.png", "training seconds (verl timing_s/step, cumulative)")):
        figure, axis = plt.subplots(figsize=(6.4, 4.2))
        for arm, seeds in runs.items():
            points = np.array([cost_curve(run["curve"], run["training"], key) for run in seeds.values()])
            x, y = points[..., 0].mean(0), points[..., 1].mean(0)
            se = points[..., 1].std(0, ddof=1) / np.sqrt(len(seeds)) if len(seeds) > 1 else np.zeros_like(y)
            axis.plot(x, y, marker="o", markersize=3, label=f"{_arm_label(arm)} ({len(seeds)} seeds)")
            axis.fill_between(x, y - se, y + se, alpha=0.2)
        paths.append(_save_accuracy_plot(figure, axis, xlabel, "accuracy against cost", output_dir / name))
    return paths


def plot_all(results: dict, output_dir: str | Path) -> list[str]:
    """PNGs: held-out accuracy against generated tokens and training seconds (``plot_cost_curves``), against RL
    steps and against sampled responses (seed mean ± standard error, the
    level L of the sample efficiency), the share of groups with no outcome signal per step, and search accuracy
    against generated tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    paths = plot_cost_curves(results["runs"], output_dir)
    arms = results["arms"]
    reference = next((s for s in arms.values() if "level" in s), None)
    for column, name, xlabel in ((0, "accuracy_vs_rl_steps.png", "RL steps"),
                                 (1, "accuracy_vs_rl_samples.png", "sampled responses (RL)")):
        figure, axis = plt.subplots(figsize=(6.4, 4.2))
        for arm, summary in arms.items():
            x = np.array([c[column] for c in summary["curve"]])
            y = np.array([c[2] for c in summary["curve"]])
            se = np.nan_to_num(np.array(summary["curve_se"]))
            axis.plot(x, y, marker="o", markersize=3, label=f"{_arm_label(arm)} ({len(summary['seeds'])} seeds)")
            axis.fill_between(x, y - se, y + se, alpha=0.2)
        if reference is not None:
            axis.axhline(reference["level"], color="gray", linestyle=":", linewidth=1,
                         label=f"L: GRPO's accuracy at step {reference['level_step']:g}")
        paths.append(_save_accuracy_plot(figure, axis, xlabel, "GRPO vs PAV-GRPO", output_dir / name))
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for arm, seeds in results["runs"].items():
        steps = sorted({t["step"] for s in seeds.values() for t in s["training"]})
        per_step = [np.mean([t["zero_signal_groups"] for s in seeds.values() for t in s["training"] if t["step"] == step])
                    for step in steps]
        axis.plot(steps, per_step, label=_arm_label(arm))
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


    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False)
    model = model.to(device).eval()
    rollouts = sample(model, tokenizer, prompt_texts_of(tokenizer), samples, max_new_tokens=max_new_tokens, seed=seed)
    rewards = outcome_rewards(rollouts, problems)
    return {"accuracy": float(rewards.mean()), "response_tokens": float(rollouts.response_mask.sum(dim=1).mean()),
            "samples_per_problem": samples}

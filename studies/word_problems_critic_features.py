"""Feature-based step critics for the word-problem recipe compared on one held-out test (issue 57 item 3): which
features of the policy carry the program check that a frozen-feature value head misses.

    python -m studies.word_problems_critic_features --work-dir runs/wp --policy runs/wp/policy \\
        --labels runs/wp/labels --eval-labels runs/wp_heldout --out runs/wp_critic_features --threads 1

For every label row (``--labels``: training, ``--eval-labels``: held out) the policy reads prompt + response once
(teacher forcing; the prompt and response tokenised apart and concatenated, as ``verl-prm train`` encodes a
rollout: ``verl_prm.steps.encode_with_step_ends``), and each step h of the labels' spans gets

- ``hidden``: the last hidden state (the LM head's input) at the token holding the step's last character, what a
  ``value_head`` critic's head reads;
- step log-prob statistics (:func:`step_logprob_stats`) over the policy's own token log-probs ``l_t = log
  p(token_t | tokens before)``: the step's minimum and mean, and the log-probability of the step's result (the
  summed log-probs of the tokens of ``c`` in a line ``... a op b = c.``, of ``N`` in ``The answer is N``;
  :func:`result_spans`);
- the same statistics cumulated over the prefix, the minimum over steps 1..h (:func:`cumulative_min`):
  ``prefix_correct`` and the Monte-Carlo value both concern the whole prefix.

Fitted critics (``verl_prm.training.head_fit.fit_logistic_head``: the weighted soft-label BCE by Newton's method on
features standardised by the training steps' mean and s.d., ridge ``--l2`` on the standardised weights) on the
training labels' Monte-Carlo rates ``q`` (labelled steps only; the prompt value is left out, it has no step and no
step log-probs), each step weighted by its rollout's class-balancing weight as ``verl-prm train --head-fit
newton`` weighs it (``verl_prm.training.data.class_balanced_weights`` over the rollouts' labelled steps;
``--uniform-weights``: all 1). Variants (:data:`FITTED`): ``hidden`` (the frozen value head), ``logprob``,
``cum_logprob``, ``logprob+cum_logprob``, ``hidden+cum_logprob``; training-free scores (:data:`TRAINING_FREE`):
``cum_min_result_logprob``, ``cum_min_token_logprob``.

The statistics are those of the ``token_logprob`` critic format (``verl_prm.critic.token_logprob``), whose
``verl-prm train --format token_logprob --result-regex`` fit with :data:`RESULT_REGEX` (:func:`result_spans`' rule
as one regex) is the ``logprob+cum_logprob`` variant as a loadable checkpoint.

Judged on the held-out steps as ``studies.word_problems_pav`` judges a critic (its functions): AUROC against
``prefix_correct`` (every held-out step) and against the Monte-Carlo label (``q > 0.5``, labelled steps), each with
a bootstrap interval over problems, and the fitted critics' MSE against ``q`` (beside a constant's: the training
steps' weighted mean q). Writes ``--out/metrics.json``, ``--out/results.md`` (a table) and
``--out/heldout_scores.jsonl`` (one JSON object per held-out step: problem, rollout, step, prefix_correct,
mc_label, the step's log-prob statistics and every variant's score). Features are cached per label shard in
``--out/features/<shard>-<key>.npz``, the key a digest of the shard's bytes, the policy (path, its files' sizes
and times) and the compute dtype, so a rerun (another ``--l2``, more shards) extracts only new shards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from studies.word_problems_pav import (MC_POSITIVE, at_least_two, json_safe, read_splits, row_name, step_metrics,
                                       step_rows)
from verl_prm.apps.word_problems.check import ANSWER, EQUATION
from verl_prm.apps.word_problems.task import STEP_DELIMITER
from verl_prm.cli_types import finite_float
# the statistics are the token_logprob critic's (verl-prm train --format token_logprob fits and scores with them)
from verl_prm.critic.token_logprob import (cumulative_min, overlapping_tokens, statistic_names, step_logprob_stats,
                                           step_token_ranges)
from verl_prm.training.token_logprob import step_weights

FEATURE_VERSION = 1  # bump when what a cached feature means changes
LOGPROB_STATS = statistic_names(result=True)  # min, mean, result
# fitted variants: name -> the feature groups it reads (hidden, logprob: the step's stats, cum_logprob: the prefix's)
FITTED = {
    "hidden": ("hidden",),
    "logprob": ("logprob",),
    "cum_logprob": ("cum_logprob",),
    "logprob+cum_logprob": ("logprob", "cum_logprob"),
    "hidden+cum_logprob": ("hidden", "cum_logprob"),
}
# training-free scores: name -> the column of the cumulative statistics (higher: more likely right)
TRAINING_FREE = {"cum_min_result_logprob": 2, "cum_min_token_logprob": 0}


# ------------------------------------------------------------------------------------------ per-step statistics


# result_spans' rule as one regex, for the token_logprob critic's result statistic (`verl-prm train --format
# token_logprob --result-regex`; its result is the first capture group that takes part): per line, N of a line
# ending "The answer is N", else c of a line "... a op b = c" with no other "=" (horizontal spaces only, so that
# no match runs into the next line)
RESULT_REGEX = (r"(?m)(?i:The answer is)[^\S\n]*\$?[^\S\n]*(-?\d[\d,]*)[^\S\n]*\.?[^\S\n]*$"
                r"|^[^=\n]*?-?\d+[^\S\n]*[-+*x×][^\S\n]*-?\d+[^\S\n]*=[^\S\n]*(-?\d+)[^\S\n]*\.?[^\S\n]*$")


def result_spans(step_text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` in ``step_text`` of the result each of its lines claims, by the rule of
    ``verl_prm.apps.word_problems.check.line_claim``: ``N`` of a line ending ``The answer is N`` (commas kept),
    else ``c`` of a line ending ``a op b = c`` with no other ``=``. A line that claims neither has none; a step
    holds one line, or several where the labeler merged the lines beyond its ``--max-steps``."""
    spans, offset = [], 0
    for line in step_text.split(STEP_DELIMITER):
        answer = ANSWER.search(line)
        equation = EQUATION.search(line) if answer is None and line.count("=") == 1 else None
        if answer is not None:
            spans.append((offset + answer.start(1), offset + answer.end(1)))
        elif equation is not None:
            spans.append((offset + equation.start(4), offset + equation.end(4)))
        offset += len(line) + len(STEP_DELIMITER)
    return spans


# ------------------------------------------------------------------------------------------ the policy's features


@dataclass
class Policy:
    """The policy model on its device, its tokenizer, the compute dtype and the cache key of its features."""

    model: Any
    tokenizer: Any
    device: str
    dtype: Any
    key: str
    captured: list


def load_policy(path: Path, device: str, precision: str) -> Policy:
    """The causal LM at ``path`` in float32 (no remote code; bf16 autocast where ``resolve_dtype(precision)``
    says), with a hook that keeps its LM head's input (the last hidden state)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.checkpoints import from_pretrained_kwargs
    from verl_prm.precision import resolve_dtype

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--policy {path}: no config.json there; pass a causal LM directory (the recipe's "
                                "policy/, or a model saved by save_pretrained)")
    dtype = resolve_dtype(precision, device)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **from_pretrained_kwargs()).to(device)
    model.eval()
    captured: list = []
    model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    key = json.dumps([FEATURE_VERSION, str(path.resolve()), str(dtype), files])
    return Policy(model, tokenizer, device, dtype, hashlib.sha256(key.encode()).hexdigest(), captured)


def rollout_features(policy: Policy, row) -> tuple[np.ndarray, np.ndarray]:
    """One label row's steps: [S, d] last hidden states at the steps' end tokens and [S, 3]
    :func:`step_logprob_stats`, from one teacher-forced pass over prompt + response."""
    import torch

    from verl_prm.steps import encode_with_step_ends

    spans = [(int(a), int(b)) for a, b in zip(row.step_starts, row.step_ends)]
    encoded = encode_with_step_ends(policy.tokenizer, row.prompt, row.response, spans, sample=row_name(row))
    ids = [int(t) for t in encoded.input_ids]
    first = int(encoded.prompt_end) + 1  # the first response token
    response = policy.tokenizer(row.response, add_special_tokens=False, split_special_tokens=True,
                                return_offsets_mapping=True)
    if list(response["input_ids"]) != ids[first:]:
        raise ValueError(f"{row_name(row)}: the tokenizer's offsets call encodes the response differently")
    offsets = np.asarray(response["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    results = []
    for start, end in spans:
        claims = [overlapping_tokens(offsets, start + a, start + b) for a, b in result_spans(row.response[start:end])]
        if any(len(tokens) == 0 for tokens in claims):
            raise ValueError(f"{row_name(row)}: no response token holds a result of step span ({start}, {end})")
        results.append(claims)
    policy.captured.clear()
    with torch.inference_mode(), torch.autocast(torch.device(policy.device).type, dtype=torch.bfloat16,
                                                enabled=policy.dtype == torch.bfloat16):
        logits = policy.model(input_ids=torch.tensor([ids], device=policy.device)).logits[0]
    hidden = policy.captured[-1][0].float()
    # l_t for t >= first, predicted at t - 1
    predicted = torch.log_softmax(logits[first - 1: -1].float(), dim=-1)
    targets = torch.tensor(ids[first:], device=predicted.device)
    token_logprobs = predicted.gather(1, targets[:, None])[:, 0].double().cpu().numpy()
    ends = [int(e) for e in encoded.step_ends]
    stats = step_logprob_stats(token_logprobs, step_token_ranges([e - first for e in ends]), results)
    return hidden[ends].cpu().numpy().astype(np.float32), stats


def shard_features(policy: Policy, shard: str, rows: pd.DataFrame, cache_dir: Path) -> dict[str, np.ndarray]:
    """``hidden`` [N, d] and ``stats`` [N, 3] of every step of one shard's rows (row and step order), from the
    cache when it holds them; a progress line per shard on stderr."""
    from verl_prm.checkpoints import file_digest

    key = hashlib.sha256(f"{file_digest(shard)}\x1f{policy.key}".encode()).hexdigest()[:20]
    path = cache_dir / f"{Path(shard).stem}-{key}.npz"
    steps = np.asarray([len(starts) for starts in rows["step_starts"]], dtype=np.int64)
    if path.is_file():
        with np.load(path) as cached:
            if np.array_equal(cached["steps"], steps):
                print(f"features: {shard}: {len(rows)} rollouts, {steps.sum()} steps from the cache {path}",
                      file=sys.stderr, flush=True)
                return {"hidden": cached["hidden"], "stats": cached["stats"]}
    began = time.perf_counter()
    per_row = [rollout_features(policy, row) for row in rows.itertuples(index=False)]
    width = policy.model.get_output_embeddings().in_features
    out = {"hidden": np.concatenate([h for h, _ in per_row] or [np.zeros((0, width), np.float32)]),
           "stats": np.concatenate([s for _, s in per_row] or [np.zeros((0, len(LOGPROB_STATS)))])}
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez(partial, steps=steps, **out)
    os.replace(partial, path)  # atomic: a cut run leaves no half-written cache
    print(f"features: {shard}: {len(rows)} rollouts, {steps.sum()} steps extracted in "
          f"{time.perf_counter() - began:.1f} s -> {path}", file=sys.stderr, flush=True)
    return out


def frame_features(policy: Policy, frame: pd.DataFrame, cache_dir: Path) -> dict[str, np.ndarray]:
    """Every step of ``frame`` (rows of ``with_origin(read_labels(...))``: whole shards in order): ``hidden``,
    ``stats``, ``rollout`` (the row's index in ``frame``) and ``q`` (NaN: not labelled), flat in row and step
    order, with ``cum_stats`` (:func:`cumulative_min` of ``stats`` within each rollout)."""
    parts = [shard_features(policy, shard, frame[frame["shard"] == shard], cache_dir)
             for shard in dict.fromkeys(frame["shard"])]
    steps = np.asarray([len(starts) for starts in frame["step_starts"]], dtype=np.int64)
    rollout = np.repeat(np.arange(len(frame)), steps)
    stats = np.concatenate([p["stats"] for p in parts]) if parts else np.zeros((0, len(LOGPROB_STATS)))
    return {"hidden": np.concatenate([p["hidden"] for p in parts]).astype(np.float64) if parts else np.zeros((0, 0)),
            "stats": stats, "cum_stats": cumulative_min(stats, rollout), "rollout": rollout,
            "q": np.asarray([q for row in frame["q"] for q in row], dtype=np.float64)}


# ------------------------------------------------------------------------------------------ fits and metrics


def variant_features(features: dict[str, np.ndarray], groups: Sequence[str]) -> np.ndarray:
    """The columns of a fitted variant: its feature groups side by side."""
    source = {"hidden": features["hidden"], "logprob": features["stats"], "cum_logprob": features["cum_stats"]}
    return np.concatenate([source[group] for group in groups], axis=1)


def fit_variant(train_x: np.ndarray, train_q: np.ndarray, weights: np.ndarray, test_x: np.ndarray, args) -> dict:
    """The logistic head fitted on the training steps; its held-out and training values and its fit record."""
    import torch

    from verl_prm.training.head_fit import fit_logistic_head

    fit = fit_logistic_head(torch.from_numpy(train_x), torch.from_numpy(train_q), torch.from_numpy(weights),
                            max_iterations=args.max_iterations, l2=args.l2)
    weight = fit.weight.numpy()

    def value(x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(x @ weight + fit.bias)))

    return {"test": value(test_x), "train": value(train_x),
            "fit": {"features": int(train_x.shape[1]), "loss": fit.loss, "iterations": fit.iterations,
                    "converged": fit.converged, "gradient_norm": fit.gradient_norm}}


def mean_squared(values: np.ndarray, q: np.ndarray) -> float:
    """Mean of (v - q)^2 over the labelled steps (q not NaN)."""
    labelled = ~np.isnan(q)
    return float(np.mean((values[labelled] - q[labelled]) ** 2)) if labelled.any() else math.nan


def score_variants(train: dict, test: dict, steps: pd.DataFrame, args) -> tuple[dict, dict, float]:
    """Every variant's metrics and held-out scores, and the constant critic (the training steps' weighted mean
    q) whose held-out MSE the fitted ones' stand beside."""
    labelled = ~np.isnan(train["q"])
    if not labelled.any():
        raise ValueError("--labels: no labelled step (every q is NaN) to fit the critics on")
    weights = step_weights(train["q"], train["rollout"], not args.uniform_weights)
    constant = float(np.average(train["q"][labelled], weights=weights))
    results, scores = {}, {}
    for name, groups in FITTED.items():
        fitted = fit_variant(variant_features(train, groups)[labelled], train["q"][labelled], weights,
                             variant_features(test, groups), args)
        scores[name] = fitted["test"]
        results[name] = {"kind": "fitted", "feature_groups": list(groups), **step_metrics(steps, fitted["test"], args),
                         "mse": mean_squared(fitted["test"], test["q"]),
                         "train_mse": mean_squared(fitted["train"], train["q"][labelled]), "fit": fitted["fit"]}
    for name, column in TRAINING_FREE.items():
        scores[name] = test["cum_stats"][:, column]
        results[name] = {"kind": "training-free", "statistic": f"prefix min of {LOGPROB_STATS[column]}",
                         **step_metrics(steps, scores[name], args), "mse": None}
    return results, scores, constant


def counts_of(frame: pd.DataFrame, questions: Sequence[str], features: dict) -> dict:
    """Problems, rollouts, steps and labelled steps of one split."""
    return {"problems": len(set(questions)), "rollouts": len(frame), "steps": int(len(features["q"])),
            "mc_labelled_steps": int((~np.isnan(features["q"])).sum())}


def interval_text(result: dict) -> str:
    if result["auroc"] is None or math.isnan(result["auroc"]):
        return "n/a"
    return f"{result['auroc']:.3f} [{result['low']:.3f}, {result['high']:.3f}]"


def results_table(metrics: dict) -> str:
    """The markdown table of ``results.md``: one line per variant."""
    counts = metrics["counts"]
    lines = [f"Held-out: {counts['heldout']['problems']} problems, {counts['heldout']['rollouts']} rollouts, "
             f"{counts['heldout']['steps']} steps ({counts['heldout']['prefix_correct_positives']} prefix_correct, "
             f"{counts['heldout']['mc_labelled_steps']} labelled, {counts['heldout']['mc_positives']} with q > "
             f"{MC_POSITIVE}). Training: {counts['train']['problems']} problems, {counts['train']['rollouts']} "
             f"rollouts, {counts['train']['mc_labelled_steps']} labelled steps. AUROC "
             f"[{metrics['bootstrap']['level']:.0%} bootstrap interval over problems]; --l2 {metrics['l2']}; weights "
             f"{metrics['weights']}; constant critic's held-out MSE {metrics['constant_mse']:.4f}.", "",
             "| variant | kind | features | AUROC vs prefix_correct | AUROC vs MC label | held-out MSE |",
             "|---|---|---|---|---|---|"]
    for name, result in metrics["variants"].items():
        what = (f"{result['fit']['features']}" if result["kind"] == "fitted" else result["statistic"])
        mse = "" if result["mse"] is None else f"{result['mse']:.4f}"
        lines.append(f"| {name} | {result['kind']} | {what} | {interval_text(result['prefix_correct'])} | "
                     f"{interval_text(result['mc_label'])} | {mse} |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, metrics: dict, steps: pd.DataFrame, test: dict, scores: dict) -> None:
    """metrics.json, results.md and heldout_scores.jsonl (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "heldout_scores.jsonl", "w") as f:
        for i, row in enumerate(steps.itertuples(index=False)):
            f.write(json.dumps(json_safe({
                "problem": row.problem, "rollout": int(row.rollout), "step": int(row.step),
                "prefix_correct": bool(row.prefix_correct), "mc_label": row.mc_label,
                "logprob": dict(zip(LOGPROB_STATS, test["stats"][i].tolist())),
                "scores": {name: float(values[i]) for name, values in scores.items()}})) + "\n")
    (out / "metrics.json").write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    (out / "results.md").write_text(results_table(json_safe(metrics)))


def run(args) -> dict:
    """Extract (or read the cached) features, fit and score every variant, write the outputs; returns metrics."""
    train_frame, held_out, questions, train_questions, problems = read_splits(args)
    steps = step_rows(held_out, questions, problems)
    policy = load_policy(args.policy, args.device, args.precision)
    cache = args.out / "features"
    train = frame_features(policy, train_frame, cache)
    test = frame_features(policy, held_out, cache)
    if len(test["q"]) != len(steps):  # both follow the labels' spans; a mismatch would misalign every row
        raise RuntimeError(f"{len(test['q'])} held-out step features for {len(steps)} held-out steps")
    variants, scores, constant = score_variants(train, test, steps, args)
    heldout_counts = {**counts_of(held_out, questions, test),
                      "prefix_correct_positives": int(steps["prefix_correct"].sum()),
                      "mc_positives": int((steps["mc_label"] > MC_POSITIVE).sum())}
    metrics = {"policy": str(args.policy), "dtype": str(policy.dtype).removeprefix("torch."),
               "labels": [str(p) for p in args.labels], "eval_labels": [str(p) for p in args.eval_labels],
               "work_dir": str(args.work_dir), "mc_positive": f"q > {MC_POSITIVE}", "l2": args.l2,
               "weights": "uniform" if args.uniform_weights else "class-balanced (verl-prm train)",
               "prompt_value": "left out (no step, no step log-probs)",
               "bootstrap": {"unit": "problem", "resamples": args.resamples, "seed": args.seed, "level": args.level},
               "counts": {"train": counts_of(train_frame, train_questions, train),
                          "heldout": heldout_counts},
               "constant": constant, "constant_mse": mean_squared(np.full(len(test["q"]), constant), test["q"]),
               "variants": variants}
    write_outputs(args.out, metrics, steps, test, scores)
    return metrics


def at_least_one(text: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.word_problems_critic_features",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, required=True, help="the word-problem recipe's work dir (data/*.jsonl)")
    p.add_argument("--policy", type=Path, required=True, help="the policy (a causal LM directory) whose features "
                   "and token log-probs the critics read")
    p.add_argument("--labels", type=Path, nargs="+", required=True, help="training label shards/dirs")
    p.add_argument("--eval-labels", type=Path, nargs="+", required=True, help="held-out label shards/dirs")
    p.add_argument("--out", type=Path, required=True, help="writes metrics.json, results.md, heldout_scores.jsonl "
                   "and the feature cache (features/)")
    p.add_argument("--l2", type=finite_float(0.0), default=1.0, help="ridge on the standardised head weights")
    p.add_argument("--max-iterations", type=at_least_one, default=100, help="Newton iterations at most per fit")
    p.add_argument("--uniform-weights", action="store_true", help="weigh every training step 1 (default: the "
                   "class-balancing weight of its rollout, as verl-prm train)")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the policy's compute dtype (verl_prm.precision.resolve_dtype; bf16: autocast)")
    p.add_argument("--resamples", type=at_least_two, default=2000, help="bootstrap resamples of the problems")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    p.add_argument("--level", type=finite_float(0.0, 1.0, low_open=True, high_open=True), default=0.95)
    p.add_argument("--device", default=None, help="the policy's device (default: CUDA when available, else CPU)")
    p.add_argument("--threads", type=at_least_one, default=None, help="torch threads (default: torch's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    args = parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    metrics = run(args)
    print(results_table(json_safe(metrics)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

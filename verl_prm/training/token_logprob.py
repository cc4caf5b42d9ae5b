"""Fitting a ``token_logprob`` critic (``verl-prm train --format token_logprob``): the policy's own token
log-probs, summarised per step and over the step prefix (:mod:`verl_prm.critic.token_logprob`), carry a step check
that a value head on its frozen last hidden state misses (docs/critic.md).

1. Label rows are encoded as ``verl-prm train`` encodes them (``encode_with_step_ends``: prompt and response
   tokenised apart and concatenated; ``--max-length`` drops the steps that end beyond it), and every step's
   features are extracted by the critic's own scoring code (the format adapter's ``step_features`` on the
   scorer's inputs, micro-batches and tensors), so a fitted head reads at scoring time what it was fitted on.
2. The logistic head is fitted on the Monte-Carlo targets ``q`` of the labelled training steps
   (``fit_logistic_head``: Newton's method, ridge ``--head-l2`` on the standardised weights), each step weighted by
   its rollout's class-balancing weight as the value-head Newton fit weighs it (``--no-balance``: all 1). The
   prompt value is a constant: the logit of the mean of the training prompts' values (one per prompt value,
   ``prompt_value_carriers``; without any, of the labelled steps' mean q), the mean clipped into [1e-6, 1 - 1e-6].
3. Held out (``--eval-labels`` or ``--eval-fraction``): the metrics of ``verl-prm train`` on the labelled steps
   and prompt values, and the ``--calibration`` map fitted on them (``calibration.json``).
4. The checkpoint (the ``--init`` LM saved by ``save_pretrained`` in its stored dtype, its tokenizer, the head's
   two files, the calibration) is written to a temporary directory next to ``--output-dir`` and renamed onto it,
   with the user's umask; an ``--output-dir`` that holds a checkpoint is replaced only with ``--overwrite``, one
   that holds other files never.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from verl_prm.checkpoints import allow_pickle_default, from_pretrained_kwargs, resolve_checkpoint, save_model
from verl_prm.critic.loading import default_attn_implementation, load_critic_tokenizer, resolve_dtype
from verl_prm.critic.scorer import ProverCritic
from verl_prm.critic.token_logprob import feature_names
from verl_prm.critic.token_logprob_format import TokenLogprobFormat
from verl_prm.critic.token_logprob_head import TokenLogprobHead, holds_head, write_head
from verl_prm.labeling.format import best_of_k_from_counts
from verl_prm.steps import encode_with_step_ends
from verl_prm.training.config import TrainConfig
from verl_prm.training.data import (EncodedRollout, class_balanced_weights, label_row_name, prompt_value_carriers,
                                    read_frames)
from verl_prm.training.evaluation import auroc_note, calibrate_held_out, check_calibration_labels
from verl_prm.training.head_fit import fit_logistic_head
from verl_prm.training.metrics import calibration_slope, value_metrics

__all__ = ["RolloutSteps", "encode_rollouts", "extract_step_features", "step_weights", "prompt_logit",
           "fit_token_logprob_head", "held_out_labels", "held_out_values", "fit_token_logprob_critic"]

# the prompt value's mean is clipped into [PROMPT_VALUE_CLIP, 1 - PROMPT_VALUE_CLIP] before its logit
PROMPT_VALUE_CLIP = 1e-6
# a calibration slope above this on the training steps is reported: the values are too flat for Eq. 5
FLAT_VALUES_SLOPE = 2.0


@dataclass
class RolloutSteps:
    """One label row as the critic reads it: ``input_ids``, ``prompt_end`` and ``step_ends`` (the critic's
    positions), ``q`` [H] (NaN: not labelled) with ``counts`` [H] (continuations behind each q), and the prompt
    value this row carries (NaN: none, or another row of the prompt carries it) with its count."""

    input_ids: list[int]
    prompt_end: int
    step_ends: list[int]
    q: np.ndarray
    counts: np.ndarray
    prompt: str
    prompt_value: float = math.nan
    prompt_count: int = 0
    name: str = ""  # the label row, for messages


def _best_of_k(values, successes, continuations, k: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    return values if k == 1 else best_of_k_from_counts(np.asarray(successes), np.asarray(continuations), values, k)


def encode_rollouts(frame: pd.DataFrame, tokenizer, *, max_length: int | None, best_of_k: int,
                    use_prompt_value: bool, note: Callable[[str], None]) -> list[RolloutSteps]:
    """The rows of ``frame`` as :class:`RolloutSteps` (``verl-prm train``'s encoding). A row longer than
    ``max_length`` keeps its first ``max_length`` tokens and the steps that end within them; a row with no step
    left, or with two steps ending in one token (the critic reads one position per step), is left out; both are
    counted in a note."""
    carriers = prompt_value_carriers(frame) if use_prompt_value else np.zeros(len(frame), dtype=bool)
    out, truncated, shared = [], 0, 0
    for carries, row in zip(carriers, frame.itertuples(index=False)):
        spans = [(int(a), int(b)) for a, b in zip(row.step_starts, row.step_ends)]
        try:
            encoded = encode_with_step_ends(tokenizer, row.prompt, row.response, spans)
        except ValueError as error:
            raise ValueError(f"{label_row_name(row)}: {str(error).removeprefix('sample 0: ')}") from None
        ids, ends = [int(t) for t in encoded.input_ids], [int(e) for e in encoded.step_ends]
        keep = len(ends)
        if max_length is not None and len(ids) > max_length:
            truncated += 1
            ids, keep = ids[:max_length], sum(e < max_length for e in ends)
        if any(b <= a for a, b in zip(ends, ends[1:])):
            shared += 1
            continue
        prompt_value = math.nan
        if carries and not math.isnan(float(row.prompt_value)):
            prompt_value = float(_best_of_k([row.prompt_value], [row.prompt_n_success], [row.prompt_n_mc],
                                            best_of_k)[0])
        q = _best_of_k(row.q, row.n_success, row.n_mc, best_of_k)[:keep]
        if keep:
            out.append(RolloutSteps(ids, int(encoded.prompt_end), ends[:keep], q,
                                    np.asarray(row.n_mc, dtype=np.int64)[:keep], row.prompt, prompt_value,
                                    int(row.prompt_n_mc), label_row_name(row)))
    if truncated:
        note(f"verl-prm train: {truncated} rollouts exceed --max-length {max_length}: the steps beyond it are "
             "not fitted on")
    if shared:
        note(f"verl-prm train: {shared} rollouts have two steps ending in one token (the critic reads one "
             "position per step): left out")
    return out


@torch.inference_mode()
def extract_step_features(critic: ProverCritic, rollouts: list[RolloutSteps], progress: bool = False
                          ) -> list[np.ndarray]:
    """[H_i, F] features of every rollout's steps, by the scorer's own path (``build_inputs``, ``plan``,
    ``prepare_batch``, the backbone) and the format's ``step_features``; a non-finite feature is an error naming
    the rollout."""
    try:
        inputs = critic.build_inputs([r.input_ids for r in rollouts], [r.prompt_end for r in rollouts],
                                     [r.step_ends for r in rollouts])
    except ValueError as error:  # "sample i" is the i-th rollout: name its label row
        raise ValueError(re.sub(r"\bsample (\d+)\b", lambda m: rollouts[int(m.group(1))].name, str(error))) from None
    out: list[np.ndarray | None] = [None] * len(rollouts)
    for batch in tqdm(critic.plan(inputs), desc="token log-prob features", unit="batch", disable=not progress):
        tensors = critic.prepare_batch(inputs, batch, critic.packing).to(critic.device)
        hidden = critic.adapter.backbone(**tensors.model_kwargs()).last_hidden_state
        counts = [len(inputs[i].read_positions) for i in batch.indices]
        for i, features in zip(batch.indices, critic.adapter.step_features(hidden, tensors, counts)):
            if not np.isfinite(features).all():
                raise FloatingPointError(f"{rollouts[i].name}: a non-finite token log-prob statistic; check the "
                                         "--init weights and the dtype")
            out[i] = features
    return out  # type: ignore[return-value]


def step_weights(q: np.ndarray, rollout: np.ndarray, balance: bool) -> np.ndarray:
    """The weight of each labelled step (``q`` not NaN, in order): its rollout's class-balancing weight over the
    rollouts' labelled steps (``class_balanced_weights``, as ``verl-prm train`` weighs a head fit's steps), or 1."""
    labelled = ~np.isnan(q)
    if not balance:
        return np.ones(int(labelled.sum()))
    kept = rollout[labelled]
    owners = list(dict.fromkeys(kept.tolist()))
    examples = [EncodedRollout([], [], q[labelled][kept == r].tolist()) for r in owners]
    per_rollout = dict(zip(owners, class_balanced_weights(examples)))
    return np.asarray([per_rollout[r] for r in kept.tolist()], dtype=np.float64)


def prompt_logit(rollouts: list[RolloutSteps]) -> tuple[float, dict]:
    """``logit(clip(mean))`` of the rollouts' prompt values (one per prompt value), else of their labelled steps'
    q; with what it was fitted on."""
    values = np.asarray([r.prompt_value for r in rollouts if not math.isnan(r.prompt_value)])
    source = "prompt values"
    if not values.size:
        values = np.concatenate([r.q[~np.isnan(r.q)] for r in rollouts])
        source = "labelled steps' q (no prompt values)"
    mean = float(np.clip(values.mean(), PROMPT_VALUE_CLIP, 1 - PROMPT_VALUE_CLIP))
    return math.log(mean / (1 - mean)), {"source": source, "labels": int(values.size), "mean": float(values.mean())}


def fit_token_logprob_head(features: list[np.ndarray], rollouts: list[RolloutSteps], *, result_regex: str | None,
                           l2: float, max_iterations: int, balance: bool) -> TokenLogprobHead:
    """The head fitted on the labelled steps of ``rollouts`` (their ``features``), in standardised units:
    ``fit_logistic_head`` gives ``logit = x . u + c``; with the training features' mean m and s.d. s (1 where a
    feature is constant), ``w = u * s`` and ``b = c + u . m`` give the same logits on ``(x - m) / s``."""
    x = np.concatenate(features) if features else np.zeros((0, len(feature_names(result_regex is not None))))
    q = np.concatenate([r.q for r in rollouts]) if rollouts else np.zeros(0)
    labelled = ~np.isnan(q)
    if not labelled.any():
        raise ValueError("verl-prm train --format token_logprob: no labelled training step (every q is NaN)")
    rollout = np.repeat(np.arange(len(rollouts)), [len(r.q) for r in rollouts])
    weights = step_weights(q, rollout, balance)
    fit = fit_logistic_head(torch.from_numpy(x[labelled]), torch.from_numpy(q[labelled]), torch.from_numpy(weights),
                            max_iterations=max_iterations, l2=l2)
    mean, std = x[labelled].mean(0), x[labelled].std(0)
    std = np.where(std > 1e-12, std, 1.0)
    weight = fit.weight.numpy()
    logit, prompt = prompt_logit(rollouts)
    record = {"labelled_steps": int(labelled.sum()), "rollouts": len(rollouts), "l2": l2, "loss": fit.loss,
              "iterations": fit.iterations, "converged": fit.converged, "gradient_norm": fit.gradient_norm,
              "weights": "class-balanced" if balance else "uniform", "prompt_value": prompt}
    head = TokenLogprobHead(feature_names(result_regex is not None), result_regex, weight * std, mean, std,
                            fit.bias + float(weight @ mean), logit, record)
    # how much faster the labels rise than the fitted values (1: the values have the labels' size)
    slope = calibration_slope(head.values(x[labelled]), q[labelled], weights)
    head.fit["calibration_slope"] = None if math.isnan(slope) else slope
    return head


def held_out_labels(rollouts: list[RolloutSteps]) -> list[EncodedRollout]:
    """The held-out labels of each rollout that has any (the prompt value it carries, then its labelled steps) as
    examples: targets, counts, prompt (what the metrics and the calibration read)."""
    examples = []
    for rollout in rollouts:
        labelled = ~np.isnan(rollout.q)
        targets, counts = rollout.q[labelled].tolist(), rollout.counts[labelled].tolist()
        if not math.isnan(rollout.prompt_value):
            targets, counts = [rollout.prompt_value, *targets], [rollout.prompt_count, *counts]
        if targets:
            examples.append(EncodedRollout([], [], targets, rollout.prompt, [int(c) for c in counts]))
    return examples


def held_out_values(head: TokenLogprobHead, features: list[np.ndarray], rollouts: list[RolloutSteps]) -> np.ndarray:
    """The head's values at the labels of :func:`held_out_labels`, in their order (v_0 at a prompt value)."""
    values = []
    for mine, rollout in zip(features, rollouts):
        if not math.isnan(rollout.prompt_value):
            values.append(head.prompt_value)
        values += head.values(mine)[~np.isnan(rollout.q)].tolist()
    return np.asarray(values, dtype=np.float64)


def check_output_dir(output: Path, overwrite: bool) -> None:
    """``output`` may be written: absent, empty, or (with ``overwrite``) holding a checkpoint; never a directory
    of other files."""
    if not output.exists():
        return
    if not output.is_dir():
        raise FileExistsError(f"--output-dir {output} is a file; pass a directory for the checkpoint")
    entries = list(output.iterdir())
    if not entries:
        return
    is_checkpoint = (output / "config.json").is_file() or holds_head(output) or any(output.glob("*.safetensors"))
    if not is_checkpoint:
        raise FileExistsError(f"--output-dir {output} holds files that are not a checkpoint ({entries[0].name}, ...); "
                              "pass a new or empty directory")
    if not overwrite:
        raise FileExistsError(f"--output-dir {output} already holds a checkpoint; pass --overwrite to replace it, or "
                              "another --output-dir")


def place(staging: Path, output: Path) -> None:
    """Rename the complete ``staging`` directory onto ``output`` (an earlier one set aside first, then removed)."""
    aside = None
    if output.exists():
        aside = output.with_name(f".{output.name}.old{os.getpid()}")
        output.rename(aside)
    staging.rename(output)
    if aside is not None:
        shutil.rmtree(aside)


def save_lm(init: str, tokenizer, staging: Path) -> None:
    """The --init causal LM in its stored dtype (``save_pretrained``: safetensors) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(init, dtype="auto", **from_pretrained_kwargs())
    save_model(model, tokenizer, staging)


def fit_token_logprob_critic(config: TrainConfig) -> dict:
    """Fit a ``token_logprob`` critic and write its checkpoint to ``config.output_dir`` (module docstring);
    returns a summary (checkpoint, held-out metrics, calibration, rollouts, the fit's record)."""
    output = Path(config.output_dir)
    check_output_dir(output, config.overwrite)
    init = resolve_checkpoint(config.init, "--init")
    tokenizer = load_critic_tokenizer(resolve_checkpoint(config.tokenizer, "--tokenizer") if config.tokenizer else init)
    train_frame, eval_frame = read_frames(config, print)
    encode = dict(max_length=config.max_length, best_of_k=config.best_of_k, use_prompt_value=config.use_prompt_value,
                  note=print)
    train = encode_rollouts(train_frame, tokenizer, **encode)
    evaluation = encode_rollouts(eval_frame, tokenizer, **encode) if len(eval_frame) else []
    examples = held_out_labels(evaluation)
    check_calibration_labels(config, examples)
    device = torch.device("cpu" if config.cpu or not torch.cuda.is_available() else "cuda")
    dtype = resolve_dtype(None, device)
    adapter = TokenLogprobFormat.load_lm(init, tokenizer, dtype=dtype, device=device, result_regex=config.result_regex,
                                         attn_implementation=default_attn_implementation(device, dtype),
                                         allow_pickle=allow_pickle_default())
    critic = ProverCritic(adapter.to(device), tokenizer, device=device)
    train_features = extract_step_features(critic, train, config.progress)
    eval_features = extract_step_features(critic, evaluation, config.progress)
    del critic, adapter
    head = fit_token_logprob_head(train_features, train, result_regex=config.result_regex, l2=config.head_l2,
                                  max_iterations=config.max_steps, balance=config.balance)
    predictions = held_out_values(head, eval_features, evaluation)
    targets = np.asarray([t for e in examples for t in e.targets], dtype=np.float64)
    metrics = {f"eval/{k}": v for k, v in value_metrics(predictions, targets).items()} if targets.size else {}
    if targets.size and auroc_note(targets) is not None:
        metrics["eval/auroc_note"] = auroc_note(targets)
    head.fit.update({"dtype": str(dtype).removeprefix("torch."), "init": str(config.init), "metrics": metrics})
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    calibration = None
    try:
        save_lm(init, tokenizer, staging)
        write_head(staging, head)
        if config.calibration != "none":
            refit = "nothing was written: rerun with another --calibration (isotonic, none)"
            calibration_metrics, calibration = calibrate_held_out(config.calibration, (predictions, targets), examples,
                                                                  staging, staging, print, refit)
            metrics.update(calibration_metrics)
            calibration = output / calibration.name
        (staging / "eval_metrics.json").write_text(json.dumps(metrics, indent=2, default=float) + "\n")
        place(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"verl-prm train: wrote the token_logprob critic {output} ({head.fit['labelled_steps']} labelled steps, "
          f"{len(head.features)} features)")
    slope = head.fit["calibration_slope"]
    if slope is not None and slope > FLAT_VALUES_SLOPE:
        print(f"verl-prm train: warning: on the training steps the labels rise {slope:.1f}x as fast as the critic's "
              f"values (calibration slope; 1: the values have the labels' size). --head-l2 {config.head_l2:g} "
              "shrinks the head, and the process term alpha * (v_h - v_{h-1}) shrinks with it; lower --head-l2 "
              "(0, the default, suits a few features)")
    return {"checkpoint": str(output), "metrics": metrics, "calibration": str(calibration) if calibration else None,
            "train_rollouts": len(train), "eval_rollouts": len(evaluation), "fit": head.fit}


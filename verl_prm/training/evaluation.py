"""Held-out evaluation of a training run: the values at every labelled held-out step, their metrics (logged once
per step), and the calibration fitted on them at the end of the run.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from verl_prm.checkpoints import weights_digest
from verl_prm.training.calibration import (
    CALIBRATION_FILE,
    MIN_CALIBRATION_LABELS,
    CalibrationError,
    cross_fitted_values,
    fit_calibration,
    label_weights,
    write_calibration,
)
from verl_prm.training.config import TrainConfig
from verl_prm.training.data import EncodedRollout, collate
from verl_prm.training.losses import gather_step_logits
from verl_prm.training.metrics import expected_calibration_error, mse, plot_reliability, value_metrics
from verl_prm.training.run import TrainingRun, log_record

__all__ = ["evaluate_examples", "auroc_note", "calibrate_held_out", "check_calibration_labels"]

REFIT_CALIBRATION = ("the checkpoint is written: rerun the same command with another --calibration (isotonic, none) "
                     "to refit without training")


@torch.inference_mode()
def evaluate_examples(model, examples: list[EncodedRollout], *, batch_size: int, pad_token_id: int,
                      device) -> tuple[np.ndarray, np.ndarray]:
    """Predicted values sigmoid(logit) and targets at every labelled position: two [num labelled steps] arrays."""
    was_training = model.training
    model.eval()
    predictions, targets = [], []
    for begin in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in collate(examples[begin : begin + batch_size], pad_token_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        values = torch.sigmoid(gather_step_logits(logits.float(), batch["positions"]))
        predictions.append(values[batch["step_mask"]].cpu().numpy())
        targets.append(batch["targets"][batch["step_mask"]].cpu().numpy())
    model.train(was_training)
    if not predictions:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(predictions).astype(np.float64), np.concatenate(targets).astype(np.float64)


def auroc_note(targets: np.ndarray) -> str | None:
    """Why the held-out AUROC is undefined (NaN), or None if it is defined: it needs steps of both classes."""
    positives = int(np.sum(targets >= 0.5))
    negatives = int(targets.size - positives)
    if targets.size == 0:
        return "AUROC is NaN: no held-out labelled steps"
    if positives == 0 or negatives == 0:
        side = "below" if positives == 0 else "at or above"
        return (f"AUROC is NaN: all {targets.size} held-out step labels are {side} 0.5 (one class); it needs both "
                "classes. Hold out more prompts (--eval-fraction) or pass --eval-labels with mixed outcomes")
    return None


def evaluate_held_out(run: TrainingRun, step: int) -> dict:
    """Held-out metrics at ``step`` (main process), logged once per step."""
    accelerator = run.accelerator
    metrics: dict = {}
    if accelerator.is_main_process and run.eval_examples:
        predictions, targets = evaluate_examples(accelerator.unwrap_model(run.model), run.eval_examples,
                                                 batch_size=run.config.eval_batch_size, pad_token_id=run.pad_token_id,
                                                 device=accelerator.device)
        run.eval_values = (predictions, targets)
        metrics = {f"eval/{k}": v for k, v in value_metrics(predictions, targets).items()}
        why = auroc_note(targets)
        if why is not None:
            metrics["eval/auroc_note"] = why
            accelerator.print(f"verl-prm train: step {step}: {why}")
        if step not in run.logged_evals:  # a rerun of a finished run evaluates again but logs no second line
            log_record(run, {"step": step, **metrics})
            run.logged_evals.add(step)
    accelerator.wait_for_everyone()
    return metrics


def check_calibration_labels(config: TrainConfig, eval_examples: list[EncodedRollout]) -> None:
    """A calibration needs enough held-out labels, of more than one value, to fit (checked before training)."""
    if config.calibration == "none":
        return
    held_out_labels = sum(len(e.targets) for e in eval_examples)
    if held_out_labels < MIN_CALIBRATION_LABELS:
        raise ValueError(f"--calibration {config.calibration} needs at least {MIN_CALIBRATION_LABELS} held-out labels "
                         f"to fit; {config.eval_labels or config.labels} leaves {held_out_labels}: hold out more "
                         "prompts (--eval-fraction, --eval-labels) or pass --calibration none")
    held_out_values = {t for e in eval_examples for t in e.targets}
    if len(held_out_values) == 1:
        raise ValueError(f"--calibration {config.calibration}: all {held_out_labels} held-out labels are "
                         f"{held_out_values.pop()}, so there is no value-to-label relation to fit: hold out "
                         "prompts with mixed outcomes (--eval-labels, --eval-fraction) or pass --calibration none")


def finish_run(run: TrainingRun, last_checkpoint: Path | None, metrics: dict) -> Path | None:
    """The main process's end of a run: the calibration (fitted, or an earlier fit's file removed under
    ``--calibration none``) and ``eval_metrics.json``; the calibration file's path."""
    calibration_path = None
    if run.config.calibration != "none":
        calibration_metrics, calibration_path = calibrate(run, last_checkpoint)
        metrics.update(calibration_metrics)
    elif last_checkpoint is not None and (last_checkpoint / CALIBRATION_FILE).exists():  # a rerun with --calibration none: the model has none
        (last_checkpoint / CALIBRATION_FILE).unlink()
        run.accelerator.print(f"verl-prm train: --calibration none: removed {last_checkpoint / CALIBRATION_FILE} of "
                              "an earlier fit")
    (run.output_dir / "eval_metrics.json").write_text(json.dumps(metrics, indent=2))
    return calibration_path


def calibrate(run: TrainingRun, checkpoint: Path) -> tuple[dict, Path]:
    """Fit ``config.calibration`` on the final held-out values, write ``checkpoint/calibration.json`` and
    ``reliability.png`` (:func:`calibrate_held_out`)."""
    return calibrate_held_out(run.config.calibration, run.eval_values, run.eval_examples, checkpoint,
                              run.output_dir, run.accelerator.print)


def calibrate_held_out(method: str, eval_values: tuple[np.ndarray, np.ndarray], eval_examples: list[EncodedRollout],
                       checkpoint: Path, plot_dir: Path, note: Callable[[str], None],
                       refit: str = REFIT_CALIBRATION) -> tuple[dict, Path]:
    """Fit calibration ``method`` on held-out ``(predictions, targets)`` (the labels of ``eval_examples``, in
    order: their counts weigh them, their prompts group them), write ``checkpoint/calibration.json`` and
    ``plot_dir/reliability.png``; the held-out metrics of the calibrated values ("eval/calibrated_*": on the
    labels the map was fitted on, and cross-fitted by prompt,
    :func:`~verl_prm.training.calibration.cross_fitted_values`). A map that cannot be fitted is a
    CalibrationError ending with ``refit`` (what to do)."""
    predictions, targets = eval_values
    weights = label_weights(np.concatenate([e.counts for e in eval_examples]))
    prompts = np.concatenate([[e.prompt] * len(e.targets) for e in eval_examples])
    try:
        calibration = fit_calibration(method, predictions, targets, weights, weights_digest(checkpoint))
    except CalibrationError as error:
        raise CalibrationError(f"verl-prm train: fitting the {method} calibration of {checkpoint} on the held-out "
                               f"labels failed ({error}); {refit}") from None
    calibrated = calibration(predictions)
    metrics: dict = {"eval/calibration": method, "eval/calibration_labels": float(targets.size),
                     "eval/calibrated_ece": expected_calibration_error(calibrated, targets),
                     "eval/calibrated_mse": mse(calibrated, targets)}
    try:
        cross = cross_fitted_values(method, predictions, targets, weights, prompts)
        metrics["eval/calibrated_ece_cross_fitted"] = expected_calibration_error(cross, targets)
        metrics["eval/calibrated_mse_cross_fitted"] = mse(cross, targets)
    except CalibrationError as error:  # the map itself was fitted; only its out-of-sample estimate is missing
        metrics["eval/calibration_note"] = f"no cross-fitted estimate: {error}"
        note(f"verl-prm train: {metrics['eval/calibration_note']}")
    measured = {k.removeprefix("eval/"): v for k, v in metrics.items() if k != "eval/calibration"}
    calibration = replace(calibration, metrics={"ece": expected_calibration_error(predictions, targets), **measured})
    path = write_calibration(calibration, checkpoint)
    plot = plot_dir / "reliability.png"
    plot_reliability(plot, {"raw": (predictions, targets), method: (calibrated, targets)},
                     title=f"held-out labels, {checkpoint.name}")
    cross_text = (f", cross-fitted {metrics['eval/calibrated_ece_cross_fitted']:.4f}"
                  if "eval/calibrated_ece_cross_fitted" in metrics else "")
    note(f"verl-prm train: {calibration.describe()}: held-out ECE {calibration.metrics['ece']:.4f} -> "
         f"{metrics['eval/calibrated_ece']:.4f}{cross_text}; wrote {path} and {plot}")
    return metrics, path

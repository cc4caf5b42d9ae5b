"""Training a PAV (process advantage verifier) on soft step labels, with accelerate.

One code path for CPU, one GPU and several GPUs (``accelerate launch`` -> DDP): the model and optimizer go
through ``accelerate.Accelerator``; every process draws the same global batch (a pure function of the step,
see :func:`~verl_prm.training.data.sample_batch_indices`) and trains on its slice of it.

Output directory::

    checkpoint-0000200/   model.safetensors + config.json + tokenizer files (loads with
                          ProverCritic.from_pretrained(path, format="value_head")) + training_state.pt
                          (optimizer, scheduler, step, config); the final one also calibration.json (the
                          map fitted on the held-out labels, --calibration; ProverCritic applies it)
    metrics.jsonl         one line per logged training step and per evaluation
    .verl-prm.lock        held by the one process training here (verl_prm.locking; released when it exits)
    eval_metrics.json     the final held-out evaluation (raw values, and calibrated: eval/calibrated_*)
    reliability.png       mean held-out label against mean value per bin, raw and calibrated

A checkpoint is written to a temporary directory and renamed when complete. A rerun with the same arguments
resumes from the newest intact checkpoint (a damaged newer one is skipped with a warning): the weights, Adam
moments and schedule are restored and the batches of the remaining steps (and their dropout masks) are the ones
the uninterrupted run draws, so no example is lost or trained on twice. A resume refuses changed settings and
changed inputs (label shards, --init, --tokenizer, --init-config: digests stored in the checkpoint). With
``--no-resume`` the checkpoints and logs of an earlier run move to ``earlier-run-<time>/``, so the checkpoints at
the top level are always this run's. A non-finite loss or gradient norm stops the run before the step changes
the weights, so no checkpoint ever holds NaN weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from verl_prm.precision import mixed_precision_for
from verl_prm.resume import check_same_settings
from verl_prm.special_tokens import ensure_pad_token, generation_config_of
from verl_prm.training.config import TrainConfig
from verl_prm.training.data import (
    EncodedRollout,
    class_balanced_weights,
    collate,
    encode_labels,
    sample_batch_indices,
    split_by_prompt,
)
from verl_prm.training.losses import gather_step_logits, soft_label_bce, warmup_cosine_factor
from verl_prm.training.calibration import (
    CALIBRATION_FILE,
    MIN_CALIBRATION_LABELS,
    CalibrationError,
    cross_fitted_values,
    fit_calibration,
    label_weights,
    write_calibration,
)
from verl_prm.training.metrics import expected_calibration_error, mse, plot_reliability, value_metrics

__all__ = ["NonFiniteLossError", "train", "evaluate_examples", "latest_checkpoint", "build_model",
           "checkpoint_problem", "input_digests"]

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
# Settings a resumed run may change: they do not change what is trained (logging, saving, progress, memory).
# Every other setting must be the one the checkpoint was written with.
_RESUME_FREE_KEYS = ("output_dir", "resume", "progress", "log_every", "eval_every", "eval_batch_size", "save_every",
                     "keep_checkpoints", "gradient_checkpointing", "calibration")


class NonFiniteLossError(ValueError):
    """The training loss or gradient norm became NaN or infinite; the run stopped before that step."""


def _checkpoint_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the ``checkpoint-<step>`` directories at the top of ``output_dir``, by step."""
    found = []
    for path in output_dir.glob("checkpoint-*"):
        match = _CHECKPOINT.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be resumed from or loaded, or None if it is intact: no
    training_state.pt, missing or cut-short weights (:func:`verl_prm.checkpoints.safetensors_problem`), or
    missing tokenizer files. Reads file headers only."""
    from verl_prm.checkpoints import CheckpointError, check_weights, safetensors_problem, tokenizer_files_problem

    path = Path(path)
    if not (path / "training_state.pt").is_file():
        return "no training_state.pt"
    try:
        check_weights(path, "checkpoint", allow_pickle=False)
    except CheckpointError as error:
        return str(error)
    for file in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem is not None:
            return problem
    problem = tokenizer_files_problem(path)
    return None if problem is None else f"it {problem}"


def latest_checkpoint(output_dir: str | Path, note: Callable[[str], None] | None = None) -> Path | None:
    """The intact checkpoint with the highest step in ``output_dir`` (None if there is none).

    A newer checkpoint that is damaged (:func:`checkpoint_problem`: e.g. weights cut short by a full disk) is
    skipped with a warning (``note``, default ``warnings.warn``) naming it and the checkpoint used instead.
    """
    note = note or (lambda message: warnings.warn(message, stacklevel=3))
    skipped = []
    for _, path in reversed(_checkpoint_dirs(Path(output_dir))):
        problem = checkpoint_problem(path)
        if problem is None:
            if skipped:
                note(f"verl-prm: skipping damaged checkpoint(s) {'; '.join(skipped)}; using the older intact {path}")
            return path
        skipped.append(f"{path} ({problem})")
    if skipped:
        note(f"verl-prm: no intact checkpoint in {output_dir}: {'; '.join(skipped)}")
    return None


def _path_digests(path: str | Path) -> dict[str, str]:
    """{file name relative to ``path``: digest} of a file or of every file under a directory (hidden ones and
    ``__pycache__`` skipped)."""
    from verl_prm.checkpoints import file_digest

    path = Path(path)
    if path.is_file():
        return {path.name: file_digest(path)}
    return {str(file.relative_to(path)): file_digest(file) for file in sorted(path.rglob("*"))
            if file.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                          for part in file.relative_to(path).parts)}


def input_digests(config: TrainConfig) -> dict[str, dict[str, str]]:
    """Digests of what a run reads: {"--labels": {shard: digest}, "--eval-labels": ..., "--init": {file: digest},
    "--init-config": ..., "--tokenizer": ...} (absent inputs omitted). A resume compares them."""
    from verl_prm.checkpoints import file_digest
    from verl_prm.labeling.format import label_files

    digests: dict[str, dict[str, str]] = {}
    for flag, paths in (("--labels", config.labels), ("--eval-labels", config.eval_labels)):
        if paths:
            digests[flag] = {str(file): file_digest(file) for file in label_files(paths)}
    for flag, path in (("--init", config.init), ("--init-config", config.init_config), ("--tokenizer", config.tokenizer)):
        if path is not None and Path(path).exists():
            digests[flag] = _path_digests(path)
    return digests


def _changed_inputs(stored: dict[str, dict[str, str]], current: dict[str, dict[str, str]]) -> list[str]:
    """One phrase per input whose files differ: "--labels: added b.parquet; changed a.parquet"."""
    changes = []
    for flag in sorted(set(stored) | set(current), key=lambda f: (f not in current, f)):
        before, after = stored.get(flag, {}), current.get(flag, {})
        if before == after:
            continue
        parts = []
        for verb, names in (("added", sorted(set(after) - set(before))), ("removed", sorted(set(before) - set(after))),
                            ("changed", sorted(n for n in set(before) & set(after) if before[n] != after[n]))):
            if names:
                parts.append(f"{verb} {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}")
        changes.append(f"{flag}: {'; '.join(parts)}")
    return changes


def build_model(config: TrainConfig, tokenizer, checkpoint: Path | None = None):
    """A token-classification model with one logit per token.

    ``checkpoint`` (resume) or ``config.init``: ``AutoModelForTokenClassification.from_pretrained`` (a causal
    LM checkpoint initialises the backbone, the one-logit head is new). ``config.init_config``: a config.json
    (file or directory) for a new model with random weights (seeded by ``config.seed``).
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    torch.manual_seed(config.seed)
    if checkpoint is not None or config.init is not None:
        path = str(checkpoint or config.init)
        if checkpoint is None:
            model = value_head_from_init(path)
        else:
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, trust_remote_code=False)
    else:
        source = Path(config.init_config)
        if source.is_dir():
            model_config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        else:
            values = json.loads(source.read_text())
            model_config = AutoConfig.for_model(values.pop("model_type"), **values)
        model_config.num_labels = 1
        if getattr(model_config, "vocab_size", None) is not None and model_config.vocab_size < len(tokenizer):
            raise ValueError(f"init_config vocab_size={model_config.vocab_size} < tokenizer size {len(tokenizer)}")
        model = AutoModelForTokenClassification.from_config(model_config)
    if model.config.num_labels != 1:
        raise ValueError(f"the critic needs one logit per token; the model has num_labels={model.config.num_labels}")
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def value_head_of(model) -> torch.nn.Module:
    """The one-logit head of a token-classification model (``score`` in most architectures, ``classifier`` in
    BERT-like ones): what ``--freeze-backbone`` trains."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(f"--freeze-backbone: {type(model).__name__} has no `score` or `classifier` head to train alone; "
                     "train the whole model (drop --freeze-backbone)")


def value_head_from_init(path: str):
    """A one-logit token-classification model on the weights at ``path`` (``--init``, usually a causal LM).

    The new head (``score.*``/``classifier.*``) missing from a causal LM checkpoint, and its LM head left
    unused, are the intent here, so transformers' load report is silenced for exactly those keys; any other
    missing, unexpected or mismatched key is still reported (a warning naming the keys).
    """
    import warnings

    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, trust_remote_code=False,
                                                                      output_loading_info=True)
    finally:
        hf_logging.set_verbosity(previous)
    head_prefixes = ("score.", "classifier.")
    surprises = {
        "missing": [k for k in info.get("missing_keys", ()) if not str(k).startswith(head_prefixes)],
        "unexpected": [k for k in info.get("unexpected_keys", ()) if not str(k).startswith("lm_head.")],
        "mismatched": [k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys", ())],
    }
    surprises = {kind: sorted(map(str, keys)) for kind, keys in surprises.items() if keys}
    if surprises:
        warnings.warn(f"verl-prm train: initialising the critic from {path}: keys other than the new value head "
                      f"did not load as expected: {surprises}", stacklevel=2)
    return model


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


def _tokenizer_as_checkpoint_loads_it(tokenizer, model_config, output_dir: Path, note: Callable[[str], None]):
    """The tokenizer that ``AutoTokenizer.from_pretrained(checkpoint)`` will return.

    transformers chooses a checkpoint's tokenizer class from its config's ``model_type`` (a byte-level BPE saved
    next to a qwen2 config loads as ``Qwen2Tokenizer``, whose pre-tokenizer splits text differently). Training
    with the reloaded tokenizer makes training, resuming and scoring with ProverCritic tokenise alike.
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".tokenizer-") as directory:
        model_config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        reloaded = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    if type(reloaded) is not type(tokenizer):
        note(f"verl-prm train: the checkpoint will load the tokenizer as {type(reloaded).__name__} (not "
             f"{type(tokenizer).__name__}); training uses that class so that scoring tokenises the same way")
    return reloaded


def read_log(path: Path, note: Callable[[str], None] = print) -> list[dict]:
    """The records of ``metrics.jsonl``. A torn last line (the process died while appending it) is skipped
    with a note; a line elsewhere that is not a JSON object is an error naming the file and the line."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not an object")
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if all(not rest.strip() for rest in lines[number:]):
                note(f"verl-prm train: {path} line {number} is torn (cut off while it was written: {error}); "
                     "dropping it")
                break
            raise ValueError(f"{path} line {number} is not a JSON record ({error}) and is not the last line; fix "
                             "or delete that line to resume") from None
        records.append(record)
    return records


def _trim_log(path: Path, step: int, note: Callable[[str], None] = print) -> list[dict]:
    """Drop log lines of steps after ``step`` (written after the checkpoint a resumed run starts from) and a
    torn last line; returns the records kept."""
    if not path.exists():
        return []
    kept = [record for record in read_log(path, note) if record.get("step", 0) <= step]
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(temp, path)
    return kept


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


def train(config: TrainConfig, *, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) a PAV; returns a summary with the final held-out metrics and checkpoint path.

    ``on_step(step, record)`` is called after every optimizer step (tests use it to simulate a crash).
    The output directory is locked against a second writer (:mod:`verl_prm.locking`) by the main process
    (``RANK`` 0 or unset under ``accelerate launch``/``torchrun``).
    """
    from verl_prm.locking import DirectoryLock

    if os.environ.get("RANK", "0") != "0":
        return _train(config, on_step)
    with DirectoryLock(config.output_dir, "verl-prm train"):
        return _train(config, on_step)


@dataclass
class _Run:
    """What the steps of one training run share."""

    config: TrainConfig
    accelerator: object
    output_dir: Path
    model: object
    tokenizer: object
    pad_token_id: int
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_examples: list[EncodedRollout]
    eval_examples: list[EncodedRollout]
    weights: np.ndarray
    inputs: dict
    logged_evals: set[int] = field(default_factory=set)
    # (predictions, targets) of the latest held-out evaluation (main process): what the calibration is fitted on
    eval_values: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def log_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"


def _train(config: TrainConfig, on_step: Callable[[int, dict], None] | None) -> dict:
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    device = "cpu" if config.cpu or not torch.cuda.is_available() else "cuda"
    accelerator = Accelerator(mixed_precision=mixed_precision_for(config.mixed_precision, device), cpu=config.cpu)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    inputs = input_digests(config)
    if not config.resume and accelerator.is_main_process:
        _set_aside_earlier_run(output_dir, accelerator.print)
    accelerator.wait_for_everyone()
    checkpoint, state = _resume_point(config, output_dir, inputs, accelerator.print) if config.resume else (None, None)
    tokenizer, model = _tokenizer_and_model(config, checkpoint, output_dir, accelerator.print)
    generation = generation_config_of(config.init) if checkpoint is None and config.init is not None else None
    pad_token_id = ensure_pad_token(tokenizer, generation, log=accelerator.print,
                                    source=f"verl-prm train: tokenizer {checkpoint or config.tokenizer or config.init}")
    train_examples, eval_examples = _examples(config, tokenizer, accelerator.print)
    _check_calibration_labels(config, eval_examples)
    weights = class_balanced_weights(train_examples) if config.balance else np.full(len(train_examples), 1.0 / len(train_examples))
    optimizer, scheduler = _optimizer(config, model)
    # The scheduler is not prepared: accelerate would step it once per process; ours counts optimizer steps.
    model, optimizer = accelerator.prepare(model, optimizer)
    start_step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = int(state["step"])
    run = _Run(config, accelerator, output_dir, model, tokenizer, pad_token_id, optimizer, scheduler, train_examples,
               eval_examples, weights, inputs)
    if accelerator.is_main_process:
        kept = _trim_log(run.log_path, start_step, accelerator.print)
        run.logged_evals = {int(r["step"]) for r in kept if any(k.startswith("eval/") for k in r)}
        accelerator.print(
            f"verl-prm train: {len(train_examples)} train rollouts ({sum(len(e.targets) for e in train_examples)} "
            f"labels), {len(eval_examples)} held-out rollouts; steps {start_step} -> {config.max_steps}"
            + (f", resumed from {checkpoint}" if checkpoint is not None else "")
        )

    metrics: dict = {}
    last_checkpoint = checkpoint
    bar = tqdm(total=config.max_steps, initial=start_step, desc="training PAV", unit="step",
               disable=not (config.progress and accelerator.is_main_process) or config.head_fit == "newton")
    if config.head_fit == "newton" and start_step < config.max_steps:
        # one fit to the optimum; its checkpoint is the run's only one (a rerun finds it and skips the fit)
        record = _fit_head(run)
        _log(run, record)
        metrics = _evaluate(run, config.max_steps)
        record.update(metrics)
        last_checkpoint = _save(run, config.max_steps)
        if on_step is not None:
            on_step(config.max_steps, record)
    adam_steps = range(start_step, config.max_steps) if config.head_fit == "adam" else range(0)
    for step in adam_steps:
        record = _optimizer_step(run, step, last_checkpoint)
        completed = step + 1
        if completed % config.log_every == 0 or completed == config.max_steps:
            _log(run, record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if (config.eval_every and completed % config.eval_every == 0) or completed == config.max_steps:
            metrics = _evaluate(run, completed)
            record.update(metrics)
        if (config.save_every and completed % config.save_every == 0) or completed == config.max_steps:
            last_checkpoint = _save(run, completed)
        if on_step is not None:
            on_step(completed, record)
    bar.close()
    if start_step >= config.max_steps:
        metrics = _evaluate(run, config.max_steps)
    calibration_path = _finish(run, last_checkpoint, metrics) if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    return {"checkpoint": str(last_checkpoint) if last_checkpoint else None, "metrics": metrics,
            "calibration": str(calibration_path) if calibration_path else None,
            "train_rollouts": len(train_examples), "eval_rollouts": len(eval_examples), "start_step": start_step}


def _check_calibration_labels(config: TrainConfig, eval_examples: list[EncodedRollout]) -> None:
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


def _finish(run: _Run, last_checkpoint: Path | None, metrics: dict) -> Path | None:
    """The main process's end of a run: the calibration (fitted, or an earlier fit's file removed under
    ``--calibration none``) and ``eval_metrics.json``; the calibration file's path."""
    calibration_path = None
    if run.config.calibration != "none":
        calibration_metrics, calibration_path = _calibrate(run, last_checkpoint)
        metrics.update(calibration_metrics)
    elif last_checkpoint is not None and (last_checkpoint / CALIBRATION_FILE).exists():  # a rerun with --calibration none: the model has none
        (last_checkpoint / CALIBRATION_FILE).unlink()
        run.accelerator.print(f"verl-prm train: --calibration none: removed {last_checkpoint / CALIBRATION_FILE} of "
                              "an earlier fit")
    (run.output_dir / "eval_metrics.json").write_text(json.dumps(metrics, indent=2))
    return calibration_path


def _calibrate(run: _Run, checkpoint: Path) -> tuple[dict, Path]:
    """Fit ``config.calibration`` on the final held-out values, write ``checkpoint/calibration.json`` and
    ``reliability.png``; the held-out metrics of the calibrated values ("eval/calibrated_*": on the labels the
    map was fitted on, and cross-fitted by prompt, :func:`~verl_prm.training.calibration.cross_fitted_values`)."""
    from verl_prm.checkpoints import weights_digest

    method = run.config.calibration
    predictions, targets = run.eval_values
    weights = label_weights(np.concatenate([e.counts for e in run.eval_examples]))
    prompts = np.concatenate([[e.prompt] * len(e.targets) for e in run.eval_examples])
    try:
        calibration = fit_calibration(method, predictions, targets, weights, weights_digest(checkpoint))
    except CalibrationError as error:
        raise CalibrationError(f"verl-prm train: fitting the {method} calibration of {checkpoint} on the held-out "
                               f"labels failed ({error}); the checkpoint is written: rerun the same command with "
                               "another --calibration (isotonic, none) to refit without training") from None
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
        run.accelerator.print(f"verl-prm train: {metrics['eval/calibration_note']}")
    measured = {k.removeprefix("eval/"): v for k, v in metrics.items() if k != "eval/calibration"}
    calibration = replace(calibration, metrics={"ece": expected_calibration_error(predictions, targets), **measured})
    path = write_calibration(calibration, checkpoint)
    plot = run.output_dir / "reliability.png"
    plot_reliability(plot, {"raw": (predictions, targets), method: (calibrated, targets)},
                     title=f"held-out labels, {checkpoint.name}")
    cross_text = (f", cross-fitted {metrics['eval/calibrated_ece_cross_fitted']:.4f}"
                  if "eval/calibrated_ece_cross_fitted" in metrics else "")
    run.accelerator.print(f"verl-prm train: {calibration.describe()}: held-out ECE "
                          f"{calibration.metrics['ece']:.4f} -> {metrics['eval/calibrated_ece']:.4f}{cross_text}; "
                          f"wrote {path} and {plot}")
    return metrics, path


def _set_aside_earlier_run(output_dir: Path, note: Callable[[str], None]) -> None:
    """``--no-resume``: move the checkpoints and logs of an earlier run into ``earlier-run-<time>/``, so that
    the top-level checkpoints (what :func:`latest_checkpoint` and rotation see) are this run's alone."""
    earlier = [path for _, path in _checkpoint_dirs(output_dir)]
    earlier += [output_dir / name for name in ("metrics.jsonl", "eval_metrics.json") if (output_dir / name).exists()]
    if not earlier:
        return
    archive = output_dir / f"earlier-run-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while archive.exists():
        suffix += 1
        archive = output_dir / f"earlier-run-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
    archive.mkdir()
    for path in earlier:
        os.replace(path, archive / path.name)
    note(f"verl-prm train: --no-resume: moved the earlier run's {', '.join(p.name for p in earlier)} to {archive}")


def _resume_point(config: TrainConfig, output_dir: Path, inputs: dict,
                  note: Callable[[str], None]) -> tuple[Path | None, dict | None]:
    """The newest intact checkpoint and its training state, after checking that the run's settings and inputs
    are the ones it was written with; (None, None) for a fresh start."""
    checkpoint = latest_checkpoint(output_dir, note)
    while checkpoint is not None:
        try:
            state = torch.load(checkpoint / "training_state.pt", map_location="cpu", weights_only=False)
            break
        except Exception as error:  # a pickle cut short raises EOFError, UnpicklingError or RuntimeError
            note(f"verl-prm train: skipping damaged checkpoint {checkpoint} (training_state.pt cannot be read: "
                 f"{type(error).__name__}: {error})")
            older = [path for step, path in _checkpoint_dirs(output_dir) if path.name < checkpoint.name
                     and checkpoint_problem(path) is None]
            checkpoint = older[-1] if older else None
    if checkpoint is None:
        damaged = [path.name for _, path in _checkpoint_dirs(output_dir)]
        if damaged:  # starting over here would mix a new run with the remains of the old one
            raise ValueError(f"{output_dir} holds only damaged checkpoints ({', '.join(damaged)}; see the notes above): "
                             "rerun with --no-resume to set them aside and start over, or use a new --output-dir")
        return None, None
    check_same_settings(state["config"], asdict(config), source=checkpoint, what="a checkpoint",
                        fix="start over with --no-resume or a new --output-dir", ignore=_RESUME_FREE_KEYS)
    changes = _changed_inputs(state.get("inputs", {}), inputs)
    if changes:
        raise ValueError(f"cannot resume from {checkpoint}: inputs changed since it was written ({'; '.join(changes)}); "
                         "restore them, or start over with --no-resume or a new --output-dir")
    return checkpoint, state


def _tokenizer_and_model(config: TrainConfig, checkpoint: Path | None, output_dir: Path,
                         note: Callable[[str], None]):
    """The tokenizer and the model to train, after the checks that need no model (paths, tokenizer files) and
    the one that needs both (every token id has an embedding)."""
    from transformers import AutoTokenizer

    from verl_prm.checkpoints import check_tokenizer_files, resolve_checkpoint

    if checkpoint is None and config.init is not None:
        # no such directory, a file, no weights, pickle-only weights: an error naming --init before any load
        resolve_checkpoint(config.init, "--init")
    if checkpoint is not None:
        tokenizer_path, flag = str(checkpoint), "checkpoint"
    elif config.tokenizer is not None:
        tokenizer_path, flag = config.tokenizer, "--tokenizer"
    else:
        tokenizer_path, flag = config.init, "--init (no --tokenizer given)"
    check_tokenizer_files(tokenizer_path, flag)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
    model = build_model(config, tokenizer, checkpoint)
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ValueError(f"the tokenizer of {flag} {tokenizer_path} has {len(tokenizer)} tokens but the model has "
                         f"{embeddings} embeddings: token ids >= {embeddings} have none. Use the model's own "
                         "tokenizer (--tokenizer), or a model whose vocab_size covers it")
    if checkpoint is None:
        tokenizer = _tokenizer_as_checkpoint_loads_it(tokenizer, model.config, output_dir, note)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    if config.freeze_backbone:
        head = value_head_of(model)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for parameter in head.parameters():
            parameter.requires_grad_(True)
    return tokenizer, model


def _with_origin(frame: pd.DataFrame, paths) -> pd.DataFrame:
    """``frame`` (rows of ``read_labels(paths)``, in order) with the ``shard`` and ``shard_row`` of each row."""
    import pyarrow.parquet as pq

    from verl_prm.labeling.format import label_files

    shards, rows = [], []
    for file in label_files(paths):
        count = pq.read_metadata(file).num_rows
        shards += [str(file)] * count
        rows += list(range(count))
    return frame.assign(shard=shards, shard_row=rows)


def _check_held_out(train_frame, eval_frame, note: Callable[[str], None]) -> None:
    """Refuse held-out rollouts that are training rollouts. A rollout's identity is
    ``(prompt_index, rollout_index, prompt, response)`` (verl_prm.labeling.format.check_duplicate_rollouts),
    so a copied or renamed shard is caught, not only a shard named twice. Shared prompts only get a note."""
    key = ["prompt_index", "rollout_index", "prompt", "response"]
    shared = eval_frame.merge(train_frame[key + ["shard", "shard_row"]], on=key, suffixes=("", "_train"))
    if len(shared):
        first = shared.iloc[0]
        raise ValueError(f"--eval-labels and --labels share {len(shared)} rollouts (e.g. {first['shard']} row "
                         f"{first['shard_row']} is {first['shard_train']} row {first['shard_row_train']}, "
                         f"prompt_index={first['prompt_index']}, rollout_index={first['rollout_index']}): held-out "
                         "metrics would be measured on training data; pass held-out shards of other rollouts")
    prompts = set(eval_frame["prompt"]) & set(train_frame["prompt"])
    if prompts:
        note(f"verl-prm train: {len(prompts)} of the {eval_frame['prompt'].nunique()} held-out prompts also have "
             "training rollouts (their step prefixes overlap); the held-out metrics are optimistic for them")


def _examples(config: TrainConfig, tokenizer, note: Callable[[str], None]) -> tuple[list, list]:
    """The encoded training and held-out rollouts (held out: --eval-labels, else a split by prompt)."""
    from verl_prm.labeling.format import read_labels

    frame = _with_origin(read_labels(config.labels), config.labels)
    if config.eval_labels:
        train_frame, eval_frame = frame, _with_origin(read_labels(config.eval_labels), config.eval_labels)
        _check_held_out(train_frame, eval_frame, note)
    else:
        train_frame, eval_frame = split_by_prompt(frame, config.held_out_fraction, config.seed)
    encode = dict(max_length=config.max_length, best_of_k=config.best_of_k, use_prompt_value=config.use_prompt_value)
    train_examples, train_stats = encode_labels(train_frame, tokenizer, **encode)
    eval_examples = encode_labels(eval_frame, tokenizer, **encode)[0] if len(eval_frame) else []
    if not train_examples:
        raise ValueError(f"no labelled steps to train on in {config.labels}")
    for message in train_stats.notes:
        note(f"verl-prm train: {message}")
    return train_examples, eval_examples


def _optimizer(config: TrainConfig, model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: warmup_cosine_factor(t, config.warmup_steps, config.max_steps, config.min_lr_ratio)
    )
    return optimizer, scheduler


def _optimizer_step(run: _Run, step: int, last_checkpoint: Path | None) -> dict:
    """One optimizer step (step -> step + 1) on this process's slice of the global batch; its log record.

    Raises NonFiniteLossError before the weights change if the loss or the gradient norm is NaN or infinite.
    """
    config, accelerator, model = run.config, run.accelerator, run.model
    world, rank = accelerator.num_processes, accelerator.process_index
    # Dropout and any other randomness of a step is seeded by (seed, step, rank): a resumed run repeats
    # the uninterrupted run's step exactly without carrying RNG state through the checkpoint.
    torch.manual_seed((config.seed * 1_000_003 + step) * 4099 + rank)
    indices = sample_batch_indices(run.weights, config.batch_size * world * config.grad_accum, step, config.seed)
    losses = []
    for micro in range(config.grad_accum):
        begin = (micro * world + rank) * config.batch_size
        batch = collate([run.train_examples[i] for i in indices[begin : begin + config.batch_size]], run.pad_token_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        sync = accelerator.no_sync(model) if micro < config.grad_accum - 1 else contextlib.nullcontext()
        with sync:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = soft_label_bce(gather_step_logits(logits, batch["positions"]), batch["targets"], batch["step_mask"])
            accelerator.backward(loss / config.grad_accum)
        losses.append(loss.detach().float().item())
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.grad_clip) if config.grad_clip else None
    completed = step + 1
    bad = [f"loss {value}" for value in losses if not math.isfinite(value)]
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        bad.append(f"gradient norm {float(grad_norm)}")
    if bad:
        kept = (f"the last good checkpoint, {last_checkpoint}, is kept" if last_checkpoint is not None
                else "no checkpoint was written")
        raise NonFiniteLossError(
            f"step {completed}: {bad[0]} is not finite; training stopped before this step changed the weights and "
            f"{kept}. Check the --init weights for NaN/inf, or lower --lr (or use --mixed-precision no)")
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    record = {"step": completed, "loss": float(np.mean(losses)), "lr": run.scheduler.get_last_lr()[0]}
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    return record


@torch.no_grad()
def _head_inputs(run: _Run) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The value head's input at every labelled training step, with its target and its weight (the rollout's
    sampling weight, so that the full-batch loss is the expectation of the sampled batches' loss): [N, d], [N],
    [N]."""
    from tqdm.auto import tqdm

    model = run.accelerator.unwrap_model(run.model)
    head = value_head_of(model)
    captured: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    was_training = model.training
    model.eval()
    features, targets, weights = [], [], []
    size = run.config.eval_batch_size
    try:
        for begin in tqdm(range(0, len(run.train_examples), size), desc="head features", unit="batch",
                          disable=not (run.config.progress and run.accelerator.is_main_process)):
            examples = run.train_examples[begin: begin + size]
            batch = {k: v.to(run.accelerator.device) for k, v in collate(examples, run.pad_token_id).items()}
            captured.clear()
            # the class's forward, not the instance's: accelerate wraps the latter in bf16 autocast under mixed
            # precision, and the head is fitted to the float32 model's features (what the critic scores with)
            type(model).forward(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            if len(captured) != 1:
                raise RuntimeError(f"--head-fit newton: the value head of {type(model).__name__} was called "
                                   f"{len(captured)} times in one forward pass; fit it with --head-fit adam")
            hidden = captured[0]
            index = batch["positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            at_steps = torch.gather(hidden, 1, index)[batch["step_mask"]]
            features.append(at_steps.to("cpu", torch.float64))
            targets.append(batch["targets"][batch["step_mask"]].to("cpu", torch.float64))
            counts = batch["step_mask"].sum(1).cpu()
            weights.append(torch.repeat_interleave(torch.as_tensor(run.weights[begin: begin + size]), counts))
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(features), torch.cat(targets), torch.cat(weights).to(torch.float64)


def _fit_head(run: _Run) -> dict:
    """``--head-fit newton``: the value head set to the optimum of the training loss on the frozen features
    (:func:`~verl_prm.training.head_fit.fit_logistic_head`); its log record."""
    from verl_prm.training.head_fit import fit_logistic_head

    features, targets, weights = _head_inputs(run)
    head = value_head_of(run.accelerator.unwrap_model(run.model))
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(f"--head-fit newton fits a linear one-logit head; {type(head).__name__} is not one: use "
                         "--head-fit adam")
    run.accelerator.print(f"verl-prm train: --head-fit newton on {features.shape[0]} labelled steps x "
                          f"{features.shape[1]} features ({features.numel() * 8 / 2**20:.0f} MiB)")
    fit = fit_logistic_head(features, targets, weights, max_iterations=run.config.max_steps,
                            fit_bias=head.bias is not None, l2=run.config.head_l2)
    with torch.no_grad():
        head.weight.copy_(fit.weight.to(head.weight.dtype).view_as(head.weight))
        if head.bias is not None:
            head.bias.fill_(fit.bias)
    if not fit.converged:
        run.accelerator.print(f"verl-prm train: --head-fit newton stopped after {fit.iterations} iterations "
                              f"(--max-steps) with gradient {fit.gradient_norm:.2e} (not yet at the optimum: "
                              "raise --max-steps; labels that features separate exactly have no finite optimum)")
    return {"step": run.config.max_steps, "loss": fit.loss, "head_fit": "newton", "head_fit_iterations": fit.iterations,
            "head_fit_gradient_norm": fit.gradient_norm, "head_fit_converged": fit.converged,
            "head_fit_labels": int(features.shape[0])}


def _log(run: _Run, record: dict) -> None:
    if run.accelerator.is_main_process:
        with open(run.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _evaluate(run: _Run, step: int) -> dict:
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
            _log(run, {"step": step, **metrics})
            run.logged_evals.add(step)
    accelerator.wait_for_everyone()
    return metrics


def _save(run: _Run, step: int) -> Path:
    """Write ``checkpoint-<step>`` (atomically: a temporary directory renamed when complete), then rotate."""
    accelerator, output_dir = run.accelerator, run.output_dir
    final = output_dir / f"checkpoint-{step:07d}"
    if accelerator.is_main_process:
        temp = output_dir / f".checkpoint-{step:07d}.tmp"
        shutil.rmtree(temp, ignore_errors=True)
        accelerator.unwrap_model(run.model).save_pretrained(temp, safe_serialization=True)
        run.tokenizer.save_pretrained(temp)
        torch.save({"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(), "step": step,
                    "config": asdict(run.config), "inputs": run.inputs}, temp / "training_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(temp, final)
        # Rotation removes the oldest of the checkpoints before this one (keep_checkpoints >= 1 is checked at
        # startup); newer ones (a damaged one skipped by the resume) are rewritten when the run gets there.
        older = [path for number, path in _checkpoint_dirs(output_dir) if number < step]
        for old in older[: max(0, len(older) + 1 - run.config.keep_checkpoints)]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final

"""A training run's output directory: its checkpoints (listed, checked intact, the newest intact one, written
atomically and rotated), the digests of the inputs a resume compares, the metrics log, and where a resumed run
starts (docs: labels.md, "Training").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from verl_prm.checkpoints import (CheckpointError, check_weights, file_digest, safetensors_problem, save_model,
                                  tokenizer_files_problem)
from verl_prm.labeling.format import label_files
from verl_prm.resume import check_same_settings
from verl_prm.training.config import TrainConfig
from verl_prm.training.run import TrainingRun

__all__ = ["checkpoint_problem", "latest_checkpoint", "input_digests", "read_log"]


_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


# Settings a resumed run may change: they do not change what is trained (logging, saving, progress, memory).
# Every other setting must be the one the checkpoint was written with.
_RESUME_FREE_KEYS = ("output_dir", "resume", "progress", "log_every", "eval_every", "eval_batch_size", "save_every",
                     "keep_checkpoints", "gradient_checkpointing", "calibration")

# settings that checkpoints written before them lack, with the value those runs had
_SETTINGS_ADDED_LATER = {"format": "value_head", "result_regex": None, "overwrite": False}


def checkpoint_dirs(output_dir: Path) -> list[tuple[int, Path]]:
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
    for _, path in reversed(checkpoint_dirs(Path(output_dir))):
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
    path = Path(path)
    if path.is_file():
        return {path.name: file_digest(path)}
    return {str(file.relative_to(path)): file_digest(file) for file in sorted(path.rglob("*"))
            if file.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                          for part in file.relative_to(path).parts)}


def input_digests(config: TrainConfig) -> dict[str, dict[str, str]]:
    """Digests of what a run reads: {"--labels": {shard: digest}, "--eval-labels": ..., "--init": {file: digest},
    "--init-config": ..., "--tokenizer": ...} (absent inputs omitted). A resume compares them."""
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


def trim_log(path: Path, step: int, note: Callable[[str], None] = print) -> list[dict]:
    """Drop log lines of steps after ``step`` (written after the checkpoint a resumed run starts from) and a
    torn last line; returns the records kept."""
    if not path.exists():
        return []
    kept = [record for record in read_log(path, note) if record.get("step", 0) <= step]
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(temp, path)
    return kept


def set_aside_earlier_run(output_dir: Path, note: Callable[[str], None]) -> None:
    """``--no-resume``: move the checkpoints and logs of an earlier run into ``earlier-run-<time>/``, so that
    the top-level checkpoints (what :func:`latest_checkpoint` and rotation see) are this run's alone."""
    earlier = [path for _, path in checkpoint_dirs(output_dir)]
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


def resume_point(config: TrainConfig, output_dir: Path, inputs: dict,
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
            older = [path for step, path in checkpoint_dirs(output_dir) if path.name < checkpoint.name
                     and checkpoint_problem(path) is None]
            checkpoint = older[-1] if older else None
    if checkpoint is None:
        damaged = [path.name for _, path in checkpoint_dirs(output_dir)]
        if damaged:  # starting over here would mix a new run with the remains of the old one
            raise ValueError(f"{output_dir} holds only damaged checkpoints ({', '.join(damaged)}; see the notes above): "
                             "rerun with --no-resume to set them aside and start over, or use a new --output-dir")
        return None, None
    # a checkpoint written before these settings existed holds a value_head run, which has their defaults
    saved = {**_SETTINGS_ADDED_LATER, **state["config"]}
    check_same_settings(saved, asdict(config), source=checkpoint, what="a checkpoint",
                        fix="start over with --no-resume or a new --output-dir", ignore=_RESUME_FREE_KEYS)
    changes = _changed_inputs(state.get("inputs", {}), inputs)
    if changes:
        raise ValueError(f"cannot resume from {checkpoint}: inputs changed since it was written ({'; '.join(changes)}); "
                         "restore them, or start over with --no-resume or a new --output-dir")
    return checkpoint, state


def save_checkpoint(run: TrainingRun, step: int) -> Path:
    """Write ``checkpoint-<step>`` (atomically: a temporary directory renamed when complete), then rotate."""
    accelerator, output_dir = run.accelerator, run.output_dir
    final = output_dir / f"checkpoint-{step:07d}"
    if accelerator.is_main_process:
        temp = output_dir / f".checkpoint-{step:07d}.tmp"
        shutil.rmtree(temp, ignore_errors=True)
        save_model(accelerator.unwrap_model(run.model), run.tokenizer, temp)
        torch.save({"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(), "step": step,
                    "config": asdict(run.config), "inputs": run.inputs}, temp / "training_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(temp, final)
        # Rotation removes the oldest of the checkpoints before this one (keep_checkpoints >= 1 is checked at
        # startup); newer ones (a damaged one skipped by the resume) are rewritten when the run gets there.
        older = [path for number, path in checkpoint_dirs(output_dir) if number < step]
        for old in older[: max(0, len(older) + 1 - run.config.keep_checkpoints)]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final

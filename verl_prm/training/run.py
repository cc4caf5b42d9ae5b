"""What the phases of one training run share (:class:`TrainingRun`) and its metrics log."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from verl_prm.training.config import TrainConfig
from verl_prm.training.data import EncodedRollout


@dataclass
class TrainingRun:
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


def log_record(run: TrainingRun, record: dict) -> None:
    """Append ``record`` to ``metrics.jsonl`` (main process)."""
    if run.accelerator.is_main_process:
        with open(run.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

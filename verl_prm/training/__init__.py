"""Training a PAV on soft step labels (docs: labels.md, "Training"): data encoding, loss, metrics, the trainer, CLI."""

from verl_prm.training.metrics import auroc, expected_calibration_error, mse, value_metrics
from verl_prm.training.trainer import TrainConfig, evaluate_examples, latest_checkpoint, train

__all__ = ["auroc", "expected_calibration_error", "mse", "value_metrics", "TrainConfig", "evaluate_examples",
           "latest_checkpoint", "train"]

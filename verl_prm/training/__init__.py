"""Training a PAV on soft step labels (docs: labels.md, "Training"): data encoding, loss, metrics, the trainer, CLI.

The names below load their module on first use, so that ``verl-prm train --help`` (verl_prm.training.cli) does
not import torch.
"""

import importlib

_NAMES = {"auroc": "metrics", "expected_calibration_error": "metrics", "mse": "metrics", "value_metrics": "metrics",
          "reliability_bins": "metrics", "plot_reliability": "metrics",
          "TrainConfig": "config", "evaluate_examples": "evaluation", "latest_checkpoint": "resume", "train": "trainer"}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"verl_prm.training.{_NAMES[name]}"), name)

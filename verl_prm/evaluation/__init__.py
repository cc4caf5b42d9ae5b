"""Evaluation of process verifiers: ``processbench`` (first-error F1 in the ProcessBench format); ``cli`` the
``verl-prm eval processbench`` command.

The names below load their module on first use, so that ``verl-prm eval processbench --help``
(verl_prm.evaluation.cli) does not import torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what static readers (type checkers, the API docs) see
    from verl_prm.evaluation.processbench import (
        FirstErrorSample,
        first_error_f1,
        predicted_first_error,
        read_first_error_samples,
        read_prm800k,
        read_processbench,
        sweep_thresholds,
    )

__all__ = [
    "FirstErrorSample",
    "first_error_f1",
    "predicted_first_error",
    "read_first_error_samples",
    "read_prm800k",
    "read_processbench",
    "sweep_thresholds",
]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("verl_prm.evaluation.processbench"), name)

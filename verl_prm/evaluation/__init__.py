"""Evaluation of process verifiers: ``processbench`` (first-error F1 in the ProcessBench format)."""

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

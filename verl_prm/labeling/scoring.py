"""Outcome scorers: verl's ``default_compute_score`` or a user function ``path.py:function``.

A scorer has verl's signature ``score(data_source, solution_str, ground_truth, extra_info) -> float | dict``
(a dict must carry ``"score"``). A response succeeds iff its score is greater than ``success_threshold``
(default 0.5: verl's rule-based scorers return 1.0 for a correct and 0.0 or -1.0 for a wrong answer).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Callable

__all__ = ["Scorer", "load_reward_function", "OutcomeScorer"]

Scorer = Callable[..., Any]


def load_reward_function(spec: str | None) -> Scorer:
    """``None`` -> verl's ``default_compute_score``; ``"path/to/file.py:name"`` -> that function."""
    if spec is None:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score
    path, separator, name = spec.rpartition(":")
    if not separator or not path or not name:
        raise ValueError(f"--reward-fn must be 'path/to/file.py:function_name', got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--reward-fn: file {file} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"verl_prm_user_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"--reward-fn: {file} has no function named {name!r}")
    return function


class OutcomeScorer:
    """Scores full responses and turns scores into 0/1 outcomes."""

    def __init__(self, function: Scorer, success_threshold: float = 0.5) -> None:
        self.function = function
        self.success_threshold = float(success_threshold)

    def score(self, data_source: str, response: str, ground_truth: Any, extra_info: dict | None) -> float:
        value = self.function(data_source, response, ground_truth, extra_info)
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"reward function returned a dict without 'score' for data_source={data_source!r}")
            value = value["score"]
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"reward function returned {value!r} for data_source={data_source!r}; it must return a number or a "
                "dict with 'score'"
            ) from None
        if math.isnan(value):
            raise ValueError(f"reward function returned NaN for data_source={data_source!r}")
        return value

    def success(self, score: float) -> bool:
        return score > self.success_threshold

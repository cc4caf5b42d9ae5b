"""Outcome scorers: verl's ``default_compute_score`` or a user function (``path.py:function`` or verl's
``pkg://module:function`` form).

A scorer has verl's signature ``score(data_source, solution_str, ground_truth, extra_info) -> float | dict``
(a dict must carry ``"score"``), or verl's batch signature ``score(data_sources=, solution_strs=,
ground_truths=, extra_infos=) -> list`` (what verl's batch reward manager calls; recognised by its
``solution_strs`` parameter), which gets every response of a labelling round in one call, e.g. to run unit-test
sandboxes in parallel (``verl_prm.code.verl_score.compute_score_batch``). A response succeeds iff its score is
greater than ``success_threshold`` (default 0.5: verl's rule-based scorers return 1.0 for a correct and 0.0 or
-1.0 for a wrong answer).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["OutcomeScorer", "Scorer", "is_batch_function", "load_reward_function", "reward_number"]

Scorer = Callable[..., Any]
_FORMS = "'path/to/file.py:function_name' or 'pkg://package.module:function_name'"


def load_reward_function(spec: str | None) -> Scorer:
    """``None`` -> verl's ``default_compute_score``; ``"path/to/file.py:name"`` or ``"pkg://package.module:name"``
    (verl's ``custom_reward_function.path`` forms, with the function name after the colon) -> that function."""
    if spec is None:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score
    path, separator, name = spec.rpartition(":")
    if not separator or not path or not name or path == "pkg":
        raise ValueError(f"--reward-fn must be {_FORMS}, got {spec!r}")
    if path.startswith("pkg://"):
        module_name = path[len("pkg://"):]
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(f"--reward-fn: cannot import module {module_name!r} ({error})") from error
        where = module_name
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"--reward-fn: file {file} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"verl_prm_user_reward_{file.stem}", file)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        where = str(file)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"--reward-fn: {where} has no function named {name!r}")
    return function


def is_batch_function(function: Scorer) -> bool:
    """True for verl's batch signature (a ``solution_strs`` parameter)."""
    try:
        return "solution_strs" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


class OutcomeScorer:
    """Scores full responses and turns scores into 0/1 outcomes."""

    def __init__(self, function: Scorer, success_threshold: float = 0.5) -> None:
        self.function = function
        self.batched = is_batch_function(function)
        self.success_threshold = float(success_threshold)

    def score(self, data_source: str, response: str, ground_truth: Any, extra_info: dict | None) -> float:
        return self.score_many([data_source], [response], [ground_truth], [extra_info])[0]

    def score_many(self, data_sources: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any],
                   extra_infos: Sequence[dict | None]) -> list[float]:
        """Scores of many responses: one call of a batch function, else one call per response."""
        if self.batched:
            values = list(self.function(data_sources=list(data_sources), solution_strs=list(responses),
                                        ground_truths=list(ground_truths), extra_infos=list(extra_infos)))
            if len(values) != len(responses):
                raise ValueError(
                    f"the batch reward function returned {len(values)} scores for {len(responses)} responses"
                )
        else:
            values = [self.function(data_source, response, ground_truth, extra_info) for data_source, response,
                      ground_truth, extra_info in zip(data_sources, responses, ground_truths, extra_infos)]
        name = getattr(self.function, "__qualname__", repr(self.function))
        return [reward_number(value, function=name, data_source=data_source, response=response)
                for value, data_source, response in zip(values, data_sources, responses)]

    def success(self, score: float) -> bool:
        return score > self.success_threshold


def reward_number(value: Any, *, function: str, data_source: Any, response: str) -> float:
    """A reward function's result as a float. A reward is a finite real number (int, float, bool, a numpy number,
    a 0-d array or tensor) or a dict whose ``"score"`` is one; anything else is an error naming the function, the
    response and its data source: a string such as ``"1.0"`` (a TypeError: no text is parsed as a number), and
    NaN or an infinity (a ValueError: an infinite score would count as a success and overflow the advantages)."""
    def problem(returned: str) -> str:
        return f"the reward function {function} returned {returned} for the response {response[:80]!r} " \
               f"(data_source={data_source!r})"

    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"{problem('a dict without a score')}: return a number or a dict with 'score'")
        value = value["score"]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d numpy array or torch tensor
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{problem(repr(value))} (a {type(value).__name__}): a reward must be a finite real number, "
                        "or a dict whose 'score' is one")
    if not math.isfinite(value):
        raise ValueError(f"{problem(repr(value))}: a reward must be a finite real number")
    return float(value)

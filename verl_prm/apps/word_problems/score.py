"""The word problems' outcome reward with verl's ``compute_score`` signature (``verl-prm label --reward-fn
pkg://verl_prm.apps.word_problems.score:compute_score``, verl's ``custom_reward_function``)."""

from __future__ import annotations

from verl_prm.apps.word_problems.task import parse_answer

__all__ = ["DATA_SOURCE", "compute_score"]

DATA_SOURCE = "word_problems"


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the first ``The answer is N`` of ``solution_str`` equals ``ground_truth`` (an integer or its
    text), else 0.0 (no such line included)."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"word_problems score: ground truth {ground_truth!r} is not an integer (data source "
                         f"{data_source!r}); the recipe's data stage writes integers") from None
    return float(parse_answer(solution_str) == expected)

"""The arithmetic task's verifier as a verl score function, in a file that verl loads by path.

    reward.custom_reward_function.path=<this file> reward.custom_reward_function.name=compute_score
    verl-prm label --reward-fn <this file>:compute_score

Standard library only and no dataclasses, so that loading it with ``importlib.util.spec_from_file_location``
(without registering a module in ``sys.modules``, as verl and ``verl-prm label`` do) works.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["DATA_SOURCE", "compute_score", "extract_answer"]

DATA_SOURCE = "arithmetic_mod"
_ANSWER = re.compile(r"answer\s+(-?\d+)\s*$")


def extract_answer(solution_str: str) -> int | None:
    """The integer of the last non-empty line if it reads ``answer N``; else None."""
    lines = [line for line in solution_str.strip().split("\n") if line.strip()]
    if not lines:
        return None
    match = _ANSWER.match(lines[-1].strip())
    return int(match.group(1)) if match else None


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl score function: 1.0 iff the final ``answer N`` line equals the ground truth, else 0.0.

    Raises for a foreign ``data_source`` (a mis-wired reward is an error, not a silent 0).
    """
    if data_source != DATA_SOURCE:
        raise ValueError(f"compute_score of the arithmetic task got data_source={data_source!r}, expected {DATA_SOURCE!r}")
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0

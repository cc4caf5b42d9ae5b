"""A text task whose prover values are known in closed form, written by a scripted policy: the labelled workload
of ``verl-prm bench gpu`` (its PAV training steps label it with the real Monte-Carlo labeller, on any machine,
without a model download), which is why it ships with the package; the tests check labellers and critics on it.

Prompt ``"Task {i}: write {H} lines.\\nAnswer:\\n"``; a response is ``H`` steps separated by ``delimiter``; a
correct step is ``x=<digit>``, a wrong step ``y=<digit>``. The outcome is 1 iff the response has exactly
``H`` steps and all are correct. The scripted policy writes each remaining step correctly with probability
``p_correct`` independently, and never repairs a wrong step. Hence, after a prefix of ``h`` steps:

    Q(prefix) = 0                       if a step of the prefix is wrong (a pit: no continuation succeeds)
              = p_correct ** (H - h)    otherwise,

and the prompt value is ``V = p_correct ** H``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

from verl_prm.labeling.generators import Completion

__all__ = ["ScriptedStepTask", "ScriptedStepGenerator", "scripted_step_score"]

PROMPT_END = "\nAnswer:\n"
_NUM_STEPS = re.compile(r"write (\d+) lines\.")
_CORRECT = re.compile(r"x=\d")
_STEP = re.compile(r"[xy]=\d")


@dataclass(frozen=True)
class ScriptedStepTask:
    num_steps: int = 4
    delimiter: str = "\n\n"

    def prompt(self, index: int) -> str:
        return f"Task {index}: write {self.num_steps} lines.{PROMPT_END}"

    def exact_values(self, response: str, step_ends: Sequence[int], p_correct: float) -> list[float]:
        """Exact Q after each prefix ``response[:end]`` (see module docstring)."""
        return [exact_prefix_value(response[:end], self.num_steps, p_correct, self.delimiter) for end in step_ends]


def _prefix_steps(prefix: str, delimiter: str) -> list[str]:
    return [part for part in prefix.split(delimiter) if part]


def exact_prefix_value(prefix: str, num_steps: int, p_correct: float, delimiter: str = "\n\n") -> float:
    """Q of the scripted prover after the response prefix ``prefix`` (module docstring)."""
    steps = _prefix_steps(prefix, delimiter)
    if len(steps) > num_steps or not all(_CORRECT.fullmatch(step) for step in steps):
        return 0.0
    return float(p_correct ** (num_steps - len(steps)))


def scripted_step_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """Outcome of the scripted task, in verl's scorer signature: 1.0 iff exactly H correct steps.

    The delimiter is taken from ``extra_info["delimiter"]`` (default "\\n\\n"); ``ground_truth`` is H.
    """
    delimiter = (extra_info or {}).get("delimiter", "\n\n")
    steps = solution_str.split(delimiter)
    ok = len(steps) == int(ground_truth) and all(_CORRECT.fullmatch(step) for step in steps)
    return 1.0 if ok else 0.0


class ScriptedStepGenerator:
    """The scripted policy as a :class:`~verl_prm.labeling.generators.Generator` (per-text seeds honoured).

    It reads H from the prompt and the steps written so far from the text after ``"\\nAnswer:\\n"``, then
    writes the remaining steps, each correct with probability ``p_correct``.
    """

    def __init__(self, p_correct: float, delimiter: str = "\n\n") -> None:
        if not 0.0 <= p_correct <= 1.0:
            raise ValueError(f"ScriptedStepGenerator: p_correct must be in [0, 1], got {p_correct}")
        self.p_correct = float(p_correct)
        self.delimiter = delimiter

    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        if len(seeds) != len(texts):
            raise ValueError(f"ScriptedStepGenerator.generate: {len(texts)} texts but {len(seeds)} seeds")
        results = []
        for text, seed in zip(texts, seeds):
            head, separator, prefix = text.partition(PROMPT_END)
            match = _NUM_STEPS.search(head)
            if not separator or match is None:
                raise ValueError(f"ScriptedStepGenerator: text is not a scripted-task prompt: {text[:80]!r}")
            num_steps = int(match.group(1))
            done = len(_prefix_steps(prefix, self.delimiter))
            rng = random.Random(seed)
            completions = []
            for _ in range(n):
                steps = [
                    ("x" if rng.random() < self.p_correct else "y") + f"={rng.randrange(10)}"
                    for _ in range(max(num_steps - done, 0))
                ]
                lead = self.delimiter if (done and steps and not prefix.endswith(self.delimiter)) else ""
                body = lead + self.delimiter.join(steps)
                completions.append(Completion(text=body, finished=True, num_tokens=len(steps)))
            results.append(completions)
        return results

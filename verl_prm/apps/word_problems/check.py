"""A program check of a word-problem response's steps against the problem's reference solution: which steps are
right, and ``prefix_correct`` (every step up to and including this one right), the ground truth a held-out test of
a step critic ranks against (docs/real_model.md, "A held-out test that can tell").

The reference solution (:meth:`.task.Problem.solution`) has one line per change of the count, ``phrase: a op b =
c.``, then ``The answer is N.``. Line k of a response (counted over the whole response, blank lines skipped) is
right when it carries line k of the reference:

- an **equation line** ends with ``a op b = c`` (an optional period after it; the words before it are ignored,
  spaces too; ``x``, ``*`` and ``×`` are all multiplication) and has no other ``=``; it is right when the
  reference line k is an equation with the same ``a``, ``op``, ``b`` and ``c``. So a wrong result (``7 - 2 = 4``)
  and right arithmetic on a wrong number (``8 - 2 = 6`` where the count was 7) are both wrong;
- an **answer line** ends with ``The answer is N`` (case-insensitive, an optional ``$`` and thousands commas as
  :func:`.task.parse_answer` reads them, an optional period); it is right when the reference line k is the answer
  line with the same ``N``;
- a line that is neither, a line beyond the reference's last (an extra line), or a line of the wrong kind is
  wrong.

A step (the labels' span: one line, or several where the labeler merged the lines beyond its ``--max-steps``
into the last step) is right when it holds at least one line and every line of it is right. A response that
ends before the reference's last line (missing lines) has its last step wrong: the solution it ends is not
finished.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from verl_prm.apps.word_problems.task import STEP_DELIMITER

__all__ = ["StepCheck", "check_steps", "line_claim", "response_lines"]

# a op b = c at the end of a line (a trailing period allowed); the words before it are the step's phrase
EQUATION = re.compile(r"(-?\d+)\s*([-+*x×])\s*(-?\d+)\s*=\s*(-?\d+)\s*\.?\s*$")
# "The answer is N" at the end of a line, N read as task.parse_answer reads it
ANSWER = re.compile(r"The answer is\s*\$?\s*(-?\d[\d,]*)\s*\.?\s*$", re.IGNORECASE)
MULTIPLY = {"x": "*", "×": "*", "*": "*"}

# what a line claims: ("equation", a, op, b, c) or ("answer", N)
Claim = Union[tuple[str, int, str, int, int], tuple[str, int]]


@dataclass(frozen=True)
class StepCheck:
    """Per step of a response: ``step_right[h]`` (every line of step h is right, see the module docstring) and
    ``prefix_correct[h] = step_right[0] and ... and step_right[h]``."""

    step_right: tuple[bool, ...]
    prefix_correct: tuple[bool, ...]


def line_claim(line: str) -> Optional[Claim]:
    """What ``line`` claims: ``("answer", N)`` when it ends with ``The answer is N``, ``("equation", a, op, b,
    c)`` when it ends with ``a op b = c`` and has no other ``=`` (op one of ``+ - *``; ``x`` and ``×`` read as
    ``*``), else None."""
    answer = ANSWER.search(line)
    if answer is not None:
        digits = answer.group(1).replace(",", "")
        return ("answer", int(digits)) if digits.lstrip("-").isdigit() else None
    equation = EQUATION.search(line)
    if equation is None or line.count("=") != 1:
        return None
    a, op, b, c = equation.groups()
    return "equation", int(a), MULTIPLY.get(op, op), int(b), int(c)


def response_lines(text: str) -> list[str]:
    """The non-blank lines of ``text`` (split at the recipe's step delimiter, a newline), stripped."""
    return [line.strip() for line in text.split(STEP_DELIMITER) if line.strip()]


def check_steps(solution: str, steps: Sequence[str]) -> StepCheck:
    """Check a response's steps against the reference ``solution`` (rule: the module docstring).

    Args:
        solution: the problem's reference solution (``Problem.solution()``, or the ``solution`` field of the
            recipe's ``data/*.jsonl``).
        steps: the response's step texts in order, as the labels store them (``response[step_starts[h]:
            step_ends[h]]``; a step may hold several lines).
    Returns:
        a :class:`StepCheck` with one entry per step.
    Raises:
        ValueError: a reference line that is neither an equation nor an answer line (not a recipe solution).
    """
    reference = []
    for number, line in enumerate(response_lines(solution), start=1):
        claim = line_claim(line)
        if claim is None:
            raise ValueError(f"check_steps: line {number} of the reference solution, {line!r}, is neither "
                             "'phrase: a op b = c.' nor 'The answer is N.': pass the problem's Problem.solution()")
        reference.append(claim)
    right, k = [], 0
    for text in steps:
        lines = response_lines(text)
        ok = bool(lines)
        for line in lines:
            ok = ok and k < len(reference) and line_claim(line) == reference[k]
            k += 1
        right.append(ok)
    if right and k < len(reference):  # the response stops before the reference's last line
        right[-1] = False
    prefix, so_far = [], True
    for ok in right:
        so_far = so_far and ok
        prefix.append(so_far)
    return StepCheck(tuple(right), tuple(prefix))

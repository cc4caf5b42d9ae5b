"""The arithmetic task's scripted prover, in closed form: an exact prover critic (``verl_prm.critic.exact``).

The prover continues a response prefix in the solution format (``solution_lines``): for each remaining
operation it writes, with probability p (``step_accuracy``), the result of the operation applied to its last
written value, and otherwise a wrong result (a value other than the problem's true value at that operation;
which one does not matter); then the answer line with its last value. Every operation is a bijection of Z_m
(m prime, no ``*`` operand divisible by m), so computing from a wrong value never gives the true value, and a
slip never writes it either: once off the true values the prover never comes back, and its answer is right iff
the prefix is on the reference solution and every remaining result is computed. A prefix the prover cannot
continue (any text that is not a prefix of the reference solution) is worth 0. Hence, with n = the number of
operations and r(prefix) = the operation results the prefix has already written::

    V(prefix) = p_acc ** (n - r(prefix))   if the prefix is a prefix of the reference solution
    V(prefix) = 0                          otherwise (a wrong result, or any other text)
    V(whole response) = 1 if it equals the reference solution (up to surrounding whitespace), else 0

so v_0 = V("") = p_acc ** n. ``prefix_is_correct(problem, prefix, complete=False)`` decides "a prefix of the
reference"; a prefix ending inside a number of the reference ("=1" of "=12") is not one. The whole response
is judged as text (``prefix_is_correct(..., complete=True)``), not by its answer line alone: a response that
reaches the right answer after a wrong line (two slips, which the prover never makes) is worth 0 here though
``compute_score`` gives it 1.

The problem is read from the prompt text: the last match of ``start (op operand)+ mod p`` (``PROBLEM_PATTERN``)
in the rendered prompt (``model.render``: the chat template around ``5 +3 *4 -2 mod 7``).

Use it in a verl run::

    verl_prm.critic.source=exact +verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver
    +verl_prm.critic.options.step_accuracy=0.8
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Mapping, Sequence

from verl_prm.critic.exact import ProverOptionError, check_step_accuracy
from verl_prm.apps.arithmetic.task import Problem, is_prime, prefix_is_correct, solution_lines

__all__ = ["EXACT_PROVER", "ArithmeticProver", "PROBLEM_PATTERN", "parse_problem", "prefix_value", "result_ends"]

# start, then one or more " <op><operand>", then " mod <p>" (Problem.prompt_text).
PROBLEM_PATTERN = re.compile(r"(?<!\d)(\d+)((?: [+\-*]\d+)+) mod (\d+)(?!\d)")
_OP = re.compile(r" ([+\-*])(\d+)")


def parse_problem(prompt_text: str, sample: int) -> Problem:
    """The ``Problem`` of the last ``PROBLEM_PATTERN`` match in ``prompt_text``.

    Raises:
        ValueError (naming ``sample`` and showing the text): no match; a modulus that is not prime or a ``*``
            operand divisible by it (the prover's value formula needs every operation to be a bijection).
    """
    matches = list(PROBLEM_PATTERN.finditer(prompt_text))
    if not matches:
        raise ValueError(
            f"sample {sample}: no arithmetic problem ('start (op operand)+ mod p', e.g. '5 +3 *4 -2 mod 7') in the "
            f"prompt text {prompt_text!r}; the arithmetic_mod exact prover reads the problem from the prompt"
        )
    match = matches[-1]
    modulus = int(match.group(3))
    ops = tuple((op, int(c)) for op, c in _OP.findall(match.group(2)))
    if not is_prime(modulus) or any(op == "*" and c % modulus == 0 for op, c in ops):
        raise ValueError(
            f"sample {sample}: the problem {match.group(0)!r} of the prompt text {prompt_text!r} has an operation "
            "that is no bijection mod its modulus (the modulus must be prime and no '*' operand a multiple of it); "
            "the arithmetic_mod exact prover's values hold only for such problems"
        )
    return Problem(int(match.group(1)), ops, modulus)


@lru_cache(maxsize=4096)
def _reference(problem: Problem) -> tuple[str, tuple[int, ...]]:
    return "\n".join(solution_lines(problem)), tuple(result_ends(problem))


def result_ends(problem: Problem) -> list[int]:
    """End (exclusive) of each operation's result in the reference solution text ``"\\n".join(solution_lines)``:
    operation h's result is the digits after the "=" of line h."""
    ends, offset = [], 0
    for line, value in zip(solution_lines(problem), problem.values):
        ends.append(offset + line.index("=") + 1 + len(str(value)))
        offset += len(line) + 1
    return ends


def prefix_value(problem: Problem, prefix: str, step_accuracy: float, complete: bool = False) -> float:
    """The scripted prover's success probability from ``prefix`` (module docstring)::

        V = step_accuracy ** (n_ops - #{results of the reference that end within the prefix})
            if prefix_is_correct(problem, prefix, complete=False), else 0;
        complete (the whole response): 1 if prefix_is_correct(problem, prefix, complete=True), else 0.
    """
    if complete:
        return 1.0 if prefix_is_correct(problem, prefix, complete=True) else 0.0
    if not prefix_is_correct(problem, prefix, complete=False):
        return 0.0
    _, ends = _reference(problem)
    written = sum(1 for end in ends if end <= len(prefix))
    return step_accuracy ** (len(problem.ops) - written)


# The name a verl run gives this prover: verl_prm.critic.options.prover.
EXACT_PROVER = f"{__name__}:ArithmeticProver"


class ArithmeticProver:
    """The exact prover of the arithmetic task (``data_source = "arithmetic_mod"``; module docstring for the
    formula). A run names it as ``verl_prm.critic.options.prover`` (:data:`EXACT_PROVER`).

    Args:
        step_accuracy: p in (0, 1], the probability that the prover writes an operation's result correctly.
    """

    OPTIONS = ("step_accuracy",)

    def __init__(self, step_accuracy: float):
        self.step_accuracy = check_step_accuracy(step_accuracy)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ArithmeticProver":
        """From ``verl_prm.critic.options`` (without ``prover``): ``step_accuracy`` is required."""
        unknown = sorted(set(options) - set(cls.OPTIONS))
        if unknown:
            raise ProverOptionError(
                unknown[0], f"unknown option {unknown[0]!r} of the arithmetic_mod exact prover; known: {list(cls.OPTIONS)}"
            )
        if "step_accuracy" not in options:
            raise ProverOptionError(
                "step_accuracy",
                "the arithmetic_mod exact prover needs step_accuracy (the prover's probability of writing one "
                "operation's result correctly, in (0, 1])",
            )
        return cls(options["step_accuracy"])

    def values(self, prompt_text: str, step_texts: Sequence[str], sample: int, complete: bool = True) -> list[float]:
        """``[v_0, ..., v_H]``: v_0 = p ** n_ops, v_h = ``prefix_value`` of ``"".join(step_texts[:h])``; with
        ``complete`` the last prefix is the whole response (value 1 iff it is the reference solution)."""
        problem = parse_problem(prompt_text, sample)
        values = [prefix_value(problem, "", self.step_accuracy)]
        prefix = ""
        for h, step in enumerate(step_texts):
            prefix += step
            last = complete and h == len(step_texts) - 1
            values.append(prefix_value(problem, prefix, self.step_accuracy, complete=last))
        return values

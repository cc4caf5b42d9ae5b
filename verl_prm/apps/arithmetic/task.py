"""Multi-step modular arithmetic with one line per operation: the task of the arithmetic recipe.

A problem is a start value and a chain of operations applied in order (left to right, no precedence: the
problem ``((5+7)*3-4) mod 13`` is written ``5 +7 *3 -4 mod 13``) modulo a prime ``p``::

    prompt:    5 +7 *3 -4 mod 13
    solution:  5+7=12 *3 -4
               12*3=10 -4
               10-4=6
               answer 6

Every line applies the next operation to the value so far (reduced mod p into [0, p)) and carries the remaining
operations along; the last line gives the answer. A step is one operation: it ends right after its result
(``STEP_REGEX``), and the answer line is the last step. Operands are in
[1, max_operand] with ``max_operand < p`` and p prime, so every operation (x + c, x - c, x * c mod p) is a bijection of Z_p: a wrong intermediate value can never turn
back into the right one, and **a solution with a slip always ends in a wrong answer**.

Slips. The supervised data has solutions with a slip (``slip_rate``, default 0.3, is the fraction of SFT
solutions that have one): at one operation step chosen uniformly at random, the written result is a uniformly
random wrong value, and the following steps compute correctly from that wrong value. A policy trained on this
data slips at a rate it learnt, at single steps; the values of its prefixes drop to 0 at the slip, so values
differ from step to step (what a process verifier must see).

The verifier (``compute_score``, verl's score-function signature) lives in ``score.py``, a file that verl
loads by path: ``reward.custom_reward_function.path=.../score.py``; ``verl-prm label --reward-fn
.../score.py:compute_score`` does the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from verl_prm.apps.arithmetic.score import DATA_SOURCE, compute_score, extract_answer

__all__ = [
    "DATA_SOURCE",
    "STEP_DELIMITER",
    "STEP_REGEX",
    "TaskConfig",
    "Problem",
    "apply_op",
    "compute_score",
    "extract_answer",
    "generate_problems",
    "is_prime",
    "prefix_correctness",
    "prefix_is_correct",
    "sft_example",
    "solution_lines",
    "verl_row",
]

STEP_DELIMITER = "\n"
# A step ends right after the result of an operation (the digits after "=", once a non-digit follows), and the
# answer line is the last step. The critic then reads a step's value at the token that completes its result,
# where the operation and its operands are a few tokens back (a local check); the carried operations that
# follow the result are copies and belong to the next step.
STEP_REGEX = r"=\d+(?=\D)"
OPS = ("+", "-", "*")


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


@dataclass(frozen=True)
class TaskConfig:
    """Difficulty knobs.

    Attributes:
        min_ops, max_ops: number of operations per problem (uniform in [min_ops, max_ops]).
        modulus: the prime p; results live in [0, p).
        max_operand: operands c are uniform in [1, max_operand] (``max_operand < p`` keeps every op a bijection).
        ops: the operations used, a subset of "+-*".
        slip_rate: fraction of supervised solutions with one slip (a wrong result at a random step).
        step_slip_rate: instead, every operation step of a supervised solution slips independently with this
            probability (0 < q < 1; then ``slip_rate`` must be 0). A policy that learns it writes a step right
            with probability about 1 - q whatever came before, so its success falls as (1 - q)^ops with the
            number of operations: the knob that makes outcome-only RL slow (few groups with a correct sample).
    """

    min_ops: int = 2
    max_ops: int = 4
    modulus: int = 13
    max_operand: int = 12
    ops: str = "+-*"
    slip_rate: float = 0.3
    step_slip_rate: float = 0.0

    def __post_init__(self) -> None:
        if not is_prime(self.modulus):
            raise ValueError(f"modulus must be prime (every op a bijection, so slips always fail), got {self.modulus}")
        if not 1 <= self.max_operand < self.modulus:
            raise ValueError(f"max_operand must be in [1, modulus - 1] = [1, {self.modulus - 1}], got {self.max_operand}")
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {''.join(OPS)!r}, got {self.ops!r}")
        if not 0.0 <= self.slip_rate <= 1.0:
            raise ValueError(f"slip_rate must be in [0, 1], got {self.slip_rate}")
        if not 0.0 <= self.step_slip_rate < 1.0:
            raise ValueError(f"step_slip_rate must be in [0, 1), got {self.step_slip_rate}")
        if self.step_slip_rate > 0 and self.slip_rate > 0:
            raise ValueError("set either slip_rate (one slip per solution) or step_slip_rate (independent slips "
                             f"per step), not both: got slip_rate={self.slip_rate}, step_slip_rate={self.step_slip_rate}")


def apply_op(x: int, op: str, c: int, modulus: int) -> int:
    """``(x op c) mod modulus`` in [0, modulus)."""
    if op == "+":
        return (x + c) % modulus
    if op == "-":
        return (x - c) % modulus
    if op == "*":
        return (x * c) % modulus
    raise ValueError(f"unknown operation {op!r}")


@dataclass(frozen=True)
class Problem:
    """``start``, then ``ops`` [(op, operand), ...] left to right, modulo ``modulus``."""

    start: int
    ops: tuple[tuple[str, int], ...]
    modulus: int
    values: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        values, x = [], self.start
        for op, c in self.ops:
            x = apply_op(x, op, c, self.modulus)
            values.append(x)
        object.__setattr__(self, "values", tuple(values))

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def expression(self) -> str:
        """The start value and the operations in order: ``5 +7 *3 -4`` (applied left to right)."""
        return f"{self.start}{remaining_ops(self.ops, 0)}"

    @property
    def prompt_text(self) -> str:
        """The user message: ``5 +7 *3 -4 mod 13``."""
        return f"{self.expression} mod {self.modulus}"


def generate_problems(n: int, config: TaskConfig, seed: int, exclude: Iterable[str] = ()) -> list[Problem]:
    """``n`` distinct problems (distinct prompts, none in ``exclude``), deterministic for (config, seed)."""
    rng = random.Random(f"arithmetic-problems-{seed}")
    seen = set(exclude)
    problems: list[Problem] = []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not draw {n} distinct problems with {config}: the problem space is too small")
        num_ops = rng.randint(config.min_ops, config.max_ops)
        ops = tuple((rng.choice(config.ops), rng.randint(1, config.max_operand)) for _ in range(num_ops))
        problem = Problem(rng.randrange(config.modulus), ops, config.modulus)
        if problem.prompt_text in seen:
            continue
        seen.add(problem.prompt_text)
        problems.append(problem)
    return problems


def remaining_ops(ops: Sequence[tuple[str, int]], depth: int) -> str:
    """The operations from ``depth`` on, as the prompt writes them: ``" *3 -4"``."""
    return "".join(f" {op}{c}" for op, c in ops[depth:])


def solution_lines(problem: Problem, slip_step: int | None = None, slip_value: int | None = None,
                   slips: dict[int, int] | None = None) -> list[str]:
    """The solution's lines: one per operation, then ``answer N``.

    Line h computes operation h on the value so far and carries the remaining operations along:
    for ``5 +7 *3 -4 mod 13`` the lines are ``5+7=12 *3 -4``, ``12*3=10 -4``, ``10-4=6``, ``answer 6``. Each
    line reads its value and operation from the start of the previous line's carried part (or the prompt), so
    every step is a local computation plus a copy.

    With ``slip_step = h`` (0-based operation index) the value written at step h is ``slip_value`` (it must
    differ from the true value) and later steps compute from it; the answer line is then wrong. ``slips``
    ({step: value}) gives several such steps (each value must differ from that step's result computed from the
    value written before it).
    """
    slips = dict(slips or {})
    if slip_step is not None:
        slips[slip_step] = slip_value
    lines, x = [], problem.start
    for h, (op, c) in enumerate(problem.ops):
        y = apply_op(x, op, c, problem.modulus)
        if h in slips:
            value = slips[h]
            if value is None or value == y or not 0 <= value < problem.modulus:
                raise ValueError(f"slip value at step {h} must be a wrong result in [0, {problem.modulus}), got "
                                 f"{value} (true {y})")
            y = value
        lines.append(f"{x}{op}{c}={y}{remaining_ops(problem.ops, h + 1)}")
        x = y
    lines.append(f"answer {x}")
    return lines


def sft_example(problem: Problem, rng: random.Random, slip_rate: float,
                step_slip_rate: float = 0.0) -> tuple[str, int]:
    """One supervised solution text and its first slip step (-1: no slip). With probability ``slip_rate`` one
    uniformly random operation step gets a uniformly random wrong result; with ``step_slip_rate`` every operation
    step independently gets a uniformly random wrong result (neither the result computed from the line before nor
    the true result)."""
    if step_slip_rate > 0:
        slips, x = {}, problem.start
        for h, (op, c) in enumerate(problem.ops):
            y = apply_op(x, op, c, problem.modulus)
            if rng.random() < step_slip_rate:
                # never the true value either: a later slip must not repair an earlier one (the outcome stays
                # wrong after any slip, as with one slip)
                y = rng.choice([v for v in range(problem.modulus) if v not in (y, problem.values[h])])
                slips[h] = y
            x = y
        return "\n".join(solution_lines(problem, slips=slips)), min(slips, default=-1)
    if rng.random() < slip_rate:
        h = rng.randrange(len(problem.ops))
        wrong = [v for v in range(problem.modulus) if v != problem.values[h]]
        return "\n".join(solution_lines(problem, h, rng.choice(wrong))), h
    return "\n".join(solution_lines(problem)), -1


def prefix_correctness(problem: Problem, response: str) -> list[bool]:
    """Per step (line) of ``response``: whether every line up to and including it is right (the prefix is
    still on a correct path). Operation line h is right when it is exactly the reference line h; the answer
    line when it is the last line and names the true answer. Any other line is wrong. Used to measure a
    critic's step-level AUROC against the truth."""
    reference = solution_lines(problem)
    lines = [line for line in response.split(STEP_DELIMITER) if line.strip()]
    out, ok = [], True
    for h, line in enumerate(lines):
        if ok:
            if h < len(problem.ops):
                ok = line.strip() == reference[h]
            else:
                ok = h == len(problem.ops) and h == len(lines) - 1 and extract_answer(line) == problem.answer
        out.append(ok)
    return out


def prefix_is_correct(problem: Problem, prefix: str, complete: bool) -> bool:
    """Whether a response prefix is still on the correct path: a prefix of the reference solution (``complete``:
    the whole response, which must equal the reference up to surrounding whitespace)."""
    reference = "\n".join(solution_lines(problem))
    if complete:
        return prefix.strip() == reference
    if not reference.startswith(prefix):
        return False
    # "...=1" is no correct prefix of "...=12": a number must not continue in the reference
    cut_number = prefix[-1:].isdigit() and len(reference) > len(prefix) and reference[len(prefix)].isdigit()
    return not cut_number


def verl_row(problem: Problem, split: str, index: int) -> dict:
    """A verl RL parquet row (the layout of verl's data preprocessing scripts)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt_text}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "start": problem.start,
            "ops": "".join(f"{op}{c} " for op, c in problem.ops).strip(),
            "modulus": problem.modulus,
            "num_ops": len(problem.ops),
        },
    }


def problem_from_row(row: dict) -> Problem:
    """Inverse of :func:`verl_row` (reads ``extra_info``)."""
    info = row["extra_info"]
    ops = tuple((token[0], int(token[1:])) for token in str(info["ops"]).split())
    return Problem(int(info["start"]), ops, int(info["modulus"]))



"""Word problems of 2-4 steps with known integer answers, and the one-step-per-line solution format.

A problem is a count of one kind of item that a person changes a few times::

    Sam has 3 apples. He buys 4 more apples. Then he gives away 2 apples. How many apples does Sam have now?

Its reference solution has one line per change and a final-answer line (steps end at a newline)::

    He buys 4 more apples: 3 + 4 = 7.
    He gives away 2 apples: 7 - 2 = 5.
    The answer is 5.

The answer of a response is the integer of its first line of the form ``The answer is N`` (:func:`parse_answer`);
the reward (:mod:`.score`) is 1 when it equals the problem's answer. Every count stays non-negative.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["OPERATIONS", "Problem", "TaskConfig", "apply", "count_problems", "few_shot_messages", "generate_problems",
           "parse_answer", "prompt_messages", "INSTRUCTION", "STEP_DELIMITER"]

STEP_DELIMITER = "\n"
NAMES = (("Sam", "he"), ("Mia", "she"), ("Tom", "he"), ("Lily", "she"), ("Ben", "he"), ("Emma", "she"),
         ("Leo", "he"), ("Zoe", "she"), ("Max", "he"), ("Ava", "she"))
ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "cards", "books", "shells", "coins", "stamps")
# kind -> (question phrase, solution phrase, operator); {k} is the amount, {item} the item's plural
OPERATIONS = {
    "add": (("buys {k} more {item}", "finds {k} more {item}", "gets {k} more {item} from a friend"), "+"),
    "sub": (("gives away {k} {item}", "loses {k} {item}", "gives {k} {item} to a friend"), "-"),
    "mul": (("doubles the {item}",), "*"),
}
INSTRUCTION = "Solve the problem. Write one step per line, and end with a line 'The answer is N.'"
# the first "The answer is N" of a response, N an integer (commas as thousands separators allowed)
ANSWER_PATTERN = re.compile(r"The answer is\s*\$?\s*(-?\d[\d,]*)", re.IGNORECASE)


@dataclass(frozen=True)
class TaskConfig:
    """The problems' ranges: steps (changes of the count), the start count, the amounts, the kinds of change."""

    min_steps: int = 2
    max_steps: int = 4
    max_start: int = 20
    max_amount: int = 9
    operations: tuple[str, ...] = ("add", "sub")

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"TaskConfig: need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.max_start < 2 or self.max_amount < 1:
            raise ValueError(f"TaskConfig: max_start must be >= 2 and max_amount >= 1, got {self.max_start}, "
                             f"{self.max_amount}")
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if unknown or not self.operations:
            raise ValueError(f"TaskConfig: unknown operations {unknown or '(none given)'}; choose from "
                             f"{sorted(OPERATIONS)}")


@dataclass(frozen=True)
class Problem:
    """A person's count of an item, changed by ``steps`` (kind, amount, phrase) in order."""

    name: str
    pronoun: str
    item: str
    start: int
    steps: tuple[tuple[str, int, str], ...]

    @property
    def answer(self) -> int:
        value = self.start
        for kind, amount, _ in self.steps:
            value = apply(kind, value, amount)
        return value

    @property
    def question(self) -> str:
        parts = [f"{self.name} has {self.start} {self.item}."]
        for i, (_, _, phrase) in enumerate(self.steps):
            sentence = f"{self.pronoun.capitalize() if i == 0 else 'Then ' + self.pronoun} {phrase}."
            parts.append(sentence)
        parts.append(f"How many {self.item} does {self.name} have now?")
        return " ".join(parts)

    def solution(self) -> str:
        """The reference solution: one line per step, ``phrase: a op b = c.``, then ``The answer is N.``."""
        lines, value = [], self.start
        for kind, amount, phrase in self.steps:
            new = apply(kind, value, amount)
            operand = 2 if kind == "mul" else amount
            lines.append(f"{self.pronoun.capitalize()} {phrase}: {value} {OPERATIONS[kind][1]} {operand} = {new}.")
            value = new
        lines.append(f"The answer is {value}.")
        return STEP_DELIMITER.join(lines)


def apply(kind: str, value: int, amount: int) -> int:
    """One change of the count: ``add`` value + amount, ``sub`` value - amount, ``mul`` 2 * value."""
    if kind == "add":
        return value + amount
    if kind == "sub":
        return value - amount
    if kind == "mul":
        return 2 * value
    raise ValueError(f"unknown operation {kind!r}; choose from {sorted(OPERATIONS)}")


def _problem(rng: random.Random, config: TaskConfig) -> Problem:
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    start = rng.randint(2, config.max_start)
    value, steps = start, []
    for _ in range(rng.randint(config.min_steps, config.max_steps)):
        kinds = [k for k in config.operations if k != "sub" or value >= 1]  # nothing to give away at 0
        kind = rng.choice(kinds)
        amount = 2 if kind == "mul" else rng.randint(1, min(config.max_amount, value) if kind == "sub"
                                                      else config.max_amount)
        phrase = rng.choice(OPERATIONS[kind][0]).format(k=amount, item=item)
        steps.append((kind, amount, phrase))
        value = apply(kind, value, amount)
    return Problem(name, pronoun, item, start, tuple(steps))


def count_problems(config: TaskConfig = TaskConfig()) -> int:
    """How many distinct questions ``config`` can produce (the draws of ``_problem``; a question's text is one
    of each name, item, start and sequence of changes, each change's kind, amount and phrase).

    With ``n(v, L)`` the sequences of ``L`` changes from the count ``v``::

        n(v, 0) = 1
        n(v, L) = |add phrases| * sum_{k=1..max_amount} n(v + k, L - 1)
                + |sub phrases| * sum_{k=1..min(max_amount, v)} n(v - k, L - 1)     (sub only when v >= 1)
                + |mul phrases| * n(2 v, L - 1)

    the count is ``|names| * |items| * sum_{start=2..max_start} sum_{L=min_steps..max_steps} n(start, L)``.
    """

    @functools.lru_cache(maxsize=None)
    def sequences(value: int, left: int) -> int:
        if left == 0:
            return 1
        total = 0
        for kind in config.operations:
            phrases = len(OPERATIONS[kind][0])
            if kind == "add":
                total += phrases * sum(sequences(value + k, left - 1) for k in range(1, config.max_amount + 1))
            elif kind == "sub":
                total += phrases * sum(sequences(value - k, left - 1)
                                       for k in range(1, min(config.max_amount, value) + 1))
            else:
                total += phrases * sequences(2 * value, left - 1)
        return total

    per_person = sum(sequences(start, steps) for start in range(2, config.max_start + 1)
                     for steps in range(config.min_steps, config.max_steps + 1))
    return len(NAMES) * len(ITEMS) * per_person


def generate_problems(n: int, config: TaskConfig = TaskConfig(), *, seed: int,
                      exclude: Sequence[str] = ()) -> list[Problem]:
    """``n`` distinct problems (by question) from ``seed``, none whose question is in ``exclude``. More than the
    config's ``count_problems`` is an error at once (the draws would never end)."""
    available = count_problems(config)
    if n > available:
        raise ValueError(f"generate_problems: could not draw {n} distinct problems from {config}: it has only "
                         f"{available} distinct questions; widen the ranges or ask for fewer")
    rng, seen, out = random.Random(seed), set(exclude), []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"generate_problems: could not draw {n} distinct problems from {config} "
                             f"(got {len(out)}); widen the ranges")
        problem = _problem(rng, config)
        if problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
    return out


def parse_answer(text: str) -> Optional[int]:
    """The integer of the first ``The answer is N`` in ``text`` (case-insensitive, ``$`` and thousands commas
    allowed), or None when there is none."""
    match = ANSWER_PATTERN.search(text)
    if match is None:
        return None
    digits = match.group(1).replace(",", "")
    return int(digits) if digits.lstrip("-").isdigit() else None


def few_shot_messages(shots: Sequence[Problem]) -> list[dict]:
    """The system instruction and one user/assistant turn per shot (its question, its reference solution)."""
    messages = [{"role": "system", "content": INSTRUCTION}]
    for shot in shots:
        messages += [{"role": "user", "content": shot.question}, {"role": "assistant", "content": shot.solution()}]
    return messages


def prompt_messages(problem: Problem, shots: Sequence[Problem] = ()) -> list[dict]:
    """The chat a policy answers: the instruction, the worked ``shots`` (none: zero-shot), then the question."""
    return few_shot_messages(shots) + [{"role": "user", "content": problem.question}]

"""A scripted code policy over HumanEval-format problems, whose values are known in closed form.

For the tests of labelling and search with the unit-test verifier, without a language model
(tests/unit/test_code.py; on sys.path through pytest's ``pythonpath`` setting). Each
problem's reference solution (HumanEval's canonical solution, a function body) is split into H steps by a code
step rule (``verl_prm.steps.code``, default "block"). The policy continues a prefix of h steps by writing
reference steps h+1..H, each one correct with probability ``p_correct`` and otherwise replaced by the
*wrong step* ``<indent>return None  # wrong step`` (indent: the reference step's). A wrong step returns
before the rest of the body runs, so the program fails its tests (for the problems whose tests never expect
``None`` everywhere: `wrong_step_fails` checks a problem); it is never repaired. Hence, after a prefix of h
steps:

    Q(prefix) = 0                      if the prefix holds a wrong step
              = p_correct ** (H - h)   otherwise

and the prompt value is ``p_correct ** H``, exactly as ``verl_prm.labeling.closed_form_task`` for text.

`ScriptedCodeGenerator` is a ``verl_prm.labeling.generators.Generator`` (texts = prompt + prefix) and a
``verl_prm.search.StepSampler`` (nodes = problem + steps), so the same policy drives ``verl-prm label``'s
``MonteCarloLabeler`` and the search functions.
"""

from __future__ import annotations

import random
from typing import Sequence

from verl_prm.steps.code import code_step_char_spans
from verl_prm.labeling.generators import Completion
from verl_prm.search import Node, StepSample

__all__ = ["ScriptedCodeGenerator", "wrong_step"]


def wrong_step(reference_step: str) -> str:
    """The wrong step that replaces ``reference_step``: an early ``return None`` at its indentation."""
    first = next((line for line in reference_step.splitlines() if line.strip()), "    ")
    indent = first[: len(first) - len(first.lstrip(" \t"))] or "    "
    return f"{indent}return None  # wrong step\n"


class ScriptedCodeGenerator:
    """The scripted code policy (module docstring).

    Args:
        prompts: the rendered prompt text of each problem (what the policy continues).
        references: the reference solution (function body) of each problem.
        p_correct: probability that each written step is the reference step.
        rule, rule_options: the code step rule of the reference steps (``code_step_char_spans``).
    """

    def __init__(self, prompts: Sequence[str], references: Sequence[str], p_correct: float, *,
                 rule: str = "block", **rule_options) -> None:
        if len(prompts) != len(references):
            raise ValueError(f"ScriptedCodeGenerator: {len(prompts)} prompts but {len(references)} references")
        if not 0.0 <= p_correct <= 1.0:
            raise ValueError(f"ScriptedCodeGenerator: p_correct must be in [0, 1], got {p_correct}")
        self.prompts = list(prompts)
        self.p_correct = float(p_correct)
        self.rule, self.rule_options = rule, rule_options
        self.steps = [[ref[s:e] for s, e in code_step_char_spans(ref, rule, **rule_options)] for ref in references]
        if any(not steps for steps in self.steps):
            raise ValueError("ScriptedCodeGenerator: a reference solution has no step")

    def num_steps(self, problem: int) -> int:
        return len(self.steps[problem])

    def _problem_of(self, text: str) -> tuple[int, str]:
        best = max((i for i, p in enumerate(self.prompts) if text.startswith(p)), key=lambda i: len(self.prompts[i]),
                   default=None)
        if best is None:
            raise ValueError(f"ScriptedCodeGenerator: text does not start with a known prompt: {text[:80]!r}")
        return best, text[len(self.prompts[best]) :]

    def _write(self, problem: int, done: int, rng: random.Random) -> list[str]:
        return [step if rng.random() < self.p_correct else wrong_step(step) for step in self.steps[problem][done:]]

    def _done(self, prefix: str) -> int:
        return len(code_step_char_spans(prefix, self.rule, **self.rule_options)) if prefix.strip() else 0

    # Generator protocol (labelling): texts are prompt + response prefix
    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list[list[Completion]]:
        if len(seeds) != len(texts):
            raise ValueError(f"ScriptedCodeGenerator.generate: {len(texts)} texts but {len(seeds)} seeds")
        out = []
        for text, seed in zip(texts, seeds):
            problem, prefix = self._problem_of(text)
            rng = random.Random(seed)
            done = self._done(prefix)
            completions = []
            for _ in range(n):
                steps = self._write(problem, done, rng)
                completions.append(Completion("".join(steps), finished=True, num_tokens=len(steps)))
            out.append(completions)
        return out

    # StepSampler protocol (search): nodes are a problem and its steps so far
    def sample_steps(self, nodes: Sequence[Node], n: int, seeds: Sequence[int]) -> list[list[StepSample]]:
        out = []
        for node, seed in zip(nodes, seeds):
            rng = random.Random(seed)
            H = self.num_steps(node.problem)
            h = node.num_steps
            samples = []
            for _ in range(n):
                step = self._write(node.problem, h, rng)[0]
                samples.append(StepSample(step, 1, finished=h + 1 >= H))
            out.append(samples)
        return out

    def sample_responses(self, problems: Sequence[int], n: int, seeds: Sequence[int]) -> list[list[Node]]:
        out = []
        for problem, seed in zip(problems, seeds):
            rng = random.Random(seed)
            out.append([Node(problem, tuple(self._write(problem, 0, rng)), finished=True,
                             num_tokens=self.num_steps(problem)) for _ in range(n)])
        return out

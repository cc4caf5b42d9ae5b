"""The unit-test verifier in test-time search: a prefix critic whose values come from running the tests.

``verl_prm.search`` scores prefixes with critics (``PrefixCritic``: ``score_nodes(nodes) -> (values,
tokens)``). `UnitTestCritic` is one built from the verifier, so best-of-N, beam search and greedy step search
run on code tasks with the unit tests as the outcome:

* the value after the last step of a **finished** node is its outcome: 1.0 iff its program passes the tests
  (exact, one sandbox run);
* the value of any other prefix (the prompt, an unfinished node, a step before the last) is the Monte-Carlo
  estimate of Q under a rollout policy: ``n_rollouts`` continuations of the prefix from ``generator`` (a
  ``verl_prm.labeling.generators.Generator``: the policy itself, a stronger prover, or vLLM), the fraction of
  whose programs pass. This is the label of ``verl-prm label`` computed on the fly.

All programs of a ``score_nodes`` call (every prefix of every node, every rollout) run in one bounded pool
(`verify_many`); the ``tokens`` reported per node are the tokens the rollouts generated for it (the compute the
critic spent), so accuracy-against-compute plots count them.

For ``verl-prm search`` on code data no code is needed: pass
``--reward-fn verl_prm/code/verl_score.py:compute_score`` (the outcome of every chosen response) and a code step
rule, e.g. ``--step-regex "$(python -c 'from verl_prm.steps.code import block_regex; print(block_regex(4))')"``.
"""

from __future__ import annotations

from typing import Sequence

from verl_prm.code.sandbox_config import SandboxConfig
from verl_prm.code.verifier import CodeTask, verify_many
from verl_prm.labeling.generators import derive_seed
from verl_prm.search import Node

__all__ = ["UnitTestCritic"]


class UnitTestCritic:
    """Prefix values from the unit-test verifier (module docstring); a ``verl_prm.search`` ``PrefixCritic``.

    Args:
        tasks: the `CodeTask` of each problem (``node.problem`` indexes it).
        prompts: the text the generator continues for each problem.
        generator: rollout policy for the values of prefixes that are not finished responses.
        n_rollouts: continuations per prefix.
        config: sandbox limits; max_workers: sandboxes at once; seed: rollout seeds.
    """

    def __init__(self, tasks: Sequence[CodeTask], prompts: Sequence[str], generator, *, n_rollouts: int = 4,
                 config: SandboxConfig | None = None, max_workers: int | None = None, seed: int = 0) -> None:
        if len(tasks) != len(prompts):
            raise ValueError(f"UnitTestCritic: {len(tasks)} tasks but {len(prompts)} prompts")
        if n_rollouts < 1:
            raise ValueError(f"UnitTestCritic: n_rollouts must be >= 1, got {n_rollouts}")
        self.tasks, self.prompts = list(tasks), list(prompts)
        self.generator = generator
        self.n_rollouts = int(n_rollouts)
        self.config = config
        self.max_workers = max_workers
        self.seed = seed
        self.sandbox_runs = 0

    def score_nodes(self, nodes: Sequence[Node]) -> tuple[list[list[float]], list[int]]:
        """``values[i]`` = [v_0, ..., v_H] of node i; ``tokens[i]`` = rollout tokens generated for it."""
        exact: list[tuple[int, int, str]] = []  # (node, h, program text)
        rollout: list[tuple[int, int, str]] = []  # (node, h, prefix)
        for i, node in enumerate(nodes):
            for h in range(node.num_steps + 1):
                prefix = "".join(node.steps[:h])
                if h == node.num_steps and node.finished and h > 0:
                    exact.append((i, h, prefix))
                else:
                    rollout.append((i, h, prefix))
        completions = []
        if rollout:
            texts = [self.prompts[nodes[i].problem] + prefix for i, _, prefix in rollout]
            seeds = [derive_seed(self.seed, "unit_test_critic", nodes[i].problem, prefix) for i, _, prefix in rollout]
            completions = self.generator.generate(texts, self.n_rollouts, seeds)
        pairs: list[tuple[CodeTask, str]] = []
        for i, _, prefix in exact:
            pairs.append((self.tasks[nodes[i].problem], prefix))
        for (i, _, prefix), samples in zip(rollout, completions):
            if len(samples) != self.n_rollouts:
                raise RuntimeError(f"generator returned {len(samples)} continuations, expected {self.n_rollouts}")
            pairs.extend((self.tasks[nodes[i].problem], prefix + sample.text) for sample in samples)
        verdicts = verify_many(pairs, self.config, max_workers=self.max_workers)
        self.sandbox_runs += len(verdicts)
        values = [[0.0] * (node.num_steps + 1) for node in nodes]
        tokens = [0] * len(nodes)
        for (i, h, _), verdict in zip(exact, verdicts):
            values[i][h] = verdict.score
        offset = len(exact)
        for k, ((i, h, _), samples) in enumerate(zip(rollout, completions)):
            block = verdicts[offset + k * self.n_rollouts : offset + (k + 1) * self.n_rollouts]
            values[i][h] = sum(v.score for v in block) / self.n_rollouts
            tokens[i] += sum(sample.num_tokens for sample in samples)
        return values, tokens

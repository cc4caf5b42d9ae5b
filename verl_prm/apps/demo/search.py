"""``verl-prm demo search``: the library's search methods on the planted sub-sequence task with exact critics
(docs: demo.md, search.md), on CPU in seconds.

    verl-prm demo search --problems 500 --output-dir runs/search_toy

The sweep, its arguments and outputs are those of ``verl-prm search`` (``verl_prm.search.cli``); this module
gives the task, its sampler and critics.

A *problem* is one planted sequence ``y*`` (random, ``planted_length`` tokens); a response is a sequence of up
to ``length`` tokens from ``1..vocab`` (``vocab`` = EOS) and succeeds iff ``y*`` occurs in it before EOS.
Steps are ``step_tokens`` consecutive tokens (the last step ends at EOS or at the length).

- **Base policy** pi = mu_{gamma_pi}: the procedural policy of ``verl_prm.apps.demo.env`` with a small gamma (a weak
  policy that rarely writes ``y*``). Being procedural, its values are exact by the same dynamic programming as
  the prover's.
- **Q critic** of pi: the exact ``V^pi(t, k)`` of ``PlantedTask.value_table(gamma_pi)`` (t tokens written,
  automaton state k). With ``q_rollouts = n > 0`` it is instead a Monte-Carlo critic: every state's value is
  the success fraction of n rollouts of pi (``Binomial(n, V^pi) / n``, drawn once per problem and state, as a
  critic fitted to n-rollout labels would give); finished states stay exact (their rollouts are the response).
- **Prover critic** mu_gamma: exact ``V^{mu_gamma}(t, k)``.
- **Verifier**: the exact reward.

Critic tokens count the tokens of the prefix the critic reads (as a language-model critic would). Sampling
draws from one generator per call, seeded by the call's first seed (results depend on how nodes are batched,
which the search algorithms fix).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from verl_prm.cli_types import finite_float
from verl_prm.search import Node, StepSample
from verl_prm.search.cli import SearchSetup, add_sweep_arguments, run_sweep, write_results

if TYPE_CHECKING:
    import torch

# torch is imported where the task computes (``demo search --help`` answers without loading it)

__all__ = ["ToySearchTask", "ToyCritic", "main", "search_parser"]


class ToySearchTask:
    """Problems, sampler and exact critics of the planted sub-sequence task.

    Args:
        num_problems: number of planted sequences (problems).
        planted_length: tokens in each planted sequence.
        length, vocab: the task's sequence length and vocabulary (``vocab`` is EOS).
        policy_gamma: gamma of the base policy mu_{gamma_pi}.
        step_tokens: tokens per step.
        seed: seeds the planted sequences.
    """

    def __init__(
        self,
        num_problems: int = 200,
        *,
        planted_length: int = 4,
        length: int = 10,
        vocab: int = 14,
        policy_gamma: float = 2.0,
        step_tokens: int = 2,
        seed: int = 0,
    ) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        import torch

        from verl_prm.apps.demo.env import PlantedTask

        generator = torch.Generator().manual_seed(seed)
        planted = torch.randint(1, vocab, (num_problems, planted_length), generator=generator)
        self.tasks = [PlantedTask(tuple(int(a) for a in row), length=length, vocab=vocab) for row in planted]
        self.length, self.vocab, self.eos = length, vocab, vocab
        self.policy_gamma = float(policy_gamma)
        self.step_tokens = int(step_tokens)
        # [P, K, V] probabilities of the base policy and [P, K, V + 1] automaton transitions per problem.
        self._policy_probs = torch.stack([task.prover_probs(policy_gamma) for task in self.tasks])
        self._policy_cdf = torch.cumsum(self._policy_probs, dim=-1).float().contiguous()
        self._transitions = torch.stack([task.transitions for task in self.tasks])
        self._value_tables: dict[float, torch.Tensor] = {}
        # Python copies for the per-node glue (indexing tensors element by element is slow).
        self._transition_lists = self._transitions.tolist()
        self._success = [task.success_state for task in self.tasks]
        self._states: dict[tuple, tuple[int, int]] = {}

    @property
    def num_problems(self) -> int:
        return len(self.tasks)

    # ------------------------------------------------------------------------------------------ values
    def value_table(self, gamma: float) -> torch.Tensor:
        """[P, length + 1, K] exact V^{mu_gamma}(t, k) per problem (cached)."""
        import torch

        if gamma not in self._value_tables:
            self._value_tables[gamma] = torch.stack([task.value_table(gamma) for task in self.tasks])
        return self._value_tables[gamma]

    def state(self, node: Node) -> tuple[int, int]:
        """``(t, k)``: tokens written and automaton state of a node."""
        return self.prefix_state(node.problem, node.steps)

    def prefix_state(self, problem: int, steps: tuple) -> tuple[int, int]:
        """``(t, k)`` after ``steps`` of ``problem`` (cached, computed from the parent's state)."""
        key = (problem, steps)
        cached = self._states.get(key)
        if cached is not None:
            return cached
        if not steps:
            result = (0, 0)
        else:
            t, k = self.prefix_state(problem, steps[:-1])
            table = self._transition_lists[problem]
            for token in steps[-1]:
                k = table[k][token]
                t += 1
            result = (t, k)
        self._states[key] = result
        return result

    def tokens(self, node: Node) -> list[int]:
        return [token for step in node.steps for token in step]

    def reward(self, node: Node) -> float:
        """1.0 iff the planted sequence occurs in the response (before EOS)."""
        return float(self.state(node)[1] == self._success[node.problem])

    def critic(self, gamma: float | None = None, *, rollouts: int = 0, seed: int = 0) -> "ToyCritic":
        """Exact critic of mu_gamma (``gamma=None``: of the base policy), or its ``rollouts``-sample MC twin."""
        gamma = self.policy_gamma if gamma is None else float(gamma)
        table = self.value_table(gamma)
        if rollouts > 0:
            import torch

            generator = torch.Generator().manual_seed(seed)
            table = torch.binomial(torch.full_like(table, float(rollouts)), table, generator=generator) / rollouts
            for p, task in enumerate(self.tasks):  # finished states are observed, not estimated
                table[p, :, task.success_state] = 1.0
                table[p, :, task.dead_state] = 0.0
                table[p, self.length] = self.value_table(gamma)[p, self.length]
        return ToyCritic(self, table)

    # ------------------------------------------------------------------------------------------ sampling
    def _sample_rows(
        self, problems: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, max_tokens: int, generator
    ) -> list[tuple[list[int], bool]]:
        """Sample up to ``max_tokens`` tokens per row from pi; rows stop at EOS or at the task's length."""
        import torch

        rows = problems.shape[0]
        states, positions = states.clone(), positions.clone()
        active = positions < self.length
        written = torch.zeros(rows, max_tokens, dtype=torch.long)  # 0 = no token
        finished = torch.zeros(rows, dtype=torch.bool)
        for i in range(max_tokens):
            if not bool(active.any()):
                break
            # Inverse-CDF sampling (torch.multinomial is slow for many short rows on CPU).
            cdf = self._policy_cdf[problems, states]
            draws = torch.rand(rows, 1, generator=generator)
            tokens = torch.searchsorted(cdf, draws).squeeze(1).clamp_(max=self.vocab - 1) + 1
            written[:, i] = torch.where(active, tokens, torch.zeros_like(tokens))
            states = torch.where(active, self._transitions[problems, states, tokens], states)
            positions = positions + active.long()
            ended = active & ((tokens == self.eos) | (positions >= self.length))
            finished |= ended
            active = active & ~ended
        return [([t for t in row if t], done) for row, done in zip(written.tolist(), finished.tolist())]

    def sample_steps(self, nodes: Sequence[Node], n: int, seeds: Sequence[int]) -> list[list[StepSample]]:
        """``n`` next steps (``step_tokens`` tokens, fewer at EOS or at the end) for each node."""
        import torch

        if not nodes:
            return []
        generator = torch.Generator().manual_seed(int(seeds[0]))
        problems, states, positions = [], [], []
        for node in nodes:
            if node.finished:
                raise ValueError(f"problem {node.problem}: cannot sample a step after a finished response")
            t, k = self.state(node)
            problems += [node.problem] * n
            states += [k] * n
            positions += [t] * n
        rows = self._sample_rows(torch.tensor(problems), torch.tensor(states), torch.tensor(positions),
                                 self.step_tokens, generator)
        samples = [StepSample(tuple(tokens), len(tokens), finished=done) for tokens, done in rows]
        return [samples[i * n : (i + 1) * n] for i in range(len(nodes))]

    def sample_responses(self, problems: Sequence[int], n: int, seeds: Sequence[int]) -> list[list[Node]]:
        """``n`` full responses per problem, split into steps of ``step_tokens`` tokens."""
        import torch

        if not problems:
            return []
        generator = torch.Generator().manual_seed(int(seeds[0]))
        rows = self._sample_rows(
            torch.tensor(problems).repeat_interleave(n),
            torch.zeros(len(problems) * n, dtype=torch.long),
            torch.zeros(len(problems) * n, dtype=torch.long),
            self.length,
            generator,
        )
        out = []
        for g, problem in enumerate(problems):
            group = []
            for tokens, _ in rows[g * n : (g + 1) * n]:
                steps = tuple(tuple(tokens[i : i + self.step_tokens]) for i in range(0, len(tokens), self.step_tokens))
                group.append(Node(problem, steps, finished=True, num_tokens=len(tokens)))
            out.append(group)
        return out

    def text(self, node: Node) -> str:
        return " ".join(str(t) for t in self.tokens(node))


class ToyCritic:
    """A prefix critic reading values from a [P, length + 1, K] table (``PrefixCritic`` protocol)."""

    def __init__(self, task: ToySearchTask, table: torch.Tensor) -> None:
        self.task = task
        self.table = table
        self._table_lists = table.tolist()

    def score_nodes(self, nodes: Sequence[Node]) -> tuple[list[list[float]], list[int]]:
        values, tokens = [], []
        for node in nodes:
            table = self._table_lists[node.problem]
            transitions = self.task._transition_lists[node.problem]
            t, k = 0, 0
            row = [table[0][0]]
            for step in node.steps:
                for token in step:
                    k = transitions[k][token]
                    t += 1
                row.append(table[t][k])
            values.append(row)
            tokens.append(max(t, 1))  # the critic reads the prefix (at least one position for the prompt)
        return values, tokens


def search_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm demo search", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(p, default_n=(1, 2, 4, 8, 16))
    toy = p.add_argument_group("the planted task")
    toy.add_argument("--problems", type=int, default=200, help="planted sequences (problems)")
    toy.add_argument("--policy-gamma", type=finite_float(0.0, low_open=True), default=2.0, help="base policy mu_gamma (weak)")
    toy.add_argument("--prover-gamma", type=finite_float(0.0, low_open=True), default=10.0, help="prover mu_gamma")
    toy.add_argument("--q-rollouts", type=int, default=16,
                     help="Q critic of the base policy fitted to this many rollouts per state (0: exact)")
    toy.add_argument("--step-tokens", type=int, default=2, help="tokens per step")
    return p


def toy_setup(args: argparse.Namespace) -> SearchSetup:
    """The sweep's problems, sampler and critics on the planted task (``--limit``: the first problems)."""
    task = ToySearchTask(args.problems, policy_gamma=args.policy_gamma, step_tokens=args.step_tokens, seed=args.seed)
    problems = list(range(task.num_problems if args.limit is None else min(args.limit, task.num_problems)))
    return SearchSetup(
        problems,
        task,
        lambda: task.critic(rollouts=args.q_rollouts, seed=args.seed + 1),
        lambda: task.critic(args.prover_gamma),
        lambda node: task.reward(node),
        task.text,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = search_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    setup = toy_setup(args)
    records = run_sweep(args, setup)
    q_source = f"fitted to {args.q_rollouts} rollouts per state" if args.q_rollouts else "exact"
    title = (f"planted sub-sequence task, {len(setup.problems)} problems; base policy mu_{args.policy_gamma:g}\n"
             f"Q^pi {q_source}; prover mu_{args.prover_gamma:g} (exact); alpha={args.alpha:g}, "
             f"M={args.samples_per_beam}, Best-of-{args.best_of_k}")
    write_results(output, records, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Search data: a node (a response prefix), a sampled step, compute counters, results, and the two
protocols a back end implements (`StepSampler`, `PrefixCritic`); see ``verl_prm.search``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

from verl_prm.labeling.generators import derive_seed


@dataclass(frozen=True)
class StepSample:
    """One sampled next step.

    Attributes:
        content: the step (text, or a tuple of tokens); ``None`` when the sampler ended the response without
            writing a step (an EOS right after the prefix): the node is then finished as it is.
        num_tokens: tokens generated for it (EOS included; tokens generated past the step's end, e.g. the
            "The" of a ".\\n\\nThe" token, included too: they were paid for).
        finished: the response ended in this step (EOS, or the task's end).
        truncated: the response hit its token budget in this step.
    """

    content: Any
    num_tokens: int
    finished: bool = False
    truncated: bool = False


@dataclass(frozen=True)
class Node:
    """A response prefix: ``problem`` and the ``steps`` written so far.

    ``num_tokens`` is the number of generated tokens along this path (the response length so far).
    ``finished``: the response is complete (EOS, end of the task, or a budget: then ``truncated``).
    """

    problem: int
    steps: tuple = ()
    finished: bool = False
    truncated: bool = False
    num_tokens: int = 0
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Cache key of the prefix: the same text (or tokens) has the same value whatever path led to it.
        object.__setattr__(self, "key", (self.problem, self.steps))

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def extend(self, sample: StepSample) -> "Node":
        """The child node after ``sample`` (a ``None`` step only finishes the node)."""
        steps = self.steps if sample.content is None else self.steps + (sample.content,)
        return Node(
            self.problem,
            steps,
            finished=sample.finished or sample.truncated,
            truncated=sample.truncated,
            num_tokens=self.num_tokens + sample.num_tokens,
        )

    def truncate(self) -> "Node":
        """This node, finished because the search ran out of steps (``max_steps``)."""
        return replace(self, finished=True, truncated=True)


@dataclass
class Compute:
    """Compute spent on one problem.

    Attributes:
        generated_tokens: tokens sampled from the policy (every sampled step or response, kept or not).
        critic_tokens: tokens read by the critics (every scored node's full prompt + response, per critic).
        step_samples: sampled steps (best-of-N: sampled full responses).
        critic_sequences: sequences scored by the critics (nodes not in the cache, per critic).
    """

    generated_tokens: int = 0
    critic_tokens: int = 0
    step_samples: int = 0
    critic_sequences: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(
            generated_tokens=self.generated_tokens,
            critic_tokens=self.critic_tokens,
            step_samples=self.step_samples,
            critic_sequences=self.critic_sequences,
        )


@dataclass
class SearchResult:
    """The answer of one method on one problem.

    Attributes:
        problem: the problem index.
        node: the chosen response.
        score: the score it was chosen by (Q / ORM value, aggregate, or last accepted step's score).
        compute: compute spent on this problem.
        info: method-specific counts (greedy: rejections, backtracks, fallbacks).
    """

    problem: int
    node: Node
    score: float
    compute: Compute
    info: dict = field(default_factory=dict)


class StepSampler(Protocol):
    """Proposes steps from a policy.

    ``sample_steps(nodes, n, seeds)``: ``n`` next steps for each unfinished node (``seeds[i]`` seeds those of
    ``nodes[i]``), in input order. ``sample_responses(problems, n, seeds)``: ``n`` full responses per problem,
    as finished nodes split into steps, with ``num_tokens`` set.
    """

    def sample_steps(self, nodes: Sequence[Node], n: int, seeds: Sequence[int]) -> list[list[StepSample]]: ...

    def sample_responses(self, problems: Sequence[int], n: int, seeds: Sequence[int]) -> list[list[Node]]: ...


class PrefixCritic(Protocol):
    """Scores prefixes: ``score_nodes(nodes) -> (values, tokens)`` with ``values[i]`` = ``[v_0, ..., v_H]``
    of node i (H = ``nodes[i].num_steps``; raw probabilities) and ``tokens[i]`` the tokens it read for node i.
    One call scores a whole batch (one forward pass per sequence for all of its steps)."""

    def score_nodes(self, nodes: Sequence[Node]) -> tuple[list[list[float]], list[int]]: ...


def node_seed(*parts: object) -> int:
    """A 31-bit seed from (run seed, method, problem, round, ...), stable across runs and batchings."""
    return derive_seed(*parts)

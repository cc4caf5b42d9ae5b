"""Greedy step search with retries and backtracking (Ma et al. 2023)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from verl_prm.search.cache import CachedCritic
from verl_prm.search.nodes import Compute, Node, SearchResult, StepSampler, node_seed
from verl_prm.search.scoring import step_accepted


@dataclass
class GreedyConfig:
    """Greedy step search (Ma et al. 2023).

    Attributes:
        threshold: a step is accepted iff its score >= threshold.
        accept_on: ``"value"`` (score = BoK value after the step) or ``"progress"`` (its change).
        max_retries: R, resamples allowed at a prefix after its first sample: at most ``1 + R`` samples are
            drawn from any prefix (any distinct text) over the whole search; the count is not reset when the
            search comes back to the prefix.
        max_backtracks: B, per problem: when a prefix has used its samples without an accepted step, the
            search drops the prefix's last step and resumes from its parent, at most B times.
        max_steps: steps after which the response is truncated.
        best_of_k: Best-of-K transform of the critic's values.
        seed: run seed.

    When a prefix has used its samples and no backtrack is left (or it is the prompt), the best-scoring step
    sampled at it is kept (preferring steps not abandoned by an earlier backtrack), so the search always ends.
    Every step kept deepens the response by one and every backtrack shortens it by one, so at most
    ``max_steps + B`` steps are kept, at most ``1 + max_steps + B`` prefixes draw samples, and at most
    ``(1 + R) * (1 + max_steps + B)`` steps are sampled per problem.
    """

    threshold: float = 0.5
    accept_on: Literal["value", "progress"] = "value"
    max_retries: int = 3
    max_backtracks: int = 2
    max_steps: int = 32
    best_of_k: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.max_backtracks < 0 or self.max_steps < 1:
            raise ValueError(
                f"greedy search: max_retries and max_backtracks must be >= 0 and max_steps >= 1, got "
                f"{self.max_retries}, {self.max_backtracks}, {self.max_steps}"
            )
        if self.accept_on not in ("value", "progress"):
            raise ValueError(f"greedy search: accept_on must be 'value' or 'progress', got {self.accept_on!r}")

    @property
    def max_step_samples(self) -> int:
        """The bound on sampled steps per problem (class docstring)."""
        return (1 + self.max_retries) * (1 + self.max_steps + self.max_backtracks)


@dataclass
class _Frame:
    node: Node
    samples_left: int
    tried: list[tuple[float, bool, Node]] = field(default_factory=list)  # (score, abandoned, child)
    samples_drawn: int = 0


@dataclass
class _GreedyState:
    stack: list[_Frame]
    backtracks_left: int
    frames: dict = field(default_factory=dict)  # prefix key -> its frame
    info: dict = field(default_factory=lambda: dict(accepted=0, rejected=0, backtracks=0, fallbacks=0, max_samples_at_a_prefix=0))
    done: bool = False
    score: float = math.nan


def greedy_step_search(
    problems: Sequence[int], sampler: StepSampler, critic: CachedCritic, config: GreedyConfig
) -> list[SearchResult]:
    """Greedy step search, all problems in lockstep: each round, every unfinished problem samples one step
    from its current prefix (one sampler call), the critic scores the new steps (one call), and each problem
    accepts or rejects its step (``step_accepted``), backtracks, or falls back (``GreedyConfig``)."""
    compute: dict[int, Compute] = {p: Compute() for p in problems}
    states = {}
    for p in problems:
        root = _Frame(Node(p), 1 + config.max_retries)
        states[p] = _GreedyState([root], config.max_backtracks, {root.node.key: root})

    def push(state: _GreedyState, child: Node, score: float) -> None:
        state.score = score
        if child.finished:
            state.stack.append(_Frame(child, 0))
            state.done = True
        elif child.num_steps >= config.max_steps:
            state.stack.append(_Frame(child.truncate(), 0))
            state.done = True
        else:
            # One frame per distinct prefix: coming back to a prefix (the same text sampled again, or a
            # fallback to an abandoned step) does not renew its samples.
            frame = state.frames.get(child.key)
            if frame is None:
                frame = state.frames[child.key] = _Frame(child, 1 + config.max_retries)
            state.stack.append(frame)

    def settle(state: _GreedyState) -> None:
        """Backtrack or fall back until the top prefix can draw a sample (or the response is done)."""
        while not state.done and state.stack[-1].samples_left == 0:
            top = state.stack[-1]
            if state.backtracks_left > 0 and len(state.stack) > 1:
                state.stack.pop()
                state.backtracks_left -= 1
                state.info["backtracks"] += 1
                parent = state.stack[-1]
                parent.tried = [(s, a or child.key == top.node.key, child) for s, a, child in parent.tried]
                continue
            # Fallback: the best step sampled here, preferring steps no backtrack abandoned.
            score, _, child = max(top.tried, key=lambda item: (not item[1], item[0]))
            state.info["fallbacks"] += 1
            top.tried = [(s, a or c.key == child.key, c) for s, a, c in top.tried]
            push(state, child, score)

    for state in states.values():
        settle(state)
    round_index = 0
    while True:
        active = [p for p in problems if not states[p].done]
        if not active:
            break
        frames = [states[p].stack[-1] for p in active]
        parents = [frame.node for frame in frames]
        base = node_seed(config.seed, "greedy", round_index)
        seeds = [(base + p) % (2**31 - 1) for p in active]
        samples = sampler.sample_steps(parents, 1, seeds)
        children = []
        for p, frame, group in zip(active, frames, samples):
            (sample,) = group
            frame.samples_left -= 1
            frame.samples_drawn += 1
            states[p].info["max_samples_at_a_prefix"] = max(states[p].info["max_samples_at_a_prefix"], frame.samples_drawn)
            compute[p].generated_tokens += sample.num_tokens
            compute[p].step_samples += 1
            children.append(frame.node.extend(sample))
        accepted, step_scores = step_accepted(
            critic.values(children, compute),
            critic.values(parents, compute),
            config.threshold,
            config.accept_on,
            config.best_of_k,
        )
        for p, frame, child, ok, score in zip(active, frames, children, accepted.tolist(), step_scores.tolist()):
            state = states[p]
            frame.tried.append((score, False, child))
            if ok:
                state.info["accepted"] += 1
                push(state, child, score)
            else:
                state.info["rejected"] += 1
            settle(state)
        round_index += 1
    results = []
    for p in problems:
        state = states[p]
        results.append(SearchResult(p, state.stack[-1].node, state.score, compute[p], dict(state.info)))
    return results

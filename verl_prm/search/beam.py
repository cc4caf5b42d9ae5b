"""Beam search on ``Q^pi + alpha * A^mu`` (Setlur et al. 2024, Sec. 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verl_prm.search.cache import CachedCritic
from verl_prm.search.nodes import Compute, Node, SearchResult, StepSampler, node_seed
from verl_prm.search.scoring import beam_scores, top_per_group


@dataclass
class BeamConfig:
    """Beam search with a PAV (Setlur et al. 2024).

    Attributes:
        beam_width: N, the beams kept per problem.
        samples_per_beam: M, next steps sampled from each unfinished beam (the root gets N * M, so the first
            round costs what every later round costs).
        alpha: weight of the prover's progress in ``Q + alpha * A`` (0: beam on Q; the paper's 0.5 default).
        best_of_k: K of the Best-of-K prover: ``A = BoK(v^mu(s, a)) - BoK(v^mu(s))``.
        max_steps: steps after which an unfinished beam is truncated.
        seed: run seed.
    """

    beam_width: int = 4
    samples_per_beam: int = 3
    alpha: float = 0.5
    best_of_k: int = 1
    max_steps: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.samples_per_beam < 1 or self.max_steps < 1:
            raise ValueError(
                f"beam search: beam_width, samples_per_beam and max_steps must be >= 1, got {self.beam_width}, "
                f"{self.samples_per_beam}, {self.max_steps}"
            )


def beam_search(
    problems: Sequence[int],
    sampler: StepSampler,
    q_critic: CachedCritic,
    prover: CachedCritic | None,
    config: BeamConfig,
) -> list[SearchResult]:
    """Beam search on ``Q^pi + alpha * A^mu``, all problems in lockstep.

    Each round: every unfinished beam of every problem samples M next steps (one sampler call); the Q critic
    scores all new candidates and, when ``alpha != 0``, the prover scores them and their parents (one call
    each, cached); per problem, the N best of (new candidates + finished beams, which keep their slot and
    score) are kept. The search ends when every kept beam is finished (or at ``max_steps``: beams truncated).
    The answer of a problem is its kept beam with the highest Q (Q as an outcome verifier).

    ``prover=None`` with ``alpha != 0`` uses the Q critic as the prover too (one critic; set ``best_of_k`` > 1
    for the Best-of-K prover of the base policy, whose values ``1 - (1 - Q)^K`` come from the same critic).
    """
    prover_critic = prover if prover is not None else q_critic
    compute: dict[int, Compute] = {p: Compute() for p in problems}
    beams: dict[int, list[Node]] = {p: [Node(p)] for p in problems}
    scores: dict[int, list[float]] = {p: [0.0] for p in problems}
    for depth in range(config.max_steps):
        parents = [node for p in problems for node in beams[p] if not node.finished]
        if not parents:
            break
        children: list[Node] = []
        child_parent: list[Node] = []
        # The first round samples N * M candidates from each root, later rounds M per unfinished beam.
        n = config.beam_width * config.samples_per_beam if depth == 0 else config.samples_per_beam
        base = node_seed(config.seed, "beam", depth)
        seeds = [(base + i) % (2**31 - 1) for i in range(len(parents))]
        samples = sampler.sample_steps(parents, n, seeds)
        for parent, group in zip(parents, samples):
            for sample in group:
                child = parent.extend(sample)
                if depth == config.max_steps - 1 and not child.finished:
                    child = child.truncate()
                children.append(child)
                child_parent.append(parent)
                compute[parent.problem].generated_tokens += sample.num_tokens
                compute[parent.problem].step_samples += 1
        q_values = q_critic.values(children, compute)
        if config.alpha != 0:
            # One prover call for the candidates and their parents (parents are cached after the first round).
            both = prover_critic.values(children + child_parent, compute)
            child_scores = beam_scores(
                q_values, both[: len(children)], both[len(children) :], config.alpha, config.best_of_k
            )
        else:
            child_scores = q_values
        # Candidates per problem: the new children plus the finished beams (they keep their slot and score).
        pool: list[Node] = []
        pool_scores: list[float] = []
        pool_groups: list[int] = []
        problem_index = {p: g for g, p in enumerate(problems)}
        for child, score in zip(children, child_scores.tolist()):
            pool.append(child)
            pool_scores.append(score)
            pool_groups.append(problem_index[child.problem])
        for p in problems:
            for node, score in zip(beams[p], scores[p]):
                if node.finished:
                    pool.append(node)
                    pool_scores.append(score)
                    pool_groups.append(problem_index[p])
        keep = top_per_group(torch.tensor(pool_scores, dtype=torch.float64), torch.tensor(pool_groups), config.beam_width)
        new_beams: dict[int, list[Node]] = {p: [] for p in problems}
        new_scores: dict[int, list[float]] = {p: [] for p in problems}
        for i in keep.tolist():
            new_beams[pool[i].problem].append(pool[i])
            new_scores[pool[i].problem].append(pool_scores[i])
        beams, scores = new_beams, new_scores
    # Any beam still open after the loop (cannot happen: the last round truncates) is truncated here.
    beams = {p: [node if node.finished else node.truncate() for node in beams[p]] for p in problems}
    finals = [node for p in problems for node in beams[p]]
    final_q = q_critic.values(finals, compute).tolist()
    results = []
    cursor = 0
    for p in problems:
        block = final_q[cursor : cursor + len(beams[p])]
        best = max(range(len(block)), key=lambda i: (block[i], -i))
        results.append(SearchResult(p, beams[p][best], float(block[best]), compute[p]))
        cursor += len(beams[p])
    return results

"""Best-of-N: N full responses per problem, re-ranked by their step scores or by the final value (ORM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from verl_prm.choices import AGGREGATIONS
from verl_prm.search.cache import CachedCritic
from verl_prm.search.nodes import Compute, Node, SearchResult, StepSampler, node_seed
from verl_prm.search.scoring import Rank, response_scores


@dataclass
class BestOfNConfig:
    """Best-of-N re-ranking.

    Attributes:
        n: responses sampled per problem.
        rank: ``"orm"`` (the value after the last step: the critic as an outcome verifier) or an aggregation
            of ``verl_prm.choices.AGGREGATIONS`` over the step scores.
        scores: what is aggregated: the step ``"values"`` or their ``"progress"`` (v_h - v_{h-1}).
        best_of_k: Best-of-K transform of the critic's values before ranking (1: none).
        seed: run seed.
    """

    n: int = 4
    rank: Rank = "orm"
    scores: Literal["values", "progress"] = "values"
    best_of_k: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"best-of-N: n must be >= 1, got {self.n}")
        if self.rank != "orm" and self.rank not in AGGREGATIONS:
            raise ValueError(f"best-of-N: rank must be 'orm' or one of {AGGREGATIONS}, got {self.rank!r}")
        if self.scores not in ("values", "progress"):
            raise ValueError(f"best-of-N: scores must be 'values' or 'progress', got {self.scores!r}")


def best_of_n(
    problems: Sequence[int], sampler: StepSampler, critic: CachedCritic, config: BestOfNConfig
) -> list[SearchResult]:
    """Sample ``config.n`` full responses per problem and keep the best by ``response_scores``.

    One ``sample_responses`` call for all problems, one critic call for all responses.
    """
    compute: dict[int, Compute] = {p: Compute() for p in problems}
    seeds = [node_seed(config.seed, "best_of_n", p) for p in problems]
    responses = sampler.sample_responses(list(problems), config.n, seeds)
    flat: list[Node] = []
    for problem, group in zip(problems, responses):
        if len(group) != config.n:
            raise ValueError(f"sampler returned {len(group)} responses for problem {problem}, expected {config.n}")
        for node in group:
            compute[problem].generated_tokens += node.num_tokens
            compute[problem].step_samples += 1
            flat.append(node)
    prompt_values, step_values, num_steps = critic.prefix_values(flat, compute)
    scores = response_scores(prompt_values, step_values, num_steps, config.rank, config.scores, config.best_of_k)
    results = []
    for g, problem in enumerate(problems):
        block = scores[g * config.n : (g + 1) * config.n]
        best = int(torch.argmax(block))  # first of the ties
        results.append(SearchResult(problem, flat[g * config.n + best], float(block[best]), compute[problem]))
    return results

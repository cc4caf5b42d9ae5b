"""Test-time search with process verifiers: best-of-N, beam search on Q + alpha * A, greedy step search.

``core`` holds the back-end-free algorithms (split into ``nodes``, ``cache``, ``scoring``, ``rerank``, ``beam``
and ``greedy``; ``core`` re-exports them all); ``generation`` the Hugging Face / vLLM step samplers and the
language-model critic adapter; ``toy`` the planted sub-sequence task with exact critics; ``cli`` the
``verl-prm search`` command.
"""

from verl_prm.search import (
    BeamConfig,
    BestOfNConfig,
    CachedCritic,
    Compute,
    GreedyConfig,
    Node,
    SearchResult,
    StepSample,
    beam_search,
    best_of_n,
    greedy_step_search,
)

__all__ = [
    "BeamConfig",
    "BestOfNConfig",
    "CachedCritic",
    "Compute",
    "GreedyConfig",
    "Node",
    "SearchResult",
    "StepSample",
    "beam_search",
    "best_of_n",
    "greedy_step_search",
]

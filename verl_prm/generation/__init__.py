"""Generation on the CPU at the machine's speed: one engine behind the labeler, the ``hf`` rollout, test-time
search and the sampled value source (``GenerationEngine``), its prefix cache, its per-row sampling and its
continuous batching for asyncio callers (``ContinuousBatcher``); the precision it computes in is
``verl_prm.precision.resolve_dtype``'s."""

from verl_prm.generation.continuous import ContinuousBatcher
from verl_prm.generation.engine import EngineStats, GenerationEngine, GenerationOutput, GenerationRequest
from verl_prm.generation.prefix_cache import PrefixCache

__all__ = [
    "ContinuousBatcher",
    "EngineStats",
    "GenerationEngine",
    "GenerationOutput",
    "GenerationRequest",
    "PrefixCache",
]

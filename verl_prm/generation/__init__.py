"""Generation on the CPU at the machine's speed: one engine behind the labeler, the ``hf`` rollout, test-time
search and the sampled value source (``GenerationEngine``), the precision it computes in (``resolve_dtype``),
its prefix cache and its per-row sampling."""

from verl_prm.generation.engine import EngineStats, GenerationEngine, GenerationOutput, GenerationRequest
from verl_prm.generation.precision import PRECISIONS, native_bf16_instructions, resolve_dtype
from verl_prm.generation.prefix_cache import PrefixCache

__all__ = [
    "EngineStats",
    "GenerationEngine",
    "GenerationOutput",
    "GenerationRequest",
    "PRECISIONS",
    "PrefixCache",
    "native_bf16_instructions",
    "resolve_dtype",
]

"""Where the critic's rows go: token-balanced shards for the data-parallel critic workers.

verl's ``Dispatch.DP_COMPUTE_PROTO`` cuts a batch into ``world_size`` chunks of equal row counts in order. Rows
of a GRPO batch differ in length by up to the response budget, and the critic's cost grows with tokens (and
faster, with attention), so equal row counts leave some workers with several times the tokens of others. The
driver therefore reorders the rows so that each equal-count chunk holds about the same number of tokens, and
puts the results back in the original order.
"""

from __future__ import annotations

import heapq
from typing import Sequence

__all__ = ["balanced_row_order", "inverse_order", "shard_token_sums"]


def balanced_row_order(lengths: Sequence[int], world_size: int) -> list[int]:
    """A permutation of ``range(len(lengths))`` whose ``world_size`` consecutive chunks of ``len / world_size``
    rows have nearly equal token sums.

    Greedy longest-processing-time with a cardinality limit: rows in decreasing length go to the shard with the
    smallest token sum that still has room. Every shard gets exactly ``n / w`` rows (``n`` must be a multiple
    of ``w``, as after ``pad_dataproto_to_divisor``), and the largest shard sum exceeds the smallest by at most
    the longest row: ``max_s T_s - min_s T_s <= max_i L_i`` (the last row added to the largest shard went to the
    then-smallest shard).
    """
    if world_size < 1:
        raise ValueError(f"balanced_row_order: world_size must be >= 1, got {world_size}")
    n = len(lengths)
    if n % world_size:
        raise ValueError(f"balanced_row_order: {n} rows do not split into {world_size} equal shards; pad the "
                         "batch to a multiple of the world size first (pad_dataproto_to_divisor)")
    bad = [i for i, length in enumerate(lengths) if int(length) < 0]
    if bad:
        raise ValueError(f"balanced_row_order: row {bad[0]} has a negative length {lengths[bad[0]]}")
    per_shard = n // world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    heap = [(0, s) for s in range(world_size)]  # (token sum, shard) of shards with room
    for i in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        total, shard = heapq.heappop(heap)
        shards[shard].append(i)
        if len(shards[shard]) < per_shard:
            heapq.heappush(heap, (total + int(lengths[i]), shard))
    return [i for shard in shards for i in sorted(shard)]


def inverse_order(order: Sequence[int]) -> list[int]:
    """``inverse[order[k]] = k``: indexing the reordered results with it restores the original row order."""
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return inverse


def shard_token_sums(lengths: Sequence[int], order: Sequence[int], world_size: int) -> list[int]:
    """Token sum of each of the ``world_size`` equal-count chunks of ``order``."""
    per_shard = len(order) // world_size
    return [sum(int(lengths[i]) for i in order[s * per_shard:(s + 1) * per_shard]) for s in range(world_size)]

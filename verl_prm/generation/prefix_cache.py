"""Key/value tensors of recently generated sequences, found again by their longest shared token prefix.

A request whose prompt begins with tokens the engine has already run (a tree branch continuing its root's
response, the ``n_mc`` continuations of one prefix, the next step prefix of a rollout being labelled, a search
node extending its parent) copies those tokens' keys and values instead of computing them again: the prefill
then runs only on the rest. This is vLLM's automatic prefix caching, kept simple for one CPU process: entries are
whole sequences (per layer ``[kv_heads, tokens, head_dim]``), found through hashes of their 16-token blocks and
then extended token by token; the least recently used entries go first when ``capacity_tokens`` is exceeded.

An entry is valid for the weights that computed it: the engine clears the cache when its weights change.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["CachedPrefix", "PrefixCache"]

BLOCK = 16


@dataclass
class CachedPrefix:
    """One cached sequence: its tokens and, per layer, keys and values ``[kv_heads, len(tokens), head_dim]``."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def _block_keys(tokens: Sequence[int]) -> list[tuple[int, ...]]:
    """The block-aligned prefixes of ``tokens`` (16, 32, ... tokens), longest last."""
    return [tuple(tokens[:end]) for end in range(BLOCK, len(tokens) + 1, BLOCK)]


class PrefixCache:
    """Least-recently-used store of sequences' keys and values, looked up by longest shared prefix."""

    def __init__(self, capacity_tokens: int) -> None:
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
            raise ValueError(f"PrefixCache: capacity_tokens must be an integer >= 0, got {capacity_tokens!r}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._by_block: dict[tuple[int, ...], int] = {}
        self._next_id = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._by_block.clear()
        self.tokens = 0

    def longest_prefix(self, tokens: Sequence[int], limit: int) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that prefix's length (at most ``limit``)."""
        best_id = None
        for key in reversed(_block_keys(tokens[:limit])):
            best_id = self._by_block.get(key)
            if best_id is not None:
                break
        if best_id is None:
            return None, 0
        entry = self._entries[best_id]
        self._entries.move_to_end(best_id)
        length = 0
        bound = min(limit, len(entry.tokens), len(tokens))
        while length < bound and entry.tokens[length] == tokens[length]:
            length += 1
        return entry, length

    def add(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store a sequence (its tensors are kept as given: pass copies). Entries it extends are dropped; a
        sequence that an entry already holds whole is not stored again."""
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) < BLOCK or len(tokens) > self.capacity_tokens:
            return
        if self.longest_prefix(tokens, limit=len(tokens))[1] == len(tokens):
            return
        blocks = _block_keys(tokens)
        for key in blocks:  # an entry that is a prefix of this one is no longer needed
            old_id = self._by_block.get(key)
            if old_id is not None and old_id in self._entries:
                old = self._entries[old_id]
                if tokens[: len(old.tokens)] == old.tokens:
                    self._remove(old_id)
        entry_id = self._next_id
        self._next_id += 1
        self._entries[entry_id] = CachedPrefix(tokens, keys, values)
        self.tokens += len(tokens)
        for key in blocks:
            self._by_block[key] = entry_id
        while self.tokens > self.capacity_tokens:
            self._remove(next(iter(self._entries)))

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.tokens -= len(entry.tokens)
        for key in _block_keys(entry.tokens):
            if self._by_block.get(key) == entry_id:
                del self._by_block[key]

"""A key/value cache preallocated at its final length that attends only to the tokens written so far.

transformers' ``DynamicCache`` concatenates every new token's keys and values onto the old ones (a copy of the
whole cache per token and layer); its ``StaticCache`` writes in place but every decode step attends over the
full preallocated length, padding included. :class:`PreallocatedLayer` does both right: one buffer
``[batch, kv_heads, capacity, head_dim]`` allocated once, written in place, and the layer's ``keys``/``values``
are views of the part written, so attention and the mask cover exactly the tokens seen (transformers' dynamic
layer semantics: ``get_seq_length`` is the view's length). Rows can be dropped (``select_rows``) when their
requests finish.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["PreallocatedLayer", "preallocated_cache"]


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in a buffer of ``capacity`` tokens (module docstring)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, key_dim = key_states.shape
        # zeros, not empty: a padding position is masked, but a NaN left in memory would still poison the
        # attention product (NaN * 0 weight is NaN)
        self._keys = torch.zeros((batch, heads, self.capacity, key_dim), dtype=self.dtype, device=self.device)
        self._values = torch.zeros((batch, heads, self.capacity, value_states.shape[-1]), dtype=self.dtype,
                                   device=self.device)
        self.length = 0
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"PreallocatedLayer: {end} tokens exceed the cache's capacity of {self.capacity}")
        self._keys[:, :, self.length: end] = key_states
        self._values[:, :, self.length: end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def write(self, row: int | slice, begin: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Place one row's keys and values ``[kv_heads, n, head_dim]`` (or a slice of rows' ``[rows, kv_heads, n,
        head_dim]``) at positions ``begin:begin + n``."""
        self._keys[row, :, begin: begin + keys.shape[-2]] = keys
        self._values[row, :, begin: begin + values.shape[-2]] = values

    def set_length(self, length: int) -> None:
        self.length = int(length)
        self._views()

    def select_rows(self, index: torch.Tensor) -> None:
        self._keys = self._keys.index_select(0, index)
        self._values = self._values.index_select(0, index)
        self._views()


def preallocated_cache(config, rows: int, capacity: int, *, dtype: torch.dtype, device) -> Cache:
    """A cache of :class:`PreallocatedLayer` for every layer of a decoder with full attention everywhere."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise NotImplementedError(
            f"the CPU generation engine supports decoders with full attention in every layer; this model has "
            f"layer types {sorted(kinds)} (sliding-window or linear attention): generate it with vLLM on a GPU")
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    layers = [PreallocatedLayer(capacity) for _ in range(text_config.num_hidden_layers)]
    empty = torch.empty((rows, heads, 0, head_dim), dtype=dtype, device=device)
    for layer in layers:
        layer.lazy_initialization(empty, empty)
    return Cache(layers=layers)

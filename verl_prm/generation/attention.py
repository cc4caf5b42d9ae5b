"""Attention for the CPU generation engine: grouped-query attention without copying keys and values per head.

transformers' eager attention repeats every key/value head for the query heads that share it (``repeat_kv``: a
copy of the whole cache per layer and step) and PyTorch's CPU SDPA kernel is slow for one query token. Here
the query heads of a group are stacked instead, so one matrix product per key/value head serves the whole
group::

    q [B, H, q, D] -> [B, H_kv, G * q, D];  scores = q k^T * scaling (+ mask);  p = softmax_float32(scores)
    out = p v -> [B, q, H, D]                                                    (G = H / H_kv)

which is exactly eager attention (query head h reads key/value head h // G, as ``repeat_kv`` lays them out),
softmax in float32 included. That is the float32 path. In bfloat16 the CPU's batched matrix product copies the
cache's keys and values (views of a longer buffer) into contiguous memory at every layer and step, which cost more
than the attention itself; PyTorch's fused SDPA kernel reads the views in place and stacks the query heads of a
group the same way (``enable_gqa``), with its softmax accumulated in float32 (SmolLM2-135M, 32 rows, 180 cached
tokens, one thread of an AMX Xeon, a layer's attention: bf16 0.73 ms against 2.3 ms; float32 1.2 against 1.1 ms,
hence the grouped product there). Registered in transformers' ``AttentionInterface`` as ``"verl_prm_gqa"`` with
eager attention's additive mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

__all__ = ["ATTENTION_NAME", "grouped_query_attention", "register_attention"]

ATTENTION_NAME = "verl_prm_gqa"


def grouped_query_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' attention signature (module docstring); returns ``(out [B, q, H, D], None)``."""
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if query.dtype != torch.float32:
        mask = None if attention_mask is None else attention_mask[:, :, :, :length]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=heads != kv_heads)
        return out.transpose(1, 2).contiguous(), None
    group = heads // kv_heads
    stacked = query.reshape(batch, kv_heads, group * queries, dim)
    scores = torch.matmul(stacked, key.transpose(2, 3)) * scaling                 # [B, H_kv, G*q, L]
    if attention_mask is not None:
        scores = (scores.view(batch, kv_heads, group, queries, length)
                  + attention_mask[:, :, None, :, :length]).view(batch, kv_heads, group * queries, length)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value).view(batch, heads, queries, dim)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register the function and its mask (eager's) under ``ATTENTION_NAME``; returns the name."""
    AttentionInterface.register(ATTENTION_NAME, grouped_query_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return ATTENTION_NAME

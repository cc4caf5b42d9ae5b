"""Forward-pass FLOP count of a decoder-only transformer critic, for achieved-TFLOP/s reports."""

from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["non_embedding_parameters", "forward_flops"]


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters that multiply every token: all but the input embedding table (a lookup, no FLOPs)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def forward_flops(parameters: int, lengths: Sequence[int], num_layers: int, attention_width: int) -> float:
    """FLOPs of one forward pass over sequences of the given lengths (each attends only to itself, causally).

        flops = 2 * parameters * sum(L)                      # every weight: one multiply-add per token
              + sum_L 2 * num_layers * L^2 * attention_width   # Q K^T and A V: 2 * L^2 * d each, halved (causal)

    ``attention_width`` = num_attention_heads * head_dim. Padding and the masked half of attention are not
    counted: this is the useful work, so FLOP/s compare methods fairly.
    """
    tokens = sum(lengths)
    attention = sum(2.0 * num_layers * n * n * attention_width for n in lengths)
    return 2.0 * parameters * tokens + attention

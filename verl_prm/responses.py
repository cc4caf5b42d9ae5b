"""What a policy's responses are, read from their token ids: the one truncation rule of the verl and TRL glue."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["truncated_responses"]


def truncated_responses(responses: torch.Tensor, response_lengths: torch.Tensor,
                        eos_token_ids: int | Iterable[int]) -> torch.Tensor:
    """[B] bool: True where a response does not end with an EOS token (it hit the length limit).

    ``responses`` [B, T] right-padded ids, ``response_lengths`` [B] valid lengths (a TRL completion's: the sum of
    its ``completion_mask``), ``eos_token_ids`` an int or a collection of ints (Qwen2.5 instruct models stop at
    either of two). A response of length 0 counts as truncated (TRL's ``mask_truncated_completions`` masks a
    truncated completion whole).
    """
    ids = eos_token_ids if isinstance(eos_token_ids, Iterable) else [eos_token_ids]
    eos = torch.as_tensor(sorted({int(e) for e in ids}), device=responses.device)
    last = (response_lengths.clamp(min=1) - 1).long().to(responses.device)
    last_ids = responses.gather(1, last[:, None]).squeeze(1)
    return ~torch.isin(last_ids, eos) | (response_lengths.to(responses.device) <= 0)

"""``verl_prm.responses.truncated_responses``: the one truncation rule of the verl hook and TRL."""

from __future__ import annotations

import torch

from verl_prm.responses import truncated_responses


def test_truncated_responses_reads_every_eos_id():
    # a response is finished when its last valid token is one of the EOS ids (Qwen2.5 instruct: two of them)
    responses = torch.tensor([[5, 6, 1, 0], [5, 2, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]])
    lengths = torch.tensor([3, 2, 4, 0])
    assert truncated_responses(responses, lengths, [1, 2]).tolist() == [False, False, True, True]
    assert truncated_responses(responses, lengths, 1).tolist() == [False, True, True, True]


def test_truncated_responses_of_trl_completions_read_the_last_valid_token():
    # TRL's completions are right-padded behind completion_mask; a completion masked whole (TRL's
    # mask_truncated_completions) has length 0 and is truncated, even when its first id is an EOS
    ids = torch.tensor([[5, 6, 1, 0], [5, 6, 7, 8], [1, 0, 0, 0], [1, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert truncated_responses(ids, mask.sum(dim=1), [1]).tolist() == [False, True, False, True]

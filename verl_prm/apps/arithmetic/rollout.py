"""Sampling from the policy with transformers, in verl's batch layout, and per-token log-probabilities.

Layout (as verl's rollout produces it): ``prompts`` [B, P] left-padded, ``responses`` [B, T] right-padded,
``attention_mask`` [B, P + T], ``response_mask`` [B, T] = 1 for response tokens up to and including the first EOS
(the EOS is part of the response, as in verl), ``position_ids`` [B, P + T] = cumsum(attention_mask) - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Rollouts", "sample"]


@dataclass
class Rollouts:
    """B = len(prompt_texts) * n sampled responses, grouped by prompt (rows i*n .. i*n+n-1 answer prompt i).

    Attributes:
        prompts: [B, P] left-padded prompt ids; responses: [B, T] right-padded response ids.
        attention_mask: [B, P + T]; response_mask: [B, T] float.
        texts: decoded responses (special tokens skipped); finished: ended at EOS; prompt_index: [B] prompt of
        each row.
    """

    prompts: torch.Tensor
    responses: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    texts: list[str]
    finished: list[bool]
    prompt_index: list[int]

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)


def sample(model, tokenizer, prompt_texts: Sequence[str], n: int, *, max_new_tokens: int, temperature: float = 1.0,
           seed: int = 0, batch_size: int = 512) -> Rollouts:
    """``n`` samples for each rendered prompt text (``temperature`` 0: greedy), in micro-batches of
    ``batch_size`` sequences; seeded by ``seed`` (and the micro-batch), so reruns repeat."""
    flat = [(i, text) for i, text in enumerate(prompt_texts) for _ in range(n)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    saved_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    prompt_rows: list[torch.Tensor] = []
    response_rows: list[list[int]] = []
    try:
        encoded_all = tokenizer([text for _, text in flat], add_special_tokens=False)["input_ids"]
        prompt_len = max(len(ids) for ids in encoded_all)
        for begin in range(0, len(flat), batch_size):
            chunk = encoded_all[begin : begin + batch_size]
            ids = torch.full((len(chunk), prompt_len), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, tokens in enumerate(chunk):
                ids[row, prompt_len - len(tokens) :] = torch.tensor(tokens)
                mask[row, prompt_len - len(tokens) :] = 1
            torch.manual_seed((seed * 1_000_003 + begin) % (2**31 - 1))
            sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else dict(do_sample=False)
            device = next(model.parameters()).device
            with torch.inference_mode():
                output = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                                        eos_token_id=eos, pad_token_id=pad, **sampling)
            prompt_rows.append(ids)
            for row in output[:, prompt_len:].cpu().tolist():
                response_rows.append(row)
    finally:
        tokenizer.padding_side = saved_side
    prompts = torch.cat(prompt_rows, dim=0)
    width = max(1, max(len(r) for r in response_rows))
    responses = torch.full((len(response_rows), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(response_rows), width), dtype=torch.float32)
    texts, finished = [], []
    for row, ids in enumerate(response_rows):
        cut = ids.index(eos) + 1 if eos in ids else len(ids)  # keep the EOS: it is a response token in verl
        responses[row, :cut] = torch.tensor(ids[:cut], dtype=torch.long)
        response_mask[row, :cut] = 1.0
        finished.append(eos in ids)
        texts.append(tokenizer.decode(ids[:cut], skip_special_tokens=True))
    prompt_mask = (prompts != pad).long()
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return Rollouts(prompts, responses, attention_mask, response_mask, texts, finished, [i for i, _ in flat])



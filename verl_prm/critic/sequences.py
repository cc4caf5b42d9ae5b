"""The critic's input sequences from the policy's batch: the policy's own ids (padding removed, step ends
moved with them) when the critic reads the policy's tokens, the prompts decoded when it does not, and the
(prompt text, step texts) that a text format reads from critic ids (``decode_segments``)."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["decode_segments"]


def adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def decode_segments(tokenizer, ids: Sequence[int], prompt_end: int, step_ends: Sequence[int]
                    ) -> tuple[str, list[str]]:
    """(prompt text, step texts) of critic ids, as a text format reads them.

    The prompt is ``decode(ids[:prompt_end + 1])`` without a leading BOS that the tokenizer's own encode adds
    (the format encodes its input itself; decoding the BOS as text would double it). The response is decoded
    without special tokens (an EOS the policy generated is no step text; the verl step split decodes the same
    way). Step h's text is
    ``decode(r[:e_h + 1])[len(decode(r[:e_{h-1} + 1])):]`` over the response ids ``r``: decoding a step alone
    would drop the leading space of a SentencePiece "▁" piece (the decoder strips it at the first token), while
    the response decoded as a whole keeps it. A step end that cuts a character (a byte-level token holding part
    of a multi-byte character) makes the decoded prefixes disagree: a ValueError, not a garbled text.
    """
    def decode(part: list[int], skip_special_tokens: bool = True) -> str:
        return tokenizer.decode(part, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    ids = list(ids)
    first = 1 if ids and adds_bos(tokenizer) and ids[0] == tokenizer.bos_token_id else 0
    prompt = decode(ids[first : prompt_end + 1], skip_special_tokens=False)
    response = ids[prompt_end + 1 :]
    steps, done = [], ""
    for h, end in enumerate(step_ends):
        text = decode(response[: end - prompt_end])
        if not text.startswith(done):
            raise ValueError(
                f"step {h - 1} ends inside a character (the decoded response up to it, {done[-20:]!r}, is no prefix "
                f"of the text decoded up to step {h}); put step ends on character boundaries"
            )
        steps.append(text[len(done) :])
        done = text
    return prompt, steps


def policy_sequences(
    prompts: torch.Tensor, responses: torch.Tensor, attention_mask: torch.Tensor, step_split
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Critic inputs from policy ids when the critic reads the policy's tokens: unmasked prompt tokens (left
    padding removed) + unmasked response tokens; a step end at response position e becomes
    ``prompt length + rank of e among the unmasked response tokens`` (= e for right-padded responses)."""
    prompt_len = prompts.shape[1]
    prompt_mask = attention_mask[:, :prompt_len].cpu() != 0
    response_mask = attention_mask[:, prompt_len:].cpu() != 0
    prompt_rows, response_rows = prompts.cpu().tolist(), responses.cpu().tolist()
    rank = (response_mask.long().cumsum(dim=1) - 1).gather(1, step_split.step_ends.cpu().clamp(min=0))
    num_steps = step_split.num_steps.cpu().tolist()
    input_ids, prompt_ends, step_ends = [], [], []
    for b in range(len(prompt_rows)):
        prompt_ids = [t for t, keep in zip(prompt_rows[b], prompt_mask[b].tolist()) if keep]
        response_ids = [t for t, keep in zip(response_rows[b], response_mask[b].tolist()) if keep]
        n = len(prompt_ids)
        input_ids.append(prompt_ids + response_ids)
        prompt_ends.append(n - 1)
        step_ends.append([n + r for r in rank[b, : num_steps[b]].tolist()])
    return input_ids, prompt_ends, step_ends


def decode_prompts(tokenizer, prompts: torch.Tensor, prompt_mask: torch.Tensor) -> list[str]:
    logger.warning(
        "critic tokenizer differs from the policy's and no prompt texts were given: the critic reads the policy "
        "prompts decoded with special tokens kept as text; pass prompt_texts to control what it reads"
    )
    keep = prompt_mask.cpu() != 0
    rows = prompts.cpu().tolist()
    return [
        tokenizer.decode([t for t, k in zip(row, krow) if k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for row, krow in zip(rows, keep.tolist())
    ]


def aligned_sequences(aligned) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Normalise ``align_to_critic``'s per-sample output (EncodedSteps-like objects) to three lists."""
    input_ids, prompt_ends, step_ends = [], [], []
    for item in aligned:
        input_ids.append([int(t) for t in item.input_ids])
        prompt_ends.append(int(item.prompt_end))
        step_ends.append([int(e) for e in item.step_ends])
    return input_ids, prompt_ends, step_ends

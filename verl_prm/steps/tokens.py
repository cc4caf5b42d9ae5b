"""Step tensors: ``step_ids`` / ``num_steps`` / ``step_ends`` of a batch from character ends of steps
(vectorised over the batch): `split_steps`, `steps_at_char_ends` and fixed-size steps."""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np
import torch

from verl_prm.steps.decoding import _check_ids_and_mask, decode_with_char_ends
from verl_prm.steps.results import _FAR, _NO_STEP, DEFAULT_DELIMITER, DecodedResponses, StepSplit
from verl_prm.steps.text import _check_max_steps, _delimiter_pattern, _kept_segment_ends, _segments


def _pad_rows(rows: list[list[int]], fill: int) -> torch.Tensor:
    """[B, max len] int64 tensor of ragged rows padded with ``fill``."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    width = int(lengths.max()) if len(rows) else 0
    out = torch.full((len(rows), width), fill, dtype=torch.int64)
    if width:
        flat = torch.tensor([x for r in rows for x in r], dtype=torch.int64)
        column = torch.arange(width).expand(len(rows), width)
        out[column < lengths[:, None]] = flat
    return out


def _compact(keep: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Move the kept entries of each row to the front: returns ``num`` [B] and each value [B, S'] (-1 fill).

    ``keep``: bool [B, S]; ``values``: [B, S] int64; S' = max kept per row.
    """
    num = keep.sum(dim=1)
    width = int(num.max()) if keep.numel() else 0
    new_column = keep.cumsum(dim=1) - 1
    rows = torch.arange(keep.shape[0])[:, None].expand_as(keep)
    out = []
    for value in values:
        compacted = torch.full((keep.shape[0], width), _NO_STEP, dtype=torch.int64)
        compacted[rows[keep], new_column[keep]] = value[keep]
        out.append(compacted)
    return (num, *out)


def _merge_past_max_steps(
    num_steps: torch.Tensor, max_steps: int | None, *ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Steps ``max_steps-1 ..`` of each row become one: its end is the row's last step end.

    Returns (num_steps, merged_steps, ends truncated to at most ``max_steps`` columns)."""
    merged = torch.zeros_like(num_steps)
    if max_steps is None or not ends or ends[0].shape[1] <= max_steps:
        return num_steps, merged, ends
    merged = (num_steps - max_steps).clamp(min=0)
    over = merged > 0
    last = (num_steps - 1).clamp(min=0)[:, None]
    out = []
    for full in ends:
        end = full[:, :max_steps].clone()
        end[:, max_steps - 1] = torch.where(over, full.gather(1, last).squeeze(1), end[:, max_steps - 1])
        out.append(end)
    return num_steps.clamp(max=max_steps), merged, tuple(out)


def _step_ids_from_ends(step_ends: torch.Tensor, num_steps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """step_ids[b, t] = number of step ends before t, for valid tokens up to the last step end; else -1.

    ``step_ends`` [B, S] increasing per row then -1; ``valid`` [B, T] bool."""
    batch, length = valid.shape
    if step_ends.shape[1] == 0 or length == 0:
        return torch.full((batch, length), _NO_STEP, dtype=torch.int64)
    sorted_ends = torch.where(step_ends >= 0, step_ends, torch.full_like(step_ends, _FAR))
    positions = torch.arange(length, dtype=torch.int64).expand(batch, length).contiguous()
    before = torch.searchsorted(sorted_ends.contiguous(), positions, side="left")  # ends < t
    return torch.where(valid & (before < num_steps[:, None]), before, torch.full_like(before, _NO_STEP))


def split_steps(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    tokenizer: Any,
    delimiter: str | None = DEFAULT_DELIMITER,
    *,
    regex: str | re.Pattern | None = None,
    max_tokens: int | None = None,
    max_steps: int | None = None,
) -> StepSplit:
    """Split a batch of responses into steps (semantics: module docstring).

    Steps end at each ``delimiter`` (default "\\n\\n"), at each match of ``regex``, or every ``max_tokens``
    valid tokens. Boundaries are found on the decoded text and mapped to tokens through character ends:

        end_token[b, h] = min {t : char_ends[b, t] >= step_char_end[b, h]}   (a searchsorted per row)
        step_ids[b, t]  = #{h : end_token[b, h] < t}  for valid t up to the last step end, else -1

    Args:
        response_ids: int [B, T] token ids of the responses (left or right padded; any device).
        response_mask: [B, T] 0/1 or bool, 1 for response tokens (verl's ``response_mask``).
        tokenizer: the transformers tokenizer that produced the ids.
        delimiter: plain string that ends a step ("\\n" in it also matches "\\r\\n"); ignored with max_tokens.
        regex: regex (string or compiled) whose match ends end steps, instead of ``delimiter``.
        max_tokens: fixed-size segments of this many valid tokens (>= 1) instead of text delimiters.
        max_steps: at most this many steps (>= 1); later steps join the last one (counted in merged_steps).

    Returns:
        StepSplit; tensors on the device of ``response_ids`` (texts and step_char_ends are host data).

    Raises:
        ValueError: shape mismatch, non-0/1 mask, ids outside the vocabulary (naming the sample), max_tokens
            < 1, max_steps < 1, both regex and max_tokens, a regex with a non-default delimiter.
    """
    _check_ids_and_mask(response_ids, response_mask)
    _check_max_steps(max_steps)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1 (fixed-size steps), got {max_tokens!r}")
        if regex is not None:
            raise ValueError("pass either regex= (text steps) or max_tokens= (fixed-size steps), not both")
        if delimiter not in (None, DEFAULT_DELIMITER):
            raise ValueError(
                f"pass either delimiter={delimiter!r} (text steps) or max_tokens= (fixed-size steps), not both"
            )
        pattern = None
    else:
        pattern = _delimiter_pattern(delimiter, regex)

    decoded = decode_with_char_ends(tokenizer, response_ids, response_mask)
    if pattern is not None:
        span_ends = [_kept_segment_ends(*_segments(text, pattern)) for text in decoded.texts]
        return steps_at_char_ends(decoded, span_ends, max_steps=max_steps, device=response_ids.device)
    num_steps, step_ends, step_char_ends = _fixed_size_steps(decoded.texts, decoded.char_ends, decoded.valid,
                                                             max_tokens)
    collapsed = torch.zeros_like(num_steps)
    return _step_split(decoded, num_steps, step_ends, step_char_ends, collapsed, max_steps, response_ids.device)


def steps_at_char_ends(
    decoded: DecodedResponses,
    step_char_ends: Sequence[Sequence[int]],
    *,
    max_steps: int | None = None,
    device: torch.device | str = "cpu",
) -> StepSplit:
    """Step tensors of responses whose steps are given as character ends in their decoded texts.

    The token-level half of ``split_steps``, for any step rule that works on text (``split_steps``'s delimiters,
    ``verl_prm.steps.code``'s ast blocks, your own): step h of response b spans
    ``decoded.texts[b][step_char_ends[b][h-1]:step_char_ends[b][h]]``, and

        end_token[b, h] = min {t : char_ends[b, t] >= step_char_ends[b][h]}   (the token holding its last character)
        step_ids[b, t]  = #{h : end_token[b, h] < t}  for valid t up to the last step end, else -1

    Steps whose last characters fall in one token merge into the earlier one (``collapsed_steps``; the later
    character end is kept); ``max_steps`` then merges trailing steps (``merged_steps``). Characters after the
    last step end are in no step.

    Args:
        decoded: ``decode_with_char_ends`` of the responses.
        step_char_ends: per response, the increasing character ends (exclusive) of its steps, each in
            ``1..len(texts[b])``; an empty list for a response without steps.
        max_steps: at most this many steps (>= 1).
        device: device of the returned tensors.

    Raises:
        ValueError: a row count that does not match the batch, or ends that are not increasing inside the text
            (naming the sample).
    """
    _check_max_steps(max_steps)
    texts, char_ends = decoded.texts, decoded.char_ends
    if len(step_char_ends) != len(texts):
        raise ValueError(f"step_char_ends has {len(step_char_ends)} rows for {len(texts)} responses")
    rows = []
    for b, (text, ends) in enumerate(zip(texts, step_char_ends)):
        ends = [int(end) for end in ends]
        if any(not 0 < end <= len(text) for end in ends) or any(a >= c for a, c in zip(ends, ends[1:])):
            raise ValueError(
                f"sample {b}: step character ends {ends} must increase strictly inside 1..{len(text)} (the length "
                "of the decoded response text)"
            )
        rows.append(ends)
    span_ends = _pad_rows(rows, _FAR)
    text_steps = (span_ends != _FAR).sum(dim=1)
    if span_ends.shape[1] and char_ends.shape[1]:
        end_token = torch.searchsorted(char_ends.contiguous(), span_ends.contiguous(), side="left")
    else:
        end_token = torch.zeros_like(span_ends)
    # steps whose last characters fall in one token merge into the earliest: keep the last of each run
    columns = torch.arange(span_ends.shape[1])[None, :]
    in_row = columns < text_steps[:, None]
    next_differs = torch.ones_like(in_row)
    if span_ends.shape[1] > 1:
        next_differs[:, :-1] = end_token[:, :-1] != end_token[:, 1:]
    keep = in_row & (next_differs | (columns == text_steps[:, None] - 1))
    num_steps, step_ends, kept_char_ends = _compact(keep, end_token, span_ends)
    return _step_split(decoded, num_steps, step_ends, kept_char_ends, text_steps - num_steps, max_steps, device)


def _step_split(decoded: DecodedResponses, num_steps, step_ends, step_char_ends, collapsed, max_steps,
                device) -> StepSplit:
    """Merge past ``max_steps``, derive ``step_ids`` and move everything to ``device``."""
    num_steps, merged, (step_ends, step_char_ends) = _merge_past_max_steps(
        num_steps, max_steps, step_ends, step_char_ends
    )
    step_ids = _step_ids_from_ends(step_ends, num_steps, decoded.valid)
    return StepSplit(
        step_ids=step_ids.to(device),
        num_steps=num_steps.to(device),
        step_ends=step_ends.to(device),
        merged_steps=merged.to(device),
        collapsed_steps=collapsed.to(device),
        texts=decoded.texts,
        step_char_ends=step_char_ends,
    )


def _nonspace_prefix(texts: list[str]) -> torch.Tensor:
    """[B, L+1] int64: number of non-whitespace characters (``not str.isspace``) in ``texts[b][:c]``."""
    width = max((len(t) for t in texts), default=0)
    out = np.zeros((len(texts), width + 1), dtype=np.int64)
    for b, text in enumerate(texts):
        if not text:
            continue
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        nonspace = _NONSPACE_TABLE[np.minimum(codepoints, len(_NONSPACE_TABLE) - 1)]
        out[b, 1 : len(text) + 1] = np.cumsum(nonspace)
        out[b, len(text) + 1 :] = out[b, len(text)]
    return torch.from_numpy(out)


# every str.isspace() code point is below U+3001; the last entry stands for all code points above
_NONSPACE_TABLE = np.array([not chr(c).isspace() for c in range(0x3001)] + [True], dtype=bool)


def _fixed_size_steps(
    texts: list[str], char_ends: torch.Tensor, valid: torch.Tensor, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segments of ``max_tokens`` valid tokens; whitespace-only segments join a neighbour as text steps do.

    Returns num_steps [B], step_ends [B, S] and step_char_ends [B, S] (-1 fill)."""
    batch, length = valid.shape
    rank = valid.cumsum(dim=1) - 1  # rank of each valid token among its row's valid tokens
    n_valid = valid.sum(dim=1)
    is_end = valid & (((rank + 1) % max_tokens == 0) | (rank == n_valid[:, None] - 1))
    n_segments = (n_valid + max_tokens - 1) // max_tokens
    width = int(n_segments.max()) if batch else 0
    segment_end = torch.full((batch, width), _NO_STEP, dtype=torch.int64)
    rows, positions = is_end.nonzero(as_tuple=True)
    segment_end[rows, rank[rows, positions] // max_tokens] = positions
    columns = torch.arange(width)[None, :]
    in_row = columns < n_segments[:, None]
    end_char = torch.where(in_row, char_ends.gather(1, segment_end.clamp(min=0)), torch.zeros_like(segment_end))
    start_char = torch.zeros_like(end_char)
    if width > 1:
        start_char[:, 1:] = end_char[:, :-1]
    nonspace = _nonspace_prefix(texts)
    has_content = in_row & (nonspace.gather(1, end_char) > nonspace.gather(1, start_char))
    seen = has_content.cumsum(dim=1) > 0
    next_has_content = torch.zeros_like(has_content)
    if width > 1:
        next_has_content[:, :-1] = has_content[:, 1:]
    keep = in_row & seen & (next_has_content | (columns == n_segments[:, None] - 1))
    return _compact(keep, segment_end, end_char)

"""Token -> text: decode a batch once and give every token its character end (vectorised for byte-level
tokenizers; the incremental vLLM/TGI detokenizer scheme for others)."""

from __future__ import annotations

import codecs
from typing import Any

import torch

from verl_prm.steps.results import DecodedResponses
from verl_prm.steps.tables import _decode_kwargs, _token_table


def _incremental_bytes_row(token_bytes: list[bytes], row_ids: list[int]) -> tuple[str, list[int]]:
    """Reference decoding of one row from token bytes, one token at a time (used for rows with invalid
    UTF-8): an incremental UTF-8 decoder emits a character when its last byte arrives; U+FFFD as ``decode``."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pieces: list[str] = []
    ends: list[int] = []
    count = 0
    for token_id in row_ids:
        piece = decoder.decode(token_bytes[token_id])
        pieces.append(piece)
        count += len(piece)
        ends.append(count)
    tail = decoder.decode(b"", final=True)
    if tail:
        pieces.append(tail)
        count += len(tail)
        ends[-1] = count
    return "".join(pieces), ends


def _incremental_tokenizer_row(tokenizer: Any, row_ids: list[int], sample: int) -> tuple[str, list[int]]:
    """General path for tokenizers that are not byte-level: the incremental detokenizer of vLLM/TGI.

    A window ``ids[prefix_offset:i+1]`` is decoded and compared with ``ids[prefix_offset:read_offset]``;
    the difference is emitted once it does not end in U+FFFD (an incomplete character). Both decodes start at
    the same token, so a decoder that strips the first token's leading space (SentencePiece) cancels out.
    """
    kwargs = _decode_kwargs()
    ends: list[int] = []
    pieces: list[str] = []
    count = 0
    prefix_offset = read_offset = 0
    prefix_text = ""
    for i in range(len(row_ids)):
        new_text = tokenizer.decode(row_ids[prefix_offset : i + 1], **kwargs)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            pieces.append(delta)
            count += len(delta)
            prefix_offset, read_offset = read_offset, i + 1
            prefix_text = tokenizer.decode(row_ids[prefix_offset:read_offset], **kwargs)
        ends.append(count)
    text = "".join(pieces)
    full = tokenizer.decode(row_ids, **kwargs)
    if text != full:
        if row_ids and full.startswith(text):  # a trailing incomplete character: the last token holds it
            ends[-1] = len(full)
            text = full
        else:
            raise ValueError(
                f"sample {sample}: incremental decoding of {type(tokenizer).__name__} does not reproduce its "
                f"decode ({text[:60]!r} vs {full[:60]!r}); this tokenizer's decode is not prefix-stable, so "
                "character offsets per token are undefined; use a byte-level BPE tokenizer or max_tokens steps"
            )
    return text, ends


def _check_ids_and_mask(response_ids: torch.Tensor, response_mask: torch.Tensor) -> None:
    if not isinstance(response_ids, torch.Tensor) or response_ids.dim() != 2:
        raise ValueError(
            f"response_ids must be a 2-D tensor [B, T], got {getattr(response_ids, 'shape', type(response_ids))}"
        )
    if not isinstance(response_mask, torch.Tensor) or response_mask.shape != response_ids.shape:
        raise ValueError(
            f"response_mask must have the shape of response_ids {tuple(response_ids.shape)}, got "
            f"{tuple(getattr(response_mask, 'shape', ()))}"
        )
    if response_ids.dtype.is_floating_point or response_ids.dtype == torch.bool:
        raise ValueError(f"response_ids must hold integer token ids, got dtype {response_ids.dtype}")
    bad = (response_mask != 0) & (response_mask != 1)
    if bad.any():
        b, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"sample {b}: response_mask[{b}, {t}] = {response_mask[b, t].item()!r}; the mask must be 0/1 (or bool)"
        )


def decode_with_char_ends(
    tokenizer: Any, response_ids: torch.Tensor, response_mask: torch.Tensor | None = None
) -> DecodedResponses:
    """Decode each response once and give every token its character end (semantics: module docstring).

    Byte-level tokenizers take the vectorised path: token bytes are gathered from the id->bytes table for the
    whole batch, a byte is a character's last byte iff the next byte of its row is no UTF-8 continuation byte
    (``0b10xxxxxx``), and ``char_ends[b, t]`` = count of character-final bytes in row b's bytes before
    ``byte_ends[b, t]`` (a cumulative sum). Rows that are not valid UTF-8 are redone with an incremental
    UTF-8 decoder. Other tokenizers use incremental decoding per row (slower).

    Args:
        tokenizer: a transformers tokenizer.
        response_ids: int [B, T] token ids (any device; the work runs on CPU).
        response_mask: [B, T] 0/1 or bool; None means all tokens are valid.

    Returns:
        DecodedResponses with ``char_ends`` [B, T] int64 and ``valid`` [B, T] bool on CPU.
    """
    if response_mask is None:
        response_mask = torch.ones_like(response_ids)
    _check_ids_and_mask(response_ids, response_mask)
    ids = response_ids.detach().to("cpu", torch.int64)
    mask = response_mask.detach().cpu() != 0
    table = _token_table(tokenizer)
    batch, length = ids.shape
    out_of_range = mask & ((ids < 0) | (ids >= table.vocab_size))
    if out_of_range.any():
        b, t = (int(x) for x in out_of_range.nonzero()[0])
        raise ValueError(
            f"sample {b}: response_ids[{b}, {t}] = {int(ids[b, t])} is outside the tokenizer's vocabulary "
            f"(size {table.vocab_size}); mask it out or use the tokenizer that produced the ids"
        )
    safe_ids = torch.where(mask, ids, torch.zeros_like(ids))
    valid = mask & ~table.special[safe_ids]
    char_ends = torch.zeros(batch, length, dtype=torch.int64)
    texts: list[str] = [""] * batch
    if batch == 0 or length == 0:
        return DecodedResponses(texts, char_ends, valid)

    if not table.byte_level:
        for b in range(batch):
            positions = valid[b].nonzero().squeeze(1)
            text, ends = _incremental_tokenizer_row(tokenizer, ids[b, positions].tolist(), b)
            texts[b] = text
            if ends:
                char_ends[b, positions] = torch.tensor(ends, dtype=torch.int64)
        return DecodedResponses(texts, char_ends.cummax(dim=1).values, valid)

    assert table.byte_len is not None and table.byte_start is not None and table.flat_bytes is not None
    token_len = table.byte_len[safe_ids] * valid  # [B, T] bytes of each valid token
    byte_ends = token_len.cumsum(dim=1)  # [B, T] row-local byte end of each token
    row_bytes = byte_ends[:, -1]  # [B]
    row_offset = row_bytes.cumsum(0) - row_bytes  # [B] start of each row in the flat buffer
    total = int(row_bytes.sum())
    nonempty = token_len > 0
    flat_len = token_len[nonempty]  # row-major order, so rows are contiguous in the buffer
    flat_start = table.byte_start[safe_ids[nonempty]]
    flat_offset = flat_len.cumsum(0) - flat_len
    gather = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(flat_start - flat_offset, flat_len)
    flat = table.flat_bytes[gather]  # [total] uint8, the bytes of every row back to back
    # byte p ends a character iff byte p+1 is no continuation byte, or p is the last byte of its row
    is_continuation = (flat & 0xC0) == 0x80
    char_final = torch.ones(total, dtype=torch.bool)
    if total > 1:
        char_final[:-1] = ~is_continuation[1:]
    row_last = (row_offset + row_bytes - 1)[row_bytes > 0]
    char_final[row_last] = True
    final_count = torch.zeros(total + 1, dtype=torch.int64)
    final_count[1:] = char_final.cumsum(0)
    char_ends = final_count[row_offset[:, None] + byte_ends] - final_count[row_offset][:, None]

    buffer = flat.numpy().tobytes()
    offsets = row_offset.tolist()
    sizes = row_bytes.tolist()
    for b in range(batch):
        chunk = buffer[offsets[b] : offsets[b] + sizes[b]]
        try:
            texts[b] = chunk.decode("utf-8")
        except UnicodeDecodeError:  # e.g. a response cut inside a character: exact slow path for this row
            assert table.token_bytes is not None
            positions = valid[b].nonzero().squeeze(1)
            text, ends = _incremental_bytes_row(table.token_bytes, ids[b, positions].tolist())
            texts[b] = text
            row = torch.zeros(length, dtype=torch.int64)
            row[positions] = torch.tensor(ends, dtype=torch.int64)
            char_ends[b] = row.cummax(dim=0).values
    return DecodedResponses(texts, char_ends, valid)

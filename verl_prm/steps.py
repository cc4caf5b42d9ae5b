"""Steps: segmentation of responses and alignment to a critic tokenizer (DESIGN.md section 3).

A response is split into steps on its **text**, and the boundaries are mapped back to tokens through
character offsets, so that tokens which merge a delimiter with text (".\\n\\n", "\\n\\nThe") and multi-byte
characters split over several byte-level tokens are handled exactly.

Shape convention, as in `verl_prm.advantages`:

    B: responses in the batch, T: padded response length, S: padded number of steps (max H in the batch).
    step_ids    [B, T] int64  step (0-based) of each response token, -1 for tokens in no step
    num_steps   [B]    int64  H of each response (0 allowed)
    step_ends   [B, S] int64  position (in the response tensor) of each step's last token, -1 for h >= H

Semantics (the contract every function here follows):

* **The text.** The text of a response is the concatenation of its valid tokens (``response_mask`` != 0,
  not a special token), decoded as the tokenizer decodes them with ``skip_special_tokens=True`` and
  ``clean_up_tokenization_spaces=False``. Masked tokens (left or right padding, or masked tokens in the
  middle) are not part of the text, so left-padded and right-padded batches give the same steps.
* **Character ends of tokens.** ``char_ends[b, t]`` is the number of characters whose last byte lies in the
  valid tokens up to and including ``t``. A token that holds the last byte of a character holds that
  character; a token that holds only leading bytes of a character (byte-level BPE splits emoji, CJK,
  Cyrillic) holds no character. Invalid UTF-8 (a response cut inside a character) decodes with U+FFFD as the
  tokenizer's ``decode`` does.
* **Delimiters.** A step ends at the end of each match of the delimiter (a plain string, default
  ``"\\n\\n"``) or of ``regex`` in the text; the delimiter belongs to the step that it ends. In a plain
  delimiter every ``"\\n"`` also matches ``"\\r\\n"``, so ``"\\n\\n"`` splits ``"a\\r\\n\\r\\nb"`` like
  ``"a\\n\\nb"`` (the ``"\\r"`` stays in the step it ends). A regex is used as given; a zero-width regex
  (``"(?=Step \\d)"``) puts the boundary before the matched text.
* **No empty steps.** A segment whose text outside its delimiter match is empty or whitespace
  (``str.isspace``) is no step of its own: it joins the previous step, or the next one when it comes before
  the first non-empty segment. Hence a run of delimiters (``"\\n\\n\\n\\n"``) joins the step that the run
  ends, a delimiter at the very start joins the first step, a whitespace-only tail joins the last step, and a
  response that is empty or whitespace-only has 0 steps. Every valid non-special token of a response with
  steps lies in a step. With ``"\\n\\n"``, ``"a\\n\\n\\nb"`` gives the steps ``"a\\n\\n"`` and ``"\\nb"``:
  the third newline is no delimiter and starts the next step.
* **Padding and special tokens** (EOS, pad, any id in ``tokenizer.all_special_ids``) are in no step
  (``step_ids == -1``); they decode to no text.
* **Tokens.** A step's last token is the token that holds the step's last character. A token that holds
  characters of two steps (".\\n\\nThe" at a ``"\\n\\n"`` boundary) belongs to the earlier step, whose last
  token it is. When every character of a step lies in the last token of the previous step, the two steps
  share their last token and cannot be told apart by any token-level signal: the later one is merged into
  the earlier one and counted in ``StepSplit.collapsed_steps``.
* **Fixed-size segments** (``max_tokens=N``): step k is valid tokens ``[k*N, (k+1)*N)`` (special and masked
  tokens are not counted); a segment whose text is whitespace-only joins its neighbour as above.
* **max_steps**: when a response has more steps than ``max_steps``, steps ``max_steps-1 ..`` are merged into
  the last kept step (its end is the response's last step end); ``StepSplit.merged_steps`` counts the steps
  merged away per response (a metric to log).

Decoding paths. For byte-level BPE tokenizers (GPT-2, Llama-3, Qwen2 style; decoder ``ByteLevel``) each id
maps to a fixed byte string, so the bytes of a whole batch are gathered from a precomputed id->bytes table
with tensor ops, character ends come from a cumulative count of UTF-8 character-final bytes, and Python only
decodes each row once. The table is checked once per tokenizer against ``tokenizer.decode`` of the whole
vocabulary. Other tokenizers (SentencePiece/Metaspace, WordPiece) use incremental decoding (the
vLLM/TGI detokenizer scheme: decode a short window, emit the new text once it ends in a whole character),
which is exact but about two ``decode`` calls per token, so much slower.

Alignment to a critic (`align_to_critic`): the critic reads the prompt text and the response text; with the
same tokenizer the ids are reused (no re-tokenisation), otherwise the text is re-tokenised by the critic
tokenizer and step h's value is read at the critic token that holds step h's last character.
"""

from __future__ import annotations

import codecs
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

__all__ = [
    "DEFAULT_DELIMITER",
    "DecodedResponses",
    "EncodedSteps",
    "StepSplit",
    "align_to_critic",
    "decode_with_char_ends",
    "encode_with_step_ends",
    "same_tokenizer",
    "split_steps",
    "step_char_spans",
    "steps_at_char_ends",
]

DEFAULT_DELIMITER = "\n\n"
_NO_STEP = -1
# sentinel larger than any character or token position, for padded sorted sequences
_FAR = 2**62


# ----------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------


@dataclass
class StepSplit:
    """Steps of a batch of responses (see the module docstring for the semantics).

    Attributes:
        step_ids: int64 [B, T], step (0-based) of each token, -1 for tokens in no step (padding, special).
        num_steps: int64 [B], number of steps H of each response.
        step_ends: int64 [B, S], position in the response tensor of each step's last token, -1 for h >= H;
            S = max H in the batch (0 when no response has a step).
        merged_steps: int64 [B], steps past ``max_steps`` merged into the last step (0 without max_steps).
        collapsed_steps: int64 [B], text steps merged into the previous step because both end in the same
            token (see "Tokens" in the module docstring); 0 for almost every real response.
        texts: the text of each response (valid non-special tokens, decoded), as the steps were found in.
        step_char_ends: int64 [B, S], end (exclusive) in ``texts[b]`` of each step's text, -1 for h >= H.
            Step h spans ``texts[b][step_char_ends[b, h-1]:step_char_ends[b, h]]`` (0 for h = 0). With
            ``max_tokens`` it is the character end of the step's last token.
    """

    step_ids: torch.Tensor
    num_steps: torch.Tensor
    step_ends: torch.Tensor
    merged_steps: torch.Tensor
    collapsed_steps: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    texts: list[str] = field(default_factory=list)
    step_char_ends: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))

    def step_texts(self, b: int) -> list[str]:
        """The text of each step of response ``b`` (a convenience for logging and tests)."""
        ends = self.step_char_ends[b, : int(self.num_steps[b])].tolist()
        starts = [0] + ends[:-1]
        return [self.texts[b][s:e] for s, e in zip(starts, ends)]


@dataclass
class EncodedSteps:
    """One critic input: ``input_ids`` = prompt tokens followed by response tokens.

    Attributes:
        input_ids: the critic token ids of prompt + response.
        prompt_end: index in ``input_ids`` of the prompt's last token (the critic reads v_0 there).
        step_ends: index in ``input_ids`` of the token holding each step's last character (v_h is read there).
    """

    input_ids: list[int]
    prompt_end: int
    step_ends: list[int]


@dataclass
class DecodedResponses:
    """Texts of a batch of responses with the character end of every token.

    Attributes:
        texts: decoded text of each response (valid non-special tokens only).
        char_ends: int64 [B, T], number of characters of ``texts[b]`` whose last byte is in valid tokens
            ``<= t``; non-decreasing along t, 0 before the first valid token, ``len(texts[b])`` after the last.
        valid: bool [B, T], mask != 0 and not a special token.
    """

    texts: list[str]
    char_ends: torch.Tensor
    valid: torch.Tensor


# ----------------------------------------------------------------------------------------------------------
# Text level
# ----------------------------------------------------------------------------------------------------------


def _delimiter_pattern(delimiter: str | None, regex: str | re.Pattern | None) -> re.Pattern:
    """The compiled pattern whose match ends are step boundaries. Each "\\n" of a plain delimiter also
    matches "\\r\\n", so Windows line ends split like Unix ones."""
    if regex is not None:
        if delimiter not in (None, DEFAULT_DELIMITER):
            raise ValueError(
                f"split by either delimiter={delimiter!r} or regex={regex!r}, not both: pass delimiter=None "
                "with a regex"
            )
        try:
            return regex if isinstance(regex, re.Pattern) else re.compile(regex)
        except re.error as error:
            raise ValueError(f"regex={regex!r} does not compile: {error}") from None
    if not isinstance(delimiter, str) or delimiter == "":
        raise ValueError(f"delimiter must be a non-empty string (or pass regex=...), got {delimiter!r}")
    return re.compile("".join(r"\r?\n" if ch == "\n" else re.escape(ch) for ch in delimiter))


def _segments(text: str, pattern: re.Pattern) -> tuple[list[int], list[bool]]:
    """Candidate segment ends (exclusive, increasing) and whether each segment has content: a non-space
    character outside its delimiter match. The segments tile ``text``."""
    ends: list[int] = []
    has_content: list[bool] = []
    pos = 0
    for match in pattern.finditer(text):
        end = match.end()
        if end == pos:  # a zero-width match at a segment start ends nothing
            continue
        content = text[pos : match.start()]
        ends.append(end)
        has_content.append(bool(content) and not content.isspace())
        pos = end
    if pos < len(text):
        content = text[pos:]
        ends.append(len(text))
        has_content.append(not content.isspace())
    return ends, has_content


def _kept_segment_ends(ends: list[int], has_content: list[bool]) -> list[int]:
    """Ends of the steps after empty segments join a neighbour: end k is kept iff some segment <= k has
    content (leading empty segments join the first step) and segment k+1 has content or k is the last one
    (an empty segment joins the step before it)."""
    kept = []
    seen = False
    last = len(ends) - 1
    for k, end in enumerate(ends):
        seen = seen or has_content[k]
        if seen and (k == last or has_content[k + 1]):
            kept.append(end)
    return kept


def step_char_spans(
    text: str,
    delimiter: str | None = DEFAULT_DELIMITER,
    *,
    regex: str | re.Pattern | None = None,
    max_steps: int | None = None,
) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of the steps of a response text (semantics: module docstring).

    The spans tile the text (step h starts where step h-1 ends; the first starts at 0 and the last ends at
    ``len(text)``) unless the text has no step. A delimiter belongs to the step it ends; runs of delimiters
    make no empty steps; a whitespace-only tail is no step; empty or whitespace-only text gives ``[]``.

    Args:
        text: the response text.
        delimiter: plain string ending a step (each "\\n" in it also matches "\\r\\n"); default "\\n\\n".
        regex: a regex whose match ends end steps, instead of ``delimiter``.
        max_steps: if given (>= 1), steps past ``max_steps`` join the last step.
    """
    _check_max_steps(max_steps)
    ends = _kept_segment_ends(*_segments(text, _delimiter_pattern(delimiter, regex)))
    if max_steps is not None and len(ends) > max_steps:
        ends = ends[: max_steps - 1] + [ends[-1]]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def _check_max_steps(max_steps: int | None) -> None:
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be an int >= 1 (or None for no limit), got {max_steps!r}")


# ----------------------------------------------------------------------------------------------------------
# Token -> text: the id->bytes table of byte-level tokenizers, and the general incremental decoder
# ----------------------------------------------------------------------------------------------------------


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable character that stands for each byte in a
    byte-level BPE vocabulary ("Ġ" is the space, "Ċ" the newline)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


@dataclass
class _TokenTable:
    """Per-tokenizer tables, built once (cached per tokenizer object and vocabulary size).

    ``special[id]`` marks ids that decode to nothing (special tokens, holes in the vocabulary). For byte-level
    tokenizers (``byte_level``), ``flat_bytes[byte_start[id] : byte_start[id] + byte_len[id]]`` are the bytes
    of ``id`` (empty for special ids) and ``token_bytes[id]`` the same as Python bytes.
    """

    vocab_size: int
    special: torch.Tensor
    byte_level: bool
    flat_bytes: torch.Tensor | None = None
    byte_start: torch.Tensor | None = None
    byte_len: torch.Tensor | None = None
    token_bytes: list[bytes] | None = None


_TABLES: "weakref.WeakKeyDictionary[Any, _TokenTable]" = weakref.WeakKeyDictionary()


def _decode_kwargs() -> dict[str, Any]:
    return {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _token_table(tokenizer: Any) -> _TokenTable:
    vocab_size = len(tokenizer)
    try:
        cached = _TABLES.get(tokenizer)
    except TypeError:  # not weak-referenceable: build every time
        cached = None
    if cached is not None and cached.vocab_size == vocab_size:
        return cached
    table = _build_token_table(tokenizer, vocab_size)
    try:
        _TABLES[tokenizer] = table
    except TypeError:
        pass
    return table


def _build_token_table(tokenizer: Any, vocab_size: int) -> _TokenTable:
    special_ids = _special_ids(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    special = torch.zeros(vocab_size, dtype=torch.bool)
    for token_id, token in enumerate(tokens):
        if token is None or token_id in special_ids:
            special[token_id] = True
    if not _is_byte_level(tokenizer):
        return _TokenTable(vocab_size, special, byte_level=False)
    added = {int(k): v for k, v in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    token_bytes: list[bytes] = []
    for token_id, token in enumerate(tokens):
        if special[token_id]:
            token_bytes.append(b"")
        elif token_id in added:  # added tokens decode to their content, not through the byte map
            token_bytes.append(str(added[token_id].content).encode("utf-8"))
        else:
            try:
                token_bytes.append(bytes(_BYTE_DECODER[ch] for ch in token))
            except KeyError:  # not a byte-level vocabulary after all
                return _TokenTable(vocab_size, special, byte_level=False)
    # One check per tokenizer: the table must reproduce the tokenizer's own decode of every id.
    regular = [i for i in range(vocab_size) if not special[i]]
    expected = tokenizer.decode(regular, **_decode_kwargs())
    if b"".join(token_bytes[i] for i in regular).decode("utf-8", "replace") != expected:
        return _TokenTable(vocab_size, special, byte_level=False)
    lengths = torch.tensor([len(b) for b in token_bytes], dtype=torch.int64)
    flat = torch.frombuffer(bytearray(b"".join(token_bytes)) or bytearray(1), dtype=torch.uint8)
    return _TokenTable(
        vocab_size,
        special,
        byte_level=True,
        flat_bytes=flat,
        byte_start=lengths.cumsum(0) - lengths,
        byte_len=lengths,
        token_bytes=token_bytes,
    )


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


# ----------------------------------------------------------------------------------------------------------
# Token level (vectorised over the batch)
# ----------------------------------------------------------------------------------------------------------


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
    ``verl_prm.code.steps``'s ast blocks, your own): step h of response b spans
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


# ----------------------------------------------------------------------------------------------------------
# Critic side: encoding with step ends, and alignment
# ----------------------------------------------------------------------------------------------------------


def _check_spans(spans: Sequence[tuple[int, int]], length: int, sample: Any) -> list[int]:
    ends = []
    previous = 0
    for h, (start, end) in enumerate(spans):
        if not (0 <= start < end <= length) or start < previous:
            raise ValueError(
                f"sample {sample}: step span {h} = ({start}, {end}) is not an increasing non-empty span inside "
                f"the response of {length} characters"
            )
        previous = end
        ends.append(end)
    return ends


def _end_tokens_from_char_ends(char_ends: list[int], span_ends: list[int]) -> list[int]:
    """Index of the first token whose character end reaches each span end (the token holding the span's
    last character)."""
    ends = np.asarray(char_ends, dtype=np.int64)
    return np.searchsorted(ends, np.asarray(span_ends, dtype=np.int64), "left").tolist()


def _end_tokens_from_offsets(offsets: list[tuple[int, int]], span_ends: list[int]) -> list[int]:
    """Fallback for tokenizers whose decode does not reproduce the text (normalisers): with offset mappings
    into the original text, the token holding character e-1 is the last token that starts before e (pieces of
    one split character share its offsets, and the last piece holds its last byte)."""
    starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
    starts = np.maximum.accumulate(starts) if len(starts) else starts
    return (np.searchsorted(starts, np.asarray(span_ends, dtype=np.int64), "left") - 1).clip(min=0).tolist()


def _response_char_ends(
    tokenizer: Any, responses: list[str], response_token_ids: list[list[int]]
) -> list[list[int] | None]:
    """Character ends of the critic's tokens of each response, via the same decoding as split_steps; None for a
    response whose tokens do not decode back to it exactly (then offsets are used)."""
    if not responses:
        return []
    padded = _pad_rows(response_token_ids, 0)
    mask = _pad_rows([[1] * len(r) for r in response_token_ids], 0)
    decoded = decode_with_char_ends(tokenizer, padded, mask)
    out: list[list[int] | None] = []
    for b, response in enumerate(responses):
        if decoded.texts[b] != response or not bool(decoded.valid[b, : len(response_token_ids[b])].all()):
            out.append(None)
        else:
            out.append(decoded.char_ends[b, : len(response_token_ids[b])].tolist())
    return out


def _encode_batch(
    tokenizer: Any,
    prompts: list[str],
    responses: list[str],
    spans: list[Sequence[tuple[int, int]]],
    samples: list[Any],
) -> list[EncodedSteps]:
    """Batched `encode_with_step_ends` (one tokenizer call for all prompts and one for all responses)."""
    for prompt, sample in zip(prompts, samples):
        if not isinstance(prompt, str) or prompt == "":
            raise ValueError(
                f"sample {sample}: the prompt is empty; the critic reads v_0 at the prompt's last token, so each "
                "sample needs a non-empty prompt text"
            )
    span_ends = [_check_spans(s, len(r), sample) for s, r, sample in zip(spans, responses, samples)]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"] if responses else []
    char_ends = _response_char_ends(tokenizer, responses, response_ids)
    out = []
    for b, sample in enumerate(samples):
        if len(prompt_ids[b]) == 0:
            raise ValueError(f"sample {sample}: the prompt {prompts[b][:60]!r} encodes to no token")
        if char_ends[b] is not None:
            ends = _end_tokens_from_char_ends(char_ends[b], span_ends[b])
        else:
            offsets = tokenizer(responses[b], add_special_tokens=False, return_offsets_mapping=True)
            if list(offsets["input_ids"]) != list(response_ids[b]):
                raise ValueError(f"sample {sample}: the tokenizer encodes the response differently on a second call")
            ends = _end_tokens_from_offsets(list(offsets["offset_mapping"]), span_ends[b])
        prompt_length = len(prompt_ids[b])
        out.append(
            EncodedSteps(
                input_ids=list(prompt_ids[b]) + list(response_ids[b]),
                prompt_end=prompt_length - 1,
                step_ends=[prompt_length + e for e in ends],
            )
        )
    return out


def encode_with_step_ends(
    tokenizer: Any, prompt: str, response: str, spans: Sequence[tuple[int, int]], *, sample: Any = None
) -> EncodedSteps:
    """Critic input ids for one sample, with the prompt's last token and each step's last token.

    The prompt and the response are tokenized separately (``add_special_tokens=False``) and concatenated, so
    the prompt's last token never holds response text (v_0 is read there). A tokenizer that prepends a space to
    every text it encodes (SentencePiece "▁") does so for the response too; that is what the critic reads.
    ``step_ends[h]`` is the index in ``input_ids`` of the token that holds the last character of span h
    (``response[spans[h][1] - 1]``), found through the character ends of the response tokens (byte-level:
    the token holding the character's last byte), or through offset mappings when the tokenizer's decode does
    not reproduce the response (normalisers).

    Args:
        tokenizer: the critic tokenizer (a transformers fast tokenizer).
        prompt: the exact text the critic reads before the response (chat template already applied).
        response: the response text.
        spans: ``[start, end)`` character spans of the steps in ``response`` (e.g. from `step_char_spans`).
        sample: a name for error messages (index or id).

    Raises:
        ValueError: empty prompt, or spans not increasing inside the response (naming the sample).
    """
    return _encode_batch(tokenizer, [prompt], [response], [list(spans)], [0 if sample is None else sample])[0]


_SAME: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    try:
        cached = _SAME.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        fingerprint = backend.to_str()
    else:
        fingerprint = repr(sorted(tokenizer.get_vocab().items())) + repr(sorted(_special_ids(tokenizer)))
    fingerprint = f"{len(tokenizer)}:{fingerprint}"
    try:
        _SAME[tokenizer] = fingerprint
    except TypeError:
        pass
    return fingerprint


def same_tokenizer(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are the same object or tokenize identically (same serialised vocabulary,
    merges, normaliser, pre-tokeniser and added tokens): then token ids mean the same text in both."""
    return a is b or (len(a) == len(b) and _tokenizer_fingerprint(a) == _tokenizer_fingerprint(b))


def _prompt_id_rows(prompt_ids: Any, prompt_mask: Any, batch: int) -> list[list[int]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != batch:
            raise ValueError(f"prompt_ids must be [B={batch}, P], got {tuple(prompt_ids.shape)}")
        if prompt_mask is None:
            raise ValueError("prompt_ids as a padded tensor needs prompt_mask (verl's prompt attention mask)")
        if prompt_mask.shape != prompt_ids.shape:
            raise ValueError(
                f"prompt_mask must have the shape of prompt_ids {tuple(prompt_ids.shape)}, "
                f"got {tuple(prompt_mask.shape)}"
            )
        ids = prompt_ids.detach().cpu().tolist()
        keep = (prompt_mask.detach().cpu() != 0).tolist()
        return [[i for i, k in zip(row, krow) if k] for row, krow in zip(ids, keep)]
    rows = [list(map(int, row)) for row in prompt_ids]
    if len(rows) != batch:
        raise ValueError(f"prompt_ids has {len(rows)} rows for {batch} responses")
    return rows


def align_to_critic(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    policy_tokenizer: Any,
    critic_tokenizer: Any,
    split: StepSplit,
    *,
    prompts: Sequence[str] | None = None,
    prompt_ids: torch.Tensor | Sequence[Sequence[int]] | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> list[EncodedSteps]:
    """Critic inputs for a batch of policy responses split into steps: per sample the critic token ids of
    prompt + response, the prompt's last token (v_0) and the token of each step's end (v_h).

    * Same tokenizer (`same_tokenizer`: the same object or an identical serialisation), given ``prompt_ids``:
      no tokenizer call at all (fast path). ``input_ids`` = the prompt's unmasked ids + the response's
      unmasked ids (special tokens such as EOS included, as the policy produced them);
      ``step_ends[h]`` = prompt length + the rank of ``split.step_ends[b, h]`` among the unmasked response
      tokens. With ``prompts`` texts instead of ids, only the prompts are encoded.
    * Another tokenizer: the critic reads the same text, re-tokenised. The response text is
      ``split.texts[b]`` (the policy's decoded response without special tokens), step h ends at character
      ``split.step_char_ends[b, h]``, and `encode_with_step_ends` finds the critic token holding that step's
      last character. ``prompts`` (texts) are required here: the critic's chat template is the caller's
      choice, and **the prompt text passed is exactly what the critic reads** (format it with
      ``critic_tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)`` for a chat
      PRM, or pass the raw question for a PRM trained on plain text).

    Steps are the same text in both vocabularies: for each h the critic's tokens up to ``step_ends[h]``
    decode to the prompt + the response text up to (at least) the end of step h, and ``step_ends[h]`` is the
    critic token that holds step h's last character.

    Args:
        response_ids: int [B, T] policy response ids (the ids ``split`` was computed from).
        response_mask: [B, T] 0/1 mask of the response tokens.
        policy_tokenizer: the tokenizer of ``response_ids``.
        critic_tokenizer: the critic's tokenizer.
        split: the `split_steps` result for these responses.
        prompts: B prompt texts exactly as the critic reads them.
        prompt_ids: the policy's prompt ids instead (same tokenizer only): a [B, P] tensor with
            ``prompt_mask`` (verl's left-padded prompts) or B lists of ids.

    Returns:
        B `EncodedSteps` in input order.

    Raises:
        ValueError: shape mismatches, a split of another batch, missing prompts, an empty prompt (naming the
            sample).
    """
    _check_ids_and_mask(response_ids, response_mask)
    batch = response_ids.shape[0]
    if split.step_ids.shape != response_ids.shape or len(split.texts) != batch:
        raise ValueError(
            f"split is for a batch of shape {tuple(split.step_ids.shape)} ({len(split.texts)} texts), "
            f"response_ids has shape {tuple(response_ids.shape)}: pass the split_steps result of these responses"
        )
    if prompts is not None and len(prompts) != batch:
        raise ValueError(f"prompts has {len(prompts)} texts for {batch} responses")
    if prompts is None and prompt_ids is None:
        raise ValueError("pass prompts= (texts the critic reads) or prompt_ids= (same tokenizer only)")
    num_steps = split.num_steps.cpu().tolist()

    if same_tokenizer(policy_tokenizer, critic_tokenizer):
        if prompt_ids is not None:
            prompt_rows = _prompt_id_rows(prompt_ids, prompt_mask, batch)
        else:
            assert prompts is not None
            for b, prompt in enumerate(prompts):
                if not isinstance(prompt, str) or prompt == "":
                    raise ValueError(f"sample {b}: the prompt is empty; the critic reads v_0 at its last token")
            prompt_rows = [list(r) for r in critic_tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
        mask = response_mask.detach().cpu() != 0
        ids = response_ids.detach().cpu().tolist()
        rank = (mask.cumsum(dim=1) - 1).gather(1, split.step_ends.cpu().clamp(min=0))  # [B, S]
        out = []
        for b in range(batch):
            if not prompt_rows[b]:
                raise ValueError(f"sample {b}: the prompt has no token; the critic reads v_0 at its last token")
            prompt_length = len(prompt_rows[b])
            response_row = [i for i, m in zip(ids[b], mask[b].tolist()) if m]
            out.append(
                EncodedSteps(
                    input_ids=prompt_rows[b] + response_row,
                    prompt_end=prompt_length - 1,
                    step_ends=[prompt_length + r for r in rank[b, : num_steps[b]].tolist()],
                )
            )
        return out

    if prompts is None:
        raise ValueError(
            "the critic tokenizer differs from the policy's: pass prompts= as the texts the critic reads "
            "(apply the critic's chat template yourself if it has one); prompt_ids cannot be re-tokenised"
        )
    char_ends = split.step_char_ends.cpu().tolist()
    spans = []
    for b in range(batch):
        ends = char_ends[b][: num_steps[b]]
        spans.append(list(zip([0] + ends[:-1], ends)))
    # invalid UTF-8 in a policy response decodes to U+FFFD, which the critic reads as a character
    return _encode_batch(critic_tokenizer, list(prompts), list(split.texts), spans, list(range(batch)))

"""Tokenizer tables: special ids and, for byte-level BPE tokenizers, the id->bytes table (built once per
tokenizer and checked against its own ``decode`` of the whole vocabulary)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


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

"""Byte-level BPE tokenizers trained locally (no hub downloads), wrapped as transformers tokenizers.

Used by the tests (two tokenizers with different merges) and by recipes that train a model from scratch.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["train_byte_level_bpe"]


def train_byte_level_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|pad|>"),
    eos_token: str = "<|endoftext|>",
    pad_token: str = "<|pad|>",
) -> PreTrainedTokenizerFast:
    """Train a GPT-2-style byte-level BPE tokenizer on ``texts`` (deterministic for the same texts).

    Byte-level: every string round-trips, multi-byte characters may split over tokens, and whitespace merges
    with neighbouring characters (".\\n\\n", " the") as in the tokenizers of real LLMs.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token, pad_token=pad_token)

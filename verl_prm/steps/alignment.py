"""Critic side: critic input ids with the token of each step's end (`encode_with_step_ends`), tokenizer
identity (`same_tokenizer`) and the alignment of a policy batch to a critic (`align_to_critic`)."""

from __future__ import annotations

import json

import weakref
from typing import Any, Sequence

import numpy as np
import torch

from verl_prm.steps.decoding import _check_ids_and_mask, decode_with_char_ends
from verl_prm.steps.results import EncodedSteps, StepSplit
from verl_prm.steps.tables import _special_ids
from verl_prm.steps.tokens import _pad_rows


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


def _check_separable(ends: list[int], response_ids: Sequence[int], tokenizer: Any, sample: Any) -> None:
    """Each step must end in its own critic token: when one critic token holds the last characters of steps
    h - 1 and h (a critic token longer than a step, e.g. fixed-size token steps of another vocabulary), the
    critic has no position to read v_h apart from v_{h-1}."""
    for h in range(1, len(ends)):
        if ends[h] <= ends[h - 1]:
            piece = tokenizer.decode([response_ids[ends[h]]]) if ends[h] < len(response_ids) else ""
            raise ValueError(
                f"sample {sample}: steps {h - 1} and {h} end in the same critic token ({piece!r}, response token "
                f"{ends[h]}): the critic's tokenizer cannot separate these steps. Split steps at a text "
                "delimiter (delimiter=, e.g. '\\n\\n', instead of max_tokens= or a regex ending inside a word) "
                "or use a critic with the policy's tokenizer"
            )


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
    *,
    separable: bool = False,
) -> list[EncodedSteps]:
    """Batched `encode_with_step_ends` (one tokenizer call for all prompts and one for all responses). With
    ``separable``, two steps ending in one critic token are an error (``_check_separable``)."""
    for prompt, sample in zip(prompts, samples):
        if not isinstance(prompt, str) or prompt == "":
            raise ValueError(
                f"sample {sample}: the prompt is empty; the critic reads v_0 at the prompt's last token, so each "
                "sample needs a non-empty prompt text"
            )
    span_ends = [_check_spans(s, len(r), sample) for s, r, sample in zip(spans, responses, samples)]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    # the response is the policy's text: never special tokens (a written "<|im_start|>" must not forge a turn)
    response_ids = (tokenizer(responses, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                    if responses else [])
    char_ends = _response_char_ends(tokenizer, responses, response_ids)
    out = []
    for b, sample in enumerate(samples):
        if len(prompt_ids[b]) == 0:
            raise ValueError(f"sample {sample}: the prompt {prompts[b][:60]!r} encodes to no token")
        if char_ends[b] is not None:
            ends = _end_tokens_from_char_ends(char_ends[b], span_ends[b])
        else:
            offsets = tokenizer(responses[b], add_special_tokens=False, split_special_tokens=True,
                                return_offsets_mapping=True)
            if list(offsets["input_ids"]) != list(response_ids[b]):
                raise ValueError(f"sample {sample}: the tokenizer encodes the response differently on a second call")
            ends = _end_tokens_from_offsets(list(offsets["offset_mapping"]), span_ends[b])
        if separable:
            _check_separable(ends, response_ids[b], tokenizer, sample)
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
    not reproduce the response (normalisers). Ends never decrease; two consecutive steps share an end when one
    token holds the last characters of both (a space merged with the next word: steps ``"- "`` and ``"b"`` end in
    ``" b"``); the callers decide what that means (``align_to_critic`` refuses it, search and training read the
    shared token for both).

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
        # Padding and truncation are call settings that a padded call stores in the backend, not part of what
        # the ids mean: two copies of one vocabulary must match whatever calls were made on them.
        serialised = json.loads(backend.to_str())
        serialised.pop("padding", None)
        serialised.pop("truncation", None)
        fingerprint = json.dumps(serialised, sort_keys=True)
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
    # the estimator's steps are the policy's: each needs a critic token of its own to read its value at
    return _encode_batch(critic_tokenizer, list(prompts), list(split.texts), spans, list(range(batch)),
                         separable=True)


def merge_shared_step_ends(step_ends: Sequence[int]) -> tuple[list[int], list[int]]:
    """Distinct critic read positions of a node's steps, and which one each step reads.

    Step ends come from ``encode_with_step_ends`` and never decrease; two consecutive steps share an end when
    every character of the later one lies in the critic token that holds the earlier one's last character
    (``--delimiter ' '``: the step "y" after "x " inside the critic token " y"; or a step cut by
    ``--max-step-tokens`` inside a critic token). Such steps are merged, as ``verl_prm.steps`` merges them: the
    critic reads one value at the shared token and both steps get it (the later step's progress is 0).

    Returns:
        ``(reads, read_of_step)``: strictly increasing positions, and for step h the index into ``reads``
        (``step_ends[h] == reads[read_of_step[h]]``).

    Raises:
        ValueError: decreasing step ends (not an output of ``encode_with_step_ends``).
    """
    reads: list[int] = []
    read_of_step: list[int] = []
    for h, end in enumerate(step_ends):
        if reads and end < reads[-1]:
            raise ValueError(f"step_ends[{h}]={end} is before step_ends[{h - 1}]={reads[-1]}: step ends must not decrease")
        if not reads or end > reads[-1]:
            reads.append(int(end))
        read_of_step.append(len(reads) - 1)
    return reads, read_of_step

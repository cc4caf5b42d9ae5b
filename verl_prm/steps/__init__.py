"""Steps: segmentation of responses and alignment to a critic tokenizer (docs: steps.md).

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

Modules (everything below is importable from ``verl_prm.steps`` itself):

* ``results``: ``StepSplit``, ``EncodedSteps``, ``DecodedResponses`` and ``DEFAULT_DELIMITER``;
* ``text``: the text rules (`step_char_spans`: delimiters, regexes, no empty steps, ``max_steps``);
* ``tables``: per-tokenizer tables (special ids; the id->bytes table of byte-level tokenizers);
* ``decoding``: `decode_with_char_ends` (token -> text with the character end of every token);
* ``tokens``: the step tensors (`split_steps`, `steps_at_char_ends`, fixed-size steps);
* ``alignment``: the critic side (`encode_with_step_ends`, `merge_shared_step_ends`, `same_tokenizer`,
  `align_to_critic`).
"""

from verl_prm.steps.alignment import align_to_critic, encode_with_step_ends, merge_shared_step_ends, same_tokenizer
from verl_prm.steps.decoding import decode_with_char_ends
from verl_prm.steps.results import DEFAULT_DELIMITER, DecodedResponses, EncodedSteps, StepSplit
from verl_prm.steps.text import step_char_spans
from verl_prm.steps.tokens import split_steps, steps_at_char_ends

__all__ = [
    "DEFAULT_DELIMITER",
    "DecodedResponses",
    "EncodedSteps",
    "StepSplit",
    "align_to_critic",
    "decode_with_char_ends",
    "encode_with_step_ends",
    "merge_shared_step_ends",
    "same_tokenizer",
    "split_steps",
    "step_char_spans",
    "steps_at_char_ends",
]

"""The critic input of the public PRMs' formats (:mod:`verl_prm.critic.formats`) from the policy's text: the
formats' required tokens (checked against the documented pieces), the authors' steps cut from ours
(``split_pieces``), and the policy's text kept as data: it never becomes a special token
(``encode_with_policy_text``) and the format's separator text in it is removed (``remove_separator_text``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

logger = logging.getLogger(__name__)


def resolve_token_id(tokenizer, token: str | int, what: str) -> int:
    """Id of a marker/candidate token: an int is taken as is; a string must be one vocabulary entry (added
    special tokens included), else its encoding must be exactly one token."""
    if isinstance(token, int):
        return token
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is not None and token_id != tokenizer.unk_token_id:
        return int(token_id)
    encoded = tokenizer.encode(token, add_special_tokens=False)
    if len(encoded) == 1:
        return int(encoded[0])
    raise ValueError(
        f"{what} {token!r} is not a single token of the critic's tokenizer (it encodes to {encoded}); add it as a "
        f"special token (tokenizer.add_special_tokens) and resize the model's embeddings, or pass its id"
    )


@dataclass(frozen=True)
class RequiredToken:
    """A token a public format needs, as its authors' tokenizer has it: the vocabulary ``piece`` and its id in
    the authors' vocabulary (``documented_id``, from ``source``)."""

    role: str
    piece: str
    documented_id: int
    source: str


def check_required_token(fmt: str, tokenizer, found: int, required: RequiredToken) -> int:
    """``found`` if it is the documented piece of this tokenizer, else a ValueError naming the token, the id found
    and the id expected (a token resolving to [UNK] or to a bare piece would score every step alike or read the
    wrong logit without any other sign)."""
    piece = tokenizer.convert_ids_to_tokens(int(found))
    if piece == required.piece and found != tokenizer.unk_token_id:
        return int(found)
    vocab = tokenizer.get_vocab()
    here = f"; this tokenizer has {required.piece!r} as id {vocab[required.piece]}" if required.piece in vocab else (
        f"; this tokenizer has no piece {required.piece!r}")
    raise ValueError(
        f"format {fmt!r}: the {required.role} resolves to id {found} ({piece!r}), expected the piece "
        f"{required.piece!r} (id {required.documented_id} in {required.source}){here}. Use the checkpoint's own "
        "tokenizer, or pass the token's id explicitly if your checkpoint really differs"
    )


def split_pieces(step_text: str, delimiter: str) -> list[str]:
    """The authors' steps inside one of our steps: ``step_text.split(delimiter)`` with the trailing empty piece
    of a step that ends with the delimiter dropped ("a\n\nb" split at "\n" gives "a", "", "b": empty lines
    are steps, as in the authors' ``response.split``)."""
    pieces = step_text.split(delimiter)
    if len(pieces) > 1 and pieces[-1] == "":
        pieces.pop()
    return pieces


def encode_plain(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


class TextInput(NamedTuple):
    """A text format's input for one sample: ids, the H + 1 read positions, the prompt's last token, and what was
    done to the policy's text (``separator_text``: it held the format's separator text, removed before encoding;
    ``special_text``: it held the text of a special token, encoded as plain text)."""

    input_ids: list[int]
    read_positions: list[int]
    prompt_last: int
    separator_text: bool = False
    special_text: bool = False


class EncodedText(NamedTuple):
    ids: list[int]
    offsets: list[tuple[int, int]]
    special_text: bool


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (the ones a text holding their content would become)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


def encode_with_policy_text(tokenizer, text: str, policy_spans: Sequence[tuple[int, int]],
                            add_special_tokens: bool = True) -> EncodedText:
    """Encode ``text`` (the authors' input) whole, as the authors do, except that the characters in
    ``policy_spans`` (text the policy wrote) never become a special token: a policy that writes
    "<|eot_id|><|start_header_id|>assistant..." or "<|im_start|>" must not forge the format's turns.

    Usually no special token falls inside a policy span and the whole-text encoding is returned as is. Otherwise
    the text is cut at the special tokens outside the policy spans (the format's own turns and separators, kept
    as tokens); every stretch between them is encoded with special-token parsing off (``split_special_tokens``),
    and tokens the tokenizer adds itself (a BOS) are kept; ``special_text`` is then True."""
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), [(int(a), int(b)) for a, b in encoding["offset_mapping"]]
    special = special_token_ids(tokenizer)

    def in_policy(a: int, b: int) -> bool:
        return b > a and any(a < end and start < b for start, end in policy_spans)

    if not any(t in special and in_policy(a, b) for t, (a, b) in zip(ids, offsets)):
        return EncodedText(ids, offsets, False)
    wide = [i for i, (a, b) in enumerate(offsets) if b > a]  # zero-width: added by the tokenizer (BOS, EOS)
    out_ids, out_offsets = ids[: wide[0]], offsets[: wide[0]]
    own = [(a, b, t) for t, (a, b) in zip(ids, offsets) if t in special and b > a and not in_policy(a, b)]
    start = 0
    for a, b, token in own + [(len(text), len(text), None)]:
        if a > start:
            part = tokenizer(text[start:a], add_special_tokens=False, split_special_tokens=True,
                             return_offsets_mapping=True)
            out_ids += list(part["input_ids"])
            out_offsets += [(int(x) + start, int(y) + start) for x, y in part["offset_mapping"]]
        if token is not None:
            out_ids.append(token)
            out_offsets.append((a, b))
        start = max(start, b)
    return EncodedText(out_ids + ids[wide[-1] + 1 :], out_offsets + offsets[wide[-1] + 1 :], True)


def token_at(offsets: Sequence[tuple[int, int]], char: int) -> int:
    """Index of the token that holds character ``char`` (``offsets``: the encoding's character offsets)."""
    for i, (a, b) in enumerate(offsets):
        if a <= char < b:
            return i
    raise ValueError(f"no token holds character {char} of the critic input")


def remove_separator_text(pieces: list[str], separator: str) -> tuple[list[str], bool]:
    """The pieces without any occurrence of ``separator`` (removed until none is left: removing one may join
    another), and whether one was there. The format's separator is its own: text the policy wrote must not add
    a scored step or a separator the PRM reads."""
    found = False
    out = []
    for piece in pieces:
        while separator and separator in piece:
            piece = piece.replace(separator, "")
            found = True
        out.append(piece)
    return out, found


def _token_text(tokenizer, token_id: int) -> str:
    """The text a token id stands for as a text holds it (an added token's content; else the decoded id without
    the space a SentencePiece decoder strips or a byte-level "Ġ" adds), not the raw vocabulary piece ("▁ки")."""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False).strip()


def shepherd_tag(tokenizer, tag: str | int) -> tuple[int, str]:
    """(id, text) of math_shepherd's step tag, as the authors' input holds it: the text written after a step
    (``step + " " + text``) must be one vocabulary token, other than the unknown token. A tag given as an id gives
    the text that id stands for (``_token_text``), and that text must encode back to the id."""
    if isinstance(tag, bool) or not isinstance(tag, (int, str)):
        raise TypeError(f"format 'math_shepherd': tag must be a token text or id, got {tag!r}")
    if isinstance(tag, int) and not 0 <= tag < len(tokenizer):
        raise ValueError(f"format 'math_shepherd': tag id {tag} is outside the tokenizer's {len(tokenizer)} ids")
    text = _token_text(tokenizer, tag) if isinstance(tag, int) else tag
    if not text or text != text.strip():
        raise ValueError(f"format 'math_shepherd': tag {tag!r} gives the text {text!r}; the tag must be a "
                         "non-empty text without surrounding spaces (the authors' 'ки')")
    context = f"a {text}"  # a step, then the tag as the authors write it
    encoding = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
    covering = [int(t) for t, (a, b) in zip(encoding["input_ids"], encoding["offset_mapping"]) if b > 2]
    pieces = tokenizer.convert_ids_to_tokens(covering)
    if len(covering) != 1 or covering[0] == tokenizer.unk_token_id:
        written = [int(t) for t, (a, b) in zip(encoding["input_ids"], encoding["offset_mapping"]) if b > 1]
        raise ValueError(
            f"format 'math_shepherd': the tag {text!r} is not one token of the critic's tokenizer (' {text}' after a "
            f"step encodes to {tokenizer.convert_ids_to_tokens(written)}"
            f"{', the unknown token' if tokenizer.unk_token_id in covering else ''}); "
            "use the checkpoint's own tag ('ки' for math-shepherd-mistral-7b-prm) and tokenizer, or add the tag to "
            "the tokenizer (tokenizer.add_tokens) and resize the model's embeddings"
        )
    if isinstance(tag, int) and covering[0] != tag:
        raise ValueError(
            f"format 'math_shepherd': tag id {tag} stands for the text {text!r}, but that text written after a step "
            f"is the token {covering[0]} ({pieces[0]!r}); pass the tag as text (tag={text!r}) or the id of that token"
        )
    return covering[0], text


def rlhflow_chat(tokenizer, prompt: str, turns: Sequence[str]
                 ) -> tuple[str, list[tuple[int, int]], list[int], int]:
    """RLHFlow's chat for ``prompt`` and the step ``turns``: (text, the character span of each turn in it, where
    each "+" answer starts, the prompt's last character). The template is rendered with a placeholder for each
    turn, replaced afterwards, so the spans come from the template, whatever text the policy wrote; the result
    must equal the template rendered on the turns themselves."""
    marks = [f"\ue000{k}\ue001" for k in range(len(turns))]
    contents = [prompt + " " + marks[0]] + marks[1:] if turns else [prompt]
    conversation: list[dict[str, str]] = []
    answer_marks = []
    for content in contents:
        conversation.append({"role": "user", "content": content})
        # where the assistant's "+" starts: the length of the conversation so far with the generation prompt
        answer_marks.append(len(tokenizer.apply_chat_template(conversation, tokenize=False,
                                                              add_generation_prompt=True)))
        conversation.append({"role": "assistant", "content": "+"})
    if not turns:
        conversation.pop()
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    text, spans, shifts, start = "", [], [], 0
    for mark, turn in zip(marks, turns):
        at = rendered.find(mark, start)
        if at < 0 or rendered.count(mark) != 1:
            raise ValueError("rlhflow: the chat template does not render a user message's content as it is; check "
                             "the tokenizer's chat template")
        text += rendered[start:at]
        spans.append((len(text), len(text) + len(turn)))
        text += turn
        start = at + len(mark)
        shifts.append((start, len(text) - start))  # characters from `start` on move by this much
    text += rendered[start:]
    answers = [c + ([d for at, d in shifts if at <= c] or [0])[-1] for c in answer_marks[: len(turns)]]
    if not turns:
        return text, spans, answers, text.index(prompt) + len(prompt) - 1
    for message, content in zip(conversation[::2], [prompt + " " + turns[0], *turns[1:]]):
        message["content"] = content
    if text != tokenizer.apply_chat_template(conversation, tokenize=False):
        raise ValueError("rlhflow: the chat template renders a user message's content differently from the text "
                         "around it; check the tokenizer's chat template")
    return text, spans, answers, spans[0][0] - 2  # the prompt's last character, before " " + the first turn


def policy_pieces(steps: Sequence[str], delimiter: str, separator: str) -> tuple[list[list[str]], bool]:
    """Our steps cut into the authors' steps, each without the format's separator text (``remove_separator_text``),
    and whether a step held it."""
    pieces_per_step, found = [], False
    for step in steps:
        pieces, removed = remove_separator_text(split_pieces(step, delimiter), separator)
        pieces_per_step.append(pieces)
        found = found or removed
    return pieces_per_step, found


def last_of_each(markers: list[int], pieces_per_step: list[list[str]], name: str, marker: str) -> list[int]:
    expected = sum(len(p) for p in pieces_per_step)
    if len(markers) != expected:
        raise ValueError(f"{name}: the input holds {len(markers)} {marker!r} tokens after the prompt, expected "
                         f"{expected}, although the step texts hold no {marker!r}: the tokenizer makes the separator "
                         "token from other text; use the checkpoint's own tokenizer")
    reads, k = [], -1
    for pieces in pieces_per_step:
        k += len(pieces)
        reads.append(markers[k])
    return reads


def check_delimiter(delimiter: str) -> str:
    if not isinstance(delimiter, str) or delimiter == "":
        raise ValueError(f"step_delimiter must be a non-empty string, got {delimiter!r}")
    return delimiter


def text_flags(built: Sequence[tuple], sample_offset: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] separator_text, [B] special_text) of the built inputs (False for token formats), logged when set."""
    separator = torch.tensor([isinstance(b, TextInput) and b.separator_text for b in built], dtype=torch.bool)
    special = torch.tensor([isinstance(b, TextInput) and b.special_text for b in built], dtype=torch.bool)
    for flags, what in ((separator, "the format's separator text, removed"),
                        (special, "special-token text, read as plain text")):
        if bool(flags.any()):
            logger.warning("critic format %r: %d response(s) held %s (first: sample %d)", name,
                           int(flags.sum()), what, sample_offset + int(flags.nonzero()[0]))
    return separator, special

"""Critic checkpoint formats: one adapter class per format, each behind the same small interface.

An adapter knows (1) how to load the checkpoint into a *backbone* (a transformers base model whose output is the
last hidden state) plus a *head* applied only at the read positions, (2) how to build the critic's input from a
prompt and its steps and where the values are read in it, and (3) how to turn the head's logits into a value.

Public PRMs are fed exactly the input their authors build (their model card / reference script, cited per
class): a *text* format (``text_input = True``) rebuilds the input from the prompt text and the step texts; the
others work on token ids. A step text is cut at the format's ``step_delimiter`` into the authors' steps
(``step.split(delimiter)``, a trailing empty piece dropped); the value of our step is the authors' value at its
last piece. The public formats have no prompt value: v_0 is read at the prompt's last token (no marker), so every
step's context is exactly the authors' one.

Formats (``ProverCritic.from_pretrained(path, format=NAME)``; the table with commands: docs/critic.md):

- ``value_head`` (native; what our PAV training writes): ``AutoModelForTokenClassification`` with
  ``num_labels=1``; ``v = sigmoid(logit)`` at each step's last token; v_0 at the prompt's last token.
- ``qwen_prm`` (Qwen2.5-Math-PRM-7B/72B): text = prompt + ``"<extra_0>".join(pieces) + "<extra_0>"``, encoded
  whole; ``v = softmax(logits)[positive_label]`` of the two-class head at each separator.
- ``pure_prm`` (PURE-PRM-7B): token-level: a step's last token is dropped when its text ends with "\n\n" (the
  period of ".\n\n" goes with it, as in PURE's code) and the "\n" token is appended; ``v = P(pos)``
  (``score="pos_minus_neg"``: PURE's ``P(pos) - P(neg)`` in [-1, 1]).
- ``math_shepherd`` (math-shepherd-mistral-7b-prm): text = prompt + " " + ``"\n".join(piece + " ки")``;
  ``v = softmax([z_+, z_-])[0]`` of the LM-head logits of "▁+", "▁-" at each "▁ки".
- ``rlhflow`` (RLHFlow Llama3.1-8B-PRM-Mistral/Deepseek-Data): a chat, one user turn per piece (the first is
  prompt + " " + piece), each answered "+" by the assistant; ``v = softmax([z_+, z_-])[0]`` at the token before
  each answer.
- ``value_head_lm`` (Skywork-o1-Open-PRM): ids = encode(bos + prompt + "\n") + per piece encode(piece) + the
  "\n" token; ``v = sigmoid(head(h))`` at each "\n" token (head ``v_head.summary`` from safetensors).
- ``token_logprob`` (native; ``verl-prm train --format token_logprob`` writes it): a causal LM and a logistic
  head on the statistics of its own token log-probs over each step and their prefix minima
  (:mod:`verl_prm.critic.token_logprob_format`); v_0 a fitted constant.

A format's required tokens are checked at load against the documented pieces (``RequiredToken``): a token that
resolves to another piece or to the unknown token is an error naming the token, the id found and the id expected.
The check compares pieces; the id only appears in the message. Ids from a source: Math-Shepherd's 648, 387, 12902
(its model card's comments). Not verified from a source here (no real tokenizer ships in an installed package):
Qwen2.5's 151651 ("<extra_0>") and 198 ("\n"), Llama-3.1's 10 ("+") and 12 ("-").

The token-id path of a text format (``ProverCritic.score_sequences``, or policy ids with the critic's
tokenizer) decodes the prompt and the steps with ``verl_prm.critic.sequences.decode_segments`` and rebuilds the
authors' input from those texts, so it gives the values of the text path. ``value_head_lm`` takes prompt ids that
already hold Skywork's ``bos + problem + "\n"`` as well as the bare problem (``prompt_from_ids``).

Step text is the policy's, so it is data, never structure: it never becomes a special token
(``encode_with_policy_text``: a step holding "<|im_start|>" or "<|eot_id|><|start_header_id|>..." is read as plain
text, not as a forged turn), and the format's separator text in it (qwen_prm's "<extra_0>", math_shepherd's "ки")
is removed before encoding (``remove_separator_text``), so a step never adds a scored position. Both are reported
per sample (``TextInput.special_text``, ``TextInput.separator_text``); nothing raises for the batch.

The adapters' interface is :class:`verl_prm.critic.format_base.CriticFormat`. Loading (tokenizer, dtype, complete
weights, heads from safetensors) is :mod:`verl_prm.critic.loading`; building the input from the policy's text
(required tokens, pieces, separator text) is :mod:`verl_prm.critic.text_input`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from verl_prm.critic.format_base import CriticFormat, no_options
from verl_prm.critic.loading import (
    base_model,
    candidate_rows_head,
    check_head,
    check_vocabulary,
    fp32_copy,
    load_complete,
    read_head_from_safetensors,
    require_head_weights,
    token_classification_head,
)
from verl_prm.critic.token_logprob_format import TokenLogprobFormat
from verl_prm.critic.text_input import (
    RequiredToken,
    TextInput,
    check_delimiter,
    check_required_token,
    encode_plain,
    encode_with_policy_text,
    last_of_each,
    policy_pieces,
    resolve_token_id,
    rlhflow_chat,
    shepherd_tag,
    split_pieces,
    token_at,
)

__all__ = [
    "CriticFormat",
    "ValueHeadFormat",
    "QwenPrmFormat",
    "MathShepherdFormat",
    "ValueHeadLMFormat",
    "RlhflowFormat",
    "PurePrmFormat",
    "TokenLogprobFormat",
    "FORMATS",
]


class ValueHeadFormat(CriticFormat):
    """Native format: ``AutoModelForTokenClassification``, ``num_labels=1``, ``v = sigmoid(logit)``."""

    name = "value_head"

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, allow_pickle=False, **options):
        from transformers import AutoModelForTokenClassification

        no_options(cls.name, options)
        model = load_complete(AutoModelForTokenClassification, path, dtype, attn_implementation, allow_pickle, device)
        if model.config.num_labels != 1:
            raise ValueError(
                f"{path}: format 'value_head' needs num_labels=1, the checkpoint has {model.config.num_labels}; "
                "a two-class head is format 'qwen_prm'"
            )
        head = token_classification_head(model)
        require_head_weights(path, model, head)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        return cls(model, base_model(model), fp32_copy(head))

    def logits_to_values(self, logits):
        return torch.sigmoid(logits[:, 0])


QWEN_SEPARATOR = RequiredToken("qwen_prm separator '<extra_0>'", "<extra_0>", 151651,
                               "the Qwen2.5 vocabulary (Qwen/Qwen2.5-Math-PRM-7B tokenizer.json; id not verified "
                               "from a source here)")


def _load_two_class_head(cls_name, path, dtype, attn_implementation, allow_pickle, device, head_prefix):
    """A two-class token classifier, or the public Qwen2.5-Math-PRM layout (custom architecture
    Qwen2ForProcessRewardModel: ``AutoModel`` + ``score`` = Linear-ReLU-Linear read from safetensors)."""
    from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    architectures = getattr(config, "architectures", None) or []
    if head_prefix is None and any(a.endswith("ForTokenClassification") for a in architectures):
        model = load_complete(AutoModelForTokenClassification, path, dtype, attn_implementation, allow_pickle, device)
        head = token_classification_head(model)
        require_head_weights(path, model, head)
        head, backbone = fp32_copy(head), base_model(model)
    else:
        prefix = head_prefix or "score"
        model = load_complete(AutoModel, path, dtype, attn_implementation, allow_pickle, device, quiet=True,
                               head_prefixes=(prefix,))
        _, head = read_head_from_safetensors(path, (prefix,))
        backbone = model
    check_head(path, cls_name, head, model, outputs=2)
    model.eval()
    return model, backbone, head


class QwenPrmFormat(CriticFormat):
    """Qwen2.5-Math-PRM, scored as its model card does (https://huggingface.co/Qwen/Qwen2.5-Math-PRM-7B):
    the assistant content is ``"<extra_0>".join(steps) + "<extra_0>"`` after the chat-templated prompt, the whole
    conversation encoded as one string, and the reward at each "<extra_0>" is ``softmax(logits)[1]`` of the
    two-class head. Our step is cut at ``step_delimiter`` ("\n\n") into pieces, each followed by the separator.
    The card's string ends with the template's "<|im_end|>\n" after the last separator; ours stops at it (causal
    attention: no value changes)."""

    name = "qwen_prm"
    text_input = True

    def __init__(self, *args, positive_label: int = 1, separator_text: str = "<extra_0>",
                 step_delimiter: str = "\n\n", **kwargs):
        super().__init__(*args, **kwargs)
        self.positive_label = positive_label
        self.separator_text = separator_text
        self.step_delimiter = step_delimiter

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, separator: str | int = "<extra_0>",
             positive_label: int = 1, head_prefix: str | None = None, step_delimiter: str = "\n\n",
             allow_pickle=False, **options):
        no_options(cls.name, options)
        marker_id = resolve_token_id(tokenizer, separator, "qwen_prm separator")
        if separator == "<extra_0>":
            check_required_token(cls.name, tokenizer, marker_id, QWEN_SEPARATOR)
        separator_text = (tokenizer.decode([marker_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                          if isinstance(separator, int) else separator)
        encoding = tokenizer("a" + separator_text, add_special_tokens=False, return_offsets_mapping=True)
        written = [int(t) for t, (_, b) in zip(encoding["input_ids"], encoding["offset_mapping"]) if b > 1]
        if written != [marker_id]:  # the input writes the separator's text after each step
            raise ValueError(
                f"format 'qwen_prm': the separator {separator!r} is written after a step as {separator_text!r}, "
                f"which encodes to {tokenizer.convert_ids_to_tokens(written)}, not the one token {marker_id}; pass "
                "a separator that is one vocabulary token (the checkpoint's '<extra_0>')"
            )
        model, backbone, head = _load_two_class_head(cls.name, path, dtype, attn_implementation, allow_pickle, device,
                                                     head_prefix)
        check_vocabulary(path, tokenizer, model)
        return cls(model, backbone, head, marker_id=marker_id, positive_label=positive_label,
                   separator_text=separator_text, step_delimiter=check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step, separator_text = policy_pieces(steps, self.step_delimiter, self.separator_text)
        text, spans = prompt, []
        for pieces in pieces_per_step:
            for piece in pieces:
                spans.append((len(text), len(text) + len(piece)))
                text += piece + self.separator_text
        encoded = encode_with_policy_text(tokenizer, text, spans)
        prompt_last = token_at(encoded.offsets, len(prompt) - 1)
        markers = [i for i, t in enumerate(encoded.ids) if t == self.marker_id and i > prompt_last]
        reads = last_of_each(markers, pieces_per_step, self.name, self.separator_text)
        return TextInput(encoded.ids, [prompt_last] + reads, prompt_last, separator_text, encoded.special_text)

    def logits_to_values(self, logits):
        return torch.softmax(logits, dim=-1)[:, self.positive_label]


PURE_NEWLINE = RequiredToken("pure_prm step token '\\n'", "Ċ", 198,
                             "the Qwen2.5 vocabulary (jinachris/PURE-PRM-7B; id not verified from a source here)")


class PurePrmFormat(CriticFormat):
    """PURE-PRM-7B (Qwen2.5-Math-7B, two-class token head), scored as PURE's RL code does
    (https://github.com/CJReinforce/PURE, openrlhf/trainer/ppo_utils/experience_maker.py, ``make_experience``):
    a step's tokens end at a token whose text ends with "\n\n"; that whole token is dropped (a period in ".\n\n"
    goes with it: PURE's ``solution_tokens[start : j - 1]``) and the "\n" token is appended; the reward is read
    at that "\n". PURE's last step ends at the last response token and drops it whatever it is (the EOS of a
    finished response); here a final step without separator drops only a trailing EOS, so a truncated response
    (no EOS) keeps its last token, where PURE would drop it.
    ``score="p_positive"`` (default, a value in [0, 1]) or ``"pos_minus_neg"`` (PURE's P(pos) - P(neg))."""

    name = "pure_prm"
    SCORES: ClassVar[tuple[str, ...]] = ("p_positive", "pos_minus_neg")

    def __init__(self, *args, separator_ids: frozenset[int] = frozenset(), eos_id: int | None = None,
                 score: str = "p_positive", **kwargs):
        super().__init__(*args, **kwargs)
        self.separator_ids = separator_ids
        self.eos_id = eos_id
        self.score = score

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, score: str = "p_positive",
             step_separator: str = "\n\n", head_prefix: str | None = None, allow_pickle=False, **options):
        no_options(cls.name, options)
        if score not in cls.SCORES:
            raise ValueError(f"pure_prm: score must be one of {list(cls.SCORES)}, got {score!r}")
        encoded = encode_plain(tokenizer, "\n", add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"pure_prm: '\\n' encodes to {encoded}, not one token; use the checkpoint's tokenizer")
        newline = check_required_token(cls.name, tokenizer, encoded[0], PURE_NEWLINE)
        separator_ids = frozenset(
            i for i in range(len(tokenizer))
            if tokenizer.decode([i], clean_up_tokenization_spaces=False).endswith(check_delimiter(step_separator))
        )
        model, backbone, head = _load_two_class_head(cls.name, path, dtype, attn_implementation, allow_pickle, device,
                                                     head_prefix)
        check_vocabulary(path, tokenizer, model)
        return cls(model, backbone, head, marker_id=newline, separator_ids=separator_ids,
                   eos_id=tokenizer.eos_token_id, score=score)

    def build_token_input(self, ids, prompt_end, step_ends):
        ids = list(ids)
        out = ids[: prompt_end + 1]
        reads = [prompt_end]
        start = prompt_end + 1
        for h, end in enumerate(step_ends):
            step = ids[start : end + 1]
            last = h == len(step_ends) - 1
            if step and (step[-1] in self.separator_ids or (last and step[-1] == self.eos_id)):
                step = step[:-1]
            out += step
            reads.append(len(out))
            out.append(self.marker_id)
            start = end + 1
        return out, reads, prompt_end

    def logits_to_values(self, logits):
        p = torch.softmax(logits, dim=-1)
        return p[:, 1] if self.score == "p_positive" else p[:, 1] - p[:, 0]


MATH_SHEPHERD_SOURCE = "the Mistral-7B vocabulary (peiyi9979/math-shepherd-mistral-7b-prm model card)"


class MathShepherdFormat(CriticFormat):
    """math-shepherd-mistral-7b-prm, scored as its model card does
    (https://huggingface.co/peiyi9979/math-shepherd-mistral-7b-prm): input ``f"{question} {output}"`` with every
    step written ``step + " ки\n"``, encoded whole (BOS added); ``candidate_tokens = encode("+ -")[1:]`` (ids 648,
    387: "▁+", "▁-"), ``step_tag_id = encode("ки")[-1]`` (12902: "▁ки"); the score at each tag is
    ``softmax(logits[candidate_tokens])[0]``. Our step is cut at ``step_delimiter`` ("\n") into pieces."""

    name = "math_shepherd"
    text_input = True

    def __init__(self, *args, softcap: float | None = None, tag_text: str = "ки", step_delimiter: str = "\n",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.softcap = softcap
        self.tag_text = tag_text
        self.step_delimiter = step_delimiter

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, tag: str | int = "ки",
             positive_token: str | int = "+", negative_token: str | int = "-", step_delimiter: str = "\n",
             allow_pickle=False, **options):
        from transformers import AutoModelForCausalLM

        no_options(cls.name, options)
        # The authors' resolution: the last pieces of encode("+ -") and encode("ки") ("▁"-prefixed pieces).
        marker_id, tag_text = shepherd_tag(tokenizer, tag)
        if tag == "ки":
            check_required_token(cls.name, tokenizer, marker_id,
                                 RequiredToken("math_shepherd tag 'ки'", "▁ки", 12902, MATH_SHEPHERD_SOURCE))
        pair = encode_plain(tokenizer, f"{positive_token} {negative_token}", add_special_tokens=False)
        candidates = []
        for k, (token, role, piece, documented) in enumerate(((positive_token, "positive", "▁+", 648),
                                                              (negative_token, "negative", "▁-", 387))):
            if isinstance(token, int):
                candidates.append(token)
                continue
            if len(pair) != 2:
                raise ValueError(f"format 'math_shepherd': {positive_token!r} {negative_token!r} encodes to {pair}, "
                                 "not two tokens; pass the token ids (positive_token=, negative_token=)")
            if token in ("+", "-"):
                check_required_token(cls.name, tokenizer, pair[k],
                                     RequiredToken(f"math_shepherd {role} token {token!r}", piece, documented,
                                                   MATH_SHEPHERD_SOURCE))
            candidates.append(pair[k])
        model = load_complete(AutoModelForCausalLM, path, dtype, attn_implementation, allow_pickle, device)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        head = candidate_rows_head(model, candidates)
        softcap = getattr(model.config, "final_logit_softcapping", None)
        return cls(model, base_model(model), head.eval(), marker_id=marker_id, softcap=softcap, tag_text=tag_text,
                   step_delimiter=check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step, separator_text = policy_pieces(steps, self.step_delimiter, self.tag_text)
        text, spans = f"{prompt} ", []
        for k, piece in enumerate(piece for pieces in pieces_per_step for piece in pieces):
            text += "\n" if k else ""
            spans.append((len(text), len(text) + len(piece)))
            text += f"{piece} {self.tag_text}"
        encoded = encode_with_policy_text(tokenizer, text, spans)
        prompt_last = token_at(encoded.offsets, len(prompt) - 1)
        tags = [i for i, t in enumerate(encoded.ids) if t == self.marker_id and i > prompt_last]
        reads = last_of_each(tags, pieces_per_step, self.name, self.tag_text)
        return TextInput(encoded.ids, [prompt_last] + reads, prompt_last, separator_text, encoded.special_text)

    def logits_to_values(self, logits):
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.softmax(logits, dim=-1)[:, 0]


RLHFLOW_SOURCE = ("the Llama-3.1 vocabulary (RLHFlow/Llama3.1-8B-PRM-Deepseek-Data, -Mistral-Data; ids not "
                  "verified from a source here)")


class RlhflowFormat(CriticFormat):
    """RLHFlow Llama3.1-8B-PRM-Mistral-Data / -Deepseek-Data, scored as RLHFlow's evaluation script does
    (https://github.com/RLHFlow/RLHF-Reward-Modeling, math-rm/prm_evaluate.py): a chat with one user turn per
    step (the first is ``problem + " " + step``), each answered "+" by the assistant, rendered with the model's
    chat template; ``candidate_tokens = [encode("+")[-1], encode("-")[-1]]`` (ids 10, 12, not verified from a
    source here) and the score of a step
    is ``softmax(logits[candidate_tokens])[0]`` at the token before its "+" answer (the authors' position -3).
    Our step is cut at ``step_delimiter`` ("\n\n") into pieces, each a user turn (stripped, as their steps):
    their ``--model_type Deepseek`` split. Their ``Mistral`` split (at "ки\n") needs responses with that tag."""

    name = "rlhflow"
    text_input = True

    def __init__(self, *args, positive_id: int = 0, step_delimiter: str = "\n\n", **kwargs):
        super().__init__(*args, **kwargs)
        self.positive_id = positive_id
        self.step_delimiter = step_delimiter

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, step_delimiter: str = "\n\n",
             allow_pickle=False, **options):
        from transformers import AutoModelForCausalLM

        no_options(cls.name, options)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"format 'rlhflow': the tokenizer of {str(path)!r} has no chat template")
        candidates = [
            check_required_token(cls.name, tokenizer, encode_plain(tokenizer, token)[-1],
                                 RequiredToken(f"rlhflow {role} token {token!r}", token, documented, RLHFLOW_SOURCE))
            for token, role, documented in (("+", "positive", 10), ("-", "negative", 12))
        ]
        model = load_complete(AutoModelForCausalLM, path, dtype, attn_implementation, allow_pickle, device)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        head = candidate_rows_head(model, candidates)
        return cls(model, base_model(model), head.eval(), positive_id=candidates[0],
                   step_delimiter=check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step = [split_pieces(step, self.step_delimiter) for step in steps]
        turns = [piece.strip() for pieces in pieces_per_step for piece in pieces]
        text, spans, answer_chars, prompt_char = rlhflow_chat(tokenizer, prompt, turns)
        # the rendered chat is tokenised without added BOS (apply_chat_template(tokenize=True) adds none)
        encoded = encode_with_policy_text(tokenizer, text, spans, add_special_tokens=False)
        prompt_last = token_at(encoded.offsets, prompt_char)
        answers = [token_at(encoded.offsets, c) for c in answer_chars]
        for a in answers:
            if encoded.ids[a] != self.positive_id:
                raise ValueError("rlhflow: the chat template does not put the assistant answer right after the "
                                 "generation prompt; check the tokenizer's chat template")
        reads = [prompt_last]
        k = -1
        for pieces in pieces_per_step:
            k += len(pieces)
            reads.append(answers[k] - 1)
        return TextInput(encoded.ids, reads, prompt_last, False, encoded.special_text)

    def logits_to_values(self, logits):
        return torch.softmax(logits, dim=-1)[:, 0]


SKYWORK_NEWLINE = RequiredToken("value_head_lm step token '\\n'", "Ċ", 198,
                                "the Qwen2.5 vocabulary (Skywork/Skywork-o1-Open-PRM-Qwen-2.5-7B)")


class ValueHeadLMFormat(CriticFormat):
    """Skywork-o1-Open-PRM, scored as Skywork's reference code does
    (https://github.com/SkyworkAI/skywork-o1-prm-inference, model_utils/io_utils.py ``prepare_input``):
    ``encode(bos_token + problem + "\n")``, then for each piece of ``response.split("\n")`` its own encoding
    (none for an empty line) followed by the "\n" token (``encode("\n")[-1]``, also after the last piece); the
    reward at each "\n" token is ``sigmoid(v_head(h))``. Encoding each step on its own keeps "\n" out of
    merged tokens like ".\n". Head: a linear ``v_head.summary`` (``head_prefix=`` to change) from safetensors."""

    name = "value_head_lm"
    text_input = True
    HEAD_PREFIXES: ClassVar[tuple[str, ...]] = ("v_head.summary", "v_head", "value_head", "score")

    def __init__(self, *args, step_delimiter: str = "\n", **kwargs):
        super().__init__(*args, **kwargs)
        self.step_delimiter = step_delimiter

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, head_prefix: str | None = None,
             step_delimiter: str = "\n", allow_pickle=False, **options):
        from transformers import AutoModel

        no_options(cls.name, options)
        delimiter = check_delimiter(step_delimiter)
        marker_id = encode_plain(tokenizer, delimiter)[-1]
        if delimiter == "\n":
            check_required_token(cls.name, tokenizer, marker_id, SKYWORK_NEWLINE)
        prefixes = (head_prefix,) if head_prefix else cls.HEAD_PREFIXES
        model = load_complete(AutoModel, path, dtype, attn_implementation, allow_pickle, device, quiet=True,
                               head_prefixes=("v_head", "value_head", "score") + prefixes)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        prefix, head = read_head_from_safetensors(path, prefixes)
        check_head(path, cls.name, head, model, outputs=1, prefix=prefix)
        return cls(model, model, head, marker_id=marker_id, step_delimiter=delimiter)

    def build_text_input(self, tokenizer, prompt, steps):
        ids = encode_plain(tokenizer, (tokenizer.bos_token or "") + prompt + "\n")
        reads = [len(ids) - 1]
        prompt_last = len(ids) - 1
        special_text = False
        for step in steps:
            for piece in split_pieces(step, self.step_delimiter):
                if piece:
                    encoded = encode_with_policy_text(tokenizer, piece, [(0, len(piece))])
                    ids += encoded.ids
                    special_text = special_text or encoded.special_text
                ids.append(self.marker_id)
            reads.append(len(ids) - 1)
        return TextInput(ids, reads, prompt_last, False, special_text)

    def prompt_from_ids(self, tokenizer, prompt):
        """The token-id contract: prompt ids that start with the BOS hold Skywork's prompt, ``encode(bos + problem
        + "\n")`` (what ``prepare_input`` and ``build_text_input`` make), so their text must end with "\n" and the
        problem is read between the two; other prompt ids hold the problem itself (BOS and "\n" are added)."""
        bos = tokenizer.bos_token
        if not bos or not prompt.startswith(bos):
            return prompt
        if not prompt.endswith("\n"):
            raise ValueError(
                f"value_head_lm: the prompt ids start with the BOS {bos!r}, so they must hold Skywork's prompt "
                f"bos + problem + '\\n' (its prepare_input), but their text ends with {prompt[-20:]!r}; end them "
                "with the '\\n' token, or pass the problem's ids without the BOS"
            )
        return prompt[len(bos) : -1]

    def logits_to_values(self, logits):
        return torch.sigmoid(logits[:, 0])


FORMATS: dict[str, type[CriticFormat]] = {
    cls.name: cls
    for cls in (ValueHeadFormat, QwenPrmFormat, PurePrmFormat, MathShepherdFormat, RlhflowFormat, ValueHeadLMFormat,
                TokenLogprobFormat)
}

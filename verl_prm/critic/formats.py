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

A format's required tokens are checked at load against the documented pieces (``RequiredToken``): a token that
resolves to another piece or to the unknown token is an error naming the token, the id found and the id expected.
The check compares pieces; the id only appears in the message. Ids from a source: Math-Shepherd's 648, 387, 12902
(its model card's comments). Not verified from a source here (no real tokenizer ships in an installed package):
Qwen2.5's 151651 ("<extra_0>") and 198 ("\n"), Llama-3.1's 10 ("+") and 12 ("-").

The token-id path of a text format (``ProverCritic.score_sequences``, or policy ids with the critic's
tokenizer) decodes the prompt and the steps with ``verl_prm.critic.scorer.decode_segments`` and rebuilds the
authors' input from those texts, so it gives the values of the text path. ``value_head_lm`` takes prompt ids that
already hold Skywork's ``bos + problem + "\n"`` as well as the bare problem (``prompt_from_ids``).

Step text is the policy's, so it is data, never structure: it never becomes a special token
(``encode_with_policy_text``: a step holding "<|im_start|>" or "<|eot_id|><|start_header_id|>..." is read as plain
text, not as a forged turn), and the format's separator text in it (qwen_prm's "<extra_0>", math_shepherd's "ки")
is removed before encoding (``remove_separator_text``), so a step never adds a scored position. Both are reported
per sample (``TextInput.special_text``, ``TextInput.separator_text``); nothing raises for the batch.

Everything loads with ``trust_remote_code=False`` and from safetensors only, unless the caller passes
``allow_pickle=True`` (``verl_prm.checkpoints``). Weights the model needs but the checkpoint lacks, or checkpoint
weights the model does not use (another architecture in config.json), are errors naming the checkpoint and the
keys: transformers would initialise or drop them silently and only mention it in its load report.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Sequence

import torch
from torch import nn

from verl_prm.checkpoints import CheckpointError, from_pretrained_kwargs, safetensors_keys

logger = logging.getLogger(__name__)

__all__ = [
    "CriticFormat",
    "ValueHeadFormat",
    "QwenPrmFormat",
    "MathShepherdFormat",
    "ValueHeadLMFormat",
    "RlhflowFormat",
    "PurePrmFormat",
    "FORMATS",
    "RequiredToken",
    "resolve_token_id",
    "check_required_token",
    "split_pieces",
    "TextInput",
    "encode_with_policy_text",
    "special_token_ids",
    "remove_separator_text",
    "shepherd_tag",
    "rlhflow_chat",
    "read_head_from_safetensors",
    "default_attn_implementation",
    "resolve_dtype",
    "load_critic_tokenizer",
    "tokenizer_differences",
]


# The parts of a tokenizer.json that decide how text becomes ids and ids become text.
TOKENIZING_PARTS = ("normalizer", "pre_tokenizer", "model", "decoder")


def tokenizer_differences(tokenizer, saved: dict) -> list[str]:
    """The ``TOKENIZING_PARTS`` of the saved ``tokenizer.json`` (a dict) that ``tokenizer``'s backend does not
    have as saved; both are compared as the tokenizers library writes them. A tokenizer without a tokenizers
    backend (a slow one) differs in every part."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(TOKENIZING_PARTS)
    loaded = json.loads(backend.to_str())
    written = json.loads(Tokenizer.from_str(json.dumps(saved)).to_str())
    return [part for part in TOKENIZING_PARTS if written.get(part) != loaded.get(part)]


def load_critic_tokenizer(path: str | Path):
    """The tokenizer of the critic checkpoint ``path``, tokenizing exactly as its saved ``tokenizer.json`` does.

    transformers 5 picks the tokenizer class from config.json's ``model_type`` (qwen2 -> ``Qwen2Tokenizer``),
    and that class builds its normalizer, pre-tokenizer and model from its own code, replacing the saved ones:
    a word-level tokenizer saved next to a qwen2 config loads as Qwen2's byte-level BPE and splits text unlike
    the tokenizer the critic was trained with. So the class transformers picks is kept only when its
    ``TOKENIZING_PARTS`` equal the file's; otherwise the file is loaded as it is (``PreTrainedTokenizerFast``,
    with the special tokens and chat template of ``tokenizer_config.json``) and a warning names the parts. A
    file that even so does not load as saved is a ``CheckpointError``. Without a local ``tokenizer.json`` (slow
    tokenizer files, a hub id) transformers' choice stands.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    file = Path(str(path)) / "tokenizer.json"
    if not file.is_file():
        return tokenizer
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
        differences = tokenizer_differences(tokenizer, saved)
    except Exception as error:  # a file transformers read but the tokenizers library cannot parse
        raise CheckpointError(f"critic checkpoint {str(path)!r}: its tokenizer.json cannot be read by the "
                              f"tokenizers library ({type(error).__name__}: {error}); save the critic's tokenizer "
                              "again (tokenizer.save_pretrained)") from error
    if not differences:
        return tokenizer
    exact = PreTrainedTokenizerFast.from_pretrained(str(path), trust_remote_code=False)
    remaining = tokenizer_differences(exact, saved)
    if remaining:
        raise CheckpointError(
            f"critic checkpoint {str(path)!r}: transformers loads its tokenizer as {type(tokenizer).__name__} with "
            f"another {', '.join(differences)} than its tokenizer.json, and even loaded as it is the "
            f"{', '.join(remaining)} differ, so the critic would not tokenize as it was trained; save the tokenizer "
            "it was trained with (tokenizer.save_pretrained) next to the model")
    logger.warning(
        "critic checkpoint %r: transformers would load its tokenizer as %s (chosen by config.json's model_type), "
        "whose %s differ from the saved tokenizer.json; the critic uses tokenizer.json as it is", str(path),
        type(tokenizer).__name__, ", ".join(differences))
    return exact


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None``: bf16 on CUDA, fp32 elsewhere; strings like "bfloat16"/"float32" name torch dtypes."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'bfloat16' or 'float32'")
        return value
    return dtype


def default_attn_implementation(device: torch.device, dtype: torch.dtype) -> str:
    """flash_attention_2 on CUDA for a bf16/fp16 model when the flash-attn package is installed (varlen
    packing), else sdpa: flash-attn's kernels take only half-precision inputs (an fp32 critic would fail)."""
    half = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda" and half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


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


def _encode_plain(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
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


def _token_at(offsets: Sequence[tuple[int, int]], char: int) -> int:
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


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json (safetensors required)")


def read_head_from_safetensors(path: str | Path, prefixes: tuple[str, ...]) -> tuple[str, nn.Module]:
    """Build a head from the tensors under the first of ``prefixes`` found in the checkpoint's safetensors.

    ``PREFIX.weight`` [+ ``PREFIX.bias``] gives one ``nn.Linear``; ``PREFIX.{i}.weight`` for several ``i`` gives
    Linears in index order with ``ReLU`` between them (the layout of ``nn.Sequential(Linear, ReLU, Linear)``,
    e.g. Qwen2.5-Math-PRM's ``score``). Returns (prefix found, fp32 module).
    """
    from safetensors import safe_open

    path = Path(path)
    tensors: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for prefix in prefixes:
                    if key.startswith(prefix + "."):
                        tensors[prefix][key[len(prefix) + 1 :]] = f.get_tensor(key)
    for prefix in prefixes:
        found = tensors[prefix]
        if not found:
            continue
        if "weight" in found:
            layers = [(found["weight"], found.get("bias"))]
        else:
            indices = sorted({int(k.split(".")[0]) for k in found if k.split(".")[0].isdigit()})
            layers = [(found[f"{i}.weight"], found.get(f"{i}.bias")) for i in indices if f"{i}.weight" in found]
        if not layers:
            raise ValueError(f"{path}: tensors under {prefix!r} ({sorted(found)}) are no Linear head")
        modules: list[nn.Module] = []
        for n, (weight, bias) in enumerate(layers):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            with torch.no_grad():
                linear.weight.copy_(weight.float())
                if bias is not None:
                    linear.bias.copy_(bias.float())
            if n:
                modules.append(nn.ReLU())
            modules.append(linear)
        head = modules[0] if len(modules) == 1 else nn.Sequential(*modules)
        return prefix, head.float().eval()
    raise ValueError(
        f"{path}: no head tensors under any of {list(prefixes)} in the safetensors; pass head_prefix=NAME "
        "for the checkpoint's head"
    )


def _base_model(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None:
        raise ValueError(f"{type(model).__name__} has no base model attribute {model.base_model_prefix!r}")
    return base


def candidate_rows_head(model: nn.Module, candidates: list[int]) -> nn.Linear:
    """The two candidate rows of a causal LM's output layer as a [2, H] fp32 Linear: the logits of the positive
    and negative tokens, without the full-vocabulary logits."""
    lm_head = model.get_output_embeddings()
    head = nn.Linear(lm_head.weight.shape[1], len(candidates), bias=getattr(lm_head, "bias", None) is not None)
    with torch.no_grad():
        head.weight.copy_(lm_head.weight[candidates].float())
        if head.bias is not None:
            head.bias.copy_(lm_head.bias[candidates].float())
    return head


def _token_classification_head(model: nn.Module) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(f"{type(model).__name__}: no 'score' or 'classifier' head found")


def _fp32_copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module).float().eval()


class CriticFormat:
    """Base adapter. Subclasses set ``name`` and implement ``load`` and ``logits_to_values``; text formats set
    ``text_input = True`` and implement ``build_text_input``.

    Attributes:
        backbone: module called as ``backbone(input_ids=, attention_mask=, position_ids=, use_cache=False)``
            returning ``.last_hidden_state`` [b, L, H].
        head: fp32 module mapping hidden states [n, H] to logits [n, C], applied only at read positions.
        marker_id: token inserted after every step by ``build_token_input`` (None: read at the last tokens).
        prompt_marker: whether a marker also follows the prompt (only a format whose authors put one there).
        model: the loaded transformers model (kept for its config and for ``.to``).
    """

    name: ClassVar[str] = ""
    text_input: ClassVar[bool] = False
    prompt_marker: ClassVar[bool] = False

    def __init__(self, model: nn.Module, backbone: nn.Module, head: nn.Module, marker_id: int | None = None):
        self.model = model
        self.backbone = backbone
        self.head = head
        self.marker_id = marker_id

    @classmethod
    def load(cls, path: str, tokenizer, *, dtype: torch.dtype, attn_implementation: str, device: torch.device,
             allow_pickle: bool = False, **options: Any) -> "CriticFormat":
        """Load the checkpoint directory ``path`` (safetensors only unless ``allow_pickle``)."""
        raise NotImplementedError

    def build_token_input(self, ids: Sequence[int], prompt_end: int, step_ends: Sequence[int]
                          ) -> tuple[list[int], list[int], int]:
        """(critic ids, H + 1 read positions, position of the prompt's last token) from token ids."""
        from verl_prm.critic.packing import insert_markers

        marked, reads = insert_markers(ids, prompt_end, step_ends, self.marker_id, prompt_marker=self.prompt_marker)
        return marked, reads, prompt_end

    def build_text_input(self, tokenizer, prompt: str, steps: Sequence[str]) -> TextInput:
        """Text formats: the authors' input for ``prompt`` and our ``steps`` (texts with their delimiters). The
        step texts are the policy's: they never become special tokens, separators or turns of the input."""
        raise NotImplementedError

    def prompt_from_ids(self, tokenizer, prompt: str) -> str:
        """Text formats, token-id path: the prompt text the format builds its input from, given the text decoded
        from the prompt ids (``decode_segments``). Default: that text."""
        return prompt

    def logits_to_values(self, logits: torch.Tensor) -> torch.Tensor:
        """Values [n] from head logits [n, C] (fp32)."""
        raise NotImplementedError

    def to(self, device: torch.device) -> "CriticFormat":
        self.model.to(device)
        self.backbone.to(device)
        self.head.to(device)
        return self

    @property
    def config(self):
        return self.model.config

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={type(self.model).__name__}, marker_id={self.marker_id})"


@contextlib.contextmanager
def _quiet_unexpected_keys():
    """AutoModel on a checkpoint with a head (lm_head, v_head, score) reports those keys as unexpected; that is
    the intended use here, so the report is silenced while loading."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def _common_kwargs(dtype: torch.dtype, attn_implementation: str, allow_pickle: bool = False,
                   device: torch.device | None = None) -> dict[str, Any]:
    """``from_pretrained`` keywords. An accelerator ``device`` becomes ``device_map={"": device}``: transformers
    then reads each tensor from the mapped safetensors and puts it on the device, so a worker never builds the
    whole model in host memory first (loading on the host, then ``.to(device)``, did). On CPU: no device_map
    (the model's tensors are transformers' host tensors, as before)."""
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation, **from_pretrained_kwargs(allow_pickle)}
    if device is not None and device.type != "cpu":
        kwargs["device_map"] = {"": _concrete_device(device)}
    return kwargs


def _concrete_device(device: torch.device) -> torch.device:
    """The concrete device of ``device``: ``cuda`` without an index is the current CUDA device (where
    ``.to("cuda")`` puts tensors; transformers' own ``device_map="cuda"`` would pick ``LOCAL_RANK`` instead)."""
    if device.index is None and device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            return torch.device(device.type, module.current_device())
    return device


def _missing_weights_error(path, missing) -> CheckpointError:
    shown = ", ".join(sorted(missing)[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return CheckpointError(
        f"critic checkpoint {str(path)!r} lacks weights the model needs: {shown}. Loading it would fill them with "
        "random values that change on every load. Use a complete checkpoint (a `verl-prm train` checkpoint-*/ "
        "directory), or the format that matches it (verl_prm.critic.format / --critic-format)"
    )


def _load_complete(auto_class, path, dtype, attn_implementation, allow_pickle: bool, device: torch.device,
                   quiet: bool = False,
                   head_prefixes: tuple[str, ...] = ()):
    """``auto_class.from_pretrained`` that raises ``CheckpointError`` when a weight of the model is not in the
    checkpoint (transformers' ``missing_keys``, which excludes tied weights) or a checkpoint weight is not used
    (``unexpected_keys`` outside ``head_prefixes`` and ``lm_head``: e.g. q/k/v biases of a Qwen2 checkpoint
    whose config.json says llama, dropped silently and every value changed)."""
    with _quiet_unexpected_keys() if quiet else contextlib.nullcontext():
        model, info = auto_class.from_pretrained(
            path, output_loading_info=True, **_common_kwargs(dtype, attn_implementation, allow_pickle, device)
        )
    missing = set(info.get("missing_keys") or ())
    if missing:
        raise _missing_weights_error(path, missing)
    allowed = ("lm_head",) + tuple(head_prefixes) if quiet else ()
    unused = {k for k in info.get("unexpected_keys") or () if not any(k == a or k.startswith(a + ".") for a in allowed)}
    if unused:
        raise unused_weights_error(path, model, unused)
    return model


def unused_weights_error(path, model: nn.Module, unused: set[str]) -> CheckpointError:
    """The load error for checkpoint weights that the model built from config.json has no place for (e.g. the
    q/k/v biases of a Qwen2 checkpoint whose config says llama): dropped silently, they would change every value."""
    shown = ", ".join(sorted(unused)[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
    return CheckpointError(
        f"critic checkpoint {str(path)!r} has weights the {type(model).__name__} built from its config.json "
        f"(model_type={getattr(model.config, 'model_type', None)!r}) does not use: {shown}. They would be "
        "dropped and every value would change; fix model_type/architectures in config.json"
    )


def check_vocabulary(path, tokenizer, model: nn.Module) -> None:
    """Every id the tokenizer can produce must have an embedding row (else an IndexError or a CUDA device
    assert at the first batch that holds such an id)."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise CheckpointError(
            f"critic checkpoint {str(path)!r}: its tokenizer has {len(tokenizer)} tokens but the model's embedding "
            f"has {rows} rows; use the checkpoint's own tokenizer (or resize the embeddings and save the model)"
        )


def _require_head_weights(path, model: nn.Module, head: nn.Module) -> None:
    """The head's parameters must be tensors of the checkpoint's safetensors (read from the headers; our own
    check, independent of transformers' load report). Pickle checkpoints rely on ``_load_complete`` alone."""
    keys = safetensors_keys(path) if Path(str(path)).is_dir() else None
    if keys is None:
        return
    prefix = next(name for name, module in model.named_modules() if module is head)
    wanted = {f"{prefix}.{name}" for name, _ in head.named_parameters()}
    missing = wanted - keys
    if missing:
        raise _missing_weights_error(path, missing)


class ValueHeadFormat(CriticFormat):
    """Native format: ``AutoModelForTokenClassification``, ``num_labels=1``, ``v = sigmoid(logit)``."""

    name = "value_head"

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, allow_pickle=False, **options):
        from transformers import AutoModelForTokenClassification

        _no_options(cls.name, options)
        model = _load_complete(AutoModelForTokenClassification, path, dtype, attn_implementation, allow_pickle, device)
        if model.config.num_labels != 1:
            raise ValueError(
                f"{path}: format 'value_head' needs num_labels=1, the checkpoint has {model.config.num_labels}; "
                "a two-class head is format 'qwen_prm'"
            )
        head = _token_classification_head(model)
        _require_head_weights(path, model, head)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        return cls(model, _base_model(model), _fp32_copy(head))

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
        model = _load_complete(AutoModelForTokenClassification, path, dtype, attn_implementation, allow_pickle, device)
        head = _token_classification_head(model)
        _require_head_weights(path, model, head)
        head, backbone = _fp32_copy(head), _base_model(model)
    else:
        prefix = head_prefix or "score"
        model = _load_complete(AutoModel, path, dtype, attn_implementation, allow_pickle, device, quiet=True,
                               head_prefixes=(prefix,))
        _, head = read_head_from_safetensors(path, (prefix,))
        backbone = model
    _check_head(path, cls_name, head, model, outputs=2)
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
        _no_options(cls.name, options)
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
                   separator_text=separator_text, step_delimiter=_check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step, separator_text = _policy_pieces(steps, self.step_delimiter, self.separator_text)
        text, spans = prompt, []
        for pieces in pieces_per_step:
            for piece in pieces:
                spans.append((len(text), len(text) + len(piece)))
                text += piece + self.separator_text
        encoded = encode_with_policy_text(tokenizer, text, spans)
        prompt_last = _token_at(encoded.offsets, len(prompt) - 1)
        markers = [i for i, t in enumerate(encoded.ids) if t == self.marker_id and i > prompt_last]
        reads = _last_of_each(markers, pieces_per_step, self.name, self.separator_text)
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
        _no_options(cls.name, options)
        if score not in cls.SCORES:
            raise ValueError(f"pure_prm: score must be one of {list(cls.SCORES)}, got {score!r}")
        encoded = _encode_plain(tokenizer, "\n", add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"pure_prm: '\\n' encodes to {encoded}, not one token; use the checkpoint's tokenizer")
        newline = check_required_token(cls.name, tokenizer, encoded[0], PURE_NEWLINE)
        separator_ids = frozenset(
            i for i in range(len(tokenizer))
            if tokenizer.decode([i], clean_up_tokenization_spaces=False).endswith(_check_delimiter(step_separator))
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

        _no_options(cls.name, options)
        # The authors' resolution: the last pieces of encode("+ -") and encode("ки") ("▁"-prefixed pieces).
        marker_id, tag_text = shepherd_tag(tokenizer, tag)
        if tag == "ки":
            check_required_token(cls.name, tokenizer, marker_id,
                                 RequiredToken("math_shepherd tag 'ки'", "▁ки", 12902, MATH_SHEPHERD_SOURCE))
        pair = _encode_plain(tokenizer, f"{positive_token} {negative_token}", add_special_tokens=False)
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
        model = _load_complete(AutoModelForCausalLM, path, dtype, attn_implementation, allow_pickle, device)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        head = candidate_rows_head(model, candidates)
        softcap = getattr(model.config, "final_logit_softcapping", None)
        return cls(model, _base_model(model), head.eval(), marker_id=marker_id, softcap=softcap, tag_text=tag_text,
                   step_delimiter=_check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step, separator_text = _policy_pieces(steps, self.step_delimiter, self.tag_text)
        text, spans = f"{prompt} ", []
        for k, piece in enumerate(piece for pieces in pieces_per_step for piece in pieces):
            text += "\n" if k else ""
            spans.append((len(text), len(text) + len(piece)))
            text += f"{piece} {self.tag_text}"
        encoded = encode_with_policy_text(tokenizer, text, spans)
        prompt_last = _token_at(encoded.offsets, len(prompt) - 1)
        tags = [i for i, t in enumerate(encoded.ids) if t == self.marker_id and i > prompt_last]
        reads = _last_of_each(tags, pieces_per_step, self.name, self.tag_text)
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

        _no_options(cls.name, options)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"format 'rlhflow': the tokenizer of {str(path)!r} has no chat template")
        candidates = [
            check_required_token(cls.name, tokenizer, _encode_plain(tokenizer, token)[-1],
                                 RequiredToken(f"rlhflow {role} token {token!r}", token, documented, RLHFLOW_SOURCE))
            for token, role, documented in (("+", "positive", 10), ("-", "negative", 12))
        ]
        model = _load_complete(AutoModelForCausalLM, path, dtype, attn_implementation, allow_pickle, device)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        head = candidate_rows_head(model, candidates)
        return cls(model, _base_model(model), head.eval(), positive_id=candidates[0],
                   step_delimiter=_check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step = [split_pieces(step, self.step_delimiter) for step in steps]
        turns = [piece.strip() for pieces in pieces_per_step for piece in pieces]
        text, spans, answer_chars, prompt_char = rlhflow_chat(tokenizer, prompt, turns)
        # the rendered chat is tokenised without added BOS (apply_chat_template(tokenize=True) adds none)
        encoded = encode_with_policy_text(tokenizer, text, spans, add_special_tokens=False)
        prompt_last = _token_at(encoded.offsets, prompt_char)
        answers = [_token_at(encoded.offsets, c) for c in answer_chars]
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

        _no_options(cls.name, options)
        delimiter = _check_delimiter(step_delimiter)
        marker_id = _encode_plain(tokenizer, delimiter)[-1]
        if delimiter == "\n":
            check_required_token(cls.name, tokenizer, marker_id, SKYWORK_NEWLINE)
        prefixes = (head_prefix,) if head_prefix else cls.HEAD_PREFIXES
        model = _load_complete(AutoModel, path, dtype, attn_implementation, allow_pickle, device, quiet=True,
                               head_prefixes=("v_head", "value_head", "score") + prefixes)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        prefix, head = read_head_from_safetensors(path, prefixes)
        _check_head(path, cls.name, head, model, outputs=1, prefix=prefix)
        return cls(model, model, head, marker_id=marker_id, step_delimiter=delimiter)

    def build_text_input(self, tokenizer, prompt, steps):
        ids = _encode_plain(tokenizer, (tokenizer.bos_token or "") + prompt + "\n")
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


def _policy_pieces(steps: Sequence[str], delimiter: str, separator: str) -> tuple[list[list[str]], bool]:
    """Our steps cut into the authors' steps, each without the format's separator text (``remove_separator_text``),
    and whether a step held it."""
    pieces_per_step, found = [], False
    for step in steps:
        pieces, removed = remove_separator_text(split_pieces(step, delimiter), separator)
        pieces_per_step.append(pieces)
        found = found or removed
    return pieces_per_step, found


def _last_of_each(markers: list[int], pieces_per_step: list[list[str]], name: str, marker: str) -> list[int]:
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


def _check_delimiter(delimiter: str) -> str:
    if not isinstance(delimiter, str) or delimiter == "":
        raise ValueError(f"step_delimiter must be a non-empty string, got {delimiter!r}")
    return delimiter


def _check_head(path, fmt: str, head: nn.Module, model: nn.Module, outputs: int, prefix: str = "head") -> None:
    """The head must read the backbone's hidden size and give ``outputs`` logits (checked at load, not at the
    first batch)."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    hidden = model.config.hidden_size
    if linears[0].in_features != hidden or linears[-1].out_features != outputs:
        raise ValueError(
            f"{path}: format {fmt!r}: head {prefix!r} maps {linears[0].in_features} -> {linears[-1].out_features}, "
            f"expected {hidden} (the model's hidden_size) -> {outputs}"
        )


def _no_options(name: str, options: dict[str, Any]) -> None:
    if options:
        raise TypeError(f"format {name!r} takes no options {sorted(options)}")


FORMATS: dict[str, type[CriticFormat]] = {
    cls.name: cls
    for cls in (ValueHeadFormat, QwenPrmFormat, PurePrmFormat, MathShepherdFormat, RlhflowFormat, ValueHeadLMFormat)
}

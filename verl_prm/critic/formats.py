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
authors' input from those texts, so it gives the values of the text path.

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
from typing import Any, ClassVar, Sequence

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
    "read_head_from_safetensors",
    "default_attn_implementation",
    "resolve_dtype",
]


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


def _char_token(tokenizer, text: str, char: int, add_special_tokens: bool = True) -> int:
    """Index of the token of ``encode(text)`` that holds character ``char`` (offsets of a fast tokenizer)."""
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    for i, (a, b) in enumerate(encoding["offset_mapping"]):
        if a <= char < b:
            return i
    raise ValueError(f"no token holds character {char} of the critic input")


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

    def build_text_input(self, tokenizer, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int], int]:
        """Text formats: the authors' input for ``prompt`` and our ``steps`` (texts with their delimiters)."""
        raise NotImplementedError

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
        separator_text = tokenizer.convert_ids_to_tokens(marker_id) if isinstance(separator, int) else separator
        model, backbone, head = _load_two_class_head(cls.name, path, dtype, attn_implementation, allow_pickle, device,
                                                     head_prefix)
        check_vocabulary(path, tokenizer, model)
        return cls(model, backbone, head, marker_id=marker_id, positive_label=positive_label,
                   separator_text=separator_text, step_delimiter=_check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step = [split_pieces(step, self.step_delimiter) for step in steps]
        content = "".join(piece + self.separator_text for pieces in pieces_per_step for piece in pieces)
        text = prompt + content
        ids = _encode_plain(tokenizer, text)
        markers = [i for i, t in enumerate(ids) if t == self.marker_id]
        prompt_last = _char_token(tokenizer, text, len(prompt) - 1)
        markers = [i for i in markers if i > prompt_last]
        if len(markers) != sum(len(p) for p in pieces_per_step):
            raise ValueError(f"qwen_prm: the input holds {len(markers)} separators after the prompt, expected "
                             f"{sum(len(p) for p in pieces_per_step)}; a step text contains {self.separator_text!r}")
        reads, k = [prompt_last], -1
        for pieces in pieces_per_step:
            k += len(pieces)
            reads.append(markers[k])
        return ids, reads, prompt_last

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
        if isinstance(tag, int):
            marker_id = tag
        else:
            marker_id = _encode_plain(tokenizer, tag)[-1]
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
        tag_text = tokenizer.convert_ids_to_tokens(tag) if isinstance(tag, int) else tag
        return cls(model, _base_model(model), head.eval(), marker_id=marker_id, softcap=softcap, tag_text=tag_text,
                   step_delimiter=_check_delimiter(step_delimiter))

    def build_text_input(self, tokenizer, prompt, steps):
        pieces_per_step = [split_pieces(step, self.step_delimiter) for step in steps]
        output = "\n".join(f"{piece} {self.tag_text}" for pieces in pieces_per_step for piece in pieces)
        text = f"{prompt} {output}"
        ids = _encode_plain(tokenizer, text)
        prompt_last = _char_token(tokenizer, text, len(prompt) - 1)
        tags = [i for i, t in enumerate(ids) if t == self.marker_id and i > prompt_last]
        return ids, [prompt_last] + _last_of_each(tags, pieces_per_step, self.name, self.tag_text), prompt_last

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
        if not turns:
            turns_text = [prompt]
        else:
            turns_text = [prompt + " " + turns[0]] + turns[1:]
        conversation: list[dict[str, str]] = []
        answer_chars = []
        for content in turns_text:
            conversation.append({"role": "user", "content": content})
            # where the assistant's "+" starts: the length of the conversation so far with the generation prompt
            answer_chars.append(len(tokenizer.apply_chat_template(conversation, tokenize=False,
                                                                  add_generation_prompt=True)))
            conversation.append({"role": "assistant", "content": "+"})
        if not steps:
            conversation.pop()
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = _encode_plain(tokenizer, text, add_special_tokens=False)  # apply_chat_template(tokenize=True) adds none
        first = text.index(turns_text[0])
        prompt_last = _char_token(tokenizer, text, first + len(prompt) - 1, add_special_tokens=False)
        answers = [_char_token(tokenizer, text, c, add_special_tokens=False) for c in answer_chars[: len(turns)]]
        for a in answers:
            if ids[a] != self.positive_id:
                raise ValueError("rlhflow: the chat template does not put the assistant answer right after the "
                                 "generation prompt; check the tokenizer's chat template")
        reads = [prompt_last]
        k = -1
        for pieces in pieces_per_step:
            k += len(pieces)
            reads.append(answers[k] - 1)
        return ids, reads, prompt_last

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
        for step in steps:
            for piece in split_pieces(step, self.step_delimiter):
                ids += (_encode_plain(tokenizer, piece) if piece else []) + [self.marker_id]
            reads.append(len(ids) - 1)
        return ids, reads, prompt_last

    def logits_to_values(self, logits):
        return torch.sigmoid(logits[:, 0])


def _last_of_each(markers: list[int], pieces_per_step: list[list[str]], name: str, marker: str) -> list[int]:
    expected = sum(len(p) for p in pieces_per_step)
    if len(markers) != expected:
        raise ValueError(f"{name}: the input holds {len(markers)} {marker!r} tokens after the prompt, expected "
                         f"{expected}; a step text contains {marker!r}")
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

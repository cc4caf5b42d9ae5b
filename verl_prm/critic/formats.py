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
  period of ".\n\n" goes with it) and the "\n" token is appended; ``v = P(pos)`` (``score="pos_minus_neg"``:
  PURE's ``P(pos) - P(neg)`` in [-1, 1]).
- ``math_shepherd`` (math-shepherd-mistral-7b-prm): text = prompt + " " + ``"".join(piece + " ки\n")``;
  ``v = softmax([z_+, z_-])[0]`` of the LM-head logits of "▁+", "▁-" at each "▁ки".
- ``rlhflow`` (RLHFlow Llama3.1-8B-PRM-Mistral/Deepseek-Data): a chat, one user turn per piece (the first is
  prompt + " " + piece), each answered "+" by the assistant; ``v = softmax([z_+, z_-])[0]`` at the token before
  each answer.
- ``value_head_lm`` (Skywork-o1-Open-PRM): ids = encode(bos + prompt + "\n") + per piece encode(piece) + the
  "\n" token; ``v = sigmoid(head(h))`` at each "\n" token (head ``v_head.summary`` from safetensors).

A format's required tokens are checked at load against the documented pieces (``RequiredToken``): a token that
resolves to another piece or to the unknown token is an error naming the token, the id found and the id expected.

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
    """Base adapter. Subclasses set ``name`` and implement ``load`` and ``logits_to_values``.

    Attributes:
        backbone: module called as ``backbone(input_ids=, attention_mask=, position_ids=, use_cache=False)``
            returning ``.last_hidden_state`` [b, L, H].
        head: fp32 module mapping hidden states [n, H] to logits [n, C], applied only at read positions.
        marker_id: token inserted after the prompt and after every step (None: read at the last tokens).
        model: the loaded transformers model (kept for its config and for ``.to``).
    """

    name: ClassVar[str] = ""

    def __init__(self, model: nn.Module, backbone: nn.Module, head: nn.Module, marker_id: int | None = None):
        self.model = model
        self.backbone = backbone
        self.head = head
        self.marker_id = marker_id

    @classmethod
    def load(cls, path: str, tokenizer, *, dtype: torch.dtype, attn_implementation: str, allow_pickle: bool = False,
             **options: Any) -> "CriticFormat":
        """Load the checkpoint directory ``path`` (safetensors only unless ``allow_pickle``)."""
        raise NotImplementedError

    def logits_to_values(self, logits: torch.Tensor) -> torch.Tensor:
        """Values [n] in [0, 1] from head logits [n, C] (fp32)."""
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


def _common_kwargs(dtype: torch.dtype, attn_implementation: str, allow_pickle: bool = False) -> dict[str, Any]:
    return {"dtype": dtype, "attn_implementation": attn_implementation, **from_pretrained_kwargs(allow_pickle)}


def _missing_weights_error(path, missing) -> CheckpointError:
    shown = ", ".join(sorted(missing)[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return CheckpointError(
        f"critic checkpoint {str(path)!r} lacks weights the model needs: {shown}. Loading it would fill them with "
        "random values that change on every load. Use a complete checkpoint (a `verl-prm train` checkpoint-*/ "
        "directory), or the format that matches it (verl_prm.critic.format / --critic-format)"
    )


def _load_complete(auto_class, path, dtype, attn_implementation, allow_pickle: bool, quiet: bool = False):
    """``auto_class.from_pretrained`` that raises ``CheckpointError`` when a weight of the model is not in the
    checkpoint (transformers' ``missing_keys``, which excludes tied weights)."""
    with _quiet_unexpected_keys() if quiet else contextlib.nullcontext():
        model, info = auto_class.from_pretrained(
            path, output_loading_info=True, **_common_kwargs(dtype, attn_implementation, allow_pickle)
        )
    missing = set(info.get("missing_keys") or ())
    if missing:
        raise _missing_weights_error(path, missing)
    return model


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
    def load(cls, path, tokenizer, *, dtype, attn_implementation, allow_pickle=False, **options):
        from transformers import AutoModelForTokenClassification

        _no_options(cls.name, options)
        model = _load_complete(AutoModelForTokenClassification, path, dtype, attn_implementation, allow_pickle)
        if model.config.num_labels != 1:
            raise ValueError(
                f"{path}: format 'value_head' needs num_labels=1, the checkpoint has {model.config.num_labels}; "
                "a two-class head is format 'qwen_prm'"
            )
        head = _token_classification_head(model)
        _require_head_weights(path, model, head)
        model.eval()
        return cls(model, _base_model(model), _fp32_copy(head))

    def logits_to_values(self, logits):
        return torch.sigmoid(logits[:, 0])


class QwenPrmFormat(CriticFormat):
    """Separator after each step and after the prompt; two-class head; ``v = softmax(logits)[positive_label]``."""

    name = "qwen_prm"

    def __init__(self, *args, positive_label: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.positive_label = positive_label

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, separator: str | int = "<extra_0>",
             positive_label: int = 1, head_prefix: str | None = None, allow_pickle=False, **options):
        from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

        _no_options(cls.name, options)
        marker_id = resolve_token_id(tokenizer, separator, "qwen_prm separator")
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        architectures = getattr(config, "architectures", None) or []
        if head_prefix is None and any(a.endswith("ForTokenClassification") for a in architectures):
            model = _load_complete(AutoModelForTokenClassification, path, dtype, attn_implementation, allow_pickle)
            head = _token_classification_head(model)
            _require_head_weights(path, model, head)
            head = _fp32_copy(head)
            backbone = _base_model(model)
        else:
            # Public Qwen2.5-Math-PRM: custom architecture (Qwen2ForProcessRewardModel), head `score` =
            # Linear-ReLU-Linear; the backbone loads as the plain base model, the head from safetensors.
            model = _load_complete(AutoModel, path, dtype, attn_implementation, allow_pickle, quiet=True)
            _, head = read_head_from_safetensors(path, (head_prefix,) if head_prefix else ("score",))
            backbone = model
        out_features = _out_features(head)
        if out_features != 2:
            raise ValueError(f"{path}: format 'qwen_prm' needs a two-class head, this head has {out_features} outputs")
        model.eval()
        return cls(model, backbone, head, marker_id=marker_id, positive_label=positive_label)

    def logits_to_values(self, logits):
        return torch.softmax(logits, dim=-1)[:, self.positive_label]


class MathShepherdFormat(CriticFormat):
    """Tag after each step and after the prompt; ``v = softmax([z_+, z_-])[0]`` from the LM head at the tag."""

    name = "math_shepherd"

    def __init__(self, *args, softcap: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.softcap = softcap

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, tag: str | int = "ки",
             positive_token: str | int = "+", negative_token: str | int = "-", allow_pickle=False, **options):
        from transformers import AutoModelForCausalLM

        _no_options(cls.name, options)
        marker_id = resolve_token_id(tokenizer, tag, "math_shepherd tag")
        candidates = [
            resolve_token_id(tokenizer, positive_token, "math_shepherd positive token"),
            resolve_token_id(tokenizer, negative_token, "math_shepherd negative token"),
        ]
        model = _load_complete(AutoModelForCausalLM, path, dtype, attn_implementation, allow_pickle)
        model.eval()
        lm_head = model.get_output_embeddings()
        # Only the two candidate rows of the LM head are needed: a [2, H] fp32 Linear instead of full-vocab logits.
        head = nn.Linear(lm_head.weight.shape[1], 2, bias=getattr(lm_head, "bias", None) is not None)
        with torch.no_grad():
            head.weight.copy_(lm_head.weight[candidates].float())
            if head.bias is not None:
                head.bias.copy_(lm_head.bias[candidates].float())
        softcap = getattr(model.config, "final_logit_softcapping", None)
        return cls(model, _base_model(model), head.eval(), marker_id=marker_id, softcap=softcap)

    def logits_to_values(self, logits):
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.softmax(logits, dim=-1)[:, 0]


class ValueHeadLMFormat(CriticFormat):
    """``AutoModel`` backbone + linear value head from safetensors; ``v = sigmoid(head(h))``."""

    name = "value_head_lm"
    HEAD_PREFIXES: ClassVar[tuple[str, ...]] = ("v_head.summary", "v_head", "value_head", "score")

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, head_prefix: str | None = None,
             allow_pickle=False, **options):
        from transformers import AutoModel

        _no_options(cls.name, options)
        model = _load_complete(AutoModel, path, dtype, attn_implementation, allow_pickle, quiet=True)
        model.eval()
        prefix, head = read_head_from_safetensors(path, (head_prefix,) if head_prefix else cls.HEAD_PREFIXES)
        if _out_features(head) != 1:
            raise ValueError(f"{path}: value head {prefix!r} has {_out_features(head)} outputs, expected 1")
        return cls(model, model, head)

    def logits_to_values(self, logits):
        return torch.sigmoid(logits[:, 0])


def _out_features(head: nn.Module) -> int:
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features


def _no_options(name: str, options: dict[str, Any]) -> None:
    if options:
        raise TypeError(f"format {name!r} takes no options {sorted(options)}")


FORMATS: dict[str, type[CriticFormat]] = {
    cls.name: cls for cls in (ValueHeadFormat, QwenPrmFormat, MathShepherdFormat, ValueHeadLMFormat)
}

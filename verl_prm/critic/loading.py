"""Loading a critic checkpoint without silent surprises, for every format (:mod:`verl_prm.critic.formats`): its
tokenizer (the class transformers picks, unless it tokenises differently from the saved one), the dtype and
attention implementation, the model with every weight it needs present and every checkpoint weight used, and
heads read from safetensors.

Everything loads with ``trust_remote_code=False`` and from safetensors only, unless the caller passes
``allow_pickle=True`` (``verl_prm.checkpoints``). Weights the model needs but the checkpoint lacks, or checkpoint
weights the model does not use (another architecture in config.json), are errors naming the checkpoint and the
keys: transformers would initialise or drop them silently and only mention it in its load report.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verl_prm.checkpoints import CheckpointError, from_pretrained_kwargs, safetensors_keys

logger = logging.getLogger(__name__)


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


def base_model(model: nn.Module) -> nn.Module:
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


def token_classification_head(model: nn.Module) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(f"{type(model).__name__}: no 'score' or 'classifier' head found")


def fp32_copy(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module).float().eval()


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


def load_complete(auto_class, path, dtype, attn_implementation, allow_pickle: bool, device: torch.device,
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


def require_head_weights(path, model: nn.Module, head: nn.Module) -> None:
    """The head's parameters must be tensors of the checkpoint's safetensors (read from the headers; our own
    check, independent of transformers' load report). Pickle checkpoints rely on ``load_complete`` alone."""
    keys = safetensors_keys(path) if Path(str(path)).is_dir() else None
    if keys is None:
        return
    prefix = next(name for name, module in model.named_modules() if module is head)
    wanted = {f"{prefix}.{name}" for name, _ in head.named_parameters()}
    missing = wanted - keys
    if missing:
        raise _missing_weights_error(path, missing)


def check_head(path, fmt: str, head: nn.Module, model: nn.Module, outputs: int, prefix: str = "head") -> None:
    """The head must read the backbone's hidden size and give ``outputs`` logits (checked at load, not at the
    first batch)."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    hidden = model.config.hidden_size
    if linears[0].in_features != hidden or linears[-1].out_features != outputs:
        raise ValueError(
            f"{path}: format {fmt!r}: head {prefix!r} maps {linears[0].in_features} -> {linears[-1].out_features}, "
            f"expected {hidden} (the model's hidden_size) -> {outputs}"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def require_tokenizer_files(path: str) -> None:
    """A local checkpoint directory must hold its tokenizer (else transformers fails later or differently)."""
    directory = Path(path)
    if directory.is_dir() and not any((directory / name).is_file() for name in TOKENIZER_FILES[:3]):
        raise CheckpointError(
            f"critic checkpoint {path!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:3])}); save "
            "the critic's tokenizer there (tokenizer.save_pretrained) or pass tokenizer="
        )

"""The files of a ``token_logprob`` critic's head, next to its causal LM in the checkpoint directory:

- ``token_logprob_head.json``: ``{"format": "token_logprob", "version": 1, "features": [...], "result_regex":
  null | "...", "fit": {...}}``: the features in column order (``verl_prm.critic.token_logprob.feature_names``),
  the regex of the result statistic (null: none), and what the fit recorded (labels, metrics; informative only);
- ``token_logprob_head.safetensors``: float64 ``weight`` [F] (on the standardised features), ``mean`` [F],
  ``std`` [F] (the standardisation), ``bias`` [1] and ``prompt_logit`` [1] (v_0 = sigmoid of it); its metadata
  ``head_config`` repeats the json's version, features and regex, so the two files are checked to belong
  together (and a calibration's weights digest, over the directory's safetensors, covers the regex too).

:func:`read_head` refuses a missing, unreadable or inconsistent pair with an error naming the file and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from verl_prm.checkpoints import CheckpointError, save_tensors
from verl_prm.checks import compile_result_regex
from verl_prm.critic.token_logprob import feature_names, head_values

__all__ = ["HEAD_JSON", "HEAD_SAFETENSORS", "HEAD_VERSION", "TokenLogprobHead", "read_head", "write_head",
           "holds_head", "native_format"]

HEAD_JSON = "token_logprob_head.json"
HEAD_SAFETENSORS = "token_logprob_head.safetensors"
HEAD_VERSION = 1
FORMAT = "token_logprob"
REFIT = ("fit the head with `verl-prm train --format token_logprob --init POLICY --labels LABELS --output-dir DIR` "
         "(it writes both files)")


@dataclass
class TokenLogprobHead:
    """``v_h = sigmoid(weight . (f_h - mean) / std + bias)`` on the features ``features`` (names, in column
    order), ``v_0 = sigmoid(prompt_logit)``; ``result_regex`` the regex of the result statistic (None: the
    features have none); ``fit``: what the fit recorded."""

    features: tuple[str, ...]
    result_regex: str | None
    weight: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    bias: float
    prompt_logit: float
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.features = tuple(self.features)
        self.weight, self.mean, self.std = (np.asarray(a, dtype=np.float64).reshape(-1)
                                            for a in (self.weight, self.mean, self.std))
        self.bias, self.prompt_logit = float(self.bias), float(self.prompt_logit)

    @property
    def config(self) -> dict[str, Any]:
        """What the features mean: the part of the json the safetensors' metadata repeats."""
        return {"version": HEAD_VERSION, "features": list(self.features), "result_regex": self.result_regex}

    def values(self, features: np.ndarray) -> np.ndarray:
        """[S] step values of [S, F] features (``verl_prm.critic.token_logprob.head_values``)."""
        return head_values(features, self.mean, self.std, self.weight, self.bias)

    @property
    def prompt_value(self) -> float:
        return 0.5 * (1.0 + math.tanh(0.5 * self.prompt_logit))

    def check(self, where: str) -> None:
        """The head is one that :func:`read_head` would accept (a ValueError naming ``where`` otherwise)."""
        if self.result_regex is not None:
            compile_result_regex(f"{where}: result_regex", self.result_regex)
        wanted = feature_names(self.result_regex is not None)
        if self.features != wanted:
            raise ValueError(f"{where}: features {list(self.features)} are not those of format {FORMAT!r} "
                             f"{'with' if self.result_regex is not None else 'without'} a result_regex: "
                             f"{list(wanted)}")
        for name in ("weight", "mean", "std"):
            array = getattr(self, name)
            if array.shape != (len(wanted),) or not np.isfinite(array).all():
                raise ValueError(f"{where}: {name} must hold {len(wanted)} finite numbers (one per feature), got "
                                 f"shape {array.shape}")
        if not (self.std > 0).all():
            raise ValueError(f"{where}: std must be > 0 for every feature, got {self.std.tolist()}")
        if not (math.isfinite(self.bias) and math.isfinite(self.prompt_logit)):
            raise ValueError(f"{where}: bias and prompt_logit must be finite, got {self.bias}, {self.prompt_logit}")


def holds_head(directory: str | Path) -> bool:
    """Whether ``directory`` holds either file of a ``token_logprob`` head."""
    directory = Path(directory)
    return (directory / HEAD_JSON).exists() or (directory / HEAD_SAFETENSORS).exists()


def native_format(directory: str | Path) -> str:
    """The format of a ``verl-prm train`` checkpoint (``verl_prm.critic.format``): ``token_logprob`` where it
    holds a head's files, else ``value_head``."""
    return FORMAT if holds_head(directory) else "value_head"


def write_head(directory: str | Path, head: TokenLogprobHead) -> None:
    """Write the head's two files into ``directory`` (checked first: :meth:`TokenLogprobHead.check`)."""
    import torch

    directory = Path(directory)
    head.check(str(directory))
    tensors = {"weight": head.weight, "mean": head.mean, "std": head.std, "bias": np.array([head.bias]),
               "prompt_logit": np.array([head.prompt_logit])}
    tensors = {name: torch.from_numpy(np.ascontiguousarray(value, dtype=np.float64)) for name, value in tensors.items()}
    save_tensors(tensors, directory / HEAD_SAFETENSORS, metadata={"head_config": _canonical(head.config)})
    (directory / HEAD_JSON).write_text(json.dumps({"format": FORMAT, **head.config, "fit": head.fit}, indent=2,
                                                  default=float) + "\n")


def _canonical(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read as JSON ({type(error).__name__}: {error}); {REFIT}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not the head of a {FORMAT!r} critic (no \"format\": \"{FORMAT}\" in it); "
                              f"{REFIT}")
    if data.get("version") != HEAD_VERSION:
        raise CheckpointError(f"{path} has version {data.get('version')!r}; this verl-prm reads version "
                              f"{HEAD_VERSION}: {REFIT}")
    regex = data.get("result_regex")
    if regex is not None and not isinstance(regex, str):
        raise CheckpointError(f"{path}: result_regex must be a string or null, got {regex!r}; {REFIT}")
    if not isinstance(data.get("features"), list):
        raise CheckpointError(f"{path}: \"features\" must be the list of feature names; {REFIT}")
    return data


def _read_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            metadata = handle.metadata() or {}
    except (OSError, SafetensorError, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read as safetensors ({error}); {REFIT}") from None
    missing = sorted({"weight", "mean", "std", "bias", "prompt_logit"} - set(tensors))
    if missing:
        raise CheckpointError(f"{path} lacks the tensors {missing}; {REFIT}")
    for name in ("bias", "prompt_logit"):
        if tensors[name].size != 1:
            raise CheckpointError(f"{path}: {name} must hold one number, got shape {tensors[name].shape}; {REFIT}")
    return tensors, metadata


def read_head(directory: str | Path) -> TokenLogprobHead:
    """The head of the ``token_logprob`` checkpoint ``directory``, checked: both files present and readable, the
    features those of its regex, every number finite (std > 0), and the safetensors written with this json."""
    directory = Path(directory)
    missing = [name for name in (HEAD_JSON, HEAD_SAFETENSORS) if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(
            f"critic checkpoint {str(directory)!r}: format {FORMAT!r} needs {HEAD_JSON} and {HEAD_SAFETENSORS} next "
            f"to the causal LM, and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: {REFIT}, "
            "or load the directory with the format it was saved for (a `verl-prm train` PAV: value_head)")
    data = _read_json(directory / HEAD_JSON)
    tensors, metadata = _read_tensors(directory / HEAD_SAFETENSORS)
    head = TokenLogprobHead(tuple(str(f) for f in data["features"]), data.get("result_regex"), tensors["weight"],
                            tensors["mean"], tensors["std"], float(tensors["bias"].reshape(-1)[0]),
                            float(tensors["prompt_logit"].reshape(-1)[0]), data.get("fit") or {})
    if metadata.get("head_config") != _canonical(head.config):
        raise CheckpointError(
            f"{directory / HEAD_SAFETENSORS} was written with another {HEAD_JSON} (its metadata says "
            f"{metadata.get('head_config')!r}, the json {_canonical(head.config)!r}): the two files belong together; "
            f"restore the pair, or {REFIT}")
    try:
        head.check(str(directory / HEAD_SAFETENSORS))
    except ValueError as error:
        raise CheckpointError(f"{error}; {REFIT}") from None
    return head

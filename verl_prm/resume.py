"""Resume only with the same settings: the one check behind every resumable directory (the label store, the
trainer's checkpoints, the refresh store, the recipe's stages).

A directory records the settings it was started with (:func:`write_settings`, atomically); a later run reads
them back (:func:`read_settings`, which names the file when it is empty, cut short or not a JSON object) and
:func:`check_same_settings` refuses other settings, naming every differing setting with both values and how to
start over instead.

The stored settings, and the refresh store's states and label shards, are written by :func:`write_atomically`:
the bytes go to a temporary file next to the target, named by the one rule of :func:`temporary_path`
(``.<name>.tmp<pid>``), and are renamed onto it. A writer killed in between leaves only such a file, which
:func:`temporary_target` recognises by name, so a store can tell its own leftovers from files a user put there.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["check_same_settings", "jsonable", "read_settings", "settings_differences", "temporary_path",
           "temporary_target", "write_atomically", "write_settings"]

# the temporary file of an atomic write of NAME: .NAME.tmp<pid of the writer> (see temporary_path)
_TEMPORARY = re.compile(r"\.(?P<target>.+)\.tmp\d+")


def jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, dataclasses dicts, other objects their
    ``str``): what a stored copy is compared with."""
    return json.loads(json.dumps(value, default=lambda o: asdict(o) if is_dataclass(o) and not isinstance(o, type) else str(o)))


def settings_differences(saved: Any, current: Any, key: str = "", ignore: Sequence[str] = ()) -> list[str]:
    """``key: saved -> current`` for every leaf setting that differs (dotted keys, list items by index), in key
    order; a key missing on one side reads as None; top-level keys in ``ignore`` are left out (settings a resume
    may change)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for name in sorted(set(saved) | set(current), key=str):
            if not key and name in ignore:
                continue
            out += settings_differences(saved.get(name), current.get(name), f"{key}.{name}" if key else str(name))
        return out
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        out = []
        for i, (old, new) in enumerate(zip(saved, current)):
            out += settings_differences(old, new, f"{key}[{i}]")
        return out
    return [] if saved == current else [f"{key or 'settings'}: {saved!r} -> {current!r}"]


def check_same_settings(saved: dict, current: dict, *, source: Any, what: str, fix: str,
                        ignore: Sequence[str] = ()) -> None:
    """Refuse a resume whose ``current`` settings differ from the ``saved`` ones (outside ``ignore``): a
    ValueError ``{source} holds {what} made with other settings (key: saved -> current; ...): resume with the
    same settings, or {fix}``."""
    differences = settings_differences(saved, current, ignore=ignore)
    if differences:
        raise ValueError(f"{source} holds {what} made with other settings ({'; '.join(differences)}): resume with "
                         f"the same settings, or {fix}")


def read_settings(path: str | os.PathLike, *, fix: str, field: str | None = None) -> dict | None:
    """The settings stored at ``path`` (a JSON object; with ``field``, that field of the object), or None when
    there is no such file. An empty, cut-short or wrongly typed file is a ValueError naming it and ``fix`` (how
    to start over)."""
    path = Path(path)
    if not path.exists():
        return None
    stored, problem = None, None
    try:
        text = path.read_text()
        stored = json.loads(text) if text.strip() else None
        problem = None if text.strip() else "is empty"
    except (OSError, ValueError) as error:  # a directory, no permission, not UTF-8, not JSON (cut short)
        problem = f"cannot be read as JSON ({type(error).__name__}: {error})"
    if problem is None and field is not None:
        stored = stored.get(field) if isinstance(stored, dict) else None
    if problem is None and not isinstance(stored, dict):
        where = f"its field {field!r}" if field is not None else "it"
        problem = f"does not hold a JSON object of settings ({where} is {type(stored).__name__})"
    if problem is not None:
        raise ValueError(f"{path} {problem}: it is written atomically, so it was changed afterwards; restore it, "
                         f"or {fix}")
    return stored


def write_settings(path: str | os.PathLike, settings: Any) -> None:
    """Write ``settings`` as JSON to ``path`` atomically (a temporary file, flushed, then renamed), so that a
    run killed at any moment leaves the old file or the new one."""
    write_atomically(path, json.dumps(settings, indent=2, sort_keys=True).encode())


def temporary_path(path: str | os.PathLike) -> Path:
    """The temporary file that an atomic write of ``path`` goes through: ``.<name>.tmp<pid>`` in the same
    directory (hidden; the pid keeps two writers of one target apart; the same filesystem, so the rename is
    atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def temporary_target(name: str) -> str | None:
    """The name of the file whose atomic write uses a temporary file called ``name`` (:func:`temporary_path`),
    or None if ``name`` is not such a temporary file: ``.step_000003.safetensors.tmp4242`` ->
    ``step_000003.safetensors``; ``.tmpAb12cd`` -> None."""
    match = _TEMPORARY.fullmatch(name)
    return match.group("target") if match else None


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: to :func:`temporary_path` (created with the modes of the user's
    umask), flushed and fsynced, then renamed onto ``path``; a process killed at any moment leaves the old file or
    the new one, and at most the temporary file. A failed write removes its temporary file."""
    path = Path(path)
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise

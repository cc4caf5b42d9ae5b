"""One declaration per setting: a dataclass field with its default, its doc and its bounds.

``alpha: float = setting(3.0, "Weight of the process term ...", low=0.0, high=MAX_ALPHA)`` is all there is of a
setting. The validation reads the bounds (``check_bounds``), the command lines build their flags from the fields
(``verl_prm.cli_types.add_dataclass_arguments``, in the manner of TRL's ``HfArgumentParser``), and the verl
config ``pav.yaml`` is generated from them with the docs as comments (``verl_prm.config.pav_yaml``). Choices are
``Literal`` types of ``verl_prm.choices``. Imports nothing heavy (the command lines' ``--help`` reads it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types as types_module
import typing
from typing import Any, Callable, Literal, Optional, Union

from verl_prm.checks import check_number, range_text

__all__ = ["check_bounds", "check_choices", "check_integer", "doc_of", "setting", "setting_type"]


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING,
            low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False,
            high_open: bool = False, finite: bool = False, flag: Optional[str] = None) -> Any:
    """A dataclass field with its doc (one paragraph; whitespace runs collapse) and, for a number, its bounds
    (inclusive unless ``*_open``; ``finite``: no bound, but NaN and inf are refused). ``flag`` names its
    command-line flag when that is not ``--<name>`` (a bool that defaults to true gets ``--no-<name>``)."""
    metadata = {"doc": " ".join(doc.split()), "flag": flag}
    if low is not None or high is not None or finite:
        metadata["bounds"] = (low, high, low_open, high_open)
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def doc_of(cls: type, name: str) -> str:
    """The doc of setting ``name`` of dataclass ``cls`` ("" when it has none)."""
    return next(f.metadata.get("doc", "") for f in dataclasses.fields(cls) if f.name == name)


def setting_type(cls: type, name: str) -> tuple[Any, bool]:
    """(the type of field ``name`` of ``cls`` with ``Optional`` removed, whether it is ``Optional``)."""
    return _setting_types(cls)[name]


@functools.lru_cache(maxsize=None)
def _setting_types(cls: type) -> dict[str, tuple[Any, bool]]:
    # Resolved once per class: the estimators build a PavConfig on every call.
    types = {}
    for name, kind in typing.get_type_hints(cls).items():
        members = [m for m in typing.get_args(kind) if m is not type(None)]
        optional = (typing.get_origin(kind) is Union or isinstance(kind, types_module.UnionType)) \
            and len(members) == 1
        types[name] = (members[0], True) if optional else (kind, False)
    return types


def check_integer(key: str, value: Any, low: Optional[float] = None, high: Optional[float] = None, *,
                  low_open: bool = False, high_open: bool = False) -> int:
    """``value`` as an ``int`` if it is an integer within the bounds; else ``ValueError`` naming ``key``.

    The one rule of every integer knob: an integer (Python's or numpy's), never a bool and never a float, not
    even a whole one (``1e3`` or ``4.0`` in a YAML file is a float; the error says to write ``1000``), so that
    what a config says is what runs."""
    bounds = range_text(low, high, low_open=low_open, high_open=high_open)
    wanted = f"{key} must be an integer{' ' + bounds if bounds else ''}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            raise ValueError(f"{wanted}, got the float {value!r}: write it as an integer ({int(value)})")
        raise ValueError(f"{wanted}, got {value!r}")
    number = int(value)
    try:
        check_number(key, number, low, high, low_open=low_open, high_open=high_open)
    except ValueError:
        raise ValueError(f"{wanted}, got {number!r}") from None
    return number


def check_bounds(config: Any, key: Callable[[str], str]) -> None:
    """Every number field of dataclass ``config`` is within its bounds (Optional fields may be None); the
    ``ValueError`` names ``key(field name)`` and the bounds. Every int field, bounded or not, holds an integer
    (``check_integer``: a float such as ``4.0`` is refused); a float field with bounds holds a finite number
    within them, which becomes a float."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        is_int = setting_type(type(config), f.name)[0] is int
        if value is None or not (is_int or "bounds" in f.metadata):
            continue
        low, high, low_open, high_open = f.metadata.get("bounds", (None, None, False, False))
        check = check_integer if is_int else check_number
        number = check(key(f.name), value, low, high, low_open=low_open, high_open=high_open)
        object.__setattr__(config, f.name, number)  # also for frozen dataclasses


def check_choices(config: Any, key: Callable[[str], str], error: type = ValueError) -> None:
    """Every ``Literal``-typed field of dataclass ``config`` holds one of its choices (Optional ones may be None);
    the error names ``key(field name)`` and the choices."""
    for f in dataclasses.fields(config):
        kind, optional = setting_type(type(config), f.name)
        value = getattr(config, f.name)
        if typing.get_origin(kind) is not Literal or (optional and value is None):
            continue
        choices = typing.get_args(kind)
        if not isinstance(value, str) or value not in choices:
            raise error(f"{key(f.name)} must be one of {choices}{' or null' if optional else ''}, got {value!r}")


def from_mapping(cls: type, data: Any, key: str, error: type = ValueError) -> Any:
    """Dataclass ``cls`` from the plain mapping ``data`` (None: the defaults), nested dataclasses from nested
    mappings. An unknown key or a value of the wrong type is ``error`` naming its dotted key (``key.name``) and,
    for an unknown key, the known ones. Values are not range-checked here: ``cls`` and its caller do that."""
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise error(f"{key} must be a mapping of settings, got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for name in data:
        if name not in known:
            raise error(f"{key}.{name} is not a setting. Known keys of {key}: {', '.join(known)}")
    values = {name: _typed(value, cls, name, f"{key}.{name}", error) for name, value in data.items()}
    try:
        return cls(**values)
    except ValueError as failure:  # the class's own checks
        raise error(str(failure)) from None


def _typed(value: Any, cls: type, name: str, key: str, error: type) -> Any:
    """``value`` as field ``name`` of ``cls`` takes it: numbers for numbers (an int field an integer only:
    ``check_integer``), text for text and choices, mappings for mappings; anything else is ``error`` naming ``key``."""
    kind, optional = setting_type(cls, name)
    if value is None:
        if optional or kind is Any:
            return None
        raise error(f"{key} must not be null")
    if dataclasses.is_dataclass(kind):
        return from_mapping(kind, value, key, error)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool and not isinstance(value, bool):
        raise error(f"{key} must be true or false, got {value!r}")
    if kind is int:
        try:
            return check_integer(key, value)
        except ValueError as failure:
            raise error(str(failure)) from None
    if kind is float and not number:
        raise error(f"{key} must be a number, got {value!r}")
    if (kind is str or typing.get_origin(kind) is Literal) and not isinstance(value, str):
        if kind is str and number:
            return str(value)  # e.g. a delimiter or a path that a YAML parser read as a number
        raise error(f"{key} must be text, got {value!r}")
    if (kind is dict or typing.get_origin(kind) is dict) and not isinstance(value, dict):
        raise error(f"{key} must be a mapping, got {value!r}")
    return float(value) if kind is float else value

"""argparse types shared by every ``verl-prm`` subcommand, and the flags of a settings dataclass.

``type=finite_float(low, high)`` instead of ``type=float``: "nan", "inf" and "1e999" (which ``float`` accepts)
and values out of range become an argparse error that names the flag, e.g.
``verl-prm search: error: argument --alpha: must be >= 0 (a finite number), got 'nan'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Literal, Optional

from verl_prm.checks import check_number, range_text
from verl_prm.settings import setting_type

__all__ = ["add_dataclass_arguments", "finite_float", "finite_floats", "flag_of"]


def finite_float(low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False,
                 high_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: the text as a finite float within the bounds (inclusive unless ``*_open``)."""

    def parse(text: str) -> float:
        try:
            number = float(text)
        except ValueError:
            number = None
        try:
            return check_number("value", number, low, high, low_open=low_open, high_open=high_open)
        except ValueError:
            bounds = range_text(low, high, low_open=low_open, high_open=high_open)
            raise argparse.ArgumentTypeError(
                f"must be {bounds + ' (a finite number)' if bounds else 'a finite number'}, got {text!r}"
            ) from None

    parse.__name__ = "finite_float"  # argparse names the type in some messages
    return parse


def finite_floats(low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False,
                  high_open: bool = False) -> Callable[[str], tuple[float, ...]]:
    """An argparse ``type``: a comma-separated list of finite floats within the bounds, e.g. ``1,3,10``."""
    one = finite_float(low, high, low_open=low_open, high_open=high_open)

    def parse(text: str) -> tuple[float, ...]:
        items = [item.strip() for item in text.split(",")]
        if not text.strip() or any(not item for item in items):
            raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}")
        values = []
        for item in items:
            try:
                values.append(one(item))
            except argparse.ArgumentTypeError as error:
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: {error}") from None
        return tuple(values)

    parse.__name__ = "finite_floats"
    return parse


def flag_of(field: dataclasses.Field) -> str:
    """The command-line flag of a settings field: its ``flag`` metadata, else ``--no-<name>`` for a bool that
    defaults to true and ``--<name>`` for the rest (underscores as dashes)."""
    if field.metadata.get("flag"):
        return field.metadata["flag"]
    dashed = field.name.replace("_", "-")
    return f"--no-{dashed}" if field.default is True else f"--{dashed}"


def add_dataclass_arguments(parser: Any, cls: type, *, skip: tuple[str, ...] = (), groups: Optional[dict] = None) -> None:
    """One flag per field of the settings dataclass ``cls`` (``verl_prm.settings.setting``), as TRL's
    ``HfArgumentParser`` builds them: the field's name, default and doc; its ``Literal`` choices; a ``finite_float``
    within its bounds for a float; ``nargs="+"`` for a list; a bool as a switch that flips its default. A field
    without a default is a required flag. ``skip`` names fields added by hand; ``groups`` maps a field name to the
    argument group (e.g. a mutually exclusive one) its flag goes to."""
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = setting_type(cls, field.name)[0]
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        options: dict[str, Any] = {"dest": field.name, "help": field.metadata.get("doc", "").replace("%", "%%")}
        if required:
            options["required"] = True
        else:
            options["default"] = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        if kind is bool:
            options["action"] = "store_false" if field.default is True else "store_true"
            options["help"] += " (on by default; this flag turns it off)" if field.default is True else ""
        elif typing.get_origin(kind) is Literal:
            options["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is list:
            options["nargs"] = "+"
        elif kind is float:
            low, high, low_open, high_open = field.metadata.get("bounds", (None, None, False, False))
            options["type"] = finite_float(low, high, low_open=low_open, high_open=high_open)
        elif kind is int:
            options["type"] = int
        elif kind is not str:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag for a setting of type {kind}")
        if not required and options.get("action") is None and options["default"] not in (None, ""):
            options["help"] += f" (default: {options['default']!r})" if kind is str else f" (default: {options['default']})"
        (groups or {}).get(field.name, parser).add_argument(flag_of(field), **options)

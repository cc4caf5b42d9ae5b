"""argparse types shared by every ``verl-prm`` subcommand.

``type=finite_float(low, high)`` instead of ``type=float``: "nan", "inf" and "1e999" (which ``float`` accepts)
and values out of range become an argparse error that names the flag, e.g.
``verl-prm search: error: argument --alpha: must be >= 0 (a finite number), got 'nan'``.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from verl_prm.checks import check_number, range_text

__all__ = ["finite_float", "finite_floats"]


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

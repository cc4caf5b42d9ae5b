"""The one check of a float knob: a finite number in its range, with the key named in the error.

Used by the typed configs (``algorithm.pav.*``, ``verl_prm.*``) and by the command line's argparse type
(``verl_prm.cli_types.finite_float``), so a NaN or an infinity is rejected at startup wherever it is typed.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

__all__ = ["check_number", "compile_result_regex", "empty_match_problem", "range_text"]


def range_text(low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False,
               high_open: bool = False) -> str:
    """``"in (0, 1]"``, ``">= 0"``, ``"< 1"`` or ``""`` (no bound) for the error messages."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def check_number(key: str, value: Any, low: Optional[float] = None, high: Optional[float] = None, *,
                 low_open: bool = False, high_open: bool = False) -> float:
    """``float(value)`` if it is a finite real number within the bounds; else ``ValueError`` naming ``key``:
    ``"algorithm.pav.alpha must be >= 0 (a finite number), got nan"``.

    ``low``/``high`` are inclusive unless ``low_open``/``high_open``. Booleans and strings are not numbers.
    """
    bounds = range_text(low, high, low_open=low_open, high_open=high_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number{' ' + bounds if bounds else ''}, got {value!r}")
    wanted = f"{bounds} (a finite number)" if bounds else "a finite number"
    number = float(value)
    in_range = math.isfinite(number)
    if in_range and low is not None:
        in_range = number > low if low_open else number >= low
    if in_range and high is not None:
        in_range = number < high if high_open else number <= high
    if not in_range:
        raise ValueError(f"{key} must be {wanted}, got {number!r}")
    return number


# Ordinary words and spaces: a step regex with a zero-width match here splits text at every word or character.
_PLAIN_TEXT = "ab cd ef"


def empty_match_problem(pattern: re.Pattern) -> Optional[str]:
    """Why the step regex ``pattern`` would split text everywhere, or None.

    A regex that matches the empty string (``''``, ``x*``, ``\\s*``) matches at every position, and one with a
    zero-width match inside plain words and spaces (``\\b``, ``(?= )``) at every word: every character or
    word becomes a step. A lookahead for a marker (``(?=Step \\d)``) has no match in plain words and is fine.
    """
    if pattern.fullmatch("") is not None:
        return "matches the empty string, so it matches at every position and makes every character a step"
    zero_width = [m.start() for m in pattern.finditer(_PLAIN_TEXT) if m.start() == m.end()]
    if zero_width:
        return (f"has a zero-width match inside plain words (at {zero_width} of {_PLAIN_TEXT!r}), so it makes "
                "every word a step")
    return None


def compile_result_regex(key: str, regex: Any) -> re.Pattern:
    """``regex`` compiled, a regular expression with at least one capture group (the result a match claims is a
    group of it: ``verl_prm.critic.token_logprob.result_span``); else a ValueError naming ``key``."""
    try:
        pattern = re.compile(regex)
    except (re.error, TypeError) as error:
        raise ValueError(f"{key}: {regex!r} is no regular expression ({error})") from None
    if pattern.groups < 1:
        raise ValueError(f"{key}: {regex!r} has no capture group; put the claimed result in one, e.g. "
                         r"'= *(-?\d+)\.?$' for the c of 'a + b = c.'")
    return pattern


def is_class_path(text: object) -> bool:
    """``text`` has the form ``"module:Class"`` (both parts non-empty), how a config names a class to import."""
    return isinstance(text, str) and text.count(":") == 1 and all(text.split(":"))

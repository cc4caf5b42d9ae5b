"""Text rules: where steps end in a response text (delimiter, regex, no empty steps; package docstring)."""

from __future__ import annotations

import re

from verl_prm.checks import empty_match_problem
from verl_prm.steps.results import DEFAULT_DELIMITER


def _delimiter_pattern(delimiter: str | None, regex: str | re.Pattern | None) -> re.Pattern:
    """The compiled pattern whose match ends are step boundaries. Each "\\n" of a plain delimiter also
    matches "\\r\\n", so Windows line ends split like Unix ones."""
    if regex is not None:
        if delimiter not in (None, DEFAULT_DELIMITER):
            raise ValueError(
                f"split by either delimiter={delimiter!r} or regex={regex!r}, not both: pass delimiter=None "
                "with a regex"
            )
        try:
            pattern = regex if isinstance(regex, re.Pattern) else re.compile(regex)
        except re.error as error:
            raise ValueError(f"regex={regex!r} does not compile: {error}") from None
        problem = empty_match_problem(pattern)
        if problem is not None:
            raise ValueError(f"regex={pattern.pattern!r} {problem}: make it match at least one character (e.g. "
                             r"r'\n\n+') or look ahead for a marker (e.g. r'(?=Step \d)')")
        return pattern
    if not isinstance(delimiter, str) or delimiter == "":
        raise ValueError(f"delimiter must be a non-empty string (or pass regex=...), got {delimiter!r}")
    return re.compile("".join(r"\r?\n" if ch == "\n" else re.escape(ch) for ch in delimiter))


def _segments(text: str, pattern: re.Pattern) -> tuple[list[int], list[bool]]:
    """Candidate segment ends (exclusive, increasing) and whether each segment has content: a non-space
    character outside its delimiter match. The segments tile ``text``."""
    ends: list[int] = []
    has_content: list[bool] = []
    pos = 0
    for match in pattern.finditer(text):
        end = match.end()
        if end == pos:  # a zero-width match at a segment start ends nothing
            continue
        content = text[pos : match.start()]
        ends.append(end)
        has_content.append(bool(content) and not content.isspace())
        pos = end
    if pos < len(text):
        content = text[pos:]
        ends.append(len(text))
        has_content.append(not content.isspace())
    return ends, has_content


def _kept_segment_ends(ends: list[int], has_content: list[bool]) -> list[int]:
    """Ends of the steps after empty segments join a neighbour: end k is kept iff some segment <= k has
    content (leading empty segments join the first step) and segment k+1 has content or k is the last one
    (an empty segment joins the step before it)."""
    kept = []
    seen = False
    last = len(ends) - 1
    for k, end in enumerate(ends):
        seen = seen or has_content[k]
        if seen and (k == last or has_content[k + 1]):
            kept.append(end)
    return kept


def step_char_spans(
    text: str,
    delimiter: str | None = DEFAULT_DELIMITER,
    *,
    regex: str | re.Pattern | None = None,
    max_steps: int | None = None,
) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of the steps of a response text (semantics: module docstring).

    The spans tile the text (step h starts where step h-1 ends; the first starts at 0 and the last ends at
    ``len(text)``) unless the text has no step. A delimiter belongs to the step it ends; runs of delimiters
    make no empty steps; a whitespace-only tail is no step; empty or whitespace-only text gives ``[]``.

    Args:
        text: the response text.
        delimiter: plain string ending a step (each "\\n" in it also matches "\\r\\n"); default "\\n\\n".
        regex: a regex whose match ends end steps, instead of ``delimiter``.
        max_steps: if given (>= 1), steps past ``max_steps`` join the last step.
    """
    _check_max_steps(max_steps)
    ends = _kept_segment_ends(*_segments(text, _delimiter_pattern(delimiter, regex)))
    if max_steps is not None and len(ends) > max_steps:
        ends = ends[: max_steps - 1] + [ends[-1]]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def _check_max_steps(max_steps: int | None) -> None:
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be an int >= 1 (or None for no limit), got {max_steps!r}")

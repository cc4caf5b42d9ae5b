"""Step rules for code, with the ``step_ids`` contract of ``verl_prm.steps``.

A code response is split into steps by one of these rules (`code_step_char_spans`):

* ``"line"``: every physical line is a step (the delimiter ``"\\n"`` of ``verl_prm.steps``: blank lines join
  the step before them).
* ``"block"``: every **statement at the base level** of the code is a step, exact, by the ``ast`` module: a
  step starts at the beginning of the line of each statement whose nesting depth is ``<= depth`` (0: the
  outermost statements of the text; 1: also the statements of their bodies, e.g. a function's body when the
  response is one ``def``), a decorated definition starting at its first decorator. A compound statement
  (``for``, ``if``/``elif``/``else``, ``try``, ``with``, ``def``) with its whole body below ``depth`` is one
  step; a multi-line expression stays in one step; comment and blank lines join the step before them (the
  ones before the first statement join the first step). A response indented as a function body (HumanEval
  completions) is parsed as the body of a block. Text that does not parse (a response cut off mid-statement,
  a syntax error, prose around the code) falls back to the ``"indent"`` rule with the base indentation of its
  first non-blank line.
* ``"indent"``: the same rule by indentation only, as one regex (`block_regex`) that ``verl_prm.steps`` and
  every ``--step-regex`` / ``verl_prm.steps.regex`` option accept: a step starts at each line indented by at
  most ``base_indent + depth * indent_unit`` spaces that starts with a character other than a space, tab,
  ``#``, ``)``, ``]``, ``}`` and is not an ``elif``/``else``/``except``/``finally`` clause. It equals the
  ``ast`` rule on code indented with ``indent_unit`` spaces per level, except for decorators (a decorator and
  its ``def`` are two steps), multi-line strings or bracketed continuation lines indented at or left of the base
  level, and ``;``-joined statements (tests check the equality on every HumanEval canonical solution).
* ``"delimiter"``: ``verl_prm.steps.step_char_spans`` with any delimiter or regex (e.g. ``"\\n\\n"``).

Every rule gives ``[start, end)`` character spans that tile the text (the contract of
``verl_prm.steps.step_char_spans``: no empty or whitespace-only step, the last step ends at the end of the
text, empty text has no step). `code_split_steps` maps the spans of any rule to tokens exactly as
``verl_prm.steps.split_steps`` does (same decoding, same "a step's last token holds its last character" rule,
same collapse of steps that end in one token, same ``max_steps`` merge): with ``rule="line"`` or
``rule="indent"`` its result equals ``split_steps`` with the matching delimiter/regex, so steps found here are
the steps the trainer hook, the labeller and the search score when they are given the same regex.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Sequence

import torch

from verl_prm.choices import CODE_SPLIT_RULES
from verl_prm.steps import StepSplit, decode_with_char_ends, step_char_spans, steps_at_char_ends

__all__ = ["ast_block_starts", "block_regex", "code_split_steps", "code_step_char_spans"]

_CONTINUATION = ("elif", "else", "except", "finally")


def block_regex(base_indent: int = 0, depth: int = 0, indent_unit: int = 4) -> str:
    """The ``"indent"`` rule as a regex for ``verl_prm.steps`` (module docstring): it matches the newline before
    each line that starts a step, so the newline ends the step before it.

    ``block_regex(4)`` splits HumanEval completions (function bodies) into their statements;
    ``block_regex(0, depth=1)`` splits a whole function (a chat answer) into its signature and body statements.
    """
    if base_indent < 0 or depth < 0 or indent_unit < 1:
        raise ValueError(f"block_regex: need base_indent >= 0, depth >= 0, indent_unit >= 1; got "
                         f"{base_indent}, {depth}, {indent_unit}")
    width = base_indent + depth * indent_unit
    keywords = "|".join(_CONTINUATION)
    return rf"\n(?=[ \t]{{0,{width}}}(?![ \t#)\]}}]|(?:{keywords})\b)\S)"


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for match in re.finditer("\n", text):
        starts.append(match.end())
    return starts


def _leading_indent(text: str) -> int:
    for line in text.splitlines():
        if line.strip():
            return len(line) - len(line.lstrip(" \t"))
    return 0


def ast_block_starts(text: str, depth: int = 0) -> list[int] | None:
    """Character offsets of the line starts of the statements of nesting depth ``<= depth`` (sorted, unique),
    or None when ``text`` does not parse (as a module, or as the body of a block when it is indented)."""
    indented = _leading_indent(text) > 0
    source = "if 1:\n" + text if indented else text
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if indented:
        first, *rest = tree.body
        roots = list(getattr(first, "body", [])) + rest
        line_shift = 1
    else:
        roots = list(tree.body)
        line_shift = 0
    line_starts = _line_starts(text)
    lines: set[int] = set()

    def visit(statements: Sequence[ast.stmt], level: int) -> None:
        for statement in statements:
            decorators = getattr(statement, "decorator_list", None) or []
            first_line = min([statement.lineno] + [d.lineno for d in decorators])
            lines.add(first_line - line_shift)
            if level < depth:
                for name in ("body", "orelse", "finalbody"):
                    visit(getattr(statement, name, None) or [], level + 1)
                for handler in getattr(statement, "handlers", None) or []:
                    visit(handler.body, level + 1)
                for case in getattr(statement, "cases", None) or []:
                    visit(case.body, level + 1)

    visit(roots, 0)
    return sorted(line_starts[line - 1] for line in lines if 1 <= line <= len(line_starts))


def _spans_from_starts(text: str, starts: list[int]) -> list[tuple[int, int]]:
    """Spans that tile ``text`` with a boundary at each start (the first step begins at 0), after the
    no-empty-step rule of ``verl_prm.steps``: a whitespace-only segment joins its neighbour."""
    if not text.strip():
        return []
    # the first statement's line start is no cut: comment and blank lines before it join the first step
    cuts = sorted({s for s in starts[1:] if 0 < s < len(text)})
    bounds = [0] + cuts + [len(text)]
    ends: list[int] = []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        if text[begin:end].strip() or not ends:
            ends.append(end)
        else:
            ends[-1] = end  # whitespace only: joins the step before it
    # a whitespace-only first segment (leading blank lines) joins the next step
    if len(ends) > 1 and not text[: ends[0]].strip():
        ends.pop(0)
    return list(zip([0] + ends[:-1], ends))


def code_step_char_spans(
    text: str,
    rule: str = "block",
    *,
    depth: int = 0,
    base_indent: int | None = None,
    indent_unit: int = 4,
    delimiter: str | None = "\n\n",
    regex: str | None = None,
    max_steps: int | None = None,
) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of the steps of a code response (rules: module docstring).

    Args:
        text: the response text.
        rule: "line", "block" (ast, falling back to "indent" when the text does not parse), "indent" (regex)
            or "delimiter".
        depth: statement nesting depth that still starts steps ("block", "indent").
        base_indent: "indent" rule's base indentation (default: the first non-blank line's).
        indent_unit: spaces per nesting level ("indent" with depth > 0).
        delimiter, regex: the "delimiter" rule's delimiter or regex.
        max_steps: steps past this count join the last step (as in ``verl_prm.steps``).
    """
    if rule not in CODE_SPLIT_RULES:
        raise ValueError(f"code step rule must be one of {CODE_SPLIT_RULES}, got {rule!r}")
    if rule == "line":
        return step_char_spans(text, "\n", max_steps=max_steps)
    if rule == "delimiter":
        return step_char_spans(text, None if regex else delimiter, regex=regex, max_steps=max_steps)
    if rule == "block":
        starts = ast_block_starts(text, depth)
        if starts is not None:
            spans = _spans_from_starts(text, starts)
            if max_steps is not None and len(spans) > max_steps:
                ends = [e for _, e in spans]
                ends = ends[: max_steps - 1] + [ends[-1]]
                spans = list(zip([0] + ends[:-1], ends))
            return spans
    indent = _leading_indent(text) if base_indent is None else base_indent
    return step_char_spans(text, None, regex=block_regex(indent, depth, indent_unit), max_steps=max_steps)


def code_split_steps(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    tokenizer: Any,
    rule: str = "block",
    *,
    max_steps: int | None = None,
    **rule_options: Any,
) -> StepSplit:
    """``verl_prm.steps.split_steps`` for code step rules: ``step_ids`` [B, T], ``num_steps`` [B],
    ``step_ends`` [B, S] (and the rest of `StepSplit`) from the spans of `code_step_char_spans`.

    The responses are decoded once by ``verl_prm.steps.decode_with_char_ends``, and
    ``verl_prm.steps.steps_at_char_ends`` maps each step end to the first token whose character end reaches it
    (the token holding the step's last character):

        end_token[b, h] = min {t : char_ends[b, t] >= step_char_end[b, h]}
        step_ids[b, t]  = #{h : end_token[b, h] < t}   for valid t <= end_token[b, H-1], else -1

    Steps whose ends fall in one token merge into the earlier one (``collapsed_steps``); ``max_steps`` merges
    trailing steps after that (``merged_steps``), as ``split_steps`` does.
    """
    decoded = decode_with_char_ends(tokenizer, response_ids, response_mask)
    ends = [[end for _, end in code_step_char_spans(text, rule, **rule_options)] for text in decoded.texts]
    return steps_at_char_ends(decoded, ends, max_steps=max_steps, device=response_ids.device)

"""The data sources verl's default scorer knows, and those of a training file (the startup check that the
training data holds only known ones is ``run_config.check_default_scorer_data_sources``).

verl's ``default_compute_score`` picks a scorer by the row's ``data_source`` and raises ``NotImplementedError``
for any other; a run without ``reward.custom_reward_function`` would meet that only when it first scores a
response or a continuation, after Ray and the models have started. The sources it knows are read from its own
code (the strings its branches compare ``data_source`` with, and the prefixes of its ``startswith`` tests), so
they follow the installed verl.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from typing import Any

__all__ = ["default_scorer_data_sources", "file_data_sources"]


def default_scorer_data_sources(function: Any = None) -> tuple[frozenset[str], tuple[str, ...]]:
    """(names, prefixes): the ``data_source`` values ``function`` (default: verl's ``default_compute_score``)
    scores, from its branches ``data_source == "x"``, ``data_source in ["x", ...]`` and
    ``data_source.startswith("x")``; both empty when its source cannot be read."""
    if function is None:
        from verl.utils.reward_score import default_compute_score as function
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(), ()
    names, prefixes = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "data_source":
            for operator, right in zip(node.ops, node.comparators):
                values = right.elts if isinstance(operator, ast.In) and isinstance(
                    right, (ast.List, ast.Tuple, ast.Set)) else [right] if isinstance(operator, ast.Eq) else []
                names.update(v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "data_source"):
            prefixes += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return frozenset(names), tuple(prefixes)


def file_data_sources(path: str) -> set[str] | None:
    """The ``data_source`` values of a local parquet or JSON-lines training file; None when it cannot be read
    here (a remote path, another format, no such column: verl reports those itself)."""
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    path = os.path.expanduser(path)
    try:
        if path.endswith(".parquet"):
            column = pq.read_table(path, columns=["data_source"]).column("data_source")
        elif path.endswith((".json", ".jsonl")):
            column = pa_json.read_json(path).column("data_source")
        else:
            return None
    except (OSError, KeyError, ValueError):  # pyarrow's errors derive from these
        return None
    return {str(value) for value in column.unique().to_pylist()}

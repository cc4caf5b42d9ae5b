"""The step-label format shared by `verl-prm label`, the converters and `verl-prm train`.

One row per rollout (a response to a prompt), stored as parquet shards:

=================  ================  =====================================================================
column             type              meaning
=================  ================  =====================================================================
prompt_index       int64             row of the input file the prompt came from (resume key)
rollout_index      int32             0..n_cov-1 for generated rollouts; row number within a converted file
data_source        string            verl ``data_source`` (selects the outcome scorer)
prompt             string            the prompt text exactly as the policy read it (chat template applied)
ground_truth       string            verl ``reward_model.ground_truth`` (JSON text if it was not a string)
response           string            the seed rollout's text (no EOS token)
step_starts        list<int32>       character start of each step in ``response``
step_ends          list<int32>       character end (exclusive) of each step in ``response``
q                  list<float64>     value label of each step: P(prover completes prompt+response[:end]
                                     correctly); NaN = not labelled (first-pit strategy)
n_success          list<int32>       accepted continuations out of ``n_mc`` for the step's prefix
n_mc               list<int32>       continuations sampled for the step's prefix; 0 = q was not sampled:
                                     exact (the terminal step of a finished response: q = outcome),
                                     inferred (0 at and after ``first_pit``), taken from a converted data
                                     set, or NaN (not labelled)
first_pit          int32             first step whose value is 0 (first-pit strategy or converted data);
                                     -1 = none found or not searched
prompt_value       float64           V(prompt) label (fraction of n_mc continuations of the bare prompt);
                                     NaN = not computed. Repeated on every rollout of the prompt (the same
                                     in each row of one prompt_index and prompt in a shard); training counts
                                     it once (verl_prm.training.data.prompt_value_carriers)
prompt_n_success   int32             accepted continuations of the bare prompt (0 if not computed)
prompt_n_mc        int32             continuations of the bare prompt (0 = not computed)
outcome            float64           1.0 / 0.0: the verifier accepted the full response; NaN = unknown
score              float64           the scorer's raw score of the full response (NaN = unknown)
finished           bool              the response ended at EOS (False: cut at max_new_tokens)
strategy           string            "every", "first_pit", "math_shepherd", "prm800k"
source             string            which prover produced the labels (model path or data set name)
=================  ================  =====================================================================

``q = n_success / n_mc`` wherever ``n_mc > 0``. Keeping the raw counts lets a Best-of-K prover's value be
derived later without new rollouts (:func:`best_of_k_from_counts`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "LABEL_SCHEMA",
    "LABEL_COLUMNS",
    "best_of_k_from_counts",
    "check_duplicate_rollouts",
    "check_label_table",
    "label_files",
    "read_labels",
    "rows_to_table",
]

LABEL_SCHEMA = pa.schema(
    [
        ("prompt_index", pa.int64()),
        ("rollout_index", pa.int32()),
        ("data_source", pa.string()),
        ("prompt", pa.string()),
        ("ground_truth", pa.string()),
        ("response", pa.string()),
        ("step_starts", pa.list_(pa.int32())),
        ("step_ends", pa.list_(pa.int32())),
        ("q", pa.list_(pa.float64())),
        ("n_success", pa.list_(pa.int32())),
        ("n_mc", pa.list_(pa.int32())),
        ("first_pit", pa.int32()),
        ("prompt_value", pa.float64()),
        ("prompt_n_success", pa.int32()),
        ("prompt_n_mc", pa.int32()),
        ("outcome", pa.float64()),
        ("score", pa.float64()),
        ("finished", pa.bool_()),
        ("strategy", pa.string()),
        ("source", pa.string()),
    ]
)
LABEL_COLUMNS: tuple[str, ...] = tuple(LABEL_SCHEMA.names)


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _same_kind(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Whether ``actual`` values may be cast to ``expected`` (integers of another width, integers to floats,
    large strings/lists); text is never parsed into numbers."""
    if pa.types.is_list(expected):
        return (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and _same_kind(actual.value_type,
                                                                                           expected.value_type)
    if pa.types.is_floating(expected):
        return pa.types.is_floating(actual) or pa.types.is_integer(actual)
    if pa.types.is_integer(expected):
        return pa.types.is_integer(actual)
    if pa.types.is_string(expected):
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
    return actual == expected


def check_label_table(table: pa.Table, where: str) -> pa.Table:
    """Validate label rows as stored; returns them in ``LABEL_SCHEMA`` (columns in order, types safely cast).

    Checks every column, vectorised: presence and type; no nulls; the five per-step lists of a row have one
    entry per step; spans ``0 <= start_h < end_h <= start_{h+1}``, ``end <= len(response)``; ``q`` in [0, 1]
    or NaN; ``0 <= n_success <= n_mc`` and ``q = n_success / n_mc`` where ``n_mc > 0``; ``first_pit`` in
    ``[-1, steps)``; the prompt value likewise; ``outcome`` in {0, 1} or NaN; ``score`` finite or NaN;
    ``prompt_index, rollout_index >= 0``. Raises ValueError naming ``where``, the row (0-based) with its
    ``prompt_index``/``rollout_index``, the column and the value.
    """
    table = _in_label_schema(table, where)
    if table.num_rows == 0:
        return table
    problem = _null_problem(table)
    if problem is None:
        lengths = pc.list_value_length(table.column("step_starts")).to_numpy(zero_copy_only=False).astype(np.int64)
        problem = _length_problem(table, lengths) or _step_problem(table, lengths) or _row_problem(table, lengths)
    if problem is not None:
        row, message = problem
        prompt_index, rollout_index = _numpy(table, "prompt_index")[row], _numpy(table, "rollout_index")[row]
        raise ValueError(f"{where} row {row} (prompt_index={prompt_index}, rollout_index={rollout_index}): "
                         f"{message}; fix or relabel the shard (see verl_prm.labeling.format)")
    return table


def _in_label_schema(table: pa.Table, where: str) -> pa.Table:
    """``table``'s label columns in ``LABEL_SCHEMA``'s order and types (a safe cast between kinds that may be
    cast, :func:`_same_kind`); a missing column or another type is a ValueError naming ``where``."""
    missing = [c for c in LABEL_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{where} is no label shard: missing columns {missing} (see verl_prm.labeling.format)")
    columns = []
    for field in LABEL_SCHEMA:
        column = table.column(field.name)
        if column.type != field.type:
            if not _same_kind(column.type, field.type):
                raise ValueError(f"{where}: column {field.name} has type {column.type}, expected {field.type} "
                                 "(see verl_prm.labeling.format)")
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
                raise ValueError(f"{where}: column {field.name} has type {column.type}, expected {field.type} "
                                 f"({error})") from None
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=LABEL_SCHEMA).combine_chunks()


# The first bad row a check of check_label_table finds, and what is wrong with it.
Problem = tuple[int, str]


def _numpy(table: pa.Table, name: str, flat: bool = False) -> np.ndarray:
    column = table.column(name)
    if flat:
        column = pc.list_flatten(column)
    return column.to_numpy(zero_copy_only=False)


def _null_problem(table: pa.Table) -> Problem | None:
    """A null in any column or list, or a negative prompt or rollout index."""
    for name in LABEL_COLUMNS:
        column = table.column(name)
        if column.null_count:
            return _first(column.is_null().to_numpy(zero_copy_only=False)), f"{name} is null"
        if pa.types.is_list(column.type):
            values = pc.list_flatten(column)
            if values.null_count:
                parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
                return int(parents[_first(values.is_null().to_numpy(zero_copy_only=False))]), f"{name} holds a null"
    for name in ("prompt_index", "rollout_index"):
        row = _first(_numpy(table, name) < 0)
        if row is not None:
            return row, f"{name}={_numpy(table, name)[row]} is negative"
    return None


def _length_problem(table: pa.Table, lengths: np.ndarray) -> Problem | None:
    """A per-step list whose length is not the row's number of steps (``lengths``: of ``step_starts``)."""
    for name in ("step_ends", "q", "n_success", "n_mc"):
        other = pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False)
        row = _first(other != lengths)
        if row is not None:
            return row, f"{name} has {other[row]} entries but there are {lengths[row]} steps (step_starts)"
    return None


def _step_problem(table: pa.Table, lengths: np.ndarray) -> Problem | None:
    """A step whose span, ``q`` or counts are out of range, or whose ``q`` is not ``n_success / n_mc``."""
    # flattened lists, the row of each entry and its step number within the row
    parent = np.repeat(np.arange(table.num_rows), lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    step = np.arange(parent.size) - offsets[parent]
    starts = _numpy(table, "step_starts", True).astype(np.int64)
    ends = _numpy(table, "step_ends", True).astype(np.int64)
    q = _numpy(table, "q", True).astype(np.float64)
    n_success, n_mc = _numpy(table, "n_success", True).astype(np.int64), _numpy(table, "n_mc", True).astype(np.int64)
    response_length = pc.utf8_length(table.column("response")).to_numpy(zero_copy_only=False).astype(np.int64)
    previous_end = np.where(step == 0, 0, np.concatenate([[0], ends[:-1]]))
    bad = _first(~((previous_end <= starts) & (starts < ends) & (ends <= response_length[parent])))
    if bad is not None:
        return parent[bad], (f"step {step[bad]} span ({starts[bad]}, {ends[bad]}) is empty, overlaps the previous "
                             f"step or leaves the response of {response_length[parent[bad]]} characters")
    bad = _first(~(np.isnan(q) | ((q >= 0.0) & (q <= 1.0))))
    if bad is not None:
        return parent[bad], f"step {step[bad]} has q={q[bad]} outside [0, 1]"
    bad = _first(~((n_success >= 0) & (n_success <= n_mc)))
    if bad is not None:
        return parent[bad], (f"step {step[bad]} has n_success={n_success[bad]}, n_mc={n_mc[bad]}: need "
                             "0 <= n_success <= n_mc")
    with np.errstate(invalid="ignore"):
        bad = _first((n_mc > 0) & ~(np.abs(q - n_success / np.maximum(n_mc, 1)) <= 1e-9))
    if bad is not None:
        return parent[bad], f"step {step[bad]} has q={q[bad]} but n_success/n_mc = {n_success[bad]}/{n_mc[bad]}"
    return None


def _row_problem(table: pa.Table, lengths: np.ndarray) -> Problem | None:
    """A row whose ``first_pit``, prompt value, ``outcome`` or ``score`` is out of range."""
    first_pit = _numpy(table, "first_pit").astype(np.int64)
    row = _first(~((first_pit >= -1) & (first_pit < np.maximum(lengths, 0)) | (first_pit == -1)))
    if row is not None:
        return row, f"first_pit={first_pit[row]} is not -1 or a step of the {lengths[row]} steps"
    value = _numpy(table, "prompt_value").astype(np.float64)
    value_success = _numpy(table, "prompt_n_success").astype(np.int64)
    value_mc = _numpy(table, "prompt_n_mc").astype(np.int64)
    row = _first(~(np.isnan(value) | ((value >= 0.0) & (value <= 1.0))))
    if row is not None:
        return row, f"prompt_value={value[row]} outside [0, 1]"
    row = _first(~((value_success >= 0) & (value_success <= value_mc)))
    if row is not None:
        return row, (f"prompt_n_success={value_success[row]}, prompt_n_mc={value_mc[row]}: need "
                     "0 <= prompt_n_success <= prompt_n_mc")
    with np.errstate(invalid="ignore"):
        row = _first((value_mc > 0) & ~(np.abs(value - value_success / np.maximum(value_mc, 1)) <= 1e-9))
    if row is not None:
        return row, (f"prompt_value={value[row]} but prompt_n_success/prompt_n_mc = "
                     f"{value_success[row]}/{value_mc[row]}")
    outcome = _numpy(table, "outcome").astype(np.float64)
    row = _first(~(np.isnan(outcome) | (outcome == 0.0) | (outcome == 1.0)))
    if row is not None:
        return row, f"outcome={outcome[row]} is not 0, 1 or NaN"
    score = _numpy(table, "score").astype(np.float64)
    row = _first(np.isinf(score))
    if row is not None:
        return row, f"score={score[row]} is infinite (NaN marks an unknown score)"
    return None


def _rows_table(rows: Sequence[dict], where: str) -> pa.Table:
    for i, row in enumerate(rows):
        missing = [c for c in LABEL_COLUMNS if c not in row]
        if missing:
            raise ValueError(f"{where} row {i}: missing columns {missing}")
    arrays = []
    for field in LABEL_SCHEMA:
        try:
            arrays.append(pa.array([row[field.name] for row in rows], type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as error:
            raise ValueError(f"{where}: column {field.name} does not hold {field.type} values ({error})") from None
    return pa.Table.from_arrays(arrays, schema=LABEL_SCHEMA)


def rows_to_table(rows: Sequence[dict]) -> pa.Table:
    """Label rows (dicts with every column of LABEL_SCHEMA) -> a pyarrow table with the fixed schema, checked
    by :func:`check_label_table` (the same checks that :func:`read_labels` applies)."""
    return check_label_table(_rows_table(rows, "label rows to write"), "label rows to write")


def label_files(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Expand directories (their ``*.parquet`` files, sorted) and files into a list of label shards; a file
    named twice (directly or through its directory) is an error: its rows would be trained on twice."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.parquet"))
            if not found:
                raise FileNotFoundError(f"no *.parquet label shards in directory {path}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"label path {path} does not exist")
    seen: dict[str, Path] = {}
    for file in files:
        key = str(file.resolve())
        if key in seen:
            raise ValueError(f"label shard {file} is given twice (as {seen[key]} and {file}); name each shard or "
                             "directory once")
        seen[key] = file
    return files


def check_duplicate_rollouts(keys: pd.DataFrame) -> None:
    """Raise ValueError naming both places if a rollout appears twice.

    ``keys`` has one row per label row: ``file`` (shard path), ``row`` (row within it), ``directory``,
    ``prompt_index``, ``rollout_index``, ``prompt``, ``response``. A rollout is identified within one directory
    (one labelling run or conversion) by ``(prompt_index, rollout_index)``, and anywhere by the prompt, the
    rollout and its text, ``(prompt_index, rollout_index, prompt, response)``: the step prefixes of a
    rollout would otherwise be trained on twice (e.g. two writers on one directory, or a copied shard).
    """
    for columns in (["directory", "prompt_index", "rollout_index"], ["prompt_index", "rollout_index", "prompt", "response"]):
        repeated = keys.duplicated(columns, keep="first")
        if repeated.any():
            second = keys[repeated].iloc[0]
            first = keys[(keys[columns] == second[columns]).all(axis=1)].iloc[0]
            raise ValueError(
                f"duplicate label rows: {second['file']} row {second['row']} repeats {first['file']} row "
                f"{first['row']} (prompt_index={first['prompt_index']}, rollout_index={first['rollout_index']}); "
                "two writers on one --output-dir, or a shard copied or given twice? Remove the duplicate shard or "
                "relabel into a new directory"
            )


def read_labels(paths: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """Read label shards (files or directories) into one DataFrame; list columns become Python lists.

    Every shard is validated as it is read (:func:`check_label_table`) and duplicate rollouts are refused
    (:func:`check_duplicate_rollouts`); errors name the shard and the row.
    """
    tables, keys = [], []
    for path in label_files(paths):
        try:
            table = pq.read_table(path)
        except Exception as error:  # pyarrow raises several types for a damaged file
            raise ValueError(f"label shard {path} cannot be read as parquet ({error}); a shard cut short by a copy "
                             "or a full disk? Shards are written atomically, so relabel or copy it again") from None
        table = check_label_table(table, f"label shard {path}")
        tables.append(table)
        keys.append(pd.DataFrame({
            "file": str(path), "row": np.arange(table.num_rows), "directory": str(path.parent.resolve()),
            "prompt_index": table.column("prompt_index").to_numpy(),
            "rollout_index": table.column("rollout_index").to_numpy(),
            "prompt": table.column("prompt").to_pandas(), "response": table.column("response").to_pandas(),
        }))
    check_duplicate_rollouts(pd.concat(keys, ignore_index=True))
    frame = pa.concat_tables(tables).to_pandas()
    for column in ("step_starts", "step_ends", "q", "n_success", "n_mc"):
        frame[column] = frame[column].map(lambda values: [v.item() if hasattr(v, "item") else v for v in values])
    return frame


def best_of_k_from_counts(n_success: np.ndarray, n_mc: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """Best-of-K value of a prover from Monte-Carlo counts of its base policy, elementwise.

    The Best-of-K policy succeeds if any of K samples succeeds: ``Q_K = 1 - (1 - p)^K``. From ``s`` successes
    in ``n`` samples the unbiased estimator (the pass@k estimator) is ``1 - C(n - s, K) / C(n, K)``
    ``= 1 - prod_{i<K} (n - s - i) / (n - i)``, used where ``n >= K``. Where ``0 < n < K`` no unbiased
    estimate exists and the plug-in ``1 - (1 - s/n)^K`` is returned (documented fallback, biased upwards
    less than it is biased by noise at such n). Where ``n == 0`` (exact, inferred or converted labels) the
    transform of ``q`` is ``1 - (1 - q)^K`` (q = 0 or 1 stays put; NaN stays NaN).

    Args:
        n_success, n_mc: integer arrays of one shape. q: float array of that shape. k: integer >= 1.
    Returns:
        float64 array of that shape.
    """
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"best_of_k_from_counts: k must be an integer >= 1, got {k!r}")
    n_success = np.asarray(n_success, dtype=np.float64)
    n_mc = np.asarray(n_mc, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    ratio = np.ones_like(n_mc)
    for i in range(int(k)):
        ratio = ratio * np.clip(n_mc - n_success - i, 0.0, None) / np.maximum(n_mc - i, 1.0)
    unbiased = 1.0 - ratio
    plug_in = 1.0 - np.power(1.0 - np.where(n_mc > 0, n_success / np.maximum(n_mc, 1.0), q), int(k))
    return np.where(n_mc >= k, unbiased, plug_in)

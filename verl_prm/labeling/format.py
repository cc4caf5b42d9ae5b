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
                                     NaN = not computed
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

import math
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "LABEL_SCHEMA",
    "LABEL_COLUMNS",
    "best_of_k_from_counts",
    "check_label_row",
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


def check_label_row(row: dict, where: str = "") -> None:
    """Raise ValueError naming the row if the per-step lists disagree or the spans leave the response."""
    name = where or f"prompt_index={row.get('prompt_index')} rollout_index={row.get('rollout_index')}"
    missing = [c for c in LABEL_COLUMNS if c not in row]
    if missing:
        raise ValueError(f"label row {name}: missing columns {missing}")
    num_steps = len(row["step_starts"])
    for column in ("step_ends", "q", "n_success", "n_mc"):
        if len(row[column]) != num_steps:
            raise ValueError(
                f"label row {name}: {column} has {len(row[column])} entries but there are {num_steps} steps"
            )
    response_length = len(row["response"])
    previous_end = 0
    for h, (start, end) in enumerate(zip(row["step_starts"], row["step_ends"])):
        if not (previous_end <= start < end <= response_length):
            raise ValueError(
                f"label row {name}: step {h} span ({start}, {end}) is empty, overlaps the previous step or leaves "
                f"the response of {response_length} characters"
            )
        previous_end = end
    for h, (q, s, n) in enumerate(zip(row["q"], row["n_success"], row["n_mc"])):
        if n > 0 and not (0 <= s <= n and math.isclose(q, s / n, abs_tol=1e-9)):
            raise ValueError(f"label row {name}: step {h} has q={q} but n_success/n_mc = {s}/{n}")
        if not (math.isnan(q) or 0.0 <= q <= 1.0):
            raise ValueError(f"label row {name}: step {h} has q={q} outside [0, 1]")


def rows_to_table(rows: Sequence[dict]) -> pa.Table:
    """Label rows (dicts with every column of LABEL_SCHEMA) -> a pyarrow table with the fixed schema."""
    for row in rows:
        check_label_row(row)
    columns = {name: [row[name] for row in rows] for name in LABEL_COLUMNS}
    return pa.Table.from_pydict(columns, schema=LABEL_SCHEMA)


def label_files(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Expand directories (their ``*.parquet`` files, sorted) and files into a list of label shards."""
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
    return files


def read_labels(paths: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """Read label shards (files or directories) into one DataFrame; list columns become Python lists."""
    tables = [pq.read_table(path) for path in label_files(paths)]
    for path, table in zip(label_files(paths), tables):
        missing = [c for c in LABEL_COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(f"{path} is no label shard: missing columns {missing} (see verl_prm.labeling.format)")
    frame = pa.concat_tables([t.select(list(LABEL_COLUMNS)) for t in tables]).to_pandas()
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

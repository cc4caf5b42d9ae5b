"""``python -m studies.bench_labels``: what validating label shards on read costs, side by side in one process.

Writes one synthetic shard (``--rows`` rollouts of ``--steps`` steps, every column valid) and times, on the same
file: the bare read (parquet -> DataFrame with Python lists, what ``read_labels`` did before it validated),
:func:`~verl_prm.labeling.format.check_label_table` alone, and :func:`~verl_prm.labeling.format.read_labels`
(read, every column checked, duplicate rollouts refused). Prints the seconds of each and the ratio to the bare read.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from verl_prm.labeling.format import LABEL_SCHEMA, check_label_table, read_labels


def synthetic_labels(rows: int, steps: int, seed: int = 0) -> pa.Table:
    """``rows`` valid label rows (4 rollouts per prompt) of ``steps`` ten-character steps each."""
    rng = np.random.default_rng(seed)
    n_mc = rng.integers(1, 9, size=(rows, steps))
    n_success = rng.integers(0, 9, size=(rows, steps)) % (n_mc + 1)
    columns = dict(
        prompt_index=np.arange(rows) // 4, rollout_index=np.arange(rows) % 4, data_source=["x"] * rows,
        prompt=[f"prompt {i // 4}" for i in range(rows)], ground_truth=["1"] * rows,
        response=["step text\n" * steps] * rows, step_starts=[list(range(0, 10 * steps, 10))] * rows,
        step_ends=[list(range(10, 10 * steps + 1, 10))] * rows, q=list(n_success / n_mc), n_success=list(n_success),
        n_mc=list(n_mc), first_pit=[-1] * rows, prompt_value=[0.5] * rows, prompt_n_success=[4] * rows,
        prompt_n_mc=[8] * rows, outcome=[1.0] * rows, score=[1.0] * rows, finished=[True] * rows,
        strategy=["every"] * rows, source=["bench"] * rows,
    )
    return pa.Table.from_pydict(columns, schema=LABEL_SCHEMA)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.bench_labels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="synthetic rollouts in the shard")
    parser.add_argument("--steps", type=int, default=8, help="steps per rollout")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        pq.write_table(synthetic_labels(args.rows, args.steps), Path(directory) / "shard-00000.parquet")
        start = time.perf_counter()
        table = pq.read_table(Path(directory) / "shard-00000.parquet")
        frame = table.to_pandas()
        for column in ("step_starts", "step_ends", "q", "n_success", "n_mc"):
            frame[column] = frame[column].map(lambda values: [v.item() for v in values])
        bare = time.perf_counter() - start
        start = time.perf_counter()
        check_label_table(table, "bench")
        check = time.perf_counter() - start
        start = time.perf_counter()
        read_labels(directory)
        full = time.perf_counter() - start
    print(f"{args.rows} rollouts x {args.steps} steps, one shard")
    print("| read | seconds | ratio to bare read |\n|---|---:|---:|")
    for name, seconds in (("bare parquet read", bare), ("check_label_table alone", check),
                          ("read_labels (validated, duplicates refused)", full)):
        print(f"| {name} | {seconds:.2f} | {seconds / bare:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

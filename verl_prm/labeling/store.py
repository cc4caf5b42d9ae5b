"""Sharded, crash-safe parquet output for label rows.

Layout of an output directory::

    .verl-prm.lock         held by the one process writing here (verl_prm.locking; released when it exits)
    labels_config.json     the labelling settings (once a shard exists, a restart with other settings is refused)
    shard-00000.parquet    label rows of a group of prompts; a shard file exists only when complete
    shard-00001.parquet
    .shard-00002.parquet.tmp   (only while it is being written)

A shard is written to a temporary file, flushed and fsynced, then renamed (``os.replace`` is atomic on POSIX),
so a kill -9 at any moment loses at most the shard being written. A restart removes leftover temporary files
and skips every prompt that a complete shard holds (read from the shards' ``prompt_index`` column).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import pyarrow.parquet as pq

from verl_prm.labeling.format import rows_to_table
from verl_prm.resume import check_same_settings, jsonable, read_settings, settings_differences, write_settings

__all__ = ["ShardStore"]

_SHARD = re.compile(r"shard-(\d+)\.parquet")


class ShardStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def config_path(self) -> Path:
        return self.directory / "labels_config.json"

    def check_config(self, config: dict, ignore: Sequence[str] = ()) -> str | None:
        """Write ``config`` on the first run; on a restart refuse settings that differ from the stored ones
        (except the keys in ``ignore``, which do not change labels: shard size, batch size, ...).

        Settings bind only labels that exist: while the directory holds no shard (a run that failed before its
        first shard), other settings replace the stored ones, and the returned note says which changed.
        """
        fix = "write to a new --output-dir"
        config = jsonable(config)
        stored = read_settings(self.config_path, fix=fix)
        note = None
        if stored is not None:
            differing = settings_differences(stored, config, ignore=ignore)
            if not differing:
                return None
            if self.shard_paths():
                check_same_settings(stored, config, source=self.directory, what="labels", fix=fix, ignore=ignore)
            note = (f"{self.directory} holds no label shard yet: the new settings replace the stored ones "
                    f"({'; '.join(differing)})")
        write_settings(self.config_path, config)
        return note

    def shard_paths(self) -> list[Path]:
        return sorted(p for p in self.directory.glob("shard-*.parquet") if _SHARD.fullmatch(p.name))

    def remove_temporary_files(self) -> list[Path]:
        """Delete shards left half-written by a killed run; returns what was removed."""
        leftovers = sorted(self.directory.glob(".shard-*.parquet.tmp*"))
        for path in leftovers:
            path.unlink()
        return leftovers

    def finished_prompts(self) -> set[int]:
        done: set[int] = set()
        for path in self.shard_paths():
            try:
                indices = pq.read_table(path, columns=["prompt_index"]).column("prompt_index").to_pylist()
            except Exception as error:  # pyarrow raises several types for a damaged file
                raise ValueError(f"label shard {path} cannot be read as parquet ({error}); shards are written "
                                 "atomically, so it was damaged afterwards: move it away and rerun to relabel its "
                                 "prompts") from None
            overlap = done.intersection(indices)
            if overlap:
                raise ValueError(f"{path} repeats prompts already in earlier shards: {sorted(overlap)[:10]}")
            done.update(indices)
        return done

    def next_shard_id(self) -> int:
        ids = [int(_SHARD.fullmatch(p.name).group(1)) for p in self.shard_paths()]
        return max(ids, default=-1) + 1

    def write_shard(self, rows: Sequence[dict]) -> Path:
        """Write rows as the next shard, atomically; returns the shard path."""
        if not rows:
            raise ValueError("write_shard: no rows (every prompt yields n_cov rows)")
        table = rows_to_table(rows)
        final = self.directory / f"shard-{self.next_shard_id():05d}.parquet"
        temp = self.directory / f".{final.name}.tmp{os.getpid()}"
        with open(temp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
        directory_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory_fd)  # make the rename itself durable
        finally:
            os.close(directory_fd)
        return final

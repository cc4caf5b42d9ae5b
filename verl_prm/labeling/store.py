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

import json
import os
import re
from pathlib import Path
from typing import Sequence

import pyarrow.parquet as pq

from verl_prm.labeling.format import rows_to_table

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
        config = json.loads(json.dumps(config, default=str))
        note = None
        if self.config_path.exists():
            try:
                stored = json.loads(self.config_path.read_text())
            except ValueError as error:
                raise ValueError(f"{self.config_path} is not valid JSON ({error}); it is written atomically, so it "
                                 "was edited by hand: restore it or write to a new --output-dir") from None
            differing = sorted(
                key for key in set(stored) | set(config) if key not in ignore and stored.get(key) != config.get(key)
            )
            if not differing:
                return None
            details = ", ".join(f"{k}: {stored.get(k)!r} -> {config.get(k)!r}" for k in differing)
            if self.shard_paths():
                raise ValueError(
                    f"{self.directory} holds labels made with other settings ({details}); resume with the same "
                    "settings or write to a new --output-dir"
                )
            note = f"{self.directory} holds no label shard yet: the new settings replace the stored ones ({details})"
        temp = self.config_path.with_name(f".{self.config_path.name}.tmp")
        temp.write_text(json.dumps(config, indent=2, sort_keys=True))
        os.replace(temp, self.config_path)
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

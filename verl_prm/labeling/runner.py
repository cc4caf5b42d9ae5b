"""The resumable labelling loop: prompts in shards, a progress bar with rollouts per second."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from tqdm.auto import tqdm

from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.monte_carlo import MonteCarloLabeler
from verl_prm.labeling.store import ShardStore

__all__ = ["run_labeling"]


def run_labeling(
    items: Sequence[PromptItem],
    render: Callable[[object], str],
    labeler: MonteCarloLabeler,
    store: ShardStore,
    *,
    shard_size: int,
    progress: bool = True,
    on_shard_written: Callable[[object], None] | None = None,
) -> dict:
    """Label every prompt of ``items`` that no complete shard in ``store`` holds, ``shard_size`` prompts per
    shard. ``on_shard_written(path)`` runs after each shard (tests use it to simulate a crash).

    Returns a summary: prompts skipped/labelled, sequences generated, seconds, rollouts per second (every
    generated sequence counts: seed rollouts, continuations and prompt-value samples).
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    removed = store.remove_temporary_files()
    done = store.finished_prompts()
    todo = [item for item in items if item.index not in done]
    start = time.perf_counter()
    generated_before = labeler.num_generated
    bar = tqdm(total=len(items), initial=len(items) - len(todo), unit="prompt", desc="labelling", disable=not progress)
    previous_hook = labeler.on_generated

    def show_rate(count: int) -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(rollouts_per_s=f"{(labeler.num_generated - generated_before) / elapsed:.1f}", refresh=False)
        bar.refresh()
        if previous_hook is not None:
            previous_hook(count)

    labeler.on_generated = show_rate
    shards = []
    try:
        for begin in range(0, len(todo), shard_size):
            chunk = list(todo[begin : begin + shard_size])
            rows = labeler.label(chunk, [render(item.prompt) for item in chunk])
            path = store.write_shard(rows)
            shards.append(path)
            bar.update(len(chunk))
            if on_shard_written is not None:
                on_shard_written(path)
    finally:
        labeler.on_generated = previous_hook
        bar.close()
    seconds = time.perf_counter() - start
    generated = labeler.num_generated - generated_before
    return dict(
        prompts_total=len(items),
        prompts_skipped=len(items) - len(todo),
        prompts_labelled=len(todo),
        shards_written=[str(p) for p in shards],
        temporary_files_removed=[str(p) for p in removed],
        rollouts_generated=generated,
        seconds=seconds,
        rollouts_per_s=generated / seconds if seconds > 0 else float("nan"),
    )

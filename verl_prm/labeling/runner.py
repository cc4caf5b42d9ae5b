"""The resumable labelling loop: prompts in shards, a progress bar with rollouts per second."""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

from tqdm.auto import tqdm

from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.monte_carlo import MonteCarloLabeler
from verl_prm.labeling.store import ShardStore
from verl_prm.locking import DirectoryLock

__all__ = ["run_labeling", "all_failed_warning"]


def all_failed_warning(rows: Sequence[dict], success_threshold: float | None = None) -> str | None:
    """A warning when the seed rollouts of ``rows`` exist and none succeeded (every label is then 0), with the
    likely causes; None otherwise.

    All-zero outcomes mostly mean that the scorer never matches the ground truth: a whole solution stored as
    the ground truth (GSM8K's ``answer`` without ``#### `` extraction), the wrong ``--answer-field``, a
    ``data_source`` that selects the wrong rule, a reward function or threshold that never accepts.
    """
    if not rows or any(row["outcome"] == 1.0 for row in rows):
        return None
    example = rows[0]
    ground_truth = str(example["ground_truth"])
    looks_like_solution = "\n" in ground_truth.strip() or len(ground_truth) > 40
    sources = sorted({str(row["data_source"]) for row in rows})
    threshold = "" if success_threshold is None else f" (success iff score > {success_threshold})"
    causes = []
    if looks_like_solution:
        causes.append(f"the ground truth looks like a whole solution, not a final answer (prompt {example['prompt_index']}: "
                      f"{ground_truth[:120]!r}): pass --answer-regex (e.g. '#### (.*)') or the right --answer-field")
    causes.append(f"the ground truth does not match what the scorer compares (prompt {example['prompt_index']}: "
                  f"ground truth {ground_truth[:60]!r}, data_source {sources[:5]}); check --answer-field / --answer-regex "
                  "/ --data-source")
    causes.append("the reward function or --success-threshold never accepts a response")
    causes.append("the policy solves none of these prompts (too weak, or --max-new-tokens cuts every answer)")
    return (f"all {len(rows)} seed rollouts of this run scored 0{threshold}, so every label is 0 and a critic trained "
            "on them learns nothing. Likely causes, most likely first: " + "; ".join(causes))


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
    with DirectoryLock(store.directory, "labelling"):  # re-entrant: the CLI holds it already
        return _run_labeling(items, render, labeler, store, shard_size, progress, on_shard_written)


def _run_labeling(items, render, labeler, store, shard_size, progress, on_shard_written) -> dict:
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
    outcomes = []  # per seed rollout of this run: the fields all_failed_warning reads
    try:
        for begin in range(0, len(todo), shard_size):
            chunk = list(todo[begin : begin + shard_size])
            rows = labeler.label(chunk, [render(item.prompt) for item in chunk])
            path = store.write_shard(rows)
            outcomes.extend({k: row[k] for k in ("outcome", "ground_truth", "data_source", "prompt_index")} for row in rows)
            shards.append(path)
            bar.update(len(chunk))
            if on_shard_written is not None:
                on_shard_written(path)
    finally:
        labeler.on_generated = previous_hook
        bar.close()
    seconds = time.perf_counter() - start
    generated = labeler.num_generated - generated_before
    warnings = []
    warning = all_failed_warning(outcomes, getattr(labeler.scorer, "success_threshold", None))
    if warning is not None:
        warnings.append(warning)
        print(f"\nverl-prm label: WARNING: {warning}\n", file=sys.stderr, flush=True)
    return dict(
        prompts_total=len(items),
        prompts_skipped=len(items) - len(todo),
        prompts_labelled=len(todo),
        shards_written=[str(p) for p in shards],
        temporary_files_removed=[str(p) for p in removed],
        rollouts_generated=generated,
        seconds=seconds,
        rollouts_per_s=generated / seconds if seconds > 0 else float("nan"),
        seed_success_rate=(sum(o["outcome"] == 1.0 for o in outcomes) / len(outcomes)) if outcomes else float("nan"),
        warnings=warnings,
    )

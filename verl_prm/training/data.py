"""Label rows -> training examples: one token sequence per rollout with the positions and labels of its steps.

Each rollout is encoded once (``verl_prm.steps.encode_with_step_ends``: prompt and response tokenised
separately and concatenated, the critic reads step h at the token holding its last character), so one forward
pass trains all of its steps, exactly as the critic scores them. The prompt's last token carries the prompt
value label when the rows have one, on one rollout of the prompt only (:func:`prompt_value_carriers`): a label
shard repeats V(prompt) on each of the prompt's rollouts, and it is one label, not one per rollout.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from typing import Callable

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

from verl_prm.labeling.format import best_of_k_from_counts, label_files, read_labels
from verl_prm.steps import encode_with_step_ends
from verl_prm.training.config import TrainConfig

__all__ = [
    "EncodedRollout",
    "read_examples",
    "read_frames",
    "label_row_name",
    "encode_labels",
    "prompt_value_carriers",
    "split_by_prompt",
    "class_balanced_weights",
    "sample_batch_indices",
    "collate",
]


@dataclass
class EncodedRollout:
    """input_ids [T]; positions [S] (token index of each labelled step, ascending); targets [S] in [0, 1];
    counts [S]: the Monte-Carlo continuations behind each target (``n_mc``/``prompt_n_mc``; 0 = not sampled:
    exact, inferred or converted), which weigh the held-out labels of a calibration fit."""

    input_ids: list[int]
    positions: list[int]
    targets: list[float]
    prompt: str = ""
    counts: list[int] = field(default_factory=list)


@dataclass
class EncodingStats:
    rollouts: int = 0
    steps: int = 0
    unlabelled_steps: int = 0
    rollouts_without_labels: int = 0
    truncated_rollouts: int = 0
    steps_beyond_max_length: int = 0
    # prompt value labels encoded, and rows whose prompt value another row of the prompt carries
    prompt_values: int = 0
    repeated_prompt_values: int = 0
    notes: list[str] = field(default_factory=list)


def _prompt_fraction(prompt: str, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}\x1f{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def split_by_prompt(frame: pd.DataFrame, eval_fraction: float, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Held-out split by prompt text (never by rollout: rollouts of one prompt share prefixes and labels).

    A prompt goes to the evaluation side iff hash(seed, prompt) / 2^64 < eval_fraction: deterministic,
    independent of row order, stable when more labels arrive.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    held_out = frame["prompt"].map(lambda prompt: _prompt_fraction(prompt, seed) < eval_fraction)
    return frame[~held_out].reset_index(drop=True), frame[held_out].reset_index(drop=True)


# the columns that hold a row's prompt value, and those that say whose prompt value it is (within one shard)
_PROMPT_VALUE_COLUMNS = ("prompt_value", "prompt_n_success", "prompt_n_mc")
_PROMPT_KEY = ("prompt_index", "prompt")


def prompt_value_carriers(frame: pd.DataFrame) -> np.ndarray:
    """Which label rows carry their prompt's value label: [num rows] booleans, True for one row per prompt value.

    A label shard repeats the prompt value (``prompt_value``, ``prompt_n_success``, ``prompt_n_mc``) on every
    rollout of the prompt; it is one Monte-Carlo estimate of V(prompt), so it is trained on and measured once.
    Rows hold *the same prompt value* iff they come from the same label shard (the frame's ``shard`` column,
    which ``verl-prm train`` adds; a frame without it counts as one shard) and have the same ``prompt_index``
    and the same ``prompt`` text. The first such row in frame order carries the label. Two prompts of one
    index but different text (or the same text at two indices, or in two shards: two labelling runs, two
    refresh steps) are separate prompt values.

    Raises:
        ValueError naming both rows if rows of one prompt value disagree on its columns (a labelling run
        writes V(prompt) once per prompt; disagreeing rows were edited or merged by hand).
    """
    if not len(frame):
        return np.zeros(0, dtype=bool)
    key = (["shard"] if "shard" in frame.columns else []) + list(_PROMPT_KEY)
    group = frame.groupby(key, sort=False, dropna=False).ngroup().to_numpy()
    order = np.arange(len(frame))
    first = pd.Series(order).groupby(group).transform("min").to_numpy()
    values = frame[list(_PROMPT_VALUE_COLUMNS)].to_numpy(dtype=np.float64)
    same = (values == values[first]) | (np.isnan(values) & np.isnan(values[first]))
    bad = np.flatnonzero(~same.all(axis=1))
    if bad.size:
        row, carrier = (next(frame.iloc[[i]].itertuples(index=False)) for i in (bad[0], first[bad[0]]))
        row_value, carrier_value = (dict(zip(_PROMPT_VALUE_COLUMNS, values[i].tolist())) for i in (bad[0], first[bad[0]]))
        raise ValueError(f"{label_row_name(row)} has the prompt of {label_row_name(carrier)} but another prompt "
                         f"value ({row_value} vs {carrier_value}); the rollouts of one prompt in a label shard share one "
                         "V(prompt): fix or relabel the shard (see verl_prm.labeling.format)")
    return first == order


def encode_labels(
    frame: pd.DataFrame,
    tokenizer,
    *,
    max_length: int | None = None,
    best_of_k: int = 1,
    use_prompt_value: bool = True,
) -> tuple[list[EncodedRollout], EncodingStats]:
    """Encode label rows; steps with q = NaN are skipped (not labelled).

    ``best_of_k > 1`` turns the labels into the Best-of-K prover's values (from the stored counts, see
    :func:`verl_prm.labeling.format.best_of_k_from_counts`). A sequence longer than ``max_length`` keeps its
    first ``max_length`` tokens and loses the labels of the steps that end beyond them (counted in the stats
    and reported; no label is moved to another position). Rows left without any label are counted and skipped.
    The prompt value is encoded once per prompt value, on the row :func:`prompt_value_carriers` picks.
    """
    stats = EncodingStats()
    examples: list[EncodedRollout] = []
    carriers = prompt_value_carriers(frame) if use_prompt_value else np.zeros(len(frame), dtype=bool)
    for carries, row in zip(carriers, frame.itertuples(index=False)):
        stats.rollouts += 1
        spans = [(int(a), int(b)) for a, b in zip(row.step_starts, row.step_ends)]
        q = np.asarray(row.q, dtype=np.float64)
        if best_of_k > 1:
            q = best_of_k_from_counts(np.asarray(row.n_success), np.asarray(row.n_mc), q, best_of_k)
        try:
            encoded = encode_with_step_ends(tokenizer, row.prompt, row.response, spans)
        except ValueError as error:  # it names "sample 0", the one-row batch: name the label row instead
            raise ValueError(f"{label_row_name(row)}: {str(error).removeprefix('sample 0: ')}") from None
        positions, targets, counts = [], [], []
        prompt_value = float(row.prompt_value)
        if use_prompt_value and not carries and not math.isnan(prompt_value):
            stats.repeated_prompt_values += 1  # the prompt's first row carries it
        elif carries and not math.isnan(prompt_value):
            stats.prompt_values += 1
            if best_of_k > 1:
                prompt_value = float(best_of_k_from_counts(np.asarray(row.prompt_n_success), np.asarray(row.prompt_n_mc),
                                                           np.asarray(prompt_value), best_of_k))
            positions.append(int(encoded.prompt_end))
            targets.append(prompt_value)
            counts.append(int(row.prompt_n_mc))
        for end, value, count in zip(encoded.step_ends, q, row.n_mc):
            stats.steps += 1
            if math.isnan(value):
                stats.unlabelled_steps += 1
                continue
            positions.append(int(end))
            targets.append(float(value))
            counts.append(int(count))
        input_ids = [int(t) for t in encoded.input_ids]
        if max_length is not None and len(input_ids) > max_length:
            stats.truncated_rollouts += 1
            kept = [(p, t, c) for p, t, c in zip(positions, targets, counts) if p < max_length]
            stats.steps_beyond_max_length += len(positions) - len(kept)
            positions, targets, counts = [p for p, _, _ in kept], [t for _, t, _ in kept], [c for _, _, c in kept]
            input_ids = input_ids[:max_length]
        if not positions:
            stats.rollouts_without_labels += 1
            continue
        examples.append(EncodedRollout(input_ids, positions, targets, row.prompt, counts))
    if stats.truncated_rollouts:
        stats.notes.append(
            f"{stats.truncated_rollouts} rollouts exceed max_length={max_length}: their first {max_length} tokens "
            f"are kept and {stats.steps_beyond_max_length} step labels beyond them are not trained on"
        )
    return examples, stats


def label_row_name(row) -> str:
    """"label shard S row R (prompt_index=..., rollout_index=...)" when the frame has the ``shard`` and
    ``shard_row`` columns of the trainer, else the rollout's indices."""
    where = f"label shard {row.shard} row {row.shard_row} " if hasattr(row, "shard") else "label row "
    return f"{where}(prompt_index={row.prompt_index}, rollout_index={row.rollout_index})"


def class_balanced_weights(examples: list[EncodedRollout], threshold: float = 0.5) -> np.ndarray:
    """Sampling weights of rollouts that balance steps with q < threshold against steps with q >= threshold.

    Each labelled step gets the weight of its class, w_c = 1 / (2 N_c) (N_c = labelled steps of class c in
    the data); a rollout's weight is the mean weight of its steps. A rollout whose steps are all of one class
    (the common case: successes are mostly >= 0.5, steps after a pit all 0) is then drawn with a probability
    that makes the two classes contribute about equally many steps; mixed rollouts sit in between. If one
    class is absent every rollout weighs the same.

    Returns:
        [num_examples] float64 weights (sum 1).
    """
    targets = [np.asarray(e.targets) >= threshold for e in examples]
    positives = sum(int(t.sum()) for t in targets)
    negatives = sum(int((~t).sum()) for t in targets)
    if positives == 0 or negatives == 0:
        weights = np.ones(len(examples))
    else:
        weights = np.array([np.mean(np.where(t, 0.5 / positives, 0.5 / negatives)) for t in targets])
    return weights / weights.sum()


def sample_batch_indices(weights: np.ndarray, batch_size: int, step: int, seed: int) -> np.ndarray:
    """The rollouts of optimizer step ``step``: ``batch_size`` draws with replacement, probability ~ weights.

    A pure function of (weights, batch_size, step, seed): a resumed run draws exactly the batches the
    uninterrupted run would have drawn, so no example is lost or repeated by a restart.
    """
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
    probabilities = torch.as_tensor(weights, dtype=torch.float64)
    return torch.multinomial(probabilities, batch_size, replacement=True, generator=generator).numpy()


def collate(examples: list[EncodedRollout], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids/attention_mask [B, T]; positions/targets/step_mask [B, S]."""
    length = max(len(e.input_ids) for e in examples)
    steps = max(len(e.positions) for e in examples)
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    positions = torch.zeros((batch, steps), dtype=torch.long)
    targets = torch.zeros((batch, steps), dtype=torch.float32)
    step_mask = torch.zeros((batch, steps), dtype=torch.bool)
    for b, e in enumerate(examples):
        input_ids[b, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attention_mask[b, : len(e.input_ids)] = 1
        positions[b, : len(e.positions)] = torch.tensor(e.positions)
        targets[b, : len(e.targets)] = torch.tensor(e.targets)
        step_mask[b, : len(e.positions)] = True
    return dict(input_ids=input_ids, attention_mask=attention_mask, positions=positions, targets=targets,
                step_mask=step_mask)


def with_origin(frame: pd.DataFrame, paths) -> pd.DataFrame:
    """``frame`` (rows of ``read_labels(paths)``, in order) with the ``shard`` and ``shard_row`` of each row."""
    shards, rows = [], []
    for file in label_files(paths):
        count = pq.read_metadata(file).num_rows
        shards += [str(file)] * count
        rows += list(range(count))
    return frame.assign(shard=shards, shard_row=rows)


def check_held_out(train_frame, eval_frame, note: Callable[[str], None]) -> None:
    """Refuse held-out rollouts that are training rollouts. A rollout's identity is
    ``(prompt_index, rollout_index, prompt, response)`` (verl_prm.labeling.format.check_duplicate_rollouts),
    so a copied or renamed shard is caught, not only a shard named twice. Shared prompts only get a note."""
    key = ["prompt_index", "rollout_index", "prompt", "response"]
    shared = eval_frame.merge(train_frame[key + ["shard", "shard_row"]], on=key, suffixes=("", "_train"))
    if len(shared):
        first = shared.iloc[0]
        raise ValueError(f"--eval-labels and --labels share {len(shared)} rollouts (e.g. {first['shard']} row "
                         f"{first['shard_row']} is {first['shard_train']} row {first['shard_row_train']}, "
                         f"prompt_index={first['prompt_index']}, rollout_index={first['rollout_index']}): held-out "
                         "metrics would be measured on training data; pass held-out shards of other rollouts")
    prompts = set(eval_frame["prompt"]) & set(train_frame["prompt"])
    if prompts:
        note(f"verl-prm train: {len(prompts)} of the {eval_frame['prompt'].nunique()} held-out prompts also have "
             "training rollouts (their step prefixes overlap); the held-out metrics are optimistic for them")


def read_frames(config: TrainConfig, note: Callable[[str], None]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The training and held-out label rows (held out: --eval-labels, else a split by prompt), each with the
    ``shard`` and ``shard_row`` of its rows."""
    frame = with_origin(read_labels(config.labels), config.labels)
    if config.eval_labels:
        train_frame, eval_frame = frame, with_origin(read_labels(config.eval_labels), config.eval_labels)
        check_held_out(train_frame, eval_frame, note)
        return train_frame, eval_frame
    return split_by_prompt(frame, config.held_out_fraction, config.seed)


def read_examples(config: TrainConfig, tokenizer, note: Callable[[str], None]) -> tuple[list, list]:
    """The encoded training and held-out rollouts (held out: --eval-labels, else a split by prompt)."""
    train_frame, eval_frame = read_frames(config, note)
    encode = dict(max_length=config.max_length, best_of_k=config.best_of_k, use_prompt_value=config.use_prompt_value)
    train_examples, train_stats = encode_labels(train_frame, tokenizer, **encode)
    eval_examples = encode_labels(eval_frame, tokenizer, **encode)[0] if len(eval_frame) else []
    if not train_examples:
        raise ValueError(f"no labelled steps to train on in {config.labels}")
    for message in train_stats.notes:
        note(f"verl-prm train: {message}")
    return train_examples, eval_examples

"""First-error evaluation of a process verifier in the ProcessBench format (the command: `verl-prm eval
processbench`, verl_prm.evaluation.cli).

A sample is a problem, its solution steps, and ``label`` = the index of the first wrong step, or -1 when every
step is correct (ProcessBench, Zheng et al. 2024). A verifier predicts the first step whose score falls below
a threshold (-1 when none does); the score of step h is the critic's value ``v_h`` (``--score values``) or
the progress ``v_h - v_{h-1}`` (``--score progress``, the PAV reading: a step is wrong when it loses the
prover's chance of success), both after the optional Best-of-K transform. A prediction is right iff it equals
the label. ``accuracy_erroneous`` is the accuracy on the samples with an error, ``accuracy_correct`` on those
without; ``F1 = 2 * acc_err * acc_cor / (acc_err + acc_cor)`` (their harmonic mean; 0 when both are 0).

The threshold is given (``--threshold``) or tuned: the samples are split at random into a tuning part
(``--tune-fraction``) and an evaluation part, stratified by erroneous/correct; the threshold of the grid with
the best F1 on the tuning part is reported with its F1 on the evaluation part.

Input rows (``--format``):

- ``processbench``: jsonl/json/parquet rows with ``problem``, ``steps`` (list of strings), ``label`` (and
  ``id``, optional). Step scores can come from a critic (``--critic``) or from a field of the rows
  (``--scores-field``: a list with one score per step).
- ``prm800k``: PRM800K rows (``question.problem``, ``label.steps[*].completions[*].rating``,
  ``chosen_completion``, ``human_completion``). The first-error label is derived from the ratings of the
  **generator's own steps**: the trajectory follows the chosen completion of each step while its rating is
  1 or 0 (PRM800K's convention: 0 "neutral" is acceptable); at a step whose chosen completion is rated -1, or
  where none was chosen and some completion is rated -1, that (first) -1 completion is the first error:
  ``label`` = its index and the row ends there (steps after a first error do not change the prediction's
  correctness). A step where nothing was chosen and nothing rated -1 ends the row with ``label = -1``. A
  labeller's human-written replacement step is not used (it is not the generator's text); this is where the
  rows differ from ``verl-prm label convert prm800k``, which continues through human steps as correct ones.
"""

from __future__ import annotations

import codecs
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from verl_prm.advantages import best_of_k, step_progress, valid_steps
from verl_prm.steps import encode_with_step_ends
from verl_prm.critic import ProverCritic
from verl_prm.labeling.inputs import plain_python

__all__ = [
    "FirstErrorSample",
    "first_error_f1",
    "evaluate",
    "holdout_split",
    "predicted_first_error",
    "read_first_error_samples",
    "read_prm800k",
    "read_processbench",
    "step_scores_of",
    "sweep_thresholds",
    "threshold_grid",
]


@dataclass
class FirstErrorSample:
    """One ProcessBench sample: ``label`` is the index of the first wrong step or -1."""

    id: str
    problem: str
    steps: list[str]
    label: int
    scores: list[float] | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"sample {self.id}: no steps")
        if not -1 <= self.label < len(self.steps):
            raise ValueError(f"sample {self.id}: label {self.label} is not -1 or a step index in [0, {len(self.steps)})")
        if self.scores is not None and len(self.scores) != len(self.steps):
            raise ValueError(f"sample {self.id}: {len(self.scores)} scores for {len(self.steps)} steps")


# ----------------------------------------------------------------------------------------------------------
# The metric (pure, vectorised)
# ----------------------------------------------------------------------------------------------------------


def predicted_first_error(step_scores: torch.Tensor, num_steps: torch.Tensor, thresholds: torch.Tensor | float) -> torch.Tensor:
    """First step whose score is below the threshold, -1 when none is: ``min{h < H : s_h < t}``.

    Args:
        step_scores: [B, S] score per step (entries at h >= num_steps ignored).
        num_steps: [B] steps per sample.
        thresholds: a float, or [K] thresholds evaluated at once.

    Returns:
        [B] int64 for a float threshold, [K, B] for a [K] tensor.
    """
    scalar = not isinstance(thresholds, torch.Tensor)
    t = torch.as_tensor(thresholds, dtype=step_scores.dtype).reshape(-1)
    below = (step_scores[None, :, :] < t[:, None, None]) & valid_steps(num_steps, step_scores.shape[1])[None]
    first = torch.argmax(below.to(torch.int8), dim=2)  # first True (0 when none)
    predicted = torch.where(below.any(dim=2), first, torch.full_like(first, -1))
    return predicted[0] if scalar else predicted


def first_error_f1(predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """ProcessBench's metric: accuracies on erroneous (label >= 0) and correct (label = -1) samples and their
    harmonic mean ``F1 = 2 a_err a_cor / (a_err + a_cor)`` (0 when both are 0; NaN when a class is empty).

    Args:
        predicted: [..., B] predicted first-error indices; labels: [B].

    Returns:
        dict of floats (for [K, B] input: use ``sweep_thresholds``).
    """
    right = predicted == labels
    erroneous = labels >= 0
    n_err, n_cor = int(erroneous.sum()), int((~erroneous).sum())
    acc_err = float(right[erroneous].float().mean()) if n_err else math.nan
    acc_cor = float(right[~erroneous].float().mean()) if n_cor else math.nan
    total = acc_err + acc_cor
    f1 = (2 * acc_err * acc_cor / total if total > 0 else 0.0) if not math.isnan(total) else math.nan
    return dict(f1=f1, accuracy_erroneous=acc_err, accuracy_correct=acc_cor, num_erroneous=n_err, num_correct=n_cor)


def sweep_thresholds(
    step_scores: torch.Tensor, num_steps: torch.Tensor, labels: torch.Tensor, thresholds: torch.Tensor
) -> tuple[float, list[dict[str, float]]]:
    """F1 at every threshold of ``thresholds`` [K]; returns ``(best threshold, one metrics dict per threshold)``
    (ties: the first, i.e. the smallest threshold of a sorted grid)."""
    predicted = predicted_first_error(step_scores, num_steps, thresholds)
    table = []
    for k in range(len(thresholds)):
        metrics = first_error_f1(predicted[k], labels)
        metrics["threshold"] = float(thresholds[k])
        table.append(metrics)
    scores = [m["f1"] if not math.isnan(m["f1"]) else -1.0 for m in table]
    best = max(range(len(table)), key=lambda k: (scores[k], -k))
    return float(thresholds[best]), table


def holdout_split(
    num: int, tune_fraction: float, seed: int, strata: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random split of ``range(num)`` into (tune indices, evaluation indices), both sorted.

    With ``strata`` ([num] labels, e.g. ``label >= 0``) each stratum is split by the same fraction (at least
    one sample on each side when it has two or more), so that both parts hold erroneous and correct samples
    and both accuracies of the F1 are defined.
    """
    if not 0 < tune_fraction < 1:
        raise ValueError(f"tune_fraction must be in (0, 1), got {tune_fraction}")
    generator = torch.Generator().manual_seed(seed)
    strata = torch.zeros(num, dtype=torch.long) if strata is None else strata.long()
    tune, held = [], []
    for value in torch.unique(strata).tolist():
        members = torch.nonzero(strata == value).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        cut = int(round(tune_fraction * len(members)))
        if len(members) >= 2:
            cut = min(max(cut, 1), len(members) - 1)
        tune.append(members[:cut])
        held.append(members[cut:])
    tune_index, held_index = torch.cat(tune).sort().values, torch.cat(held).sort().values
    if len(tune_index) == 0 or len(held_index) == 0:
        raise ValueError(f"{num} samples are too few to split with tune_fraction={tune_fraction}")
    return tune_index, held_index


def step_scores_of(
    prompt_values: torch.Tensor, step_values: torch.Tensor, num_steps: torch.Tensor, score: str, best_of_k_k: int = 1
) -> torch.Tensor:
    """[B, S] scores the threshold applies to: BoK values, or their progress ``v_h - v_{h-1}``."""
    values = best_of_k(step_values, best_of_k_k)
    if score == "values":
        return values
    if score == "progress":
        return step_progress(values, best_of_k(prompt_values, best_of_k_k), num_steps)
    raise ValueError(f"score must be 'values' or 'progress', got {score!r}")


# ----------------------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------------------


def _records(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pandas as pd

        return [plain_python(r) for r in pd.read_parquet(path).to_dict(orient="records")]
    with open(path) as f:
        if path.suffix == ".json":
            data = json.load(f)
            return data if isinstance(data, list) else [data]
        return [json.loads(line) for line in f if line.strip()]


def read_processbench(path: str | Path, scores_field: str | None = None) -> list[FirstErrorSample]:
    """ProcessBench rows (``problem``, ``steps``, ``label``, optional ``id``) from jsonl/json/parquet."""
    path = Path(path)
    samples = []
    for row, record in enumerate(_records(path)):
        missing = [k for k in ("problem", "steps", "label") if k not in record]
        if missing:
            raise ValueError(f"{path} row {row}: missing field(s) {missing}; ProcessBench rows have problem, steps, "
                             "label (use --format prm800k for PRM800K rows)")
        scores = None
        if scores_field is not None:
            if scores_field not in record:
                raise ValueError(f"{path} row {row}: no field {scores_field!r} (--scores-field)")
            scores = [float(s) for s in record[scores_field]]
        samples.append(FirstErrorSample(str(record.get("id", row)), str(record["problem"]),
                                        [str(s) for s in record["steps"]], int(record["label"]), scores,
                                        dict(source="processbench")))
    return samples


def read_prm800k(path: str | Path) -> list[FirstErrorSample]:
    """PRM800K rows -> first-error samples (module docstring: the label comes from the generator's steps)."""
    path = Path(path)
    samples = []
    for row, record in enumerate(_records(path)):
        try:
            problem = record["question"]["problem"]
            steps_in = record["label"]["steps"] or []
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path} row {row}: expected question.problem and label.steps ({error!r})") from None
        steps: list[str] = []
        label = -1
        for h, step in enumerate(steps_in):
            completions = step.get("completions") or []
            chosen = step.get("chosen_completion")
            if chosen is not None:
                if not 0 <= chosen < len(completions):
                    raise ValueError(f"{path} row {row}: step {h} chosen_completion={chosen} of {len(completions)}")
                rating = completions[chosen].get("rating")
                if rating not in (-1, 0, 1):
                    raise ValueError(f"{path} row {row}: step {h} chosen completion rated {rating!r}, expected -1, 0, 1")
                steps.append(completions[chosen]["text"])
                if rating == -1:
                    label = h
                    break
                continue
            errors = [c for c in completions if c.get("rating") == -1]
            if errors:
                steps.append(errors[0]["text"])
                label = h
            break
        if not steps:
            continue  # nothing rated: no sample
        samples.append(FirstErrorSample(f"prm800k-{row}", problem, steps, label, None,
                                        dict(source="prm800k", finish_reason=record["label"].get("finish_reason"))))
    return samples


def read_first_error_samples(path: str | Path, format: str = "auto", scores_field: str | None = None) -> list[FirstErrorSample]:
    """Read ProcessBench or PRM800K rows; ``format="auto"`` looks at the first row's fields."""
    if format == "auto":
        first = _records(Path(path))[:1]
        format = "prm800k" if first and "question" in first[0] and "label" in first[0] and isinstance(first[0]["label"], dict) else "processbench"
    if format == "processbench":
        return read_processbench(path, scores_field)
    if format == "prm800k":
        if scores_field is not None:
            raise ValueError("--scores-field applies to ProcessBench rows only")
        return read_prm800k(path)
    raise ValueError(f"unknown format {format!r}: use processbench, prm800k or auto")


# ----------------------------------------------------------------------------------------------------------
# Scoring with a critic
# ----------------------------------------------------------------------------------------------------------


def critic_values(critic, samples: Sequence[FirstErrorSample], prompt_format: str, separator: str):
    """``(prompt_values [B], step_values [B, S], num_steps [B])`` of a ``ProverCritic`` on the samples.

    The critic reads ``prompt_format.format(problem=...)`` and the steps joined by ``separator``; each step's
    value is read at its last character (explicit spans: a step's own text is never re-split)."""
    input_ids, prompt_ends, step_ends = [], [], []
    for sample in samples:
        pieces = [step + (separator if h < len(sample.steps) - 1 else "") for h, step in enumerate(sample.steps)]
        spans, position = [], 0
        for piece, step in zip(pieces, sample.steps):
            spans.append((position, position + len(step)))  # the value is read at the step's own last character
            position += len(piece)
        encoded = encode_with_step_ends(critic.tokenizer, prompt_format.format(problem=sample.problem), "".join(pieces),
                                        spans, sample=sample.id)
        input_ids.append(list(encoded.input_ids))
        prompt_ends.append(int(encoded.prompt_end))
        step_ends.append([int(e) for e in encoded.step_ends])
    scores = critic.score_sequences(input_ids, prompt_ends, step_ends)
    return scores.prompt_values.double(), scores.step_values.double(), scores.num_steps


def _pad_scores(samples: Sequence[FirstErrorSample]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s.steps) for s in samples)
    table = torch.zeros(len(samples), width, dtype=torch.float64)
    for i, s in enumerate(samples):
        table[i, : len(s.steps)] = torch.tensor(s.scores, dtype=torch.float64)
    return table, torch.tensor([len(s.steps) for s in samples])


def threshold_grid(start: float, stop: float, count: int) -> torch.Tensor:
    """``count`` evenly spaced thresholds from ``start`` to ``stop`` (both included), float64."""
    return torch.linspace(start, stop, count, dtype=torch.float64)


def evaluate(args, samples: Sequence[FirstErrorSample]) -> dict[str, Any]:
    """Score, predict and compute F1 (tuned or at a fixed threshold); returns the report dict."""
    if args.scores_field is not None:
        step_values, num_steps = _pad_scores(samples)
        prompt_values = torch.zeros(len(samples), dtype=torch.float64)
        if args.score == "progress":
            raise SystemExit("--score progress needs the critic's prompt value: use --critic, or precompute progress")
    elif args.critic is not None:
        critic = ProverCritic.from_pretrained(args.critic, format=args.critic_format, device=args.device)
        prompt_values, step_values, num_steps = critic_values(
            critic, samples, args.prompt_format, codecs.decode(args.separator, "unicode_escape"))
    else:
        raise SystemExit("verl-prm eval processbench: pass --critic PATH or --scores-field FIELD")
    scores = step_scores_of(prompt_values, step_values, num_steps, args.score, args.best_of_k)
    labels = torch.tensor([s.label for s in samples])
    report: dict[str, Any] = dict(samples=len(samples), score=args.score, best_of_k=args.best_of_k)
    if args.threshold is not None:
        threshold = float(args.threshold)
        report.update(threshold=threshold, tuned=False, **first_error_f1(predicted_first_error(scores, num_steps, threshold), labels))
        evaluated = torch.arange(len(samples))
    else:
        grid = threshold_grid(*(args.thresholds if args.thresholds is not None else
                                (0.0, 1.0, 101) if args.score == "values" else (-1.0, 1.0, 201)))
        tune, evaluated = holdout_split(len(samples), args.tune_fraction, args.seed, strata=labels >= 0)
        threshold, table = sweep_thresholds(scores[tune], num_steps[tune], labels[tune], grid)
        tuned = next(m for m in table if m["threshold"] == threshold)
        report.update(threshold=threshold, tuned=True, tune_samples=len(tune), tune_f1=tuned["f1"],
                      **first_error_f1(predicted_first_error(scores[evaluated], num_steps[evaluated], threshold), labels[evaluated]))
        report["eval_samples"] = len(evaluated)
    predicted = predicted_first_error(scores, num_steps, report["threshold"])
    report["_predictions"] = [
        dict(id=samples[i].id, label=samples[i].label, predicted=int(predicted[i]), evaluated=bool((evaluated == i).any()),
             scores=scores[i, : len(samples[i].steps)].tolist())
        for i in range(len(samples))
    ]
    return report

"""Test-time search on the word problems at equal generation budgets: majority vote, best-of-N ranked by an outcome
verifier (ORM) or by the PAV, and beam search on the PAV's ``Q + alpha * A`` (``verl_prm.search``).

Best-of-N and majority vote read the same N full samples per problem (the first N of one draw of ``max(N)``), so
their differences are the rankers' alone. A method's budget is the mean number of tokens it generated per problem;
its accuracy's standard error is over problems.

The ORM is a value head on the same frozen backbone, trained by the same trainer on the same rollouts, whose every
step is labelled with the rollout's outcome (:func:`outcome_labels`): it predicts the outcome from any prefix, and
best-of-N ranks by its value after the last step.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

__all__ = ["accuracy_summary", "majority_vote", "outcome_labels", "paired_difference", "write_outcome_labels"]


def majority_vote(answers: Sequence[Optional[int]]) -> Optional[int]:
    """The most frequent answer that is not None; ties go to the answer reached first; None when none parsed."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def accuracy_summary(correct: Sequence[float], tokens: Sequence[float]) -> dict:
    """Accuracy (the mean of ``correct`` over problems), its standard error ``sqrt(var / n)`` (sample variance,
    ddof 1), the mean generated tokens per problem, and each problem's outcome (``correct``, 0 or 1, in problem
    order: what a paired comparison of two methods reads)."""
    values = np.asarray(correct, dtype=float)
    n = values.size
    if n == 0:
        raise ValueError("accuracy_summary: no problems")
    if not np.isin(values, (0.0, 1.0)).all():
        raise ValueError(f"accuracy_summary: correct must hold 0 or 1 per problem, got {sorted(set(values.tolist()))[:5]}")
    stderr = float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"accuracy": float(values.mean()), "stderr": stderr, "problems": n,
            "tokens_per_problem": float(np.mean(tokens)), "correct": [int(v) for v in values]}


def paired_difference(first: Sequence[int], second: Sequence[int], *, resamples: int = 10000, seed: int = 0,
                      level: float = 0.95) -> dict:
    """Two methods' outcomes on the same problems (0/1 each, problem order): the accuracy difference
    ``mean(first) - mean(second)``, its percentile bootstrap interval at ``level`` (problems resampled with
    replacement, ``resamples`` times), and McNemar's exact two-sided p-value: with b problems only ``first``
    solves and c only ``second`` solves, ``p = min(1, 2 * P(X <= min(b, c)))`` for ``X ~ Binomial(b + c, 1/2)``
    (1 when b + c = 0)."""
    a, b_ = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if a.shape != b_.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_difference: two equal, non-empty lists of outcomes needed, got {a.shape} and {b_.shape}")
    if not (np.isin(a, (0.0, 1.0)).all() and np.isin(b_, (0.0, 1.0)).all()):
        raise ValueError("paired_difference: outcomes must be 0 or 1")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"paired_difference: resamples must be an integer >= 1, got {resamples!r}")
    if not (isinstance(level, float) and 0 < level < 1):
        raise ValueError(f"paired_difference: level must be a float in (0, 1), got {level!r}")
    only_first, only_second = int(((a == 1) & (b_ == 0)).sum()), int(((a == 0) & (b_ == 1)).sum())
    discordant = only_first + only_second
    tail = sum(math.comb(discordant, k) for k in range(min(only_first, only_second) + 1)) / 2 ** discordant
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, a.size, size=(resamples, a.size))
    differences = (a[picks] - b_[picks]).mean(axis=1)
    low, high = np.quantile(differences, [(1 - level) / 2, (1 + level) / 2])
    return {"difference": float(a.mean() - b_.mean()), "interval": [float(low), float(high)], "level": level,
            "only_first": only_first, "only_second": only_second,
            "mcnemar_p": 1.0 if discordant == 0 else float(min(1.0, 2 * tail))}


def outcome_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """The label rows of ``frame`` (``verl_prm.labeling.format``) relabelled for an outcome verifier: every step's
    value is the rollout's outcome, taken from data (``n_mc`` 0, no counts), and no prompt value. Rollouts of
    unknown outcome are an error."""
    unknown = frame["outcome"].isna()
    if unknown.any():
        first = frame[unknown].iloc[0]
        raise ValueError(f"outcome_labels: {int(unknown.sum())} rollouts have no outcome (first: prompt "
                         f"{first['prompt_index']}, rollout {first['rollout_index']}); label them with a scorer")
    out = frame.copy()
    steps = [len(ends) for ends in out["step_ends"]]
    out["q"] = [[float(o)] * h for o, h in zip(out["outcome"], steps)]
    out["n_success"] = [[0] * h for h in steps]
    out["n_mc"] = [[0] * h for h in steps]
    out["first_pit"] = -1
    out["prompt_value"] = float("nan")
    out["prompt_n_success"] = 0
    out["prompt_n_mc"] = 0
    out["source"] = "outcome"
    return out


def write_outcome_labels(labels: str | Path, out: str | Path) -> Path:
    """:func:`outcome_labels` of the label shards in ``labels`` written as one shard, ``out/outcome.parquet`` (the
    training data of an outcome verifier: ``verl-prm train --labels out``); returns its path."""
    import pyarrow.parquet as pq

    from verl_prm.labeling.format import read_labels, rows_to_table
    from verl_prm.labeling.inputs import plain_python

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frame = outcome_labels(read_labels(labels))
    path = out / "outcome.parquet"
    pq.write_table(rows_to_table([plain_python(r) for r in frame.to_dict(orient="records")]), path)
    return path


def sampled_answers(problems, sampler, n: int, seed: int) -> tuple[list[list], list[list[Optional[int]]]]:
    """``n`` full responses per problem from ``sampler`` (one draw) and their parsed answers."""
    from verl_prm.apps.word_problems.task import parse_answer
    from verl_prm.search.nodes import node_seed

    indices = list(range(len(problems)))
    nodes = sampler.sample_responses(indices, n, [node_seed(seed, "best_of_n", p) for p in indices])
    return nodes, [[parse_answer("".join(node.steps)) for node in group] for group in nodes]


def ranked_choices(nodes: Sequence[Sequence], critic, rank: str, n: int, best_of_k: int = 1) -> list[int]:
    """Per problem, the index among its first ``n`` samples that ``critic`` (a ``CachedCritic``) ranks best
    (``verl_prm.search.scoring.response_scores`` with ``rank``: ``orm`` or an aggregation of the step values)."""
    import torch

    from verl_prm.search.nodes import Compute
    from verl_prm.search.scoring import response_scores

    flat = [node for group in nodes for node in group[:n]]
    compute = {node.problem: Compute() for node in flat}
    prompt_values, step_values, num_steps = critic.prefix_values(flat, compute)
    scores = response_scores(prompt_values, step_values, num_steps, rank, "values", best_of_k)
    return [int(torch.argmax(scores[g * n:(g + 1) * n])) for g in range(len(nodes))]


BEST_OF_N_METHODS = ("majority_vote", "best_of_n_orm", "best_of_n_pav")
ROW_KEYS = ("method", "n", "accuracy", "stderr", "problems", "tokens_per_problem", "correct")


def check_rows(rows, *, source) -> list[dict]:
    """``rows`` as :func:`compare_at_budgets` writes them, or a ValueError naming ``source`` and the bad row."""
    if not isinstance(rows, list):
        raise ValueError(f"{source}: 'rows' is a {type(rows).__name__}, not a list of result rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or sorted(row) != sorted(ROW_KEYS):
            raise ValueError(f"{source}: row {i} is {row!r}, not an object with exactly the keys {list(ROW_KEYS)}")
        if row["method"] not in BEST_OF_N_METHODS + ("beam_pav",) or not isinstance(row["n"], int) or row["n"] < 1:
            raise ValueError(f"{source}: row {i} has method {row['method']!r} and N {row['n']!r}: expected one of "
                             f"{list(BEST_OF_N_METHODS) + ['beam_pav']} and a positive integer")
        if not all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in ROW_KEYS[2:6]):
            raise ValueError(f"{source}: row {i} ({row['method']} N={row['n']}) has a non-finite number: {row!r}")
        correct = row["correct"]
        if (not isinstance(correct, list) or len(correct) != row["problems"]
                or any(c not in (0, 1) or isinstance(c, bool) for c in correct)):
            raise ValueError(f"{source}: row {i} ({row['method']} N={row['n']}): 'correct' must list 0 or 1 for each "
                             f"of its {row['problems']} problems")
    return rows


def compare_at_budgets(problems, sampler, pav, orm, *, best_of_n: Sequence[int], beam_widths: Sequence[int],
                       samples_per_beam: int, alpha: float, best_of_k: int, pav_rank: str, max_steps: int,
                       seed: int = 0, finished: Sequence[dict] = (), on_row=None, log=print) -> list[dict]:
    """One row per (method, N): accuracy, its standard error over problems, tokens per problem. ``pav`` and
    ``orm``: ``CachedCritic`` of the two value heads; the problems' answers are ``problems[i].answer``.

    ``finished``: rows of an interrupted call with the same arguments, kept instead of recomputed (every method
    draws from its own seeded generator, so a row does not depend on which rows ran before it); the best-of-N
    rows are kept only all together, as they share one draw of samples. ``on_row(rows)`` is called after each
    new row with the rows so far (to save them)."""
    from verl_prm.apps.word_problems.task import parse_answer
    from verl_prm.search import BeamConfig, beam_search

    kept = {(r["method"], r["n"]): r for r in finished}
    truth = [p.answer for p in problems]
    rows = []

    def add(row: dict, new: bool) -> None:
        rows.append(row)
        shown = {key: value for key, value in row.items() if key != "correct"}  # 0/1 per problem: too long a line
        log(f"[word-problems] search: {row['method']} N={row['n']}: {shown}" + ("" if new else " (kept)"))
        if new and on_row is not None:
            on_row(list(rows))

    best_of_n_keys = [(method, n) for n in sorted(best_of_n) for method in BEST_OF_N_METHODS]
    if all(key in kept for key in best_of_n_keys):
        for key in best_of_n_keys:
            add(kept[key], new=False)
    else:
        log(f"[word-problems] search: sampling {max(best_of_n)} responses for each of {len(problems)} problems, "
            "then ranking them")
        nodes, answers = sampled_answers(problems, sampler, max(best_of_n), seed)
        for n in sorted(best_of_n):
            tokens = [sum(node.num_tokens for node in group[:n]) for group in nodes]
            picks = {"majority_vote": [majority_vote(a[:n]) for a in answers]}
            for name, critic, rank in (("best_of_n_orm", orm, "orm"), ("best_of_n_pav", pav, pav_rank)):
                chosen = ranked_choices(nodes, critic, rank, n)
                picks[name] = [a[c] for a, c in zip(answers, chosen)]
            for method, picked in picks.items():
                add({"method": method, "n": n,
                     **accuracy_summary([float(a == t) for a, t in zip(picked, truth)], tokens)}, new=True)
    for width in sorted(beam_widths):
        if ("beam_pav", width) in kept:
            add(kept[("beam_pav", width)], new=False)
            continue
        log(f"[word-problems] search: beam search of width {width} on {len(problems)} problems")
        config = BeamConfig(beam_width=width, samples_per_beam=samples_per_beam, alpha=alpha, best_of_k=best_of_k,
                            max_steps=max_steps, seed=seed)
        results = beam_search(list(range(len(problems))), sampler, pav, None, config)
        correct = [float(parse_answer("".join(r.node.steps)) == truth[r.problem]) for r in results]
        add({"method": "beam_pav", "n": width,
             **accuracy_summary(correct, [r.compute.generated_tokens for r in results])}, new=True)
    return rows


def markdown_table(rows: Sequence[dict]) -> str:
    """The rows as a markdown table: method, N, accuracy +- standard error, tokens per problem."""
    lines = ["| method | N | accuracy | tokens per problem |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['n']} | {r['accuracy']:.3f} +- {r['stderr']:.3f} | "
                     f"{r['tokens_per_problem']:.0f} |")
    return "\n".join(lines)

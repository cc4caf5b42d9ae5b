"""A held-out test of word-problem step critics that can tell: step AUROC on held-out problems with a bootstrap
interval over problems, against the task's own ground truth (``prefix_correct``: every step up to this one right,
by :mod:`verl_prm.apps.word_problems.check`) and against the Monte-Carlo label (docs/real_model.md, "A held-out
test that can tell").

    python -m studies.word_problems_pav --work-dir runs/wp --labels runs/wp/labels --eval-labels runs/wp_heldout \\
        --critic pav=runs/wp/pav --out runs/wp_heldout_eval \\
        --export-heldout docs/real_model/pav_heldout.jsonl \\
        --export-train-problems docs/real_model/pav_train_problems.txt

Inputs: ``--eval-labels``, label shards (``verl_prm.labeling.format``) of held-out problems whose prompts are the
recipe's verl chat prompts; ``--labels``, the shards the critics were trained on; ``--work-dir``, the recipe's work
directory, whose ``data/*.jsonl`` carry every problem's question and reference solution (``shots.jsonl`` aside:
its questions are the worked examples inside every prompt). A label row's problem is the one whose question its
prompt contains (none or several is an error naming the row). A held-out question among the training labels'
questions is an error: the test would be on training problems.

Every held-out step (the labels' spans; the prompt value is no step) is scored by each ``--critic`` (a ``verl-prm
train`` checkpoint, value_head or token_logprob format, or its output directory: the newest checkpoint) through
``verl_prm.critic.ProverCritic`` (``score_sequences`` on ``encode_with_step_ends`` of the labels' spans, as
``verl-prm train`` encodes them), raw values (no calibration map). Reported per critic, each AUROC with its
bootstrap interval over problems (``verl_prm.training.metrics.grouped_bootstrap_auroc``):

- ``prefix_correct``: the step AUROC against the program check;
- ``mc_label``: the step AUROC against the Monte-Carlo label, positive where ``q > 0.5`` (labelled steps only);
- ``prompt_value``: the critic's value of the bare prompt against the prompt's Monte-Carlo value (``> 0.5``), one
  per prompt value (``verl_prm.training.data.prompt_value_carriers``: a shard repeats it on every rollout).

Writes ``--out/metrics.json``, the held-out rows (one JSON object per step: ``problem``, ``step`` (1-based),
``score`` (the first critic's value after the step, or ``--export-critic``'s), ``prefix_correct``, ``mc_label``
(the Monte-Carlo rate; null where the step is not labelled)) and the training problems' questions, one a line.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd

from verl_prm.apps.word_problems.check import check_steps
from verl_prm.cli_types import finite_float
from verl_prm.labeling.format import read_labels
from verl_prm.training.data import prompt_value_carriers, with_origin
from verl_prm.training.metrics import grouped_bootstrap_auroc

MC_POSITIVE = 0.5  # a step's Monte-Carlo label is positive when q > MC_POSITIVE
NAME = re.compile(r"[\w.-]+")


def read_problems(work_dir: Path) -> dict[str, str]:
    """question -> reference solution of every problem in ``work_dir/data/*.jsonl`` except ``shots.jsonl`` (the
    worked examples every prompt holds: their questions are in every prompt, never the one it asks)."""
    files = sorted(path for path in (work_dir / "data").glob("*.jsonl") if path.name != "shots.jsonl")
    if not files:
        raise FileNotFoundError(f"no problem files {work_dir / 'data'}/*.jsonl: pass the word-problem recipe's "
                                "--work-dir (its data stage writes them)")
    problems: dict[str, str] = {}
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or "question" not in record or "solution" not in record:
                raise ValueError(f"{path} line {number} has no question and solution: not a recipe problem file")
            question, solution = record["question"], record["solution"]
            if problems.setdefault(question, solution) != solution:
                raise ValueError(f"{path} line {number}: the question {question!r} appears with two solutions")
    return problems


def row_name(row) -> str:
    return (f"label shard {row.shard} row {row.shard_row} (prompt_index={row.prompt_index}, "
            f"rollout_index={row.rollout_index})")


def match_questions(frame: pd.DataFrame, problems: dict[str, str], what: str) -> list[str]:
    """The question of each label row of ``frame``: the one problem question its prompt contains; none or
    several is a ValueError naming the row."""
    found: dict[str, list[str]] = {}
    questions = []
    for row in frame.itertuples(index=False):
        if row.prompt not in found:
            found[row.prompt] = [question for question in problems if question in row.prompt]
        matches = found[row.prompt]
        if len(matches) != 1:
            which = "no problem's question" if not matches else f"{len(matches)} problems' questions ({matches[:3]})"
            raise ValueError(f"{what} {row_name(row)}: its prompt holds {which} of the recipe's data/*.jsonl; the "
                             "labels must be of the recipe's problems (pass its --work-dir)")
        questions.append(matches[0])
    return questions


def step_rows(frame: pd.DataFrame, questions: Sequence[str], problems: dict[str, str]) -> pd.DataFrame:
    """One row per held-out step: the problem, the rollout, the step (1-based), the program check and the
    Monte-Carlo label (NaN: not labelled)."""
    rows = []
    for index, (row, question) in enumerate(zip(frame.itertuples(index=False), questions)):
        texts = [row.response[a:b] for a, b in zip(row.step_starts, row.step_ends)]
        check = check_steps(problems[question], texts)
        for h, q in enumerate(row.q):
            rows.append({"problem": question, "rollout": index, "step": h + 1, "step_right": check.step_right[h],
                         "prefix_correct": check.prefix_correct[h], "mc_label": float(q)})
    return pd.DataFrame(rows, columns=["problem", "rollout", "step", "step_right", "prefix_correct", "mc_label"])


def resolve_critic(path: Path) -> Path:
    """A checkpoint directory as given, or the newest intact checkpoint of a ``verl-prm train`` output directory."""
    from verl_prm.training.resume import latest_checkpoint

    if (path / "config.json").is_file():
        return path
    checkpoint = latest_checkpoint(path) if path.is_dir() else None
    if checkpoint is None:
        raise FileNotFoundError(f"--critic {path}: neither a checkpoint directory (config.json) nor a verl-prm train "
                                "output directory with an intact checkpoint-* in it")
    return checkpoint


def critic_values(path: Path, frame: pd.DataFrame, device: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The critic's raw values after every step of every row (flat, in row and step order) and of every row's
    bare prompt, read at the labels' spans (``encode_with_step_ends``, as ``verl-prm train`` encodes them)."""
    from verl_prm.critic import ProverCritic
    from verl_prm.critic.token_logprob_head import native_format
    from verl_prm.steps import encode_with_step_ends

    critic = ProverCritic.from_pretrained(str(path), format=native_format(path), device=device,
                                          calibration="none")
    ids, prompt_ends, step_ends = [], [], []
    for row in frame.itertuples(index=False):
        encoded = encode_with_step_ends(critic.tokenizer, row.prompt, row.response,
                                        list(zip(row.step_starts, row.step_ends)), sample=row_name(row))
        ids.append([int(t) for t in encoded.input_ids])
        prompt_ends.append(int(encoded.prompt_end))
        step_ends.append([int(e) for e in encoded.step_ends])
    scores = critic.score_sequences(ids, prompt_ends, step_ends)
    steps = [scores.step_values[b, : len(ends)].numpy() for b, ends in enumerate(step_ends)]
    return (np.concatenate(steps).astype(np.float64) if steps else np.zeros(0),
            scores.prompt_values.numpy().astype(np.float64))


def interval(scores, labels, groups, args) -> dict:
    """AUROC with its bootstrap interval over problems, or NaN with the reason where the data give none (one
    class, too few problems with both; the knobs are checked by the parser)."""
    out = {"items": int(len(labels)), "positives": int(np.sum(labels))}
    try:
        result = grouped_bootstrap_auroc(scores, labels, groups, resamples=args.resamples, seed=args.seed,
                                         level=args.level)
    except ValueError as error:
        return {**out, "auroc": math.nan, "low": math.nan, "high": math.nan, "note": str(error)}
    return {**out, "auroc": result.auroc, "low": result.low, "high": result.high,
            "skipped_resamples": result.skipped}


def step_metrics(steps: pd.DataFrame, values: np.ndarray, args) -> dict:
    """The two step AUROCs of one critic's ``values`` (one per row of ``steps``): against ``prefix_correct`` on
    every step, against the Monte-Carlo label (``q > MC_POSITIVE``) on the labelled steps."""
    labelled = steps["mc_label"].notna().to_numpy()
    mc = steps["mc_label"].to_numpy()
    return {
        "prefix_correct": interval(values, steps["prefix_correct"].to_numpy(), steps["problem"].to_numpy(), args),
        "mc_label": interval(values[labelled], mc[labelled] > MC_POSITIVE, steps["problem"].to_numpy()[labelled],
                             args),
    }


def critic_metrics(steps: pd.DataFrame, values: np.ndarray, prompts: pd.DataFrame, prompt_values: np.ndarray,
                   args) -> dict:
    """The three AUROCs of one critic (module docstring)."""
    return {
        **step_metrics(steps, values, args),
        "prompt_value": interval(prompt_values, prompts["prompt_value"].to_numpy() > MC_POSITIVE,
                                 prompts["problem"].to_numpy(), args),
    }


def parse_critics(values: Sequence[str]) -> dict[str, Path]:
    """``NAME=PATH`` or ``PATH`` (named by its directory) -> {name: path}; a name given twice is an error."""
    critics: dict[str, Path] = {}
    for value in values:
        name, _, path = value.partition("=")
        if not (path and NAME.fullmatch(name)):
            name, path = Path(value).name, value
        if name in critics:
            raise ValueError(f"--critic: the name {name!r} is given twice; name each critic (NAME=PATH)")
        critics[name] = Path(path)
    return critics


def json_safe(value):
    """NaN -> None (JSON has no NaN), recursively; numpy scalars -> Python."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    return None if isinstance(value, float) and math.isnan(value) else value


def read_splits(args) -> tuple[pd.DataFrame, pd.DataFrame, list[str], list[str], dict[str, str]]:
    """The training label rows, the held-out label rows (both with their ``shard`` and ``shard_row``), the
    held-out rows' questions, the training questions (in order of first appearance) and the problems; refuses a
    held-out question that is a training question."""
    problems = read_problems(args.work_dir)
    train = with_origin(read_labels(args.labels), args.labels)
    train_questions = list(dict.fromkeys(match_questions(train, problems, "--labels")))
    held_out = with_origin(read_labels(args.eval_labels), args.eval_labels)
    questions = match_questions(held_out, problems, "--eval-labels")
    shared = sorted(set(questions) & set(train_questions))
    if shared:
        raise ValueError(f"{len(shared)} of the {len(set(questions))} held-out problems are also training problems "
                         f"(--labels), e.g. {shared[0]!r}: the test would be on training problems; label held-out "
                         "problems the critics never saw")
    return train, held_out, questions, train_questions, problems


def read_held_out(args) -> tuple[pd.DataFrame, list[str], list[str], dict[str, str]]:
    """:func:`read_splits` without the training rows."""
    _, held_out, questions, train_questions, problems = read_splits(args)
    return held_out, questions, train_questions, problems


class HeldOut(NamedTuple):
    """The held-out label rows, one row per step (:func:`step_rows`), the rows that carry a problem's prompt value
    (once per problem) with those values, the counts, and the training questions."""

    rows: pd.DataFrame
    steps: pd.DataFrame
    carriers: np.ndarray
    prompts: pd.DataFrame
    counts: dict
    train_questions: list[str]


def held_out_steps(args) -> HeldOut:
    """What every critic is judged on (:class:`HeldOut`); refuses held-out problems among the training ones."""
    held_out, questions, train_questions, problems = read_held_out(args)
    steps = step_rows(held_out, questions, problems)
    # one prompt value per problem: the first row that carries one (prompt_value_carriers: once per prompt value)
    carriers = prompt_value_carriers(held_out) & held_out["prompt_value"].notna().to_numpy()
    carriers &= ~pd.Series(questions).where(carriers).duplicated().to_numpy()
    prompts = pd.DataFrame({"problem": np.asarray(questions)[carriers],
                            "prompt_value": held_out["prompt_value"].to_numpy()[carriers]})
    counts = {"problems": len(set(questions)), "rollouts": len(held_out), "steps": len(steps),
              "prefix_correct_positives": int(steps["prefix_correct"].sum()),
              "step_right": int(steps["step_right"].sum()), "mc_labelled_steps": int(steps["mc_label"].notna().sum()),
              "mc_positives": int((steps["mc_label"] > MC_POSITIVE).sum()), "prompt_values": len(prompts),
              "training_problems": len(train_questions)}
    return HeldOut(held_out, steps, carriers, prompts, counts, train_questions)


def run(args) -> dict:
    """Score the held-out steps with every critic, write metrics.json and the exports; returns the metrics."""
    critics = parse_critics(args.critic)
    export_critic = args.export_critic or next(iter(critics))
    if export_critic not in critics:
        raise ValueError(f"--export-critic {export_critic!r} is none of the --critic names {sorted(critics)}")
    judged = held_out_steps(args)
    held_out, steps, carriers, prompts = judged.rows, judged.steps, judged.carriers, judged.prompts
    counts, train_questions = judged.counts, judged.train_questions
    results, exported = {}, None
    for name, path in critics.items():
        checkpoint = resolve_critic(path)
        values, prompt_values = critic_values(checkpoint, held_out, args.device)
        if len(values) != len(steps):  # both follow the labels' spans; a mismatch would misalign every row
            raise RuntimeError(f"critic {name}: {len(values)} step values for {len(steps)} held-out steps")
        results[name] = {"checkpoint": str(checkpoint), **critic_metrics(steps, values, prompts,
                                                                         prompt_values[carriers], args)}
        if name == export_critic:
            exported = values
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout_path = Path(args.export_heldout or out / "pav_heldout.jsonl")
    train_path = Path(args.export_train_problems or out / "pav_train_problems.txt")
    for path in (heldout_path, train_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    with open(heldout_path, "w") as f:
        for row, score in zip(steps.itertuples(index=False), exported):
            f.write(json.dumps(json_safe({"problem": row.problem, "step": int(row.step), "score": float(score),
                                          "prefix_correct": bool(row.prefix_correct),
                                          "mc_label": row.mc_label})) + "\n")
    train_path.write_text("".join(question + "\n" for question in train_questions))
    metrics = {"eval_labels": [str(p) for p in args.eval_labels], "labels": [str(p) for p in args.labels],
               "work_dir": str(args.work_dir), "mc_positive": f"q > {MC_POSITIVE}",
               "bootstrap": {"unit": "problem", "resamples": args.resamples, "seed": args.seed, "level": args.level},
               "counts": counts, "critics": results,
               "exports": {"heldout": str(heldout_path), "critic": export_critic, "train_problems": str(train_path)}}
    (out / "metrics.json").write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    return metrics


def at_least_two(text: str) -> int:
    """An argparse ``type``: an integer >= 2 (a bad bootstrap knob must not turn every interval into a note)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.word_problems_pav", description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, required=True, help="the word-problem recipe's work dir (data/*.jsonl)")
    p.add_argument("--labels", type=Path, nargs="+", required=True, help="the critics' training label shards/dirs")
    p.add_argument("--eval-labels", type=Path, nargs="+", required=True, help="held-out label shards/dirs")
    p.add_argument("--critic", action="append", required=True,
                   help="NAME=PATH or PATH: a value_head checkpoint or a verl-prm train output dir (repeatable)")
    p.add_argument("--out", type=Path, required=True, help="writes metrics.json (and the exports by default)")
    p.add_argument("--export-heldout", type=Path, default=None, help="default OUT/pav_heldout.jsonl")
    p.add_argument("--export-train-problems", type=Path, default=None, help="default OUT/pav_train_problems.txt")
    p.add_argument("--export-critic", default=None, help="the critic whose scores the held-out export carries "
                   "(default: the first --critic)")
    p.add_argument("--resamples", type=at_least_two, default=2000, help="bootstrap resamples of the problems")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    p.add_argument("--level", type=finite_float(0.0, 1.0, low_open=True, high_open=True), default=0.95)
    p.add_argument("--device", default=None, help="the critics' device (default: CUDA when available, else CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    metrics = run(args)
    for name, result in metrics["critics"].items():
        for label in ("prefix_correct", "mc_label", "prompt_value"):
            r = result[label]
            print(f"{name}: {label}: AUROC {r['auroc']} [{r['low']}, {r['high']}] ({r['items']} items, "
                  f"{r['positives']} positive)")
    print(json.dumps(metrics["counts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

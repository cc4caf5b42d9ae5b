"""Converters from public step-labelled data sets into the label format of :mod:`verl_prm.labeling.format`.

**Math-Shepherd** (``input`` with a "ки" tag after each step, ``label`` with "+" or "-" in place of each tag,
``task``). The question is the text before the first "Step 1:"; each step is the text between tags, stripped,
and the response is the steps joined by "\\n" (each "\\n" belongs to the step it ends, as in
:mod:`verl_prm.steps`). Mapping: "+" -> q = 1, "-" -> q = 0, with ``n_mc = 0`` (the
counts are not published). Math-Shepherd's labels are *hard* Monte-Carlo estimates: "+" iff some completion of
the prefix reached the answer, so "-" means zero successes, the same "falls to 0" as our first-pit strategy;
its q is 1[Q > 0], not Q. ``first_pit`` = first "-" step; ``outcome`` = the last step's label (Math-Shepherd
labels the final step by the correctness of the answer); ``ground_truth`` is not in the rows ("").

**PRM800K** (``question.problem``, ``question.ground_truth_answer``, ``label.steps[*]`` with rated
``completions``, ``chosen_completion``, ``human_completion``, ``label.finish_reason``). The trajectory follows
the chosen completion of each step; where none was chosen it takes the human completion if there is one
(human steps carry no rating and count as correct: q = 1), else the first completion rated -1 (the error the
labeller found), else it ends (the labeller gave up). Ratings map by PRM800K's convention that 0 ("neutral")
is acceptable: **1 and 0 -> q = 1, -1 -> q = 0**. The trajectory **ends at its first -1 step** (first_pit):
labellers stop there, and under the value reading a pit has Q = 0 for every later step anyway. With
``alternatives=True`` each rated, not chosen completion also becomes a row: the trajectory's earlier steps plus
that completion as the last step. Steps are joined by "\\n" (PRM800K's generations write one step per line).
``outcome`` and ``score`` are NaN (not judged by a verifier), ``finished`` = finish_reason == "solution".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator
from verl_prm.labeling.inputs import read_jsonl_records

__all__ = ["convert_math_shepherd", "convert_prm800k", "read_jsonl", "PRM800K_RATING_TO_Q"]

TAG = "ки"
PRM800K_RATING_TO_Q = {1: 1.0, 0: 1.0, -1: 0.0}


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """The records of a jsonl file; a line that is not UTF-8 or not JSON raises ValueError naming file and line."""
    for _, record in read_jsonl_records(path):
        yield record


def _row(index, rollout, data_source, prompt, ground_truth, steps, q, first_pit, outcome, finished, strategy, delimiter):
    # The delimiter belongs to the step it ends (the convention of verl_prm.steps), so the spans tile the text.
    response = delimiter.join(steps)
    starts, ends, position = [], [], 0
    for h, step in enumerate(steps):
        starts.append(position)
        position += len(step) + (len(delimiter) if h < len(steps) - 1 else 0)
        ends.append(position)
    return dict(
        prompt_index=int(index), rollout_index=int(rollout), data_source=data_source, prompt=prompt,
        ground_truth=ground_truth, response=response, step_starts=starts, step_ends=ends, q=list(q),
        n_success=[0] * len(steps), n_mc=[0] * len(steps), first_pit=int(first_pit), prompt_value=math.nan,
        prompt_n_success=0, prompt_n_mc=0, outcome=float(outcome), score=math.nan, finished=bool(finished),
        strategy=strategy, source=strategy,
    )


def convert_math_shepherd(rows: Iterable[dict], *, prompt_format: str = "{question}\n") -> list[dict]:
    """Math-Shepherd rows -> label rows (module docstring). Raises ValueError naming the row on bad input."""
    out = []
    for index, record in enumerate(rows):
        where = f"Math-Shepherd row {index}"
        if not {"input", "label"} <= set(record):
            raise ValueError(f"{where}: expected fields 'input' and 'label', got {sorted(record)}")
        text, labelled = record["input"], record["label"]
        parts = text.split(TAG)
        if len(parts) < 2:
            raise ValueError(f"{where}: no '{TAG}' step tag in 'input'")
        signs, position = [], 0
        for part in parts[:-1]:
            if labelled[position : position + len(part)] != part or position + len(part) >= len(labelled):
                raise ValueError(f"{where}: 'label' does not match 'input' with its tags replaced by +/-")
            position += len(part)
            sign = labelled[position]
            if sign not in "+-":
                raise ValueError(f"{where}: expected '+' or '-' in 'label' at a tag, found {sign!r}")
            signs.append(sign)
            position += 1
        if labelled[position:] != parts[-1]:
            raise ValueError(f"{where}: 'label' does not match 'input' after the last tag")
        start = parts[0].find("Step 1:")
        if start < 0:
            raise ValueError(f"{where}: cannot split question from steps: no 'Step 1:' before the first tag")
        question = parts[0][:start].strip()
        steps = [parts[0][start:].strip()] + [part.strip() for part in parts[1:-1]]
        if any(not step for step in steps):
            raise ValueError(f"{where}: an empty step between two '{TAG}' tags")
        q = [1.0 if sign == "+" else 0.0 for sign in signs]
        first_pit = q.index(0.0) if 0.0 in q else -1
        task = record.get("task", "unknown")
        out.append(_row(index, 0, f"math_shepherd/{task}", prompt_format.format(question=question), "", steps, q,
                        first_pit, q[-1], True, "math_shepherd", "\n"))
    return out


def convert_prm800k(rows: Iterable[dict], *, prompt_format: str = "{question}\n", alternatives: bool = False) -> list[dict]:
    """PRM800K rows -> label rows (module docstring). Raises ValueError naming the row on bad input."""
    out = []
    for index, record in enumerate(rows):
        where = f"PRM800K row {index}"
        try:
            question = record["question"]["problem"]
            steps_in = record["label"]["steps"]
            finish_reason = record["label"].get("finish_reason")
        except (KeyError, TypeError) as error:
            raise ValueError(f"{where}: expected question.problem and label.steps ({error!r})") from None
        ground_truth = record["question"].get("ground_truth_answer")
        prompt = prompt_format.format(question=question)
        texts: list[str] = []
        q: list[float] = []
        branches: list[tuple[list[str], list[float]]] = []
        first_pit = -1
        for h, step in enumerate(steps_in or []):
            completions = step.get("completions") or []
            chosen = step.get("chosen_completion")
            human = step.get("human_completion")
            if alternatives:
                for c, completion in enumerate(completions):
                    if c != chosen and completion.get("rating") in PRM800K_RATING_TO_Q:
                        branches.append((texts + [completion["text"]], q + [PRM800K_RATING_TO_Q[completion["rating"]]]))
            if chosen is not None:
                if not 0 <= chosen < len(completions):
                    raise ValueError(f"{where}: step {h} chosen_completion={chosen} but {len(completions)} completions")
                pick = completions[chosen]
                rating = pick.get("rating")
                if rating not in PRM800K_RATING_TO_Q:
                    raise ValueError(f"{where}: step {h} chosen completion has rating {rating!r}, expected -1, 0 or 1")
                texts.append(pick["text"])
                q.append(PRM800K_RATING_TO_Q[rating])
            elif human is not None:
                texts.append(human["text"])
                q.append(1.0)
            else:
                errors = [c for c in completions if c.get("rating") == -1]
                if errors:
                    texts.append(errors[0]["text"])
                    q.append(0.0)
                break  # the labeller found an error or gave up: the trajectory ends here
            if q[-1] == 0.0:
                break
        if 0.0 in q:
            first_pit = q.index(0.0)
        if not texts:
            continue  # nothing rated (an empty task): no row to write
        gt = "" if ground_truth is None else str(ground_truth)
        out.append(_row(index, 0, "prm800k", prompt, gt, texts, q, first_pit, math.nan, finish_reason == "solution",
                        "prm800k", "\n"))
        for b, (branch_texts, branch_q) in enumerate(branches, start=1):
            pit = branch_q.index(0.0) if 0.0 in branch_q else -1
            out.append(_row(index, b, "prm800k", prompt, gt, branch_texts, branch_q, pit, math.nan, False,
                            "prm800k", "\n"))
    return out

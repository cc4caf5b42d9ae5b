"""The word-problem recipe (verl_prm.apps.word_problems): the problems' answers against a reading of their text,
the answer parser, the reward, the search's pure helpers, and every stage wired end to end on a tiny random model
(the recipe's settings, resume and refusal of other settings)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest

from verl_prm.apps.word_problems.score import compute_score
from verl_prm.apps.word_problems.search import accuracy_summary, majority_vote, outcome_labels
from verl_prm.apps.word_problems.task import (STEP_DELIMITER, TaskConfig, generate_problems, parse_answer,
                                              prompt_messages)

# What each sentence of a question does to the count, read from the text alone (not from the generator's tables).
CHANGES = [(re.compile(r"(?:buys|finds|gets) (\d+) more"), lambda v, k: v + k),
           (re.compile(r"(?:gives away|loses|gives) (\d+)"), lambda v, k: v - k),
           (re.compile(r"doubles"), lambda v, k: 2 * v)]


def answer_from_text(question: str) -> tuple[int, int, list[int]]:
    """(answer, number of changes, the count after each change) of a question, by reading its sentences."""
    sentences = [s.strip() for s in question.split(".") if s.strip()]
    value = int(re.fullmatch(r"\w+ has (\d+) \w+", sentences[0]).group(1))
    counts = []
    for sentence in sentences[1:-1]:
        matched = [(p.search(sentence), f) for p, f in CHANGES if p.search(sentence)]
        assert len(matched) == 1, sentence
        match, change = matched[0]
        value = change(value, int(match.group(1)) if match.groups() else 0)
        counts.append(value)
    assert sentences[-1].startswith("How many")
    return value, len(counts), counts


@pytest.mark.parametrize("config", [TaskConfig(), TaskConfig(min_steps=1, max_steps=6, max_start=5,
                                                              operations=("add", "sub", "mul"))])
def test_answers_equal_the_text_read_step_by_step(config):
    problems = generate_problems(300, config, seed=5)
    steps_seen = set()
    for p in problems:
        answer, steps, counts = answer_from_text(p.question)
        assert p.answer == answer and config.min_steps <= steps <= config.max_steps
        assert min(counts) >= 0
        steps_seen.add(steps)
        # the reference solution: one line per change, each "a op b = c." true and chained, then the answer line
        lines = p.solution().split(STEP_DELIMITER)
        assert len(lines) == steps + 1 and lines[-1] == f"The answer is {answer}."
        previous = int(re.fullmatch(r"\w+ has (\d+) .*", p.question.split(".")[0]).group(1))
        for line, count in zip(lines[:-1], counts):
            a, op, b, c = re.search(r"(\d+) ([-+*]) (\d+) = (\d+)\.$", line).groups()
            assert int(a) == previous and int(c) == count == {"+": int(a) + int(b), "-": int(a) - int(b),
                                                               "*": int(a) * int(b)}[op]
            previous = count
        assert parse_answer(p.solution()) == answer and compute_score("word_problems", p.solution(), str(answer)) == 1
    assert steps_seen == set(range(config.min_steps, config.max_steps + 1))


def test_problems_are_distinct_seeded_and_respect_exclude():
    first = generate_problems(50, seed=3)
    assert [p.question for p in first] == [p.question for p in generate_problems(50, seed=3)]
    assert len({p.question for p in first}) == 50
    other = generate_problems(50, seed=3, exclude=[p.question for p in first[:10]])
    assert not {p.question for p in first[:10]} & {p.question for p in other}
    with pytest.raises(ValueError, match="could not draw 500 distinct problems"):
        generate_problems(500, TaskConfig(min_steps=1, max_steps=1, max_start=2, max_amount=1,
                                          operations=("mul",)), seed=0)
    with pytest.raises(ValueError, match="unknown operations"):
        TaskConfig(operations=("div",))


@pytest.mark.parametrize("text, expected", [
    ("He buys 2 more: 3 + 2 = 5.\nThe answer is 5.", 5),
    ("the answer is -3", -3),
    ("The answer is 1,234.", 1234),
    ("The answer is $ 7.", 7),
    ("The answer is 4.\nThe answer is 9.", 4),  # the first answer line counts
    ("So 3 + 4 = 7.", None),
    ("The answer is x.", None),
    ("", None),
])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected
    assert compute_score("word_problems", text, "5") == float(expected == 5)


def test_score_names_a_ground_truth_that_is_no_integer():
    with pytest.raises(ValueError, match="ground truth 'five'"):
        compute_score("word_problems", "The answer is 5.", "five")


def test_prompt_messages_put_the_shots_before_the_question():
    shots = generate_problems(2, seed=9)
    problem = generate_problems(1, seed=10)[0]
    chat = prompt_messages(problem, shots)
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert chat[2]["content"] == shots[0].solution() and chat[-1]["content"] == problem.question
    assert [m["role"] for m in prompt_messages(problem)] == ["system", "user"]


def test_majority_vote_and_accuracy_summary():
    assert majority_vote([3, None, 4, 4, 3]) == 3  # tie: the answer reached first
    assert majority_vote([None, 5, 6, 6]) == 6
    assert majority_vote([None, None]) is None
    correct = [1.0, 0.0, 1.0, 1.0]
    summary = accuracy_summary(correct, [10, 20, 30, 40])
    # standard error of the mean: sqrt(sum (x - mean)^2 / (n - 1) / n)
    mean = 0.75
    assert summary["accuracy"] == mean and summary["tokens_per_problem"] == 25
    assert math.isclose(summary["stderr"], math.sqrt(sum((x - mean) ** 2 for x in correct) / 3 / 4))
    assert summary["correct"] == [1, 0, 1, 1]
    with pytest.raises(ValueError, match="0 or 1 per problem"):
        accuracy_summary([0.5, 1.0], [1, 2])


def test_paired_difference_is_mcnemars_exact_test_with_a_bootstrap_interval():
    from verl_prm.apps.word_problems.search import paired_difference

    # 10 problems only the first solves, 2 only the second, 8 both, 20 neither. McNemar's exact test (Fagerland,
    # Lydersen & Laake 2013, BMC Med Res Methodol 13:91): p = 2 * P(Binomial(12, 1/2) <= 2) = 2 * 79 / 4096
    first = [1] * 10 + [0] * 2 + [1] * 8 + [0] * 20
    second = [0] * 10 + [1] * 2 + [1] * 8 + [0] * 20
    result = paired_difference(first, second, resamples=4000, seed=1)
    assert (result["only_first"], result["only_second"]) == (10, 2)
    assert result["mcnemar_p"] == pytest.approx(2 * 79 / 4096)
    assert result["difference"] == pytest.approx(8 / 40)
    # the bootstrap interval of a mean difference of paired outcomes covers the difference, about +- 2 s.e.
    d = [a - b for a, b in zip(first, second)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    low, high = result["interval"]
    assert low < mean < high and high - low == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert paired_difference([1, 0], [1, 0])["mcnemar_p"] == 1.0
    with pytest.raises(ValueError, match="two equal, non-empty lists"):
        paired_difference([1, 0], [1])


def test_outcome_labels_put_the_outcome_on_every_step():
    frame = pd.DataFrame({"prompt_index": [0, 1], "rollout_index": [0, 0], "outcome": [1.0, 0.0],
                          "step_ends": [[3, 7], [5]], "q": [[0.5, 1.0], [0.25]], "n_success": [[1, 2], [1]],
                          "n_mc": [[2, 2], [4]], "first_pit": [-1, -1], "prompt_value": [0.5, 0.5],
                          "prompt_n_success": [1, 1], "prompt_n_mc": [2, 2], "source": ["p", "p"]})
    out = outcome_labels(frame)
    assert out["q"].tolist() == [[1.0, 1.0], [0.0]] and out["n_mc"].tolist() == [[0, 0], [0]]
    assert np.isnan(out["prompt_value"]).all() and frame["q"].tolist() == [[0.5, 1.0], [0.25]]
    with pytest.raises(ValueError, match="1 rollouts have no outcome .first: prompt 1, rollout 0"):
        outcome_labels(frame.assign(outcome=[1.0, float("nan")]))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Every stage on a tiny random Qwen2 with a tokenizer trained on the problems' text."""
    from verl_prm.apps.arithmetic.model import SFTConfig
    from verl_prm.apps.word_problems import pipeline
    from tiny_model import write_tiny_causal_lm

    root = tmp_path_factory.mktemp("word_problems")
    texts = [p.question + "\n" + p.solution() for p in generate_problems(200, seed=7)]
    base = write_tiny_causal_lm(texts, root / "tiny", vocab_size=400, hidden_size=32)
    config = pipeline.RecipeConfig(
        base=str(base), shots=1, sft_problems=16, sft=SFTConfig(steps=2, batch_size=2, lr=1e-3, warmup_steps=1),
        measure_problems=4, test_problems=8, max_new_tokens=16, label_problems=10, n_cov=2, n_mc=2,
        label_shard_size=5, search_problems=4, best_of_n=(1, 2), beam_widths=(1, 2), pav_steps=3, pav_l2=0.5)
    lines: list[str] = []
    records = pipeline.run(config, root / "work", progress=False, log=lines.append)
    return pipeline, config, root / "work", records, lines


def test_every_stage_on_a_tiny_model(tiny_run, assert_umask_modes):
    from verl_prm.labeling.format import read_labels
    from verl_prm.labeling.inputs import read_prompts

    pipeline, config, work, records, _ = tiny_run
    for written in ("policy", *(c.relative_to(work) for c in work.glob("pav/checkpoint-*"))):  # SFT, verl-prm train
        assert_umask_modes(work / written)
    assert list(work.glob("pav/checkpoint-*"))
    assert list(records) == list(pipeline.STAGES)
    splits = pipeline.split_problems(config)
    questions = [{p.question for p in problems} for problems in splits.values()]
    assert sum(map(len, questions)) == len(set().union(*questions))  # no question in two splits
    items = read_prompts(str(work / "data" / "label.parquet"))
    assert [item.ground_truth for item in items] == [str(p.answer) for p in splits["label"]]
    assert items[0].prompt[-1]["content"] == splits["label"][0].question and len(items[0].prompt) == 4  # 1 shot
    labels = read_labels(work / "labels")
    assert sorted(labels["prompt_index"]) == sorted(list(range(10)) * 2)
    orm = read_labels(work / "orm" / "outcome_labels")
    assert [list(q) for q in orm["q"]] == [[o] * len(e) for o, e in zip(labels["outcome"], labels["step_ends"])]
    assert records["pav"]["outputs"]["training"]["head_l2"] == records["orm"]["outputs"]["training"]["head_l2"] == 0.5
    measured = records["measure"]["outputs"]
    assert set(measured) == {"base_zero_shot", "base_few_shot", "policy"}
    assert all(m["problems"] == 4 and m["generated_tokens"] > 0 for m in measured.values())
    rows = json.loads((work / "search" / "results.json").read_text())
    assert [(r["method"], r["n"]) for r in rows] == [
        (m, n) for n in (1, 2) for m in ("majority_vote", "best_of_n_orm", "best_of_n_pav")] + [
        ("beam_pav", 1), ("beam_pav", 2)]
    by = {(r["method"], r["n"]): r for r in rows}
    # best-of-N and the vote read the same samples: N=2 costs twice N=1 (16 tokens each, none ends early here)
    assert by["majority_vote", 2]["tokens_per_problem"] == by["best_of_n_pav", 2]["tokens_per_problem"]
    assert all(r["problems"] == 4 and 0 <= r["accuracy"] <= 1 for r in rows)


def test_a_rerun_skips_complete_stages_and_refuses_other_settings(tiny_run):
    from dataclasses import replace

    pipeline, config, work, _, _ = tiny_run
    lines: list[str] = []
    pipeline.run(config, work, ["search"], progress=False, log=lines.append)
    # the search reads every stage but the measurement
    assert [line.split(":")[0] for line in lines] == [f"[word-problems] {name}" for name in pipeline.STAGES
                                                      if name != "measure"]
    assert all("complete, skipped" in line for line in lines)
    with pytest.raises(ValueError, match=r"labels holds a completed stage made with other settings .*n\[1\]: 2 -> 3"):
        pipeline.run(replace(config, n_mc=3), work, ["label"], progress=False, log=lines.append)
    with pytest.raises(ValueError, match="unknown stages"):
        pipeline.run(config, work, ["rl"], progress=False)
    with pytest.raises(ValueError, match=r"pav_l2 \(--pav-l2\) must be >= 0 \(a finite number\), got nan"):
        replace(config, pav_l2=float("nan"))
    args = pipeline.recipe_parser().parse_args(["--work-dir", str(work), "--pav-l2", "3"])
    assert pipeline.config_from_args(args).pav_l2 == 3.0
    with pytest.raises(SystemExit):  # argparse: "must be >= 0 (a finite number)"
        pipeline.recipe_parser().parse_args(["--work-dir", str(work), "--pav-l2", "nan"])


def test_an_interrupted_search_keeps_its_rows_and_recomputes_only_the_rest(tiny_run, tmp_path, monkeypatch):
    import shutil
    from dataclasses import replace

    import verl_prm.search as search

    pipeline, config, work, _, _ = tiny_run
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    (copy / "search" / "DONE.json").unlink()
    (copy / "search" / "results.json").unlink()
    complete = json.loads((work / "search" / "results.json").read_text())
    beam_search = search.beam_search

    def interrupted(problems, sampler, critic, prior, beam):
        if beam.beam_width == 2:
            raise KeyboardInterrupt("killed at the widest beam")
        return beam_search(problems, sampler, critic, prior, beam)

    monkeypatch.setattr(search, "beam_search", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(config, copy, ["search"], progress=False, log=lambda line: None)
    partial = copy / "search" / "rows.partial.json"
    assert json.loads(partial.read_text())["rows"] == complete[:-1]  # saved row by row

    monkeypatch.setattr(search, "beam_search", beam_search)
    lines: list[str] = []
    pipeline.run(config, copy, ["search"], progress=False, log=lines.append)
    search_lines = [line for line in lines if line.startswith("[word-problems] search: ") and "N=" in line]
    assert [line.endswith("(kept)") for line in search_lines] == [True] * (len(complete) - 1) + [False]
    # the resumed rows equal an uninterrupted run's: no row depends on which rows ran before it
    assert json.loads((copy / "search" / "results.json").read_text()) == complete
    assert not partial.exists()

    # rows of other settings, or damaged rows, are refused naming the file
    (copy / "search" / "DONE.json").unlink()
    write = {"settings": {"problems": 3}, "rows": complete[:1]}
    partial.write_text(json.dumps(write))
    with pytest.raises(ValueError, match=r"rows.partial.json holds search rows made with other settings"):
        pipeline.run(config, copy, ["search"], progress=False, log=lambda line: None)
    settings = pipeline.stages_of(config, copy)["search"].settings
    partial.write_text(json.dumps({"settings": settings, "rows": [{**complete[0], "accuracy": float("nan")}]}))
    with pytest.raises(ValueError, match=r"rows.partial.json: row 0 \(majority_vote N=1\) has a non-finite number"):
        pipeline.run(config, copy, ["search"], progress=False, log=lambda line: None)
    partial.write_text(json.dumps({"settings": settings, "rows": [{"method": "vote", "n": 1}]}))
    with pytest.raises(ValueError, match=r"row 0 is .*not an object with exactly the keys"):
        pipeline.run(replace(config), copy, ["search"], progress=False, log=lambda line: None)


@pytest.mark.parametrize("flags, message", [
    (["--search-problems", "-5"], r"RecipeConfig.search_problems \(--search-problems\) must be an integer >= 1, got -5"),
    (["--pav-steps", "-1"], r"RecipeConfig.pav_steps \(--pav-steps\) must be an integer >= 1, got -1"),
    (["--pav-steps", "0"], r"RecipeConfig.pav_steps \(--pav-steps\) must be an integer >= 1, got 0"),
    (["--n-mc", "0"], r"RecipeConfig.n_mc \(--n-mc\) must be an integer >= 1, got 0"),
    (["--label-problems", "0"], r"RecipeConfig.label_problems \(--label-problems\) must be an integer in \[1, 1024\]"),
    (["--test-problems", "100000000"], r"the data stage would draw 100005024 distinct problems \(test_problems "
     r"100000000 \+ shots 0 \+ sft_problems 4000 \+ label pool 1024\), more than it can generate: at most 200000 .*"
     r"lower RecipeConfig.test_problems \(--test-problems\)"),
])
def test_bad_counts_are_refused_before_any_stage_runs(flags, message, tmp_path, monkeypatch):
    """--search-problems -5 ran the search on test[:-5]; --pav-steps 0 or -1 was taken; --test-problems 1e8 drew
    problems for minutes. The config refuses them (also when made in Python), before any stage."""
    import time

    from verl_prm.apps.word_problems import pipeline

    def no_stage(*args, **kwargs):
        raise AssertionError("a stage ran")

    monkeypatch.setattr(pipeline, "run", no_stage)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        pipeline.main(["--work-dir", str(tmp_path / "work"), *flags])
    assert time.perf_counter() - started < 10 and not (tmp_path / "work").exists()


def test_recipe_config_checks_its_counts_when_made_in_python():
    from verl_prm.apps.word_problems.pipeline import MAX_DRAWN_PROBLEMS, RecipeConfig

    with pytest.raises(ValueError, match=r"RecipeConfig.search_problems \(--search-problems\) must be an integer >= 1"):
        RecipeConfig(search_problems=-5)
    with pytest.raises(ValueError, match=r"RecipeConfig.samples_per_beam must be an integer >= 1, got 0"):
        RecipeConfig(samples_per_beam=0)
    with pytest.raises(ValueError, match=r"RecipeConfig.pav_steps \(--pav-steps\) must be an integer >= 1, got the "
                                         r"float 3.0"):
        RecipeConfig(pav_steps=3.0)
    # a narrow task: the bound is half of what it can produce, not MAX_DRAWN_PROBLEMS
    narrow = TaskConfig(min_steps=1, max_steps=1, max_start=5, max_amount=2, operations=("add",))
    with pytest.raises(ValueError, match=r"at most 1200 \(the smaller of 200000, which it draws in seconds, and half "
                                         r"of the 2400 distinct problems"):
        RecipeConfig(task=narrow, sft=None, sft_problems=0, label_problems=4, measure_problems=4, search_problems=4,
                     test_problems=500)
    assert RecipeConfig(test_problems=MAX_DRAWN_PROBLEMS - 5024).test_problems == MAX_DRAWN_PROBLEMS - 5024


def every_question(config: TaskConfig) -> set[str]:
    """Every question text of ``config``, enumerated: each name, item, start and sequence of changes (a change:
    its kind, amount and phrase from the task's tables; nothing to give away at a count of 0)."""
    from verl_prm.apps.word_problems.task import ITEMS, NAMES, OPERATIONS, Problem

    def sequences(value, left, item):
        if left == 0:
            yield ()
            return
        for kind in config.operations:
            if kind == "sub" and value < 1:
                continue
            amounts = [2] if kind == "mul" else range(1, (min(config.max_amount, value) if kind == "sub"
                                                          else config.max_amount) + 1)
            for amount in amounts:
                new = 2 * value if kind == "mul" else value + amount if kind == "add" else value - amount
                for phrase in OPERATIONS[kind][0]:
                    for rest in sequences(new, left - 1, item):
                        yield ((kind, amount, phrase.format(k=amount, item=item)),) + rest

    return {Problem(name, pronoun, item, start, steps).question for name, pronoun in NAMES for item in ITEMS
            for start in range(2, config.max_start + 1) for length in range(config.min_steps, config.max_steps + 1)
            for steps in sequences(start, length, item)}


def test_count_problems_is_every_question_the_generator_can_draw():
    """count_problems against the enumerated question texts (each distinct), which hold every question the
    generator draws; more problems than that is an error at once instead of endless draws."""
    import random

    from verl_prm.apps.word_problems import task

    for config in (TaskConfig(min_steps=1, max_steps=2, max_start=3, max_amount=2, operations=("add", "sub", "mul")),
                   TaskConfig(min_steps=1, max_steps=1, max_start=5, max_amount=2, operations=("add",))):
        questions = every_question(config)
        rng = random.Random(0)
        assert {task._problem(rng, config).question for _ in range(20_000)} <= questions
        assert len(questions) == task.count_problems(config)
    assert task.count_problems(TaskConfig(min_steps=1, max_steps=1, max_start=5, max_amount=2,
                                          operations=("add",))) == 10 * 10 * 4 * 3 * 2
    with pytest.raises(ValueError, match="could not draw 2401 distinct problems .* it has only 2400 distinct"):
        generate_problems(2401, TaskConfig(min_steps=1, max_steps=1, max_start=5, max_amount=2, operations=("add",)),
                          seed=0)


def test_search_study_on_the_tiny_run_reports_the_tokens_to_reach_majority_vote_and_resumes(tiny_run, tmp_path):
    from dataclasses import replace

    from studies import word_problems_search as study

    _, config, work, records, _ = tiny_run
    config = replace(config, best_of_n=(1, 2, 8), beam_widths=(1,))
    pav, orm = records["pav"]["outputs"]["checkpoint"], records["orm"]["outputs"]["checkpoint"]
    export = tmp_path / "docs" / "search.json"
    result = study.run(config, work, pav, orm, tmp_path / "out", export=export, log=lambda line: None)
    rows = result["rows"]
    assert [(r["method"], r["n"]) for r in rows] == [
        (m, n) for n in (1, 2, 8) for m in ("majority_vote", "best_of_n_orm", "best_of_n_pav")] + [("beam_pav", 1)]
    vote = next(r for r in rows if (r["method"], r["n"]) == ("majority_vote", 8))
    assert result["target"]["accuracy"] == vote["accuracy"]
    assert result["tokens_to_reach_target"]["majority_vote"] == study.tokens_to_reach(
        rows, "majority_vote", vote["accuracy"]) <= vote["tokens_per_problem"]
    assert json.loads(export.read_text()) == json.loads((tmp_path / "out" / "results.json").read_text())
    # beam width 1 against majority vote and the ORM at the N nearest its tokens, problem by problem
    [vs_vote, vs_orm] = result["paired"]
    beam = rows[-1]
    for paired, method in ((vs_vote, "majority_vote"), (vs_orm, "best_of_n_orm")):
        other = min((r for r in rows if r["method"] == method),
                    key=lambda r: abs(r["tokens_per_problem"] - beam["tokens_per_problem"]))
        assert (paired["against"], paired["n"]) == (method, other["n"])
        assert paired["difference"] == pytest.approx(beam["accuracy"] - other["accuracy"])
        assert paired["only_first"] == sum(b and not o for b, o in zip(beam["correct"], other["correct"]))
    assert (tmp_path / "out" / "search.png").stat().st_size > 0
    # a rerun keeps every row; other settings are refused naming the file
    (tmp_path / "out" / "rows.partial.json").write_text(json.dumps({"settings": result["settings"], "rows": rows}))
    lines: list[str] = []
    assert study.run(config, work, pav, orm, tmp_path / "out", log=lines.append)["rows"] == rows
    assert all(line.endswith("(kept)") for line in lines if "N=" in line)
    (tmp_path / "out" / "rows.partial.json").write_text(json.dumps({"settings": result["settings"], "rows": rows}))
    with pytest.raises(ValueError, match="rows.partial.json holds search rows made with other settings"):
        study.run(replace(config, alpha=0.25), work, pav, orm, tmp_path / "out", log=lambda line: None)
    with pytest.raises(ValueError, match="needs 8 among them"):
        study.run(replace(config, best_of_n=(1, 2)), work, pav, orm, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="the recipe's data stage is not complete"):
        study.run(config, tmp_path / "empty", pav, orm, tmp_path / "out2")


def test_tokens_to_reach_interpolates_between_the_budgets_around_the_target():
    from studies.word_problems_search import summary, tokens_to_reach

    rows = [{"method": "beam_pav", "n": n, "accuracy": a, "tokens_per_problem": t, "stderr": 0.0, "problems": 5,
             "correct": [1] * round(5 * a) + [0] * (5 - round(5 * a))}
            for n, a, t in ((1, 0.2, 50.0), (2, 0.4, 100.0), (4, 0.6, 300.0))]
    assert tokens_to_reach(rows, "beam_pav", 0.5) == pytest.approx(200.0)  # halfway from 100 to 300 tokens
    assert tokens_to_reach(rows, "beam_pav", 0.1) == 50.0                   # the smallest budget already there
    assert tokens_to_reach(rows, "beam_pav", 0.7) is None
    with pytest.raises(ValueError, match="no majority_vote row at N = 8"):
        summary(rows)

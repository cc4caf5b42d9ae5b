"""The word-problem recipe's held-out test (issue 57 item 1): the program check of a response's steps against the
reference solution, the AUROC's bootstrap interval over problems against a plain loop over resamples, and
``studies.word_problems_pav`` end to end on a tiny random value critic with hand-made label rows whose
``prefix_correct`` is known."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from verl_prm.apps.word_problems.check import check_steps, line_claim
from verl_prm.apps.word_problems.task import Problem, generate_problems
from verl_prm.training.metrics import grouped_bootstrap_auroc, grouped_bootstrap_auroc_difference

# 3 apples, buys 4 (-> 7), gives away 2 (-> 5), doubles (-> 10)
PROBLEM = Problem("Sam", "he", "apples", 3, (("add", 4, "buys 4 more apples"), ("sub", 2, "gives away 2 apples"),
                                             ("mul", 2, "doubles the apples")))


def as_steps(*lines: str) -> list[str]:
    """Steps of one line each, as the labels store them: each but the last ends with its newline."""
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


def test_the_reference_solution_passes_every_step():
    solution = PROBLEM.solution()
    assert solution.split("\n") == ["He buys 4 more apples: 3 + 4 = 7.", "He gives away 2 apples: 7 - 2 = 5.",
                                    "He doubles the apples: 5 * 2 = 10.", "The answer is 10."]
    check = check_steps(solution, as_steps(*solution.split("\n")))
    assert check.step_right == check.prefix_correct == (True, True, True, True)
    for problem in generate_problems(50, seed=11):  # every generated problem's own solution
        lines = problem.solution().split("\n")
        assert all(check_steps(problem.solution(), as_steps(*lines)).prefix_correct)


@pytest.mark.parametrize("steps, right", [
    # a wrong result
    (as_steps("3 + 4 = 8.", "8 - 2 = 6.", "6 * 2 = 12.", "The answer is 12."), (False, False, False, False)),
    # right arithmetic on the wrong number (the count was 7), and every line after it
    (as_steps("3 + 4 = 7.", "8 - 2 = 6.", "6 * 2 = 12.", "The answer is 12."), (True, False, False, False)),
    # the phrase words, spaces and the period are ignored; x and × multiply
    (as_steps("He finds some: 3+4=7", "7 - 2 = 5", "so 5 x 2 = 10.", "The answer is 10"), (True, True, True, True)),
    (as_steps("3 + 4 = 7.", "7 - 2 = 5.", "5 × 2 = 10.", "So the answer is 10."), (True, True, True, True)),
    # the wrong operator, an operand swapped, a line with no equation, a line with two
    (as_steps("3 - 4 = 7.", "2 - 7 = 5.", "Let me think.", "5 * 2 = 10 = 10."), (False, False, False, False)),
    # the answer line: a wrong N; at an equation's place; an equation at the answer's place
    (as_steps("3 + 4 = 7.", "7 - 2 = 5.", "5 * 2 = 10.", "The answer is 11."), (True, True, True, False)),
    (as_steps("3 + 4 = 7.", "The answer is 7.", "5 * 2 = 10.", "The answer is 10."), (True, False, True, True)),
    (as_steps("3 + 4 = 7.", "7 - 2 = 5.", "5 * 2 = 10.", "10 + 0 = 10."), (True, True, True, False)),
    # merged steps (lines beyond --max-steps join the last): right when every line is; one bad line spoils it
    (["3 + 4 = 7.\n", "7 - 2 = 5.\n5 * 2 = 10.\nThe answer is 10."], (True, True)),
    (["3 + 4 = 7.\n", "7 - 2 = 5.\n5 * 2 = 11.\nThe answer is 11."], (True, False)),
    # blank lines are skipped
    (["3 + 4 = 7.\n\n", "7 - 2 = 5.\n", "\n5 * 2 = 10.\n", "The answer is 10.\n\n"], (True, True, True, True)),
    # an extra line (after the answer), alone or inside a merged step
    (as_steps("3 + 4 = 7.", "7 - 2 = 5.", "5 * 2 = 10.", "The answer is 10.", "The answer is 10."),
     (True, True, True, True, False)),
    (["3 + 4 = 7.\n", "7 - 2 = 5.\n5 * 2 = 10.\nThe answer is 10.\nDone."], (True, False)),
    # missing lines: the response stops before the answer line, so its last step is wrong
    (as_steps("3 + 4 = 7.", "7 - 2 = 5.", "5 * 2 = 10.\n"), (True, True, False)),
    # a step with no line
    (["3 + 4 = 7.\n", "  \n", "7 - 2 = 5.\n5 * 2 = 10.\nThe answer is 10."], (True, False, True)),
])
def test_step_check_cases(steps, right):
    check = check_steps(PROBLEM.solution(), steps)
    assert check.step_right == right
    assert check.prefix_correct == tuple(all(right[: h + 1]) for h in range(len(right)))


def test_line_claims_and_a_solution_that_is_no_recipe_solution():
    assert line_claim("He buys 12 more: 13 + 12 = 25.") == ("equation", 13, "+", 12, 25)
    assert line_claim("7 - 9 = -2") == ("equation", 7, "-", 9, -2)
    assert line_claim("The answer is $1,234.") == ("answer", 1234)
    assert line_claim("3 + 4 = 7 apples.") is None and line_claim("") is None
    assert check_steps(PROBLEM.solution(), []).prefix_correct == ()
    with pytest.raises(ValueError, match="line 2 of the reference solution, 'So five.'"):
        check_steps("3 + 2 = 5.\nSo five.", ["3 + 2 = 5."])


def pairwise_auroc(positives, negatives) -> float:
    """P(a positive scores above a negative) + 1/2 P(tie), over all pairs (Mann-Whitney)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def loop_bootstrap(scores, labels, groups, resamples, seed, level):
    """The percentile bootstrap over groups written as a loop: draw the sorted distinct groups with replacement
    (the same draws: numpy's default_rng(seed).integers), pool their items, skip one-class resamples."""
    keys = sorted(set(groups))
    draws = np.random.default_rng(seed).integers(0, len(keys), size=(resamples, len(keys)))
    values = []
    for row in draws:
        items = [i for k in row for i in range(len(scores)) if groups[i] == keys[k]]
        positives = [scores[i] for i in items if labels[i]]
        negatives = [scores[i] for i in items if not labels[i]]
        if positives and negatives:
            values.append(pairwise_auroc(positives, negatives))
    everything = pairwise_auroc([s for s, y in zip(scores, labels) if y], [s for s, y in zip(scores, labels) if not y])
    low, high = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return everything, low, high, resamples - len(values)


@pytest.mark.parametrize("case", ["mixed", "one_group_of_positives"])
def test_grouped_bootstrap_equals_the_loop(case):
    rng = np.random.default_rng(3)
    n = 60
    scores = (rng.integers(0, 6, n) / 5).tolist()  # ties
    groups = [f"problem {i % 7}" for i in range(n)]
    if case == "mixed":
        labels = (rng.random(n) < 0.4).tolist()
    else:  # resamples without "problem 2" have no positive: skipped
        labels = [g == "problem 2" for g in groups]
    got = grouped_bootstrap_auroc(scores, labels, groups, resamples=300, seed=5, level=0.9)
    want = loop_bootstrap(scores, labels, groups, 300, 5, 0.9)
    assert np.allclose(got[:3], want[:3], rtol=0, atol=1e-12) and got.skipped == want[3]
    assert (got.skipped > 0) == (case == "one_group_of_positives")


def loop_bootstrap_difference(scores_a, scores_b, labels, groups, resamples, seed, level):
    """The paired bootstrap as a loop: each resample's pooled items scored both ways, their AUROCs subtracted."""
    keys = sorted(set(groups))
    draws = np.random.default_rng(seed).integers(0, len(keys), size=(resamples, len(keys)))
    differences = []
    for row in draws:
        items = [i for k in row for i in range(len(labels)) if groups[i] == keys[k]]
        if any(labels[i] for i in items) and not all(labels[i] for i in items):
            differences.append(
                pairwise_auroc([scores_a[i] for i in items if labels[i]], [scores_a[i] for i in items if not labels[i]])
                - pairwise_auroc([scores_b[i] for i in items if labels[i]],
                                 [scores_b[i] for i in items if not labels[i]]))
    def whole(scores):
        return pairwise_auroc([s for s, y in zip(scores, labels) if y], [s for s, y in zip(scores, labels) if not y])

    point = whole(scores_a) - whole(scores_b)
    low, high = np.percentile(differences, [50 * (1 - level), 50 * (1 + level)])
    return point, low, high, resamples - len(differences)


def test_paired_auroc_difference_equals_the_loop():
    rng = np.random.default_rng(4)
    n = 70
    labels = (rng.random(n) < 0.45).tolist()
    groups = [f"problem {i % 9}" for i in range(n)]
    scores_a = (np.asarray(labels) * 0.5 + rng.integers(0, 6, n) / 5).tolist()  # informative, with ties
    scores_b = (rng.integers(0, 6, n) / 5).tolist()  # chance
    got = grouped_bootstrap_auroc_difference(scores_a, scores_b, labels, groups, resamples=250, seed=2, level=0.9)
    want = loop_bootstrap_difference(scores_a, scores_b, labels, groups, 250, 2, 0.9)
    assert np.allclose(got[:3], want[:3], rtol=0, atol=1e-12) and got.skipped == want[3]
    assert got.low > 0  # the informative scoring is ahead on every 5th-95th percentile resample
    same = grouped_bootstrap_auroc_difference(scores_a, scores_a, labels, groups, resamples=50)
    assert same[:3] == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="scoring 1, score 3, is nan"):
        grouped_bootstrap_auroc_difference(scores_a, scores_b[:3] + [math.nan] + scores_b[4:], labels, groups)
    with pytest.raises(ValueError, match=f"{n} scores, {n - 1} scores, {n} labels"):
        grouped_bootstrap_auroc_difference(scores_a, scores_b[1:], labels, groups)


def test_grouped_bootstrap_refuses_what_has_no_interval():
    scores, groups = [0.1, 0.2, 0.3, 0.4], ["a", "a", "b", "b"]
    with pytest.raises(ValueError, match="all 4 items are of one class"):
        grouped_bootstrap_auroc(scores, [1, 1, 1, 1], groups)
    # 1 group of positives out of 10: 0.9^10 = 35% of the resamples lack it
    many = [f"g{i}" for i in range(10)]
    with pytest.raises(ValueError, match=r"only \d+ of 200 resamples of the 10 groups hold both classes"):
        grouped_bootstrap_auroc(np.arange(10.0), [g == "g0" for g in many], many, resamples=200, min_valid_share=0.9)
    with pytest.raises(ValueError, match="score 1 is nan"):
        grouped_bootstrap_auroc([0.1, math.nan, 0.3, 0.4], [0, 1, 0, 1], groups)
    with pytest.raises(ValueError, match="4 scores, 3 labels"):
        grouped_bootstrap_auroc(scores, [0, 1, 0], groups)
    for knobs, message in (({"level": 1.0}, "level"), ({"level": math.nan}, "level"), ({"resamples": 1}, "resamples"),
                           ({"resamples": 2.5}, "resamples"), ({"seed": 0.5}, "seed")):
        with pytest.raises(ValueError, match=message):
            grouped_bootstrap_auroc(scores, [0, 1, 0, 1], groups, **knobs)


# ----------------------------------------------------------------------------------------------- the study


def chat(shot: Problem, problem: Problem) -> str:
    """A chat prompt as the recipe renders it: the instruction, a worked shot, the question."""
    return (f"<|im_start|>system\nSolve the problem.<|im_end|>\n<|im_start|>user\n{shot.question}<|im_end|>\n"
            f"<|im_start|>assistant\n{shot.solution()}<|im_end|>\n<|im_start|>user\n{problem.question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def label_row(prompt_index: int, rollout_index: int, prompt: str, response: str, successes: list[int],
              prompt_successes: int) -> dict:
    """A label row of ``response`` split at newlines with at most 3 steps (the lines beyond merge into the last),
    4 continuations per step prefix."""
    from verl_prm.steps import step_char_spans

    spans = step_char_spans(response, "\n", max_steps=3)
    assert len(spans) == len(successes)
    return {"prompt_index": prompt_index, "rollout_index": rollout_index, "data_source": "word_problems",
            "prompt": prompt, "ground_truth": "0", "response": response,
            "step_starts": [a for a, _ in spans], "step_ends": [b for _, b in spans],
            "q": [k / 4 for k in successes], "n_success": successes, "n_mc": [4] * len(spans), "first_pit": -1,
            "prompt_value": prompt_successes / 4, "prompt_n_success": prompt_successes, "prompt_n_mc": 4,
            "outcome": float(successes[-1] == 4), "score": 0.0, "finished": True, "strategy": "every",
            "source": "hand-made"}


def responses(problem: Problem) -> list[tuple[str, tuple[bool, ...]]]:
    """Three responses of ``problem`` (two-change problems) and their known prefix_correct: the reference
    solution; a wrong result in the first line; a merged last step with a wrong answer."""
    lines = problem.solution().split("\n")
    (_, amount, _), value = problem.steps[0], problem.start
    wrong = lines[0].rsplit("=", 1)[0] + f"= {value + amount + 1}."
    return [("\n".join(lines), (True, True, True)),
            ("\n".join([wrong] + lines[1:]), (False, False, False)),
            ("\n".join(lines[:2] + ["7 - 7 = 0.", f"The answer is {problem.answer + 1}."]), (True, True, False))]


@pytest.fixture(scope="module")
def study_inputs(tmp_path_factory):
    """A recipe work dir's data/*.jsonl, training and held-out label shards, a tiny value_head critic."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForTokenClassification

    from tiny_model import write_tiny_causal_lm
    from verl_prm.apps.word_problems.task import TaskConfig
    from verl_prm.labeling.format import rows_to_table

    root = tmp_path_factory.mktemp("heldout")
    problems = generate_problems(7, TaskConfig(min_steps=2, max_steps=2), seed=21)
    shot, train, held_out = problems[0], problems[1:3], problems[3:]
    (root / "work" / "data").mkdir(parents=True)
    for name, split in (("shots", [shot]), ("label", train + held_out[:2]), ("test", held_out[2:])):
        (root / "work" / "data" / f"{name}.jsonl").write_text("".join(json.dumps(
            {"question": p.question, "answer": p.answer, "solution": p.solution()}) + "\n" for p in split))
    shards = {}
    for name, split, offset in (("train", train, 0), ("heldout", held_out, 10)):
        rows = [label_row(offset + i, r, chat(shot, p), text, [4, 2 + r % 3, 4 * (r == 0)][: len(right)], 1 + i % 3)
                for i, p in enumerate(split) for r, (text, right) in enumerate(responses(p))]
        (root / name).mkdir()
        # the last rollout in a shard of its own: its problem's prompt value is then in two shards, counted once
        pq.write_table(rows_to_table(rows[:-1]), root / name / "part-0.parquet")
        pq.write_table(rows_to_table(rows[-1:]), root / name / "part-1.parquet")
        shards[name] = rows
    base = write_tiny_causal_lm([chat(shot, p) + p.solution() for p in problems], root / "tiny", vocab_size=300,
                                hidden_size=32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForTokenClassification(config).save_pretrained(root / "critic")
    tokenizer.save_pretrained(root / "critic")
    return root, train, held_out, shards


def reference_values(critic_dir, rows) -> list[float]:
    """sigmoid of the critic's logit at the token holding each step's last character, the prompt and response
    tokenised apart (the response's offsets locate the token), straight from transformers."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(critic_dir)
    model = AutoModelForTokenClassification.from_pretrained(critic_dir).eval()
    values = []
    for row in rows:
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False, return_offsets_mapping=True)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + response["input_ids"]])).logits[0, :, 0]
        for end in row["step_ends"]:
            token = next(t for t, (a, b) in enumerate(response["offset_mapping"]) if a <= end - 1 < b)
            values.append(float(torch.sigmoid(logits[len(prompt_ids) + token])))
    return values


def test_study_scores_every_held_out_step_and_exports_them(study_inputs):
    from studies import word_problems_pav

    root, train, held_out, shards = study_inputs
    out = root / "out"
    argv = ["--work-dir", str(root / "work"), "--labels", str(root / "train"), "--eval-labels", str(root / "heldout"),
            "--critic", f"tiny={root / 'critic'}", "--critic", str(root / "critic"), "--out", str(out),
            "--resamples", "200", "--device", "cpu", "--export-heldout", str(root / "docs" / "rows.jsonl")]
    assert word_problems_pav.main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (root / "docs" / "rows.jsonl").read_text().splitlines()]
    # one row per held-out step, in label order, with the known check and the labels' Monte-Carlo rate
    known = [(p.question, h + 1, right[h], q / 4) for i, p in enumerate(held_out)
             for (_, right), row in zip(responses(p), shards["heldout"][3 * i: 3 * i + 3])
             for h, q in enumerate(row["n_success"])]
    assert [(r["problem"], r["step"], r["prefix_correct"], r["mc_label"]) for r in rows] == known
    assert np.allclose([r["score"] for r in rows], reference_values(root / "critic", shards["heldout"]), atol=1e-5)
    counts = metrics["counts"]
    # per problem: prefix_correct 3 + 0 + 2 steps; steps right 3 + 2 (the lines after the wrong one) + 2
    assert counts == {"problems": 4, "rollouts": 12, "steps": 36, "prefix_correct_positives": 20,
                      "step_right": 28, "mc_labelled_steps": 36,
                      "mc_positives": sum(r["mc_label"] > 0.5 for r in rows), "prompt_values": 4,
                      "training_problems": 2}
    assert (out / "pav_train_problems.txt").read_text() == "".join(p.question + "\n" for p in train)
    for name in ("tiny", "critic"):  # the same checkpoint twice, named and unnamed: the same numbers
        result = metrics["critics"][name]
        for label, positive in (("prefix_correct", lambda r: r["prefix_correct"]),
                                ("mc_label", lambda r: r["mc_label"] > 0.5)):
            want = pairwise_auroc([r["score"] for r in rows if positive(r)],
                                  [r["score"] for r in rows if not positive(r)])
            got = result[label]
            assert math.isclose(got["auroc"], want, abs_tol=1e-9) and got["low"] <= got["high"]
            assert got["items"] == 36 and got["positives"] == sum(map(positive, rows))
        assert result["prompt_value"]["items"] == 4  # one per problem, not one per rollout
    assert metrics["critics"]["tiny"] == metrics["critics"]["critic"]
    assert metrics["mc_positive"] == "q > 0.5" and metrics["exports"]["critic"] == "tiny"


def test_study_refuses_training_problems_held_out_and_rows_of_no_problem(study_inputs, tmp_path):
    from studies import word_problems_pav

    root, _, _, _ = study_inputs
    base = ["--critic", str(root / "critic"), "--resamples", "50", "--device", "cpu", "--labels", str(root / "train")]
    with pytest.raises(ValueError, match="2 of the 2 held-out problems are also training problems"):
        word_problems_pav.main(base + ["--work-dir", str(root / "work"), "--eval-labels", str(root / "train"),
                                       "--out", str(tmp_path / "same")])
    other = tmp_path / "other_work"  # a recipe whose problems are not those of the labels
    (other / "data").mkdir(parents=True)
    problem = generate_problems(1, seed=99)[0]
    (other / "data" / "test.jsonl").write_text(json.dumps({"question": problem.question, "answer": problem.answer,
                                                           "solution": problem.solution()}) + "\n")
    with pytest.raises(ValueError, match=r"--labels label shard \S+part-0.parquet row 0 \(prompt_index=0, "
                                         r"rollout_index=0\): its prompt holds no problem's question"):
        word_problems_pav.main(base + ["--work-dir", str(other), "--eval-labels", str(root / "heldout"),
                                       "--out", str(tmp_path / "other")])
    with pytest.raises(SystemExit):
        word_problems_pav.parser().parse_args(base + ["--work-dir", "w", "--eval-labels", "e", "--out", "o",
                                                      "--resamples", "1"])
    with pytest.raises(ValueError, match="the name 'critic' is given twice"):
        word_problems_pav.parse_critics([str(root / "critic"), f"critic={root / 'critic'}"])


def test_a_checkpoint_is_scored_in_the_format_its_files_say(tmp_path):
    """A token_logprob checkpoint (its head file beside the LM) is read as token_logprob, any other as value_head."""
    from verl_prm.critic.token_logprob_head import HEAD_JSON, native_format

    (tmp_path / "config.json").write_text("{}")
    assert native_format(tmp_path) == "value_head"
    (tmp_path / HEAD_JSON).write_text("{}")
    assert native_format(tmp_path) == "token_logprob"


def first_pit_rows(rows: list[dict]) -> list[dict]:
    """The hand-made rows as a first-pit search would label them: a failed rollout's steps from its first
    zero-value step on are 0 (the pit measured, the rest inferred, n_mc 0), the steps before it unlabelled (NaN)
    but the one just before the pit; a successful rollout keeps every label."""
    out = []
    for row in rows:
        q, n_success, n_mc = list(row["q"]), list(row["n_success"]), list(row["n_mc"])
        pit = next((h for h, s in enumerate(n_success) if s == 0), -1)
        if pit >= 0:
            for h in range(len(q)):
                if h > pit:
                    q[h], n_success[h], n_mc[h] = 0.0, 0, 0
                elif h < pit - 1:
                    q[h], n_success[h], n_mc[h] = math.nan, 0, 0
        out.append({**row, "q": q, "n_success": n_success, "n_mc": n_mc, "first_pit": pit, "strategy": "first_pit"})
    return out


def test_label_budget_compare_fits_a_critic_per_setting_and_pairs_them_on_the_held_out_steps(study_inputs):
    """``studies.word_problems_label_budget compare`` on the hand-made labels (n_mc 4): at a budget of 1 problem
    at n_mc 4 (cost 2) n_mc 2 (cost 1) gets 2 problems, its labels drawn from the n_mc 4 counts, and the first-pit
    search (cost 1) 2 problems of its own labels; each critic is judged on the same held-out steps and paired
    against n_mc 4's. Its held-out scores are those of the checkpoint `verl-prm train` fits on the same labels."""
    import pyarrow.parquet as pq

    from studies import word_problems_label_budget as study
    from studies import word_problems_pav
    from verl_prm.labeling.format import rows_to_table
    from verl_prm.training import TrainConfig, train

    root, _, _, shards = study_inputs
    (root / "work" / "policy").symlink_to(root / "tiny")  # the tiny LM as the policy whose log-probs are features
    out = root / "budget"
    for name, rows in (("first_pit", first_pit_rows(shards["train"])),
                       ("train_first", [r for r in shards["train"] if r["prompt_index"] == 0])):
        (root / name).mkdir()
        pq.write_table(rows_to_table(rows), root / name / "shard-00000.parquet")
    out.mkdir()
    (out / "cost.json").write_text(json.dumps({"2": {"cpu_seconds_per_problem": 1.0},
                                               "4": {"cpu_seconds_per_problem": 2.0},
                                               "first_pit:4": {"cpu_seconds_per_problem": 1.0}}))
    argv = ["compare", "--work-dir", str(root / "work"), "--labels", str(root / "train"), "--eval-labels",
            str(root / "heldout"), "--first-pit-labels", str(root / "first_pit"), "--budget-problems", "1",
            "--n-mc", "2,4", "--resamples", "200", "--device", "cpu", "--out", str(out)]
    assert study.main(argv) == 0
    results = json.loads((out / "compare.json").read_text())
    [budget] = results["budgets"]
    assert budget["settings"] == {"2": "every,n_mc=2,problems=2,l2=0,seed=0",
                                  "4": "every,n_mc=4,problems=1,l2=0,seed=0",
                                  "first_pit": "first_pit,n_mc=4,problems=2,l2=0,seed=0"}
    settings = results["settings"]
    assert settings["every,n_mc=2,problems=2,l2=0,seed=0"]["labelled_steps"] == 18  # 2 problems x 3 rollouts x 3
    unlabelled = sum(math.isnan(q) for row in first_pit_rows(shards["train"]) for q in row["q"])
    assert settings["first_pit,n_mc=4,problems=2,l2=0,seed=0"]["labelled_steps"] == 18 - unlabelled < 18
    rows = {name: [json.loads(line) for line in (out / "heldout" / f"{tag}.jsonl").open()]
            for name, tag in (("2", "n2_p2_l2-0_s0"), ("4", "n4_p1_l2-0_s0"),
                              ("first_pit", "first_pit_n4_p2_l2-0_s0"))}

    # n_mc 4 on 1 problem is the first problem's labels as they are: verl-prm train on them, judged by the study
    train(TrainConfig(labels=[str(root / "train_first")], output_dir=str(root / "critic_first"),
                      init=str(root / "tiny"), format="token_logprob", eval_fraction=0.0, cpu=True, progress=False,
                      calibration="none"))
    word_problems_pav.main(["--work-dir", str(root / "work"), "--labels", str(root / "train_first"), "--eval-labels",
                            str(root / "heldout"), "--critic", f"pav={root / 'critic_first'}", "--out",
                            str(root / "judged_first"), "--resamples", "200", "--device", "cpu"])
    judged = [json.loads(line) for line in (root / "judged_first" / "pav_heldout.jsonl").open()]
    assert [r["step"] for r in judged] == [r["step"] for r in rows["4"]]
    # (the checkpoint scores in float32, the study in float64: equal to rounding, so ties may break otherwise)
    assert np.allclose([r["score"] for r in judged], [r["score"] for r in rows["4"]], atol=1e-5, rtol=0)

    def auroc_of(name):
        positives = [r["score"] for r in rows[name] if r["prefix_correct"]]
        negatives = [r["score"] for r in rows[name] if not r["prefix_correct"]]
        return pairwise_auroc(positives, negatives)

    for name in ("2", "first_pit"):
        paired = budget["paired"][name]["prefix_correct"]
        assert paired["difference"] == pytest.approx(auroc_of(name) - auroc_of("4"), abs=1e-12)
        assert paired["low"] <= paired["difference"] <= paired["high"]
    assert budget["paired"]["4"] == {}  # the reference
    table = (out / "results.md").read_text().splitlines()
    assert [line.split(" | ")[:5] for line in table[2:]] == [
        ["| 1", "0", "n_mc 2", "2", "18"], ["| 1", "0", "n_mc 4", "1", "9"],
        ["| 1", "0", "n_mc 4, first pit", "2", str(18 - unlabelled)]]
    # a rerun reads the policy's features from the cache and gives the same results
    cached = (out / "features.npz").stat().st_mtime_ns
    assert study.main(argv) == 0 and (out / "features.npz").stat().st_mtime_ns == cached
    assert json.loads((out / "compare.json").read_text()) == results
    # features of another policy are not reused: new weights make the cache an error naming it
    weights = next((root / "tiny").glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with pytest.raises(SystemExit, match="features.npz holds features of another policy or dtype"):
        study.main(argv)
    (out / "features.npz").unlink()
    # another writer of OUT, a budget the labels cannot pay, labels of other problems or of fewer continuations:
    # refused
    import subprocess
    import sys

    from verl_prm.locking import DirectoryLockedError

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from verl_prm.locking import DirectoryLock; "
                               f"DirectoryLock({str(out)!r}, 'test').acquire(); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryLockedError):
            study.main(argv)
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(SystemExit, match="--budget-problems 2 needs 4 labelled problems for 2 but"):
        study.main(argv[:-9] + ["2", "--n-mc", "2,4", "--out", str(out)])
    with pytest.raises(SystemExit, match="--first-pit-labels .*: labels of \\['every'\\]"):
        study.main(argv[:8] + [str(root / "train")] + argv[9:])
    (root / "first_pit_other").mkdir()
    moved = [{**row, "prompt_index": row["prompt_index"] + 1} for row in first_pit_rows(shards["train"])]
    pq.write_table(rows_to_table(moved), root / "first_pit_other" / "shard-00000.parquet")
    with pytest.raises(SystemExit, match="prompt_index 1 is not the problem of that index in"):
        study.main(argv[:8] + [str(root / "first_pit_other")] + argv[9:])
    (out / "cost.json").write_text(json.dumps({"4": {"cpu_seconds_per_problem": 1.0},
                                               "8": {"cpu_seconds_per_problem": 2.0}}))
    with pytest.raises(SystemExit, match=r"with 4 continuations at least: the labels of n_mc=8"):
        study.main(argv[:7] + ["--budget-problems", "1", "--n-mc", "4,8", "--out", str(out)])

"""studies.word_problems_critic_features (issue 57 item 3): the result-token locator on hand-written steps, the
step log-prob statistics and hidden states against a per-token loop over a tiny causal LM straight from
transformers, the prefix minimum and step weights against loops, and the study end to end on hand-made label rows
(every variant's AUROC is the pairwise definition on its own exported held-out scores; a rerun reads the cache)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from verl_prm.apps.word_problems.task import Problem, TaskConfig, generate_problems


@pytest.mark.parametrize("step, results", [
    ("He buys 15 more cards: 10 + 15 = 125.\n", ["125"]),  # a multi-digit result, not the operand 15
    ("She loses 3 cookies: 3 - 3 = 0", ["0"]),  # no period, no newline
    ("The answer is 1,250.", ["1,250"]),  # the answer line: N with its comma
    ("So the answer is 7\n", ["7"]),
    ("He returns 20 back to the original 10.\n", []),  # no equation, no answer
    ("5 * 2 = 10 = 10.\n", []),  # two '=': no claim (check.line_claim)
    ("7 - 2 = 5.\n5 * 2 = 10.\nThe answer is 10.", ["5", "10", "10"]),  # a merged step: a claim per line
])
def test_result_spans_of_hand_written_steps(step, results):
    from studies.word_problems_critic_features import result_spans

    spans = result_spans(step)
    assert [step[a:b] for a, b in spans] == results
    # each span ends its line's claim: after it at most a period and spaces before the line ends
    for _, b in spans:
        assert step[b:].split("\n")[0].strip() in ("", ".")


@pytest.mark.parametrize("step", [
    "He buys 15 more cards: 10 + 15 = 125.\n", "She loses 3 cookies: 3 - 3 = 0", "The answer is 1,250.",
    "So the answer is 7\n", "He returns 20 back to the original 10.\n", "5 * 2 = 10 = 10.\n",
    "7 - 2 = 5.\n5 * 2 = 10.\nThe answer is 10.", "3 + 4 =\n7.\n", "the ANSWER is $ 5 .  \n",
    "The answer is 3 + 4 = 7", "He has 4 x 3 = 12 eggs.\n", "-2 + 5 = 3 .\t\nThe answer is -3",
])
def test_the_result_regex_claims_what_result_spans_claims(step):
    """RESULT_REGEX (the token_logprob critic's --result-regex for the recipe) is result_spans' rule: the first
    capture group that takes part in each match is a claimed result."""
    import re

    from studies.word_problems_critic_features import RESULT_REGEX, result_spans
    from verl_prm.critic.token_logprob import result_span

    assert [result_span(m) for m in re.finditer(RESULT_REGEX, step)] == result_spans(step)
    for problem in PROBLEMS:  # every line of the reference solutions claims its result
        solution = problem.solution()
        assert [result_span(m) for m in re.finditer(RESULT_REGEX, solution)] == result_spans(solution) != []


def test_overlapping_tokens_is_the_tokens_sharing_a_character():
    from studies.word_problems_critic_features import overlapping_tokens

    offsets = np.array([[0, 2], [2, 4], [4, 4], [4, 7], [7, 8], [8, 12]])
    for start, end in ((0, 1), (2, 5), (4, 7), (3, 9), (11, 12), (12, 13)):
        want = [t for t, (a, b) in enumerate(offsets) if set(range(a, b)) & set(range(start, end))]
        assert overlapping_tokens(offsets, start, end).tolist() == want


def test_cumulative_min_and_step_ranges_against_loops():
    from studies.word_problems_critic_features import cumulative_min, step_token_ranges

    rng = np.random.default_rng(0)
    lengths = [3, 1, 5, 2]
    rollout = np.repeat(np.arange(4), lengths)
    values = rng.normal(size=(len(rollout), 3))
    want = np.empty_like(values)
    for i in range(len(values)):
        for k in range(3):
            want[i, k] = min(values[j, k] for j in range(i + 1) if rollout[j] == rollout[i])
    assert np.array_equal(cumulative_min(values, rollout), want)
    # a step whose end token is the previous step's reads that token alone
    assert step_token_ranges([4, 9, 9, 12]) == [(0, 5), (5, 10), (9, 10), (10, 13)]


def test_step_weights_balance_the_classes_as_a_loop_does():
    from studies.word_problems_critic_features import step_weights

    q = np.array([1.0, 0.75, np.nan, 0.0, 0.25, 0.5, np.nan, 0.0, 1.0])
    rollout = np.array([0, 0, 0, 1, 1, 2, 3, 4, 4])
    labelled = [i for i in range(len(q)) if not math.isnan(q[i])]
    positives = sum(q[i] >= 0.5 for i in labelled)
    negatives = len(labelled) - positives
    # a rollout's weight: the mean over its labelled steps of 1 / (2 N_class); normalised over rollouts
    per_rollout = {}
    for r in dict.fromkeys(rollout[labelled].tolist()):
        mine = [i for i in labelled if rollout[i] == r]
        per_rollout[r] = sum(0.5 / positives if q[i] >= 0.5 else 0.5 / negatives for i in mine) / len(mine)
    total = sum(per_rollout.values())
    want = [per_rollout[rollout[i]] / total for i in labelled]
    assert np.allclose(step_weights(q, rollout, True), want, rtol=0, atol=1e-15)
    assert np.array_equal(step_weights(q, rollout, False), np.ones(len(labelled)))


# ------------------------------------------------------------------------------------------- the tiny policy


def chat(shot: Problem, problem: Problem) -> str:
    return (f"<|im_start|>system\nSolve the problem.<|im_end|>\n<|im_start|>user\n{shot.question}<|im_end|>\n"
            f"<|im_start|>assistant\n{shot.solution()}<|im_end|>\n<|im_start|>user\n{problem.question}<|im_end|>\n"
            "<|im_start|>assistant\n")


PROBLEMS = generate_problems(9, TaskConfig(min_steps=2, max_steps=2), seed=21)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from tiny_model import write_tiny_causal_lm

    root = tmp_path_factory.mktemp("critic_features")
    texts = [chat(PROBLEMS[0], p) + p.solution() for p in PROBLEMS]
    return write_tiny_causal_lm(texts, root / "policy", vocab_size=300, hidden_size=32)


def test_step_statistics_and_hidden_states_against_a_per_token_loop(tiny_policy):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from studies.word_problems_critic_features import load_policy, rollout_features

    # steps: an equation with a two-digit result, a line with no claim, the answer line
    steps = ["He buys 15 more cards: 10 + 15 = 25.\n", "Let me check.\n", "The answer is 125."]
    results = ["25", None, "125"]
    response = "".join(steps)
    starts = np.cumsum([0] + [len(s) for s in steps[:-1]]).tolist()
    prompt = chat(PROBLEMS[0], PROBLEMS[1])
    row = SimpleNamespace(prompt=prompt, response=response, step_starts=starts,
                          step_ends=[a + len(s) for a, s in zip(starts, steps)], prompt_index=0, rollout_index=0,
                          shard="hand-written", shard_row=0)
    policy = load_policy(tiny_policy, "cpu", "float32")
    hidden, stats = rollout_features(policy, row)

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    base = AutoModel.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    encoded = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets, first = prompt_ids + encoded["input_ids"], encoded["offset_mapping"], len(prompt_ids)
    logprobs = []  # l_t: the model on the tokens before t alone, one forward pass per token
    with torch.no_grad():
        for t in range(first, len(ids)):
            logits = model(input_ids=torch.tensor([ids[:t]])).logits[0, -1]
            logprobs.append(float(torch.log_softmax(logits, -1)[ids[t]]))
        last_hidden = base(input_ids=torch.tensor([ids])).last_hidden_state[0]
    previous = -1
    assert stats.shape == (len(steps), 3) and hidden.shape == (len(steps), 32)
    for h, (start, step, result) in enumerate(zip(starts, steps, results)):
        end = start + len(step)
        end_token = next(t for t, (a, b) in enumerate(offsets) if a <= end - 1 < b)
        mine = [logprobs[t] for t in range(previous + 1, end_token + 1)]
        assert math.isclose(stats[h, 0], min(mine), abs_tol=1e-4)
        assert math.isclose(stats[h, 1], sum(mine) / len(mine), abs_tol=1e-4)
        if result is None:
            want = min(mine)
        else:
            a = start + step.rindex(result)
            chars = set(range(a, a + len(result)))
            tokens = [t for t, (x, y) in enumerate(offsets) if chars & set(range(x, y))]
            assert len(tokens) >= 2  # the tiny tokenizer splits digits: a multi-token result
            want = sum(logprobs[t] for t in tokens)
        assert math.isclose(stats[h, 2], want, abs_tol=1e-4)
        assert np.allclose(hidden[h], last_hidden[first + end_token].numpy(), atol=1e-5)
        previous = end_token


# ----------------------------------------------------------------------------------------------- the study


def label_row(prompt_index: int, rollout_index: int, prompt: str, response: str, successes: list[int]) -> dict:
    """A label row of ``response`` split at newlines (at most 3 steps: the lines beyond merge into the last),
    4 continuations per step prefix."""
    from verl_prm.steps import step_char_spans

    spans = step_char_spans(response, "\n", max_steps=3)
    successes = successes[: len(spans)]
    return {"prompt_index": prompt_index, "rollout_index": rollout_index, "data_source": "word_problems",
            "prompt": prompt, "ground_truth": "0", "response": response,
            "step_starts": [a for a, _ in spans], "step_ends": [b for _, b in spans],
            "q": [k / 4 for k in successes], "n_success": successes, "n_mc": [4] * len(spans), "first_pit": -1,
            "prompt_value": 0.5, "prompt_n_success": 2, "prompt_n_mc": 4,
            "outcome": float(successes[-1] == 4), "score": 0.0, "finished": True, "strategy": "every",
            "source": "hand-made"}


def responses(problem: Problem) -> list[str]:
    """The reference solution; a wrong first result; a line that claims nothing and a wrong answer."""
    lines = problem.solution().split("\n")
    (_, amount, _), value = problem.steps[0], problem.start
    wrong = lines[0].rsplit("=", 1)[0] + f"= {value + amount + 11}."
    return ["\n".join(lines), "\n".join([wrong] + lines[1:]),
            "\n".join([lines[0], "Let me think.", f"The answer is {problem.answer + 1}."])]


@pytest.fixture(scope="module")
def study_inputs(tiny_policy, tmp_path_factory):
    import pyarrow.parquet as pq

    from verl_prm.labeling.format import rows_to_table

    root = tmp_path_factory.mktemp("critic_features_study")
    shot, train, held_out = PROBLEMS[0], PROBLEMS[1:5], PROBLEMS[5:9]
    (root / "work" / "data").mkdir(parents=True)
    for name, split in (("shots", [shot]), ("label", train), ("test", held_out)):
        (root / "work" / "data" / f"{name}.jsonl").write_text("".join(json.dumps(
            {"question": p.question, "answer": p.answer, "solution": p.solution()}) + "\n" for p in split))
    successes = ([4, 3, 4], [1, 0, 0], [3, 1, 0])
    for name, split, offset in (("train", train, 0), ("heldout", held_out, 10)):
        rows = [label_row(offset + i, r, chat(shot, p), text, [min(4, k + i % 2) for k in successes[r]])
                for i, p in enumerate(split) for r, text in enumerate(responses(p))]
        (root / name).mkdir()
        pq.write_table(rows_to_table(rows[:7]), root / name / "part-0.parquet")
        pq.write_table(rows_to_table(rows[7:]), root / name / "part-1.parquet")
    return root


def pairwise_auroc(positives, negatives) -> float:
    """P(a positive scores above a negative) + 1/2 P(tie), over all pairs (Mann-Whitney)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def test_study_end_to_end_on_the_tiny_policy(study_inputs, tiny_policy, capsys):
    from studies import word_problems_critic_features as study

    root = study_inputs
    out = root / "out"
    argv = ["--work-dir", str(root / "work"), "--policy", str(tiny_policy), "--labels", str(root / "train"),
            "--eval-labels", str(root / "heldout"), "--out", str(out), "--resamples", "200", "--device", "cpu",
            "--precision", "float32"]
    assert study.main(argv) == 0
    assert capsys.readouterr().err.count("steps extracted in") == 4  # two shards each side
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "heldout_scores.jsonl").read_text().splitlines()]
    assert metrics["counts"]["heldout"] == {"problems": 4, "rollouts": 12, "steps": 36, "mc_labelled_steps": 36,
                                            "prefix_correct_positives": 4 * (3 + 0 + 1),
                                            "mc_positives": sum(r["mc_label"] > 0.5 for r in rows)}
    assert metrics["counts"]["train"]["problems"] == 4 and len(rows) == 36
    assert set(metrics["variants"]) == set(study.FITTED) | set(study.TRAINING_FREE)
    for name, result in metrics["variants"].items():
        for label, positive in (("prefix_correct", lambda r: r["prefix_correct"]),
                                ("mc_label", lambda r: r["mc_label"] > 0.5)):
            want = pairwise_auroc([r["scores"][name] for r in rows if positive(r)],
                                  [r["scores"][name] for r in rows if not positive(r)])
            got = result[label]
            assert math.isclose(got["auroc"], want, abs_tol=1e-9) and got["low"] <= got["auroc"] <= got["high"]
        if result["kind"] == "fitted":
            want_mse = np.mean([(r["scores"][name] - r["mc_label"]) ** 2 for r in rows])
            assert math.isclose(result["mse"], want_mse, rel_tol=1e-9) and result["fit"]["converged"]
    assert metrics["variants"]["hidden"]["fit"]["features"] == 32
    assert metrics["variants"]["hidden+cum_logprob"]["fit"]["features"] == 35
    # the training-free scores: the prefix minimum of the exported step statistics, rollout by rollout
    for r, before in zip(rows, [None] + rows[:-1]):
        same = before is not None and before["rollout"] == r["rollout"]
        for name, stat in (("cum_min_result_logprob", "result_logprob"), ("cum_min_token_logprob", "min_logprob")):
            want = min(r["logprob"][stat], before["scores"][name]) if same else r["logprob"][stat]
            assert r["scores"][name] == want
    table = (out / "results.md").read_text()
    assert all(f"| {name} |" in table for name in metrics["variants"])
    # a rerun with another ridge reads every shard's features from the cache
    assert study.main(argv[:-4] + ["--precision", "float32", "--l2", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().err.count("from the cache") == 4
    again = json.loads((out / "metrics.json").read_text())
    assert again["variants"]["cum_min_token_logprob"] == metrics["variants"]["cum_min_token_logprob"]
    assert again["l2"] == 3.0 and len(list((out / "features").glob("*.npz"))) == 4


def test_study_refuses_bad_knobs_and_a_policy_that_is_none(study_inputs, tmp_path):
    from studies import word_problems_critic_features as study

    root = study_inputs
    with pytest.raises(FileNotFoundError, match=r"--policy \S+nowhere: no config.json"):
        study.main(["--work-dir", str(root / "work"), "--policy", str(tmp_path / "nowhere"), "--labels",
                    str(root / "train"), "--eval-labels", str(root / "heldout"), "--out", str(tmp_path / "out")])

    base = ["--work-dir", "w", "--policy", "p", "--labels", "l", "--eval-labels", "e", "--out", "o"]
    for bad in (["--l2", "nan"], ["--l2", "-1"], ["--max-iterations", "0"], ["--max-iterations", "1.5"],
                ["--precision", "fp8"], ["--resamples", "1"]):
        with pytest.raises(SystemExit):
            study.parser().parse_args(base + bad)

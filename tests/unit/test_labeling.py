"""Monte-Carlo step labels (verl_prm.labeling): agreement with exact values on a scripted task, first pit,
resumable sharded output, the transformers/Ray back ends, converters of public data, the CLI."""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from verl_prm.labeling.converters import convert_math_shepherd, convert_prm800k, read_jsonl
from verl_prm.labeling.format import best_of_k_from_counts, read_labels
from verl_prm.labeling.generators import RayGeneratorPool, trim_at_eos
from verl_prm.labeling.hf_generator import HFGenerator
from verl_prm.labeling.inputs import PromptItem, read_prompts, render_prompt
from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
from verl_prm.monte_carlo import first_pit_search_step
from verl_prm.labeling.runner import run_labeling
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask, scripted_step_score
from verl_prm.labeling.store import ShardStore
from verl_prm.steps import step_char_spans


def scripted_items(task: ScriptedStepTask, count: int, start: int = 0) -> list[PromptItem]:
    return [PromptItem(i, task.prompt(i), str(task.num_steps), "scripted") for i in range(start, start + count)]


def scripted_labeler(settings: LabelSettings, p_policy: float, p_prover: float) -> MonteCarloLabeler:
    return MonteCarloLabeler(ScriptedStepGenerator(p_policy), ScriptedStepGenerator(p_prover),
                             OutcomeScorer(scripted_step_score), settings)



# ------------------------------------------------------------------------------------------------ Monte Carlo


def test_every_prefix_labels_agree_with_exact_q():
    task, p_prover, n_mc = ScriptedStepTask(num_steps=4), 0.75, 64
    items = scripted_items(task, 10)
    labeler = scripted_labeler(LabelSettings(n_cov=4, n_mc=n_mc, prefix_rule="every"), 0.7, p_prover)
    rows = labeler.label(items, [item.prompt for item in items])
    assert len(rows) == 40 and [(r["prompt_index"], r["rollout_index"]) for r in rows] == [
        (i, r) for i in range(10) for r in range(4)
    ]
    errors, variances, zeros_seen = [], [], 0
    for row in rows:
        exact = task.exact_values(row["response"], row["step_ends"], p_prover)
        assert row["step_ends"][-1] == len(row["response"]) and len(exact) == 4
        for h, (q, Q, s, n) in enumerate(zip(row["q"], exact, row["n_success"], row["n_mc"])):
            if h == 3:  # terminal step of a finished response: exact, no rollouts
                assert n == 0 and q == Q == row["outcome"]
                continue
            assert n == n_mc and q == s / n
            assert abs(q - Q) <= 4 * math.sqrt(Q * (1 - Q) / n_mc) + 1e-12, (row["response"], h, q, Q)
            zeros_seen += Q == 0.0
            errors.append(q - Q)
            variances.append(Q * (1 - Q) / n_mc)
        assert row["outcome"] == scripted_step_score("", row["response"], 4)
        v0 = p_prover**4
        assert row["prompt_n_mc"] == n_mc and abs(row["prompt_value"] - v0) <= 4 * math.sqrt(v0 * (1 - v0) / n_mc)
    assert zeros_seen > 0  # pits occurred and were labelled exactly 0
    # unbiased: the mean error over all labels is within 4 standard errors of 0
    assert abs(np.mean(errors)) <= 4 * math.sqrt(np.sum(variances)) / len(errors)


@pytest.mark.parametrize("num_steps", range(1, 9))
def test_first_pit_search_step_finds_every_pit(num_steps):
    for pit in range(num_steps + 1):  # pit == num_steps: no pit
        for known_last_zero in (False, True):
            if known_last_zero and pit == num_steps:
                continue
            lo, hi = 0, num_steps - 1 if known_last_zero else num_steps
            measured = 0
            while lo < hi:
                lo, hi = first_pit_search_step(lo, hi, (lo + hi) // 2 >= pit)
                measured += 1
            assert lo == pit
            assert measured <= math.ceil(math.log2(num_steps + 1))


def test_first_pit_matches_exact_pit_at_lower_cost():
    task, p_prover, n_mc = ScriptedStepTask(num_steps=6), 0.85, 32
    items = scripted_items(task, 8)
    pit_labeler = scripted_labeler(LabelSettings(n_cov=4, n_mc=n_mc, prefix_rule="first_pit", prompt_value=False), 0.8, p_prover)
    rows = pit_labeler.label(items, [item.prompt for item in items])
    every_labeler = scripted_labeler(LabelSettings(n_cov=4, n_mc=n_mc, prefix_rule="every", prompt_value=False), 0.8, p_prover)
    every_labeler.label(items, [item.prompt for item in items])
    failed = [row for row in rows if row["outcome"] == 0.0]
    assert 5 <= len(failed) < len(rows)
    for row in rows:
        exact = task.exact_values(row["response"], row["step_ends"], p_prover)
        if row["outcome"] == 1.0:  # success_labels="every": every prefix sampled, no pit
            assert row["first_pit"] == -1 and row["n_mc"][:-1] == [n_mc] * 5
            continue
        exact_pit = exact.index(0.0)
        assert row["first_pit"] == exact_pit, (row["response"], row["q"], exact)
        assert all(q == 0.0 for q in row["q"][exact_pit:])
        sampled = [h for h, n in enumerate(row["n_mc"]) if n > 0]
        assert len(sampled) <= math.ceil(math.log2(6))
        for h in range(exact_pit):
            assert math.isnan(row["q"][h]) or (row["q"][h] > 0 and h in sampled)
    assert pit_labeler.num_generated < 0.8 * every_labeler.num_generated


def test_first_pit_on_truncated_rollouts_searches_the_last_step_too():
    class Truncating(ScriptedStepGenerator):
        """Seed rollouts marked as cut at max_new_tokens: the last step's value is unknown."""

        def generate(self, texts, n, seeds):
            return [[c.__class__(c.text, False, c.num_tokens) for c in out] for out in super().generate(texts, n, seeds)]

    task, p_prover = ScriptedStepTask(num_steps=5), 0.9
    labeler = MonteCarloLabeler(Truncating(0.75), ScriptedStepGenerator(p_prover), OutcomeScorer(scripted_step_score),
                                LabelSettings(n_cov=4, n_mc=32, prefix_rule="first_pit", success_labels="outcome",
                                              prompt_value=False))
    items = scripted_items(task, 6)
    rows = labeler.label(items, [item.prompt for item in items])
    for row in rows:
        exact = task.exact_values(row["response"], row["step_ends"], p_prover)
        assert not row["finished"]
        if row["outcome"] == 1.0:  # success_labels="outcome" but unfinished: nothing is exact, nothing sampled
            assert row["first_pit"] == -1 and all(math.isnan(q) for q in row["q"])
        else:
            assert row["first_pit"] == exact.index(0.0)


def test_best_of_k_from_counts_is_the_subset_average():
    """1 - C(n-s,K)/C(n,K) is the fraction of K-subsets of the n samples that contain a success."""
    for n, s, k in [(4, 1, 2), (6, 2, 3), (5, 0, 4), (5, 5, 2), (8, 3, 1)]:
        outcomes = [1] * s + [0] * (n - s)
        subsets = list(itertools.combinations(outcomes, k))
        expected = sum(max(sub) for sub in subsets) / len(subsets)
        got = best_of_k_from_counts(np.array([s]), np.array([n]), np.array([s / n]), k)
        assert got[0] == pytest.approx(expected, abs=1e-12)
    # n < K: plug-in; n = 0: transform of q (exact labels stay, NaN stays NaN)
    got = best_of_k_from_counts(np.array([1, 0, 0, 0]), np.array([2, 0, 0, 0]), np.array([0.5, 1.0, 0.0, np.nan]), 4)
    assert got[:3] == pytest.approx([1 - 0.5**4, 1.0, 0.0]) and np.isnan(got[3])
    with pytest.raises(ValueError, match="k must be"):
        best_of_k_from_counts(np.array([1]), np.array([2]), np.array([0.5]), 0)


# ------------------------------------------------------------------------------------------------ storage


def _run(tmp: Path, items, settings, **kwargs):
    labeler = scripted_labeler(settings, 0.7, 0.8)
    return run_labeling(items, lambda prompt: prompt, labeler, ShardStore(tmp), shard_size=2, progress=False, **kwargs)


def test_interrupted_labelling_resumes_without_loss_or_duplicates(tmp_path):
    task = ScriptedStepTask(num_steps=3)
    items = scripted_items(task, 7)
    settings = LabelSettings(n_cov=2, n_mc=8, prefix_rule="every")
    reference = _run(tmp_path / "reference", items, settings)
    assert reference["prompts_labelled"] == 7 and len(reference["shards_written"]) == 4

    class Crash(RuntimeError):
        pass

    def crash_after_two(path):
        if path.name == "shard-00001.parquet":
            raise Crash

    interrupted = tmp_path / "interrupted"
    with pytest.raises(Crash):
        _run(interrupted, items, settings, on_shard_written=crash_after_two)
    leftover = interrupted / ".shard-00002.parquet.tmp12345"  # a shard half-written when the process was killed
    leftover.write_bytes(b"PAR1 truncated")
    resumed = _run(interrupted, items, settings)
    assert resumed["prompts_skipped"] == 4 and resumed["prompts_labelled"] == 3
    assert resumed["temporary_files_removed"] == [str(leftover)] and not leftover.exists()
    assert resumed["rollouts_generated"] < reference["rollouts_generated"]
    got = read_labels(interrupted).sort_values(["prompt_index", "rollout_index"]).reset_index(drop=True)
    want = read_labels(tmp_path / "reference").sort_values(["prompt_index", "rollout_index"]).reset_index(drop=True)
    assert not got.duplicated(["prompt_index", "rollout_index"]).any()
    pd.testing.assert_frame_equal(got, want)
    # a finished run does nothing when restarted
    assert _run(interrupted, items, settings)["prompts_labelled"] == 0


def test_store_refuses_other_settings_and_repeated_prompts(tmp_path):
    store = ShardStore(tmp_path)
    assert store.check_config({"n_mc": 8, "shard_size": 4}, ignore=("shard_size",)) is None
    assert store.check_config({"n_mc": 8, "shard_size": 16}, ignore=("shard_size",)) is None
    task = ScriptedStepTask(num_steps=2)
    rows = scripted_labeler(LabelSettings(n_cov=1, n_mc=2), 0.5, 0.5).label(scripted_items(task, 1), [task.prompt(0)])
    store.write_shard(rows)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} holds labels made with other settings (n_mc: 8 -> 16; "
                                                   "seed: None -> 1): resume with the same settings, or write to a "
                                                   "new --output-dir")):
        store.check_config({"n_mc": 16, "shard_size": 4, "seed": 1}, ignore=("shard_size",))
    for damaged, problem in (("", "is empty"), ("[8]", "does not hold a JSON object of settings (it is list)"),
                             ('{"n_mc": 8', "cannot be read as JSON")):
        store.config_path.write_text(damaged)
        with pytest.raises(ValueError, match=re.escape(f"{store.config_path} {problem}") + ".*write to a new --output"):
            store.check_config({"n_mc": 8, "shard_size": 4}, ignore=("shard_size",))
    store.write_shard(rows)
    with pytest.raises(ValueError, match="repeats prompts"):
        store.finished_prompts()


# ------------------------------------------------------------------------------------------------ back ends


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory, bpe_small):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=bpe_small.eos_token_id, pad_token_id=bpe_small.pad_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_lm")
    Qwen2ForCausalLM(config).save_pretrained(path)
    bpe_small.save_pretrained(path)
    return path


def test_trim_at_eos():
    assert trim_at_eos([5, 6, 2, 1, 1], {2}, 1) == ([5, 6], True)
    assert trim_at_eos([5, 1, 6], {2}, 1) == ([5, 1, 6], False)
    assert trim_at_eos([2], {2, 3}, 1) == ([], True)


def test_hf_generator_batches_left_padded_and_stops_at_eos(tiny_lm_dir):
    texts = ["Natalia sold clips to 48 of her friends in April", "How many", "A robe takes 2 bolts"]
    generator = HFGenerator.from_pretrained(str(tiny_lm_dir), device="cpu", max_new_tokens=10, temperature=0.0,
                                            batch_size=8)
    tokenizer = generator.tokenizer
    batched = generator.generate(texts, 1, [0, 1, 2])
    single = [generator.generate([text], 1, [0])[0][0] for text in texts]
    assert [c[0] for c in batched] == single  # left padding does not change greedy outputs
    assert all(not c.finished and c.num_tokens == 10 for c in single)

    # make the 4th greedy token of text 0 an EOS: that sequence stops there while the others run on
    with torch.inference_mode():
        encoded = tokenizer(texts[0], return_tensors="pt", add_special_tokens=False)
        raw = generator.model.generate(**encoded, max_new_tokens=10, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)[0, encoded["input_ids"].shape[1]:].tolist()
    stop = raw[3]
    generator.eos_token_ids = generator.eos_token_ids | {stop}
    stopped = generator.generate(texts, 1, [0, 1, 2])
    assert stopped[0][0].finished and stopped[0][0].text == tokenizer.decode(raw[:raw.index(stop)])
    assert stopped[0][0].num_tokens == raw.index(stop) + 1
    for i in (1, 2):
        with torch.inference_mode():
            encoded = tokenizer(texts[i], return_tensors="pt", add_special_tokens=False)
            full = generator.model.generate(**encoded, max_new_tokens=10, do_sample=False,
                                            pad_token_id=tokenizer.pad_token_id)[0, encoded["input_ids"].shape[1]:].tolist()
        cut = full.index(stop) if stop in full else len(full)
        assert stopped[i][0].text == tokenizer.decode(full[:cut]) and stopped[i][0].finished == (stop in full)

    # sampling: n samples per text, reproducible for the same seeds, different for other seeds
    sampler = HFGenerator(generator.model, tokenizer, max_new_tokens=8, temperature=1.0, batch_size=4)
    first = sampler.generate(texts[:2], 3, [7, 8])
    assert [len(c) for c in first] == [3, 3]
    assert first == sampler.generate(texts[:2], 3, [7, 8])
    assert first != sampler.generate(texts[:2], 3, [9, 10])
    assert len({c.text for c in first[0]}) > 1


def test_vllm_back_end_is_optional_with_a_clear_message():
    try:
        import vllm  # noqa: F401
    except ImportError:
        from verl_prm.labeling.generators import VLLMGenerator

        with pytest.raises(ImportError, match="pip install"):
            VLLMGenerator("/nonexistent")
    else:
        pytest.skip("vllm is installed: the message for a missing vllm cannot be shown here")


@pytest.mark.ray
def test_ray_pool_returns_what_one_engine_returns(ray_local):
    task = ScriptedStepTask(num_steps=3)
    texts = [task.prompt(i) + ("x=1\n\n" if i % 2 else "") for i in range(7)]
    seeds = list(range(100, 107))
    pool = RayGeneratorPool(functools.partial(ScriptedStepGenerator, 0.6), 3, num_gpus_per_worker=0,
                            num_cpus_per_worker=1)
    try:
        assert pool.generate(texts, 4, seeds) == ScriptedStepGenerator(0.6).generate(texts, 4, seeds)
    finally:
        pool.shutdown()


# ------------------------------------------------------------------------------------------------ converters


def test_math_shepherd_converter_on_repo_samples(repo_data):
    raw = list(read_jsonl(repo_data / "math_shepherd_samples.jsonl"))
    rows = convert_math_shepherd(raw)
    assert len(rows) == len(raw) == 7
    first = rows[0]
    assert first["prompt"].startswith("Janet pays $40/hour") and first["prompt"].endswith("in a year?\n")
    assert first["q"] == [1.0, 1.0, 1.0, 1.0, 0.0] and first["first_pit"] == 4 and first["outcome"] == 0.0
    for record, row in zip(raw, rows):
        signs = re.findall(r" ([+-])(?:\n|$)", record["label"])  # the tags: " ки" at each step's end
        assert len(signs) == record["input"].count("ки")
        assert row["q"] == [1.0 if s == "+" else 0.0 for s in signs]
        assert "ки" not in row["response"] and "Step 1:" not in row["prompt"]
        spans = list(zip(row["step_starts"], row["step_ends"]))
        assert spans == step_char_spans(row["response"], "\n")  # the critic segments it the same way
        steps = record["input"].split("ки")[:-1]
        assert row["response"][: spans[0][1]].strip() == steps[0][steps[0].index("Step 1:"):].strip()
        for (a, b), step in zip(spans[1:], steps[1:]):
            assert row["response"][a:b].strip() == step.strip()
        assert row["n_mc"] == [0] * len(spans) and row["data_source"] == "math_shepherd/GSM8K"
    bad = dict(raw[0], label=raw[0]["label"].replace(" +\n", " ?\n", 1))
    with pytest.raises(ValueError, match="Math-Shepherd row 0: expected '\\+' or '-'"):
        convert_math_shepherd([bad])
    with pytest.raises(ValueError, match="Math-Shepherd row 0: 'label' does not match 'input'"):
        convert_math_shepherd([dict(raw[0], label=raw[0]["label"].replace("hours", "days", 1))])


def test_prm800k_converter_on_repo_samples(repo_data):
    raw = list(read_jsonl(repo_data / "prm800k_samples.jsonl"))
    rows = convert_prm800k(raw)
    by_index = {row["prompt_index"]: row for row in rows}
    assert sorted(by_index) == list(range(6))
    solved = by_index[0]  # step 1: all five completions -1, the human's step continues the trajectory
    assert solved["q"] == [1.0] * 6 and solved["first_pit"] == -1 and solved["finished"]
    assert raw[0]["label"]["steps"][1]["human_completion"]["text"] in solved["response"]
    assert solved["ground_truth"] == "29" and math.isnan(solved["outcome"])
    found_error = by_index[1]  # rating 0 counts as acceptable; the trajectory ends at the first -1
    assert found_error["q"] == [1.0] * 6 + [0.0] and found_error["first_pit"] == 6 and not found_error["finished"]
    assert found_error["response"].endswith(raw[1]["label"]["steps"][6]["completions"][0]["text"])
    gave_up = by_index[4]  # the last step has no completions: the trajectory ends before it
    assert gave_up["q"] == [1.0] * 8 and gave_up["first_pit"] == -1
    for row in rows:
        assert row["step_ends"][-1] == len(row["response"])
    with_alternatives = convert_prm800k(raw[:1], alternatives=True)
    assert len(with_alternatives) == 1 + 5 + 4  # step 1: five -1 siblings; step 5: four not chosen
    assert [r["q"][-1] for r in with_alternatives[1:]] == [0.0] * 5 + [1.0] * 4  # rating 0 -> q = 1
    assert all(len(r["q"]) == 2 for r in with_alternatives[1:6])


# ------------------------------------------------------------------------------------------------ inputs + CLI


def test_render_prompt_and_read_prompts_errors(tmp_path):
    assert render_prompt([{"role": "user", "content": "hi"}], None) == "hi\n"
    assert render_prompt("plain", None) == "plain"
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "work #### 7"}) + "\n")
    items = read_prompts(path, prompt_field="question", answer_field="answer", data_source="openai/gsm8k",
                         answer_regex="#### (.*)")
    assert items[0].ground_truth == "7" and items[0].prompt == "q"
    with pytest.raises(KeyError, match="--prompt-field"):
        read_prompts(path)
    from verl_prm.labeling.scoring import load_reward_function

    with pytest.raises(ValueError, match="path/to/file.py:function_name' or 'pkg://"):
        load_reward_function("no_function_named")
    with pytest.raises(ImportError, match="cannot import module 'verl_prm.no_such_module'"):
        load_reward_function("pkg://verl_prm.no_such_module:score")
    with pytest.raises(AttributeError, match="verl_prm.labeling.closed_form_task has no function named 'nope'"):
        load_reward_function("pkg://verl_prm.labeling.closed_form_task:nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_function(str(tmp_path / "missing.py") + ":score")
    with pytest.raises(TypeError, match="returned None .*a reward must be a finite real number"):
        OutcomeScorer(lambda *args: None).score("toy", "response", "1", None)


@pytest.mark.parametrize("reward, error, problem", [
    ("1.0", TypeError, "returned '1.0' for the response 'x = \\{1\\}' \\(data_source='toy'\\) \\(a str\\)"),
    (math.inf, ValueError, "returned inf for the response 'x = \\{1\\}'"),
    (-math.inf, ValueError, "returned -inf"), (math.nan, ValueError, "returned nan"),
    ({"score": "1"}, TypeError, "returned '1' "), ({"acc": 1.0}, ValueError, "returned a dict without a score"),
    ([1.0], TypeError, r"returned \[1.0\] .*\(a list\)")])
def test_a_reward_is_a_finite_real_number(reward, error, problem):
    """A string "1.0" or an infinite score would count as a success (score > threshold): refused, naming the
    function and the response; numbers of any real type (bool, numpy, 0-d tensors) are rewards."""
    def reward_function(data_source, solution_str, ground_truth, extra_info):
        return reward

    scorer = OutcomeScorer(reward_function)
    with pytest.raises(error, match=f"the reward function .*reward_function {problem}"):
        scorer.score("toy", "x = {1}", "1", None)
    for number, expected in ((True, 1.0), (np.float32(0.75), 0.75), (np.int64(-1), -1.0), (torch.tensor(0.5), 0.5),
                             (np.array(2.0), 2.0), ({"score": 1}, 1.0)):
        assert OutcomeScorer(lambda *args, n=number: n).score("toy", "x", "1", None) == expected


def test_label_cli_with_tiny_transformers_model_and_resume(tmp_path, tiny_lm_dir, repo_data):
    from verl_prm.labeling.cli import main

    rows = [{"prompt": [{"role": "user", "content": f"Question {i}: add {i} and {i}."}], "data_source": "toy",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
            for i in range(3)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 2 == 0)\n")
    args = ["--input", str(tmp_path / "train.parquet"), "--output-dir", str(tmp_path / "labels"), "--policy",
            str(tiny_lm_dir), "--n-cov", "2", "--n-mc", "3", "--max-new-tokens", "12", "--delimiter", "\\n",
            "--shard-size", "2", "--reward-fn", f"{reward}:score", "--device", "cpu", "--no-progress"]
    assert main(args) == 0
    labels = read_labels(tmp_path / "labels")
    assert len(labels) == 6 and sorted(set(labels["prompt_index"])) == [0, 1, 2]
    assert len(list((tmp_path / "labels").glob("shard-*.parquet"))) == 2
    assert labels["prompt"].iloc[0] == "Question 0: add 0 and 0.\n"  # no chat template: documented fallback
    for row in labels.itertuples():
        assert list(zip(row.step_starts, row.step_ends)) == step_char_spans(row.response, "\n")
        assert row.outcome == float(len(row.response) % 2 == 0) and row.prompt_n_mc == 3
    assert main(args) == 0 and len(read_labels(tmp_path / "labels")) == 6  # restart: nothing to do
    with pytest.raises(ValueError, match="n_mc: 3 -> 4"):
        main([a if a != "3" else "4" for a in args])

    # jsonl input scored by verl's default scorer (GSM8K rule)
    jsonl_args = ["--input", str(repo_data / "gsm8k_test.jsonl"), "--limit", "2", "--prompt-field", "question",
                  "--answer-field", "answer", "--answer-regex", "#### (.*)", "--data-source", "openai/gsm8k",
                  "--output-dir", str(tmp_path / "gsm"), "--policy", str(tiny_lm_dir), "--n-cov", "1", "--n-mc", "1",
                  "--max-new-tokens", "6", "--prefix-rule", "first_pit", "--device", "cpu", "--no-progress"]
    assert main(jsonl_args) == 0
    gsm = read_labels(tmp_path / "gsm")
    assert list(gsm["ground_truth"]) == ["18", "3"] and (gsm["outcome"] == 0.0).all()


def test_convert_cli_writes_label_shards(tmp_path, repo_data):
    from verl_prm.labeling.cli import main

    assert main(["convert", "prm800k", "--input", str(repo_data / "prm800k_samples.jsonl"), "--output-dir",
                 str(tmp_path / "prm"), "--alternatives"]) == 0
    frame = read_labels(tmp_path / "prm")
    assert (frame["strategy"] == "prm800k").all() and frame["prompt_index"].nunique() == 6
    assert main(["convert", "math_shepherd", "--input", str(repo_data / "math_shepherd_samples.jsonl"),
                 "--output-dir", str(tmp_path / "ms")]) == 0
    assert len(read_labels(tmp_path / "ms")) == 7


def test_batch_reward_function_scores_each_round_in_one_call():
    """verl's batch signature (solution_strs=...) is recognised, loaded by pkg://, and gives the same labels as the
    per-response function with one call per labelling round."""
    from verl_prm.labeling.scoring import is_batch_function, load_reward_function

    assert load_reward_function("pkg://verl_prm.labeling.closed_form_task:scripted_step_score") is scripted_step_score
    calls = []

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(len(solution_strs))
        return [{"score": scripted_step_score(*args)} for args in zip(data_sources, solution_strs, ground_truths,
                                                                      extra_infos)]

    assert is_batch_function(batch_score) and not is_batch_function(scripted_step_score)
    task = ScriptedStepTask(num_steps=4)
    items = scripted_items(task, 6)
    prompts = [item.prompt for item in items]
    for prefix_rule in ("every", "first_pit"):
        settings = LabelSettings(n_cov=3, n_mc=4, prefix_rule=prefix_rule, seed=5)
        expected = scripted_labeler(settings, 0.6, 0.7).label(items, prompts)
        calls.clear()
        batched = MonteCarloLabeler(ScriptedStepGenerator(0.6), ScriptedStepGenerator(0.7),
                                    OutcomeScorer(batch_score), settings).label(items, prompts)
        assert batched == expected
        # one call for the seed rollouts, one per round of continuations (first_pit: the binary-search rounds)
        assert calls[0] == 6 * 3 and len(calls) <= 1 + math.ceil(math.log2(4)) + 1, calls
        assert sum(calls) > 5 * len(calls)
    with pytest.raises(ValueError, match="returned 1 scores for 2 responses"):
        OutcomeScorer(lambda data_sources, solution_strs, ground_truths, extra_infos: [1.0]).score_many(
            ["a", "b"], ["x", "y"], ["1", "1"], [None, None])


# ------------------------------------------------------------------------------------------------ safe resumes


_STALLING_WRITER = """
import sys, time
from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
from verl_prm.labeling.runner import run_labeling
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask, scripted_step_score
from verl_prm.labeling.store import ShardStore

task = ScriptedStepTask(num_steps=3)
items = [PromptItem(i, task.prompt(i), str(task.num_steps), "scripted") for i in range(7)]
labeler = MonteCarloLabeler(ScriptedStepGenerator(0.7), ScriptedStepGenerator(0.8), OutcomeScorer(scripted_step_score),
                            LabelSettings(n_cov=2, n_mc=8, prefix_rule="every"))

def stall(path):
    print("wrote", path.name, flush=True)
    time.sleep(120)

run_labeling(items, lambda prompt: prompt, labeler, ShardStore(sys.argv[1]), shard_size=2, progress=False,
             on_shard_written=stall)
"""


def test_second_label_writer_is_refused_and_a_killed_writer_resumes(tmp_path):
    """A live labelling process (a real subprocess, mid-run) locks its directory: run_labeling, `verl-prm label`
    and `label convert` on it fail naming the holder's pid; after kill -9 of the holder the rerun resumes with no
    duplicate and labels equal to an uninterrupted run."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from verl_prm.labeling.cli import main
    from verl_prm.locking import DirectoryLockedError

    task = ScriptedStepTask(num_steps=3)
    items = scripted_items(task, 7)
    settings = LabelSettings(n_cov=2, n_mc=8, prefix_rule="every")
    _run(tmp_path / "reference", items, settings)
    out = tmp_path / "labels"
    child = subprocess.Popen([sys.executable, "-c", _STALLING_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "wrote shard-00000.parquet"
        holder = f"{out} is being written by another process: pid {child.pid} on host {socket.gethostname()} (labelling"
        with pytest.raises(DirectoryLockedError, match=re.escape(holder)):
            _run(out, items, settings)
        with pytest.raises(DirectoryLockedError, match=re.escape(holder)):
            main(["--input", str(tmp_path / "unused.parquet"), "--output-dir", str(out), "--policy", "unused"])
        with pytest.raises(DirectoryLockedError, match=re.escape(holder)):
            main(["convert", "math_shepherd", "--input", str(tmp_path / "unused.jsonl"), "--output-dir", str(out)])
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert not (out / "labels_config.json").exists()  # the refused CLI wrote nothing
    resumed = _run(out, items, settings)
    assert resumed["prompts_skipped"] == 2 and resumed["prompts_labelled"] == 5
    got = read_labels(out).sort_values(["prompt_index", "rollout_index"]).reset_index(drop=True)
    want = read_labels(tmp_path / "reference").sort_values(["prompt_index", "rollout_index"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want)


def _bad_shard_rows() -> list[dict]:
    task = ScriptedStepTask(num_steps=3)
    return scripted_labeler(LabelSettings(n_cov=2, n_mc=4), 0.7, 0.8).label(scripted_items(task, 2),
                                                                          [task.prompt(i) for i in range(2)])


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(q=[5.0] + r["q"][1:], n_mc=[0] * 3, n_success=[0] * 3), "step 0 has q=5.0 outside [0, 1]"),
    (lambda r: r.update(q=[-1.0] + r["q"][1:], n_mc=[0] * 3, n_success=[0] * 3), "step 0 has q=-1.0 outside [0, 1]"),
    (lambda r: r.update(q=r["q"][:2]), "q has 2 entries but there are 3 steps"),
    (lambda r: r.update(n_mc=r["n_mc"][:1]), "n_mc has 1 entries but there are 3 steps"),
    (lambda r: r.update(n_success=[5, 0, 0], n_mc=[4, 4, 0]), "step 0 has n_success=5, n_mc=4"),
    (lambda r: r.update(q=[0.5, 0.5, r["q"][2]], n_success=[1, 2, 0], n_mc=[4, 4, 0]), "step 0 has q=0.5 but n_success/n_mc = 1/4"),
    (lambda r: r.update(step_ends=r["step_ends"][:2] + [len(r["response"]) + 5]), "step 2 span"),
    (lambda r: r.update(step_starts=[0, 0, r["step_starts"][2]]), "step 1 span"),
    (lambda r: r.update(outcome=2.0), "outcome=2.0 is not 0, 1 or NaN"),
    (lambda r: r.update(first_pit=3), "first_pit=3 is not -1 or a step of the 3 steps"),
    (lambda r: r.update(prompt_value=1.5, prompt_n_mc=0, prompt_n_success=0), "prompt_value=1.5 outside [0, 1]"),
    (lambda r: r.update(prompt_value=0.25), "prompt_value=0.25 but prompt_n_success/prompt_n_mc"),
    (lambda r: r.update(score=math.inf), "score=inf is infinite"),
    (lambda r: r.update(data_source=None), "data_source is null"),
    (lambda r: r.update(rollout_index=-1), "rollout_index=-1 is negative"),
])
def test_read_labels_checks_every_column_naming_shard_and_row(tmp_path, change, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_prm.labeling.format import LABEL_SCHEMA

    rows = _bad_shard_rows()
    if message.startswith("prompt_value=0.25"):
        rows[3]["prompt_n_mc"], rows[3]["prompt_n_success"] = 4, 2
    change(rows[3])
    shard = tmp_path / "shard-00000.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=LABEL_SCHEMA), shard)  # bypasses the writer's checks
    index = rows[3]["rollout_index"]
    with pytest.raises(ValueError, match=re.escape(f"label shard {shard} row 3 (prompt_index=1, rollout_index={index}): "
                                                   f"{message}")):
        read_labels(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):  # the writer applies the same checks
        ShardStore(tmp_path / "written").write_shard(rows)


def test_read_labels_checks_column_types(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_prm.labeling.format import LABEL_SCHEMA

    table = pa.Table.from_pylist(_bad_shard_rows(), schema=LABEL_SCHEMA)
    as_text = pa.array([[str(v) for v in q] for q in table.column("q").to_pylist()], type=pa.list_(pa.string()))
    pq.write_table(table.set_column(LABEL_SCHEMA.get_field_index("q"), "q", as_text), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=re.escape(f"label shard {tmp_path / 'a.parquet'}: column q has type "
                                                   "list<element: string>, expected list<item: double>")):
        read_labels(tmp_path)
    # a safe cast is fine: int64 indices written by another tool read as the schema's int32
    wide = table.set_column(1, "rollout_index", table.column("rollout_index").cast(pa.int64()))
    pq.write_table(wide, tmp_path / "a.parquet")
    assert list(read_labels(tmp_path)["rollout_index"]) == [0, 1, 0, 1]


def test_read_labels_refuses_duplicate_rollouts(tmp_path):
    import shutil

    rows = _bad_shard_rows()
    store = ShardStore(tmp_path / "two_writers")
    store.write_shard(rows)
    store.write_shard(rows)  # what two unlocked writers left behind
    first, second = tmp_path / "two_writers" / "shard-00000.parquet", tmp_path / "two_writers" / "shard-00001.parquet"
    with pytest.raises(ValueError, match=re.escape(f"duplicate label rows: {second} row 0 repeats {first} row 0 "
                                                   "(prompt_index=0, rollout_index=0)")):
        read_labels(tmp_path / "two_writers")
    ShardStore(tmp_path / "one").write_shard(rows)
    with pytest.raises(ValueError, match="is given twice"):
        read_labels([tmp_path / "one", tmp_path / "one" / "shard-00000.parquet"])
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "one" / "shard-00000.parquet", tmp_path / "copy" / "shard-00000.parquet")
    with pytest.raises(ValueError, match="duplicate label rows: .*copy/shard-00000.parquet row 0 repeats"):
        read_labels([tmp_path / "one", tmp_path / "copy"])
    # other rollouts of the same prompts (another seed) in another directory are no duplicates
    task = ScriptedStepTask(num_steps=3)
    other = scripted_labeler(LabelSettings(n_cov=2, n_mc=4, seed=9), 0.7, 0.8).label(scripted_items(task, 2),
                                                                                    [task.prompt(i) for i in range(2)])
    ShardStore(tmp_path / "seed9").write_shard(other)
    assert len(read_labels([tmp_path / "one", tmp_path / "seed9"])) == 8


def test_label_run_that_failed_before_its_first_shard_does_not_bind_the_rerun(tmp_path, tiny_lm_dir, repo_data, capsys):
    import shutil

    from verl_prm.labeling.cli import main

    out = tmp_path / "gsm"
    args = ["--input", str(repo_data / "gsm8k_test.jsonl"), "--limit", "1", "--prompt-field", "question",
            "--answer-field", "answer", "--data-source", "openai/gsm8k", "--output-dir", str(out), "--n-cov", "1",
            "--n-mc", "1", "--max-new-tokens", "4", "--device", "cpu", "--no-progress"]
    with pytest.raises(ValueError, match=re.escape("row 0 (line 1): --answer-regex 'Answer: (.*)' does not match")):
        main(args + ["--policy", str(tiny_lm_dir), "--answer-regex", "Answer: (.*)"])
    assert not (out / "labels_config.json").exists()  # bad input fails before anything is written
    with pytest.raises(FileNotFoundError, match="--policy checkpoint .*no_such_model': no such directory"):
        main(args + ["--policy", str(tmp_path / "no_such_model")])  # a missing model: before anything is written
    assert not (out / "labels_config.json").exists()
    broken = tmp_path / "broken_model"  # passes the path checks, fails to load: after the settings were stored
    shutil.copytree(tiny_lm_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="deserializing header"):
        main(args + ["--policy", str(broken)])
    assert (out / "labels_config.json").exists() and not list(out.glob("shard-*"))
    assert main(args + ["--policy", str(tiny_lm_dir)]) == 0
    assert "holds no label shard yet: the new settings replace the stored ones (policy: " in capsys.readouterr().err
    assert len(read_labels(out)) == 1
    with pytest.raises(ValueError, match="holds labels made with other settings"):  # now labels exist: bound
        main(args + ["--policy", str(tiny_lm_dir), "--n-mc", "2"])


def test_known_data_sources_get_verls_ground_truth_extraction(repo_data):
    from verl.utils.reward_score import default_compute_score

    notes = []
    items = read_prompts(repo_data / "gsm8k_test.jsonl", prompt_field="question", answer_field="answer",
                         data_source="openai/gsm8k", notes=notes)
    raw = [json.loads(line) for line in (repo_data / "gsm8k_test.jsonl").read_text().splitlines()]
    assert [item.ground_truth for item in items] == [re.search("#### (.*)", r["answer"]).group(1).replace(",", "")
                                                     for r in raw]
    assert items[0].ground_truth == "18" and any("," in r["answer"].split("####")[1] for r in raw)
    assert notes == [f"ground truth of {len(raw)} of {len(raw)} rows (data_source 'openai/gsm8k'): the GSM8K "
                     "'#### <number>' of 'answer', as verl's preprocessing extracts it; --answer-regex overrides this"]
    correct = raw[0]["answer"]  # the reference solution itself is a correct response
    assert default_compute_score("openai/gsm8k", correct, items[0].ground_truth) == 1.0
    assert default_compute_score("openai/gsm8k", correct, raw[0]["answer"]) == 0.0  # what the old default stored
    math_items = read_prompts(repo_data / "math500_test.jsonl", prompt_field="problem", answer_field="solution",
                              data_source="HuggingFaceH4/MATH-500")
    answers = [json.loads(line)["answer"] for line in (repo_data / "math500_test.jsonl").read_text().splitlines()]
    assert [item.ground_truth for item in math_items] == answers
    explicit = read_prompts(repo_data / "gsm8k_test.jsonl", prompt_field="question", answer_field="answer",
                            data_source="openai/gsm8k", answer_regex="(?s)(.*)", limit=1)
    assert explicit[0].ground_truth == raw[0]["answer"].strip()  # --answer-regex wins
    other = read_prompts(repo_data / "gsm8k_test.jsonl", prompt_field="question", answer_field="answer",
                         data_source="my_source", limit=1)
    assert other[0].ground_truth == raw[0]["answer"]  # unknown sources are left alone


def test_all_failed_seed_rollouts_warn_with_the_likely_cause(tmp_path, repo_data, capsys):
    from verl.utils.reward_score import default_compute_score

    task = ScriptedStepTask(num_steps=3)
    solution = json.loads((repo_data / "gsm8k_test.jsonl").read_text().splitlines()[0])["answer"]
    items = [PromptItem(i, task.prompt(i), solution, "openai/gsm8k") for i in range(3)]
    labeler = MonteCarloLabeler(ScriptedStepGenerator(0.9), ScriptedStepGenerator(0.9),
                                OutcomeScorer(default_compute_score), LabelSettings(n_cov=2, n_mc=2))
    summary = run_labeling(items, lambda p: p, labeler, ShardStore(tmp_path / "zero"), shard_size=2, progress=False)
    assert summary["seed_success_rate"] == 0.0 and len(summary["warnings"]) == 1
    warning = summary["warnings"][0]
    assert warning.startswith("all 6 seed rollouts of this run scored 0 (success iff score > 0.5), so every label is 0")
    assert "the ground truth looks like a whole solution, not a final answer (prompt 0: 'Janet sells" in warning
    assert f"verl-prm label: WARNING: {warning}" in capsys.readouterr().err
    ok = _run(tmp_path / "fine", scripted_items(task, 3), LabelSettings(n_cov=2, n_mc=2))
    assert ok["warnings"] == [] and 0 < ok["seed_success_rate"] < 1


def test_truncated_or_non_utf8_inputs_name_the_file_and_line(tmp_path):
    from verl_prm.labeling.cli import main as label_main

    good = json.dumps({"question": "q", "answer": "#### 1"})
    torn = tmp_path / "torn.jsonl"
    torn.write_text(f"{good}\n{good}\n{good[:9]}")
    with pytest.raises(ValueError, match=re.escape(f"{torn} line 3: not valid JSON (the last line: was the file "
                                                   "cut short?)")):
        read_prompts(torn, prompt_field="question", answer_field="answer", data_source="openai/gsm8k")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(f"{good}\n".encode() + json.dumps({"question": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{latin} line 2: not UTF-8 text")):
        read_prompts(latin, prompt_field="question", answer_field="answer", data_source="x")
    latin.write_bytes(latin.read_bytes().split(b"\n")[1])
    with pytest.raises(ValueError, match=re.escape(f"{latin} line 1: not UTF-8 text")):
        label_main(["convert", "math_shepherd", "--input", str(latin), "--output-dir", str(tmp_path / "ms")])
    prompts = tmp_path / "prompts.parquet"
    pd.DataFrame([{"prompt": "p", "data_source": "x", "reward_model": {"ground_truth": "1"}}] * 50).to_parquet(prompts)
    prompts.write_bytes(prompts.read_bytes()[:-40])
    with pytest.raises(ValueError, match=re.escape(f"prompts file {prompts} is not a readable parquet file")):
        read_prompts(prompts)
    ShardStore(tmp_path / "labels").write_shard(_bad_shard_rows())
    shard = tmp_path / "labels" / "shard-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=re.escape(f"label shard {shard} cannot be read as parquet")):
        read_labels(tmp_path / "labels")

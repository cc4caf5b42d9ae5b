"""Process rewards for code (the sandbox itself: test_sandbox.py): the unit-test verifier on real HumanEval
problems, code step rules and their step_ids, HumanEval/MBPP rows, the verl reward function,
Monte-Carlo labels and search with the verifier, and the code launcher's Hydra composition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sandbox_support import sandbox_processes

from verl_prm.code.data import (
    humaneval_rows,
    humaneval_task,
    mbpp_rows,
    read_jsonl,
    write_parquet,
)
from verl_prm.code.sandbox_config import SandboxConfig
from verl_prm.steps.code import (
    ast_block_starts,
    block_regex,
    code_split_steps,
    code_step_char_spans,
)
from verl_prm.code.verifier import CodeTask, build_program, extract_code, verify, verify_many
from verl_prm.code.verl_score import compute_score, compute_score_batch
from verl_prm.steps import split_steps, step_char_spans

REPO = Path(__file__).resolve().parents[2]
# Ten HumanEval problems spread over the set; the canonical solution of each passes and a mutant fails.
SUBSET = [0, 16, 32, 48, 64, 80, 96, 112, 128, 144]
SWAPS = [(" < ", " >= "), (" > ", " <= "), (" == ", " != "), (" + ", " - "), (" - ", " + "), (" * ", " + ")]


def mutate(solution: str) -> str:
    """A wrong solution: the first operator swap that applies, else a body that returns None."""
    for old, new in SWAPS:
        if old in solution:
            return solution.replace(old, new, 1)
    return "    return None\n"


# ---------------------------------------------------------------------------------------------- verifier


def test_humaneval_canonical_solutions_pass_and_mutants_fail(humaneval):
    problems = [humaneval[i] for i in SUBSET]
    pairs = [(humaneval_task(p), p["canonical_solution"]) for p in problems]
    pairs += [(humaneval_task(p), mutate(p["canonical_solution"])) for p in problems]
    verdicts = verify_many(pairs, SandboxConfig(timeout_s=10), max_workers=2)
    good, bad = verdicts[: len(problems)], verdicts[len(problems):]
    assert [v.reason for v in good] == ["passed"] * len(problems), [(v.task_id, v.detail) for v in good]
    assert not any(v.passed for v in bad)
    assert {v.reason for v in bad} <= {"assertion_failed", "runtime_error"}
    assert [v.task_id for v in good] == [p["task_id"] for p in problems]


def test_build_program_for_a_body_a_full_function_and_a_fenced_chat_answer(humaneval):
    problem = humaneval[0]
    task = humaneval_task(problem)
    body = problem["canonical_solution"]
    function = "def has_close_elements(numbers, threshold):\n" + body
    chat = f"Here you go:\n```python\nfrom typing import List\n\n{function}```\nIt compares all pairs."
    assert extract_code(chat) == f"from typing import List\n\n{function}"
    assert build_program(task, body).startswith(problem["prompt"] + body)
    assert build_program(task, body).endswith("check(has_close_elements)\n")
    for completion in (body, function, chat):
        assert verify(task, completion).passed
    assert verify(task, chat.replace(" < threshold", " > threshold")).reason == "assertion_failed"
    with pytest.raises(ValueError, match="no tests"):
        CodeTask("t", "assert", "", "  ")


def test_verl_compute_score_signature_and_batch(humaneval):
    rows = humaneval_rows([humaneval[i] for i in SUBSET[:3]])
    truths = [row["reward_model"]["ground_truth"] for row in rows]
    solutions = [humaneval[i]["canonical_solution"] for i in SUBSET[:3]]
    wrong = [mutate(s) for s in solutions]
    single = [compute_score("openai_humaneval", s, g, {"index": 0}) for s, g in zip(solutions + wrong, truths * 2)]
    assert [r["score"] for r in single] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert all(r["acc"] == r["score"] for r in single) and single[0]["reason"] == "passed"
    assert compute_score("x", solutions[0], json.loads(truths[0]))["score"] == 1.0  # a dict ground truth
    batch = compute_score_batch(["openai_humaneval"] * 6, solutions + wrong, truths * 2, max_workers=2)
    assert batch == single
    assert compute_score("x", "    while True: pass\n", truths[0], None, timeout_s=1.0, cpu_s=1)["reason"] == "timeout"
    with pytest.raises(TypeError, match="unknown reward_kwargs"):
        compute_score("x", solutions[0], truths[0], None, timeout=3)
    with pytest.raises(ValueError, match="not JSON"):
        compute_score("x", solutions[0], "def f(): pass", None)


# ---------------------------------------------------------------------------------------------- data


def test_humaneval_rows_round_trip_through_parquet_and_the_label_reader(tmp_path, humaneval):
    from verl_prm.labeling.inputs import read_prompts

    assert len(humaneval) == 164
    path = write_parquet(humaneval_rows(humaneval[:5], "test"), tmp_path / "test.parquet")
    items = read_prompts(path)
    assert [item.extra_info["task_id"] for item in items] == [p["task_id"] for p in humaneval[:5]]
    assert items[0].prompt[0]["role"] == "user" and humaneval[0]["prompt"] in items[0].prompt[0]["content"]
    task = CodeTask.from_ground_truth(items[1].ground_truth)
    assert task == humaneval_task(humaneval[1])
    assert compute_score(items[1].data_source, items[1].extra_info["reference"], items[1].ground_truth)["score"] == 1.0


def test_humaneval_preparation_script_writes_a_seeded_split(tmp_path):
    script = REPO / "examples" / "code" / "prepare_humaneval.py"
    out = subprocess.run([sys.executable, str(script), "--local_save_dir", str(tmp_path), "--test_size", "20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import pandas as pd

    train, test = pd.read_parquet(tmp_path / "train.parquet"), pd.read_parquet(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (144, 20)
    ids = [e["task_id"] for e in train["extra_info"]] + [e["task_id"] for e in test["extra_info"]]
    assert len(set(ids)) == 164


def test_mbpp_rows_from_jsonl_are_scored_by_their_asserts(tmp_path):
    # Records in MBPP's layout (task_id, text, code, test_list, test_setup_code), as the hub serves them.
    records = [
        {"task_id": 901, "text": "Write a function to find the shared elements from the given two lists.",
         "code": "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n",
         "test_list": ["assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
                       "assert similar_elements((1, 2, 3, 4), (5, 4, 3, 7)) == (3, 4)"],
         "test_setup_code": ""},
        {"task_id": 902, "text": "Write a python function to identify non-prime numbers.",
         "code": "import math\ndef is_not_prime(n):\n    if n < 2:\n        return True\n"
                 "    for i in range(2, int(math.sqrt(n)) + 1):\n        if n % i == 0:\n            return True\n"
                 "    return False\n",
         "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                       "assert is_not_prime(35) == True"],
         "test_setup_code": "import math"},
    ]
    jsonl = tmp_path / "mbpp.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = mbpp_rows(read_jsonl(jsonl), "test")
    tasks = [CodeTask.from_ground_truth(r["reward_model"]["ground_truth"]) for r in rows]
    assert [t.entry_point for t in tasks] == ["similar_elements", "is_not_prime"]
    assert "assert is_not_prime(10) == True" in rows[1]["prompt"][0]["content"]
    fenced = [f"```python\n{r['code']}```" for r in records]
    wrong = [records[0]["code"].replace("&", "|"), records[1]["code"].replace("    return False\n", "    return True\n")]
    scores = compute_score_batch(["mbpp"] * 4, fenced + wrong, [r["reward_model"]["ground_truth"] for r in rows] * 2,
                                 max_workers=2)
    assert [s["score"] for s in scores] == [1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------- steps


def test_block_rule_equals_the_indent_regex_on_every_humaneval_solution(humaneval):
    total_steps = 0
    for problem in humaneval:
        body = problem["canonical_solution"]
        spans = code_step_char_spans(body, "block")
        assert ast_block_starts(body) is not None, problem["task_id"]
        assert spans == code_step_char_spans(body, "indent") == step_char_spans(body, None, regex=block_regex(4))
        assert "".join(body[s:e] for s, e in spans) == body  # the steps tile the text
        assert spans[0][0] == 0 and spans[-1][1] == len(body)
        total_steps += len(spans)
    assert total_steps > 2 * len(humaneval)


def test_block_rule_on_real_solutions_and_its_options(humaneval):
    body = humaneval[0]["canonical_solution"]
    steps = [body[s:e] for s, e in code_step_char_spans(body)]
    assert steps == [body[: body.index("    return False")], "    return False\n"]
    # depth 1: the loop's body statement starts its own step
    deep = [body[s:e] for s, e in code_step_char_spans(body, depth=1)]
    assert deep[0] == "    for idx, elem in enumerate(numbers):\n" and len(deep) == 3
    # a whole function (a chat answer): docstring stays in one step with the ast rule
    full = humaneval[0]["prompt"] + body
    full_steps = [full[s:e] for s, e in code_step_char_spans(full, depth=1)]
    assert full_steps[0] == "from typing import List\n\n\n"
    assert full_steps[1] == "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    assert full_steps[2].lstrip().startswith('"""') and full_steps[2].rstrip().endswith('"""')
    assert full_steps[-1] == "    return False\n"
    # comments, decorators, clauses, multi-line expressions
    code = ("# helper\nimport math\n@staticmethod\ndef f(x):\n    return x\nif x:\n    y = [1,\n2]\nelse:\n"
            "    y = 3\n\ntry:\n    pass\nexcept E:\n    pass\n")
    texts = [code[s:e] for s, e in code_step_char_spans(code)]
    assert texts == ["# helper\nimport math\n", "@staticmethod\ndef f(x):\n    return x\n",
                     "if x:\n    y = [1,\n2]\nelse:\n    y = 3\n\n", "try:\n    pass\nexcept E:\n    pass\n"]
    # text that does not parse falls back to the indent rule (a response cut mid-statement)
    cut = body[: body.index("distance = abs(") + 15]
    assert ast_block_starts(cut) is None
    assert code_step_char_spans(cut) == step_char_spans(cut, None, regex=block_regex(4))
    # line rule and delimiter rule are verl_prm.steps' own
    assert code_step_char_spans(body, "line") == step_char_spans(body, "\n")
    assert code_step_char_spans(body, "delimiter", delimiter="\n\n") == step_char_spans(body, "\n\n")
    assert code_step_char_spans("  \n\n", "block") == [] and code_step_char_spans("", "line") == []
    assert len(code_step_char_spans(full, depth=1, max_steps=2)) == 2
    with pytest.raises(ValueError, match="code step rule"):
        code_step_char_spans(body, "sentences")


def _tokenize(tokenizer, texts):
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row)  # left padded, as some rollouts are
        mask[b, width - len(row):] = 1
    return ids, mask


def test_code_split_steps_follows_the_split_steps_contract(humaneval, bpe_large, bpe_small):
    texts = [p["canonical_solution"] for p in humaneval[:24]] + ["", "    x = 'é€😀'\n    return x\n"]
    for tokenizer in (bpe_large, bpe_small):
        ids, mask = _tokenize(tokenizer, texts)
        for rule, reference in (("line", dict(delimiter="\n")), ("indent", dict(delimiter=None, regex=block_regex(4)))):
            ours = code_split_steps(ids, mask, tokenizer, rule, base_indent=4, max_steps=6)
            theirs = split_steps(ids, mask, tokenizer, max_steps=6, **reference)
            for name in ("step_ids", "num_steps", "step_ends", "merged_steps", "collapsed_steps", "step_char_ends"):
                assert torch.equal(getattr(ours, name), getattr(theirs, name)), (rule, name)
        block = code_split_steps(ids, mask, tokenizer, "block")
        for b, text in enumerate(block.texts):
            spans = code_step_char_spans(text, "block")
            assert block.texts[b] == texts[b]
            assert int(block.num_steps[b]) == len(spans) - int(block.collapsed_steps[b])
            # each step's last token holds its last character; tokens of step h come before step h+1's
            for h in range(int(block.num_steps[b])):
                end_token = int(block.step_ends[b, h])
                assert int(block.step_ids[b, end_token]) == h
                assert block.step_texts(b)[h] == text[(0 if h == 0 else int(block.step_char_ends[b, h - 1])):
                                                      int(block.step_char_ends[b, h])]
            valid = mask[b].bool() & (ids[b] != tokenizer.eos_token_id)
            if len(spans):
                assert (block.step_ids[b][valid] >= 0).all()
            assert (block.step_ids[b][~valid] == -1).all()


# ---------------------------------------------------------------------------------------------- labels, search


@pytest.fixture(scope="module")
def scripted_problems(humaneval):
    """Three HumanEval problems whose tests fail when any step of the reference body returns None early."""
    from scripted_code import wrong_step

    chosen = []
    for index in (0, 2, 4, 12, 22):
        problem = humaneval[index]
        body = problem["canonical_solution"]
        steps = [body[s:e] for s, e in code_step_char_spans(body)]
        if len(steps) >= 2:
            chosen.append(problem)
        if len(chosen) == 3:
            break
    tasks = [humaneval_task(p) for p in chosen]
    # every single-step corruption of every reference fails its tests (the closed-form values need it)
    pairs = []
    for task, problem in zip(tasks, chosen):
        body = problem["canonical_solution"]
        spans = code_step_char_spans(body)
        for h in range(len(spans)):
            steps = [body[s:e] for s, e in spans]
            steps[h] = wrong_step(steps[h])
            pairs.append((task, "".join(steps)))
    assert not any(v.passed for v in verify_many(pairs, max_workers=2))
    return chosen, tasks


def test_monte_carlo_labels_with_the_unit_test_verifier_equal_the_closed_form(scripted_problems):
    from scripted_code import ScriptedCodeGenerator
    from verl_prm.labeling.inputs import PromptItem
    from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
    from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function

    problems, tasks = scripted_problems
    prompts = [p["prompt"] for p in problems]
    references = [p["canonical_solution"] for p in problems]
    policy = ScriptedCodeGenerator(prompts, references, p_correct=0.5)
    prover = ScriptedCodeGenerator(prompts, references, p_correct=1.0)
    # the CLI's extension point: --reward-fn verl_prm/code/verl_score.py:compute_score
    scorer = OutcomeScorer(load_reward_function(str(REPO / "verl_prm" / "code" / "verl_score.py") + ":compute_score"))
    settings = LabelSettings(n_cov=3, n_mc=2, delimiter=None, step_regex=block_regex(4), seed=3)
    items = [PromptItem(i, prompts[i], t.to_ground_truth(), "openai_humaneval") for i, t in enumerate(tasks)]
    rows = MonteCarloLabeler(policy, prover, scorer, settings).label(items, prompts)
    assert len(rows) == 9
    saw_pit = saw_success = False
    for row in rows:
        response = row["response"]
        spans = list(zip(row["step_starts"], row["step_ends"]))
        assert spans == code_step_char_spans(response, "block")  # the labeller's regex steps are the ast blocks
        wrong = [response[s:e].rstrip().endswith("# wrong step") for s, e in spans]
        for h, q in enumerate(row["q"]):
            # the prover writes every remaining step correctly: Q = 1 until the first wrong step, then 0
            assert q == (0.0 if any(wrong[: h + 1]) else 1.0), (row["prompt_index"], h, wrong, row["q"])
        assert row["outcome"] == (0.0 if any(wrong) else 1.0)
        assert row["prompt_value"] == 1.0
        saw_pit |= any(wrong)
        saw_success |= not any(wrong)
    assert saw_pit and saw_success


def test_search_with_the_unit_test_critic(scripted_problems):
    from scripted_code import ScriptedCodeGenerator
    from verl_prm.code.search import UnitTestCritic
    from verl_prm.search import (
        BeamConfig,
        BestOfNConfig,
        CachedCritic,
        GreedyConfig,
        beam_search,
        best_of_n,
        greedy_step_search,
        node_seed,
    )

    problems, tasks = scripted_problems
    prompts = [p["prompt"] for p in problems]
    references = [p["canonical_solution"] for p in problems]
    policy = ScriptedCodeGenerator(prompts, references, p_correct=0.6)
    prover = ScriptedCodeGenerator(prompts, references, p_correct=1.0)
    critic = UnitTestCritic(tasks, prompts, prover, n_rollouts=1, max_workers=2)
    ids = list(range(len(problems)))

    def passes(node) -> bool:
        return verify(tasks[node.problem], "".join(node.steps)).passed

    # best-of-N with the verifier as ORM picks a passing sample whenever one of the N passes
    chosen = best_of_n(ids, policy, CachedCritic(critic), BestOfNConfig(n=4, rank="orm", seed=1))
    samples = policy.sample_responses(ids, 4, [node_seed(1, "best_of_n", p) for p in ids])  # best_of_n's draws
    for result, group in zip(chosen, samples):
        assert passes(result.node) == any(passes(node) for node in group)
        assert result.score == float(passes(result.node))
    # greedy step search accepts a step iff its continuations pass: every answer passes
    greedy = greedy_step_search(ids, policy, CachedCritic(critic),
                                GreedyConfig(threshold=0.5, accept_on="value", max_retries=6, max_backtracks=0, seed=2))
    assert all(passes(r.node) for r in greedy)
    assert all(r.info["rejected"] + r.info["accepted"] == r.compute.step_samples for r in greedy)
    assert any(r.info["rejected"] > 0 for r in greedy)
    # beam search on Q (the verifier's values) keeps a correct beam
    beams = beam_search(ids, policy, CachedCritic(critic), None,
                        BeamConfig(beam_width=2, samples_per_beam=2, alpha=0.0, max_steps=8, seed=3))
    assert all(passes(r.node) and r.score == 1.0 for r in beams)
    assert critic.sandbox_runs > 0 and sandbox_processes() == []


# ---------------------------------------------------------------------------------------------- launcher


def test_code_launcher_composes_with_verl_and_passes_validation(tmp_path, bpe_small):
    import verl
    from hydra import compose, initialize_config_dir
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_prm.integrations.verl.run_config import validate_run_config

    critic = tmp_path / "critic"
    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=bpe_small.pad_token_id)
    Qwen2ForTokenClassification(config).save_pretrained(critic)
    bpe_small.save_pretrained(critic)
    bin_dir, capture = tmp_path / "bin", tmp_path / "call"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{capture}"\n')
    fake.chmod(0o755)
    script = REPO / "examples" / "code" / "run_qwen2_5_coder_0_5b_humaneval_pav_grpo.sh"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(tmp_path), CRITIC_PATH=str(critic))
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = capture.read_bytes().decode().split("\0")[:-1]
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"]
    config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        composed = compose("ppo_trainer", overrides=argv[2:])
    validate_config(composed, use_reference_policy=need_reference_policy(composed), use_critic=need_critic(composed))
    hook, pav = validate_run_config(composed)
    assert hook.steps.code_rule == "block" and hook.steps.code_depth == 1 and hook.steps.delimiter is None
    assert hook.steps.regex is None and hook.steps.max_tokens is None
    assert composed.reward.custom_reward_function.path == "pkg://verl_prm.code.verl_score"
    assert composed.reward.reward_manager.name == "pav" and composed.algorithm.adv_estimator == "pav_grpo"
    # the reward function verl loads from that path scores with the sandbox
    from verl.trainer.ppo.reward import get_custom_reward_fn

    reward_fn = get_custom_reward_fn(composed)
    task = CodeTask("t", "assert", "", "assert add(2, 3) == 5")
    assert reward_fn(data_source="x", solution_str="def add(a, b):\n    return a + b\n",
                     ground_truth=task.to_ground_truth(), extra_info={})["score"] == 1.0
    assert reward_fn(data_source="x", solution_str="def add(a, b):\n    return a - b\n",
                     ground_truth=task.to_ground_truth(), extra_info={})["reason"] == "assertion_failed"


# ---------------------------------------------------------------------------------------------- CLIs


@pytest.fixture(scope="module")
def tiny_code_models(tmp_path_factory, humaneval):
    """A tiny random causal LM (its samples are noise: almost always a syntax error) and a tiny value-head critic
    with its tokenizer, trained on HumanEval text, plus three HumanEval rows as parquet."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForTokenClassification

    from tiny_model import write_tiny_causal_lm

    root = tmp_path_factory.mktemp("code_cli")
    texts = [p["prompt"] + p["canonical_solution"] for p in humaneval]
    policy = write_tiny_causal_lm(texts, root / "policy", vocab_size=400, hidden_size=32, num_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForTokenClassification(config).save_pretrained(root / "critic")
    tokenizer.save_pretrained(root / "critic")
    rows = write_parquet(humaneval_rows(humaneval[:3]), root / "humaneval.parquet")
    return policy, root / "critic", rows


def test_label_cli_scores_code_with_the_reward_fn_extension_point(tiny_code_models, tmp_path):
    import pandas as pd

    from verl_prm.labeling.cli import main

    policy, _, rows = tiny_code_models
    out = tmp_path / "labels"
    assert main(["--input", str(rows), "--policy", str(policy), "--output-dir", str(out), "--n-cov", "2",
                 "--n-mc", "1", "--max-new-tokens", "24", "--device", "cpu", "--no-progress",
                 "--delimiter", "\\n\\n", "--step-regex", block_regex(0, depth=1),
                 "--reward-fn", str(REPO / "verl_prm" / "code" / "verl_score.py") + ":compute_score"]) == 0
    labels = pd.concat([pd.read_parquet(p) for p in sorted(out.glob("*.parquet"))])
    assert len(labels) == 6
    for _, row in labels.iterrows():
        # the noise the tiny policy writes fails its tests; the labels are its outcomes and prefix values
        ground = CodeTask.from_ground_truth(row["ground_truth"])
        assert row["outcome"] == float(verify(ground, row["response"]).passed) == 0.0
        assert [int(e) for e in row["step_ends"]] == [e for _, e in step_char_spans(row["response"], None,
                                                                                     regex=block_regex(0, depth=1))]


def test_search_cli_runs_on_code_with_the_unit_test_outcome(tiny_code_models, tmp_path, humaneval):
    from verl_prm.search.cli import main

    policy, critic, rows = tiny_code_models
    out = tmp_path / "search"
    assert main(["--input", str(rows), "--policy", str(policy), "--q-critic", str(critic),
                 "--output-dir", str(out), "--methods", "best_of_n,greedy", "--n", "1", "--max-steps", "3",
                 "--max-step-tokens", "8", "--max-response-tokens", "16", "--device", "cpu",
                 "--step-regex", block_regex(0, depth=1),
                 "--reward-fn", str(REPO / "verl_prm" / "code" / "verl_score.py") + ":compute_score"]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"best_of_n", "greedy"} and len(records) == 6
    tasks = [humaneval_task(p) for p in humaneval[:3]]
    for record in records:  # the search's outcome is the sandboxed unit tests' verdict on the chosen response
        assert record["reward"] == float(verify(tasks[record["problem"]], record["response"]).passed)


def test_label_settings_split_by_a_code_rule():
    from verl_prm.labeling.cli import label_parser
    from verl_prm.labeling.monte_carlo import LabelSettings

    text = "def f(x):\n    y = [\n        1,\n    ]\n    return y\n"
    spans = LabelSettings(code_rule="block", code_depth=1).step_spans(text)
    assert spans == [tuple(span) for span in code_step_char_spans(text, "block", depth=1)]
    assert [text[s:e] for s, e in spans] == ["def f(x):\n", "    y = [\n        1,\n    ]\n", "    return y\n"]
    assert LabelSettings().step_spans("A.\n\nB.") == [(0, 4), (4, 6)]
    for options, message in (({"code_rule": "ast"}, "code_rule must be"),
                             ({"code_rule": "line", "step_regex": "x"}, "not both"),
                             ({"code_depth": -1}, "code_depth must be an integer >= 0"),
                             ({"code_depth": 1}, "code_depth \\(--code-depth 1\\) applies to a code rule only")):
        with pytest.raises(ValueError, match=message):
            LabelSettings(**options)
    args = label_parser().parse_args(["--input", "x", "--output-dir", "o", "--policy", "p", "--reward-fn", "f",
                                      "--code-rule", "block", "--code-depth", "1"])
    assert (args.code_rule, args.code_depth) == ("block", 1)

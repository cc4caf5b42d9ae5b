"""The arithmetic task: generator and verifier, slips, the verl score function and rows, the tokenizer, and the
RL advantage path on a recipe batch."""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd
import pytest
import torch

from verl_prm.apps.arithmetic.score import DATA_SOURCE, compute_score, extract_answer
from verl_prm.apps.arithmetic.task import (
    STEP_REGEX,
    Problem,
    TaskConfig,
    generate_problems,
    prefix_correctness,
    prefix_is_correct,
    problem_from_row,
    sft_example,
    solution_lines,
    verl_row,
)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = [
    TaskConfig(),
    TaskConfig(min_ops=1, max_ops=2, modulus=7, max_operand=6),
    TaskConfig(min_ops=3, max_ops=6, modulus=97, max_operand=96, ops="*-"),
]


# ------------------------------------------------------------------------------------------- task


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "mod7", "mod97"])
def test_every_solution_without_a_slip_verifies_and_every_slip_fails(config):
    problems = generate_problems(60, config, seed=11)
    for problem in problems:
        reference = "\n".join(solution_lines(problem))
        assert compute_score(DATA_SOURCE, reference, str(problem.answer)) == 1.0
        assert prefix_correctness(problem, reference) == [True] * (len(problem.ops) + 1)
        for h in range(len(problem.ops)):
            # every wrong value at every step (a sample of them at mod 97)
            wrong = [v for v in range(problem.modulus) if v != problem.values[h]]
            for value in wrong if problem.modulus < 20 else random.Random(h).sample(wrong, 5):
                slipped = "\n".join(solution_lines(problem, h, value))
                assert compute_score(DATA_SOURCE, slipped, str(problem.answer)) == 0.0, (problem, h, value)
                truth = prefix_correctness(problem, slipped)
                assert truth == [True] * h + [False] * (len(problem.ops) + 1 - h)
                lines = slipped.split("\n")
                prefixes = ["\n".join(lines[: k + 1]) for k in range(len(lines))]
                assert [prefix_is_correct(problem, p, complete=k == len(lines) - 1)
                        for k, p in enumerate(prefixes)] == truth


def test_solution_format_one_line_per_operation_then_the_answer():
    problem = Problem(5, (("+", 7), ("*", 3), ("-", 4)), 13)
    assert problem.prompt_text == "5 +7 *3 -4 mod 13"
    assert ((5 + 7) * 3 - 4) % 13 == problem.answer == 6
    assert solution_lines(problem) == ["5+7=12 *3 -4", "12*3=10 -4", "10-4=6", "answer 6"]
    assert solution_lines(problem, 1, 0) == ["5+7=12 *3 -4", "12*3=0 -4", "0-4=9", "answer 9"]
    with pytest.raises(ValueError, match="wrong result"):
        solution_lines(problem, 1, problem.values[1])


def test_sft_slips_have_the_documented_rate_and_fail():
    config = TaskConfig(slip_rate=0.3)
    rng = random.Random(0)
    problems = generate_problems(2000, config, seed=5)
    outcomes = [(sft_example(p, rng, config.slip_rate), p) for p in problems]
    slip_share = sum(slip >= 0 for (_, slip), _ in outcomes) / len(outcomes)
    assert abs(slip_share - 0.3) < 0.04  # binomial std 0.01
    for (text, slip), problem in outcomes:
        assert compute_score(DATA_SOURCE, text, problem.answer) == float(slip < 0)
    steps = [slip for (_, slip), _ in outcomes if slip >= 0]
    assert len(set(steps)) == config.max_ops  # slips land on every step position


def test_per_step_slips_have_the_documented_rate_fail_and_never_repair():
    """step_slip_rate: each operation slips independently, so (1 - q)^ops of the solutions are right; a solution
    with slips always fails (a later slip never writes the true value back), and its prefix is wrong from the
    first slip on."""
    config = TaskConfig(min_ops=5, max_ops=5, modulus=5, max_operand=4, slip_rate=0.0, step_slip_rate=0.25)
    rng = random.Random(0)
    problems = generate_problems(4000, config, seed=5)
    examples = [(sft_example(p, rng, 0.0, config.step_slip_rate), p) for p in problems]
    clean = sum(slip < 0 for (_, slip), _ in examples) / len(examples)
    assert abs(clean - 0.75 ** 5) < 0.03  # binomial std 0.0075
    for (text, slip), problem in examples:
        assert compute_score(DATA_SOURCE, text, problem.answer) == float(slip < 0)
        correct = prefix_correctness(problem, text)
        assert correct == [slip < 0 or h < slip for h in range(len(correct))]
    with pytest.raises(ValueError, match="either slip_rate"):
        TaskConfig(slip_rate=0.3, step_slip_rate=0.1)
    with pytest.raises(ValueError, match=r"step_slip_rate must be in \[0, 1\)"):
        TaskConfig(slip_rate=0.0, step_slip_rate=1.0)


def test_sweep_statistics_against_their_definitions():
    import numpy as np

    from verl_prm.apps.arithmetic.measure import group_statistics, step_accuracy

    outcomes = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    assert group_statistics(outcomes) == {"success": 5 / 16, "zero_signal_groups": 0.75, "all_fail_groups": 0.5,
                                          "group_size": 4}
    with pytest.raises(ValueError, match="G >= 2"):
        group_statistics(np.zeros((3, 1)))
    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    texts = ["3+2=5 *3\n5*3=1\nanswer 1", "3+2=5 *3\n5*3=2\nanswer 2", "3+2=6 *3\n6*3=4\nanswer 4"]
    result = step_accuracy([problem], texts, [0, 0, 0])
    # step 0: right in 2 of 3; step 1 (after a right step 0): right in 1 of 2
    assert result["step_accuracy_by_step"] == [2 / 3, 1 / 2] and result["step_accuracy"] == pytest.approx(3 / 5)


def test_generator_is_deterministic_distinct_and_excludes():
    a = generate_problems(300, TaskConfig(), seed=1)
    assert a == generate_problems(300, TaskConfig(), seed=1)
    assert len({p.prompt_text for p in a}) == 300
    b = generate_problems(300, TaskConfig(), seed=2, exclude=[p.prompt_text for p in a])
    assert not {p.prompt_text for p in a} & {p.prompt_text for p in b}
    assert all(2 <= len(p.ops) <= 4 for p in a)


@pytest.mark.parametrize("kwargs, message", [
    (dict(modulus=12, max_operand=5), "prime"),
    (dict(modulus=7, max_operand=7), "max_operand"),
    (dict(min_ops=3, max_ops=2), "min_ops"),
    (dict(ops="+/"), "ops"),
    (dict(slip_rate=1.5), "slip_rate"),
])
def test_task_config_rejects_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TaskConfig(**kwargs)


def test_verifier_edge_cases():
    assert extract_answer("3+1\nanswer 4\n") == 4
    assert extract_answer("answer 4\nmore") is None
    assert compute_score(DATA_SOURCE, "", "4") == 0.0
    assert compute_score(DATA_SOURCE, "answer four", "4") == 0.0
    with pytest.raises(ValueError, match="data_source"):
        compute_score("openai/gsm8k", "answer 4", "4")


def test_score_file_loads_through_verls_custom_reward_loader():
    from verl.utils.import_utils import load_extern_object

    from verl_prm.apps.arithmetic.verl_rl import SCORE_FILE

    assert SCORE_FILE == REPO / "verl_prm" / "apps" / "arithmetic" / "score.py"
    fn = load_extern_object(module_path=str(SCORE_FILE), object_name="compute_score")
    assert fn(DATA_SOURCE, "5\nanswer 5", "5") == 1.0
    assert fn(DATA_SOURCE, "5\nanswer 6", "5") == 0.0


def test_verl_rows_round_trip():
    problems = generate_problems(5, TaskConfig(), seed=3)
    rows = [verl_row(p, "test", i) for i, p in enumerate(problems)]
    frame = pd.DataFrame(rows)
    assert list(frame.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    for row, problem in zip(rows, problems):
        assert row["prompt"] == [{"role": "user", "content": problem.prompt_text}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(problem.answer)}
        assert problem_from_row(row) == problem


def test_tokenizer_is_per_character_and_renders_like_verl_prm_label():
    from verl_prm.labeling.inputs import render_prompt
    from verl_prm.apps.arithmetic.model import build_tokenizer, render

    tokenizer = build_tokenizer()
    text = "5 +12 *3 -4 mod 13\n5+12=4 *3 -4\nanswer 6"
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == len(text)
    chat = [{"role": "user", "content": "1+2 mod 7"}]
    assert render(tokenizer, "1+2 mod 7") == render_prompt(chat, tokenizer) == "1+2 mod 7\n"


def test_rl_batch_advantages_follow_the_lines(tmp_path):
    """The CPU loop's DataProto path: split_steps gives one step per operation (``STEP_REGEX``), pav_grpo adds
    alpha * A_h to the tokens of step h only, and at alpha = 0 equals verl's grpo on the same batch."""
    import verl  # noqa: F401  (registers pav_grpo)
    from omegaconf import OmegaConf

    from verl.trainer.ppo.ray_trainer import compute_advantage

    from verl_prm.integrations.verl.advantage import StepInputs, estimator_step_inputs
    from verl_prm.apps.arithmetic.model import build_tokenizer
    from verl_prm.apps.arithmetic.batch import build_data
    from verl_prm.apps.arithmetic.rollout import Rollouts
    from verl_prm.steps import split_steps

    tokenizer = build_tokenizer()
    texts = ["1*3=3 -4\n3-4=12\n12*2=11\nanswer 11", "2*3=6 -4\n6-4=2\n2*2=4\nanswer 4", "6+6=12\nanswer 12",
             "3+2=5\nanswer 5"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, ids))
    responses = torch.full((4, width), tokenizer.pad_token_id)
    mask = torch.zeros(4, width)
    for row, r in enumerate(ids):
        responses[row, : len(r)] = torch.tensor(r)
        mask[row, : len(r)] = 1
    rollouts = Rollouts(torch.zeros(4, 1, dtype=torch.long), responses, torch.cat([torch.ones(4, 1), mask], 1).long(),
                        mask, texts, [True] * 4, [0, 0, 1, 1])
    split = split_steps(responses, mask, tokenizer, regex=STEP_REGEX)
    assert split.num_steps.tolist() == [4, 4, 2, 2]
    # a step ends at its result; the carried operations and the newline open the next step
    assert split.step_texts(0) == ["1*3=3", " -4\n3-4=12", "\n12*2=11", "\nanswer 11"]
    values = torch.tensor([[0.8, 0.1, 0.1, 0.0], [0.9, 0.9, 0.9, 1.0], [0.2, 0.0, 0, 0], [0.6, 1.0, 0, 0]])
    steps = {"step_ids": split.step_ids, "num_steps": split.num_steps, "step_values": values,
             "prompt_values": torch.tensor([0.5, 0.5, 0.4, 0.4])}
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])
    uids = ["a", "a", "b", "b"]

    inputs = StepInputs(steps["step_ids"], steps["step_values"], steps["prompt_values"], steps["num_steps"],
                        torch.zeros(4, dtype=torch.bool))

    def advantages(estimator, alpha):
        """verl's compute_advantage inside estimator_step_inputs, the trainer hook's path."""
        config = OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True,
                                   "pav": {"alpha": alpha, "best_of_k": 1}})
        with estimator_step_inputs(inputs):
            data = compute_advantage(build_data(rollouts, rewards, uids), adv_estimator=estimator, config=config)
        return data.batch["advantages"]

    grpo = advantages("grpo", 0.0)
    assert torch.allclose(advantages("pav_grpo", 0.0), grpo)
    pav = advantages("pav_grpo", 2.0)
    progress = torch.diff(torch.cat([steps["prompt_values"][:, None], values], 1), dim=1)
    for row in range(4):
        for t in range(width):
            h = int(split.step_ids[row, t])
            expected = grpo[row, t] + (2.0 * progress[row, h] if h >= 0 else 0.0) * mask[row, t]
            assert torch.isclose(pav[row, t], expected, atol=1e-6), (row, t)
    assert (pav[mask == 0] == 0).all()

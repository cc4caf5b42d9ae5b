"""The arithmetic recipe: generator and verifier, the verl score function, the RL advantage path, a micro run of
the whole recipe (every stage for real, a few optimisation steps each; resume), and the GPU launcher's verl
overrides composed with verl's own config."""

from __future__ import annotations

import json
import os
import random
import subprocess
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
EXAMPLE = REPO / "examples" / "arithmetic"
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

    from verl_prm.integrations.verl.advantage import compute_advantage_with_steps
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

    def advantages(estimator, alpha):
        config = OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True,
                                   "pav": {"alpha": alpha, "best_of_k": 1}})
        return compute_advantage_with_steps(build_data(rollouts, rewards, uids, steps), config).batch["advantages"]

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


# ------------------------------------------------------------------------------------------- micro run


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    from verl_prm.apps.arithmetic.pipeline import SCALES, run

    work = tmp_path_factory.mktemp("arithmetic_micro")
    torch_threads = torch.get_num_threads()
    records = run(SCALES["micro"], work, progress=False, log=lambda *_: None)
    torch.set_num_threads(torch_threads)
    return work, records


def test_micro_run_of_the_whole_recipe(micro_run):
    from transformers import AutoModelForCausalLM

    from verl_prm.labeling.format import read_labels

    work, records = micro_run
    assert set(records) == {"data", "sft", "prover", "label", "pav", "rl", "evaluate"}
    # (a) the policy in Hugging Face format with safetensors and its tokenizer
    assert (work / "policy" / "model.safetensors").exists() and (work / "policy" / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(work / "policy", trust_remote_code=False)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    # (b) the exact prover's p: the SFT policy's per-step accuracy, a probability
    prover = records["prover"]["outputs"]
    assert 0 < prover["step_accuracy"] <= 1 and 0 <= prover["zero_signal_groups"] <= 1
    # (c) Monte-Carlo labels of `verl-prm label`: the prover is the policy, raw counts kept
    labels = read_labels(work / "labels")
    assert len(labels) == 3 and all(len(q) == len(n) for q, n in zip(labels["q"], labels["n_mc"]))
    # (d) a value-head PAV of `verl-prm train`
    checkpoint = Path(records["pav"]["outputs"]["checkpoint"])
    assert (checkpoint / "model.safetensors").exists()
    # (e) RL through verl's own main_ppo (PAV-GRPO with the exact prover): verl's file logger has the held-out
    # accuracy before training and after each step, the pav/* metrics of every step; the merged final policy
    run = records["rl"]["outputs"]["pav_exact_seed0"]
    assert [point[0] for point in run["curve"]] == [0, 1, 2]
    assert [t["step"] for t in run["training"]] == [1, 2]
    assert all(0 <= t["zero_signal_groups"] <= 1 for t in run["training"])
    metrics = [json.loads(x) for x in (work / "rl" / "pav_exact_seed0" / "metrics.jsonl").read_text().splitlines()]
    trained = [m["data"] for m in metrics if "actor/pg_loss" in m["data"]]
    assert len(trained) == 2 and all(m["pav/process_term/std"] == m["pav/process_term/std"] for m in trained)
    # verl's validation with 4 samples per test prompt, before training and after each step
    assert sum("val-core/arithmetic_mod/acc/mean@4" in m["data"] for m in metrics) == 3
    assert (work / "rl" / "pav_exact_seed0" / "final" / "model.safetensors").exists()
    command = (work / "rl" / "pav_exact_seed0" / "command.sh").read_text()
    assert "verl.trainer.main_ppo" in command and "verl_prm.critic.format=exact" in command
    # (f) the table and the plots
    results = json.loads((work / "results" / "results.json").read_text())
    assert set(results["search"]) == {"learned", "exact"}
    assert all({r["method"] for r in rows} == {"best_of_n", "beam_pav"} for rows in results["search"].values())
    assert set(results["arms"]) == {"pav_exact"} and results["arms"]["pav_exact"]["seeds"] == [0]
    assert "PAV-GRPO, exact prover" in (work / "results" / "results.md").read_text()
    for png in ("accuracy_vs_rl_steps.png", "accuracy_vs_rl_samples.png", "zero_signal_groups.png",
                "search_accuracy_vs_compute.png"):
        assert (work / "results" / png).read_bytes()[:4] == b"\x89PNG"


def test_rerun_skips_complete_stages_and_says_which_setting_changed(micro_run):
    from dataclasses import replace

    from verl_prm.apps.arithmetic.pipeline import SCALES, run

    work, _ = micro_run
    before = {p: p.stat().st_mtime_ns for p in work.rglob("DONE.json")}
    messages: list[str] = []
    run(SCALES["micro"], work, progress=False, log=messages.append)
    assert sum("complete, skipped" in m for m in messages) == 7
    assert {p: p.stat().st_mtime_ns for p in work.rglob("DONE.json")} == before
    other = replace(SCALES["micro"], sft=replace(SCALES["micro"].sft, steps=5))
    with pytest.raises(ValueError, match=r"other settings \(model.*sft.steps: 4 -> 5\)|other settings \(sft.steps: 4 -> 5\)"):
        run(other, work, progress=False, log=lambda *_: None)


def test_pav_on_a_checking_backbone_trains_only_its_value_head(tmp_path):
    """Scale.critic_init: the pav stage teaches the policy the check (pav/backbone), then trains only the value
    head on it; another critic_init is refused by the finished stage and by a half-finished one (backbone only)."""
    from dataclasses import asdict, replace

    from safetensors.torch import load_file

    from verl_prm.apps.arithmetic.critic_init import CriticInitConfig
    from verl_prm.apps.arithmetic.pipeline import SCALES, run

    init = CriticInitConfig(steps=2, batch_size=4, eval_every=1, eval_fraction=0.25, check_weight=1.0)
    scale = replace(SCALES["micro"], critic_init=init)
    messages: list[str] = []
    pav = run(scale, tmp_path, ["data", "sft", "prover", "label", "pav"], progress=False,
              log=messages.append)["pav"]["outputs"]
    assert pav["training"]["freeze_backbone"] and pav["training"]["init"] == str(tmp_path / "pav" / "backbone")
    assert pav["critic_init"]["config"] == asdict(init) and len(pav["critic_init"]["curve"]) == 2
    assert sum("critic_init" in m for m in messages) == 2  # each evaluation of the backbone is logged
    backbone = load_file(tmp_path / "pav" / "backbone" / "model.safetensors")
    critic = load_file(Path(pav["checkpoint"]) / "model.safetensors")
    shared = [k for k in critic if not k.startswith("score.")]
    assert shared and all(torch.equal(critic[k], backbone[k]) for k in shared)
    other = replace(scale, critic_init=replace(init, steps=3))
    with pytest.raises(ValueError, match=r"critic_init.steps: 2 -> 3"):
        run(other, tmp_path, ["pav"], progress=False, log=lambda *_: None)
    (tmp_path / "pav" / "DONE.json").unlink()
    with pytest.raises(ValueError, match="other critic_init settings"):
        run(other, tmp_path, ["pav"], progress=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="check_weight > 0"):
        replace(SCALES["cpu"], critic_init=CriticInitConfig())


def test_rl_stage_is_complete_only_when_every_run_is(tmp_path):
    """Adding an arm or a seed to a finished recipe reruns the rl stage for the new runs only (the finished runs
    keep their markers); the results stage's settings name the arms and seeds, so its table is rebuilt."""
    from dataclasses import replace

    from verl_prm.apps.arithmetic.pipeline import SCALES, stages_of

    scale = replace(SCALES["micro"], rl_arms=("grpo",), rl_seeds=(0,))
    stages = stages_of(scale, tmp_path)
    assert [part.path.name for part in stages["rl"].parts] == ["grpo_seed0"]
    assert not stages["rl"].done()
    stages["rl"].parts[0].path.mkdir(parents=True)
    stages["rl"].parts[0].finish({"curve": []}, 1.0, env={})
    assert not stages["rl"].done()  # the stage's own marker is missing
    stages["rl"].finish({}, 1.0, env={})
    assert stages["rl"].done()

    more = stages_of(replace(scale, rl_arms=("grpo", "pav_exact")), tmp_path)
    assert more["rl"].settings == stages["rl"].settings
    assert [part.done() for part in more["rl"].parts] == [True, False]
    assert not more["rl"].done()
    assert more["evaluate"].settings["arms"] == ["grpo", "pav_exact"]
    assert more["evaluate"].settings != stages["evaluate"].settings


def test_settings_differences_name_each_changed_leaf():
    from verl_prm.apps.arithmetic.pipeline import settings_differences

    recorded = {"rl": {"steps": 40, "lr": 2e-4}, "arms": ["grpo", "pav_exact"], "seed": 0}
    current = {"rl": {"steps": 60, "lr": 2e-4}, "arms": ["grpo", "pav_learned"], "seed": 0, "new": 1}
    assert settings_differences(recorded, current) == [
        "arms[1]: 'pav_exact' -> 'pav_learned'", "new: None -> 1", "rl.steps: 40 -> 60"]


# ------------------------------------------------------------------------------------------- verl commands


def _compose(overrides):
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose("ppo_trainer", overrides=overrides)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return config


@pytest.mark.parametrize("device,scale_name", [("cpu", "cpu"), ("cuda", "gpu")])
def test_main_ppo_commands_of_every_arm_compose_and_differ_only_in_the_critic(tmp_path, device, scale_name):
    """The recipe's verl command (CPU and GPU the same function): each arm composes with verl's config and passes
    verl's and the plugin's startup validation; the arms differ only in estimator, critic and run names."""
    from verl_prm.integrations.verl.run_config import validate_run_config
    from verl_prm.apps.arithmetic.pipeline import SCALES
    from verl_prm.apps.arithmetic.task import STEP_REGEX
    from verl_prm.apps.arithmetic.verl_rl import ARMS, RunPaths, main_ppo_command
    from verl_prm.training.trainer import latest_checkpoint  # noqa: F401  (the learned critic's layout)

    scale = SCALES[scale_name]
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / "config.json").write_text("{}")
    (critic / "model.safetensors").write_bytes(b"")
    paths = RunPaths(policy=tmp_path / "policy", train_file=tmp_path / "train.parquet",
                     val_file=tmp_path / "test.parquet", learned_critic=critic, step_accuracy=0.8125)
    commands = {}
    for arm in ARMS:
        command = main_ppo_command(scale, arm, 1, paths, tmp_path / arm, device=device)
        assert command[1:3] == ["-m", "verl.trainer.main_ppo"]
        config = _compose(command[3:])
        hook, pav = validate_run_config(config)
        assert hook.steps.regex == STEP_REGEX
        assert config.algorithm.adv_estimator == ARMS[arm].estimator
        assert (pav.alpha, pav.best_of_k) == (scale.rl.alpha, scale.rl.best_of_k)
        assert config.data.train_batch_size == scale.rl.prompts_per_step
        assert config.actor_rollout_ref.rollout.n == scale.rl.group_size
        assert config.actor_rollout_ref.rollout.val_kwargs.n == scale.rl.eval_samples >= 4
        assert config.actor_rollout_ref.actor.ppo_mini_batch_size == scale.rl.prompts_per_step
        assert config.data.max_response_length >= scale.max_new_tokens
        assert config.trainer.total_training_steps == scale.rl.steps and config.trainer.test_freq == scale.rl.eval_every
        assert (config.data.seed, config.actor_rollout_ref.rollout.seed) == (1, 1)
        assert config.actor_rollout_ref.rollout.name == ("hf" if device == "cpu" else "vllm")
        exact_prover = {"prover": "verl_prm.apps.arithmetic.prover:ArithmeticProver", "step_accuracy": 0.8125}
        if ARMS[arm].critic == "exact":
            assert hook.critic.format == "exact"
            assert dict(hook.critic.options) == exact_prover
            assert hook.diagnostics.reference is None
        else:
            assert (hook.critic.format, hook.critic.path) == ("value_head", str(critic))
            # the exact arm's prover is the learned arm's reference, for the diagnostics only
            assert hook.diagnostics.reference == exact_prover
        commands[arm] = set(command[3:])
    run_names = ("trainer.experiment_name=", "trainer.default_local_dir=")
    for a, b, allowed in (("grpo", "pav_exact", ("algorithm.adv_estimator=",)),
                          ("pav_exact", "pav_learned", ("verl_prm.critic.", "+verl_prm.critic.",
                                                        "+verl_prm.diagnostics.reference."))):
        differing = sorted(commands[a] ^ commands[b])
        assert differing and all(x.startswith(allowed + run_names) for x in differing), differing


def test_a_run_stops_with_every_process_of_its_session(tmp_path):
    """`verl_rl.start_run` (cpu_loop.start_main_ppo): `stop` ends a child that left the run's process group, as
    Ray's workers do (a process-group kill misses it), and the run keeps its command and appends to its log."""
    import sys
    import time

    from verl_prm.apps.arithmetic.verl_rl import start_run
    from verl_prm.apps.cpu_loop import session_processes

    child = tmp_path / "child.pid"
    script = ("import os, subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)'])\n"
              f"open({str(child)!r}, 'w').write(str(p.pid))\nprint('started', flush=True)\ntime.sleep(60)\n")
    (tmp_path / "main_ppo.log").write_text("earlier part\n")
    run = start_run([sys.executable, "-c", script], tmp_path, threads=1)
    try:
        deadline = time.time() + 30
        while not child.exists() or not child.read_text():
            assert time.time() < deadline and run.poll() is None, (tmp_path / "main_ppo.log").read_text()
            time.sleep(0.1)
        pid = int(child.read_text())
        while os.getpgid(pid) == os.getpgid(run.process.pid):  # the child has left the run's process group
            assert time.time() < deadline
            time.sleep(0.1)
        assert set(session_processes(run.process.pid)) >= {run.process.pid, pid}
    finally:
        run.stop()
    assert not session_processes(run.process.pid) and run.poll() is not None
    assert (tmp_path / "main_ppo.log").read_text().startswith("earlier part\nstarted")
    assert (tmp_path / "command.sh").read_text().startswith(f"VERL_FILE_LOGGER_PATH={tmp_path / 'metrics.jsonl'} ")


def test_the_gpu_scale_runs_each_gpu_stage_in_a_process_of_its_own(tmp_path, monkeypatch):
    """At --scale gpu the stages that hold the GPU run in processes of their own (the recipe's own process never
    holds GPU memory when the next stage starts), each with the same scale (read back from WORK_DIR/scale.json);
    the label stage's vLLM engine gets the scale's memory share."""
    from dataclasses import replace

    import verl_prm.labeling.cli as label_cli
    from verl_prm.apps.arithmetic.pipeline import (
        SCALES, _jsonable, label_prompts, recipe_parser, scale_from_args, scale_from_json, stage_process_command,
        stages_in_own_process)
    from verl_prm.apps.arithmetic.task import generate_problems, verl_row

    assert stages_in_own_process(SCALES["gpu"]) == ("sft", "label", "pav", "evaluate")
    assert all(stages_in_own_process(SCALES[name]) == () for name in ("cpu", "micro", "tiny"))
    scale = replace(SCALES["gpu"], pav_steps=7)
    scale_file = tmp_path / "scale.json"
    scale_file.write_text(json.dumps(_jsonable(scale)))
    command = stage_process_command(scale_file, tmp_path / "w", "label", progress=False, python="python3")
    assert command == ["python3", "-m", "verl_prm.apps.arithmetic.pipeline", "--scale-file", str(scale_file),
                       "--work-dir", str(tmp_path / "w"), "--stages", "label", "--in-process", "--no-progress"]
    args = recipe_parser().parse_args(command[3:])
    assert scale_from_args(args) == scale and args.in_process and args.stages == "label"
    for name, value in SCALES.items():
        assert scale_from_json(_jsonable(value)) == value, name
    with pytest.raises(ValueError, match=r"Scale has no settings \['old'\]"):
        scale_from_json({**_jsonable(scale), "old": 1})
    # the engine of the label stage: vLLM at the scale's share of the GPU (0.5: room for what follows)
    assert SCALES["gpu"].label_gpu_memory_utilization == 0.5
    prompts = tmp_path / "label.parquet"
    pd.DataFrame([verl_row(p, "label", i) for i, p in enumerate(generate_problems(2, scale.rl_task, seed=4))]
                 ).to_parquet(prompts)
    built = {}

    def engine(backend, path, **settings):
        built.update(backend=backend, path=path, **settings)
        raise RuntimeError("engine built")

    monkeypatch.setattr(label_cli, "build_generator", engine)
    with pytest.raises(RuntimeError, match="engine built"):
        label_prompts(prompts, tmp_path / "policy", tmp_path / "labels", scale, progress=False)
    assert built == {"backend": "vllm", "path": str(tmp_path / "policy"), "max_new_tokens": scale.max_new_tokens,
                     "temperature": 1.0, "top_p": 1.0, "batch_size": 1024, "gpu_memory_utilization": 0.5}


@pytest.mark.slow
def test_a_stage_in_its_own_process_gives_what_it_gives_in_this_one(tmp_path, monkeypatch):
    """The mechanism of the GPU scale on CPU: the micro scale's sft stage run in a process of its own (as
    --scale gpu runs it) writes the same policy as the stage run in this process."""
    from safetensors.torch import load_file

    import verl_prm.apps.arithmetic.pipeline as pipeline

    torch_threads = torch.get_num_threads()
    try:
        pipeline.run(pipeline.SCALES["micro"], tmp_path / "here", ["data", "sft"], progress=False,
                     log=lambda *_: None)
        monkeypatch.setattr(pipeline, "stages_in_own_process", lambda scale: ("sft",))
        messages: list[str] = []
        records = pipeline.run(pipeline.SCALES["micro"], tmp_path / "there", ["data", "sft"], progress=False,
                               log=messages.append)
    finally:
        torch.set_num_threads(torch_threads)
    assert any("sft: running in its own process" in m for m in messages)
    assert json.loads((tmp_path / "there" / "scale.json").read_text())["sft"]["steps"] == 4
    here = load_file(tmp_path / "here" / "policy" / "model.safetensors")
    there = load_file(tmp_path / "there" / "policy" / "model.safetensors")
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
    assert records["sft"]["outputs"]["final_loss"] == json.loads(
        (tmp_path / "here" / "policy" / "DONE.json").read_text())["outputs"]["final_loss"]


def _run_launcher(script: Path, tmp_path: Path, env_extra: dict[str, str]) -> list[list[str]]:
    """Run a launcher with fake `python3` first on PATH; return each call's argv, in order."""
    bin_dir, capture = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(parents=True)
    capture.mkdir()
    fake = bin_dir / "python3"
    fake.write_text("#!/usr/bin/env bash\n"
                    f'n=$(ls "{capture}" | wc -l); printf "%s\\0" python3 "$@" > "{capture}/$(printf %03d "$n")"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **env_extra)
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [(capture / f).read_bytes().decode().split("\0")[:-1] for f in sorted(os.listdir(capture))]


def test_gpu_launcher_runs_the_recipe_at_gpu_scale(tmp_path):
    calls = _run_launcher(EXAMPLE / "run_gpu.sh", tmp_path, {"WORK_DIR": str(tmp_path / "w")})
    assert calls == [["python3", "-m", "verl_prm.apps.arithmetic", "--scale", "gpu", "--work-dir",
                      str(tmp_path / "w")]]
    calls = _run_launcher(EXAMPLE / "run_cpu.sh", tmp_path / "cpu", {})
    assert calls[0][:5] == ["python3", "-m", "verl_prm.apps.arithmetic", "--scale", "cpu"]


def test_read_run_takes_the_curves_from_verls_file_logger(tmp_path):
    from verl_prm.apps.arithmetic.pipeline import SCALES
    from verl_prm.apps.arithmetic.verl_rl import read_run

    scale = SCALES["micro"]
    key = f"val-core/arithmetic_mod/acc/mean@{scale.rl.eval_samples}"
    lines = [{"step": 0, "data": {key: 0.5}},
             {"step": 1, "data": {"critic/score/mean": 0.25, "pav/outcome_zero_signal_groups": 0.5,
                                  "pav/process_term/std": 0.1, "timing_s/step": 3.0}},
             {"step": 2, "data": {"critic/score/mean": 0.5, "pav/outcome_zero_signal_groups": 0.0,
                                  "pav/process_term/std": 0.2, "timing_s/step": 2.0, key: 0.75}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "da')
    run = read_run(tmp_path, scale)
    per_step = scale.rl.prompts_per_step * scale.rl.group_size
    assert run["curve"] == [(0, 0, 0.5), (2, 2 * per_step, 0.75)]
    assert [t["zero_signal_groups"] for t in run["training"]] == [0.5, 0.0]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "da\n' + json.dumps(lines[0]) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1 is not JSON"):
        read_run(tmp_path, scale)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[1]) + "\n")
    with pytest.raises(ValueError, match=f"has no val-core/arithmetic_mod/acc/mean@{scale.rl.eval_samples} metric"):
        read_run(tmp_path, scale)


def test_command_line_overrides_reach_the_scale():
    from verl_prm.apps.arithmetic.pipeline import SCALES, recipe_parser, scale_from_args

    default = scale_from_args(recipe_parser().parse_args(["--work-dir", "w"]))
    assert default == SCALES["cpu"]
    scale = scale_from_args(recipe_parser().parse_args(
        ["--work-dir", "w", "--label-problems", "1536", "--n-mc", "4", "--pav-steps", "1500", "--rl-steps", "7"]))
    assert (scale.label_problems, scale.n_mc, scale.pav_steps, scale.rl.steps) == (1536, 4, 1500, 7)
    assert scale.sft == SCALES["cpu"].sft and scale.task == SCALES["cpu"].task


# ------------------------------------------------------------------------------------------- pinned numbers

# The numbers of `verl-prm recipe arithmetic --scale tiny` (every stage for real, on 1 torch thread) with
# python 3.11.7, torch 2.13.0+cpu, transformers 5.10.4, tokenizers 0.22.2, numpy 2.4.6, verl 0.9.1, accelerate
# 1.15.0 on x86_64 with torch's AVX512 kernels. A change of code, settings or versions that moves any of them
# fails here: if the move is intended, re-measure the CPU recipe (docs/arithmetic.md) and update both.
PINNED_TINY = {
    "sft_slip_share": 0.35,
    "sft_loss": [[25, 2.873384175300598], [50, 0.7472337675094605], [75, 0.5118842422962189],
                 [100, 0.5023809397220611], [125, 0.4898651480674744], [150, 0.48760770916938784]],
    "label_rollouts": 8, "label_steps": 16, "label_q_mean": 0.1875, "label_seed_accuracy": 0.25,
    "pav_mse": 0.22745072162529287, "pav_auroc": 0.125,
    # the prover stage: the SFT policy on the label prompts
    "prover": {"success": 0.3125, "zero_signal_groups": 0.25, "step_accuracy": 0.2},
}



def _with_kernel_floats(sft_loss, pav_mse) -> dict:
    """PINNED_TINY with the floats that torch's CPU kernel level moves (the discrete numbers stay)."""
    import copy

    pinned = copy.deepcopy(PINNED_TINY)
    pinned.update(sft_loss=sft_loss, pav_mse=pav_mse)
    return pinned


# The same run with torch's other x86 kernel levels (measured on the same machine with ATEN_CPU_CAPABILITY=avx2
# and =default): the float rounding of the kernels moves the losses in the 6th digit; every count and accuracy
# is the same.
PINNED_BY_KERNELS = {
    ("x86_64", "AVX512"): PINNED_TINY,
    ("x86_64", "AVX2"): _with_kernel_floats(
        [[25, 2.873386263847351], [50, 0.7472287249565125], [75, 0.5118833935260773], [100, 0.5023816525936127],
         [125, 0.4898658812046051], [150, 0.4876088213920593]], 0.2274514110693775),
    ("x86_64", "DEFAULT"): _with_kernel_floats(
        [[25, 2.8733741092681884], [50, 0.7472591614723205], [75, 0.5118884479999543], [100, 0.5023774135112763],
         [125, 0.4898615169525147], [150, 0.4876021468639374]], 0.22744718201663852),
}


def recipe_numbers(work: Path) -> dict:
    """The numbers of a finished recipe run that PINNED_TINY holds, read from its outputs."""
    import numpy as np

    from verl_prm.labeling.format import read_labels

    def outputs(name: str) -> dict:
        return json.loads((work / name / "DONE.json").read_text())["outputs"]

    labels = read_labels(work / "labels")
    q = [float(v) for values in labels["q"] for v in values if v == v]
    sft = [json.loads(x) for x in (work / "policy" / "sft_metrics.jsonl").read_text().splitlines()]
    pav = outputs("pav")["eval_metrics"]
    prover = outputs("prover")
    return {
        "sft_slip_share": outputs("data")["sft_slip_share"],
        "sft_loss": [[r["step"], r["loss"]] for r in sft],
        "label_rollouts": len(labels), "label_steps": len(q), "label_q_mean": float(np.mean(q)),
        "label_seed_accuracy": outputs("labels")["seed_accuracy"],
        "pav_mse": pav["eval/mse"], "pav_auroc": pav["eval/auroc"],
        "prover": {k: prover[k] for k in ("success", "zero_signal_groups", "step_accuracy")},
    }


def _moved(measured, pinned, path: str = "", rel: float = 1e-5) -> list[str]:
    """Where ``measured`` differs from ``pinned``: floats beyond ``rel`` (abs 1e-7), anything else exactly."""
    if isinstance(pinned, dict):
        if not isinstance(measured, dict) or set(measured) != set(pinned):
            return [f"{path}: keys {sorted(measured) if isinstance(measured, dict) else measured} != {sorted(pinned)}"]
        return [m for key in pinned for m in _moved(measured[key], pinned[key], f"{path}.{key}", rel)]
    if isinstance(pinned, list):
        if not isinstance(measured, (list, tuple)) or len(measured) != len(pinned):
            return [f"{path}: {measured} != {pinned}"]
        return [m for i, (a, b) in enumerate(zip(measured, pinned)) for m in _moved(a, b, f"{path}[{i}]", rel)]
    if isinstance(pinned, float) and not isinstance(measured, bool) and isinstance(measured, (int, float)):
        return [] if measured == pytest.approx(pinned, rel=rel, abs=1e-7) else [f"{path}: {measured!r} != {pinned!r}"]
    return [] if measured == pinned else [f"{path}: {measured!r} != {pinned!r}"]


def test_moved_reports_what_differs():
    pinned = {"a": [1, 0.5, None], "b": {"c": "x"}}
    assert _moved({"a": [1, 0.5 + 1e-9, None], "b": {"c": "x"}}, pinned) == []
    assert _moved({"a": [1, 0.51, None], "b": {"c": "y"}}, pinned) == [".a[1]: 0.51 != 0.5", ".b.c: 'y' != 'x'"]
    assert _moved({"a": [1, 0.5], "b": {"c": "x"}}, pinned) == [".a: [1, 0.5] != [1, 0.5, None]"]
    assert _moved({"a": [1, 0.5, None]}, pinned) == [": keys ['a'] != ['a', 'b']"]


def test_tiny_recipe_reproduces_its_pinned_numbers_when_resumed_stage_by_stage(tmp_path):
    """The tiny scale up to the PAV (the RL stages are verl runs, checked by the micro run) gives the pinned numbers of this machine's kernel kind (to rel 1e-5; on a kind
    not pinned, the counts and accuracies exactly and the floats to rel 2e-2, the spread between the pinned
    kinds), also when its stages run in two calls with the global generators disturbed and the thread count
    changed in between (each stage seeds itself and sets its threads); records the environment and settings."""
    import platform

    import numpy as np

    from verl_prm.apps.arithmetic.pipeline import SCALES, environment, run

    kind = (platform.machine(), torch.backends.cpu.get_cpu_capability())
    pinned, rel = PINNED_BY_KERNELS.get(kind, PINNED_TINY), 1e-5 if kind in PINNED_BY_KERNELS else 2e-2
    scale = SCALES["tiny"]
    threads = torch.get_num_threads()
    try:
        run(scale, tmp_path, ["data", "sft", "prover"], progress=False, log=lambda *_: None)
        random.seed(99), np.random.seed(99), torch.manual_seed(99), torch.rand(7)
        torch.set_num_threads(2)
        records = run(scale, tmp_path, ["label", "pav"], progress=False, log=lambda *_: None)
        assert torch.get_num_threads() == 2  # the caller's thread count is restored
    finally:
        torch.set_num_threads(threads)
    measured = recipe_numbers(tmp_path)
    moved = _moved(measured, pinned, rel=rel)
    assert not moved, (f"the tiny recipe's numbers moved on {kind} (code, settings or versions changed; if intended, "
                       f"update PINNED_BY_KERNELS and re-measure docs/arithmetic.md): {moved}\n"
                       f"measured: {json.dumps(measured)}")
    # every stage records the environment it ran in (1 torch thread) and its settings
    current = environment()
    for name in ("data", "policy", "prover", "labels", "pav"):
        record = json.loads((tmp_path / name / "DONE.json").read_text())
        assert record["environment"]["packages"] == current["packages"]
        assert record["environment"]["torch_threads"] == 1
        assert record["settings"]
    assert records["sft"]["settings"]["threads"] == 1


def test_skipping_a_stage_made_under_other_versions_says_so(micro_run):
    from verl_prm.apps.arithmetic.pipeline import SCALES, environment_differences, run

    work, _ = micro_run
    marker = work / "data" / "DONE.json"
    original = marker.read_text()
    record = json.loads(original)
    record["environment"]["packages"]["torch"] = "0.0.1"
    marker.write_text(json.dumps(record))
    try:
        messages: list[str] = []
        run(SCALES["micro"], work, ["data"], progress=False, log=messages.append)
    finally:
        marker.write_text(original)
    assert len(messages) == 1 and "complete, skipped" in messages[0]
    assert f"packages.torch: 0.0.1 -> {torch.__version__}" in messages[0]
    assert environment_differences(None, {"python": "3"}) == ["no environment recorded"]


def test_threads_setting_is_validated_and_reaches_the_scale():
    from dataclasses import replace

    from verl_prm.apps.arithmetic.pipeline import SCALES, recipe_parser, scale_from_args

    assert SCALES["cpu"].threads == 1
    assert scale_from_args(recipe_parser().parse_args(["--work-dir", "w", "--threads", "2"])).threads == 2
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="threads"):
            replace(SCALES["cpu"], threads=bad)
    with pytest.raises(ValueError, match="search_alpha must be finite"):
        replace(SCALES["cpu"], search_alpha=float("nan"))
    with pytest.raises(ValueError, match=r"RLConfig.alpha must be finite and >= 0, got inf"):
        replace(SCALES["cpu"].rl, alpha=float("inf"))
    with pytest.raises(ValueError, match=r"RLConfig.group_size must be >= 1, got 0"):
        replace(SCALES["cpu"].rl, group_size=0)
    with pytest.raises(ValueError, match=r"SFTConfig.lr must be finite and >= 0, got nan"):
        replace(SCALES["cpu"].sft, lr=float("nan"))


def test_help_names_the_verl_prm_command(capsys):
    from verl_prm.apps.cli import main as cli

    with pytest.raises(SystemExit) as exit_info:
        cli(["recipe", "arithmetic", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: verl-prm recipe arithmetic ")
    assert "--threads" in out


def test_value_head_init_reports_only_unexpected_keys(micro_run, tmp_path, capfd):
    """Building the PAV's value head on the policy is deliberate: no load report for the new head; a backbone
    key missing from the checkpoint is still reported."""
    from safetensors.torch import load_file, save_file

    from verl_prm.training.trainer import value_head_from_init

    work, _ = micro_run
    capfd.readouterr()
    model = value_head_from_init(str(work / "policy"))
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "MISSING" not in err, err
    assert model.config.num_labels == 1 and model.score.weight.shape[0] == 1
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(work / "policy", broken)
    weights = load_file(broken / "model.safetensors")
    dropped = next(k for k in weights if k.endswith("mlp.up_proj.weight"))
    del weights[dropped]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="up_proj"):
        value_head_from_init(str(broken))


# ------------------------------------------------------------------------------------------- statistics


def test_interpolation_and_the_first_crossing_are_exact_on_piecewise_linear_curves():
    from verl_prm.apps.arithmetic.stats import first_crossing, interpolate

    xs, ys = [0, 10, 20], [0.2, 0.4, 0.6]
    assert interpolate(xs, ys, 15) == pytest.approx(0.5) and interpolate(xs, ys, 10) == 0.4
    assert first_crossing(xs, ys, 0.5) == pytest.approx(15.0)  # 10 + (0.5 - 0.4) / (0.6 - 0.4) * 10
    assert first_crossing(xs, ys, 0.4) == 10.0 and first_crossing(xs, ys, 0.1) == 0.0
    assert first_crossing(xs, ys, 0.61) is None
    # not monotone: the first segment that reaches the level, not the first point above it
    bumpy_x, bumpy_y = [0, 10, 20, 30], [0.2, 0.5, 0.3, 0.7]
    assert first_crossing(bumpy_x, bumpy_y, 0.4) == pytest.approx(10 * 0.2 / 0.3)
    assert first_crossing(bumpy_x, bumpy_y, 0.6) == pytest.approx(20 + 10 * 0.3 / 0.4)
    with pytest.raises(ValueError, match=r"x = 31 is outside the curve's range \[0, 30\]"):
        interpolate(bumpy_x, bumpy_y, 31)
    with pytest.raises(ValueError, match="x must increase strictly"):
        first_crossing([0, 10, 10], [0.1, 0.2, 0.3], 0.2)
    # random curves: the curve is at the level at the crossing, and below it on a fine grid before it
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 8)
        xs = sorted(rng.sample(range(0, 100), n))
        ys = [rng.random() for _ in range(n)]
        level = rng.uniform(0, 1.1)
        crossing = first_crossing(xs, ys, level)
        grid = [xs[0] + (xs[-1] - xs[0]) * k / 2000 for k in range(2001)]
        if crossing is None:
            assert max(ys) < level
            continue
        if crossing > xs[0]:
            assert interpolate(xs, ys, crossing) == pytest.approx(level, abs=1e-12)
        assert all(interpolate(xs, ys, x) < level for x in grid if x < crossing - 1e-9)


def test_normalised_auc_is_the_trapezoid_over_the_budget():
    from verl_prm.apps.arithmetic.stats import interpolate, normalised_auc

    # by hand: 10 * (0.2 + 0.4) / 2 + 20 * (0.4 + 0.1) / 2 = 3 + 5 = 8 over 30 steps
    assert normalised_auc([0, 10, 30], [0.2, 0.4, 0.1], 30) == pytest.approx(8 / 30)
    assert normalised_auc([0, 30], [0.5, 0.5], 30) == pytest.approx(0.5)
    # a midpoint sum of the interpolated curve converges to it
    xs, ys = [0, 5, 10, 20, 30], [0.19, 0.17, 0.25, 0.2, 0.31]
    midpoints = [(k + 0.5) * 30 / 30000 for k in range(30000)]
    assert normalised_auc(xs, ys, 30) == pytest.approx(sum(interpolate(xs, ys, x) for x in midpoints) / 30000, abs=1e-9)
    with pytest.raises(ValueError, match=r"the curve spans \[0, 25\], the budget is \[0, 30\]"):
        normalised_auc([0, 25], [0.1, 0.2], 30)


def test_bootstrap_is_seeded_resamples_within_each_group_and_matches_the_exact_bootstrap():
    import itertools

    import numpy as np

    from verl_prm.apps.arithmetic.stats import bootstrap, bootstrap_se

    groups = {"a": [0.0, 1.0, 3.0], "b": [2.0, 2.5, 5.0]}

    def difference(sample):
        assert len(sample["a"]) == 3 and set(sample["a"]) <= set(groups["a"]) and set(sample["b"]) <= set(groups["b"])
        return [np.mean(sample["b"]) - np.mean(sample["a"]), np.mean(sample["a"])]

    draws = bootstrap(difference, groups, resamples=2000, seed=7)
    assert draws.shape == (2000, 2)
    assert np.array_equal(draws, bootstrap(difference, groups, resamples=2000, seed=7))
    assert not np.array_equal(draws, bootstrap(difference, groups, resamples=2000, seed=8))
    # the ideal bootstrap: every one of the 3^3 x 3^3 equally likely resamples (a loop)
    exact = [np.mean(b) - np.mean(a) for a in itertools.product(groups["a"], repeat=3)
             for b in itertools.product(groups["b"], repeat=3)]
    assert bootstrap_se(draws[:, 0])[0] == pytest.approx(np.std(exact), rel=0.05)
    # the mean of n values: the bootstrap variance is the population variance over n
    population = np.var(groups["a"])  # ((0 - 4/3)^2 + (1 - 4/3)^2 + (3 - 4/3)^2) / 3 = 14/9
    assert population == pytest.approx(14 / 9)
    assert bootstrap_se(draws[:, 1])[0] == pytest.approx(np.sqrt(population / 3), rel=0.05)
    se, undefined = bootstrap_se([1.0, 2.0, float("nan"), float("inf")])
    assert se == pytest.approx(np.sqrt(0.5)) and undefined == 0.5
    with pytest.raises(ValueError, match="resamples must be an integer >= 2, got 1"):
        bootstrap(difference, groups, resamples=1, seed=0)


def test_mean_curve_needs_the_same_evaluations_in_every_seed():
    from verl_prm.apps.arithmetic.stats import mean_curve

    curve = [(0, 0, 0.2), (10, 160, 0.4), (20, 320, 0.6)]
    mean, se = mean_curve([curve, [(0, 0, 0.4), (10, 160, 0.6), (20, 320, 0.8)]])
    assert [m[:2] for m in mean] == [(0, 0), (10, 160), (20, 320)]
    assert [m[2] for m in mean] == pytest.approx([0.3, 0.5, 0.7]) and se == pytest.approx([0.1, 0.1, 0.1])
    with pytest.raises(ValueError, match=r"curve 1 is evaluated at steps \[0, 10\], curve 0 at \[0, 10, 20\]"):
        mean_curve([curve, curve[:2]])


def _rl_run(values, step=10):  # 16 sampled responses per step
    return {"curve": [(step * i, 16 * step * i, v) for i, v in enumerate(values)],
            "training": [{"step": 1, "zero_signal_groups": 0.5}], "final": {"accuracy": values[-1]}}


def test_sample_efficiency_is_the_steps_to_grpos_accuracy_at_two_thirds_of_its_budget():
    import itertools

    import numpy as np

    from verl_prm.apps.arithmetic.evaluate import efficiency_statistics, summarise_arms

    runs = {"grpo": {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.3, 0.4, 0.5])},
            "pav_exact": {0: _rl_run([0.2, 0.5, 0.5, 0.6]), 1: _rl_run([0.2, 0.5, 0.5, 0.6])}}
    arms = summarise_arms(runs, budget=30, resamples=200)
    grpo, pav = arms["grpo"], arms["pav_exact"]
    # L: GRPO at step 20 (2/3 of 30) = 0.4, which GRPO reaches at 20 and PAV at 0 + (0.4 - 0.2) / 0.3 * 10
    assert pav["level"] == pytest.approx(0.4) and pav["level_step"] == pytest.approx(20)
    assert grpo["steps_to_level"] == pytest.approx(20) and grpo["efficiency"] == pytest.approx(1.0)
    assert pav["reference_steps_to_level"] == pytest.approx(20)
    assert pav["steps_to_level"] == pytest.approx(20 / 3) and pav["samples_to_level"] == pytest.approx(16 * 20 / 3)
    assert pav["efficiency"] == pytest.approx(3.0)
    # areas by hand: (10 (0.2 + 0.3) + 10 (0.3 + 0.4) + 10 (0.4 + 0.5)) / 2 / 30, and the same for PAV
    assert grpo["auc"] == pytest.approx(10.5 / 30) and pav["auc"] == pytest.approx(14 / 30)
    assert pav["auc_gain"] == pytest.approx(3.5 / 30) and pav["auc_by_seed"] == pytest.approx([14 / 30] * 2)
    # identical seeds: no spread in any resample
    assert pav["efficiency_se"] == pytest.approx(0, abs=1e-12) and pav["auc_se"] == pytest.approx(0, abs=1e-12)
    assert pav["efficiency_undefined_share"] == 0
    assert pav["final_accuracy"] == 0.6 and pav["final_accuracy_se"] == 0.0

    # seeds that differ: the bootstrap's error against the exact bootstrap over the 2^2 x 2^2 resamples
    runs = {"grpo": {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.2, 0.3, 0.6])},
            "pav_exact": {0: _rl_run([0.2, 0.5, 0.5, 0.6]), 1: _rl_run([0.2, 0.3, 0.6, 0.5])}}
    curves = {arm: [seeds[s]["curve"] for s in sorted(seeds)] for arm, seeds in runs.items()}
    exact = [efficiency_statistics(ref, arm, budget=30, level_fraction=2 / 3)
             for ref in itertools.product(curves["grpo"], repeat=2)
             for arm in itertools.product(curves["pav_exact"], repeat=2)]
    arms = summarise_arms(runs, budget=30, resamples=2000, seed=3)
    for name in ("level", "steps_to_level", "efficiency", "auc", "auc_gain"):
        assert arms["pav_exact"][f"{name}_se"] == pytest.approx(np.std([e[name] for e in exact]), rel=0.06), name
    assert arms == summarise_arms(runs, budget=30, resamples=2000, seed=3)  # seeded: the same again

    # an arm that never reaches L; a run that stopped early
    runs["grpo"] = {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.3, 0.4, 0.5])}
    runs["pav_exact"] = {0: _rl_run([0.2, 0.25, 0.3, 0.35]), 1: _rl_run([0.2, 0.25, 0.3, 0.35])}
    never = summarise_arms(runs, budget=30, resamples=50)["pav_exact"]
    assert never["steps_to_level"] is None and np.isnan(never["efficiency"])
    assert never["steps_to_level_undefined_share"] == 1.0
    runs["pav_exact"][1] = _rl_run([0.2, 0.25, 0.3])
    with pytest.raises(ValueError, match=r"pav_exact seed 1 spans steps \[0, 10, 20\]; the statistics need steps 0 to"):
        summarise_arms(runs, budget=30, resamples=50)


def test_results_table_states_the_machine_the_level_and_too_few_seeds(tmp_path):
    from verl_prm.apps.arithmetic.evaluate import summarise_arms, write_table

    runs = {"grpo": {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.3, 0.4, 0.5])},
            "pav_exact": {0: _rl_run([0.2, 0.5, 0.5, 0.6]), 1: _rl_run([0.2, 0.5, 0.5, 0.6])}}
    environment = {"cpu": "AMD EPYC", "machine": "x86_64", "logical_cpus": 2, "cpus_available": 2,
                   "cpu_flags": ["avx512f", "avx2"], "torch_cpu_capability": "AVX512", "torch_threads": 1, "gpus": [],
                   "python": "3.11.7", "packages": {"torch": "2.13.0+cpu", "verl": "0.9.1"}}
    results = {"arms": summarise_arms(runs, budget=30, resamples=50), "runs": runs, "environment": environment,
               "settings": {"rl": {"eval_samples": 4}},
               "prover": {"group_size": 8, "success": 0.2, "zero_signal_groups": 0.17, "all_fail_groups": 0.17,
                          "step_accuracy": 0.66},
               "policies": {"base": {"accuracy": 0.18, "samples_per_problem": 4}},
               "critic": {"label_auroc": 0.6, "step_auroc": 0.9, "steps_scored": 10, "wrong_step_share": 0.5,
                          "mean_value_drop_at_first_wrong_step": 0.1}, "search": {}}
    text = write_table(results, tmp_path / "results.md", tmp_path / "results.json")
    assert text.startswith("Machine: AMD EPYC (x86_64), 2 logical CPUs (2 available), flags avx512f avx2, torch "
                           "kernels AVX512, 1 torch threads; GPUs: none;")
    assert "L = 0.400, GRPO's seed-mean held-out accuracy at step 20 (0.667 of its 30 steps)" in text
    assert "4 samples per test prompt per evaluation" in text and "50 resamples, seed 0" in text
    row = next(line for line in text.splitlines() if line.startswith("| PAV-GRPO, exact prover"))
    assert row.split(" | ")[4:8] == ["0.467 ± 0.000", "6.7 ± 0.0", "107 ± 0", "3.00 ± 0.00x"], row
    grpo_row = next(line for line in text.splitlines() if line.startswith("| GRPO"))
    assert grpo_row.split(" | ")[4:8] == ["0.350 ± 0.000", "20.0 ± 0.0", "320 ± 0", "1x (the reference)"], grpo_row
    assert "**Fewer than 3 seeds** (grpo: 2, pav_exact: 2)" in text
    assert json.loads((tmp_path / "results.json").read_text())["arms"]["pav_exact"]["efficiency"] == pytest.approx(3.0)


def test_cpu_info_reads_the_model_the_cpus_and_the_avx_flags():
    from verl_prm.apps.arithmetic.machine import cpu_info
    from verl_prm.apps.arithmetic.pipeline import environment

    text = ("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 avx512f avx512bw\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert cpu_info(text) == {"cpu": "AMD EPYC 7B13", "logical_cpus": 2, "cpu_flags": ["avx512f", "avx2"]}
    assert cpu_info("processor : 0\nflags : fpu sse\n") == {"cpu": None, "logical_cpus": 1, "cpu_flags": []}
    env = environment()
    assert env["logical_cpus"] >= env["cpus_available"] >= 1 and isinstance(env["gpus"], list)


def test_every_scale_evaluates_with_4_samples_and_a_changed_statistic_is_detected_on_resume(tmp_path):
    from dataclasses import replace

    from verl_prm.apps.arithmetic.pipeline import SCALES, stages_of

    for name, scale in SCALES.items():
        assert scale.eval_samples >= 4 and scale.rl.eval_samples >= 4, name
    assert SCALES["cpu"].rl_seeds == (0, 1, 2) and SCALES["cpu"].bootstrap_resamples == 2000
    with pytest.raises(ValueError, match=r"rl.eval_samples must be >= 4 samples per test prompt, got 1"):
        replace(SCALES["cpu"], rl=replace(SCALES["cpu"].rl, eval_samples=1))
    with pytest.raises(ValueError, match=r"eval_samples must be >= 4 samples per test prompt, got 2"):
        replace(SCALES["cpu"], eval_samples=2)
    with pytest.raises(ValueError, match=r"level_fraction must be in \(0, 1\], got nan"):
        replace(SCALES["cpu"], level_fraction=float("nan"))
    with pytest.raises(ValueError, match="bootstrap_resamples must be an integer >= 2, got 1"):
        replace(SCALES["cpu"], bootstrap_resamples=1)
    scale = replace(SCALES["micro"], rl_arms=("grpo",))
    stages = stages_of(scale, tmp_path)
    for stage in (stages["evaluate"], stages["rl"].parts[0]):
        stage.path.mkdir(parents=True)
        stage.finish({}, 1.0, env={})
    other = stages_of(replace(scale, level_fraction=0.5), tmp_path)
    with pytest.raises(ValueError, match=r"other settings \(statistics\[0\]: 0.6666666666666666 -> 0.5\)"):
        other["evaluate"].done()
    more = stages_of(replace(scale, rl=replace(scale.rl, eval_samples=8)), tmp_path)
    with pytest.raises(ValueError, match=r"other settings \(rl.eval_samples: 4 -> 8\)"):
        more["rl"].parts[0].done()


def test_exact_label_rows_hold_the_exact_provers_values_and_pass_the_label_checks(tmp_path):
    import pandas as pd

    from verl_prm.labeling.format import read_labels
    from verl_prm.labeling.store import ShardStore
    from verl_prm.apps.arithmetic.critic_study import exact_label_rows
    from verl_prm.apps.arithmetic.model import build_tokenizer, render
    from verl_prm.apps.arithmetic.prover import prefix_value

    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    prompt = render(build_tokenizer(), problem.prompt_text)
    rows = []
    for i, response in enumerate(["3+2=5 *3\n5*3=1\nanswer 1", "3+2=6 *3\n6*3=4\nanswer 4"]):
        ends = [5, 14, len(response)] if i == 0 else [5, 14, len(response)]
        rows.append({"prompt_index": 0, "rollout_index": i, "data_source": DATA_SOURCE, "prompt": prompt,
                     "ground_truth": "1", "response": response, "step_starts": [0, 5, 14], "step_ends": ends,
                     "q": [0.5, 0.5, 0.0], "n_success": [1, 1, 0], "n_mc": [2, 2, 2], "first_pit": -1,
                     "prompt_value": 0.5, "prompt_n_success": 1, "prompt_n_mc": 2, "outcome": float(i == 0),
                     "score": float(i == 0), "finished": True, "strategy": "every", "source": "test"})
    exact = exact_label_rows(pd.DataFrame(rows), step_accuracy=0.8)
    assert exact[0]["q"] == [0.8, 1.0, 1.0] and exact[0]["prompt_value"] == pytest.approx(0.64)
    assert exact[1]["q"] == [0.0, 0.0, 0.0] and exact[1]["first_pit"] == 0
    assert exact[0]["q"][0] == prefix_value(problem, rows[0]["response"][:5], 0.8)
    ShardStore(tmp_path).write_shard(exact)  # the writer validates the rows
    assert read_labels(tmp_path)["q"].map(list).tolist() == [[0.8, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_sft_solutions_become_exact_label_rows_with_one_step_per_result(tmp_path):
    from verl_prm.apps.arithmetic.critic_study import sft_label_rows
    from verl_prm.apps.arithmetic.model import build_tokenizer

    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    right, slipped = "\n".join(solution_lines(problem)), "\n".join(solution_lines(problem, 1, 2))
    (tmp_path / "sft.jsonl").write_text("".join(
        json.dumps({"prompt": problem.prompt_text, "response": r, "slip_step": s}) + "\n"
        for r, s in ((right, -1), (slipped, 1))))
    rows = sft_label_rows(tmp_path, build_tokenizer(), step_accuracy=0.5)
    assert [r["response"][a:b] for r in rows[:1] for a, b in zip(r["step_starts"], r["step_ends"])] == [
        "3+2=5", " *3\n5*3=1", "\nanswer 1"]
    assert rows[0]["q"] == [0.5, 1.0, 1.0] and rows[0]["prompt_value"] == 0.25
    assert rows[1]["q"] == [0.5, 0.0, 0.0] and rows[1]["first_pit"] == 1 and rows[1]["outcome"] == 0.0


def test_running_min_is_the_least_likely_step_so_far():
    from verl_prm.apps.arithmetic.critic_study import running_min

    assert running_min([-0.1, -2.0, -0.5, -3.0]) == [-0.1, -2.0, -2.0, -3.0]
    assert running_min([]) == []


def test_policy_signal_reads_the_log_probability_of_each_written_result(monkeypatch):
    """An oracle policy that puts its mass on the reference solution's next character: the running minimum of its
    log-probabilities of the written results separates right prefixes from wrong ones perfectly, and a probe of
    a hidden state that carries the first step's truth finds it."""
    from types import SimpleNamespace

    import verl_prm.apps.arithmetic.rollout as rollout
    from verl_prm.apps.arithmetic.critic_study import policy_signal
    from verl_prm.apps.arithmetic.model import build_tokenizer, render

    tokenizer = build_tokenizer()
    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    prompt = render(tokenizer, problem.prompt_text)
    right = "\n".join(solution_lines(problem))
    texts = [right, "\n".join(solution_lines(problem, 0, 6)), "\n".join(solution_lines(problem, 1, 2))] * 4
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: SimpleNamespace(texts=texts, prompt_index=[0] * len(texts)))
    reference = tokenizer(prompt + right, add_special_tokens=False)["input_ids"]

    class Oracle:
        def __call__(self, input_ids, output_hidden_states=False):
            ids = input_ids[0].tolist()
            logits = torch.zeros(len(ids), tokenizer.vocab_size + 2)
            for t in range(len(ids) - 1):
                logits[t, reference[t + 1]] = 8.0
            # hidden state: 1 where the written token is the reference's (the first result's token included)
            hidden = torch.tensor([[float(i == r)] + [0.0] * 3 for i, r in zip(ids, reference)]).unsqueeze(0)
            return SimpleNamespace(logits=logits.unsqueeze(0), hidden_states=(hidden,))

    signal = policy_signal(Oracle(), tokenizer, [prompt], [problem], samples=1, max_new_tokens=32, seed=0)
    assert signal["policy_logprob_steps"] == 2 * len(texts)
    assert signal["policy_logprob_step_auroc"] == 1.0
    assert signal["policy_logprob_first_step_auroc"] == 1.0 and signal["probe_first_step_auroc"] == 1.0
    assert signal["first_steps"] == len(texts)


def test_result_targets_mark_each_written_result_with_the_result_of_its_operation():
    from verl_prm.apps.arithmetic.critic_init import result_targets
    from verl_prm.apps.arithmetic.model import build_tokenizer, render

    tokenizer = build_tokenizer()
    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    prompt = render(tokenizer, problem.prompt_text)
    slipped = "\n".join(solution_lines(problem, 0, 6))  # 3+2=6 *3 / 6*3=4 / answer 4
    targets = result_targets(tokenizer, prompt, slipped, 7)
    assert slipped.splitlines()[:2] == ["3+2=6 *3", "6*3=4"]
    # the last token of each written result (one token per character), the operation's result from the written
    # operand (6*3 = 18 = 4 mod 7: the second line is right given the first), and whether the written one slipped
    assert [tokenizer.decode([targets.input_ids[t]]) for t in targets.positions] == ["6", "4"]
    assert targets.positions == [len(prompt) + 4, len(prompt) + 13]
    assert targets.targets == [5, 4] and targets.slipped == [True, False]
    assert targets.prefix_right == [False, False]  # once a result slipped, no later prefix is right
    right = result_targets(tokenizer, prompt, "\n".join(solution_lines(problem)), 7)
    assert right.slipped == [False, False] and right.prefix_right == [True, True]
    # a line that computes right from a miscopied operand: no slip, but the prefix is wrong from there on
    miscopied = result_targets(tokenizer, prompt, "3+2=5 *3\n4*3=5\nanswer 5", 7)
    assert miscopied.slipped == [False, False] and miscopied.prefix_right == [True, False]


def test_critic_init_needs_a_slipped_result_and_saves_a_causal_lm(tmp_path):
    from verl_prm.apps.arithmetic.critic_init import CriticInitConfig, train_critic_init
    from verl_prm.apps.arithmetic.model import ModelConfig, build_model, build_tokenizer, save_policy

    tokenizer = build_tokenizer()
    policy = save_policy(build_model(tokenizer, ModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                            num_attention_heads=2, num_key_value_heads=2,
                                                            max_position_embeddings=64)), tokenizer, tmp_path / "p")
    problem = Problem(3, (("+", 2), ("*", 3)), 7)
    right = "\n".join(solution_lines(problem))
    with pytest.raises(ValueError, match="no solution with a slipped result"):
        train_critic_init(policy, tmp_path / "out", [problem.prompt_text] * 4, [right] * 4, 7,
                          CriticInitConfig(steps=1, eval_fraction=0.25), progress=False)
    slipped = "\n".join(solution_lines(problem, 0, 6))
    result = train_critic_init(policy, tmp_path / "out", [problem.prompt_text] * 8, [slipped, right] * 4, 7,
                               CriticInitConfig(steps=2, batch_size=2, eval_fraction=0.5, eval_every=1), progress=False)
    assert [r["step"] for r in result["curve"]] == [1, 2] and result["train_solutions"] == result["eval_solutions"] == 2
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=False)
    assert type(saved).__name__ == "Qwen2ForCausalLM" and (tmp_path / "out" / "tokenizer.json").exists()
    from safetensors.torch import load_file

    heads = load_file(tmp_path / "out" / "critic_init_heads.safetensors")  # result head over 7 residues, check head
    assert heads["heads.0.weight"].shape == (7, 16) and heads["heads.1.weight"].shape == (1, 16)
    # with the check target the solutions without a slip are used too, and the check's held-out AUROC is measured
    checked = train_critic_init(policy, tmp_path / "check", [problem.prompt_text] * 8, [slipped, right] * 4, 7,
                                CriticInitConfig(steps=1, batch_size=2, eval_fraction=0.5, check_weight=1.0),
                                progress=False)
    assert checked["train_solutions"] == checked["eval_solutions"] == 4 and 0 <= checked["eval/check_auroc"] <= 1
    # the check head read as a value head: its logits are the check head's on the init's backbone
    from transformers import AutoModelForTokenClassification

    from verl_prm.apps.arithmetic.critic_study import check_head_checkpoint

    converted = AutoModelForTokenClassification.from_pretrained(
        check_head_checkpoint(tmp_path / "check", tmp_path / "check_head"), trust_remote_code=False).eval()
    init = AutoModelForCausalLM.from_pretrained(tmp_path / "check", trust_remote_code=False).eval()
    heads = load_file(tmp_path / "check" / "critic_init_heads.safetensors")
    ids = torch.tensor([tokenizer(problem.prompt_text + slipped)["input_ids"]])
    with torch.no_grad():
        hidden = init.get_decoder()(input_ids=ids).last_hidden_state
        want = hidden @ heads["heads.1.weight"].T + heads["heads.1.bias"]
        assert torch.allclose(converted(input_ids=ids).logits, want, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="no heads saved"):
        check_head_checkpoint(policy, tmp_path / "nothing")
    with pytest.raises(ValueError, match="check_weight"):
        CriticInitConfig(check_weight=float("inf"))
    with pytest.raises(ValueError, match="eval_fraction"):
        CriticInitConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="lr"):
        CriticInitConfig(lr=float("nan"))

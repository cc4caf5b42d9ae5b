"""The arithmetic recipe end to end: a micro run of the whole recipe (every stage for real, a few optimisation
steps each; resume), the verl commands of every arm composed with verl's own config, the GPU scale's stage
processes and launcher, and the tiny scale's pinned numbers. The task, the statistics and the learned critics:
test_arithmetic_task.py, test_arithmetic_statistics.py, test_arithmetic_critic.py."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch


REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "arithmetic"

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
    assert "verl.trainer.main_ppo" in command and "verl_prm.critic.source=exact" in command
    # (f) the table and the plots
    results = json.loads((work / "results" / "results.json").read_text())
    assert set(results["search"]) == {"learned", "exact"}
    assert all({r["method"] for r in rows} == {"best_of_n", "beam_pav"} for rows in results["search"].values())
    assert set(results["arms"]) == {"pav_exact"} and results["arms"]["pav_exact"]["seeds"] == [0]
    assert "PAV-GRPO, exact prover" in (work / "results" / "results.md").read_text()
    for png in ("accuracy_vs_rl_steps.png", "accuracy_vs_rl_samples.png", "zero_signal_groups.png",
                "search_accuracy_vs_compute.png", "accuracy_vs_generated_tokens.png", "accuracy_vs_seconds.png"):
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


def test_pav_refined_trains_the_pav_backbone_on_and_only_its_arm_reads_it(tmp_path):
    """Scale.critic_refine: the pav_refined stage starts a critic_init round from pav/backbone (its weights move
    from there), fits only a value head on the result (to its optimum, --head-fit newton; otherwise the pav stage's
    settings), and is run only for an arm
    that reads it (pav_learned_refined), whose runs name its settings; a refined arm without critic_refine is
    refused when the scale is made."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from verl_prm.apps.arithmetic.critic_init import CriticInitConfig
    from verl_prm.apps.arithmetic.pipeline import SCALES, run, stages_of

    init = CriticInitConfig(steps=2, batch_size=4, eval_every=1, eval_fraction=0.25, check_weight=1.0)
    refine = replace(init, steps=3, lr=5e-4)
    scale = replace(SCALES["micro"], critic_init=init, critic_refine=refine)
    records = run(scale, tmp_path, ["data", "sft", "prover", "label", "pav"], progress=False, log=lambda *_: None)
    assert "pav_refined" not in records  # no arm reads it
    messages: list[str] = []
    refined = run(scale, tmp_path, ["pav_refined"], progress=False, log=messages.append)["pav_refined"]["outputs"]
    assert refined["critic_init"]["config"]["steps"] == 3 and len(refined["critic_init"]["curve"]) == 3
    assert any(m.startswith("[arithmetic] pav_refined: critic_init") for m in messages)
    pav_training = json.loads((tmp_path / "pav" / "DONE.json").read_text())["outputs"]["training"]
    training = refined["training"]
    assert training["freeze_backbone"] and training["init"] == str(tmp_path / "pav_refined" / "backbone")
    assert training["head_fit"] == "newton" and pav_training["head_fit"] == "adam"  # Scale.refined_head_fit
    assert {k: v for k, v in training.items() if k not in ("init", "output_dir", "head_fit")} == \
        {k: v for k, v in pav_training.items() if k not in ("init", "output_dir", "head_fit")}
    before = load_file(tmp_path / "pav" / "backbone" / "model.safetensors")
    after = load_file(tmp_path / "pav_refined" / "backbone" / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    critic = load_file(Path(refined["checkpoint"]) / "model.safetensors")
    assert all(torch.equal(critic[k], after[k]) for k in critic if not k.startswith("score."))

    arms = replace(scale, rl_arms=("pav_learned", "pav_learned_refined"))
    runs = {part.path.name: part.settings for part in stages_of(arms, tmp_path)["rl"].parts}
    named = stages_of(arms, tmp_path)
    assert runs["pav_learned_refined_seed0"]["critic"] == named["pav_refined"].settings
    assert runs["pav_learned_seed0"]["critic"] == named["pav"].settings
    with pytest.raises(ValueError, match=r"read the pav_refined stage's PAV, which needs critic_refine"):
        replace(SCALES["micro"], rl_arms=("pav_learned_refined",))
    with pytest.raises(ValueError, match="critic_refine trains critic_init's backbone on"):
        replace(SCALES["micro"], critic_refine=refine)


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


# ------------------------------------------------------------------------------------------- verl commands


def _compose(overrides):
    from verl_support import compose_validated

    return compose_validated(overrides)


@pytest.mark.parametrize("device,scale_name", [("cpu", "cpu"), ("cuda", "gpu")])
def test_main_ppo_commands_of_every_arm_compose_and_differ_only_in_the_critic(tmp_path, device, scale_name):
    """The recipe's verl command (CPU and GPU the same function): each arm composes with verl's config and passes
    verl's and the plugin's startup validation; the arms differ only in estimator, critic and run names."""
    from verl_prm.integrations.verl.run_config import validate_run_config
    from verl_prm.apps.arithmetic.pipeline import SCALES
    from verl_prm.apps.arithmetic.task import STEP_REGEX
    from verl_prm.apps.arithmetic.verl_rl import ARMS, MC_N, RunPaths, main_ppo_command
    from verl_prm.training.resume import latest_checkpoint  # noqa: F401  (the learned critic's layout)

    scale = SCALES[scale_name]
    critics = {}
    for kind in ("learned", "refined"):
        critics[kind] = tmp_path / f"critic_{kind}"
        critics[kind].mkdir()
        (critics[kind] / "config.json").write_text("{}")
        (critics[kind] / "model.safetensors").write_bytes(b"")
    paths = RunPaths(policy=tmp_path / "policy", train_file=tmp_path / "train.parquet",
                     val_file=tmp_path / "test.parquet", learned_critics=critics, step_accuracy=0.8125)
    commands = {}
    for arm in ARMS:
        command = main_ppo_command(scale, arm, 1, paths, tmp_path / arm, device=device)
        assert command[1:3] == ["-m", "verl.trainer.main_ppo"]
        config = _compose(command[3:])
        hook, pav = validate_run_config(config)
        assert hook.steps.regex == STEP_REGEX
        assert config.algorithm.adv_estimator == ARMS[arm].estimator
        assert (pav.alpha, pav.best_of_k) == (1.0 if arm == "pav_learned_refined_alpha1" else scale.rl.alpha,
                                               scale.rl.best_of_k)
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
            assert hook.critic.source == "exact"
            assert dict(hook.critic.options) == exact_prover
            assert hook.diagnostics.reference is None
        elif ARMS[arm].critic == "rollout":
            assert (hook.critic.source, hook.critic.path, hook.critic.n_mc) == ("sampled", None, MC_N)
            assert hook.diagnostics.reference == exact_prover
        elif ARMS[arm].critic == "tree":
            assert (hook.critic.source, hook.critic.path) == ("tree", None)
            assert (hook.tree.roots, hook.tree.branch_width, hook.tree.branch_rule) == (2, 2, "every")
            assert hook.diagnostics.reference == exact_prover
        else:
            # each learned arm reads the PAV of its own stage
            assert (hook.critic.source, hook.critic.format, hook.critic.path) == (
                "checkpoint", "value_head", str(critics[ARMS[arm].critic]))
            assert hook.critic.calibration == ARMS[arm].calibration
            # the exact arm's prover is the learned arm's reference, for the diagnostics only
            assert hook.diagnostics.reference == exact_prover
            assert hook.refresh.every == (5 if arm == "pav_learned_refresh" else 0)
        assert pav.normalize == (arm == "pav_learned_refined_normalized")
        commands[arm] = set(command[3:])
    run_names = ("trainer.experiment_name=", "trainer.default_local_dir=")
    # each arm differs from the one it is compared with only where its row in verl_rl's table says
    for a, b, allowed in (("grpo", "pav_exact", ("algorithm.adv_estimator=",)),
                          ("pav_exact", "pav_learned", ("verl_prm.critic.", "+verl_prm.critic.",
                                                        "+verl_prm.diagnostics.reference.")),
                          ("pav_learned", "pav_learned_calibrated", ("verl_prm.critic.calibration=",)),
                          ("pav_learned", "pav_learned_refined", ("verl_prm.critic.path=",)),
                          ("pav_learned_refined", "pav_learned_refined_normalized", ("algorithm.pav.normalize=",)),
                          ("pav_learned_refined", "pav_learned_refined_alpha1", ("algorithm.pav.alpha=",)),
                          ("pav_learned_refined", "pav_learned_refresh", ("verl_prm.critic.n_mc=", "verl_prm.critic.prefix_rule=",
                                                                          "verl_prm.critic.mc_", "verl_prm.refresh.")),
                          ("pav_exact", "pav_mc", ("verl_prm.critic.", "+verl_prm.critic.",
                                                   "+verl_prm.diagnostics.reference.")),
                          ("pav_exact", "pav_tree", ("verl_prm.critic.", "+verl_prm.critic.", "verl_prm.tree.",
                                                     "+verl_prm.diagnostics.reference."))):
        differing = sorted(commands[a] ^ commands[b])
        assert differing and all(x.startswith(allowed + run_names) for x in differing), (a, b, differing)


def test_an_arms_alpha_must_be_finite_and_non_negative():
    """An arm's own ``algorithm.pav.alpha`` is checked where the arm is declared, not when verl starts."""
    from verl_prm.apps.arithmetic.verl_rl import Arm

    for alpha in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=r"Arm\.alpha must be finite and >= 0"):
            Arm("pav_grpo", "refined", "bad", alpha=alpha)
    assert Arm("pav_grpo", "refined", "ok", alpha=0.0).alpha == 0.0


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
        SCALES, label_prompts, recipe_parser, scale_from_args, scale_from_json, stage_process_command,
        stages_in_own_process)
    from verl_prm.resume import jsonable
    from verl_prm.apps.arithmetic.task import generate_problems, verl_row

    assert stages_in_own_process(SCALES["gpu"]) == ("sft", "label", "pav", "pav_refined", "evaluate")
    assert all(stages_in_own_process(SCALES[name]) == () for name in ("cpu", "micro", "tiny"))
    scale = replace(SCALES["gpu"], pav_steps=7)
    scale_file = tmp_path / "scale.json"
    scale_file.write_text(json.dumps(jsonable(scale)))
    command = stage_process_command(scale_file, tmp_path / "w", "label", progress=False, python="python3")
    assert command == ["python3", "-m", "verl_prm.apps.arithmetic.pipeline", "--scale-file", str(scale_file),
                       "--work-dir", str(tmp_path / "w"), "--stages", "label", "--in-process", "--no-progress"]
    args = recipe_parser().parse_args(command[3:])
    assert scale_from_args(args) == scale and args.in_process and args.stages == "label"
    for name, value in SCALES.items():
        assert scale_from_json(jsonable(value)) == value, name
    with pytest.raises(ValueError, match=r"Scale has no settings \['old'\]"):
        scale_from_json({**jsonable(scale), "old": 1})
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
                                  "pav/process_term/std": 0.2, "timing_s/step": 2.0, key: 0.75,
                                  "pav/zero_outcome_groups_with_signal": None, "pav/process_corr": 0.5,
                                  "pav/mc_tokens": 300.0, "response_length/mean": 5.0,
                                  "pav/tree_generated_tokens": 70.0}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "da')
    run = read_run(tmp_path, scale)
    per_step = scale.rl.prompts_per_step * scale.rl.group_size
    assert run["curve"] == [(0, 0, 0.5), (2, 2 * per_step, 0.75)]
    assert [t["zero_signal_groups"] for t in run["training"]] == [0.5, 0.0]
    second = run["training"][1]  # a NaN logged as null (no group without an outcome signal) reads as nan
    assert math.isnan(second["zero_outcome_groups_with_signal"]) and second["process_corr"] == 0.5
    assert (second["mc_tokens"], second["response_tokens"]) == (300.0, 5.0 * per_step)
    assert run["training"][0]["mc_tokens"] == 0.0 and math.isnan(run["training"][0]["process_corr"])
    # a tree run generates fewer tokens than it trains on: its tree_generated_tokens; any other run its responses
    assert second["generated_tokens"] == 70.0 and math.isnan(run["training"][0]["generated_tokens"])
    from verl_prm.apps.arithmetic.evaluate import process_summary

    tree = [{"response_tokens": 100.0, "generated_tokens": 90.0, "mc_tokens": 0.0},
            {"response_tokens": 120.0, "generated_tokens": 100.0, "mc_tokens": 0.0}]
    assert process_summary([tree])["tokens_per_step"] == 95.0
    sampled = [{"response_tokens": 100.0, "mc_tokens": 1000.0}]  # an export made before generated_tokens
    assert process_summary([sampled])["tokens_per_step"] == 1100.0
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "da\n' + json.dumps(lines[0]) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1 is not JSON"):
        read_run(tmp_path, scale)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[1]) + "\n")
    with pytest.raises(ValueError, match=f"has no val-core/arithmetic_mod/acc/mean@{scale.rl.eval_samples} metric"):
        read_run(tmp_path, scale)


def test_a_resumed_run_keeps_the_steps_it_logged_before_the_resume(tmp_path):
    """verl's file logger truncates metrics.jsonl when main_ppo starts: start_run moves a non-empty one aside as
    the next metrics-<n>.jsonl, and read_run reads the parts in order (a step logged again replaces the earlier
    record; a torn last line of a killed start is skipped)."""
    import sys

    from verl_prm.apps.arithmetic.pipeline import SCALES
    from verl_prm.apps.arithmetic.verl_rl import read_run, start_run

    scale = SCALES["micro"]
    key = f"val-core/arithmetic_mod/acc/mean@{scale.rl.eval_samples}"
    first = [{"step": 0, "data": {key: 0.25}}, {"step": 1, "data": {"critic/score/mean": 0.5, key: 0.3}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in first) + '{"step": 2, "da')
    run = start_run([sys.executable, "-c", "pass"], tmp_path, threads=1)
    run.wait(60)
    run.stop()
    assert (tmp_path / "metrics-1.jsonl").read_text().startswith(json.dumps(first[0]))
    second = [{"step": 1, "data": {"critic/score/mean": 0.75, key: 0.5}}, {"step": 2, "data": {key: 0.6}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in second))
    per_step = scale.rl.prompts_per_step * scale.rl.group_size
    result = read_run(tmp_path, scale)
    assert result["curve"] == [(0, 0, 0.25), (1, per_step, 0.5), (2, 2 * per_step, 0.6)]
    assert [t["batch_accuracy"] for t in result["training"]] == [0.75]
    start_run([sys.executable, "-c", "pass"], tmp_path, threads=1).stop()  # the next start: the next part
    assert (tmp_path / "metrics-2.jsonl").read_text() == "".join(json.dumps(x) + "\n" for x in second)


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
# 1.15.0 on an x86_64 Intel Xeon with AMX-BF16 (so bf16 where the recipe's precision is auto) and torch's AVX512
# kernels. A change of code, settings or versions that moves any of them fails here: if the move is intended,
# re-measure the CPU recipe (docs/arithmetic.md) and update both.
# The label numbers moved when the generation engine began drawing a token by inversion of its cumulative
# probabilities (one random number per row and step) instead of the exponential race.
PINNED_TINY = {
    "sft_slip_share": 0.35,
    "sft_loss": [[25, 2.8733823776245115], [50, 0.7472386407852173], [75, 0.5118850374221802],
                 [100, 0.5023802852630616], [125, 0.48986446619033813], [150, 0.4876066493988037]],
    "label_rollouts": 8, "label_steps": 16, "label_q_mean": 0.03125, "label_seed_accuracy": 0.0,
    "pav_mse": 0.2120696573055106, "pav_auroc": 1.0,
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
# is the same. The key holds the CPU's native bf16 instructions too: AMX and AVX512-BF16 alone round bf16
# products differently (the PAV's MSE moved by 2e-4 between the two with the same code).
PINNED_BY_KERNELS = {
    ("x86_64", "AVX512", "amx_bf16"): PINNED_TINY,
    ("x86_64", "AVX2", "amx_bf16"): _with_kernel_floats(
        [[25, 2.8733840703964235], [50, 0.7472340965270996], [75, 0.5118842887878418], [100, 0.5023809111118317],
         [125, 0.4898651134967804], [150, 0.48760764360427855]], 0.21207340745535105),
    ("x86_64", "DEFAULT", "amx_bf16"): _with_kernel_floats(
        [[25, 2.873371195793152], [50, 0.7472659850120544], [75, 0.5118895363807678], [100, 0.5023764526844025],
         [125, 0.48986050963401795], [150, 0.48760060548782347]], 0.21212839848220283),
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

    from verl_prm.precision import cpu_bf16_flags

    kind = (platform.machine(), torch.backends.cpu.get_cpu_capability(), (cpu_bf16_flags() or ("none",))[0])
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

    from verl_prm.training.model import value_head_from_init

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


def test_search_study_gives_the_evaluate_stages_search_without_the_rl_stage(micro_run):
    """search_study runs the evaluate stage's search sweep from the critics alone: the same rows, critic by critic."""
    from verl_prm.apps.arithmetic.pipeline import SCALES
    from studies.arithmetic_search import run_search

    work, _ = micro_run
    study = run_search(work, SCALES["micro"], log=lambda *_: None)
    evaluated = json.loads((work / "results" / "results.json").read_text())["search"]
    assert set(study["search"]) == set(evaluated) == {"learned", "exact"}
    assert study["search"] == evaluated
    assert study["critics"]["learned"].endswith("uncalibrated")


def test_curves_export_merge_and_summarise_runs_apart_from_their_work_directory(micro_run, tmp_path):
    """curves: a run exported and read back is the same run; seeds from two sources merge into one arm (the seed
    mean is the mean of the seeds' curves); a seed with another setting, one run twice with another curve, or a run
    on another machine kind is refused by name."""
    import copy

    from studies.arithmetic_curves import export_runs, read_runs, summary_table
    from verl_prm.apps.arithmetic.pipeline import SCALES

    work, _ = micro_run
    runs = read_runs([work])
    assert set(runs) == {"pav_exact"} and set(runs["pav_exact"]) == {0}
    exported = export_runs(runs, tmp_path / "runs.json")
    again = read_runs([exported])
    assert again["pav_exact"][0]["outputs"]["curve"] == runs["pav_exact"][0]["outputs"]["curve"]
    assert read_runs([work, exported])["pav_exact"].keys() == {0}  # the same run twice is one run
    # a second seed in another file: the arm has two seeds, its seed-mean curve the mean of both
    other = copy.deepcopy(again["pav_exact"][0])
    other["settings"]["seed"] = 1
    other["outputs"]["curve"] = [[s, n, a / 2] for s, n, a in other["outputs"]["curve"]]
    export_runs({"pav_exact": {1: other}}, tmp_path / "seed1.json")
    merged = read_runs([work, tmp_path / "seed1.json"])
    lines, arms = summary_table(merged, SCALES["micro"])
    assert arms["pav_exact"]["seeds"] == [0, 1]
    for point, (_, _, accuracy) in zip(arms["pav_exact"]["curve"], runs["pav_exact"][0]["outputs"]["curve"]):
        assert point[2] == pytest.approx(0.75 * accuracy)
    assert any(line.startswith("| PAV-GRPO, exact prover | 2 |") for line in lines)
    other["settings"]["rl"]["lr"] = 1.0
    export_runs({"pav_exact": {1: other}}, tmp_path / "other_lr.json")
    with pytest.raises(ValueError, match=r"pav_exact seed 1 .* was run with other settings than seed 0 \(rl.lr"):
        read_runs([work, tmp_path / "other_lr.json"])
    changed = copy.deepcopy(again["pav_exact"][0])
    changed["outputs"]["curve"][0][2] += 0.5
    export_runs({"pav_exact": {0: changed}}, tmp_path / "changed.json")
    with pytest.raises(ValueError, match="pav_exact seed 0 is in more than one source"):
        read_runs([work, tmp_path / "changed.json"])
    elsewhere = copy.deepcopy(again["pav_exact"][0])
    elsewhere["settings"]["seed"] = 2
    elsewhere["environment"]["cpu_flags"] = ["avx512f"] if elsewhere["environment"]["cpu_flags"] != ["avx512f"] else []
    export_runs({"pav_exact": {2: elsewhere}}, tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match="one table holds runs of one machine kind"):
        read_runs([work, tmp_path / "elsewhere.json"])
    with pytest.raises(ValueError, match="not an export of this module"):
        read_runs([work / "pav" / "DONE.json"])
    from studies.arithmetic_curves import main

    assert main(["--runs", str(work), str(tmp_path / "seed1.json"), "--scale", "micro",
                 "--plot", str(tmp_path / "plots")]) == 0
    for png in ("accuracy_vs_generated_tokens.png", "accuracy_vs_seconds.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    # a record made before read_run read generated_tokens gets them again from the run's verl log
    import shutil

    old = tmp_path / "old"
    shutil.copytree(work / "rl", old / "rl", ignore=shutil.ignore_patterns("checkpoints", "final"))
    marker = next((old / "rl").glob("pav_exact_seed0/DONE.json"))
    record = json.loads(marker.read_text())
    for step in record["outputs"]["training"]:
        del step["generated_tokens"]
    marker.write_text(json.dumps(record))
    assert "generated_tokens" not in read_runs([old])["pav_exact"][0]["outputs"]["training"][0]
    reread = read_runs([old], reread_scale=SCALES["micro"])["pav_exact"][0]["outputs"]["training"]
    # compared as JSON: the metrics a run did not log are NaN, which equals nothing in a dict comparison
    assert json.dumps(reread, sort_keys=True) == json.dumps(runs["pav_exact"][0]["outputs"]["training"], sort_keys=True)
    assert all(step["generated_tokens"] == step["response_tokens"] for step in reread)  # no tree: its responses
    record["outputs"]["curve"][0][2] += 0.5
    marker.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="the held-out curve read again from its verl log differs"):
        read_runs([old], reread_scale=SCALES["micro"])


def test_value_size_reads_the_micro_runs_critic_and_its_backbone_features(micro_run):
    """value_size on a finished recipe: the exact values measured against themselves have slope 1 and MSE 0; the
    backbone features it reads are the value head's input (the head applied to them gives the critic's values);
    the head fits give finite statistics on the held-out rows."""
    import numpy as np

    from studies.arithmetic_value_size import _critic_rows, _label_split, backbone_features, head_fits, measure
    from verl_prm.critic import ProverCritic

    work, _ = micro_run
    results = measure(work, best_of_k=2, log=lambda *_: None)
    exact = results["sources"]["held_out"]["exact"]
    assert exact["mse"] == 0.0 and exact["slope"] == pytest.approx(1.0)
    assert set(results["sources"]["held_out"]) == {"exact", "mc_labels", "constant", "pav_raw"}
    train_frame, _, _, checkpoint = _label_split(work, None)
    critic = ProverCritic.from_pretrained(checkpoint, device="cpu", dtype="float32", calibration="none")
    features = backbone_features(critic, train_frame)
    with torch.no_grad():
        values = [torch.sigmoid(critic.adapter.head(torch.from_numpy(f).float())).squeeze(-1).numpy() for f in features]
    for got, want in zip(values, _critic_rows(critic, train_frame)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    fits = head_fits(work, best_of_k=2, log=lambda *_: None)["fits"]
    truth_auroc = fits["mc_labels_with_truth_flipped_0"]["truth_auroc"]
    assert truth_auroc == 1.0 or np.isnan(truth_auroc)  # nan: one class only in a micro split
    assert all(np.isfinite(stats["mse"]) for stats in fits.values())


def test_needed_stages_read_the_labels_and_pavs_only_where_an_arm_or_the_evaluation_does():
    from dataclasses import replace

    from verl_prm.apps.arithmetic.pipeline import SCALES, needed_stages

    cpu = SCALES["cpu"]
    outcome_and_exact = replace(cpu, rl_arms=("grpo", "pav_exact"))
    assert needed_stages(outcome_and_exact, ["rl"]) == {"data", "sft", "prover", "rl"}
    assert needed_stages(outcome_and_exact, ["label", "rl"]) == {"data", "sft", "prover", "label", "rl"}
    learned = replace(cpu, rl_arms=("grpo", "pav_learned"))
    assert needed_stages(learned, ["rl"]) == {"data", "sft", "prover", "label", "pav", "rl"}
    refined = replace(cpu, rl_arms=("pav_learned_refined",))
    assert needed_stages(refined, ["rl"]) == {"data", "sft", "prover", "label", "pav", "pav_refined", "rl"}
    # the evaluation reads the pav stage's PAV (search, AUROC) whatever the arms
    assert needed_stages(outcome_and_exact, ["evaluate"]) == {"data", "sft", "prover", "label", "pav", "rl", "evaluate"}
    assert needed_stages(outcome_and_exact, ["sft"]) == {"data", "sft"}


@pytest.mark.parametrize("flags, message", [
    (["--n-mc", "0"], r"n_mc \(--n-mc\) must be an integer >= 1, got 0"),
    (["--label-problems", "-4"], r"label_problems \(--label-problems\) must be an integer >= 1, got -4"),
    (["--pav-steps", "-2"], r"pav_steps \(--pav-steps\) must be an integer >= 1, got -2"),
    (["--rl-parallel", "0"], r"rl_parallel \(--rl-parallel\) must be an integer >= 1, got 0"),
])
def test_bad_counts_are_refused_before_the_data_stage(flags, message, tmp_path, monkeypatch):
    """--n-mc 0, --label-problems -4 and --pav-steps -2 were taken and the data stage started: the Scale's
    declared bounds refuse them (also a Scale made in Python), before any stage."""
    from dataclasses import replace

    from verl_prm.apps.arithmetic import pipeline

    def no_stage(*args, **kwargs):
        raise AssertionError("a stage ran")

    monkeypatch.setattr(pipeline, "run", no_stage)
    with pytest.raises(ValueError, match=message):
        pipeline.main(["--scale", "micro", "--work-dir", str(tmp_path / "work"), *flags])
    assert not (tmp_path / "work").exists()
    with pytest.raises(ValueError, match=r"sft_problems must be an integer >= 1, got the float 200.0"):
        replace(pipeline.SCALES["micro"], sft_problems=200.0)
    with pytest.raises(ValueError, match=r"samples_per_beam must be an integer >= 1, got 0"):
        replace(pipeline.SCALES["micro"], samples_per_beam=0)
    with pytest.raises(ValueError, match=r"pav_lr must be > 0 \(a finite number\), got -0.001"):
        replace(pipeline.SCALES["micro"], pav_lr=-1e-3)

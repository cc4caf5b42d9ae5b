"""studies.word_problems_rl: the main_ppo command of each word-problem RL arm composed with verl's config and
checked by verl and the plugin, its data, verl's dataloader over fewer problems than the run's batches, the run
directory's settings and the queue (no run: nothing here starts main_ppo)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from studies import word_problems_rl as study
from studies.word_problems_rl import RunSettings, command, default_skip, main


CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with a chat template: the prompts' lengths in a policy's chat."""
    from verl_prm.bpe import train_byte_level_bpe

    trained = train_byte_level_bpe([f"label q{i} test q{i}" for i in range(50)], vocab_size=280)
    trained.chat_template = CHAT
    return trained


@pytest.fixture(autouse=True)
def _policy_tokenizer(tokenizer, monkeypatch):  # every work dir's policy is read with it
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kwargs: tokenizer)


def _work_dir(tmp_path, pool=40, test=20):
    def rows(n, split):
        return [{"data_source": "word_problems", "prompt": [{"role": "user", "content": f"{split} q{i}"}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
                 "extra_info": {"split": split, "index": i}} for i in range(n)]

    work = tmp_path / "wp"
    (work / "data").mkdir(parents=True)
    pd.DataFrame(rows(pool, "label")).to_parquet(work / "data" / "label.parquet")
    pd.DataFrame(rows(test, "test")).to_parquet(work / "data" / "test.parquet")
    (work / "policy").mkdir()
    (work / "policy" / "model.safetensors").write_bytes(b"weights")
    return work


def _critic(tmp_path):
    critic = tmp_path / "pav" / "checkpoint-10"
    critic.mkdir(parents=True)
    (critic / "config.json").write_text("{}")
    (critic / "model.safetensors").write_bytes(b"")
    return critic


def _compose(overrides):
    from verl_support import compose_validated

    return compose_validated(overrides)


def _settings(arm, critic=None, **changes):
    values = {"seed": 2, "steps": 40, "val_problems": 16, "skip": 24, **changes}
    return RunSettings(arm=arm, critic=str(critic) if arm == "pav_learned" else None, **values)


def test_every_arm_composes_with_verls_config_and_passes_the_plugins_checks(tmp_path):
    from verl_prm.integrations.verl.run_config import validate_run_config

    work, critic = _work_dir(tmp_path), _critic(tmp_path)
    commands = {}
    for arm in study.ARMS:
        cmd, run_dir, record = command(work, tmp_path / "rl", _settings(arm, critic))
        assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"] and run_dir == (tmp_path / "rl" / f"{arm}_seed2").resolve()
        overrides = cmd[3:]
        keys = [a.lstrip("+").split("=", 1)[0] for a in overrides]
        assert len(keys) == len(set(keys)), "a key given twice"
        config = _compose(overrides)
        assert (config.data.train_batch_size, config.actor_rollout_ref.rollout.n) == (8, 4)
        assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 8  # one update a step, every response
        assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 16
        assert config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 16
        assert (config.data.val_batch_size, config.data.max_response_length) == (16, 96)
        assert (config.data.seed, config.actor_rollout_ref.rollout.seed) == (2, 2)
        validation = config.actor_rollout_ref.rollout.val_kwargs
        assert validation.do_sample and validation.n == 1 and validation.temperature == 1.0
        trainer = config.trainer
        assert (trainer.total_training_steps, trainer.test_freq, trainer.save_freq) == (40, 10, 10)
        assert trainer.resume_mode == "auto" and trainer.val_before_train
        assert trainer.validation_data_dir == str(run_dir / "validation")
        assert trainer.default_local_dir == str(run_dir / "checkpoints")
        # 16 RL problems (40 - 24), 2 batches an epoch: 40 steps need 20 epochs, and one for a resume
        assert trainer.total_epochs == 21 and record["rl_problems"] == 16
        assert config.actor_rollout_ref.model.path == str(work.resolve() / "policy")
        if arm == "grpo":  # verl's own GRPO: no verl-prm config group
            assert config.algorithm.adv_estimator == "grpo" and "verl_prm" not in config
        else:
            hook, _ = validate_run_config(config)
            assert config.algorithm.adv_estimator == "pav_grpo" and hook.steps.delimiter == "\n"
            if arm == "pav_tree":
                assert (hook.critic.source, hook.critic.path) == ("tree", None)
            else:
                assert (hook.critic.source, hook.critic.format, hook.critic.path, hook.critic.calibration) == (
                    "checkpoint", "value_head", str(critic), "none")
        commands[arm] = {a for a in overrides if not a.startswith(
            ("data.train_files=", "data.val_files=", "trainer.experiment_name=", "trainer.default_local_dir=",
             "trainer.validation_data_dir="))}
    # the arms differ in the estimator and the hook's settings alone
    for a, b in (("grpo", "pav_tree"), ("pav_tree", "pav_learned")):
        assert all(o.lstrip("+").startswith(("verl_prm", "algorithm.adv_estimator")) for o in commands[a] ^ commands[b])
    trains = [pd.read_parquet(tmp_path / "rl" / f"{arm}_seed2" / "data" / "train.parquet") for arm in study.ARMS]
    assert all(frame.equals(trains[0]) for frame in trains)
    # a token_logprob checkpoint (its head's files beside the LM) is read in that format
    from verl_prm.critic.token_logprob_head import HEAD_JSON

    (critic / HEAD_JSON).write_text("{}")
    cmd, _, _ = command(work, tmp_path / "rl_tlp", _settings("pav_learned", critic))
    hook, _ = validate_run_config(_compose(cmd[3:]))
    assert (hook.critic.source, hook.critic.format, hook.critic.path) == ("checkpoint", "token_logprob", str(critic))


def test_the_rl_problems_are_the_label_pool_after_the_pavs_and_bad_sizes_are_named(tmp_path):
    work = _work_dir(tmp_path)
    command(work, tmp_path / "rl", _settings("grpo"))
    run = tmp_path / "rl" / "grpo_seed2" / "data"
    assert [r["index"] for r in pd.read_parquet(run / "train.parquet").extra_info] == list(range(24, 40))
    assert [r["index"] for r in pd.read_parquet(run / "val.parquet").extra_info] == list(range(16))
    with pytest.raises(ValueError, match="--skip 36 leaves 4 of the 40 label-pool problems .* fewer than a step's 8"):
        command(work, tmp_path / "rl", RunSettings(arm="grpo", skip=36, val_problems=4))
    with pytest.raises(ValueError, match="--val-problems 128: .*test.parquet has 20 problems"):
        command(work, tmp_path / "rl", RunSettings(arm="grpo", skip=0))
    with pytest.raises(ValueError, match="no config.json there"):
        command(work, tmp_path / "rl", RunSettings(arm="pav_learned", critic=str(tmp_path), val_problems=4))
    with pytest.raises(ValueError, match="pav_learned arm needs --critic"):
        RunSettings(arm="pav_learned")
    with pytest.raises(ValueError, match="micro_batch \\(12\\) must divide the step's 32 responses"):
        RunSettings(arm="grpo", micro_batch=12)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        RunSettings(arm="grpo", steps=2.5)


def test_the_default_skip_is_what_the_label_stage_labels(tmp_path):
    work = _work_dir(tmp_path)
    with pytest.raises(ValueError, match="no label stage .*: pass --skip"):
        default_skip(work)
    (work / "labels").mkdir()
    config = {"input": str(work / "data" / "label.parquet"), "limit": 36}
    (work / "labels" / "labels_config.json").write_text(json.dumps(config))
    assert default_skip(work) == 36
    (work / "labels" / "labels_config.json").write_text(json.dumps({**config, "input": "other.parquet"}))
    with pytest.raises(ValueError, match="not the first problems of .*label.parquet: pass --skip"):
        default_skip(work)


def test_verls_dataloader_cycles_fewer_problems_than_the_runs_batches_and_resumes_the_same_sequence(tmp_path):
    """The run's data settings (composed as main_ppo composes them) through verl's sampler and StatefulDataLoader,
    iterated as RayPPOTrainer.fit does (``for epoch in range(global_steps // len(loader), total_epochs)``): 128
    problems, 8 a step, 40 steps."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_sampler

    work = _work_dir(tmp_path, pool=1024 + 128, test=128)
    cmd, _, record = command(work, tmp_path / "rl", RunSettings(arm="grpo", seed=1, skip=1024))
    config = _compose(cmd[3:])
    problems = list(range(record["rl_problems"]))
    assert len(problems) == 128

    def loader():
        return StatefulDataLoader(dataset=problems, batch_size=config.data.train_batch_size, drop_last=True,
                                  sampler=create_rl_sampler(config.data, problems), num_workers=0)

    def fit(dataloader, global_steps, stop_after=None):
        batches = []
        for _ in range(global_steps // len(dataloader), config.trainer.total_epochs):
            for batch in dataloader:
                global_steps += 1
                batches.append(batch.tolist())
                if global_steps in (stop_after, config.trainer.total_training_steps):
                    return batches, dataloader.state_dict()
        return batches, None

    batches, _ = fit(loader(), 0)
    assert len(batches) == 40 and all(len(batch) == 8 for batch in batches)
    for epoch in range(math.ceil(40 / 16)):  # each epoch a permutation of the 128 problems, another each epoch
        seen = [p for batch in batches[16 * epoch:16 * (epoch + 1)] for p in batch]
        assert len(seen) == len(set(seen)) == min(128, 8 * (40 - 16 * epoch))
    assert batches[:16] != batches[16:32]
    # the checkpoints of test_freq 10, and at an epoch's end: the resumed loader first ends the exhausted epoch
    # (total_epochs has one more than the steps need, else the run ends 8 or 16 steps short)
    for saved_at in (10, 16, 20, 30, 32):
        first, state = fit(loader(), 0, stop_after=saved_at)
        resumed = loader()
        resumed.load_state_dict(state)
        assert first + fit(resumed, saved_at)[0] == batches


def test_a_run_directory_holds_one_run_and_a_finished_run_is_not_started_again(tmp_path, monkeypatch):
    work = _work_dir(tmp_path)
    _, run_dir, record = command(work, tmp_path / "rl", _settings("grpo"))
    study.check_settings(run_dir, record)
    study.check_settings(run_dir, record)  # the same settings: a resume
    with pytest.raises(ValueError, match="holds a run with other settings \\(lr: 2e-06 -> 1e-05\\)"):
        study.check_settings(run_dir, {**record, "lr": 1e-5})
    (run_dir / "DONE.json").write_text("{}")

    def no_start(*args, **kwargs):
        raise AssertionError("a finished run was started again")

    monkeypatch.setattr(study, "start_run", no_start)
    assert study.run(work, tmp_path / "rl", _settings("grpo"), log=lambda line: None) == 0
    data = run_dir / "data" / "train.parquet"
    before = data.read_bytes()
    with pytest.raises(ValueError, match="holds a run with other settings \\(rl_problems: 16 -> 10; skip: 24 -> 30\\)"):
        study.run(work, tmp_path / "rl", _settings("grpo", skip=30), log=lambda line: None)
    assert data.read_bytes() == before  # the refused start left the run's data as it was


def test_the_queue_runs_every_arm_and_seed_seed_by_seed_with_the_default_skip(tmp_path, monkeypatch):
    work, critic = _work_dir(tmp_path), _critic(tmp_path)
    (work / "labels").mkdir()
    (work / "labels" / "labels_config.json").write_text(
        json.dumps({"input": str(work / "data" / "label.parquet"), "limit": 24}))
    started = []
    archives = set()
    monkeypatch.setattr(study, "run", lambda work_dir, out, settings, archive: archives.add(archive)
                        or started.append(settings) or 0)
    assert main(["--work-dir", str(work), "--out", str(tmp_path / "rl"), "--arm", "grpo", "pav_tree",
                 "pav_learned", "--seed", "0", "1", "2", "--critic", str(critic), "--archive",
                 str(tmp_path / "kept")]) == 0
    assert archives == {tmp_path / "kept"}
    assert [(s.arm, s.seed) for s in started] == [(arm, seed) for seed in range(3) for arm in study.ARMS]
    assert {s.skip for s in started} == {24} and {(s.steps, s.prompts_per_step, s.val_problems) for s in started} == {
        (40, 8, 128)}
    assert [s.critic for s in started if s.critic] == [str(critic)] * 3
    assert {s.critic for s in started if s.arm != "pav_learned"} == {None}


def test_a_stopped_queue_says_which_run_it_stopped_and_runs_nothing_after_it(tmp_path, monkeypatch, capsys):
    work = _work_dir(tmp_path)
    started = []

    def run(work_dir, out, settings, archive):
        started.append((settings.arm, settings.seed))
        if settings.arm == "pav_tree":
            raise KeyboardInterrupt("signal 15")  # what `kill PID` raises (study._terminated)
        return 0

    monkeypatch.setattr(study, "run", run)
    assert main(["--work-dir", str(work), "--out", str(tmp_path / "rl"), "--arm", "grpo", "pav_tree",
                 "--seed", "0", "1", "--skip", "0"]) == 130
    assert started == [("grpo", 0), ("pav_tree", 0)]
    assert "stopped (signal 15) during pav_tree seed 0; the same command resumes it" in capsys.readouterr().err


def test_bad_options_are_refused_naming_them(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--work-dir", str(tmp_path), "--out", str(tmp_path / "rl"), "--arm", "grpo", "--lr", "nan"])
    assert "argument --lr" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--work-dir", str(tmp_path), "--out", str(tmp_path / "rl"), "--arm", "pav_learned", "--skip", "0"])
    assert "pav_learned arm needs --critic" in capsys.readouterr().err


def test_a_start_records_itself_and_a_run_that_trained_every_step_is_marked_done(tmp_path, monkeypatch):
    """``run`` with main_ppo stood in for: the stand-in logs the records verl's file logger would and exits 0."""
    import types

    from studies.arithmetic_curves import read_runs as read_exported

    work = _work_dir(tmp_path)
    val = study.VALIDATION_KEY
    step = {"critic/score/mean": 0.5, "response_length/mean": 10.0, "timing_s/step": 30.0}

    def stand_in(logged):  # for cpu_loop.start_main_ppo, which verl_rl.start_run calls after keeping earlier records
        def start(cmd, metrics_path, log_path, env, cwd, append_log):
            assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"] and env["OMP_NUM_THREADS"] == "1"
            Path(metrics_path).write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in logged))
            return types.SimpleNamespace(poll=lambda: 0, process=types.SimpleNamespace(returncode=0), stop=lambda: None,
                                         peak_bytes=2 ** 31)
        return start

    from verl_prm.apps.arithmetic import verl_rl

    settings = _settings("grpo", steps=2, test_freq=1)
    monkeypatch.setattr(verl_rl, "start_main_ppo", stand_in([(0, {val: 0.25}), (1, step), (1, {val: 0.5})]))
    assert study.run(work, tmp_path / "rl", settings, log=lambda line: None) == 0
    run_dir = tmp_path / "rl" / "grpo_seed2"
    assert not (run_dir / "DONE.json").exists()  # 1 of 2 steps: stopped early, not finished
    monkeypatch.setattr(verl_rl, "start_main_ppo", stand_in([(1, {val: 0.5}), (2, step), (2, {val: 0.75})]))
    assert study.run(work, tmp_path / "rl", settings, log=lambda line: None) == 0
    starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]
    assert [s["returncode"] for s in starts] == [0, 0] and starts[0]["peak_rss_gib"] == 2.0
    assert starts[0]["load_1min_max"] >= starts[0]["load_1min_mean"] >= 0 and "cpu" in starts[0]["environment"]
    assert (run_dir / "metrics-1.jsonl").exists()  # the first start's records, kept for the resumed one
    done = json.loads((run_dir / "DONE.json").read_text())
    assert done["outputs"]["curve"] == [[0, 0, 0.25], [1, 32, 0.5], [2, 64, 0.75]]
    assert [t["step"] for t in done["outputs"]["training"]] == [1, 2]
    assert done["seconds"] == pytest.approx(sum(s["seconds"] for s in starts))
    # a DONE.json is a record of the arithmetic recipe's runs format
    exported = tmp_path / "runs.json"
    exported.write_text(json.dumps({"format": "verl-prm arithmetic runs v1", "runs": [done]}))
    assert read_exported([exported])["grpo"][2]["settings"]["skip"] == 24


def test_the_settings_name_the_policy_and_the_compute_dtype_and_a_resume_on_others_is_refused(tmp_path,
                                                                                               monkeypatch):
    import hashlib

    from verl_prm import precision

    monkeypatch.setattr(precision, "native_bf16_instructions", lambda: False)  # a CPU without native bf16
    work = _work_dir(tmp_path)
    _, run_dir, record = command(work, tmp_path / "rl", _settings("grpo"))
    # weights_digest's definition: sha256 over "name\0sha256(file)\n" of each *.safetensors file
    expected = hashlib.sha256(f"model.safetensors\0{hashlib.sha256(b'weights').hexdigest()}\n".encode()).hexdigest()
    assert record["policy_sha256"] == expected
    assert json.loads((run_dir / "settings.json").read_text())["policy_sha256"] == expected
    (work / "policy" / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ValueError, match="holds a run with other settings \\(policy_sha256: "):
        command(work, tmp_path / "rl", _settings("grpo"))
    (work / "policy" / "model.safetensors").write_bytes(b"weights")
    # the dtype the precision resolves to on this machine; another machine's is refused on resume
    assert record["compute_dtype"] == "float32" == command(work, tmp_path / "f32", _settings(
        "grpo", precision="float32"))[2]["compute_dtype"]
    monkeypatch.setattr(precision, "native_bf16_instructions", lambda: True)  # an AMX machine resumes the run
    with pytest.raises(ValueError, match="other settings \\(compute_dtype: 'float32' -> 'bfloat16'\\)"):
        command(work, tmp_path / "rl", _settings("grpo"))
    (work / "policy" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors weights .*run the recipe's sft stage first"):
        command(work, tmp_path / "rl2", _settings("grpo"))


def test_a_finished_run_is_archived_without_its_checkpoints_and_an_archived_run_is_not_started_again(
        tmp_path, monkeypatch):
    import types

    from verl_prm.apps.arithmetic import verl_rl

    work, archive = _work_dir(tmp_path), tmp_path / "archive"
    val = study.VALIDATION_KEY
    step = {"critic/score/mean": 0.5, "response_length/mean": 10.0, "timing_s/step": 30.0}

    def start(cmd, metrics_path, log_path, env, cwd, append_log):  # main_ppo stood in for: one step and its checkpoint
        Path(metrics_path).write_text("".join(json.dumps({"step": s, "data": d}) + "\n"
                                              for s, d in [(0, {val: 0.25}), (1, step), (1, {val: 0.5})]))
        (Path(cwd) / "checkpoints" / "global_step_1").mkdir(parents=True)
        (Path(cwd) / "checkpoints" / "global_step_1" / "actor.pt").write_bytes(b"x" * 1000)
        (Path(cwd) / "validation").mkdir(exist_ok=True)
        (Path(cwd) / "validation" / "1.jsonl").write_text("{}\n")
        return types.SimpleNamespace(poll=lambda: 0, process=types.SimpleNamespace(returncode=0), stop=lambda: None,
                                     peak_bytes=2 ** 30)

    monkeypatch.setattr(verl_rl, "start_main_ppo", start)
    settings = _settings("grpo", steps=1, test_freq=1)
    lines = []
    assert study.run(work, tmp_path / "rl", settings, log=lines.append, archive=archive) == 0
    kept = archive / "grpo_seed2"
    assert {p.name for p in kept.iterdir()} >= {"settings.json", "metrics.jsonl", "starts.jsonl", "DONE.json",
                                                "validation"}
    assert not (kept / "checkpoints").exists() and not (kept / "data").exists()
    assert (kept / "validation" / "1.jsonl").read_text() == "{}\n" and any("archived in" in line for line in lines)

    def no_start(*args, **kwargs):
        raise AssertionError("an archived run was started again")

    monkeypatch.setattr(verl_rl, "start_main_ppo", no_start)
    # on a fresh machine: no run directory, another SFT's weights; the archive's run is finished
    (work / "policy" / "model.safetensors").write_bytes(b"another machine's weights")
    assert study.run(work, tmp_path / "fresh", settings, log=lines.append, archive=archive) == 0
    assert "finished before, archived" in lines[-1] and not (tmp_path / "fresh").exists()
    # the precision a machine resolves is no setting of the archived run: "auto" finished there, float32 asked here
    assert study.run(work, tmp_path / "fresh", _settings("grpo", steps=1, test_freq=1, precision="float32"),
                     log=lines.append, archive=archive) == 0
    with pytest.raises(ValueError, match="finished with other settings \\(lr: 2e-06 -> 1e-05\\)"):
        study.run(work, tmp_path / "fresh", _settings("grpo", steps=1, test_freq=1, lr=1e-5), archive=archive)


def test_a_prompt_over_the_studys_budget_is_named_before_anything_is_written(tmp_path, tokenizer):
    work = _work_dir(tmp_path)
    pool = pd.read_parquet(work / "data" / "label.parquet")
    long_question = "label q7 " * study.MAX_PROMPT_LENGTH
    pool.at[30, "prompt"] = [{"role": "user", "content": long_question}]
    pool.to_parquet(work / "data" / "label.parquet")
    length = len(tokenizer.apply_chat_template([{"role": "user", "content": long_question}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    with pytest.raises(ValueError, match=f"label.parquet, row 30: the prompt is {length} tokens in the policy's chat, "
                                         f"over the study's {study.MAX_PROMPT_LENGTH}"):
        command(work, tmp_path / "rl", _settings("grpo"))  # skip 24: row 30 is an RL problem
    assert not (tmp_path / "rl").exists()
    _, _, record = command(work, tmp_path / "rl", _settings("grpo", skip=31))  # row 30 left out: it fits
    assert record["max_prompt_length"] == study.MAX_PROMPT_LENGTH and 0 < record["longest_prompt"] <= length

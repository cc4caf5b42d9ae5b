"""verl's own training loop on CPU: the CPU platform, the hf rollout, the startup check, and `main_ppo` end to end.

Fast tests: platform selection (accelerator checks mocked), the device id, the runtime fixes' gating (a fresh
process with VERL_PLATFORM=nvidia gets none of them), the rollout server against the model itself, the CPU
startup check (also in a real `main_ppo` process, before Ray), `verl-prm patches --help`.

Slow tests (two real `python -m verl.trainer.main_ppo` runs on a tiny Qwen2, one after the other):
1. PAV-GRPO (`+verl_prm=pav`), 2 steps, critic on verl's pool (`placement.pool=colocated`), checkpoint at step
   2, validation at step 2 with the `pav` reward manager;
2. GRPO resumed from that checkpoint (`trainer.resume_mode=auto`) for step 3, critic on its own pool
   (`placement.pool=own`, scoring the pav/* metrics of an outcome estimator).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- platform


def test_cpu_platform_is_chosen_only_without_an_accelerator():
    from verl_prm.integrations.verl.platform import cpu

    platform = cpu.CPUPlatform()
    with mock.patch.object(cpu.torch.cuda, "is_available", return_value=False), \
            mock.patch.object(cpu.shutil, "which", return_value=None):
        assert platform.is_platform_available(use_smi_check=True)
    with mock.patch.object(cpu.torch.cuda, "is_available", return_value=True), \
            mock.patch.object(cpu.shutil, "which", return_value=None):
        assert not platform.is_platform_available(use_smi_check=True)
    for tool in cpu.ACCELERATOR_TOOLS:  # a CPU-only Ray actor on a GPU host: no device, but the vendor tool
        with mock.patch.object(cpu.torch.cuda, "is_available", return_value=False), \
                mock.patch.object(cpu.shutil, "which", side_effect=lambda name, t=tool: "/usr/bin/x" if name == t else None):
            assert not platform.is_platform_available(use_smi_check=True), tool


def test_verl_detection_picks_nvidia_on_a_gpu_host_and_cpu_without_one(monkeypatch):
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    from verl_prm.integrations.verl.platform import cpu

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert platform_manager.PlatformRegistry.get("cpu") is cpu.CPUPlatform  # registered by the plugin
    with mock.patch.object(PlatformCUDA, "is_platform_available", return_value=True), \
            mock.patch.object(cpu.torch.cuda, "is_available", return_value=True):
        assert platform_manager._detect_platform_name() == "nvidia"
    with mock.patch.object(PlatformCUDA, "is_platform_available", return_value=False), \
            mock.patch.object(cpu, "accelerator_present", return_value=False):
        assert platform_manager._detect_platform_name() == "cpu"
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert platform_manager._detect_platform_name() == "cpu"


def test_cpu_device_id_is_the_cpu_and_formats_as_zero():
    from verl_prm.integrations.verl.platform.cpu import CPU_DEVICE_ID, CPU_DEVICE_MODULE, CPUPlatform

    platform = CPUPlatform()
    assert f"{platform.device_name}:{platform.current_device()}" == "cpu:0"
    assert torch.device(CPU_DEVICE_ID) == torch.device("cpu")
    assert torch.zeros(2).to(CPU_DEVICE_ID).device == torch.device("cpu")
    assert platform.communication_backend_name() == "gloo" and not platform.is_ipc_supported()
    free, total = CPU_DEVICE_MODULE.mem_get_info()
    assert 0 < free <= total
    state = CPU_DEVICE_MODULE.get_rng_state()
    first = torch.rand(3)
    CPU_DEVICE_MODULE.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)


def test_fixes_run_only_where_the_cpu_platform_is_active():
    from verl_prm.integrations.verl.platform import fixes

    calls = []
    with mock.patch.object(fixes, "cpu_platform_active", return_value=False):
        fixes._when_cpu(lambda: calls.append("fix"))()
    assert calls == []
    with mock.patch.object(fixes, "cpu_platform_active", return_value=True):
        fixes._when_cpu(lambda: calls.append("fix"))()
    assert calls == ["fix"]


GPU_PLATFORM_SCRIPT = """
import verl
import verl.utils.distributed as distributed
from verl.workers.engine.base import EngineRegistry
import verl.workers.engine  # registers the engines
from verl.plugin.platform import get_platform
from verl_prm.integrations.verl.platform.fixes import installed_fixes
engines = EngineRegistry._engines["language_model"]["fsdp2"]
print("PLATFORM", get_platform().device_name)
print("FIXES", list(installed_fixes()))
print("DEFAULTS", distributed.initialize_global_process_group_ray.__defaults__)
print("CPU_ENGINE", "cpu" in engines)
import verl.models.transformers.monkey_patch as monkey_patch  # the TRL import fix applies on every platform
from verl_prm.integrations.verl.trl_fix import trl_fix_installed, trl_has_value_head
print("TRL_FIX", monkey_patch.is_trl_available() is False or trl_has_value_head())
print("TRL_FIX_INSTALLED", trl_fix_installed())
import verl.trainer.ppo.metric_utils as metric_utils
print("BOOTSTRAP_FIXED", hasattr(metric_utils.bootstrap_metric, "loop_bootstrap_metric"))
print("FIXES", list(installed_fixes()))
"""


@pytest.mark.slow
def test_nothing_of_the_cpu_platform_is_active_on_a_gpu_platform():
    """A fresh process on the nvidia platform (VERL_PLATFORM=nvidia; this host has no GPU): the plugin registers
    the cpu platform name, but no CPU fix is applied and verl's functions and engine registry are untouched."""
    env = dict(os.environ, VERL_PLATFORM="nvidia")
    result = subprocess.run([sys.executable, "-c", GPU_PLATFORM_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PLATFORM cuda" in result.stdout
    import importlib.util

    from verl_prm.integrations.verl.trl_fix import trl_has_value_head

    assert "FIXES []" in result.stdout and "BOOTSTRAP_FIXED False" in result.stdout
    # The fix that is not about the CPU: verl's TRL import, needed on any device when TRL lacks the class.
    trl_fix = importlib.util.find_spec("trl") is not None and not trl_has_value_head()
    assert f"TRL_FIX_INSTALLED {trl_fix}" in result.stdout
    assert "DEFAULTS (None, None)" in result.stdout
    assert "CPU_ENGINE False" in result.stdout
    assert "TRL_FIX True" in result.stdout


@pytest.mark.slow
def test_cpu_platform_process_gets_every_cpu_fix():
    """The same script on the CPU platform: each fix is installed once its module is imported."""
    env = dict(os.environ, VERL_PLATFORM="cpu")
    result = subprocess.run([sys.executable, "-c", GPU_PLATFORM_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PLATFORM cpu" in result.stdout
    assert "BOOTSTRAP_FIXED True" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == (
        "FIXES ['process_group_backend', 'engine_registry', 'validation_bootstrap']")


def test_vectorised_validation_bootstrap_gives_verls_numbers():
    """The CPU fix 0007 against verl's own bootstrap_metric (the reference: verl 0.9.1's loop), on numbers of
    every kind verl's validation passes (ints, floats, bools) and through process_validation_metrics."""
    from functools import partial

    import numpy as np
    import verl.trainer.ppo.metric_utils as metric_utils

    from verl_prm.integrations.verl.platform.fixes import vectorised_bootstrap_metric

    loop = getattr(metric_utils.bootstrap_metric, "loop_bootstrap_metric", metric_utils.bootstrap_metric)
    fast = vectorised_bootstrap_metric(loop)
    rng = np.random.default_rng(0)
    for data in (rng.integers(0, 2, 4).astype(float).tolist(), rng.integers(1, 9, 8).tolist(),
                 rng.normal(size=16).tolist(), [True, False, False, True], [3]):
        for subset in (1, 2, 4, 16):
            for seed in (42, 7):
                assert fast(data, subset, [np.max, np.min], seed=seed) == loop(data, subset, [np.max, np.min], seed=seed)
    # majority voting and other reductions go to verl's loop
    votes = [{"val": 1.0, "pred": "a"}, {"val": 0.0, "pred": "b"}, {"val": 1.0, "pred": "a"}]
    maj = [partial(metric_utils.calc_maj_val, vote_key="pred", val_key="val")]
    assert fast(votes, 2, maj) == loop(votes, 2, maj)
    assert fast([1.0, 2.0, 4.0], 2, [np.mean]) == loop([1.0, 2.0, 4.0], 2, [np.mean])
    # a whole validation batch of the pav reward manager's keys (4 prompts x 4 samples), with and without
    sources = ["arithmetic_mod"] * 16
    uids = [f"u{i // 4}" for i in range(16)]
    infos = {"acc": rng.integers(0, 2, 16).astype(float).tolist(), "pav_num_steps": rng.integers(1, 8, 16).tolist(),
             "pav_truncated": rng.integers(0, 2, 16).astype(float).tolist(), "pav_step_spans": ["[]"] * 16,
             "pred": [str(v) for v in rng.integers(0, 3, 16)]}
    original = metric_utils.bootstrap_metric
    try:
        metric_utils.bootstrap_metric = loop
        reference = metric_utils.process_validation_metrics(sources, uids, infos)
        metric_utils.bootstrap_metric = fast
        assert metric_utils.process_validation_metrics(sources, uids, infos) == reference
    finally:
        metric_utils.bootstrap_metric = original
    assert "best@4/mean" in reference["arithmetic_mod"]["acc"] and "maj@4/mean" in reference["arithmetic_mod"]["acc"]


def test_flops_counter_runs_on_the_cpu_platform(monkeypatch):
    from verl.plugin.platform import platform_manager
    from verl.utils.flops_counter import get_device_flops

    from verl_prm.integrations.verl.platform.cpu import CPUPlatform

    monkeypatch.setattr(platform_manager, "_current_platform", CPUPlatform())
    assert math.isfinite(get_device_flops()) and get_device_flops() > 0


# ---------------------------------------------------------------------------------------------- hf rollout


@pytest.fixture(scope="module")
def loop_dir(tmp_path_factory):
    from verl_prm.apps.cpu_loop import prepare

    work = tmp_path_factory.mktemp("cpu_loop")
    prepare(work)
    return work


def test_the_loops_policy_and_critic_have_the_users_umask_modes(loop_dir, assert_umask_modes):
    assert_umask_modes(loop_dir / "policy")
    assert_umask_modes(loop_dir / "critic")


def _server(loop_dir, **config):
    from omegaconf import OmegaConf

    from verl_prm.integrations.verl.platform.rollout import HFRolloutServer

    rollout = OmegaConf.create({"dtype": "float32", "max_model_len": None, "prompt_length": 64,
                                "response_length": 12, "seed": 0, **config})
    server = HFRolloutServer(rollout, OmegaConf.create({"path": str(loop_dir / "policy")}), replica_rank=0,
                             max_batch_size=8)
    server.load()
    return server


def test_hf_rollout_greedy_batch_matches_the_model_and_its_log_probs(loop_dir):
    """Concurrent requests are generated as one left-padded batch: each greedy response equals the model's
    own greedy continuation of that prompt alone, and the log-probs are those of the model on prompt + response."""
    server = _server(loop_dir)
    prompts = [[40, 41, 42, 10], [50, 51, 10], [60, 61, 62, 63, 64, 10]]

    async def generate_all():
        return await asyncio.gather(*[
            server.generate(prompt_ids=p, sampling_params={"temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                                             "logprobs": True}, request_id=str(i))
            for i, p in enumerate(prompts)])

    outputs = asyncio.run(generate_all())
    model = server.model
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=12, eos_token_id=server.eos_token_ids, pad_token_id=server.pad_token_id)
        expected = alone[0, len(prompt):].tolist()
        if server.eos_token_ids[0] in expected:
            expected = expected[: expected.index(server.eos_token_ids[0]) + 1]
        assert output.token_ids == expected
        full = torch.tensor([prompt + output.token_ids])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(full).logits[0, len(prompt) - 1:-1].float(), dim=-1)
        reference = log_probs.gather(-1, torch.tensor(output.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(output.log_probs), reference, atol=1e-4)
        assert output.stop_reason == "completed"


def test_hf_rollout_loads_weights_and_rejects_foreign_names(loop_dir):
    server = _server(loop_dir)
    state = {name: torch.zeros_like(t) for name, t in server.model.state_dict().items() if name != "lm_head.weight"}
    assert server.load_weights(state) == len(state)
    assert all(float(t.abs().sum()) == 0.0 for t in server.model.state_dict().values())
    with pytest.raises(KeyError, match="does not have: \\['model.extra.weight'\\]"):
        server.load_weights({**state, "model.extra.weight": torch.zeros(1)})
    missing = dict(state)
    missing.pop("model.norm.weight")
    with pytest.raises(KeyError, match="lacks parameters of the rollout model: \\['model.norm.weight'\\]"):
        server.load_weights(missing)


def test_hf_rollout_rejects_a_prompt_without_room(loop_dir):
    server = _server(loop_dir, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        server._request(list(range(8)), {})


# ---------------------------------------------------------------------------------------------- startup check


def _good_cpu_config():
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "trainer": {"device": "cpu", "n_gpus_per_node": 1, "nnodes": 1},
        "actor_rollout_ref": {"actor": {"strategy": "fsdp2"}, "ref": {"strategy": "fsdp2"},
                              "rollout": {"name": "hf", "dtype": "auto"},
                              "model": {"override_config": {"attn_implementation": "sdpa"}}},
        "ray_kwargs": {"ray_init": {"num_gpus": 1}},
    })


@pytest.mark.parametrize("key, value, message", [
    ("actor_rollout_ref.actor.strategy", "fsdp", "set actor_rollout_ref.actor.strategy=fsdp2"),
    ("actor_rollout_ref.rollout.name", "vllm", "set actor_rollout_ref.rollout.name=hf"),
    ("actor_rollout_ref.model.override_config.attn_implementation", "flash_attention_2",
     "set +actor_rollout_ref.model.override_config.attn_implementation=sdpa"),
    ("ray_kwargs.ray_init.num_gpus", None, "set +ray_kwargs.ray_init.num_gpus=1"),
    ("ray_kwargs.ray_init.num_gpus", float("nan"), "ray_kwargs.ray_init.num_gpus must be >= 0 \\(a finite number\\), got nan"),
    ("actor_rollout_ref.rollout.dtype", "float16", "actor_rollout_ref.rollout.dtype=float16: the hf rollout computes "
     "in one of \\('auto', 'bfloat16', 'float32'\\)"),
])
def test_cpu_startup_check_names_the_key_and_the_value_to_use(key, value, message):
    from omegaconf import OmegaConf

    from verl_prm.config.hook import ConfigError
    from verl_prm.integrations.verl.platform.checks import CPUStartupCheck

    config = _good_cpu_config()
    OmegaConf.update(config, key, value)
    pattern = message if "\\(" in message else message.replace("+", "\\+")
    with pytest.raises(ConfigError, match="verl-prm startup check failed: trainer.device=cpu: .*" + pattern):
        CPUStartupCheck(config.trainer, config.actor_rollout_ref, config.ray_kwargs)


def test_cpu_startup_check_refuses_a_bf16_rollout_on_a_cpu_without_native_bf16(monkeypatch):
    from verl_prm.config.hook import ConfigError
    from verl_prm.integrations.verl.platform import checks

    config = _good_cpu_config()
    config.actor_rollout_ref.rollout.dtype = "bfloat16"
    monkeypatch.setattr(checks, "native_bf16_instructions", lambda: True)
    checks.check_cpu_run(config.trainer, config.actor_rollout_ref, config.ray_kwargs)
    monkeypatch.setattr(checks, "native_bf16_instructions", lambda: False)  # an AVX2 CPU, simulated
    with pytest.raises(ConfigError, match="rollout.dtype=bfloat16 .* without native bf16 instructions .*: set "
                                          "actor_rollout_ref.rollout.dtype=auto or float32"):
        checks.check_cpu_run(config.trainer, config.actor_rollout_ref, config.ray_kwargs)
    del config.actor_rollout_ref.rollout["dtype"]  # verl's default is bfloat16
    with pytest.raises(ConfigError, match="verl's default when unset"):
        checks.check_cpu_run(config.trainer, config.actor_rollout_ref, config.ray_kwargs)


def test_cpu_startup_check_passes_a_cpu_run_and_leaves_gpu_runs_alone():
    from verl_prm.config.hook import ConfigError
    from verl_prm.integrations.verl.platform.checks import check_cpu_run

    config = _good_cpu_config()
    check_cpu_run(config.trainer, config.actor_rollout_ref, config.ray_kwargs)
    config.trainer.device = "cuda"
    config.actor_rollout_ref.actor.strategy = "fsdp"  # a GPU run: nothing of the CPU check applies
    check_cpu_run(config.trainer, config.actor_rollout_ref, config.ray_kwargs, accelerator=True)
    with pytest.raises(ConfigError, match="no accelerator .*: set trainer.device=cpu"):
        check_cpu_run(config.trainer, config.actor_rollout_ref, config.ray_kwargs, accelerator=False)


def test_cpu_startup_check_warns_of_bf16_fsdp_and_not_of_the_loop_settings(monkeypatch):
    from omegaconf import OmegaConf

    from verl_prm import precision
    from verl_prm.apps.cpu_loop import cpu_overrides
    from verl_prm.integrations.verl.platform import checks
    from verl_prm.integrations.verl.platform.checks import cpu_run_warnings

    # a CPU without native bf16 instructions (AVX2), simulated
    monkeypatch.setattr(checks, "native_bf16_instructions", lambda: False)
    monkeypatch.setattr(precision, "native_bf16_instructions", lambda: False)
    config = _good_cpu_config()
    for role in ("actor", "ref"):
        OmegaConf.update(config, f"actor_rollout_ref.{role}.fsdp_config", {"param_offload": False})
    warnings = cpu_run_warnings(config.trainer, config.actor_rollout_ref)
    assert len(warnings) == 2 and all("computes in bf16" in warning for warning in warnings)
    assert ("set ++actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,"
            "buffer_dtype:fp32}'") in warnings[0]
    # the CPU loop's settings, as Hydra parses them: no warning
    overrides = [o.removeprefix("++") for o in cpu_overrides() if ".fsdp_config.mixed_precision=" in o]
    assert len(overrides) == 2
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(overrides):
        OmegaConf.update(config, override.key_or_group, override.value(), merge=False)
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision == {
        "param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    assert cpu_run_warnings(config.trainer, config.actor_rollout_ref) == []
    config.actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype = "bf16"
    assert [w.split(":")[1].split(" computes")[0].strip() for w in cpu_run_warnings(
        config.trainer, config.actor_rollout_ref)] == ["actor_rollout_ref.ref"]
    config.trainer.device = "cuda"  # a GPU run: bf16 is its default and its fast path
    assert cpu_run_warnings(config.trainer, config.actor_rollout_ref) == []


def test_the_cpu_loop_computes_in_bf16_exactly_where_the_cpu_has_native_bf16(monkeypatch):
    from omegaconf import OmegaConf

    from verl_prm import precision
    from verl_prm.apps.cpu_loop import cpu_overrides
    from verl_prm.integrations.verl.platform import checks
    from verl_prm.integrations.verl.platform.checks import cpu_run_warnings

    for native in (True, False):
        monkeypatch.setattr(precision, "native_bf16_instructions", lambda: native)
        monkeypatch.setattr(checks, "native_bf16_instructions", lambda: native)
        overrides = cpu_overrides()
        dtype = "bfloat16" if native else "float32"
        short = "bf16" if native else "fp32"
        assert f"actor_rollout_ref.rollout.dtype={dtype}" in overrides
        assert sum(f"mixed_precision={{param_dtype:{short},reduce_dtype:fp32,buffer_dtype:fp32}}" in o
                   for o in overrides) == 2
        config = _good_cpu_config()
        for role in ("actor", "ref"):  # verl's default: bf16, which warns only without native bf16
            OmegaConf.update(config, f"actor_rollout_ref.{role}.fsdp_config", {"param_offload": False})
        assert len(cpu_run_warnings(config.trainer, config.actor_rollout_ref)) == (0 if native else 2)
    assert "actor_rollout_ref.rollout.dtype=float32" in cpu_overrides(precision="float32")
    with pytest.raises(ValueError, match="without native bf16 instructions"):
        cpu_overrides(precision="bfloat16")  # native is False here


@pytest.mark.slow
def test_main_ppo_with_a_gpu_only_setting_on_cpu_fails_before_ray(loop_dir):
    from verl_prm.apps.cpu_loop import main_ppo_args

    args = main_ppo_args(loop_dir, "pav_grpo", steps=1, extra=["actor_rollout_ref.actor.strategy=fsdp"])
    result = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args], capture_output=True, text=True,
                            timeout=240, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert ("verl-prm startup check failed: trainer.device=cpu: actor_rollout_ref.actor.strategy=fsdp needs an "
            "accelerator") in output
    assert "set actor_rollout_ref.actor.strategy=fsdp2" in output
    assert "ray init kwargs" not in output  # raised while Hydra builds its callbacks: Ray never started


def test_patches_help_is_plain_text():
    from verl_prm.integrations.verl.patches import main

    with pytest.raises(SystemExit) as exit_info, mock.patch("sys.stdout") as stdout:
        main(["--help"])
    assert exit_info.value.code == 0
    text = "".join(call.args[0] for call in stdout.write.call_args_list)
    assert "verl-prm patches" in text and "``" not in text


# ---------------------------------------------------------------------------------------------- main_ppo end to end


def _step_metrics(result, step: int) -> dict:
    records = {record["step"]: record["data"] for record in result.metrics}
    assert step in records, f"main_ppo logged steps {sorted(records)}, not step {step}; log tail:\n{result.tail()}"
    return records[step]


REFRESH_OVERRIDES = ["verl_prm.refresh.every=1", "verl_prm.refresh.window=2", "verl_prm.critic.n_mc=2",
                     "verl_prm.critic.prefix_rule=fixed", "verl_prm.critic.prefixes_per_response=2",
                     "verl_prm.critic.mc_token_budget=1500"]


@pytest.fixture(scope="module")
def loop_runs(loop_dir):
    """PAV-GRPO for 2 steps (checkpoint + validation at step 2), then GRPO resumed for steps 3-4 (critic on its own
    pool) with the learned PAV's refresh at both steps (2 continuations of 2 prefixes per response, a token
    budget). Sequential: each run peaks at ~7 GiB."""
    from verl_prm.apps.cpu_loop import main_ppo_args, run_main_ppo

    runs = {}
    runs["pav_grpo"] = run_main_ppo(
        main_ppo_args(loop_dir, "pav_grpo", steps=2, save_freq=2, test_freq=2, critic_pool="colocated"),
        loop_dir / "pav_grpo.jsonl", loop_dir / "pav_grpo.log", timeout=600)
    if runs["pav_grpo"].returncode == 0:
        runs["grpo_resumed"] = run_main_ppo(
            main_ppo_args(loop_dir, "grpo", steps=4, run_name="grpo_resumed", checkpoint_name="pav_grpo",
                          resume=True, critic_pool="own", extra=REFRESH_OVERRIDES),
            loop_dir / "grpo_resumed.jsonl", loop_dir / "grpo_resumed.log", timeout=600)
    return runs


@pytest.mark.slow
def test_main_ppo_pav_grpo_two_steps_on_cpu(loop_runs):
    result = loop_runs["pav_grpo"]
    assert result.returncode == 0, f"main_ppo pav_grpo exited {result.returncode}; log tail:\n{result.tail()}"
    assert [record["step"] for record in result.metrics] == [1, 2]
    assert "computes in bf16" not in result.log_path.read_text(errors="replace")  # fp32 FSDP reached verl
    for step in (1, 2):
        metrics = _step_metrics(result, step)
        pav = {key: value for key, value in metrics.items() if key.startswith("pav/")}
        assert {"pav/steps_per_response", "pav/process_term/mean", "pav/v0_mean", "pav/critic_seconds"} <= set(pav), \
            f"step {step}: pav metrics {sorted(pav)}"
        bad = {key: value for key, value in pav.items() if not math.isfinite(value)}
        assert not bad, f"step {step}: non-finite pav metrics {bad}"
        assert pav["pav/steps_per_response"] > 0, f"step {step}: no steps were scored"
        assert metrics["actor/grad_norm"] > 0, f"step {step}: actor grad norm {metrics['actor/grad_norm']}"
        # rewards are all 0 for a random policy: the non-zero advantages are PAV's process term
        assert metrics["critic/advantages/max"] > metrics["critic/advantages/min"], f"step {step}: constant advantages"
        assert "timing_s/pav_critic" in metrics, f"step {step}: no critic timing"


@pytest.mark.slow
def test_main_ppo_validation_with_the_pav_reward_manager(loop_runs):
    metrics = _step_metrics(loop_runs["pav_grpo"], 2)
    source = "arithmetic_mod"
    assert math.isfinite(metrics[f"val-core/{source}/acc/mean@1"])
    # the pav reward manager's extra info, averaged by verl's validation
    for key in ("pav_num_steps", "pav_response_tokens", "pav_truncated"):
        assert math.isfinite(metrics[f"val-aux/{source}/{key}/mean@1"]), key
    assert metrics[f"val-aux/{source}/pav_response_tokens/mean@1"] > 0


@pytest.mark.slow
def test_main_ppo_checkpoint_resume_continues_at_the_next_step(loop_runs, loop_dir):
    assert (loop_dir / "checkpoints" / "pav_grpo" / "global_step_2" / "actor").is_dir()
    assert "grpo_resumed" in loop_runs, "the PAV-GRPO run failed, nothing to resume"
    result = loop_runs["grpo_resumed"]
    assert result.returncode == 0, f"main_ppo grpo (resumed) exited {result.returncode}; log tail:\n{result.tail()}"
    assert [record["step"] for record in result.metrics] == [3, 4]
    assert "Resuming from" in result.log_path.read_text() and "global_step_2" in result.log_path.read_text()
    metrics = _step_metrics(result, 3)
    # GRPO with the critic on its own pool: verl's advantages, the hook's pav/* metrics only
    assert math.isfinite(metrics["pav/v0_mean"]) and metrics["pav/steps_per_response"] > 0
    assert metrics["training/global_step"] == 3


@pytest.mark.slow
def test_main_ppo_refresh_refits_the_pav_to_the_sampled_values(loop_runs, loop_dir):
    """verl_prm.refresh.every=1 on the resumed run: each step samples, writes labels that verl-prm train reads and
    refits the head; step 4's PAV (refitted at step 3) is close to step 4's fresh samples, which the random
    checkpoint head of step 3 was not (the untrained policy's labels are near 0, its values near 0.5)."""
    from verl_prm.labeling.format import read_labels

    result = loop_runs.get("grpo_resumed")
    assert result is not None and result.returncode == 0, "the resumed run failed (see the resume test)"
    first, second = _step_metrics(result, 3), _step_metrics(result, 4)
    for step, metrics in ((3, first), (4, second)):
        refresh = {key: value for key, value in metrics.items() if key.startswith("pav/refresh/")}
        assert refresh["pav/refresh/labels"] > 0 and refresh["pav/refresh/fit_converged"] == 1.0, (step, refresh)
        assert all(math.isfinite(v) for v in refresh.values()), (step, refresh)
        assert 0 < metrics["pav/mc_tokens"] <= 1500 and metrics["timing_s/pav_refresh"] > 0, step
    assert second["pav/refresh/window_labels"] == first["pav/refresh/labels"] + second["pav/refresh/labels"]
    assert first["pav/refresh/mse"] > 0.01 and second["pav/refresh/mse"] < first["pav/refresh/mse"] / 10, \
        (first["pav/refresh/mse"], second["pav/refresh/mse"])
    directory = loop_dir / "checkpoints" / "pav_grpo" / "pav_refresh"
    labels = read_labels(directory / "labels")
    assert sorted(p.name for p in (directory / "labels").glob("*.parquet")) == ["step_000003.parquet",
                                                                                  "step_000004.parquet"]
    # one row per response (4 prompts x 4 responses a step), each labelled position counted once, each prompt's
    # value once (not on each of its responses)
    assert len(labels) == 32
    counted = labels["prompt_index"].nunique() + sum(sum(n > 0 for n in row.n_mc) + (len(row.n_mc) > 0)
                                                     for row in labels.itertuples())
    assert counted == first["pav/refresh/labels"] + second["pav/refresh/labels"]


def test_launcher_runs_the_same_main_ppo_command_as_the_tests(tmp_path):
    """examples/cpu_loop/run.sh spells the command out for users; it must be main_ppo_args' command."""
    from verl_prm.apps.cpu_loop import main_ppo_args
    from verl_prm.apps.arithmetic import score

    lines = (REPO / "examples" / "cpu_loop" / "run.sh").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("python3 -m verl.trainer.main_ppo \\"))
    overrides = []
    for line in lines[start + 1:]:
        item = line.strip().rstrip("\\").strip()
        if item == '"$@"':
            break
        if item.startswith("`#"):
            continue
        overrides.append(item)
    import torch

    from verl_prm.precision import resolve_dtype

    bf16 = resolve_dtype("auto", "cpu") == torch.bfloat16  # the script reads the same /proc/cpuinfo flags
    for estimator in ("grpo", "pav_grpo"):
        values = {"$WORK_DIR": str(tmp_path), "$ADV_ESTIMATOR": estimator, "$SCORE_FILE": score.__file__, "$STEPS": "2",
                  "$ROLLOUT_DTYPE": "bfloat16" if bf16 else "float32", "$PARAM_DTYPE": "bf16" if bf16 else "fp32"}
        script = []
        for item in overrides:
            for name, value in values.items():
                item = item.replace(name, value)
            script.append(item.replace('"', "").replace("'", ""))
        assert script == main_ppo_args(tmp_path, estimator, steps=2)


def test_main_ppo_args_keep_one_value_per_key_and_can_leave_the_plugin_out(tmp_path):
    from verl_prm.apps.cpu_loop import main_ppo_args, merge_overrides

    assert merge_overrides(["+verl_prm=pav", "a.b=1", "c=2", "d=3"], ["a.b=5", "~d", "e=6"]) == [
        "+verl_prm=pav", "c=2", "a.b=5", "e=6"]
    assert merge_overrides(["+x.y=1"], ["x.y=2"]) == ["x.y=2"]  # the same key with or without +
    args = main_ppo_args(tmp_path, "pav_grpo", steps=2, extra=["verl_prm.critic.path=null", "~trainer.total_epochs",
                                                               "data.seed=3"])
    keys = [a.lstrip("+").split("=", 1)[0] for a in args]
    assert len(keys) == len(set(keys)) and "trainer.total_epochs" not in keys
    assert "verl_prm.critic.path=null" in args and "data.seed=3" in args
    own = main_ppo_args(tmp_path, "grpo", steps=2, plugin=False)
    assert [a for a in own if a.lstrip("+").startswith("verl_prm")] == []
    assert [a for a in main_ppo_args(tmp_path, "grpo", steps=2) if not a.lstrip("+").startswith("verl_prm")] == own


def test_bench_loop_averages_steps_after_the_first():
    from verl_prm.apps.bench.loop import metric_means, phase_means, table

    metrics = [{"step": 2, "data": {"timing_s/step": 3.0, "timing_s/adv": 0.3, "pav/mc_tokens": 90.0}},
               {"step": 1, "data": {"timing_s/step": 10.0, "timing_s/adv": 1.0, "pav/mc_tokens": 10.0}},
               {"step": 3, "data": {"timing_s/step": 5.0, "timing_s/adv": 0.1, "pav/mc_tokens": 110.0}}]
    assert phase_means(metrics) == {"step": 4.0, "adv": 0.2}
    assert phase_means(metrics[1:2]) == {"step": 10.0, "adv": 1.0}  # one step: nothing to skip
    assert metric_means(metrics, ["pav/mc_tokens", "pav/mc_token_ratio"]) == {"pav/mc_tokens": 100.0}
    text = table({"grpo": {"step": 2.0, "adv": 0.1}, "pav_grpo": {"step": 4.0, "adv": 0.2}})
    assert "adv" in text and "2.00" in text and "5.0%" in text


def test_bench_loop_table_and_summary_of_the_sampled_arm():
    from verl_prm.apps.bench.loop import sampled_summary, table

    means = {"grpo": {"gen": 2.0, "adv": 0.1, "step": 2.5},
             "pav_grpo": {"gen": 2.0, "pav_critic": 0.05, "adv": 0.1, "step": 2.5},
             "sampled": {"gen": 2.0, "pav_critic": 1.1, "pav_mc": 1.0, "adv": 1.2, "step": 4.0}}
    rows = {line.split()[0]: line.split()[1:] for line in table(means).splitlines()[2:]}
    # seconds of grpo, pav_grpo, sampled; ratios pav_grpo/grpo, sampled/grpo; shares of the pav_grpo, sampled step
    assert rows["pav_mc"] == ["-", "-", "1.000", "-", "-", "-", "25.0%"]
    assert rows["adv"] == ["0.100", "0.100", "1.200", "1.00", "12.00", "4.0%", "30.0%"]
    assert rows["step"][3:] == ["1.00", "1.60", "100.0%", "100.0%"]
    text = sampled_summary(means["sampled"], {"pav/mc_tokens": 640.0, "pav/mc_token_ratio": 1.6,
                                              "pav/mc_continuations": 40.0, "pav/mc_prefixes_evaluated": 10.0,
                                              "pav/mc_prefixes_skipped": 0.0, "response_length/mean": 25.0}, 16)
    assert "timing_s/pav_mc = 25.0% of a step (1.000 s of 4.000 s; advantage phase incl. sampling 30.0%)" in text
    assert "per step 640 continuation tokens (40 continuations of 10 prefixes, 0 refused" in text
    assert "for 400 response tokens: pav/mc_token_ratio 1.60" in text


def test_bench_loop_summary_of_the_tree_arm():
    from verl_prm.apps.bench.loop import tree_summary

    text = tree_summary({"gen": 2.5, "step": 5.0}, {
        "pav/tree_generated_tokens": 300.0, "pav/tree_root_tokens": 200.0, "pav/tree_branch_tokens": 100.0,
        "pav/tree_trained_tokens": 400.0, "pav/tree_generated_share": 0.75, "pav/tree_fallback_groups": 0.5})
    assert text == ("tree groups: per step 300 generated tokens (200 roots, 100 branches) for 400 trained: 0.75 of a "
                    "GRPO step's generation; 0.5 groups fell back to extra roots; timing_s/gen 2.500 s of a 5.000 s step")


def test_bench_loop_arms_compose_and_the_sampled_arm_passes_the_startup_check(tmp_path):
    """The arms' main_ppo configs: the same parity reward (it gives both outcomes), the sampled arm with
    format=rollout passing the rollout critic's startup check, the tree arm with format=tree passing the tree's."""
    from verl_support import compose_verl

    from verl_prm.apps.bench.loop import ARMS, arm_overrides
    from verl_prm.apps.cpu_loop import main_ppo_args
    from verl_prm.config.hook import read_hook_config
    from verl_prm.integrations.verl.rollout_sampler import run_reward_function
    from verl_prm.integrations.verl.run_config import check_sampling_run
    from verl_prm.integrations.verl.run_config import check_tree_run

    configs = {}
    for arm in ARMS:
        estimator, extra = arm_overrides(arm, n_mc=3, prefix_rule="first_pit", tree_roots=2, tree_width=2)
        config = configs[arm] = compose_verl(main_ppo_args(tmp_path, estimator, steps=2, extra=extra))
        score = run_reward_function(config)
        assert [score("arithmetic_mod", text, "7") for text in ("12", "123")] == [1.0, 0.0], arm
        assert config.algorithm.adv_estimator == estimator
        assert config.verl_prm.critic.source == {"sampled": "sampled", "tree": "tree"}.get(arm, "checkpoint"), arm
    sampled, tree = configs["sampled"], configs["tree"]
    assert (sampled.verl_prm.critic.path, sampled.verl_prm.critic.n_mc, sampled.verl_prm.critic.prefix_rule) == \
        (None, 3, "first_pit")
    check_sampling_run(sampled)
    assert (tree.verl_prm.critic.path, tree.verl_prm.tree.roots, tree.verl_prm.tree.branch_width) == (None, 2, 2)
    check_tree_run(tree, read_hook_config(tree.verl_prm))
    with pytest.raises(ValueError, match="unknown bench loop arm 'sft'"):
        arm_overrides("sft")


@pytest.mark.parametrize("flag", ["--steps", "--n-mc", "--tree-roots", "--tree-width"])
def test_bench_loop_rejects_a_count_below_one_naming_the_flag(flag, capsys):
    from verl_prm.apps.bench.loop import main

    with pytest.raises(SystemExit) as exit_info:
        main([flag, "0"])
    assert exit_info.value.code == 2
    assert f"verl-prm bench loop: error: argument {flag}: must be >= 1, got 0" in capsys.readouterr().err

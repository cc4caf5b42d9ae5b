"""Readiness for the first GPU run, checked on CPU: the GPU extra against verl's own pins, the attention chosen
without flash-attn, accelerator detection as verl does it, the GPU-less head node, token-balanced critic shards."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import random
import re
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_gpu_extra_pins_what_verls_vllm_extra_pins():
    """verl 0.9.1's installed metadata (its `vllm` extra) is the reference: the same vllm/torch/transformers."""
    verl_pins = {}
    for text in importlib.metadata.requires("verl"):
        req = Requirement(text)
        if req.marker is not None and req.marker.evaluate({"extra": "vllm"}) and req.name in ("vllm", "torch", "transformers"):
            verl_pins[req.name] = str(req.specifier)
    assert verl_pins == {"vllm": "==0.24.0", "torch": "==2.11.0", "transformers": "==5.9.0"}
    project = _pyproject()["project"]
    ours = {Requirement(t).name: str(Requirement(t).specifier) for t in project["optional-dependencies"]["gpu"]}
    assert ours == verl_pins
    assert not any(Requirement(t).name == "flash-attn" for t in project["optional-dependencies"]["gpu"])
    base = {Requirement(t).name: Requirement(t).specifier for t in project["dependencies"]}
    assert base["transformers"].contains(verl_pins["transformers"].removeprefix("=="))
    assert SpecifierSet(str(base["torch"])).contains(verl_pins["torch"].removeprefix("=="))


@pytest.mark.parametrize("installed, expected", [(True, ("flash_attention_2", True)), (False, ("sdpa", False))])
def test_actor_attention_follows_flash_attn(installed, expected):
    from verl_prm.integrations.verl.attention import actor_attention

    assert actor_attention(installed) == expected


@pytest.mark.parametrize("installed", [True, False])
def test_launcher_interpolations_resolve_to_the_choice(monkeypatch, caplog, installed):
    """The launchers' two interpolations resolve (with one log line) to flash + remove-padding or sdpa + padded."""
    from omegaconf import OmegaConf

    from verl_prm.integrations.verl import attention

    attention.register_attention_resolvers()
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: installed)
    monkeypatch.setattr(attention, "_logged", False)
    launchers = [REPO / "examples/pav_grpo/run_qwen2_5_0_5b_gsm8k_pav_grpo.sh",
                 REPO / "examples/code/run_qwen2_5_coder_0_5b_humaneval_pav_grpo.sh"]
    for launcher in launchers:
        text = launcher.read_text()
        assert "use_remove_padding=True" not in text, launcher
        overrides = dict(re.findall(r"^\s+\+?(actor_rollout_ref\.model\.[\w.]+)='(\$\{[^']+\})' \\$", text, re.M))
        assert set(overrides) == {"actor_rollout_ref.model.use_remove_padding",
                                  "actor_rollout_ref.model.override_config.attn_implementation"}, launcher
        config = OmegaConf.create({"a": overrides["actor_rollout_ref.model.use_remove_padding"],
                                   "b": overrides["actor_rollout_ref.model.override_config.attn_implementation"]})
        with caplog.at_level("WARNING", logger="verl_prm"):
            assert (config.a, config.b) == ((True, "flash_attention_2") if installed else (False, "sdpa"))
    lines = [r.getMessage() for r in caplog.records if "flash-attn is" in r.getMessage()]
    assert lines == [f"verl-prm: flash-attn is {'installed' if installed else 'not installed'}: the actor uses "
                     f"attn_implementation={'flash_attention_2' if installed else 'sdpa'}, "
                     f"use_remove_padding={installed}"]


def test_critic_attention_is_sdpa_for_fp32_even_with_flash_attn(monkeypatch):
    from verl_prm.critic import loading

    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    cuda = torch.device("cuda")
    assert loading.default_attn_implementation(cuda, torch.bfloat16) == "flash_attention_2"
    assert loading.default_attn_implementation(cuda, torch.float16) == "flash_attention_2"
    assert loading.default_attn_implementation(cuda, torch.float32) == "sdpa"  # flash-attn takes half precision only
    assert loading.default_attn_implementation(torch.device("cpu"), torch.bfloat16) == "sdpa"


def test_accelerator_detection_looks_where_verl_looks(monkeypatch, tmp_path):
    """nvidia-smi in /usr/bin but not on the PATH: verl's CUDA platform finds it (platform_cuda.py), so must we."""
    from verl_prm.integrations.verl.platform import cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    tool_dir = tmp_path / "usr_bin"
    tool_dir.mkdir()
    monkeypatch.setattr(cpu, "TOOL_DIRECTORIES", (str(tool_dir),))
    assert not cpu.accelerator_present()
    tool = tool_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\n")
    assert not cpu.accelerator_present()  # not executable: verl skips it too
    tool.chmod(0o755)
    assert cpu.find_tool("nvidia-smi") == str(tool)
    assert cpu.accelerator_present()
    from verl.plugin.platform.platform_base import PlatformBase
    import inspect

    # verl's own list of places (the reference this mirrors)
    source = inspect.getsource(PlatformBase.check_smi_command)
    monkeypatch.undo()
    assert list(cpu.TOOL_DIRECTORIES) == re.findall(r'f"(/[\w/]+?)/\{cmd\}"', source)


def test_gpu_less_head_node_passes_when_it_joins_the_cluster(monkeypatch):
    from verl_prm.config.hook import ConfigError
    from verl_prm.integrations.verl.platform.checks import check_cpu_run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    trainer = {"device": "cuda", "n_gpus_per_node": 8, "nnodes": 2}
    with pytest.raises(ConfigError, match="this host has no accelerator and the run starts its own Ray cluster"):
        check_cpu_run(trainer, {}, {}, accelerator=False)
    check_cpu_run(trainer, {}, {"ray_init": {"address": "10.0.0.1:6379"}}, accelerator=False)
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    check_cpu_run(trainer, {}, {}, accelerator=False)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    with pytest.raises(ConfigError):
        check_cpu_run(trainer, {}, {}, accelerator=False)


def test_balanced_row_order_equal_counts_and_token_bound():
    from verl_prm.integrations.verl.critic_placement import balanced_row_order, inverse_order, shard_token_sums

    rng = random.Random(3)
    for world in (1, 2, 4, 8):
        lengths = [int(64 * 32 ** rng.random()) for _ in range(world * 16)]
        order = balanced_row_order(lengths, world)
        assert sorted(order) == list(range(len(lengths)))
        sums = shard_token_sums(lengths, order, world)
        assert sum(sums) == sum(lengths)
        assert max(sums) - min(sums) <= max(lengths)  # the docstring's bound
        naive = shard_token_sums(lengths, list(range(len(lengths))), world)
        assert max(sums) <= max(naive)
        inverse = inverse_order(order)
        assert [order[inverse[i]] for i in range(len(order))] == list(range(len(order)))
    # sorted lengths split in order: one shard gets all the long rows; balanced: equal here
    lengths = [1000] * 4 + [10] * 4
    assert shard_token_sums(lengths, balanced_row_order(lengths, 2), 2) == [2020, 2020]
    with pytest.raises(ValueError, match="5 rows do not split into 2 equal shards"):
        balanced_row_order([1] * 5, 2)


def test_worker_error_names_the_batch_sample():
    from verl_prm.integrations.verl.critic_worker import batch_sample_numbers

    assert batch_sample_numbers("sample 1: too long (sample 0 fine)", [7, 3]) == "sample 3: too long (sample 7 fine)"

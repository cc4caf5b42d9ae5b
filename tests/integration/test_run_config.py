"""The run config of a verl run with the plugin, composed by Hydra as main_ppo composes it: the yaml's defaults,
the typed sections, and the startup validation's errors (unknown keys, NaN knobs, critic paths, exact provers)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import re

import pytest
import torch
from omegaconf import OmegaConf
from verl_support import PLUGIN_OVERRIDES, compose_verl

from verl_prm.config import PavConfig
from verl_prm.choices import CHECKPOINT_FORMATS, CODE_STEP_RULES, VALUE_SOURCES
from verl_prm.config.hook import ConfigError, HookConfig, read_hook_config
from verl_prm.integrations.verl.run_config import check_source_settings, validate_run_config


# ---------------------------------------------------------------------------------------------- config


def test_yaml_defaults_equal_the_typed_configs():
    """Hydra composes pav.yaml (generated from the dataclasses) into exactly the dataclasses' defaults: no key more,
    none less, no value different."""
    config = compose_verl(PLUGIN_OVERRIDES)
    assert OmegaConf.to_container(config.verl_prm, resolve=True) == asdict(HookConfig())
    assert read_hook_config(config.verl_prm) == HookConfig()
    assert OmegaConf.to_container(config.algorithm.pav, resolve=True) == asdict(PavConfig())
    assert config.trainer.v1.trainer_mode == "pav_sync"
    assert config.reward.reward_manager.name == "pav"
    assert config.algorithm.adv_estimator == "pav_grpo"


def test_every_checkpoint_format_a_config_names_has_a_loader():
    """A format the config accepts must load: the checkpoint formats are the loaders' registry; exact, rollout and
    tree read no checkpoint."""
    from verl_prm.critic.formats import FORMATS

    assert set(CHECKPOINT_FORMATS) == set(FORMATS)
    assert not set(VALUE_SOURCES) & set(FORMATS)  # a source is no checkpoint format


def test_every_code_rule_a_config_names_splits_code():
    from verl_prm.steps.code import code_step_char_spans

    code = "def f(x):\n    y = x + 1\n    return y\n"
    for rule in CODE_STEP_RULES:
        spans = code_step_char_spans(code, rule, depth=1)
        assert len(spans) >= 2 and spans[-1][1] == len(code), rule
        read_hook_config({"steps": {"delimiter": None, "code_rule": rule}})


def test_steps_section_splits_with_its_rule(bpe_small):
    """The hook and the reward manager split through StepsSection.split: the text rules go to split_steps, a
    code rule to code_split_steps."""
    from verl_prm.steps.code import code_split_steps
    from verl_prm.config.hook import StepsSection
    from verl_prm.steps import split_steps

    texts = ["def f(x):\n    y = x + 1\n\n    return y\n", "First.\n\nSecond.\n\nThird."]
    rows = [bpe_small.encode(t, add_special_tokens=False) + [bpe_small.eos_token_id] for t in texts]
    ids = torch.full((2, max(map(len, rows)) + 1), bpe_small.pad_token_id)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1

    def fields(split):
        return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(split).items()}

    text_section = read_hook_config({"steps": {"max_steps": 2}}).steps
    assert fields(text_section.split(ids, mask, bpe_small)) == fields(split_steps(ids, mask, bpe_small, max_steps=2))
    code_section = read_hook_config({"steps": {"delimiter": None, "code_rule": "block", "code_depth": 1}}).steps
    assert isinstance(code_section, StepsSection)
    split = code_section.split(ids, mask, bpe_small)
    assert fields(split) == fields(code_split_steps(ids, mask, bpe_small, "block", depth=1))
    assert split.step_texts(0) == ["def f(x):\n", "    y = x + 1\n\n", "    return y\n"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+verl_prm.critic.colour=red"], "verl_prm.critic.colour"),
        (["+verl_prm.stepz.delimiter=x"], "verl_prm.stepz"),
        (["+algorithm.pav.alphaa=1"], "alphaa"),
        (["algorithm.pav.alpha=-0.5"], "algorithm.pav.alpha must be in [0, 1e+06]"),
        (["algorithm.pav.alpha=1e7"], "algorithm.pav.alpha must be in [0, 1e+06] (a finite number), got 10000000.0"),
        (["algorithm.pav.best_of_k=0"], "algorithm.pav.best_of_k must be an integer >= 1"),
        (["verl_prm.critic.path=null"], "verl_prm.critic.path is required"),
        (["verl_prm.critic.path=/no/such/critic"], "verl_prm.critic.path: critic checkpoint '/no/such/critic': no such directory"),
        # NaN and inf knobs: checked at startup, the key named
        (["algorithm.pav.alpha=nan"], "algorithm.pav.alpha must be in [0, 1e+06] (a finite number), got nan"),
        (["algorithm.pav.alpha=inf"], "algorithm.pav.alpha must be in [0, 1e+06] (a finite number), got inf"),
        (["algorithm.pav.clip=nan"], "algorithm.pav.clip must be > 0 (a finite number), got nan"),
        (["algorithm.pav.epsilon=inf"], "algorithm.pav.epsilon must be > 0 (a finite number), got inf"),
        (["algorithm.pav.aggregate_weight=-inf"], "algorithm.pav.aggregate_weight must be in [-1e+06, 1e+06] (a finite number), got -inf"),
        (["algorithm.pav.best_of_k=nan"], "algorithm.pav.best_of_k must be an integer >= 1, got nan"),
        (["+verl_prm.critic.options.softcap=nan"], "verl_prm.critic.options.softcap must be a finite number, got nan"),
        (["algorithm.adv_estimator=pav_grp"],
         "algorithm.adv_estimator='pav_grp' is not a registered advantage estimator (did you mean 'pav_grpo'?)"),
        (["algorithm.adv_estimator=no_such_estimator", "trainer.v1.trainer_mode=sync"],
         "algorithm.adv_estimator='no_such_estimator' is not a registered advantage estimator; known: gae,"),
        (["trainer.v1.trainer_mode=sync"], "needs the step tensors that only the verl-prm trainer hook computes"),
        (["verl_prm.critic.format=onnx"], "verl_prm.critic.format must be one of"),
        (["verl_prm.placement.pool=elsewhere"], "verl_prm.placement.pool must be one of"),
        (["verl_prm.steps.regex='(?=Step'"], "is not a valid regex"),
        (["verl_prm.steps.max_tokens=0"], "verl_prm.steps.max_tokens must be an integer >= 1"),
        (["verl_prm.critic.n_mc=2.5"], "verl_prm.critic.n_mc must be an integer, got 2.5"),
        (["verl_prm.critic.dtype=fp8"], "verl_prm.critic.dtype must be one of ('auto', 'bfloat16', 'float16', 'float32'), got 'fp8'"),
        (["verl_prm.steps.regex=Step", "verl_prm.steps.max_tokens=8"], "not both"),
        (["verl_prm.critic.max_tokens_per_batch=0"], "max_tokens_per_batch must be an integer >= 1"),
        (["verl_prm.steps.code_rule=ast"], "verl_prm.steps.code_rule must be one of"),
        (["verl_prm.steps.code_rule=block", "verl_prm.steps.regex=x", "verl_prm.steps.delimiter=null"],
         "code_rule replaces the text rules: set verl_prm.steps.regex=null"),
        (["verl_prm.steps.code_rule=line", "verl_prm.steps.delimiter=';'"],
         "set verl_prm.steps.delimiter=null"),
        (["verl_prm.steps.code_depth=-1"], "verl_prm.steps.code_depth must be an integer >= 0"),
        (["algorithm.adv_estimator=tree_rl"],
         "algorithm.adv_estimator=tree_rl reads the node values and leaf counts of tree-shaped groups, but "
         "verl_prm.critic.source=checkpoint: set verl_prm.critic.source=tree"),
    ],
)
def test_startup_validation_errors(overrides, message, critic_dir):
    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}"] + overrides)
    with pytest.raises(ConfigError) as error:
        validate_run_config(config)
    assert message in str(error.value)


def test_known_estimators_cover_verl_and_the_plugin():
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    from verl_prm.integrations.verl.run_config import known_estimators
    from verl_prm.estimators import ESTIMATORS

    known = known_estimators()
    assert set(ESTIMATORS) <= known and {e.value for e in AdvantageEstimator} <= known


@pytest.fixture
def broken_critics(tmp_path, critic_dir) -> dict[str, Path]:
    """Critic paths that must fail the startup check: a file, a directory without weights, pickle-only."""
    import shutil

    from safetensors.torch import load_file

    empty = tmp_path / "no_weights"
    empty.mkdir()
    shutil.copy(critic_dir / "config.json", empty / "config.json")
    pickle_only = tmp_path / "pickle_only"
    shutil.copytree(critic_dir, pickle_only)
    torch.save(load_file(pickle_only / "model.safetensors"), pickle_only / "pytorch_model.bin")
    (pickle_only / "model.safetensors").unlink()
    return {"file": critic_dir / "config.json", "no_weights": empty, "pickle_only": pickle_only}


@pytest.mark.parametrize("kind, message", [
    ("file", "is a file, not a checkpoint directory"),
    ("no_weights", "has no model weights (no model.safetensors"),
    ("pickle_only", "has only pickle weights (pytorch_model.bin)"),
])
def test_startup_rejects_a_critic_path_without_loadable_weights(kind, message, broken_critics):
    path = broken_critics[kind]
    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={path}"])
    with pytest.raises(ConfigError) as error:
        validate_run_config(config)
    assert str(error.value).startswith(f"verl_prm.critic.path: critic checkpoint {str(path)!r} ")
    assert message in str(error.value)
    if kind == "pickle_only":  # the documented opt-in
        validate_run_config(compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={path}",
                                                             "verl_prm.critic.allow_pickle=true"]))


def test_startup_rejects_an_uncached_hub_id_offline(critic_dir, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="'some-org/some-critic': no such directory, and HF_HUB_OFFLINE is set"):
        validate_run_config(compose_verl(PLUGIN_OVERRIDES + ["verl_prm.critic.path=some-org/some-critic"]))
    monkeypatch.delenv("HF_HUB_OFFLINE")  # online, a hub id is left to the worker's download
    validate_run_config(compose_verl(PLUGIN_OVERRIDES + ["verl_prm.critic.path=some-org/some-critic"]))


def test_critic_worker_gets_the_pickle_opt_in(critic_dir):
    from verl_prm.integrations.verl.sources import critic_worker_kwargs

    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", "verl_prm.critic.allow_pickle=true"])
    hook, _ = validate_run_config(config)
    assert critic_worker_kwargs(hook)["allow_pickle"] is True
    assert critic_worker_kwargs(read_hook_config(None))["allow_pickle"] is False


def test_critic_calibration_choice_reaches_the_worker_and_is_checked_at_startup(critic_dir, tmp_path):
    """verl_prm.critic.calibration goes to ProverCritic.from_pretrained as is (auto: the checkpoint's
    calibration.json; none: raw values; tests/unit/test_calibration.py loads both); a missing file, or a choice
    for a critic without weights, stops the run at startup naming the key."""
    from verl_prm.integrations.verl.sources import critic_worker_kwargs

    base = PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}"]
    assert critic_worker_kwargs(validate_run_config(compose_verl(base))[0])["calibration"] == "auto"
    hook, _ = validate_run_config(compose_verl(base + ["verl_prm.critic.calibration=none"]))
    assert critic_worker_kwargs(hook)["calibration"] == "none"
    missing = tmp_path / "calibration.json"
    with pytest.raises(ConfigError, match=re.escape(f"verl_prm.critic.calibration={str(missing)!r} does not exist")):
        validate_run_config(compose_verl(base + [f"verl_prm.critic.calibration={missing}"]))
    with pytest.raises(ConfigError, match=re.escape("verl_prm.critic.calibration='none' is unused with "
                                                    "verl_prm.critic.source=sampled")):
        check_source_settings(read_hook_config({"critic": {"source": "sampled", "calibration": "none"}}))


@pytest.fixture
def calibrated_critic(tmp_path, critic_dir) -> Path:
    """A copy of the tiny critic with a valid Platt calibration.json fitted for its weights."""
    import shutil

    from verl_prm.checkpoints import weights_digest
    from verl_prm.training.calibration import Calibration, write_calibration

    copy = tmp_path / "calibrated_critic"
    shutil.copytree(critic_dir, copy)
    write_calibration(Calibration("platt", {"slope": 1.3, "intercept": -0.2}, 64, weights_digest(copy)), copy)
    return copy


def _edit_calibration(path: Path, **fields) -> None:
    import json

    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("case, message", [
    ("non_monotone", r"verl_prm.critic.calibration=auto: {file}: isotonic map is not monotone at breakpoint 1"),
    ("flat", r"verl_prm.critic.calibration=auto: {file}: the platt map is flat"),
    ("other_weights", r"verl_prm.critic.calibration=auto: {file} was fitted for other weights"),
    ("dangling_link", r"verl_prm.critic.calibration=auto: {file} is a symbolic link to .*, which does not exist"),
    ("directory_without_file", r"verl_prm.critic.calibration={directory}: no calibration file {directory}/"
                               r"calibration.json"),
    ("refresh_with_auto", r"verl_prm.refresh.every=2 refits the value head of {critic}, but "
                          r"verl_prm.critic.calibration=auto applies platt calibration \(slope 1.3.*from {file}\), a "
                          r"map fitted for the checkpoint's head: set verl_prm.critic.calibration=none"),
])
def test_startup_reads_and_checks_the_calibration_the_critic_will_apply(calibrated_critic, tmp_path, case, message):
    """The startup check (run before Ray and the critic workers start) reads the calibration file through the
    function the workers load it with (checkpoint_calibration), so each of these stops the run there."""
    file, overrides = calibrated_critic / "calibration.json", []
    base = PLUGIN_OVERRIDES + [f"verl_prm.critic.path={calibrated_critic}"]
    validate_run_config(compose_verl(base))  # the valid calibration passes
    if case == "non_monotone":
        _edit_calibration(file, method="isotonic", parameters={"x": [0.2, 0.1], "y": [0.1, 0.9]})
    elif case == "flat":
        _edit_calibration(file, parameters={"slope": 1e-12, "intercept": 0.0})
    elif case == "other_weights":
        _edit_calibration(file, weights_digest="ab" * 32)
    elif case == "dangling_link":
        file.rename(tmp_path / "moved.json")
        file.symlink_to(tmp_path / "elsewhere.json")
    elif case == "directory_without_file":
        (tmp_path / "calibrations").mkdir()
        overrides = [f"verl_prm.critic.calibration={tmp_path / 'calibrations'}"]
    else:
        overrides = ["verl_prm.refresh.every=2"]
    with pytest.raises(ConfigError) as error:
        validate_run_config(compose_verl(base + overrides))
    assert re.match(message.format(file=re.escape(str(file)), directory=re.escape(str(tmp_path / "calibrations")),
                                   critic=re.escape(str(calibrated_critic))), str(error.value)), str(error.value)
    if case == "refresh_with_auto":  # the documented fix
        validate_run_config(compose_verl(base + overrides + ["verl_prm.critic.calibration=none"]))


def test_startup_validation_accepts_a_valid_run(critic_dir):
    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", "algorithm.pav.alpha=0.5"])
    hook, pav = validate_run_config(config)
    assert hook.critic.path == str(critic_dir) and pav.alpha == 0.5
    # an outcome-only run without the hook needs no critic
    validate_run_config(compose_verl(["algorithm.adv_estimator=grpo"]))

def test_own_placement_adds_the_critic_pool_to_verl_resource_pools(critic_dir, policy_dir):
    """placement.pool=own: the critic's pool joins verl's ResourcePoolManager spec before verl creates the pools
    (so verl's GPU-availability check counts it); colocated adds nothing (the critic uses global_pool)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_prm.integrations.verl.critic_group import CRITIC_POOL_NAME

    base = PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", f"actor_rollout_ref.model.path={policy_dir}"]
    own = get_trainer_cls("pav_sync")(compose_verl(base + [
        "verl_prm.placement.pool=own", "verl_prm.placement.n_gpus_per_node=2", "verl_prm.placement.nnodes=1"]))
    own._init_resource_pool_mgr()
    assert own.resource_pool_manager.resource_pool_spec == {"global_pool": [8], CRITIC_POOL_NAME: [2]}  # verl default: 8 GPUs
    colocated = get_trainer_cls("pav_sync")(compose_verl(base))
    colocated._init_resource_pool_mgr()
    assert colocated.resource_pool_manager.resource_pool_spec == {"global_pool": [8]}

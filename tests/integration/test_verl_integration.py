"""verl integration on CPU, against the real verl 0.9.1: Hydra composition of the launchers and verl's config
validation, the startup checks (also in real `python -m verl.trainer.main_ppo` runs, plugin on and off), the
`pav` reward manager in verl's reward loop on a local Ray, and the trainer hook's advantage phase (TransferQueue
+ a CPU critic worker group) against the pieces called directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl_prm.config import PavConfig
from verl_prm.config.hook import (
    CRITIC_FORMATS,
    ConfigError,
    HookConfig,
    read_hook_config,
    validate_run_config,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
LAUNCHERS = sorted((EXAMPLES / "pav_grpo").glob("*.sh"))
VERL_CONFIG_DIR = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
PLUGIN_OVERRIDES = ["hydra.searchpath=[pkg://verl_prm.config]", "+verl_prm=pav"]


def compose_verl(overrides: list[str]):
    """verl's ppo_trainer config composed with `overrides`, as `python -m verl.trainer.main_ppo` composes it."""
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def load_example(name: str):
    path = EXAMPLES / "data_preprocess" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, bpe_small) -> Path:
    """The policy 'model' directory verl reads the tokenizer from (byte-level BPE, vocab 300)."""
    path = tmp_path_factory.mktemp("policy")
    bpe_small.save_pretrained(path)
    return path


def save_tiny_critic(path: Path, tokenizer, seed: int) -> Path:
    """A tiny random native-format critic (Qwen2 token classification, num_labels=1) with its tokenizer."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForTokenClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory, bpe_small) -> Path:
    """A critic with the policy's tokenizer."""
    return save_tiny_critic(tmp_path_factory.mktemp("critic"), bpe_small, seed=0)


@pytest.fixture(scope="module")
def critic_dir_other_vocab(tmp_path_factory, bpe_large) -> Path:
    """A critic with another tokenizer than the policy's (byte-level BPE, vocab 2000)."""
    return save_tiny_critic(tmp_path_factory.mktemp("critic_other_vocab"), bpe_large, seed=1)


@pytest.fixture(scope="module")
def gsm8k_rows(repo_data):
    """Real GSM8K test rows, made by the example's data preparation (verl's row layout)."""
    gsm8k = load_example("gsm8k")
    return gsm8k.make_rows(gsm8k.read_jsonl(repo_data / "gsm8k_test.jsonl")[:4], "test")


def responses_for(rows, tokenizer) -> list[tuple[dict, str, list[int]]]:
    """Per row: a correct response (the reference answer, one step per line, EOS), a wrong one (last number + 1,
    EOS) and a truncated one (no EOS). Returns (row, text, ids)."""
    out = []
    for row in rows:
        answer = row["extra_info"]["answer"].replace("\n", "\n\n")
        truth = row["reward_model"]["ground_truth"]
        wrong = answer[: answer.rindex("####")] + f"#### {int(float(truth)) + 1}"
        for text, eos in ((answer, True), (wrong, True), (answer[: len(answer) // 2], False)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            out.append((row, text, ids))
    return out


# ---------------------------------------------------------------------------------------------- config


def test_yaml_defaults_equal_the_typed_configs():
    config = compose_verl(PLUGIN_OVERRIDES)
    assert OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HookConfig), config.verl_prm)) == HookConfig()
    assert read_hook_config(config.verl_prm) == HookConfig()
    assert OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PavConfig), config.algorithm.pav)) == PavConfig()
    assert config.trainer.v1.trainer_mode == "pav_sync"
    assert config.reward.reward_manager.name == "pav"
    assert config.algorithm.adv_estimator == "pav_grpo"


def test_critic_formats_match_the_critic_module():
    """The config's formats are the checkpoint formats of verl_prm.critic.formats plus the exact critic's."""
    from verl_prm.config.hook import CHECKPOINT_CRITIC_FORMATS, EXACT_CRITIC_FORMAT
    from verl_prm.critic.exact import EXACT_FORMAT
    from verl_prm.critic.formats import FORMATS

    assert set(CHECKPOINT_CRITIC_FORMATS) == set(FORMATS)
    assert EXACT_CRITIC_FORMAT == EXACT_FORMAT and EXACT_FORMAT not in FORMATS
    assert CRITIC_FORMATS == CHECKPOINT_CRITIC_FORMATS + (EXACT_FORMAT,)


def test_code_step_rules_match_the_code_module():
    from verl_prm.steps.code import CODE_STEP_RULES as CODE_MODULE_RULES
    from verl_prm.config.hook import CODE_STEP_RULES

    assert set(CODE_STEP_RULES) == set(CODE_MODULE_RULES) - {"delimiter"}


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
        (["algorithm.pav.alpha=-0.5"], "algorithm.pav.alpha must be >= 0"),
        (["algorithm.pav.best_of_k=0"], "algorithm.pav.best_of_k must be an integer >= 1"),
        (["verl_prm.critic.path=null"], "verl_prm.critic.path is required"),
        (["verl_prm.critic.path=/no/such/critic"], "verl_prm.critic.path: critic checkpoint '/no/such/critic': no such directory"),
        # NaN and inf knobs: checked at startup, the key named
        (["algorithm.pav.alpha=nan"], "algorithm.pav.alpha must be >= 0 (a finite number), got nan"),
        (["algorithm.pav.alpha=inf"], "algorithm.pav.alpha must be >= 0 (a finite number), got inf"),
        (["algorithm.pav.clip=nan"], "algorithm.pav.clip must be > 0 (a finite number), got nan"),
        (["algorithm.pav.epsilon=inf"], "algorithm.pav.epsilon must be > 0 (a finite number), got inf"),
        (["algorithm.pav.aggregate_weight=-inf"], "algorithm.pav.aggregate_weight must be a finite number, got -inf"),
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
        (["verl_prm.steps.max_tokens=0"], "verl_prm.steps.max_tokens must be >= 1"),
        (["verl_prm.steps.regex=Step", "verl_prm.steps.max_tokens=8"], "not both"),
        (["verl_prm.critic.max_tokens_per_batch=0"], "max_tokens_per_batch must be >= 1"),
        (["verl_prm.steps.code_rule=ast"], "verl_prm.steps.code_rule must be one of"),
        (["verl_prm.steps.code_rule=block", "verl_prm.steps.regex=x", "verl_prm.steps.delimiter=null"],
         "code_rule replaces the text rules: set verl_prm.steps.regex=null"),
        (["verl_prm.steps.code_rule=line", "verl_prm.steps.delimiter=';'"],
         "set verl_prm.steps.delimiter=null"),
        (["verl_prm.steps.code_depth=-1"], "verl_prm.steps.code_depth must be >= 0"),
    ],
)
def test_startup_validation_errors(overrides, message, critic_dir):
    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}"] + overrides)
    with pytest.raises(ConfigError) as error:
        validate_run_config(config)
    assert message in str(error.value)


def test_known_estimators_cover_verl_and_the_plugin():
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    from verl_prm.config.hook import known_estimators
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
    from verl_prm.integrations.verl.hook_trainer import critic_worker_kwargs

    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", "verl_prm.critic.allow_pickle=true"])
    hook, _ = validate_run_config(config)
    assert critic_worker_kwargs(hook)["allow_pickle"] is True
    assert critic_worker_kwargs(read_hook_config(None))["allow_pickle"] is False


def test_startup_validation_accepts_a_valid_run(critic_dir):
    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", "algorithm.pav.alpha=0.5"])
    hook, pav = validate_run_config(config)
    assert hook.critic.path == str(critic_dir) and pav.alpha == 0.5
    # an outcome-only run without the hook needs no critic
    validate_run_config(compose_verl(["algorithm.adv_estimator=grpo"]))


# ---------------------------------------------------------------------------------------------- launchers


def run_launcher(script: Path, tmp_path: Path, home: Path, env_extra: dict[str, str]) -> list[list[str]]:
    """Run a launcher with fake `python3` and `verl-prm` first on PATH; return each call's argv, in order."""
    bin_dir = tmp_path / "bin"
    capture = tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    capture.mkdir(exist_ok=True)
    for name in ("python3", "verl-prm"):
        fake = bin_dir / name
        fake.write_text(
            "#!/usr/bin/env bash\n"
            f'n=$(ls "{capture}" | wc -l); printf "%s\\0" "{name}" "$@" > "{capture}/$(printf %03d "$n")"\n'
        )
        fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(home), **env_extra)
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [(capture / f).read_bytes().decode().split("\0")[:-1] for f in sorted(os.listdir(capture))]


def verl_overrides(call: list[str]) -> list[str]:
    assert call[:3] == ["python3", "-m", "verl.trainer.main_ppo"], call[:3]
    return call[3:]


@pytest.fixture(scope="module")
def launcher_calls(tmp_path_factory, critic_dir) -> dict[str, list[list[str]]]:
    calls = {}
    home = tmp_path_factory.mktemp("home")
    # where `verl-prm train` of the label-and-train launcher leaves its checkpoints (WORK_DIR under $HOME)
    (home / "verl_prm" / "gsm8k_qwen2_5_0_5b" / "pav" / "checkpoint-0000010").mkdir(parents=True)
    for script in LAUNCHERS:
        calls[script.name] = run_launcher(script, tmp_path_factory.mktemp(script.stem), home,
                                          {"CRITIC_PATH": str(critic_dir)})
    return calls


def test_launchers_exist():
    names = {script.name for script in LAUNCHERS}
    assert names == {
        "run_qwen2_5_0_5b_gsm8k_pav_grpo.sh",
        "run_qwen2_5_0_5b_gsm8k_grpo_baseline.sh",
        "run_qwen2_5_0_5b_gsm8k_label_train_pav_grpo.sh",
    }


def test_launcher_overrides_compose_and_pass_verl_validation(launcher_calls, critic_dir):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    for name, calls in launcher_calls.items():
        overrides = verl_overrides(calls[-1])
        config = compose_verl(overrides)
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        if name == "run_qwen2_5_0_5b_gsm8k_label_train_pav_grpo.sh":
            # the RL stage reads the newest checkpoint of `verl-prm train`
            assert config.verl_prm.critic.path.endswith("pav/checkpoint-0000010")
            config.verl_prm.critic.path = str(critic_dir)
        hook, pav = validate_run_config(config)
        assert config.trainer.v1.trainer_mode == "pav_sync"
        assert config.reward.reward_manager.name == "pav"
        assert config.trainer.n_gpus_per_node == 1
        assert hook.steps.delimiter == "\n\n"  # the launcher's '\n\n' reaches the hook as two newlines


def test_launcher_with_an_exact_critic_composes_and_passes_verl_validation(launcher_calls):
    """The PAV-GRPO launcher with the critic path replaced by an exact prover critic (README: "Exact prover
    critics") composes with verl's config, passes verl's and the plugin's startup checks, and the critic worker
    gets the data source and the prover's options."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_prm.integrations.verl.hook_trainer import critic_worker_kwargs

    launcher = verl_overrides(launcher_calls["run_qwen2_5_0_5b_gsm8k_pav_grpo.sh"][-1])
    kept = [o for o in launcher if not o.startswith("verl_prm.critic.path=")]
    assert len(kept) == len(launcher) - 1
    exact = ["verl_prm.critic.format=exact", "+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver",
             "+verl_prm.critic.options.step_accuracy=0.8"]
    config = compose_verl(kept + exact)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    hook, _ = validate_run_config(config)
    assert hook.critic.format == "exact" and hook.critic.path is None
    assert critic_worker_kwargs(hook) == {"format": "exact", "prover": "verl_prm.apps.arithmetic.prover:ArithmeticProver", "step_accuracy": 0.8}
    with pytest.raises(ConfigError, match="verl_prm.critic.options.step_accuracy: step_accuracy must be a finite"):
        validate_run_config(compose_verl(kept + exact[:2] + ["+verl_prm.critic.options.step_accuracy=1.5"]))


def test_baseline_differs_from_pav_grpo_only_in_the_estimator(launcher_calls):
    pav = verl_overrides(launcher_calls["run_qwen2_5_0_5b_gsm8k_pav_grpo.sh"][-1])
    base = verl_overrides(launcher_calls["run_qwen2_5_0_5b_gsm8k_grpo_baseline.sh"][-1])
    differing = sorted(set(pav) ^ set(base))
    assert differing == sorted([
        "algorithm.adv_estimator=grpo", "algorithm.adv_estimator=pav_grpo",
        "trainer.experiment_name=qwen2_5_0_5b_gsm8k_grpo_alpha3.0",
        "trainer.experiment_name=qwen2_5_0_5b_gsm8k_pav_grpo_alpha3.0",
    ])
    assert compose_verl(base).algorithm.adv_estimator == "grpo"


def test_label_train_launcher_uses_the_label_and_train_commands(launcher_calls):
    from verl_prm.labeling.cli import label_parser
    from verl_prm.training.cli import train_parser

    calls = launcher_calls["run_qwen2_5_0_5b_gsm8k_label_train_pav_grpo.sh"]
    assert [call[:2] for call in calls] == [["verl-prm", "label"], ["verl-prm", "train"], ["python3", "-m"]]
    label_args = label_parser().parse_args(calls[0][2:])
    train_args = train_parser().parse_args(calls[1][2:])
    assert Path(train_args.labels[0]) == Path(label_args.output_dir)
    assert train_args.best_of_k == 4 and label_args.strategy == "first_pit"


# ---------------------------------------------------------------------------------------------- real main_ppo runs


# A fresh process: verl_prm.integrations.verl.reward_manager imported before verl (it imports verl, whose plugin loader then registers
# while verl_prm.integrations.verl.reward_manager is incomplete: the registration is deferred to the end of its import), and a trainer
# module that cannot be imported (a stub that raises the error + an ERROR log, verl stays usable).
PLUGIN_ORDER_AND_FAILURE_SCRIPT = """
import sys
sys.modules["verl_prm.integrations.verl.critic_worker"] = None  # the trainer module cannot import
import verl_prm.integrations.verl.reward_manager as r
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
print("REGISTERED", get_reward_manager_cls("pav") is r.PavRewardManager)
from verl.trainer.ppo.v1 import get_trainer_cls
try:
    get_trainer_cls("pav_sync")(None)
except Exception as error:
    print("STUB", type(error).__name__, error)
"""


@pytest.fixture(scope="module")
def main_ppo_runs(critic_dir) -> dict[str, subprocess.CompletedProcess]:
    """Real `python -m verl.trainer.main_ppo` runs and fresh-process plugin checks (started together: each
    spends ~10 s importing verl)."""
    main_ppo = [sys.executable, "-m", "verl.trainer.main_ppo"]
    runs = {
        "plugin_disabled": (main_ppo + PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}"],
                            {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
        "negative_alpha": (main_ppo + PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}",
                                                          "algorithm.pav.alpha=-1"], {}),
        "plugin_order_and_failure": ([sys.executable, "-c", PLUGIN_ORDER_AND_FAILURE_SCRIPT], {}),
        "nan_alpha": (main_ppo + PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", "algorithm.pav.alpha=nan"],
                      {}),
        "unknown_estimator": (main_ppo + PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}",
                                                             "algorithm.adv_estimator=pav_grop"], {}),
        "critic_path_is_a_file": (main_ppo + PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}/config.json"],
                                  {}),
        "exact_bad_step_accuracy": (main_ppo + PLUGIN_OVERRIDES + [
            "verl_prm.critic.format=exact", "+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver",
            "+verl_prm.critic.options.step_accuracy=1.5"], {}),
    }
    processes = {
        name: subprocess.Popen(command, env=dict(os.environ, **env_extra), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO)
        for name, (command, env_extra) in runs.items()
    }
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=240)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return results


def test_main_ppo_without_the_plugin_fails_before_ray_with_a_clear_error(main_ppo_runs):
    result = main_ppo_runs["plugin_disabled"]
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "verl did not load the verl-prm plugin" in output
    assert "VERL_USE_EXTERNAL_PLUGINS='none' excludes it" in output
    # raised while Hydra builds its callbacks: verl's main (its config validation, Ray) never ran
    assert "full_key: hydra.callbacks.verl_prm_startup_check" in output
    assert "Please set at least one of" not in output and "ray init kwargs" not in output


def test_main_ppo_startup_check_rejects_a_bad_config_before_ray(main_ppo_runs):
    result = main_ppo_runs["negative_alpha"]
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "verl-prm startup check failed: algorithm.pav.alpha must be >= 0 (a finite number), got -1.0" in output
    assert "Please set at least one of" not in output and "ray init kwargs" not in output


@pytest.mark.parametrize("run, message", [
    ("nan_alpha", "verl-prm startup check failed: algorithm.pav.alpha must be >= 0 (a finite number), got nan"),
    ("unknown_estimator", "verl-prm startup check failed: algorithm.adv_estimator='pav_grop' is not a registered "
                          "advantage estimator (did you mean 'pav_grpo'?)"),
    ("critic_path_is_a_file", "verl-prm startup check failed: verl_prm.critic.path: critic checkpoint "),
    ("exact_bad_step_accuracy", "verl-prm startup check failed: verl_prm.critic.options.step_accuracy: "
                                "step_accuracy must be a finite number in (0, 1], got 1.5"),
])
def test_main_ppo_startup_check_catches_nan_knobs_unknown_estimators_and_bad_critics(main_ppo_runs, run, message):
    """Real `python -m verl.trainer.main_ppo` argument parsing: the check fails the run while Hydra builds its
    callbacks, before verl's main (its config validation, Ray) starts."""
    result = main_ppo_runs[run]
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert message in output
    if run == "critic_path_is_a_file":
        assert "config.json' is a file, not a checkpoint directory" in output
    assert "full_key: hydra.callbacks.verl_prm_startup_check" in output
    assert "Please set at least one of" not in output and "ray init kwargs" not in output


def test_plugin_registers_when_our_module_is_imported_before_verl(main_ppo_runs):
    result = main_ppo_runs["plugin_order_and_failure"]
    assert result.returncode == 0, result.stderr
    assert "REGISTERED True" in result.stdout


def test_plugin_failure_registers_a_stub_that_names_the_error(main_ppo_runs):
    result = main_ppo_runs["plugin_order_and_failure"]
    assert "verl-prm failed to register trainer pav_sync with verl" in result.stderr  # logged at ERROR
    assert "STUB PluginLoadError verl-prm failed to load, so its trainer 'pav_sync'" in result.stdout
    assert "verl_prm.integrations.verl.critic_worker" in result.stdout


# ---------------------------------------------------------------------------------------------- registrations


def test_plugin_registers_trainer_and_reward_manager():
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    from verl_prm.integrations.verl.reward_manager import PavRewardManager
    from verl_prm.integrations.verl.hook_trainer import PavSyncTrainer

    assert get_trainer_cls("pav_sync") is PavSyncTrainer
    assert issubclass(PavSyncTrainer, PPOTrainerSync)
    assert get_reward_manager_cls("pav") is PavRewardManager


# ---------------------------------------------------------------------------------------------- reward loop


@pytest.mark.ray
def test_pav_reward_manager_in_verl_reward_loop(ray_local, policy_dir, gsm8k_rows, bpe_small):
    """verl's RewardLoopManager with the `pav` manager on GSM8K rows: the streaming path (one worker call per
    trajectory, as verl's agent loop makes it: one float) and the batch path (rm_scores), plus verl's
    validation metrics over the extra info."""
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.metric_utils import process_validation_metrics
    from verl.utils.reward_score import default_compute_score

    from verl_prm.steps import split_steps

    config = compose_verl(PLUGIN_OVERRIDES + [f"actor_rollout_ref.model.path={policy_dir}", "reward.num_workers=2"])
    manager = RewardLoopManager(config=config, rm_resource_pool=None)
    assert manager.reward_loop_worker_handles is not None  # rule-based: the streaming path is on

    samples = responses_for(gsm8k_rows[:2], bpe_small)
    tokenizer = bpe_small
    prompt_ids = [tokenizer(row["prompt"][0]["content"])["input_ids"] for row, _, _ in samples]
    expected = []
    for row, text, ids in samples:
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        split = split_steps(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), tokenizer)
        ends = split.step_char_ends[0, : int(split.num_steps[0])].tolist()
        expected.append({
            "score": float(default_compute_score(row["data_source"], decoded, row["reward_model"]["ground_truth"])),
            "num_steps": int(split.num_steps[0]),
            "spans": [[s, e] for s, e in zip([0] + ends[:-1], ends)],
            "truncated": float(ids[-1] != tokenizer.eos_token_id),
        })
    assert [e["score"] for e in expected] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert min(e["num_steps"] for e in expected) >= 1 and max(e["num_steps"] for e in expected) >= 3

    def sample_proto(index: int):
        from verl import DataProto

        row, _, ids = samples[index]
        prompt = torch.tensor(prompt_ids[index])
        response = torch.tensor(ids)
        return DataProto.from_dict(
            tensors={
                "prompts": prompt[None], "responses": response[None],
                "attention_mask": torch.ones(1, len(prompt) + len(response), dtype=torch.long),
            },
            non_tensors={
                "data_source": np.array([row["data_source"]]),
                "reward_model": np.array([row["reward_model"]], dtype=object),
                "extra_info": np.array([row["extra_info"]], dtype=object),
                "__num_turns__": np.array([2]),
            },
        )

    # streaming path: the agent loop's call, one trajectory at a time
    import ray

    worker = manager.reward_loop_worker_handles[0]
    results = ray.get([worker.compute_score.remote(sample_proto(i)) for i in range(len(samples))])
    for result, exp in zip(results, expected):
        assert isinstance(result["reward_score"], float) and result["reward_score"] == exp["score"]
        info = result["reward_extra_info"]
        assert info["acc"] == exp["score"]
        assert info["pav_num_steps"] == exp["num_steps"]
        assert json.loads(info["pav_step_spans"]) == exp["spans"]
        assert info["pav_truncated"] == exp["truncated"]

    # batch path (colocated reward): verl pads prompts left and responses right
    from verl import DataProto

    width_p = max(len(p) for p in prompt_ids)
    width_r = max(len(ids) for _, _, ids in samples)
    prompts = torch.full((len(samples), width_p), tokenizer.pad_token_id)
    responses = torch.full((len(samples), width_r), tokenizer.pad_token_id)
    mask = torch.zeros(len(samples), width_p + width_r, dtype=torch.long)
    for i, (p, (_, _, ids)) in enumerate(zip(prompt_ids, samples)):
        prompts[i, width_p - len(p):] = torch.tensor(p)
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, width_p - len(p): width_p + len(ids)] = 1
    batch = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors={
            "data_source": np.array([row["data_source"] for row, _, _ in samples]),
            "reward_model": np.array([row["reward_model"] for row, _, _ in samples], dtype=object),
            "extra_info": np.array([row["extra_info"] for row, _, _ in samples], dtype=object),
        },
    )
    output = manager.compute_rm_score(batch)
    lengths = torch.tensor([len(ids) for _, _, ids in samples])
    rm_scores = output.batch["rm_scores"]
    assert torch.equal(rm_scores[torch.arange(len(samples)), lengths - 1], torch.tensor([e["score"] for e in expected]))
    assert rm_scores.sum().item() == sum(e["score"] for e in expected)
    assert [json.loads(s) for s in output.non_tensor_batch["pav_step_spans"]] == [e["spans"] for e in expected]

    # validation: verl's metric reduction over the extra info (spans are text: skipped, numbers averaged)
    infos = {key: list(output.non_tensor_batch[key]) for key in output.meta_info["reward_extra_keys"]}
    metrics = process_validation_metrics(
        [row["data_source"] for row, _, _ in samples], [str(i // 3) for i in range(len(samples))], infos
    )
    per_source = metrics["openai/gsm8k"]
    assert per_source["acc"]["mean@3"] == pytest.approx(1 / 3)
    assert per_source["pav_num_steps"]["mean@3"] == pytest.approx(np.mean([e["num_steps"] for e in expected]))
    assert "pav_step_spans" not in per_source


# ---------------------------------------------------------------------------------------------- trainer hook


@pytest.fixture(scope="module")
def transfer_queue(ray_local):
    import transfer_queue as tq

    conf = OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    tq.init(conf)
    yield tq
    tq.close()


def put_trajectories(tq, tokenizer, samples, partition="train") -> tuple[list[str], list[dict], list[list[int]]]:
    """Write trajectories to TransferQueue as verl's agent loop does (jagged fields, keys uid_session_index)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys, fields, tags, prompts = [], [], [], []
    uids: dict[int, str] = {}
    for i, (row, _, ids) in enumerate(samples):
        group = i // 3
        uid = uids.setdefault(group, str(uuid.uuid4()))
        prompt = tokenizer(row["prompt"][0]["content"])["input_ids"][:40]
        score = float(i % 3 == 0)
        rm_scores = torch.zeros(len(ids))
        rm_scores[-1] = score
        keys.append(f"{uid}_{i % 3}_0")
        fields.append({
            "prompts": torch.tensor(prompt), "responses": torch.tensor(ids),
            "response_mask": torch.ones(len(ids), dtype=torch.long), "rm_scores": rm_scores, "uid": uid,
        })
        tags.append({"status": "success", "prompt_len": len(prompt), "response_len": len(ids),
                     "seq_len": len(prompt) + len(ids)})
        prompts.append(prompt)
    tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags)
    return keys, tags, prompts


def make_hook_trainer(policy_dir, critic_dir, policy_tokenizer, pool_prefix, critic_overrides=None,
                      steps_overrides=("verl_prm.steps.delimiter='\\n'",)):
    """The registered trainer, built by verl's constructor, with its critic worker group on a CPU resource pool
    (verl's ResourcePoolManager only makes GPU pools, so the pool is the one verl's _setup would hand over).
    ``critic_overrides`` replace ``verl_prm.critic.path=<critic_dir>`` (e.g. an exact critic)."""
    from verl.single_controller.ray import RayResourcePool, ResourcePoolManager
    from verl.trainer.ppo.v1 import get_trainer_cls

    critic = list(critic_overrides) if critic_overrides is not None else [f"verl_prm.critic.path={critic_dir}"]
    config = compose_verl(PLUGIN_OVERRIDES + critic + list(steps_overrides) + [
        f"actor_rollout_ref.model.path={policy_dir}", "trainer.device=cpu",
        "algorithm.pav.alpha=2.0", "algorithm.pav.clip=0.5",
        "actor_rollout_ref.rollout.n=3", "data.train_batch_size=2",
    ])
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config)
    trainer.tokenizer = policy_tokenizer
    trainer.resource_pool_manager = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
    trainer.resource_pool_manager.resource_pool_dict["global_pool"] = RayResourcePool(
        process_on_nodes=[2], use_gpu=False, max_colocate_count=1, name_prefix=pool_prefix
    )
    trainer.prover_wg = trainer._init_prover_critic()
    return trainer


@pytest.fixture(scope="module")
def hook_trainer(transfer_queue, policy_dir, critic_dir, bpe_small):
    return make_hook_trainer(policy_dir, critic_dir, bpe_small, "pav_test_pool")


@pytest.mark.ray
def test_hook_trainer_is_sync_everywhere_verl_checks(hook_trainer):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    assert hook_trainer.trainer_mode == "sync"
    assert hook_trainer.registered_trainer_mode == "pav_sync"
    assert type(hook_trainer.replay_buffer) is ReplayBuffer  # the sync trainer's buffer, not ReplayBufferAsync
    assert hook_trainer.parameter_sync_step == 1
    assert hook_trainer.prover_wg.world_size == 2


@pytest.mark.ray
def test_hook_advantage_phase_equals_the_pieces(hook_trainer, transfer_queue, gsm8k_rows, critic_dir, bpe_small):
    """trainer._compute_advantage (TransferQueue in and out, critic worker group) == split_steps + ProverCritic +
    compute_advantage_with_steps called directly; metrics from the same values."""
    from verl_prm.critic import ProverCritic

    critic = ProverCritic.from_pretrained(str(critic_dir), format="value_head", device="cpu")
    # same vocabulary: the critic reads the policy ids as they are
    check_advantage_phase(hook_trainer, transfer_queue, responses_for(gsm8k_rows[:2], bpe_small), bpe_small,
                          lambda *batch: critic.score_policy_batch(*batch, None), {"delimiter": "\n"})


@pytest.mark.ray
def test_hook_with_a_critic_of_another_vocabulary(transfer_queue, policy_dir, critic_dir_other_vocab, gsm8k_rows,
                                                  bpe_small):
    """The critic re-reads the split's text in its own vocabulary: the hook sends where the steps end in the text."""
    from verl_prm.critic import ProverCritic

    trainer = make_hook_trainer(policy_dir, critic_dir_other_vocab, bpe_small, "pav_test_pool_other_vocab")
    critic = ProverCritic.from_pretrained(str(critic_dir_other_vocab), format="value_head", device="cpu")
    # another vocabulary: it re-reads the split's text
    check_advantage_phase(trainer, transfer_queue, responses_for(gsm8k_rows[:2], bpe_small), bpe_small,
                          lambda *batch: critic.score_policy_batch(*batch, bpe_small), {"delimiter": "\n"})


def arithmetic_responses_for(problems, tokenizer) -> list[tuple[dict, str, list[int]]]:
    """Per arithmetic problem (a verl row): the reference solution (EOS), one with a slip (EOS) and the first
    half of the reference (no EOS), as responses_for."""
    from verl_prm.apps.arithmetic.task import solution_lines, verl_row

    out = []
    for i, problem in enumerate(problems):
        correct = "\n".join(solution_lines(problem))
        slipped = "\n".join(solution_lines(problem, 1, (problem.values[1] + 1) % problem.modulus))
        for text, eos in ((correct, True), (slipped, True), (correct[: len(correct) // 2], False)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            out.append((verl_row(problem, "train", i), text, ids))
    return out


@pytest.mark.ray
def test_hook_with_an_exact_critic(transfer_queue, policy_dir, bpe_small):
    """format=exact: the worker group starts without a checkpoint (the policy's tokenizer reads the text), and
    the advantage phase equals split_steps + the arithmetic prover on the texts + the estimator."""
    from verl_prm.critic.exact import ExactCritic
    from verl_prm.apps.arithmetic.task import STEP_REGEX, Problem

    exact = ["verl_prm.critic.format=exact", "+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver",
             "+verl_prm.critic.options.step_accuracy=0.8"]
    steps = ["verl_prm.steps.delimiter=null", f"verl_prm.steps.regex='{STEP_REGEX}'"]
    trainer = make_hook_trainer(policy_dir, None, bpe_small, "pav_test_pool_exact", critic_overrides=exact,
                                steps_overrides=steps)
    assert trainer.hook_config.steps.regex == STEP_REGEX
    assert trainer._policy_tokenizer_path() == str(policy_dir)
    problems = [Problem(5, (("+", 7), ("*", 3), ("-", 4)), 13), Problem(2, (("*", 5), ("+", 9), ("*", 2)), 11)]
    critic = ExactCritic.from_options("verl_prm.apps.arithmetic.prover:ArithmeticProver", step_accuracy=0.8)
    check_advantage_phase(trainer, transfer_queue, arithmetic_responses_for(problems, bpe_small), bpe_small,
                          lambda *batch: critic.score_policy_batch(*batch, bpe_small), {"regex": STEP_REGEX,
                                                                                      "delimiter": None})


def check_advantage_phase(hook_trainer, transfer_queue, samples, bpe_small, score, split_kwargs):
    """``hook_trainer._compute_advantage`` on ``samples`` (triples: rewards 1, 0, 0; the third truncated) ==
    ``split_steps(**split_kwargs)`` + ``score(prompts, responses, attention, split)`` (the critic called
    directly) + ``compute_advantage_with_steps``; metrics from the same values."""
    from transfer_queue import KVBatchMeta
    from verl import DataProto

    from verl_prm.integrations.verl.advantage import compute_advantage_with_steps
    from verl_prm.steps import split_steps
    from verl_prm.integrations.verl.hook_trainer import pav_metrics, truncated_responses

    tq = transfer_queue
    keys, tags, prompts = put_trajectories(tq, bpe_small, samples)
    metrics: dict = {}
    hook_trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)
    written = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages", "returns"])
    advantages = written["advantages"].to_padded_tensor(padding=0.0)

    # the pieces, called directly
    tokenizer = bpe_small
    lengths = [len(ids) for _, _, ids in samples]
    width = max(lengths)
    pad = tokenizer.pad_token_id
    responses = torch.full((len(samples), width), pad)
    response_mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, (_, _, ids) in enumerate(samples):
        responses[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = 1
    width_p = max(len(p) for p in prompts)
    prompt_tensor = torch.full((len(samples), width_p), pad)
    attention = torch.zeros(len(samples), width_p + width, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_tensor[i, width_p - len(p):] = torch.tensor(p)
        attention[i, width_p - len(p):width_p] = 1
    attention[:, width_p:] = response_mask
    split = split_steps(responses, response_mask, tokenizer, **split_kwargs)
    scores = score(prompt_tensor, responses, attention, split)
    truncated = truncated_responses(responses, torch.tensor(lengths), tokenizer.eos_token_id)
    rm_scores = torch.zeros(len(samples), width)
    rm_scores[torch.arange(len(samples)), torch.tensor(lengths) - 1] = torch.tensor(
        [float(i % 3 == 0) for i in range(len(samples))]
    )
    data = DataProto.from_dict(
        tensors={
            "token_level_rewards": rm_scores, "response_mask": response_mask, "step_ids": split.step_ids,
            "step_values": scores.step_values, "prompt_values": scores.prompt_values,
            "num_steps": split.num_steps, "truncated": truncated,
        },
        non_tensors={"uid": np.array([key.rsplit("_", 2)[0] for key in keys], dtype=object)},
    )
    expected = compute_advantage_with_steps(data, hook_trainer.config.algorithm).batch["advantages"]

    assert split.num_steps.min() >= 2
    assert advantages.shape == expected.shape
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=1e-5)
    # the process term really is in there: alpha = 0 would give verl's grpo
    assert (advantages * response_mask).std(dim=1).max() > 1e-4

    expected_metrics = pav_metrics(scores.step_values, scores.prompt_values, split.num_steps, truncated,
                                   hook_trainer.pav_config, critic_seconds=0.0)
    for name, value in expected_metrics.items():
        if name != "pav/critic_seconds":
            assert metrics[name] == pytest.approx(value, abs=1e-5), name
    assert metrics["pav/truncated_share"] == pytest.approx(1 / 3)
    assert metrics["pav/critic_seconds"] > 0
    # groups (uid) whose outcomes are all equal: GRPO's advantage is zero there
    outcomes: dict = {}
    for uid, reward in zip(data.non_tensor_batch["uid"], rm_scores.sum(dim=1).tolist()):
        outcomes.setdefault(uid, []).append(reward)
    same = [len(set(rewards)) == 1 for rewards in outcomes.values()]
    assert metrics["pav/outcome_zero_signal_groups"] == pytest.approx(sum(same) / len(same))
    tq.kv_clear(keys=keys, partition_id="train")


@pytest.mark.ray
def test_hook_with_grpo_keeps_verl_advantages_and_pav_alpha_zero_equals_them(hook_trainer, transfer_queue, gsm8k_rows, bpe_small):
    from transfer_queue import KVBatchMeta
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    tq = transfer_queue
    samples = responses_for(gsm8k_rows[2:4], bpe_small)
    keys, tags, _ = put_trajectories(tq, bpe_small, samples)
    algorithm = hook_trainer.config.algorithm
    original = algorithm.adv_estimator
    algorithm.adv_estimator = "grpo"
    try:
        metrics: dict = {}
        hook_trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)
    finally:
        algorithm.adv_estimator = original
    advantages = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])["advantages"]
    raw = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["uid", "response_mask", "rm_scores"])
    data = DataProto(batch=raw.to_padded_tensor())
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    expected = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator="grpo", config=algorithm)
    torch.testing.assert_close(advantages.to_padded_tensor(padding=0.0), expected.batch["advantages"])
    assert metrics["pav/steps_per_response"] >= 2 and "pav/process_term/std" in metrics

    # pav_grpo with alpha = 0 through the hook gives verl's grpo advantages
    alpha = algorithm.pav.alpha
    algorithm.pav.alpha = 0.0
    try:
        hook_trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), {})
    finally:
        algorithm.pav.alpha = alpha
    pav_zero = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])["advantages"]
    torch.testing.assert_close(pav_zero.to_padded_tensor(padding=0.0), expected.batch["advantages"],
                               atol=1e-6, rtol=1e-5)
    tq.kv_clear(keys=keys, partition_id="train")


# ---------------------------------------------------------------------------------------------- patches


def test_each_patch_applies_cleanly_to_the_installed_verl():
    from verl_prm.integrations.verl.patches import check_patches, find_patches, installed_verl_root

    statuses = check_patches()
    assert [s.patch.name for s in statuses] == [p.name for p in find_patches()]
    assert len(statuses) == 6  # 0001-0003: the plugin's workarounds; 0004-0006: the CPU platform's fixes
    assert all(s.state == "applies" for s in statuses), [(s.patch.name, s.state, s.detail) for s in statuses]
    assert (installed_verl_root() / "verl" / "__init__.py").is_file()


def test_patches_apply_to_a_copy_and_compile(tmp_path):
    import py_compile
    import re
    import shutil

    from verl_prm.integrations.verl.patches import apply_patches, check_patches, find_patches, installed_verl_root

    root = installed_verl_root()
    touched = sorted({m for p in find_patches() for m in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M)})
    for relative in touched:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / relative, tmp_path / relative)
    assert all(s.state == "applied now" for s in apply_patches(tmp_path))
    assert all(s.state == "applied" for s in check_patches(tmp_path))
    for relative in touched:
        py_compile.compile(str(tmp_path / relative), doraise=True)
    trainer_base = (tmp_path / "verl/trainer/ppo/v1/trainer_base.py").read_text()
    assert 'trainer_mode == "sync"' not in trainer_base and 'trainer_mode != "sync"' not in trainer_base
    # the installed verl is untouched
    assert all(s.state == "applies" for s in check_patches())


def test_patches_cli_check_exit_code(capsys):
    from verl_prm.apps.cli import main
    from verl_prm.integrations.verl.patches import find_patches

    assert main(["patches", "check"]) == 0
    assert capsys.readouterr().out.count("applies") == len(find_patches())


def test_truncated_responses_reads_every_eos_id():
    from verl_prm.integrations.verl.hook_trainer import truncated_responses

    responses = torch.tensor([[5, 6, 1, 0], [5, 2, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]])
    lengths = torch.tensor([3, 2, 4, 0])
    assert truncated_responses(responses, lengths, [1, 2]).tolist() == [False, False, True, True]
    assert truncated_responses(responses, lengths, 1).tolist() == [False, True, True, True]


def test_own_placement_adds_the_critic_pool_to_verl_resource_pools(critic_dir, policy_dir):
    """placement.pool=own: the critic's pool joins verl's ResourcePoolManager spec before verl creates the pools
    (so verl's GPU-availability check counts it); colocated adds nothing (the critic uses global_pool)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_prm.integrations.verl.hook_trainer import CRITIC_POOL_NAME

    base = PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", f"actor_rollout_ref.model.path={policy_dir}"]
    own = get_trainer_cls("pav_sync")(compose_verl(base + [
        "verl_prm.placement.pool=own", "verl_prm.placement.n_gpus_per_node=2", "verl_prm.placement.nnodes=1"]))
    own._init_resource_pool_mgr()
    assert own.resource_pool_manager.resource_pool_spec == {"global_pool": [8], CRITIC_POOL_NAME: [2]}  # verl default: 8 GPUs
    colocated = get_trainer_cls("pav_sync")(compose_verl(base))
    colocated._init_resource_pool_mgr()
    assert colocated.resource_pool_manager.resource_pool_spec == {"global_pool": [8]}

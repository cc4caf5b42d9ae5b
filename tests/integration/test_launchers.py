"""The example launchers: run with stand-ins for `python3` and `verl-prm`, their overrides composed by Hydra and
passed through verl's own config validation."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from verl_support import LAUNCHERS, compose_verl, load_example

from verl_prm.config.hook import ConfigError, read_hook_config
from verl_prm.integrations.verl.run_config import check_sampling_run
from verl_prm.integrations.verl.run_config import validate_run_config
from verl_prm.integrations.verl.run_config import check_tree_run

# the launchers of one value source each, and the GRPO baseline each must equal outside its verl-prm block
VALUE_SOURCE_LAUNCHERS = {
    "run_qwen2_5_0_5b_gsm8k_pav_tree.sh": "run_qwen2_5_0_5b_gsm8k_grpo_baseline.sh",
    "run_qwen2_5_0_5b_gsm8k_pav_sampled.sh": "run_qwen2_5_0_5b_gsm8k_grpo_baseline.sh",
    "run_qwen2_5_0_5b_gsm8k_pav_qwen_prm_7b.sh": "run_qwen2_5_0_5b_gsm8k_grpo_baseline.sh",
    "run_qwen2_5_0_5b_math_pav_tree.sh": "run_qwen2_5_0_5b_math_grpo_baseline.sh",
    "run_qwen2_5_0_5b_math_pav_sampled.sh": "run_qwen2_5_0_5b_math_grpo_baseline.sh",
    "run_qwen2_5_0_5b_math_pav_qwen_prm_7b.sh": "run_qwen2_5_0_5b_math_grpo_baseline.sh",
}


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


def verl_prm_key(override: str) -> bool:
    """Whether a verl override belongs to the verl-prm block: the plugin's config group, its `verl_prm.*` keys,
    the estimator and its `algorithm.pav.*` knobs."""
    key = override.split("=", 1)[0].lstrip("+")
    return (key in ("hydra.searchpath", "verl_prm", "algorithm.adv_estimator")
            or key.startswith(("verl_prm.", "algorithm.pav.")))


def split_verl_prm_block(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the verl-prm block, the rest but the experiment name), in the launcher's order."""
    block = [o for o in overrides if verl_prm_key(o)]
    rest = [o for o in overrides if not verl_prm_key(o) and not o.startswith("trainer.experiment_name=")]
    return block, rest


def launcher_dataset(name: str) -> str:
    return "math" if "_math_" in name else "gsm8k"


@pytest.fixture(scope="module")
def launcher_data(tmp_path_factory, repo_data) -> dict[str, Path]:
    """DATA_DIR of each dataset: train and test parquet rows of the examples' data preparation (real GSM8K and
    MATH500 rows), so the startup checks read their data sources."""
    dirs = {}
    for dataset, example, jsonl in (("gsm8k", "gsm8k", "gsm8k_test.jsonl"),
                                    ("math", "math_dataset", "math500_test.jsonl")):
        module = load_example(example)
        records = module.read_jsonl(repo_data / jsonl)[:6]
        out = dirs[dataset] = tmp_path_factory.mktemp(f"data_{dataset}")
        pd.DataFrame(module.make_rows(records[:4], "train")).to_parquet(out / "train.parquet")
        pd.DataFrame(module.make_rows(records[4:], "test")).to_parquet(out / "test.parquet")
    return dirs


@pytest.fixture(scope="module")
def launcher_calls(tmp_path_factory, critic_dir, launcher_data) -> dict[str, list[list[str]]]:
    calls = {}
    home = tmp_path_factory.mktemp("home")
    # where `verl-prm train` of the label-and-train launcher leaves its checkpoints (WORK_DIR under $HOME)
    (home / "verl_prm" / "gsm8k_qwen2_5_0_5b" / "pav" / "checkpoint-0000010").mkdir(parents=True)
    for script in LAUNCHERS:
        # the tiny critic stands in for the learned PAV and for the public PRM (its path is all the checks read)
        env = {"CRITIC_PATH": str(critic_dir), "PRM_PATH": str(critic_dir),
               "DATA_DIR": str(launcher_data[launcher_dataset(script.name)])}
        calls[script.name] = run_launcher(script, tmp_path_factory.mktemp(script.stem), home, env)
    return calls


def test_launchers_exist():
    names = {script.name for script in LAUNCHERS}
    assert names == {
        "run_qwen2_5_0_5b_gsm8k_pav_grpo.sh",
        "run_qwen2_5_0_5b_gsm8k_grpo_baseline.sh",
        "run_qwen2_5_0_5b_gsm8k_label_train_pav_grpo.sh",
        "run_qwen2_5_0_5b_math_grpo_baseline.sh",
        *VALUE_SOURCE_LAUNCHERS,
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
        # the trainer hook's own startup checks of the sampling sources (PavSyncTrainer.__init__): rollout.n
        # against the tree's shape, the reward, the rollout context, the training files' data sources
        if hook.critic.source == "sampled":
            check_sampling_run(config)
        if hook.critic.source == "tree":
            check_tree_run(config, hook)
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

    from verl_prm.integrations.verl.sources import critic_worker_kwargs

    launcher = verl_overrides(launcher_calls["run_qwen2_5_0_5b_gsm8k_pav_grpo.sh"][-1])
    kept = [o for o in launcher if not o.startswith("verl_prm.critic.path=")]
    assert len(kept) == len(launcher) - 1
    exact = ["verl_prm.critic.source=exact", "+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver",
             "+verl_prm.critic.options.step_accuracy=0.8"]
    config = compose_verl(kept + exact)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    hook, _ = validate_run_config(config)
    assert hook.critic.source == "exact" and hook.critic.path is None
    assert critic_worker_kwargs(hook) == {"prover": "verl_prm.apps.arithmetic.prover:ArithmeticProver", "step_accuracy": 0.8}
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
    assert train_args.best_of_k == 4 and label_args.prefix_rule == "first_pit"


def test_value_source_launchers_differ_from_their_baseline_only_in_the_verl_prm_block(launcher_calls):
    """Each value-source launcher is its dataset's GRPO baseline with another verl-prm block (at the top of the
    command) and its own experiment name (so no two runs share a checkpoint directory)."""
    names = {}
    for name, baseline in VALUE_SOURCE_LAUNCHERS.items():
        assert launcher_dataset(name) == launcher_dataset(baseline)
        overrides = verl_overrides(launcher_calls[name][-1])
        block, rest = split_verl_prm_block(overrides)
        base_block, base_rest = split_verl_prm_block(verl_overrides(launcher_calls[baseline][-1]))
        assert rest == base_rest, (name, sorted(set(rest) ^ set(base_rest)))
        assert overrides[:len(block)] == block, f"{name}: the verl-prm overrides are not one block at the top"
        assert block != base_block
        for script in (name, baseline):
            names[script] = [o for o in verl_overrides(launcher_calls[script][-1])
                             if o.startswith("trainer.experiment_name=")]
    names = {script: name for script, (name,) in names.items()}  # exactly one each
    assert len(set(names.values())) == len(names), names


def test_math_baseline_is_the_gsm8k_run_with_math_data_and_lengths(launcher_calls, launcher_data):
    _, gsm8k = split_verl_prm_block(verl_overrides(launcher_calls["run_qwen2_5_0_5b_gsm8k_grpo_baseline.sh"][-1]))
    _, math = split_verl_prm_block(verl_overrides(launcher_calls["run_qwen2_5_0_5b_math_grpo_baseline.sh"][-1]))
    assert sorted(set(math) - set(gsm8k)) == sorted([
        f"data.train_files={launcher_data['math']}/train.parquet", f"data.val_files={launcher_data['math']}/test.parquet",
        "data.max_prompt_length=1024", "data.max_response_length=2048", "trainer.project_name=verl_prm_math",
    ])
    assert len(math) == len(gsm8k)
    config = compose_verl(verl_overrides(launcher_calls["run_qwen2_5_0_5b_math_grpo_baseline.sh"][-1]))
    hook, _ = validate_run_config(config)
    # plain verl GRPO through the plugin's trainer: no step is scored
    assert config.algorithm.adv_estimator == "grpo" and not hook.score_outcome_estimators


@pytest.mark.parametrize("dataset", ["gsm8k", "math"])
def test_value_source_launchers_configure_their_source(launcher_calls, dataset):
    """The settings each launcher's comments give reasons for reach the composed config as the comments say."""
    from verl_prm.integrations.verl.sources import critic_worker_kwargs

    def composed(source):
        config = compose_verl(verl_overrides(launcher_calls[f"run_qwen2_5_0_5b_{dataset}_pav_{source}.sh"][-1]))
        hook, pav = validate_run_config(config)
        return config, hook, pav

    config, hook, pav = composed("tree")
    assert hook.critic.source == "tree" and hook.critic.path is None
    # 8 = 2 roots + 3 branch points x 2 continuations, on the baseline's rollout.n
    assert config.actor_rollout_ref.rollout.n == 8 and hook.tree.shape().branch_points(8) == 3
    assert (hook.tree.roots, hook.tree.branch_width, hook.tree.branch_rule) == (2, 2, "confidence")
    assert pav.best_of_k == 4 and config.algorithm.adv_estimator == "pav_grpo"

    config, hook, pav = composed("sampled")
    assert hook.critic.source == "sampled" and hook.critic.path is None
    assert (hook.critic.n_mc, hook.critic.prefix_rule) == (4, "first_pit") and pav.best_of_k == 4
    # the budget is twice the largest batch the rollout can generate: prompts x responses x response length
    largest_batch = config.data.train_batch_size * config.actor_rollout_ref.rollout.n * config.data.max_response_length
    assert hook.critic.mc_token_budget == 2 * largest_batch

    config, hook, pav = composed("qwen_prm_7b")
    assert critic_worker_kwargs(hook) == {
        "format": "qwen_prm", "best_of_k": 1, "max_tokens_per_batch": 16384, "truncation": "error",
        "allow_pickle": False, "calibration": "auto", "dtype": "bfloat16",
    }
    assert (hook.placement.pool, hook.placement.offload, hook.placement.shard) == ("colocated", "cpu", "none")
    assert pav.best_of_k == 1
    # the longest input (prompt + response, plus the card's system prompt and separators) fits the PRM's
    # 4,096-token context
    assert config.data.max_prompt_length + config.data.max_response_length <= 4096 - 256


def test_tree_launcher_rejects_a_rollout_n_its_shape_cannot_reach(launcher_calls):
    """The trainer check the launchers pass above can fail: rollout.n=7 is not 2 roots + branches of 2."""
    overrides = verl_overrides(launcher_calls["run_qwen2_5_0_5b_gsm8k_pav_tree.sh"][-1])
    config = compose_verl(overrides + ["actor_rollout_ref.rollout.n=7"])
    hook = read_hook_config(config.verl_prm)
    with pytest.raises(ConfigError, match="verl_prm.tree with actor_rollout_ref.rollout.n=7"):
        check_tree_run(config, hook)

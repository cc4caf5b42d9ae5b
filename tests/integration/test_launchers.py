"""The example launchers: run with stand-ins for `python3` and `verl-prm`, their overrides composed by Hydra and
passed through verl's own config validation."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from verl_support import LAUNCHERS, compose_verl

from verl_prm.config.hook import ConfigError
from verl_prm.integrations.verl.run_config import validate_run_config


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

    from verl_prm.integrations.verl.critic_group import critic_worker_kwargs

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
    assert train_args.best_of_k == 4 and label_args.prefix_rule == "first_pit"

"""Real `python -m verl.trainer.main_ppo` processes, plugin on and off: the startup checks fail before Ray with
clear errors; the plugin registers its names (also when our module is imported before verl, and as stubs that
name the error when it fails)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from verl_support import PLUGIN_OVERRIDES, REPO



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
    assert "verl-prm startup check failed: algorithm.pav.alpha must be in [0, 1e+06] (a finite number), got -1.0" in output
    assert "Please set at least one of" not in output and "ray init kwargs" not in output


@pytest.mark.parametrize("run, message", [
    ("nan_alpha", "verl-prm startup check failed: algorithm.pav.alpha must be in [0, 1e+06] (a finite number), got nan"),
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

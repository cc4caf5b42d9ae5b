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


# Named mistakes of the checks that used to run in the trainer's __init__ (inside verl's Ray task) or that name a
# renamed setting: each must stop main_ppo in the startup check, before ray.init.
BEFORE_RAY_MISTAKES = {
    "sampled_with_a_reward_model": (["verl_prm.critic.source=sampled", "reward.reward_model.enable=True"],
                                    "reward.reward_model.enable=True (a reward model) cannot score them"),
    "sampled_with_two_updates_per_sync": (["verl_prm.critic.source=sampled", "+trainer.v1.sync.parameter_sync_step=2"],
                                          "trainer.v1.sync.parameter_sync_step=2 updates the actor"),
    "tree_shape_against_rollout_n": (["verl_prm.critic.source=tree", "actor_rollout_ref.rollout.n=5"],
                                     "verl_prm.tree with actor_rollout_ref.rollout.n=5"),
    "tree_unknown_data_source": (["verl_prm.critic.source=tree", "actor_rollout_ref.rollout.n=6",
                                  "data.train_files=UNKNOWN_SOURCE_FILE"],
                                 "holds data_source values that verl's default reward function does not score ('my_task'"),
    "old_format_name": (["verl_prm.critic.format=rollout"], "set verl_prm.critic.source=sampled"),
    "renamed_setting": (["verl_prm.critic.source=tree", "+verl_prm.critic.mc_success_threshold=0.3"],
                        "verl_prm.critic.mc_success_threshold was renamed: set verl_prm.critic.success_threshold"),
}


@pytest.fixture(scope="module")
def ray_tmpdir(tmp_path_factory):
    """A Ray temp dir of these runs only: ray.init would create its session_* directory here."""
    return tmp_path_factory.mktemp("ray")


@pytest.fixture(scope="module")
def before_ray_runs(ray_tmpdir, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """A real `python -m verl.trainer.main_ppo` run per named mistake, one after another (each spends ~10 s of CPU
    importing verl; run side by side on a loaded machine they would time out)."""
    import pandas as pd

    data = tmp_path_factory.mktemp("data") / "train.parquet"
    pd.DataFrame({"data_source": ["my_task"], "prompt": [[{"role": "user", "content": "1+1"}]]}).to_parquet(data)
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmpdir))
    return {name: subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo"] + PLUGIN_OVERRIDES
                                 + [o.replace("UNKNOWN_SOURCE_FILE", str(data)) for o in overrides],
                                 env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
            for name, (overrides, _) in BEFORE_RAY_MISTAKES.items()}


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
            "verl_prm.critic.source=exact", "+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver",
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


@pytest.mark.parametrize("run", sorted(BEFORE_RAY_MISTAKES))
def test_main_ppo_refuses_each_source_mistake_before_ray_starts(before_ray_runs, ray_tmpdir, run):
    """The rollout, reward and data checks of the sampling and tree sources, the training data's sources and the
    renamed settings: each refused by the startup check (a Hydra callback, in the driver), and Ray never started
    (no session directory in the runs' RAY_TMPDIR, no `ray init kwargs` line from verl's main)."""
    result = before_ray_runs[run]
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "verl-prm startup check failed: " in output and BEFORE_RAY_MISTAKES[run][1] in output, output[-3000:]
    assert "full_key: hydra.callbacks.verl_prm_startup_check" in output
    assert "ray init kwargs" not in output
    assert not list(ray_tmpdir.glob("**/session_*")), "a main_ppo run started Ray"


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

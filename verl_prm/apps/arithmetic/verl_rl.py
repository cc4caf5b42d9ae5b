"""The RL stages of the arithmetic recipe: verl's own trainer (``python -m verl.trainer.main_ppo``) with the plugin.

The arms, the same command but for the estimator and the critic (same SFT policy, prompts, seeds and budget):

==========================  ==============  ==============================================================
arm                         estimator       prover critic (``verl_prm.critic``)
==========================  ==============  ==============================================================
``grpo``                    ``grpo``        the exact prover, for the ``pav/*`` metrics only (verl's advantages)
``pav_exact``               ``pav_grpo``    ``format=exact``: the task's scripted prover with exact values
``pav_learned``             ``pav_grpo``    ``format=value_head``: the PAV that ``verl-prm train`` learnt, its raw
                                            values (``critic.calibration=none``)
``pav_learned_calibrated``  ``pav_grpo``    the same PAV with its post-hoc calibration (``calibration=auto``:
                                            the checkpoint's ``calibration.json``)
``pav_learned_refined``     ``pav_grpo``    the PAV of the ``pav_refined`` stage, raw values: the same labels and
                                            value head on a backbone whose check was trained on
                                            (``Scale.critic_refine``)
``pav_learned_refined_      ``pav_grpo``    the refined PAV, its process term divided by its batch std
normalized``                                (``algorithm.pav.normalize=true``)
``pav_learned_refined_      ``pav_grpo``    the refined PAV at ``algorithm.pav.alpha=1`` (the others: ``RLConfig.alpha``)
alpha1``
``pav_mc``                  ``pav_grpo``    ``source=sampled``: Monte-Carlo values, ``MC_N`` continuations of every
                                            step prefix from the run's own rollout replicas
==========================  ==============  ==============================================================

Every PAV arm but ``pav_exact`` names the exact prover as its ``verl_prm.diagnostics.reference`` (metrics only:
``pav/process_corr``, ``pav/*abs_adv*``).

:func:`main_ppo_command` builds the command for a device: the run's settings (batch, group size, learning
rate, evaluation, ``algorithm.pav.*``) are the same on CPU and GPU; only the device block differs (CPU: the
plugin's CPU platform and ``hf`` rollout, ``docs/cpu_loop.md``; GPU: vLLM). ``examples/arithmetic/run_gpu.sh``
runs the recipe at ``--scale gpu``, which calls the same function.

A run writes ``RUN_DIR/metrics.jsonl`` (verl's file logger), ``RUN_DIR/main_ppo.log``, checkpoints under
``RUN_DIR/checkpoints`` and, merged with verl's model merger, the final policy ``RUN_DIR/final`` (Hugging
Face format). :func:`read_run` turns the metrics into the curves the evaluation reads.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from verl_prm.apps.arithmetic.task import STEP_REGEX
from verl_prm.apps.cpu_loop import cpu_overrides, start_main_ppo

__all__ = ["ARMS", "Arm", "CRITIC_STAGES", "LEARNED_ARMS", "MC_N", "DIAGNOSTIC_METRICS", "RLConfig", "RunPaths",
           "SCORE_FILE", "device_overrides", "learned_critic_overrides", "main_ppo_command", "merge_final_policy", "read_records", "read_run", "run_arms",
           "run_curves", "start_run"]

# the task's verl score function, in a file that verl (and the label stage) load by path
SCORE_FILE = Path(__file__).with_name("score.py")


@dataclass(frozen=True)
class RLConfig:
    """The settings of every RL run (verl's ``main_ppo``; :func:`main_ppo_command` maps them): PAV's
    ``alpha`` and Best-of-K, ``steps`` x ``prompts_per_step`` prompts x ``group_size`` samples, the policy's
    learning rate (one on-policy update per batch), sampling temperature, the held-out evaluation every
    ``eval_every`` steps with ``eval_samples`` samples per test prompt, verl's ``loss_agg_mode``."""

    alpha: float = 3.0
    best_of_k: int = 4
    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4
    temperature: float = 1.0
    eval_every: int = 5
    eval_samples: int = 4
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        for name in ("alpha", "lr", "temperature"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"RLConfig.{name} must be finite and >= 0, got {value!r}")
        for name in ("best_of_k", "steps", "prompts_per_step", "group_size", "eval_every",
                     "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Arm:
    """One RL arm: verl's estimator, the plugin's critic (``exact``; ``learned``: the ``pav`` stage's PAV;
    ``refined``: the ``pav_refined`` stage's; ``rollout``), the learned critic's calibration
    (``verl_prm.critic.calibration``), further ``algorithm.pav`` overrides, the sampling settings
    (``verl_prm.critic.mc_*``) of the rollout critic or of a learned PAV's refresh (``verl_prm.refresh.*``)."""

    estimator: str
    critic: str
    label: str
    calibration: str = "none"
    pav_overrides: tuple[str, ...] = ()
    # source=sampled, or a learned PAV's refresh: verl_prm.critic.mc_* overrides
    mc_overrides: tuple[str, ...] = ()
    # a learned PAV refitted to sampled values during the run: verl_prm.refresh.* overrides
    refresh_overrides: tuple[str, ...] = ()
    # algorithm.pav.alpha of this arm where it is not the run's (RLConfig.alpha): the weight of a noisy process term
    alpha: float | None = None
    # format=tree: verl_prm.tree.* overrides (the shape of each group's tree)
    tree_overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.alpha is not None and (not np.isfinite(self.alpha) or self.alpha < 0):
            raise ValueError(f"Arm.alpha must be finite and >= 0, got {self.alpha!r}")


# continuations per step prefix of the pav_mc arm (n of the Monte-Carlo estimate; the labels' n_mc is 2)
MC_N = 4

ARMS: dict[str, Arm] = {
    "grpo": Arm("grpo", "exact", "GRPO (outcome only)"),
    "pav_exact": Arm("pav_grpo", "exact", "PAV-GRPO, exact prover"),
    "pav_learned": Arm("pav_grpo", "learned", "PAV-GRPO, learned PAV (raw values)"),
    "pav_learned_calibrated": Arm("pav_grpo", "learned", "PAV-GRPO, learned PAV, calibrated", calibration="auto"),
    "pav_learned_refined": Arm("pav_grpo", "refined", "PAV-GRPO, learned PAV on the refined check (raw values)"),
    # the estimator's own scale controls on the refined PAV: a noisy process term with less weight, or rescaled
    "pav_learned_refined_normalized": Arm("pav_grpo", "refined", "PAV-GRPO, refined PAV, process term / batch std",
                                          pav_overrides=("normalize=true",)),
    "pav_learned_refined_alpha1": Arm("pav_grpo", "refined", "PAV-GRPO, refined PAV, alpha = 1", alpha=1.0),
    "pav_mc": Arm("pav_grpo", "rollout", f"PAV-GRPO, Monte-Carlo values (n={MC_N})",
                  mc_overrides=(f"n_mc={MC_N}", "prefix_rule=every")),
    # each group of 8 sampled as a tree: 2 roots, then 3 branch points of 2 continuations each (breadth-first);
    # the node values are the mean outcomes of the leaves below (no critic, no samples beyond the group)
    "pav_tree": Arm("pav_grpo", "tree", "PAV-GRPO, tree-shaped groups (node values)",
                    tree_overrides=("roots=2", "branch_width=2", "branch_rule=every")),
    # the refined PAV's head refitted every 5 steps to the samples of pav_mc's settings (all refreshes in the window)
    "pav_learned_refresh": Arm("pav_grpo", "refined", f"PAV-GRPO, refined PAV refreshed from samples (n={MC_N}, every 5 steps)",
                               mc_overrides=(f"n_mc={MC_N}", "prefix_rule=every"),
                               refresh_overrides=("every=5", "window=6")),
}
# the arms whose critic is a learned PAV, and the stage that trains it (their runs depend on that stage)
CRITIC_STAGES = {"learned": "pav", "refined": "pav_refined"}
LEARNED_ARMS = tuple(name for name, arm in ARMS.items() if arm.critic in CRITIC_STAGES)


@dataclass(frozen=True)
class RunPaths:
    """What a run reads."""

    policy: Path
    train_file: Path
    val_file: Path
    # the learned PAVs' checkpoints by critic kind (``Arm.critic``: ``learned``, ``refined``), those trained
    learned_critics: dict[str, Path]
    step_accuracy: float  # p of the exact prover (the SFT policy's measured per-step accuracy)


def _validation_key(samples: int) -> str:
    return f"val-core/arithmetic_mod/acc/mean@{samples}"


def device_overrides(scale, device: str) -> list[str]:
    """The ``main_ppo`` overrides of a run that depend on the device (``cpu``: the plugin's CPU platform, fp32
    FSDP; ``cuda``: vLLM). Part of every RL run's settings: the numbers depend on them."""
    rl = scale.rl
    batch = rl.prompts_per_step
    if device == "cpu":
        tokens = batch * rl.group_size * (scale.max_prompt_tokens + scale.max_new_tokens)

        # the plugin's CPU platform (docs/cpu_loop.md explains each setting), one training process; float32, in
        # which the recipe's published runs were measured (its 0.9M-parameter policy gains little from bf16)
        return cpu_overrides(n_procs=1, precision="float32") + [
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * rl.group_size}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * rl.group_size}",
            f"actor_rollout_ref.rollout.max_num_seqs={max(256, batch * rl.group_size)}",
            f"actor_rollout_ref.rollout.max_num_batched_tokens={max(8192, tokens)}",
            "data.dataloader_num_workers=0",
            "verl_prm.critic.dtype=float32",
        ]
    if device == "cuda":
        return [
            "trainer.n_gpus_per_node=1",
            "trainer.nnodes=1",
            # flash-attn installed: flash_attention_2 + remove-padding, else sdpa (verl_prm.integrations.verl.attention)
            "actor_rollout_ref.model.use_remove_padding=${verl_prm.flash_attn:}",
            "+actor_rollout_ref.model.override_config.attn_implementation=${verl_prm.attn_implementation:}",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
        ]
    raise ValueError(f"device must be cpu or cuda, got {device!r}")


def learned_critic_overrides(checkpoint: str | Path, calibration: str = "none", mc_overrides: Sequence[str] = (),
                             refresh_overrides: Sequence[str] = ()) -> list[str]:
    """The ``verl_prm.critic`` overrides of a PAV that ``verl-prm train`` learnt (source ``checkpoint``, format
    ``value_head`` or ``token_logprob``, read from the checkpoint) at ``checkpoint``, with its ``calibration``
    (``none``: the raw values; ``auto``: the checkpoint's ``calibration.json``), the sampling settings
    ``mc_overrides`` (``verl_prm.critic.<key>=<value>``) and a refresh's ``refresh_overrides``
    (``verl_prm.refresh.<key>=<value>``)."""
    from verl_prm.critic.token_logprob_head import native_format

    return ["verl_prm.critic.source=checkpoint", f"verl_prm.critic.path={checkpoint}",
            f"verl_prm.critic.format={native_format(checkpoint)}", f"verl_prm.critic.calibration={calibration}",
            *(f"verl_prm.critic.{override}" for override in mc_overrides),
            *(f"verl_prm.refresh.{override}" for override in refresh_overrides)]


def main_ppo_command(scale, arm_name: str, seed: int, paths: RunPaths, run_dir: Path, device: str = "cpu",
                     python: str = sys.executable) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with every override of one run (see the module docstring)."""
    from verl_prm.apps.arithmetic.prover import EXACT_PROVER

    if arm_name not in ARMS:
        raise ValueError(f"unknown RL arm {arm_name!r}; known: {', '.join(ARMS)}")
    arm, rl = ARMS[arm_name], scale.rl
    exact_prover = [f"prover={EXACT_PROVER}", f"step_accuracy={paths.step_accuracy:.6f}"]
    # the exact arm's prover as the diagnostics' reference: the pav/process_corr, pav/*abs_adv* metrics
    reference = [f"+verl_prm.diagnostics.reference.{option}" for option in exact_prover]
    if arm.critic in CRITIC_STAGES:
        if arm.critic not in paths.learned_critics:
            raise ValueError(f"arm {arm_name} needs the learned PAV checkpoint of the recipe's "
                             f"{CRITIC_STAGES[arm.critic]} stage")
        critic = [*learned_critic_overrides(paths.learned_critics[arm.critic], arm.calibration, arm.mc_overrides,
                                            arm.refresh_overrides), *reference]
    elif arm.critic == "rollout":
        critic = ["verl_prm.critic.source=sampled", "verl_prm.critic.path=null",
                  *(f"verl_prm.critic.{override}" for override in arm.mc_overrides), *reference]
    elif arm.critic == "tree":
        critic = ["verl_prm.critic.source=tree", "verl_prm.critic.path=null",
                  *(f"verl_prm.tree.{override}" for override in arm.tree_overrides), *reference]
    else:
        critic = ["verl_prm.critic.source=exact", *(f"+verl_prm.critic.options.{option}" for option in exact_prover)]
    batch = rl.prompts_per_step
    run = [
        "hydra.searchpath=[pkg://verl_prm.config]",
        "+verl_prm=pav",
        *critic,
        "verl_prm.steps.delimiter=null",
        f"verl_prm.steps.regex='{STEP_REGEX}'",
        "verl_prm.placement.pool=colocated",
        f"algorithm.adv_estimator={arm.estimator}",
        f"algorithm.pav.alpha={rl.alpha if arm.alpha is None else arm.alpha}",
        f"algorithm.pav.best_of_k={rl.best_of_k}",
        *(f"algorithm.pav.{override}" for override in arm.pav_overrides),
        "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={SCORE_FILE}",
        "reward.custom_reward_function.name=compute_score",
        f"data.train_files={paths.train_file}",
        f"data.val_files={paths.val_file}",
        f"data.train_batch_size={batch}",
        f"data.max_prompt_length={scale.max_prompt_tokens}",
        f"data.max_response_length={scale.max_new_tokens}",
        "data.truncation=error",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={paths.policy}",
        f"actor_rollout_ref.actor.optim.lr={rl.lr}",
        # one update per batch: on-policy, as the PAV paper's online RL
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.loss_agg_mode={rl.loss_agg_mode}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.rollout.n={rl.group_size}",
        f"actor_rollout_ref.rollout.temperature={rl.temperature}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        f"actor_rollout_ref.rollout.val_kwargs.temperature={rl.temperature}",
        f"actor_rollout_ref.rollout.val_kwargs.n={rl.eval_samples}",
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",
        "trainer.project_name=verl_prm_arithmetic",
        f"trainer.experiment_name={arm_name}_seed{seed}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        "trainer.resume_mode=auto",
        "trainer.val_before_train=True",
        f"trainer.test_freq={rl.eval_every}",
        # a checkpoint at every evaluation, the latest kept: a killed run resumes (resume_mode=auto) from there
        f"trainer.save_freq={rl.eval_every}",
        "trainer.max_actor_ckpt_to_keep=1",
        f"trainer.total_training_steps={rl.steps}",
        "trainer.total_epochs=1000",
    ]
    return [python, "-m", "verl.trainer.main_ppo", *run, *device_overrides(scale, device)]


def _metric_parts(run_dir: Path) -> list[Path]:
    """The metrics of earlier starts of a resumed run (``metrics-1.jsonl``, ``metrics-2.jsonl``, ...), in order."""
    parts = [(int(path.stem.split("-")[1]), path) for path in run_dir.glob("metrics-*.jsonl")
             if path.stem.split("-")[1].isdigit()]
    return [path for _, path in sorted(parts)]


def _keep_earlier_metrics(run_dir: Path) -> None:
    """verl's file logger truncates its file when it starts, so the steps an interrupted run logged before its
    resume would be lost: keep them as the next ``metrics-<n>.jsonl`` (``read_run`` reads every part)."""
    current = run_dir / "metrics.jsonl"
    if current.exists() and current.stat().st_size > 0:
        parts = _metric_parts(run_dir)
        number = int(parts[-1].stem.split("-")[1]) + 1 if parts else 1
        current.replace(run_dir / f"metrics-{number}.jsonl")


def start_run(command: Sequence[str], run_dir: Path, *, threads: int = 1):
    """Start ``command`` in ``run_dir`` (``cpu_loop.start_main_ppo``: a session of its own, whose ``stop`` ends
    the Ray processes too) with verl's file logger at ``run_dir/metrics.jsonl``, its output appended to
    ``run_dir/main_ppo.log`` and the command in ``run_dir/command.sh``; returns the run's handle."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _keep_earlier_metrics(run_dir)
    (run_dir / "command.sh").write_text(
        f"VERL_FILE_LOGGER_PATH={shlex.quote(str(run_dir / 'metrics.jsonl'))} " + shlex.join(command) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TRL_EXPERIMENTAL_SILENCE="1",
               RAY_DEDUP_LOGS="1")
    return start_main_ppo(command, run_dir / "metrics.jsonl", run_dir / "main_ppo.log", env=env, cwd=run_dir,
                          append_log=True)


def check_exit(returncode: int, run_dir: Path) -> None:
    """A failed run raises with the end of its log."""
    if returncode != 0:
        tail = (run_dir / "main_ppo.log").read_bytes()[-4000:].decode(errors="replace")
        raise RuntimeError(f"main_ppo for {run_dir} exited with {returncode}; command: {run_dir / 'command.sh'}; "
                           f"log {run_dir / 'main_ppo.log'} ends with:\n{tail}")


def merge_final_policy(run_dir: Path, steps: int, python: str = sys.executable) -> Path:
    """verl's model merger: the FSDP checkpoint of the last step -> ``run_dir/final`` (Hugging Face format)."""
    final = run_dir / "final"
    if (final / "config.json").exists():
        return final
    actor = run_dir / "checkpoints" / f"global_step_{steps}" / "actor"
    if not actor.is_dir():
        raise FileNotFoundError(f"{actor} does not exist: the run did not save its step-{steps} checkpoint")
    subprocess.run([python, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(actor),
                    "--target_dir", str(final)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return final


# the process-term diagnostics against the exact reference (verl_prm.diagnostics) and the sampler's time, by the
# names read_run gives them
DIAGNOSTIC_METRICS = {
    "process_corr": "pav/process_corr",
    "abs_adv_right": "pav/abs_adv_right",
    "abs_adv_slipped": "pav/abs_adv_slipped",
    "exact_abs_adv_right": "pav/exact_abs_adv_right",
    "exact_abs_adv_slipped": "pav/exact_abs_adv_slipped",
    "zero_outcome_groups_with_signal": "pav/zero_outcome_groups_with_signal",
    "mc_seconds": "timing_s/pav_mc",
    # a learned PAV's refresh (verl_prm.refresh.every=k), logged on its refresh steps only: the PAV before its refit
    # against the step's fresh samples
    "refresh_labels": "pav/refresh/labels",
    "refresh_mse": "pav/refresh/mse",
    "refresh_mse_constant": "pav/refresh/mse_constant",
    "refresh_auroc": "pav/refresh/auroc",
    "refresh_seconds": "timing_s/pav_refresh",
}


def _metric(data: dict, key: str, missing: float = float("nan")) -> float:
    """A logged metric as a float; a step where it is undefined (verl's file logger writes a NaN as null) is nan."""
    value = data.get(key, missing)
    return float("nan") if value is None else float(value)


def read_records(run_dir: Path) -> list[dict]:
    """verl's file-logger records of a run (``{"step": int, "data": {metric: value}}``), in the order they were
    logged: the parts its earlier starts logged first (``metrics-<n>.jsonl``, kept by ``start_run``: verl truncates
    the file when it starts), then ``metrics.jsonl``. A torn last line of a part (its start was killed while
    writing) is skipped; any other unreadable line is an error naming it."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: was the run started with trainer.logger including 'file'?")
    records = []
    for part in [*_metric_parts(run_dir), path]:
        lines = part.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):  # torn by the kill that interrupted this start
                    continue
                raise ValueError(f"{part}:{number} is not JSON") from None
    return records


def run_curves(records: Sequence[dict], validation_key: str, responses_per_step: int) -> dict:
    """The curves of a run's records (:func:`read_records`; a step logged again, after a resume, replaces the
    earlier record): ``curve``, (step, sampled responses = step x ``responses_per_step``, held-out accuracy) at each
    step that logged ``validation_key``; ``training``, per training step the batch accuracy, the share of groups
    with no outcome signal, the step's time, its generated tokens (responses; continuations of source=sampled)
    and the PAV metrics (``DIAGNOSTIC_METRICS``; nan when not logged)."""
    evaluations: dict[int, float] = {}
    training: dict[int, dict] = {}
    for record in records:
        step, data = int(record["step"]), record["data"]
        if validation_key in data:
            evaluations[step] = float(data[validation_key])
        if "critic/score/mean" in data:
            responses = _metric(data, "response_length/mean") * responses_per_step
            training[step] = {
                "batch_accuracy": float(data["critic/score/mean"]),
                "zero_signal_groups": _metric(data, "pav/outcome_zero_signal_groups"),
                "process_term_std": _metric(data, "pav/process_term/std"),
                "step_seconds": _metric(data, "timing_s/step"),
                # the batch's response tokens (what the update trains on), the tokens sampled to make them (fewer
                # for tree-shaped groups, whose branches share their prefixes), and the Monte-Carlo continuations'
                # (source=sampled; 0 otherwise)
                "response_tokens": responses,
                "generated_tokens": _metric(data, "pav/tree_generated_tokens", responses),
                "mc_tokens": _metric(data, "pav/mc_tokens", 0.0),
                **{name: _metric(data, key) for name, key in DIAGNOSTIC_METRICS.items()},
            }
    curve = [(step, step * responses_per_step, evaluations[step]) for step in sorted(evaluations)]
    return {"curve": curve, "training": [dict(step=s, **training[s]) for s in sorted(training)]}


def read_run(run_dir: Path, scale) -> dict:
    """The run's curves (:func:`run_curves`) from verl's file logger (:func:`read_records`, every part of a resumed
    run), with the recipe's validation key and batch; a run that logged no held-out accuracy is an error."""
    rl = scale.rl
    key = _validation_key(rl.eval_samples)
    curves = run_curves(read_records(run_dir), key, rl.prompts_per_step * rl.group_size)
    if not curves["curve"]:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no {key} metric: was the run started with "
                         f"trainer.test_freq and val_kwargs.n={rl.eval_samples}?")
    return curves


def run_arms(scale, runs: Sequence[tuple[str, int, Path]], paths: RunPaths, *, parallel: int = 1,
             log=print, on_done=None) -> None:
    """Run ``runs`` ((arm, seed, run_dir), in order) with up to ``parallel`` main_ppo processes at once; each
    finished run is merged (``final/``) and handed to ``on_done(arm, seed, run_dir, seconds)``."""
    pending = list(runs)
    active: list[tuple[str, int, Path, object, float]] = []
    failures: list[str] = []
    import signal
    import threading

    def terminated(signum, frame):  # `kill PID` stops the runs too, as Ctrl-C does
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminated) if threading.current_thread() is threading.main_thread() else None
    try:
        _schedule(scale, pending, active, failures, paths, parallel, log, on_done)
    finally:  # an interrupt (or a failure in on_done) leaves no run behind
        for _, _, _, run, _ in active:
            run.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failures:
        raise RuntimeError("RL runs failed:\n" + "\n".join(failures))


def _schedule(scale, pending, active, failures, paths, parallel, log, on_done) -> None:
    while pending or active:
        while pending and len(active) < max(1, parallel):
            arm, seed, run_dir = pending.pop(0)
            command = main_ppo_command(scale, arm, seed, paths, run_dir, device=scale.trainer_device)
            log(f"[arithmetic] rl {arm} seed {seed}: main_ppo -> {run_dir} (log: {run_dir / 'main_ppo.log'})")
            active.append((arm, seed, run_dir, start_run(command, run_dir, threads=scale.threads), time.time()))
        time.sleep(2.0)
        for item in list(active):
            arm, seed, run_dir, run, started = item
            returncode = run.poll()
            if returncode is None:
                continue
            active.remove(item)
            run.stop()  # whatever main_ppo left in its session (Ray's processes)
            try:
                check_exit(returncode, run_dir)
                merge_final_policy(run_dir, scale.rl.steps)
                if on_done is not None:
                    on_done(arm, seed, run_dir, time.time() - started)
            except Exception as error:  # the other runs go on; the stage fails at the end, naming every failure
                failures.append(f"{arm} seed {seed}: {error}")
                log(f"[arithmetic] rl {arm} seed {seed} FAILED: {str(error)[:400]}")

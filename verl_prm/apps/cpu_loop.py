"""The CPU loop: verl's ``main_ppo`` with GRPO or PAV-GRPO on a tiny Qwen2 built locally, on CPU.

    python -m verl_prm.apps.cpu_loop prepare WORK_DIR          # tokenizer, policy, critic, data (seconds)
    python -m verl_prm.apps.cpu_loop command WORK_DIR pav_grpo  # print the main_ppo command line

``prepare`` writes, with the arithmetic recipe's character tokenizer and Qwen2 builder (random weights, seeded):
``WORK_DIR/policy`` (a Qwen2ForCausalLM), ``WORK_DIR/critic`` (a Qwen2 value-head critic, the ``value_head``
format), ``WORK_DIR/data/{train,val}.parquet`` (arithmetic problems in verl's RL layout). ``main_ppo_args``
returns the overrides of one run: verl's ``main_ppo`` with the plugin's config group (``+verl_prm=pav``), the
CPU platform's settings (``trainer.device=cpu``, fsdp2, logical Ray GPUs), the ``hf`` rollout and the launcher's
batch (``LoopSize``). ``start_main_ppo`` starts a run as a session of its own (``poll``, ``wait``; ``stop`` ends
every process of the session, Ray's included), ``run_main_ppo`` runs one to its end; the arithmetic recipe starts
its runs the same way. ``read_metrics`` reads verl's file logger (one JSON line per step).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from verl_prm.apps.arithmetic.model import ModelConfig, build_model, build_tokenizer, save_policy
from verl_prm.apps.arithmetic.task import TaskConfig, generate_problems, verl_row
from verl_prm.apps.arithmetic import score

__all__ = [
    "LoopSize",
    "MainPPOResult",
    "MainPPORun",
    "cpu_overrides",
    "merge_overrides",
    "main_ppo_args",
    "prepare",
    "read_metrics",
    "run_main_ppo",
    "start_main_ppo",
]

# A step of the tiny policy's responses: fixed-size steps (a random policy writes no delimiters).
STEP_TOKENS = 8


@dataclass(frozen=True)
class LoopSize:
    """The launcher's batch and model: as small as verl's loop allows, so that a run is mostly start-up."""

    prompts_per_step: int = 4
    responses_per_prompt: int = 4
    max_prompt_length: int = 64
    max_response_length: int = 32
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    train_problems: int = 64
    val_problems: int = 8


CRITIC_CONTEXT_FACTOR = 4  # the critic's context over the policy's (prompt + response)


def prepare(work_dir: str | Path, size: LoopSize = LoopSize(), seed: int = 0) -> dict[str, str]:
    """Write the policy, the critic and the data under ``work_dir`` (idempotent: existing parts are kept)."""
    import pandas as pd
    import torch
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    from verl_prm.checkpoints import save_model

    work_dir = Path(work_dir)
    paths = {"policy": work_dir / "policy", "critic": work_dir / "critic",
             "train": work_dir / "data" / "train.parquet", "val": work_dir / "data" / "val.parquet"}
    tokenizer = build_tokenizer()
    model_config = ModelConfig(hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
                               num_hidden_layers=size.num_hidden_layers, num_attention_heads=size.num_attention_heads,
                               num_key_value_heads=size.num_attention_heads,
                               max_position_embeddings=size.max_prompt_length + size.max_response_length)
    if not (paths["policy"] / "config.json").exists():
        save_policy(build_model(tokenizer, model_config, seed=seed), tokenizer, paths["policy"])
    if not (paths["critic"] / "config.json").exists():
        critic_config = Qwen2Config(
            vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            hidden_size=model_config.hidden_size, intermediate_size=model_config.intermediate_size,
            num_hidden_layers=model_config.num_hidden_layers, num_attention_heads=model_config.num_attention_heads,
            num_key_value_heads=model_config.num_key_value_heads,
            # the critic reads the policy's text re-encoded, where a special token a random policy sampled is
            # plain text of several tokens: room for that, so a run does not stop on a long re-encoding
            max_position_embeddings=CRITIC_CONTEXT_FACTOR * model_config.max_position_embeddings,
        )
        torch.manual_seed(seed + 1)
        critic = Qwen2ForTokenClassification(critic_config)
        save_model(critic, tokenizer, paths["critic"])
    task = TaskConfig()
    if not paths["val"].exists():
        paths["val"].parent.mkdir(parents=True, exist_ok=True)
        val = generate_problems(size.val_problems, task, seed=seed + 11)
        train = generate_problems(size.train_problems, task, seed=seed + 12, exclude=[p.prompt_text for p in val])
        pd.DataFrame([verl_row(p, "train", i) for i, p in enumerate(train)]).to_parquet(paths["train"])
        pd.DataFrame([verl_row(p, "test", i) for i, p in enumerate(val)]).to_parquet(paths["val"])
    return {name: str(path) for name, path in paths.items()}


def cpu_overrides(n_procs: int = 1, extra_logical_gpus: int = 0, precision: str = "auto") -> list[str]:
    """The settings a ``main_ppo`` run needs on the CPU platform (docs/cpu_loop.md explains each).

    ``extra_logical_gpus``: Ray slots beyond the training processes (1 for the critic's own pool,
    ``verl_prm.placement.pool=own``). ``precision`` (``verl_prm.precision``): ``auto`` computes the rollout and
    the actor's and reference's forward and backward in bf16 (FSDP mixed precision over float32 master weights)
    where the CPU has native bf16 instructions, in float32 elsewhere."""
    import torch

    from verl_prm.integrations.verl.platform.checks import BF16_MIXED_PRECISION, FP32_MIXED_PRECISION
    from verl_prm.precision import resolve_dtype

    bf16 = resolve_dtype(precision, "cpu") == torch.bfloat16
    mixed_precision = BF16_MIXED_PRECISION if bf16 else FP32_MIXED_PRECISION

    return [
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={n_procs}",
        "trainer.nnodes=1",
        # verl's worker pools ask Ray for GPU bundles: one logical GPU per training process
        f"+ray_kwargs.ray_init.num_gpus={n_procs + extra_logical_gpus}",
        "ray_kwargs.ray_init.num_cpus=16",
        # one TransferQueue storage unit (eight start slowly on 2 cores)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.dtype={'bfloat16' if bf16 else 'float32'}",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.model.use_remove_padding=False",
        # verl's default attention is flash_attention_2 (CUDA only)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        # verl's FSDP default computes in bf16: on a CPU without native bf16 (no avx512_bf16 / AMX) that is several
        # times slower than fp32 (docs/cpu_loop.md, the measured ratio), so there the run computes in fp32
        *(f"++actor_rollout_ref.{role}.fsdp_config.mixed_precision={mixed_precision}" for role in ("actor", "ref")),
    ]


def main_ppo_args(work_dir: str | Path, estimator: str, *, steps: int, size: LoopSize = LoopSize(),
                  run_name: str | None = None, save_freq: int = -1, test_freq: int = -1,
                  val_before_train: bool = False, resume: bool = False, critic_pool: str = "colocated",
                  checkpoint_name: str | None = None, plugin: bool = True, extra: Sequence[str] = (),
                  precision: str = "auto") -> list[str]:
    """The ``python -m verl.trainer.main_ppo`` overrides of one CPU-loop run of ``estimator`` (grpo, pav_grpo).

    ``critic_pool``: ``verl_prm.placement.pool`` (``colocated``: the critic's worker shares verl's pool;
    ``own``: a pool of one more logical GPU). ``checkpoint_name``: the directory under ``WORK_DIR/checkpoints``
    the run saves to and resumes from (default: ``run_name``). ``plugin=False``: verl's own trainer and
    estimator, without the plugin's config group and hook (the CPU platform stays). ``extra``: overrides that
    replace those of the same key (:func:`merge_overrides`). ``precision``: :func:`cpu_overrides`'."""
    work_dir = Path(work_dir)
    run_name = run_name or estimator
    batch = size.prompts_per_step
    plugin_args = [
        "+verl_prm=pav",
        f"verl_prm.critic.path={work_dir / 'critic'}",
        "verl_prm.critic.dtype=float32",
        "verl_prm.steps.delimiter=null",
        f"verl_prm.steps.max_tokens={STEP_TOKENS}",
        f"verl_prm.placement.pool={critic_pool}",
    ]
    base = [
        "hydra.searchpath=[pkg://verl_prm.config]",
        *(plugin_args if plugin else []),
        f"algorithm.adv_estimator={estimator}",
        "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={score.__file__}",
        "reward.custom_reward_function.name=compute_score",
        f"data.train_files={work_dir / 'data' / 'train.parquet'}",
        f"data.val_files={work_dir / 'data' / 'val.parquet'}",
        f"data.train_batch_size={batch}",
        f"data.val_batch_size={size.val_problems}",
        f"data.max_prompt_length={size.max_prompt_length}",
        f"data.max_response_length={size.max_response_length}",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={work_dir / 'policy'}",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * size.responses_per_prompt}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.rollout.n={size.responses_per_prompt}",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * size.responses_per_prompt}",
        f"actor_rollout_ref.rollout.max_num_seqs={batch * size.responses_per_prompt}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        *cpu_overrides(extra_logical_gpus=1 if critic_pool == "own" else 0, precision=precision),
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",
        "trainer.project_name=verl_prm_cpu_loop",
        f"trainer.experiment_name={run_name}",
        f"trainer.default_local_dir={work_dir / 'checkpoints' / (checkpoint_name or run_name)}",
        f"trainer.resume_mode={'auto' if resume else 'disable'}",
        f"trainer.val_before_train={val_before_train}",
        f"trainer.test_freq={test_freq}",
        f"trainer.save_freq={save_freq}",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
    ]
    return merge_overrides(base, extra)


def merge_overrides(args: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """``args`` with each ``key=value`` of ``overrides`` replacing the one of the same key (with or without
    ``+``), else appended; ``~key`` removes the key. One value per key, so no reader depends on which of two wins."""
    keys = {o.lstrip("~").split("=", 1)[0].lstrip("+") for o in overrides}
    kept = [a for a in args if a.split("=", 1)[0].lstrip("+") not in keys]
    return kept + [o for o in overrides if not o.startswith("~")]


@dataclass
class MainPPOResult:
    returncode: int
    seconds: float
    metrics: list[dict]
    log_path: Path
    # peak of the summed resident memory of the run's processes (main_ppo, Ray, its workers), sampled each second
    peak_rss_gib: float = 0.0
    peak_processes: int = 0

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def read_metrics(path: str | Path) -> list[dict]:
    """verl's file-logger records ``{"step": int, "data": {metric: value}}``, one per logged step."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def session_processes(session: int) -> dict[int, int]:
    """{pid: resident bytes} of the live processes of a session (``/proc``; Ray's workers change their process
    group but stay in the session of the ``main_ppo`` process, which ``start_main_ppo`` starts as a new session)."""
    page = os.sysconf("SC_PAGE_SIZE")
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:
                continue
            with open(f"/proc/{entry}/statm") as statm:
                found[int(entry)] = int(statm.read().split()[1]) * page
        except (OSError, IndexError, ValueError):  # the process ended while being read
            continue
    return found


class MainPPORun:
    """A ``main_ppo`` process started by :func:`start_main_ppo`, in a session of its own: ``poll`` (which also
    samples the session's resident memory), ``wait``, and ``stop``, which ends every process left in the session
    (Ray's GCS, raylet and workers change their process group, not their session)."""

    def __init__(self, process: subprocess.Popen, log, log_path: Path, metrics_path: Path) -> None:
        self.process, self._log = process, log
        self.log_path, self.metrics_path = log_path, metrics_path
        self.started = time.perf_counter()
        self.peak_bytes, self.peak_processes = 0, 0

    def poll(self) -> int | None:
        """The exit status once ``main_ppo`` has exited, else None (after sampling the session's memory)."""
        returncode = self.process.poll()
        if returncode is None:
            resident = session_processes(self.process.pid)
            if sum(resident.values()) > self.peak_bytes:
                self.peak_bytes, self.peak_processes = sum(resident.values()), len(resident)
        return returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: until it exits), sampling memory each second; the exit status, or
        None when the time ran out (the run is still going: ``stop`` it)."""
        while True:
            returncode = self.poll()
            if returncode is not None:
                return returncode
            if timeout is not None and time.perf_counter() - self.started > timeout:
                return None
            try:
                return self.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                continue

    def stop(self) -> None:
        """End every process of the run's session (SIGTERM, up to 5 s, then SIGKILL) and close the log."""
        try:
            _end_session(self.process)
        finally:
            self._log.close()


def start_main_ppo(command: Sequence[str], metrics_path: str | Path, log_path: str | Path, *,
                   env: dict | None = None, cwd: str | Path | None = None, append_log: bool = False) -> MainPPORun:
    """Start ``command`` (``python -m verl.trainer.main_ppo ...``) as a new session, so that ``stop`` ends every
    process it starts; verl's file logger writes ``metrics_path``, stdout and stderr go to ``log_path`` (appended
    to with ``append_log``: a resumed run keeps the log of its first part)."""
    metrics_path, log_path = Path(metrics_path), Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    run_env = dict(os.environ if env is None else env)
    run_env["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    run_env.setdefault("RAY_DEDUP_LOGS", "0")
    log = open(log_path, "ab" if append_log else "wb")
    try:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=run_env,
                                   cwd=None if cwd is None else str(cwd), start_new_session=True)
    except BaseException:
        log.close()
        raise
    return MainPPORun(process, log, log_path, metrics_path)


def run_main_ppo(args: Sequence[str], metrics_path: str | Path, log_path: str | Path, *,
                 timeout: float = 900, env: dict | None = None) -> MainPPOResult:
    """Run ``python -m verl.trainer.main_ppo ARGS`` (:func:`start_main_ppo`) to its end or for at most ``timeout``
    seconds (return code -9), then end every process left in its session. The summed resident memory of the
    session is sampled each second (``peak_rss_gib``)."""
    run = start_main_ppo([sys.executable, "-m", "verl.trainer.main_ppo", *args], metrics_path, log_path, env=env)
    try:
        returncode = run.wait(timeout)
    finally:
        run.stop()
    return MainPPOResult(-9 if returncode is None else returncode, time.perf_counter() - run.started,
                         read_metrics(run.metrics_path), run.log_path, run.peak_bytes / 2**30, run.peak_processes)


def _end_session(process: subprocess.Popen) -> None:
    """End every process left in the run's session: SIGTERM, up to 5 s, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = set(session_processes(process.pid))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for _ in range(50):
            process.poll()  # reap main_ppo itself once it has exited
            if not session_processes(process.pid):
                break
            time.sleep(0.1)
        else:
            continue
        break
    if process.poll() is None:
        process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_prm.apps.cpu_loop",
                                     description="prepare the CPU loop's tiny model and data, or print its command")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="write WORK_DIR/{policy,critic,data}")
    prep.add_argument("work_dir")
    command = sub.add_parser("command", help="print the main_ppo overrides of one run, one per line")
    command.add_argument("work_dir")
    command.add_argument("estimator", choices=("grpo", "pav_grpo"))
    command.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    if args.action == "prepare":
        for name, path in prepare(args.work_dir).items():
            print(f"{name}: {path}")
        return 0
    print("\n".join(shlex.quote(arg) for arg in main_ppo_args(args.work_dir, args.estimator, steps=args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

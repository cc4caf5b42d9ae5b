"""The arithmetic recipe end to end, stage by stage, each stage resuming from its outputs.

    python -m verl_prm.apps.arithmetic --scale cpu --work-dir runs/arithmetic_cpu

Stages (``--stages``, default all, in this order), each writing under ``--work-dir``:

==========  ===========================================================================================
data        ``data/``: verl parquet rows (``rl_train``, ``test``; the label stage adds its prompts) and the SFT solutions
            (``sft.jsonl``, with slips)
sft         ``policy/``: a tiny Qwen2 causal LM trained from scratch (HF format, safetensors, tokenizer)
prover      ``prover/``: the SFT policy measured on the label prompts: success, groups with no outcome signal and
            its per-step accuracy p, the exact prover's parameter (:mod:`.prover`)
label       ``labels/``: Monte-Carlo values of step prefixes by ``verl_prm.labeling`` (what ``verl-prm label``
            runs; the prover is the policy, raw success counts kept so that the Best-of-K prover's values follow)
pav         ``pav/``: the learned PAV. With ``Scale.critic_init`` (the CPU and GPU scales): the policy is first
            taught to check each written result on the SFT solutions (``pav/backbone/``, :mod:`.critic_init`),
            then ``verl_prm.training`` (what ``verl-prm train --freeze-backbone`` runs) fits a value head on it to
            the Monte-Carlo labels; without it, the whole policy is fine-tuned with a value head (the PAV paper's
            choice)
pav_refined ``pav_refined/``: with ``Scale.critic_refine`` and an arm that reads it (``pav_learned_refined``): the
            ``pav`` stage's backbone trained on at its check (``critic_refine``: heads drawn again, a fresh
            warm-up; ``pav_refined/backbone/``), then a value head on it on the same labels, fitted to its optimum
            (``Scale.refined_head_fit``: ``verl-prm train --head-fit newton``)
rl          ``rl/<arm>_seed<seed>/``: every arm (GRPO, PAV-GRPO with the exact prover, PAV-GRPO with the learned
            PAV) with every seed through ``python -m verl.trainer.main_ppo`` (:mod:`.verl_rl`), the same prompts,
            seeds and budget; on CPU with the plugin's CPU platform, on GPU with vLLM
evaluate    ``results/``: ``results.md``, ``results.json`` and the plots
==========  ===========================================================================================

The command of a verl run is built by ``verl_rl.main_ppo_command`` for the scale's device, so the CPU run and
the GPU run (``examples/arithmetic/run_gpu.sh``: ``--scale gpu``) differ only in scale and device settings.

At a GPU scale the stages that hold the GPU (``sft``, ``label``, ``pav``, ``evaluate``) each run in a process of
their own (:func:`stage_process_command`: this module with ``--scale-file``, the scale written to
``WORK_DIR/scale.json``, and ``--in-process``), so that a stage's exit frees all the GPU memory it held (the
label stage's vLLM engine takes ``Scale.label_gpu_memory_utilization`` of it) before the next stage, and verl's
own vLLM in the rl stage, starts; the recipe's process itself never touches the GPU.

A stage is skipped when its ``DONE.json`` marker exists and records the same settings; a marker with other
settings is an error (use another work directory). The labeling, the PAV training and the RL loop also resume
inside a stage that was interrupted.

Reproducibility. The numbers are a function of the settings, the package versions and the machine's float
kernels: the recipe runs torch on a fixed number of threads (``Scale.threads``, 1 by default, part of every
stage's settings; ``--threads`` overrides it), seeds Python's, numpy's and torch's generators at the start of
every stage (a stage gives the same outputs whether it runs after the others in one process or alone in a
resumed run), and every ``DONE.json`` and ``results.json`` records the environment (:func:`environment`:
python, torch, transformers, tokenizers, numpy, verl, ... versions, torch threads, CPU). Skipping a stage
that was made under another environment is logged with the differences.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from verl_prm.apps.arithmetic.critic_init import CriticInitConfig, critic_init_from_sft
from verl_prm.apps.arithmetic.machine import cpu_info, gpu_names
from verl_prm.apps.arithmetic.model import ModelConfig, SFTConfig
from verl_prm.apps.arithmetic.task import STEP_REGEX, TaskConfig
from verl_prm.apps.arithmetic.verl_rl import ARMS, CRITIC_STAGES, LEARNED_ARMS, SCORE_FILE, RLConfig, device_overrides
from verl_prm.resume import check_same_settings, jsonable, read_settings, write_settings
from verl_prm.settings import check_bounds, setting

__all__ = ["Scale", "SCALES", "STAGES", "environment", "run", "main", "scale_from_json", "seed_everything",
           "split_problems", "stage_process_command", "stages_in_own_process"]

DATA_SOURCE_NAME = "arithmetic_mod"
STAGES = ("data", "sft", "prover", "label", "pav", "pav_refined", "rl", "evaluate")
# The stages that hold a GPU (the rl stage's main_ppo runs are processes of their own already): at a GPU scale
# each runs in a process of its own, whose exit frees all it held (a vLLM engine has no shutdown) for the next.
GPU_STAGES = ("sft", "label", "pav", "pav_refined", "evaluate")
LABEL_SHARD_SIZE = 64  # prompts per label shard (verl-prm label's default)
MIN_EVAL_SAMPLES = 4  # samples per test prompt at every evaluation (verl's validation and the final policies)


# the Scale fields that `verl-prm recipe arithmetic` takes as flags (--<name with dashes>)
FLAG_FIELDS = ("label_problems", "n_mc", "pav_steps", "threads", "rl_parallel")


def scale_key(name: str) -> str:
    """How an error names Scale setting ``name``: the name, and its flag when it has one."""
    return f"{name} (--{name.replace('_', '-')})" if name in FLAG_FIELDS else name


@dataclass(frozen=True)
class Scale:
    """Every setting of one run of the recipe."""

    task: TaskConfig = field(default_factory=TaskConfig)
    # The RL, label and test problems have exactly this many operations (None: the task's range, as the SFT
    # data). SFT on a range of lengths, RL on long problems: the SFT policy learns the arithmetic on the short
    # ones and rarely solves the long ones, where outcome-only RL has few groups with a signal.
    rl_num_ops: Optional[int] = setting(None, "Operations of every RL, label and test problem (None: the task's "
                                        "range).", low=1)
    sft_problems: int = setting(20000, "SFT problems.", low=1)
    rl_problems: int = setting(2000, "RL training problems.", low=1)
    label_problems: int = setting(384, "Problems the label stage labels.", low=1)
    test_problems: int = setting(256, "Held-out test problems.", low=1)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    # verl-prm label
    n_cov: int = setting(4, "Rollouts per label problem.", low=1)
    n_mc: int = setting(2, "Prover continuations per step prefix.", low=1)
    label_backend: str = "hf"
    label_batch_size: int = setting(1024, "Prompts per label generation batch.", low=1)
    # vllm back end: the share of the GPU's memory its engine may take (the label stage's process has the GPU to
    # itself and frees it at its end; the KV cache of the GPU scale's batches needs far less than half an H100)
    label_gpu_memory_utilization: float = setting(0.85, "The vllm label engine's share of the GPU's memory.",
                                                  low=0.0, high=1.0, low_open=True)
    # the learned PAV's backbone: None = the SFT policy, fine-tuned whole by verl-prm train (the PAV paper's
    # choice; on the CPU scale its value ranks prefixes at chance, docs/arithmetic.md); a CriticInitConfig = the
    # policy first taught to check each written result (critic_init with check_weight > 0), then only the value
    # head is trained on the Monte-Carlo labels (--freeze-backbone), at pav_lr
    critic_init: Optional[CriticInitConfig] = None
    # the pav_refined stage: critic_init's backbone trained on (its check had not converged in critic_init's
    # schedule: on an AVX512 machine its held-out AUROC was 0.915 after 3,000 steps, and the value head's size is
    # bounded by the check's quality, docs/arithmetic.md); None = no such stage
    critic_refine: Optional[CriticInitConfig] = None
    # how the pav_refined stage fits its value head (verl-prm train --head-fit): "newton", the optimum of the head's
    # loss on the frozen features (500 sampled Adam steps stopped short of it on the refined features: a converged
    # head's values had 1.5x the size, docs/arithmetic.md), or "adam" as the pav stage
    refined_head_fit: str = "newton"
    # verl-prm train
    pav_steps: int = setting(500, "PAV training steps.", low=1)
    pav_batch_size: int = setting(32, "PAV training batch size.", low=1)
    pav_lr: float = setting(2e-4, "PAV learning rate.", low=0.0, low_open=True)
    pav_warmup: int = setting(10, "PAV warm-up steps.", low=0)
    # verl-prm train --calibration: the post-hoc map fitted on the held-out labels and stored in the checkpoint
    # (the pav_learned_calibrated arm applies it, pav_learned reads the raw values); "none" at the test scales,
    # whose few held-out labels cannot fit one
    pav_calibration: str = "platt"
    # RL through verl's main_ppo: every arm (verl_rl.ARMS) with every seed, the same settings otherwise
    rl: RLConfig = field(default_factory=RLConfig)
    rl_arms: tuple[str, ...] = ("grpo", "pav_exact", "pav_learned", "pav_learned_calibrated", "pav_mc")
    rl_seeds: tuple[int, ...] = (0, 1, 2)
    # main_ppo processes at once (a CPU run spends ~40% of a step waiting on verl's replay-buffer poll)
    rl_parallel: int = setting(2, "main_ppo processes at once.", low=1)
    # evaluation: samples per test prompt of the final policies (rl.eval_samples: of verl's validation during RL)
    eval_samples: int = 4
    search_problems: int = setting(64, "Test problems of the search comparison.", low=1)
    best_of_n: tuple[int, ...] = (1, 2, 4, 8)
    beam_widths: tuple[int, ...] = (1, 2, 4)
    samples_per_beam: int = setting(2, "Continuations sampled per beam.", low=1)
    search_alpha: float = 0.5
    # the statistics of the RL curves (evaluate.summarise_arms): sample efficiency at the level L, GRPO's
    # seed-mean held-out accuracy at level_fraction of the RL budget; standard errors from bootstrap_resamples
    # resamples of the seeds, drawn from bootstrap_seed
    level_fraction: float = setting(2 / 3, "The level L of sample efficiency, as a fraction of the RL budget.",
                                    low=0.0, high=1.0, low_open=True)
    bootstrap_resamples: int = setting(2000, "Bootstrap resamples of the seeds.", low=2)
    bootstrap_seed: int = setting(0, "Seed of the bootstrap.", low=0)
    device: str = "cpu"
    # torch intra-op threads for every stage: how a float reduction is split may depend on it, so it is a
    # setting, not the machine's core count (1: no split, and the fastest on a shared machine, where a second
    # thread waits for a core)
    threads: int = setting(1, "Torch intra-op threads of every stage.", low=1)

    @property
    def trainer_device(self) -> str:
        """verl's ``trainer.device`` for this scale's RL runs: ``cpu`` (the plugin's CPU platform) or ``cuda``
        (``device`` may name a GPU, ``cuda:1``; verl places its workers itself)."""
        return "cpu" if self.device == "cpu" else "cuda"

    def __post_init__(self) -> None:
        # every count an integer within its bounds, every bounded float finite within them: a bad flag
        # (--n-mc 0, --label-problems -4, --pav-steps -2) is an error here, before the data stage starts
        check_bounds(self, scale_key)
        unknown = [arm for arm in self.rl_arms if arm not in ARMS]
        if unknown or not self.rl_arms:
            raise ValueError(f"rl_arms must name arms of {tuple(ARMS)}, got {self.rl_arms}")
        if not self.rl_seeds or len(set(self.rl_seeds)) != len(self.rl_seeds):
            raise ValueError(f"rl_seeds must be distinct seeds, got {self.rl_seeds}")
        if self.critic_refine is not None and (self.critic_init is None or not self.critic_refine.check_weight > 0):
            raise ValueError("critic_refine trains critic_init's backbone on at its check: it needs critic_init and "
                             "check_weight > 0")
        refined = [arm for arm in self.rl_arms if ARMS[arm].critic == "refined"]
        if refined and self.critic_refine is None:
            raise ValueError(f"rl_arms {refined} read the pav_refined stage's PAV, which needs critic_refine; this "
                             "scale has none (drop the arm, or use the cpu scale)")
        if self.critic_init is not None and not self.critic_init.check_weight > 0:
            raise ValueError("critic_init needs check_weight > 0: only the value head is trained on it, so the backbone "
                             "must have been taught the check (with check_weight 0 it only recomputes results, and a "
                             "linear value head reads no check from that; docs/arithmetic.md)")
        from verl_prm.choices import CALIBRATION_METHODS, HEAD_FITS

        if self.refined_head_fit not in HEAD_FITS:
            raise ValueError(f"refined_head_fit must be one of {', '.join(HEAD_FITS)}, got {self.refined_head_fit!r}")

        if self.pav_calibration not in CALIBRATION_METHODS:
            raise ValueError(f"pav_calibration must be one of {', '.join(CALIBRATION_METHODS)}, got {self.pav_calibration!r}")
        if not np.isfinite(self.search_alpha):
            raise ValueError(f"search_alpha must be finite, got {self.search_alpha!r}")
        # one sample per prompt gives each evaluation point a standard error of ~0.025 at 256 prompts, as large as
        # the differences the curves are read for
        for name, value in (("eval_samples", self.eval_samples), ("rl.eval_samples", self.rl.eval_samples)):
            if value < MIN_EVAL_SAMPLES:
                raise ValueError(f"{name} must be >= {MIN_EVAL_SAMPLES} samples per test prompt, got {value}")

    @property
    def max_new_tokens(self) -> int:
        """The longest reference solution (every number with the most digits) plus slack for one EOS and a
        few wrong tokens."""
        from verl_prm.apps.arithmetic.task import solution_lines

        top = self.task.modulus - 1
        worst = self._longest_problem()
        longest = sum(len(line.replace(str(worst.values[h] if h < len(worst.values) else top), str(top))) + 1
                      for h, line in enumerate(solution_lines(worst)))
        return longest + len(str(top)) * self.rl_task.max_ops + 8

    @property
    def rl_task(self) -> TaskConfig:
        """The task of the RL, label and test problems: ``task`` with ``rl_num_ops`` operations."""
        if self.rl_num_ops is None:
            return self.task
        return replace(self.task, min_ops=self.rl_num_ops, max_ops=self.rl_num_ops)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest rendered prompt (per-character tokenizer: its length in characters) plus slack."""
        from verl_prm.apps.arithmetic.model import build_tokenizer, render

        return len(render(build_tokenizer(), self._longest_problem().prompt_text)) + 8

    def _longest_problem(self):
        """An RL problem with the most operations and the widest numbers (every value and operand at its largest)."""
        from verl_prm.apps.arithmetic.task import Problem

        top = self.task.modulus - 1
        return Problem(top, tuple((self.task.ops[0], self.task.max_operand) for _ in range(self.rl_task.max_ops)),
                       self.task.modulus)


SCALES: dict[str, Scale] = {
    # The default CPU recipe: ~0.9 M parameters, a few minutes per stage on 2 cores. Three operations mod 7
    # with single-digit operands: the smallest setting that a model this size learns in ~1000 SFT steps.
    "cpu": Scale(
        task=TaskConfig(min_ops=3, max_ops=6, modulus=7, max_operand=6, slip_rate=0.0, step_slip_rate=0.25),
        rl_num_ops=6,
        sft=SFTConfig(steps=2200, batch_size=32, lr=2e-3, warmup_steps=20, curriculum_steps=1200),
        critic_init=CriticInitConfig(check_weight=1.0), pav_lr=1e-3,
        critic_refine=CriticInitConfig(steps=2000, lr=5e-4, warmup_steps=50, check_weight=1.0),
        rl_arms=("grpo", "pav_exact", "pav_learned", "pav_learned_refined", "pav_mc"),
        rl=RLConfig(steps=30, prompts_per_step=16, group_size=8, lr=5e-5, eval_every=5, eval_samples=4),
    ),
    # The test suite's micro run: every stage for real, a few optimisation steps each.
    "micro": Scale(
        task=TaskConfig(min_ops=1, max_ops=2, modulus=7, max_operand=6),
        sft_problems=200, rl_problems=20, label_problems=3, test_problems=6,
        model=ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, max_position_embeddings=160),
        sft=SFTConfig(steps=4, batch_size=8, warmup_steps=1),
        n_cov=1, n_mc=2, label_batch_size=16, pav_steps=2, pav_batch_size=4, pav_warmup=1, pav_calibration="none",
        rl=RLConfig(steps=2, prompts_per_step=2, group_size=2, eval_every=1, eval_samples=4),
        rl_arms=("pav_exact",), rl_seeds=(0,), rl_parallel=1,
        eval_samples=4, search_problems=2, best_of_n=(1, 2), beam_widths=(1,), samples_per_beam=2,
    ),
    # The test suite's pinned run (tests/apps/test_arithmetic.py asserts its numbers): one operation mod 5, a
    # model that starts to learn in 150 SFT steps, so that the labels, the critic and RL see both outcomes.
    "tiny": Scale(
        task=TaskConfig(min_ops=1, max_ops=1, modulus=5, max_operand=4, slip_rate=0.3),
        sft_problems=40, rl_problems=8, label_problems=4, test_problems=12,
        model=ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, max_position_embeddings=64),
        sft=SFTConfig(steps=150, batch_size=16, lr=1e-2, warmup_steps=5),
        n_cov=2, n_mc=2, label_batch_size=16, pav_steps=2, pav_batch_size=4, pav_warmup=1, pav_calibration="none",
        rl=RLConfig(steps=2, prompts_per_step=4, group_size=4, lr=1e-3, eval_every=1, eval_samples=4),
        eval_samples=4, search_problems=4, best_of_n=(1, 2), beam_widths=(1,), samples_per_beam=2,
    ),
    # One H100/H200: a ~25 M parameter model on a harder task (examples/arithmetic/run_gpu.sh).
    "gpu": Scale(
        task=TaskConfig(min_ops=3, max_ops=8, modulus=97, max_operand=96, slip_rate=0.0, step_slip_rate=0.2),
        rl_num_ops=8,
        sft_problems=400_000, rl_problems=20_000, label_problems=2000, test_problems=1024,
        model=ModelConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=8, max_position_embeddings=512),
        sft=SFTConfig(steps=6000, batch_size=256, lr=1e-3, warmup_steps=200, curriculum_steps=2000),
        n_cov=4, n_mc=16, label_backend="vllm", label_batch_size=1024, label_gpu_memory_utilization=0.5,
        critic_init=CriticInitConfig(steps=6000, batch_size=64, check_weight=1.0),
        pav_steps=2000, pav_batch_size=64, pav_lr=1e-3, pav_warmup=100,
        rl=RLConfig(steps=200, prompts_per_step=128, group_size=8, lr=1e-5, eval_every=10, eval_samples=4),
        eval_samples=4, search_problems=512, best_of_n=(1, 2, 4, 8, 16, 32), beam_widths=(1, 2, 4, 8),
        samples_per_beam=3, device="cuda", rl_parallel=1,
    ),
}


ENVIRONMENT_PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "verl", "verl-prm", "accelerate",
                        "safetensors", "pandas", "pyarrow")


def environment() -> dict:
    """What the recipe's numbers depend on besides its settings: package versions, torch's thread count and
    float-kernel back ends, the Python build and the machine (CPU model, logical CPUs and those this process
    may use, the AVX flags, GPUs)."""
    import os
    from importlib import metadata

    import torch

    versions = {}
    for name in ENVIRONMENT_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        cpu = cpu_info(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {"cpu": None, "logical_cpus": os.cpu_count(), "cpu_flags": []}
    if cpu["cpu"] is None:
        cpu["cpu"] = platform.processor() or platform.machine()
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"python": platform.python_version(), "packages": versions, "torch_threads": torch.get_num_threads(),
            "torch_mkldnn": bool(torch.backends.mkldnn.is_available()),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            **cpu, "cpus_available": available, "gpus": gpu_names(), "system": platform.system()}


def environment_differences(recorded: dict | None, current: dict) -> list[str]:
    """``key: recorded -> current`` for every entry (packages one by one) that differs."""
    if not recorded:
        return ["no environment recorded"]
    out = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += [f"{key}.{name}: {old.get(name)} -> {new.get(name)}" for name in sorted(set(old) | set(new))
                    if old.get(name) != new.get(name)]
        elif old != new:
            out.append(f"{key}: {old} -> {new}")
    return out


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (a stage then does not depend on what ran before
    it in the process)."""
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stage_seed(name: str) -> int:
    """A fixed seed per stage name (crc32: the same in every Python process, unlike ``hash``)."""
    return zlib.crc32(f"arithmetic-stage-{name}".encode())


class Stage:
    """A stage directory with a completion marker that records the stage's settings."""

    def __init__(self, root: Path, name: str, settings: dict, parts: Sequence["Stage"] = ()) -> None:
        self.path = root / name
        self.marker = self.path / "DONE.json"
        self.settings = jsonable(settings)
        # sub-stages with their own markers (the rl stage's runs): the stage is complete when every part is, so
        # a finished stage asked for more parts (another arm or seed) runs only the new ones
        self.parts = tuple(parts)

    def done(self) -> bool:
        if not self.marker.exists() or not all(part.done() for part in self.parts):
            return False
        fix = f"use another --work-dir or delete {self.path}"
        recorded = read_settings(self.marker, fix=fix, field="settings")
        check_same_settings(recorded, self.settings, source=self.path, what="a completed stage", fix=fix)
        return True

    def finish(self, outputs: dict, seconds: float, env: dict | None = None) -> dict:
        record = {"settings": self.settings, "outputs": jsonable(outputs), "seconds": round(seconds, 1),
                  "environment": env if env is not None else environment()}
        tmp = self.marker.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(self.marker)
        return record

    def outputs(self) -> dict:
        return json.loads(self.marker.read_text())["outputs"]


# ------------------------------------------------------------------------------------------------- stages


def split_problems(scale: Scale):
    """(sft, rl, label, test) problems; test prompts appear in no other split."""
    from verl_prm.apps.arithmetic.task import generate_problems

    test = generate_problems(scale.test_problems, scale.rl_task, seed=1)
    held = [p.prompt_text for p in test]
    rl = generate_problems(scale.rl_problems, scale.rl_task, seed=2, exclude=held)
    sft = generate_problems(scale.sft_problems, scale.task, seed=3, exclude=held)
    label = generate_problems(scale.label_problems, scale.rl_task, seed=4, exclude=held)
    return sft, rl, label, test


def stage_data(stage: Stage, scale: Scale) -> dict:
    import pandas as pd

    from verl_prm.apps.arithmetic.task import sft_example, verl_row

    sft, rl, label, test = split_problems(scale)
    stage.path.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, problems in (("rl_train", rl), ("test", test)):
        path = stage.path / f"{name}.parquet"
        pd.DataFrame([verl_row(p, name, i) for i, p in enumerate(problems)]).to_parquet(path)
        files[name] = str(path)
    rng = random.Random(f"sft-solutions-{scale.sft.seed}")
    slips = 0
    with open(stage.path / "sft.jsonl", "w") as f:
        for p in sft:
            text, slip = sft_example(p, rng, scale.task.slip_rate, scale.task.step_slip_rate)
            slips += slip >= 0
            f.write(json.dumps({"prompt": p.prompt_text, "response": text, "slip_step": slip}) + "\n")
    files["sft"] = str(stage.path / "sft.jsonl")
    return {"files": files, "sft_solutions": len(sft), "sft_slip_share": slips / max(len(sft), 1)}


def stage_sft(stage: Stage, scale: Scale, data_dir: Path, progress: bool) -> dict:
    import torch

    from verl_prm.apps.arithmetic.model import build_model, build_tokenizer, encode_sft, save_policy, train_sft

    rows = [json.loads(line) for line in open(data_dir / "sft.jsonl")]
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, scale.model, seed=scale.sft.seed).to(scale.device)
    examples = encode_sft(tokenizer, [r["prompt"] for r in rows], [r["response"] for r in rows])
    stage.path.mkdir(parents=True, exist_ok=True)
    log_path = stage.path / "sft_metrics.jsonl"
    log_path.write_text("")

    def log(record: dict) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    # the curriculum's short problems: the task's fewest operations (a prompt holds one space per operation
    # before "mod")
    short = [i for i, r in enumerate(rows) if r["prompt"].split(" mod ")[0].count(" ") == scale.task.min_ops]
    losses = train_sft(model, examples, scale.sft, tokenizer.pad_token_id, progress=progress, log=log,
                       device=torch.device(scale.device), short=short)
    save_policy(model.to("cpu"), tokenizer, stage.path)
    return {"parameters": sum(p.numel() for p in model.parameters()), "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "path": str(stage.path)}


def stage_label(stage: Stage, scale: Scale, data_dir: Path, policy: Path, progress: bool) -> dict:
    """Monte-Carlo step labels of the label problems (``verl_prm.labeling``, as ``verl-prm label`` makes them):
    the prover is the policy, raw success counts kept; a step ends after each result (``task.STEP_REGEX``)."""
    import pandas as pd

    from verl_prm.labeling.format import read_labels
    from verl_prm.apps.arithmetic.task import verl_row

    _, _, label, _ = split_problems(scale)
    prompts = stage.path.parent / "data" / f"label_{scale.label_problems}.parquet"
    if not prompts.exists():
        pd.DataFrame([verl_row(p, "label", i) for i, p in enumerate(label)]).to_parquet(prompts)
    summary = label_prompts(prompts, policy, stage.path, scale, progress)
    frame = read_labels(stage.path)
    q = [v for values in frame["q"] for v in values]
    return {"settings": summary["settings"], "rollouts": len(frame), "labelled_steps": len(q),
            "seed_accuracy": float(frame["outcome"].mean()),
            "labelled_share": float(np.mean([v == v for v in q])) if q else 0.0}


def label_prompts(prompts: Path, policy: Path, output: Path, scale: Scale, progress: bool) -> dict:
    """``verl_prm.labeling.runner.run_labeling`` of ``prompts`` into ``output`` with the scale's settings (its
    back end, ``n_cov`` seed rollouts, ``n_mc`` continuations at every step); resumes from the shards there.
    Returns the runner's summary and the settings (what the store records)."""
    import functools

    from transformers import AutoTokenizer

    from verl_prm.labeling.cli import build_generator
    from verl_prm.labeling.inputs import read_prompts, render_prompt
    from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
    from verl_prm.labeling.runner import run_labeling
    from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function
    from verl_prm.labeling.store import ShardStore

    settings = LabelSettings(n_cov=scale.n_cov, n_mc=scale.n_mc, prefix_rule="every", step_regex=STEP_REGEX, seed=0,
                             source=str(policy))
    items = read_prompts(str(prompts))
    scorer = OutcomeScorer(load_reward_function(f"{SCORE_FILE}:compute_score"))
    record = {"input": str(prompts), "policy": str(policy), "backend": scale.label_backend,
              "max_new_tokens": scale.max_new_tokens, "temperature": 1.0, **asdict(settings)}
    store = ShardStore(output)
    store.check_config(record)
    engine_settings = dict(max_new_tokens=scale.max_new_tokens, temperature=1.0, top_p=1.0,
                           batch_size=scale.label_batch_size)
    if scale.label_backend == "hf":
        engine_settings.update(device=scale.device, dtype="float32")
    else:
        engine_settings.update(gpu_memory_utilization=scale.label_gpu_memory_utilization)
    engine = build_generator(scale.label_backend, str(policy), **engine_settings)
    labeler = MonteCarloLabeler(engine, engine, scorer, settings)
    tokenizer = AutoTokenizer.from_pretrained(str(policy), trust_remote_code=False)
    summary = run_labeling(items, functools.partial(render_prompt, tokenizer=tokenizer), labeler, store,
                           shard_size=LABEL_SHARD_SIZE, progress=progress)
    return {**summary, "settings": record}


def train_pav(labels: Path, init: Path, output: Path, *, steps: int, batch_size: int, lr: float, warmup_steps: int,
              max_length: int, log_every: int, cpu: bool, freeze_backbone: bool = False, calibration: str = "none",
              head_fit: str = "adam", head_l2: float = 0.0, progress: bool = True) -> dict:
    """``verl_prm.training.trainer.train`` (what ``verl-prm train`` runs) of a value-head PAV on ``labels``: 20% of
    the prompts held out, the Monte-Carlo values themselves (Best-of-1), seed 0, the post-hoc ``calibration``
    fitted on the held-out labels (``--calibration``), the head fitted by ``head_fit`` (``--head-fit``, with the
    ridge penalty ``head_l2``: ``--head-l2``); resumes from
    ``output``. Returns the training settings
    (``TrainConfig`` as a dict)."""
    from verl_prm.training.config import TrainConfig
    from verl_prm.training.trainer import train

    config = TrainConfig(labels=[str(labels)], output_dir=str(output), init=str(init), eval_fraction=0.2,
                         max_length=max_length, batch_size=batch_size, max_steps=steps, lr=lr,
                         warmup_steps=warmup_steps, best_of_k=1, freeze_backbone=freeze_backbone, head_fit=head_fit, seed=0, cpu=cpu,
                         log_every=log_every, progress=progress, calibration=calibration, head_l2=head_l2)
    train(config)
    return {k: v for k, v in asdict(config).items() if k != "progress"}


def stage_pav(stage: Stage, scale: Scale, labels: Path, policy: Path, data_dir: Path, progress: bool, log,
              critic_init: CriticInitConfig | None = None, head_fit: str = "adam") -> dict:
    """The learned PAV: with ``critic_init`` (default ``scale.critic_init``), the backbone at ``policy`` first
    taught the check (``stage/backbone``), then a value head fitted on it (``head_fit``: ``--head-fit``); else the
    whole ``policy`` fine-tuned."""
    from verl_prm.training.resume import latest_checkpoint

    critic_init = critic_init or scale.critic_init
    init, outputs = policy, {}
    if critic_init is not None:
        init = stage.path / "backbone"
        outputs["critic_init"] = critic_init_from_sft(init, policy, data_dir, scale.task.modulus, critic_init,
                                                      device=scale.device, progress=progress,
                                                      log=lambda line: log(f"[arithmetic] {stage.path.name}: {line}"))
    outputs["training"] = train_pav(
        labels, init, stage.path, steps=scale.pav_steps, batch_size=scale.pav_batch_size, lr=scale.pav_lr,
        warmup_steps=scale.pav_warmup, max_length=scale.model.max_position_embeddings, log_every=10,
        cpu=scale.device == "cpu", freeze_backbone=critic_init is not None, calibration=scale.pav_calibration,
        head_fit=head_fit, progress=progress)
    metrics = json.loads((stage.path / "eval_metrics.json").read_text())
    return {"checkpoint": str(latest_checkpoint(stage.path)), "eval_metrics": metrics, **outputs}


def stage_prover(stage: Stage, scale: Scale, policy: Path) -> dict:
    """The SFT policy measured on the label problems (none is a test problem): success, groups without an outcome
    signal, and its per-step accuracy, which becomes the exact prover's p (``prover.ArithmeticProver``).

    p is at least 1 / modulus, a uniform guess among the residues: the scripted prover of an untrained policy
    (the test suite's micro scale, or a step accuracy that no prefix reached) still has values in (0, 1]. Both
    the measured accuracy and the p used are recorded."""
    from verl_prm.apps.arithmetic.measure import measure_policy

    _, _, label, _ = split_problems(scale)
    stage.path.mkdir(parents=True, exist_ok=True)
    measured = measure_policy(policy, label, group_size=max(2, scale.rl.group_size),
                              max_new_tokens=scale.max_new_tokens, seed=stage_seed("prover"))
    measured["measured_step_accuracy"] = measured["step_accuracy"]
    chance = 1.0 / scale.task.modulus
    if not measured["step_accuracy"] >= chance:  # also NaN: no step was reached with a right prefix
        measured["step_accuracy"] = chance
    return measured


def rl_run_stages(scale: Scale, root: Path, settings: dict) -> dict[tuple[str, int], Stage]:
    """The sub-stage (directory ``rl/<arm>_seed<seed>`` and settings) of every RL run."""
    out = {}
    # seed by seed, every arm of a seed together: an interrupted stage leaves complete comparisons
    for seed in scale.rl_seeds:
        for arm in scale.rl_arms:
            critic = settings[CRITIC_STAGES[ARMS[arm].critic]] if arm in LEARNED_ARMS else settings["prover"]
            out[(arm, seed)] = Stage(root / "rl", f"{arm}_seed{seed}", {
                "policy": settings["policy"], "critic": critic, "rl": scale.rl, "arm": arm, "seed": seed,
                # what the arm runs (its estimator, critic and overrides): a changed arm is a changed run
                "arm_settings": ARMS[arm],
                "max_new_tokens": scale.max_new_tokens, "device": scale.device,
                # the device's main_ppo settings (the CPU platform's fp32 FSDP, ...): they change the numbers
                "device_overrides": device_overrides(scale, scale.trainer_device)})
    return out


def stage_rl(stage: Stage, scale: Scale, data_dir: Path, policy: Path, learned_critics: dict[str, str],
             step_accuracy: float, log) -> dict:
    """Every arm x seed through ``python -m verl.trainer.main_ppo`` (``verl_rl``), ``scale.rl_parallel`` at once;
    a finished run is recorded in its own ``DONE.json``, so an interrupted stage resumes with the rest."""
    from verl_prm.apps.arithmetic.verl_rl import RunPaths, read_run, run_arms

    runs = {(part.settings["arm"], part.settings["seed"]): part for part in stage.parts}
    paths = RunPaths(policy=policy.resolve(), train_file=(data_dir / "rl_train.parquet").resolve(),
                     val_file=(data_dir / "test.parquet").resolve(),
                     learned_critics={kind: Path(path).resolve() for kind, path in learned_critics.items()},
                     step_accuracy=float(step_accuracy))
    todo = []
    for (arm, seed), run_stage in runs.items():
        if run_stage.done():
            log(f"[arithmetic] rl {arm} seed {seed}: complete, skipped ({run_stage.path})")
            continue
        # an interrupted run resumes from its verl checkpoints only under the same settings
        started = run_stage.path / "SETTINGS.json"
        fix = f"delete {run_stage.path} or use another --work-dir"
        recorded = read_settings(started, fix=fix)
        if recorded is not None:
            check_same_settings(recorded, run_stage.settings, source=run_stage.path, what="an interrupted run",
                                fix=fix)
        run_stage.path.mkdir(parents=True, exist_ok=True)
        write_settings(started, run_stage.settings)
        todo.append((arm, seed, run_stage.path.resolve()))

    def finished(arm: str, seed: int, run_dir: Path, seconds: float) -> None:
        outputs = {**read_run(run_dir, scale), "final_policy": str(run_dir / "final"), "run_dir": str(run_dir)}
        runs[(arm, seed)].finish(outputs, seconds)
        log(f"[arithmetic] rl {arm} seed {seed}: done in {seconds:.0f} s, held-out accuracy "
            f"{outputs['curve'][0][2]:.3f} -> {outputs['curve'][-1][2]:.3f}")

    run_arms(scale, todo, paths, parallel=scale.rl_parallel, log=log, on_done=finished)
    return {f"{arm}_seed{seed}": run_stage.outputs() for (arm, seed), run_stage in runs.items()}


def search_with_critics(scale: Scale, model, tokenizer, critics: dict, step_accuracy: float, *,
                        seed: int = 12345) -> dict[str, list[dict]]:
    """The test-time search sweep (``evaluate.search_sweep``: Best-of-N and PAV beam search with the base policy
    ``model``) on the first ``scale.search_problems`` test problems, with each of ``critics`` (``{name:
    ProverCritic}``) and with the exact prover of ``step_accuracy`` (``"exact"``); the same seed for every critic."""
    from verl_prm.apps.arithmetic import evaluate as ev
    from verl_prm.apps.arithmetic.model import render
    from verl_prm.apps.arithmetic.prover import ArithmeticProver

    search_set = split_problems(scale)[3][: scale.search_problems]
    texts = [render(tokenizer, p.prompt_text) for p in search_set]
    prefix_critics = {name: ev.learned_prefix_critic(critic, texts) for name, critic in critics.items()}
    prefix_critics["exact"] = ev.exact_prefix_critic(ArithmeticProver(step_accuracy=step_accuracy), texts)
    return {name: ev.search_sweep(model, tokenizer, prefix_critic, texts, search_set, best_of_n=scale.best_of_n,
                                  beam_widths=scale.beam_widths, samples_per_beam=scale.samples_per_beam,
                                  alpha=scale.search_alpha, best_of_k=scale.rl.best_of_k,
                                  max_new_tokens=scale.max_new_tokens, max_steps=scale.rl_task.max_ops + 2, seed=seed)
            for name, prefix_critic in prefix_critics.items()}


def stage_evaluate(stage: Stage, scale: Scale, policy: Path, critic: str, pav_metrics: dict, prover: dict,
                   rl_runs: dict, refined: dict | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.critic import ProverCritic
    from verl_prm.apps.arithmetic import evaluate as ev
    from verl_prm.apps.arithmetic.model import render

    sft, rl, label, test = split_problems(scale)
    stage.path.mkdir(parents=True, exist_ok=True)

    def texts_of(tokenizer, problems=test):
        return [render(tokenizer, p.prompt_text) for p in problems]

    seed = 12345
    policies = {"base": ev.policy_accuracy(policy, texts_of, test, samples=scale.eval_samples,
                                           max_new_tokens=scale.max_new_tokens, seed=seed, device=scale.device)}
    runs: dict = {}
    for name, outputs in sorted(rl_runs.items()):
        arm, _, seed_text = name.rpartition("_seed")
        final = ev.policy_accuracy(outputs["final_policy"], texts_of, test, samples=scale.eval_samples,
                                   max_new_tokens=scale.max_new_tokens, seed=seed, device=scale.device)
        runs.setdefault(arm, {})[int(seed_text)] = {**outputs, "final": final}
    tokenizer = AutoTokenizer.from_pretrained(str(policy), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(policy), trust_remote_code=False).to(scale.device).eval()
    # the learned PAV's raw values (as the pav_learned arm reads them) and, when the checkpoint has one, with its
    # calibration (the pav_learned_calibrated arm): the step AUROC is the same (a monotone map), the sizes are not
    critic_models = {"learned": ProverCritic.from_pretrained(critic, format="value_head", device=scale.device,
                                                             calibration="none")}
    calibrated = ProverCritic.from_pretrained(critic, format="value_head", device=scale.device)
    if calibrated.calibration is not None:
        critic_models["learned_calibrated"] = calibrated
    critic_result = ev.critic_step_auroc(critic_models["learned"], tokenizer, model, texts_of(tokenizer), test,
                                         samples=1, max_new_tokens=scale.max_new_tokens, seed=seed + 1)
    critic_result["label_auroc"] = float(pav_metrics.get("eval/auroc", float("nan")))
    critic_result["label_mse"] = float(pav_metrics.get("eval/mse", float("nan")))
    if "learned_calibrated" in critic_models:
        calibrated_result = ev.critic_step_auroc(calibrated, tokenizer, model, texts_of(tokenizer), test, samples=1,
                                                 max_new_tokens=scale.max_new_tokens, seed=seed + 1)
        critic_result["calibration"] = calibrated.calibration.describe()
        critic_result["calibrated_mean_value_drop_at_first_wrong_step"] = \
            calibrated_result["mean_value_drop_at_first_wrong_step"]
        critic_result["calibrated_label_mse"] = float(pav_metrics.get("eval/calibrated_mse", float("nan")))
    if refined is not None:
        # the pav_refined stage's PAV, raw values (as the pav_learned_refined arm reads them)
        critic_models["learned_refined"] = ProverCritic.from_pretrained(
            refined["checkpoint"], format="value_head", device=scale.device, calibration="none")
        refined_result = ev.critic_step_auroc(critic_models["learned_refined"], tokenizer, model, texts_of(tokenizer),
                                              test, samples=1, max_new_tokens=scale.max_new_tokens, seed=seed + 1)
        critic_result["refined"] = {**refined_result,
                                    "label_auroc": float(refined["eval_metrics"].get("eval/auroc", float("nan"))),
                                    "label_mse": float(refined["eval_metrics"].get("eval/mse", float("nan")))}
    search = search_with_critics(scale, model, tokenizer, critic_models, prover["step_accuracy"], seed=seed)
    arms = ev.summarise_arms(runs, budget=scale.rl.steps, reference="grpo", level_fraction=scale.level_fraction,
                             resamples=scale.bootstrap_resamples, seed=scale.bootstrap_seed)
    results = {"policies": policies, "runs": runs, "arms": arms,
               "prover": prover, "critic": critic_result, "search": search,
               "settings": jsonable(scale), "environment": environment()}
    table = ev.write_table(results, stage.path / "results.md", stage.path / "results.json")
    plots = ev.plot_all(results, stage.path)
    return {"table": table, "plots": plots, "results": str(stage.path / "results.json")}


# ------------------------------------------------------------------------------------------------- driver


def stages_of(scale: Scale, root: Path) -> dict[str, Stage]:
    """Every stage's directory and settings (a stage's settings include those of the stages it reads)."""
    d = Stage(root, "data", {"task": scale.task, "n": [scale.sft_problems, scale.rl_problems, scale.test_problems],
                             "seed": scale.sft.seed, **({"rl_num_ops": scale.rl_num_ops} if scale.rl_num_ops else {})})
    s = Stage(root, "policy", {"data": d.settings, "model": scale.model, "sft": scale.sft, "threads": scale.threads})
    prover = Stage(root, "prover", {"policy": s.settings, "prompts": scale.label_problems,
                                    "group_size": max(2, scale.rl.group_size), "max_new_tokens": scale.max_new_tokens})
    lab = Stage(root, "labels", {"policy": s.settings, "prompts": scale.label_problems, "n": [scale.n_cov, scale.n_mc],
                                 "backend": scale.label_backend, "max_new_tokens": scale.max_new_tokens})
    pav = Stage(root, "pav", {"labels": lab.settings, "steps": scale.pav_steps, "batch": scale.pav_batch_size,
                              "lr": scale.pav_lr, "warmup": scale.pav_warmup, "calibration": scale.pav_calibration,
                              "critic_init": asdict(scale.critic_init) if scale.critic_init else None,
                              **({"data": d.settings} if scale.critic_init else {})})
    refined = Stage(root, "pav_refined", {"pav": pav.settings, "data": d.settings,
                                          "critic_refine": asdict(scale.critic_refine) if scale.critic_refine else None,
                                          "head_fit": scale.refined_head_fit})
    rl_settings = {"policy": s.settings, "prover": prover.settings, "pav": pav.settings,
                   "pav_refined": refined.settings, "rl": scale.rl, "max_new_tokens": scale.max_new_tokens,
                   "device": scale.device}
    # The runs are the stage's parts, each with its own settings (the learned critic's only in pav_learned runs):
    # another critic, arm or seed reruns only the runs it changes. The results depend on all of them.
    rl = Stage(root, "rl", {k: v for k, v in rl_settings.items() if k not in CRITIC_STAGES.values()},
               parts=tuple(rl_run_stages(scale, root, rl_settings).values()))
    ev = Stage(root, "results", {"rl": rl.settings, "critic": pav.settings, "critic_refined": refined.settings,
                                 "arms": scale.rl_arms,
                                 "seeds": scale.rl_seeds,
                                 "eval_samples": scale.eval_samples,
                                 "statistics": [scale.level_fraction, scale.bootstrap_resamples, scale.bootstrap_seed],
                                 "search": [scale.search_problems, scale.best_of_n, scale.beam_widths,
                                            scale.samples_per_beam, scale.search_alpha]})
    return {"data": d, "sft": s, "prover": prover, "label": lab, "pav": pav, "pav_refined": refined, "rl": rl,
            "evaluate": ev}


def run(scale: Scale, work_dir: str | Path, stages: Sequence[str] = STAGES, *, progress: bool = True,
        log=print, in_process: bool = False) -> dict:
    """Run the requested stages (skipping complete ones) on ``scale.threads`` torch threads (the caller's
    thread count is restored afterwards); returns every stage's record. At a GPU scale the GPU stages run in
    processes of their own (:func:`stages_in_own_process`) unless ``in_process``."""
    import torch

    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; choose from {STAGES}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(scale.threads)
    try:
        own_process = () if in_process else stages_in_own_process(scale)
        return _run(scale, Path(work_dir), stages, progress, log, own_process)
    finally:
        torch.set_num_threads(previous_threads)


def needed_stages(scale: Scale, stages: Sequence[str]) -> set[str]:
    """The stages a request runs or reads: every stage up to the last requested one, less those no requested stage
    reads (the PAVs when no arm and no evaluation reads them, the labels when no PAV stage is needed). A needed
    stage that was not requested must be complete."""
    needed = set(STAGES[: max(STAGES.index(x) for x in stages) + 1])
    # the rl stage reads a learned PAV in the arms of its critic only; the evaluation reads the pav stage's always,
    # the pav_refined stage's when an arm reads it
    critic_kinds = {ARMS[arm].critic for arm in scale.rl_arms}
    if "pav" not in stages and "evaluate" not in needed and not critic_kinds & set(CRITIC_STAGES):
        needed.discard("pav")
    if scale.critic_refine is None or ("pav_refined" not in stages and "refined" not in critic_kinds):
        needed.discard("pav_refined")  # a scale without critic_refine has no such stage
    if "label" not in stages and not {"pav", "pav_refined"} & needed:
        needed.discard("label")  # only the PAVs read the labels: GRPO and the exact prover's runs start without them
    return needed


def _run(scale: Scale, root: Path, stages: Sequence[str], progress: bool, log, own_process: Sequence[str]) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    env = environment()
    named = stages_of(scale, root)
    records: dict = {}

    def do(name: str, fn) -> dict:
        from verl_prm.locking import DirectoryLock

        if name in own_process and name in stages and not named[name].done():
            # the stage's process takes the stage's lock and writes its marker
            log(f"[arithmetic] {name}: running in its own process -> {named[name].path}")
            run_stage_process(scale, root, name, progress)
            records[name] = json.loads(named[name].marker.read_text())
            log(f"[arithmetic] {name}: done in {records[name]['seconds']} s")
            return records[name]["outputs"]
        # one writer per stage directory
        with DirectoryLock(named[name].path, f"arithmetic recipe stage {name}"):
            return do_locked(name, named[name], fn)

    def do_locked(name: str, stage: Stage, fn) -> dict:
        if stage.done():
            records[name] = json.loads(stage.marker.read_text())
            differences = environment_differences(records[name].get("environment"), env)
            note = f"; made under another environment ({'; '.join(differences)})" if differences else ""
            log(f"[arithmetic] {name}: complete, skipped ({stage.path}){note}")
            return records[name]["outputs"]
        if name not in stages:
            raise RuntimeError(f"stage {name} is needed but not complete and not requested (--stages)")
        log(f"[arithmetic] {name}: running -> {stage.path}")
        started = time.perf_counter()
        seed_everything(stage_seed(name))
        outputs = fn()
        records[name] = stage.finish(outputs, time.perf_counter() - started, env)
        log(f"[arithmetic] {name}: done in {records[name]['seconds']} s")
        return outputs

    needed = needed_stages(scale, stages)
    d, s = named["data"], named["sft"]
    out: dict = {}
    for name, fn in (
        ("data", lambda: stage_data(d, scale)),
        ("sft", lambda: stage_sft(s, scale, d.path, progress)),
        ("prover", lambda: stage_prover(named["prover"], scale, s.path)),
        ("label", lambda: stage_label(named["label"], scale, d.path, s.path, progress)),
        ("pav", lambda: stage_pav(named["pav"], scale, named["label"].path, s.path, d.path, progress, log)),
        # the pav stage's backbone taught on: its own critic_init round from there, then the same head training
        ("pav_refined", lambda: stage_pav(named["pav_refined"], scale, named["label"].path,
                                          named["pav"].path / "backbone", d.path, progress, log,
                                          critic_init=scale.critic_refine, head_fit=scale.refined_head_fit)),
        ("rl", lambda: stage_rl(named["rl"], scale, d.path, s.path,
                                {kind: out[stage]["checkpoint"] for kind, stage in CRITIC_STAGES.items() if stage in out},
                                out["prover"]["step_accuracy"], log)),
        ("evaluate", lambda: stage_evaluate(named["evaluate"], scale, s.path, out["pav"]["checkpoint"],
                                            out["pav"]["eval_metrics"], out["prover"], out["rl"],
                                            refined=out.get("pav_refined"))),
    ):
        if name in needed:
            out[name] = do(name, fn)
    if "evaluate" in out:
        log(out["evaluate"]["table"])
        log("plots: " + ", ".join(out["evaluate"]["plots"]))
    return records



def stages_in_own_process(scale: Scale) -> tuple[str, ...]:
    """The stages that run in a process of their own: the GPU stages at a GPU scale, none on CPU."""
    return () if scale.device == "cpu" else GPU_STAGES


def scale_from_json(data: dict) -> Scale:
    """The ``Scale`` whose ``jsonable`` form is ``data`` (what ``WORK_DIR/scale.json`` holds)."""
    return _dataclass_from_json(Scale, data)


def _dataclass_from_json(cls, data: dict):
    """``cls`` (a dataclass of settings) from its JSON form: nested settings rebuilt, lists back to tuples; every
    field must be there, and nothing else."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{cls.__name__} has no settings {unknown}: the scale file was written by another version")
    missing = [name for name in names if name not in data]
    if missing:
        raise ValueError(f"the scale file lacks {cls.__name__} settings {missing}: write it with this version")
    values = {}
    for name in names:
        hint, value = hints[name], data[name]
        if typing.get_origin(hint) is typing.Union:  # Optional[X]
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        if value is not None and dataclasses.is_dataclass(hint):
            value = _dataclass_from_json(hint, value)
        elif typing.get_origin(hint) is tuple:
            value = tuple(value)
        values[name] = value
    return cls(**values)


def stage_process_command(scale_file: Path, work_dir: Path, stage: str, progress: bool,
                          python: str = sys.executable) -> list[str]:
    """The command that runs one stage in a process of its own: this module with the scale of ``scale_file``
    and every stage in that process."""
    return [python, "-m", "verl_prm.apps.arithmetic.pipeline", "--scale-file", str(scale_file),
            "--work-dir", str(work_dir), "--stages", stage, "--in-process", *([] if progress else ["--no-progress"])]


def run_stage_process(scale: Scale, root: Path, stage: str, progress: bool) -> None:
    """Run ``stage`` in a process of its own (:func:`stage_process_command`; its output goes to this process's)."""
    import subprocess

    scale_file = root / "scale.json"
    tmp = scale_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(jsonable(scale), indent=2))
    tmp.replace(scale_file)
    command = stage_process_command(scale_file, root, stage, progress)
    code = subprocess.run(command).returncode
    if code != 0:
        raise RuntimeError(f"the {stage} stage's process exited with {code} (its output is above): {shlex.join(command)}")


def scale_from_args(args: argparse.Namespace) -> Scale:
    """The scale named by ``--scale`` (or read from ``--scale-file``) with the command line's overrides."""
    scale = scale_from_json(json.loads(Path(args.scale_file).read_text())) if args.scale_file else SCALES[args.scale]
    if args.rl_steps is not None:
        scale = replace(scale, rl=replace(scale.rl, steps=args.rl_steps))
    overrides = {"label_problems": args.label_problems, "n_mc": args.n_mc, "pav_steps": args.pav_steps,
                 "threads": args.threads, "rl_parallel": args.rl_parallel,
                 "rl_arms": tuple(a.strip() for a in args.rl_arms.split(",")) if args.rl_arms else None,
                 "rl_seeds": tuple(int(x) for x in args.rl_seeds.split(",")) if args.rl_seeds else None}
    return replace(scale, **{key: value for key, value in overrides.items() if value is not None})


def recipe_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-prm recipe arithmetic",
                                     description=__doc__.split("\n\n")[0] + " (also: python -m verl_prm.apps.arithmetic)")
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--scale-file", default=None,
                        help="the settings of a scale as JSON, as the recipe writes them to WORK_DIR/scale.json for "
                        "its stage processes (instead of --scale)")
    parser.add_argument("--work-dir", required=True, help="outputs of every stage; rerun to resume")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the RL iterations of the scale")
    parser.add_argument("--rl-arms", default=None, help="override the RL arms (comma-separated names of verl_rl.ARMS)")
    parser.add_argument("--rl-seeds", default=None, help="override the RL seeds (comma-separated integers)")
    parser.add_argument("--rl-parallel", type=int, default=None, help="main_ppo runs at once (default 2)")
    parser.add_argument("--label-problems", type=int, default=None, help="override the problems labelled")
    parser.add_argument("--n-mc", type=int, default=None, help="override the prover continuations per prefix")
    parser.add_argument("--pav-steps", type=int, default=None, help="override the PAV training steps")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every stage (default 1; the measured numbers are for 1: float "
                             "reductions may differ with another count)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every stage in this process (by default a GPU scale runs sft, label, pav and "
                        "evaluate each in a process of its own, whose exit frees the GPU for the next)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = recipe_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    scale = scale_from_args(args)
    run(scale, args.work_dir, [s.strip() for s in args.stages.split(",") if s.strip()], progress=not args.no_progress,
        in_process=args.in_process)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

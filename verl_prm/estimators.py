"""verl glue for the advantage math: estimator registrations and the DataProto entry point.

Each estimator is called with verl's keyword arguments (``token_level_rewards``, ``response_mask``, ``index``,
``config``) plus the step tensors of DESIGN.md section 2 (``step_ids``, ``step_values``, ``prompt_values``,
``num_steps``) and optionally ``truncated`` [B] bool. verl's own ``compute_advantage`` passes no step tensors to
plugin estimators, so ``compute_advantage_with_steps`` (used by the trainer hook and the demo) is the one place
that reads them from a ``DataProto`` and calls the registered estimator. The math is in
``verl_prm.advantages``; this module only translates.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from verl_prm import advantages as adv
from verl_prm.config import PavConfig, read_pav_config

__all__ = [
    "PAV_ESTIMATORS",
    "STEP_KEYS",
    "compute_advantage_with_steps",
    "compute_pav_grpo_advantage",
    "compute_pav_prime_advantage",
    "compute_pav_pure_advantage",
    "compute_pav_reinforce_advantage",
    "compute_pav_rloo_advantage",
    "compute_prm_aggregate_advantage",
    "register_estimators",
]

STEP_KEYS = ("step_ids", "step_values", "prompt_values", "num_steps")
# verl's compute_advantage passes these to every registered estimator when the batch has them.
_VERL_OPTIONAL_KWARGS = frozenset({"reward_baselines"})


class MissingStepTensorsError(ValueError):
    """A PAV estimator was called without the step tensors."""


def _inputs(name: str, step_tensors: dict[str, Any], token_level_rewards, response_mask, pav: PavConfig, extra: dict):
    unknown = set(extra) - _VERL_OPTIONAL_KWARGS
    if unknown:
        raise TypeError(f"{name}: unexpected arguments {sorted(unknown)}")
    missing = [key for key in STEP_KEYS if step_tensors.get(key) is None]
    if missing:
        raise MissingStepTensorsError(
            f"advantage estimator {name!r} needs the step tensors {list(STEP_KEYS)} but got none for {missing}. "
            "verl's own compute_advantage does not pass them to plugin estimators: compute advantages with "
            "verl_prm.estimators.compute_advantage_with_steps on a DataProto that carries the step tensors (the "
            "verl-prm trainer hook does this after the prover critic has scored the steps)."
        )
    if pav.check_inputs:
        adv.check_step_inputs(
            step_tensors["step_ids"],
            step_tensors["step_values"],
            step_tensors["prompt_values"],
            step_tensors["num_steps"],
            response_mask,
        )
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same shape"
        )


def _process_scores(name: str, pav: PavConfig, step_tensors: dict[str, Any], truncated) -> torch.Tensor:
    keep = None
    if pav.drop_truncated:
        if truncated is None:
            raise MissingStepTensorsError(
                f"{name}: algorithm.pav.drop_truncated=true needs the `truncated` tensor [B] (True for responses "
                "that hit the length limit without EOS); the verl-prm trainer hook supplies it"
            )
        keep = ~truncated.bool()
    return adv.process_scores(
        step_tensors["step_values"],
        step_tensors["prompt_values"],
        step_tensors["num_steps"],
        best_of_k_k=pav.best_of_k,
        use_values=pav.uses_values,
        clip=pav.clip,
        normalize=pav.normalize,
        keep=keep,
        epsilon=pav.epsilon,
    )


def _groups(name: str, index, device) -> tuple[torch.Tensor, int]:
    if index is None:
        raise ValueError(f"{name} needs `index` (verl's uid per response) to group responses by prompt")
    return adv.group_ids(index, device=device)


def _norm_by_std(config) -> bool:
    if config is None:
        return True
    getter = getattr(config, "get", None)
    return bool(getter("norm_adv_by_std_in_grpo", True) if getter else getattr(config, "norm_adv_by_std_in_grpo", True))


def _grpo_outcome(name, rewards, index, config, pav, scores, num_steps):
    groups, num_groups = _groups(name, index, rewards.device)
    return adv.group_normalized_outcome(rewards, groups, num_groups, epsilon=pav.epsilon,
                                        norm_by_std=_norm_by_std(config))


def _rloo_outcome(name, rewards, index, config, pav, scores, num_steps):
    groups, num_groups = _groups(name, index, rewards.device)
    return adv.leave_one_out_outcome(rewards, groups, num_groups)


def _reinforce_outcome(name, rewards, index, config, pav, scores, num_steps):
    return adv.batch_baseline_outcome(rewards)


def _aggregate_outcome(name, rewards, index, config, pav, scores, num_steps):
    reward = pav.aggregate_weight * adv.aggregate_step_scores(scores, num_steps, pav.aggregation)
    if pav.aggregate_with_outcome:
        reward = reward + rewards
    return _grpo_outcome(name, reward, index, config, pav, scores, num_steps)


def _step_estimator(name, outcome_fn, per_step: bool, token_level_rewards, response_mask, index, config,
                    steps: dict, truncated, verl_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """What every step estimator shares: read the config, check the inputs, the process scores, the broadcast."""
    pav = read_pav_config(config)
    _inputs(name, steps, token_level_rewards, response_mask, pav, verl_kwargs)
    with torch.no_grad():
        scores = _process_scores(name, pav, steps, truncated)
        outcome = outcome_fn(name, token_level_rewards.sum(dim=-1), index, config, pav, scores, steps["num_steps"])
        if per_step:
            advantages = adv.process_advantage(outcome, scores, steps["step_ids"], response_mask, pav.alpha,
                                               compile=pav.compile)
        else:
            advantages = outcome[:, None] * response_mask
    return advantages, advantages


# The estimators keep explicit signatures: verl (and patch 0001) pass keyword arguments by name.


def compute_pav_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    step_ids: torch.Tensor | None = None,
    step_values: torch.Tensor | None = None,
    prompt_values: torch.Tensor | None = None,
    num_steps: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    **verl_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pav_grpo``: GRPO's outcome advantage plus ``alpha *`` the progress of each token's step.

    ``adv[i, t] = (out_i + alpha * A_{i, step_ids[i, t]}) * response_mask[i, t]`` with out_i verl's grpo
    advantage (``norm_adv_by_std_in_grpo`` read from ``config``). With alpha = 0 it equals verl's ``grpo``.
    Returns ``(advantages, returns)`` with ``returns = advantages``, as verl's grpo.
    """
    steps = dict(step_ids=step_ids, step_values=step_values, prompt_values=prompt_values, num_steps=num_steps)
    return _step_estimator("pav_grpo", _grpo_outcome, True, token_level_rewards, response_mask, index, config,
                           steps, truncated, verl_kwargs)


def compute_pav_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    step_ids: torch.Tensor | None = None,
    step_values: torch.Tensor | None = None,
    prompt_values: torch.Tensor | None = None,
    num_steps: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    **verl_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pav_rloo``: RLOO's outcome advantage (``R_i`` minus the mean of the other responses of its prompt,
    as verl's ``rloo``) plus ``alpha *`` the progress of each token's step. With alpha = 0 it equals verl's rloo.
    """
    steps = dict(step_ids=step_ids, step_values=step_values, prompt_values=prompt_values, num_steps=num_steps)
    return _step_estimator("pav_rloo", _rloo_outcome, True, token_level_rewards, response_mask, index, config,
                           steps, truncated, verl_kwargs)


def compute_pav_reinforce_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    step_ids: torch.Tensor | None = None,
    step_values: torch.Tensor | None = None,
    prompt_values: torch.Tensor | None = None,
    num_steps: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    **verl_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pav_reinforce``: the PAV paper's online-RL form, ``out_i = R_i - mean_batch R`` plus
    ``alpha *`` the progress of each token's step. ``index`` is not needed.
    """
    steps = dict(step_ids=step_ids, step_values=step_values, prompt_values=prompt_values, num_steps=num_steps)
    return _step_estimator("pav_reinforce", _reinforce_outcome, True, token_level_rewards, response_mask, index,
                           config, steps, truncated, verl_kwargs)


def compute_prm_aggregate_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    step_ids: torch.Tensor | None = None,
    step_values: torch.Tensor | None = None,
    prompt_values: torch.Tensor | None = None,
    num_steps: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    **verl_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prm_aggregate`` (Pan et al. 2023): one trajectory reward from the step scores, group-normalised.

    ``reward_i = [R_i] + w * agg_h p_{i,h}`` (``agg`` = ``pav.aggregation``, p = progress or value per
    ``pav.process_term``, R_i included when ``pav.aggregate_with_outcome``), then GRPO's group normalisation,
    broadcast over the response tokens.
    """
    steps = dict(step_ids=step_ids, step_values=step_values, prompt_values=prompt_values, num_steps=num_steps)
    return _step_estimator("prm_aggregate", _aggregate_outcome, False, token_level_rewards, response_mask, index,
                           config, steps, truncated, verl_kwargs)


PAV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "pav_grpo": compute_pav_grpo_advantage,
    "pav_rloo": compute_pav_rloo_advantage,
    "pav_reinforce": compute_pav_reinforce_advantage,
    "prm_aggregate": compute_prm_aggregate_advantage,
}  # pav_pure and pav_prime are added below, next to their definitions


def register_estimators() -> None:
    """Register every PAV estimator in verl's advantage-estimator registry (idempotent)."""
    from verl.trainer.ppo.core_algos import register_adv_est

    for name, fn in PAV_ESTIMATORS.items():
        register_adv_est(name)(fn)


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
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    name = config.get("adv_estimator") if hasattr(config, "get") else config.adv_estimator
    estimator = get_adv_estimator_fn(name)
    kwargs: dict[str, Any] = {
        "token_level_rewards": data.batch["token_level_rewards"],
        "response_mask": data.batch["response_mask"],
        "config": config,
    }
    if "uid" in data.non_tensor_batch:
        kwargs["index"] = data.non_tensor_batch["uid"]
    if name in PAV_ESTIMATORS:
        for key in (*STEP_KEYS, "truncated"):
            if key in data.batch.keys():
                kwargs[key] = data.batch[key]
    advantages, returns = estimator(**kwargs)
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


# ------------------------------------------------------------------------------------------------------------
# Credit assignment of the anchors (PURE, PRIME): the process scores become rewards at the end of each step,
# summed over later tokens; the outcome advantage is RLOO's, as both use. Math: verl_prm.advantages.


def _returns_estimator(name, token_level_rewards, response_mask, index, config, steps: dict, truncated,
                       verl_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    pav = read_pav_config(config)
    _inputs(name, steps, token_level_rewards, response_mask, pav, verl_kwargs)
    with torch.no_grad():
        scores = _process_scores(name, pav, steps, truncated)  # raises when drop_truncated lacks `truncated`
        keep = ~truncated.bool() if pav.drop_truncated else None
        groups, num_groups = _groups(name, index, token_level_rewards.device)
        outcome = adv.leave_one_out_outcome(token_level_rewards.sum(dim=-1), groups, num_groups)
        common = dict(groups=groups, num_groups=num_groups, keep=keep)
        if name == "pav_pure":
            advantages = adv.min_form_advantage(
                outcome, scores, steps["step_ids"], steps["num_steps"], response_mask, pav.alpha,
                temperature=pav.min_form_temperature, baseline=pav.min_form_baseline,
                zero_separators=pav.zero_separator_advantage, **common,
            )
        else:
            advantages = adv.leave_one_out_process_advantage(
                outcome, scores, steps["step_ids"], steps["num_steps"], response_mask, pav.alpha,
                whiten=pav.whiten_returns, **common,
            )
    return advantages, advantages


def compute_pav_pure_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    step_ids: torch.Tensor | None = None,
    step_values: torch.Tensor | None = None,
    prompt_values: torch.Tensor | None = None,
    num_steps: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    **verl_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pav_pure``: PURE's min-form credit assignment (Cheng et al. 2025) of the PAV process scores.

    Step rewards ``r = softmin_T-weighted p`` minus PURE's leave-one-out step baseline, placed at each step's
    last token and summed over later tokens, plus RLOO's outcome advantage:
    ``adv[i, t] = (out_i + alpha * sum_{t' >= t} d[i, t']) * response_mask[i, t]``, 0 on step-separator tokens
    (``verl_prm.advantages.min_form_advantage``; knobs ``pav.min_form_temperature``, ``pav.min_form_baseline``,
    ``pav.zero_separator_advantage``). With alpha = 0 and ``zero_separator_advantage=false`` it equals verl's rloo.
    """
    steps = dict(step_ids=step_ids, step_values=step_values, prompt_values=prompt_values, num_steps=num_steps)
    return _returns_estimator("pav_pure", token_level_rewards, response_mask, index, config, steps, truncated,
                              verl_kwargs)


def compute_pav_prime_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    step_ids: torch.Tensor | None = None,
    step_values: torch.Tensor | None = None,
    prompt_values: torch.Tensor | None = None,
    num_steps: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    **verl_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pav_prime``: PRIME's leave-one-out process returns (Cui et al. 2025, ``compute_rloo_returns``) with
    the PAV process scores in place of the implicit PRM's rewards.

    ``q[i, h] = p[i, h] n/(n-1) - sum_g m_j/(n-1)`` at each step's last token, summed over later tokens, plus
    RLOO's outcome advantage, whitened over the batch's response tokens (``pav.whiten_returns``):
    ``verl_prm.advantages.leave_one_out_process_advantage``. With alpha = 0 and ``whiten_returns=false`` it
    equals verl's rloo.
    """
    steps = dict(step_ids=step_ids, step_values=step_values, prompt_values=prompt_values, num_steps=num_steps)
    return _returns_estimator("pav_prime", token_level_rewards, response_mask, index, config, steps, truncated,
                              verl_kwargs)


PAV_ESTIMATORS["pav_pure"] = compute_pav_pure_advantage
PAV_ESTIMATORS["pav_prime"] = compute_pav_prime_advantage

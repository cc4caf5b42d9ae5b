"""The advantage estimators: one registry of names, each estimator registered at its definition.

Every estimator has verl's calling convention (``register_adv_est``): keyword arguments
``token_level_rewards`` [B, T], ``response_mask`` [B, T], ``index`` (verl's uid per response), ``config``
(verl's algorithm config, with ``pav``), plus the step tensors (``step_ids``, ``step_values``,
``prompt_values``, ``num_steps``; docs: concepts, "tensor contract") and optionally ``truncated`` [B] bool. It
returns ``(advantages, returns)``. :func:`register_estimator` builds that signature once around a small rule
``(name, inputs, pav, config) -> advantages``; :data:`ESTIMATORS` (name -> estimator) is the one list of names
that the config check, the verl plugin (which registers each entry in verl's registry) and the docs read.

The math is in ``verl_prm.advantages``; this module only reads the config, checks the inputs and calls it. It
imports no verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from verl_prm import advantages as adv
from verl_prm import trees
from verl_prm.config import PavConfig, read_pav_config

__all__ = ["ESTIMATORS", "STEP_KEYS", "TREE_ESTIMATORS", "TREE_KEYS", "EstimatorInputs", "MissingStepTensorsError",
           "register_estimator"]

STEP_KEYS = ("step_ids", "step_values", "prompt_values", "num_steps")
# The tensors of tree-shaped groups (verl_prm.trees.TreeValues) that the tree estimators read besides the step
# tensors: the leaves below each step's node [B, S], each response's own node's value [B] and leaves [B].
TREE_KEYS = ("leaf_counts", "response_values", "response_leaf_counts")
# verl's compute_advantage passes these to every registered estimator when the batch has them.
_VERL_OPTIONAL_KWARGS = frozenset({"reward_baselines"})

Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: dict[str, Estimator] = {}


class MissingStepTensorsError(ValueError):
    """A PAV estimator was called without the step tensors."""


@dataclass
class EstimatorInputs:
    """What an estimator's rule reads: the tensors and the process scores of every step.

    The inputs are checked after the rule has run (the math clamps every index, so bad inputs cannot crash it):
    ``bad_rows`` is what the check reads instead of the inputs, when the rule's fused lookup computed it.
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: Any
    step_ids: torch.Tensor
    num_steps: torch.Tensor
    # p [B, S]: per-step progress (or value, per pav.process_term), Best-of-K transformed, normalised, clipped
    scores: torch.Tensor
    # keep [B] bool or None: the responses that get a process term (algorithm.pav.drop_truncated)
    keep: torch.Tensor | None
    # R_i [B]: the row sums of token_level_rewards (verl's outcome), computed once
    outcome_rewards: torch.Tensor
    # [B] bool, set by rules whose lookup flags the responses that break the tensor contract as it reads the step
    # ids (verl_prm.advantages.bad_input_rows)
    bad_rows: torch.Tensor | None = None
    # the raw step values [B, S] and prompt values [B] (before Best-of-K), and the tree tensors (TREE_KEYS:
    # tree-shaped groups, verl_prm.trees; None otherwise): what the tree estimators read
    step_values: torch.Tensor | None = None
    prompt_values: torch.Tensor | None = None
    tree: dict[str, torch.Tensor | None] | None = None
    # [B] bool, set by the tree rules: the responses whose own node (response_values, response_leaf_counts) breaks
    # its contract, checked in the same host read as the step tensors
    tree_bad_rows: torch.Tensor | None = None


def _check(name: str, steps: dict[str, Any], token_level_rewards, response_mask, pav: PavConfig, extra: dict):
    unknown = set(extra) - _VERL_OPTIONAL_KWARGS
    if unknown:
        raise TypeError(f"{name}: unexpected arguments {sorted(unknown)}")
    missing = [key for key in STEP_KEYS if steps.get(key) is None]
    if missing:
        raise MissingStepTensorsError(
            f"advantage estimator {name!r} needs the step tensors {list(STEP_KEYS)} but got none for {missing}. "
            "verl's compute_advantage does not pass them to plugin estimators: run it inside "
            "verl_prm.integrations.verl.advantage.estimator_step_inputs(StepInputs(...)), whose step tensors the "
            "registered estimator reads (the verl-prm trainer hook, which +verl_prm=pav selects, does this after "
            "the steps are valued), or pass the step tensors to the estimator as keyword arguments."
        )
    # shapes before the math (free); the values after it, in one host read (register_estimator)
    adv.check_step_shapes(steps["step_ids"], steps["step_values"], steps["prompt_values"], steps["num_steps"],
                          response_mask, token_level_rewards)


def _keep(name: str, pav: PavConfig, truncated) -> torch.Tensor | None:
    if not pav.drop_truncated:
        return None
    if truncated is None:
        raise MissingStepTensorsError(
            f"{name}: algorithm.pav.drop_truncated=true needs the `truncated` tensor [B] (True for responses "
            "that hit the length limit without EOS); the verl-prm trainer hook supplies it"
        )
    return ~truncated.bool()


def _check_tree_inputs(name: str, inputs: EstimatorInputs, step_ids, step_values, prompt_values, num_steps,
                       response_mask, token_level_rewards) -> None:
    """``check_step_inputs`` with the tree tensors' flags in its one host read; the tensors are read again only
    to name a bad sample."""
    step_bad = inputs.bad_rows
    if step_bad is None:
        step_bad = adv.bad_input_rows(step_ids, step_values, prompt_values, num_steps, inputs.outcome_rewards)
    any_step_bad, any_tree_bad = torch.stack([step_bad.any(), inputs.tree_bad_rows.any()]).tolist()
    if any_step_bad:
        adv.check_step_inputs(step_ids, step_values, prompt_values, num_steps, response_mask, token_level_rewards,
                              bad_rows=step_bad)
    if any_tree_bad:
        row = int(inputs.tree_bad_rows.nonzero()[0, 0])
        values, leaves = inputs.tree["response_values"], inputs.tree["response_leaf_counts"]
        raise ValueError(f"{name}: sample {row} has response_values {float(values[row])} and response_leaf_counts "
                         f"{int(leaves[row])}; a response's own node is a success rate in [0, 1] over >= 1 leaves "
                         "(verl_prm.trees.tree_step_values)")


def register_estimator(name: str) -> Callable[[Callable[..., torch.Tensor]], Estimator]:
    """Register ``rule(name, inputs: EstimatorInputs, pav: PavConfig, config) -> advantages [B, T]`` as the
    estimator ``name`` with verl's keyword signature; the estimator returns ``(advantages, advantages)`` (the
    returns equal the advantages, as in verl's grpo). The rule's docstring is the estimator's."""
    if name in ESTIMATORS:
        raise ValueError(f"estimator {name!r} is registered twice")

    def decorate(rule: Callable[..., torch.Tensor]) -> Estimator:
        def estimator(
            token_level_rewards: torch.Tensor,
            response_mask: torch.Tensor,
            index=None,
            config=None,
            step_ids: torch.Tensor | None = None,
            step_values: torch.Tensor | None = None,
            prompt_values: torch.Tensor | None = None,
            num_steps: torch.Tensor | None = None,
            truncated: torch.Tensor | None = None,
            leaf_counts: torch.Tensor | None = None,
            response_values: torch.Tensor | None = None,
            response_leaf_counts: torch.Tensor | None = None,
            **verl_kwargs,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            pav = read_pav_config(config)
            steps = dict(step_ids=step_ids, step_values=step_values, prompt_values=prompt_values,
                         num_steps=num_steps)
            _check(name, steps, token_level_rewards, response_mask, pav, verl_kwargs)
            with torch.no_grad():
                keep = _keep(name, pav, truncated)
                scores = pav.process_scores(step_values, prompt_values, num_steps, keep)
                inputs = EstimatorInputs(token_level_rewards, response_mask, index, step_ids, num_steps, scores,
                                         keep, token_level_rewards.sum(dim=-1), step_values=step_values,
                                         prompt_values=prompt_values,
                                         tree=dict(leaf_counts=leaf_counts, response_values=response_values,
                                                   response_leaf_counts=response_leaf_counts))
                advantages = rule(name, inputs, pav, config)
                if pav.check_inputs:
                    # one host read per batch, after the math (which clamps every index): the [B, T] inputs are
                    # checked through the outcome sums and the lookup's flags (verl_prm.advantages)
                    if inputs.tree_bad_rows is None:
                        adv.check_step_inputs(step_ids, step_values, prompt_values, num_steps, response_mask,
                                              token_level_rewards, bad_rows=inputs.bad_rows)
                    else:
                        _check_tree_inputs(name, inputs, step_ids, step_values, prompt_values, num_steps,
                                           response_mask, token_level_rewards)
            return advantages, advantages

        estimator.__name__ = estimator.__qualname__ = name
        estimator.__doc__ = rule.__doc__
        estimator.__module__ = rule.__module__
        ESTIMATORS[name] = estimator
        return estimator

    return decorate


def _groups(name: str, inputs: EstimatorInputs) -> tuple[torch.Tensor, int]:
    """Group ids on the batch's device: a tensor ``index`` (group ids made once per batch, e.g. by
    ``adv.group_ids(uids, device)``) is used where it lies, no transfer; verl's host uids are grouped on the host
    and uploaded once, asynchronously from pinned memory (``adv.group_ids``)."""
    if inputs.index is None:
        raise ValueError(f"{name} needs `index` (verl's uid per response) to group responses by prompt")
    return adv.group_ids(inputs.index, device=inputs.token_level_rewards.device)


def _norm_by_std(config) -> bool:
    if config is None:
        return True
    getter = getattr(config, "get", None)
    return bool(getter("norm_adv_by_std_in_grpo", True) if getter else getattr(config, "norm_adv_by_std_in_grpo", True))


def _per_step(outcome: torch.Tensor, inputs: EstimatorInputs, pav: PavConfig) -> torch.Tensor:
    checked = (inputs.step_values, inputs.prompt_values, inputs.num_steps, inputs.outcome_rewards)
    advantages, inputs.bad_rows = adv.process_advantage_and_bad_rows(
        outcome, inputs.scores, inputs.step_ids, inputs.response_mask, pav.alpha,
        checked=checked if pav.check_inputs else None, compile=pav.compile)
    return advantages


def _grpo_outcome(name: str, rewards: torch.Tensor, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    groups, num_groups = _groups(name, inputs)
    return adv.group_normalized_outcome(rewards, groups, num_groups, epsilon=pav.epsilon,
                                        norm_by_std=_norm_by_std(config))


@register_estimator("pav_grpo")
def _pav_grpo(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``pav_grpo``: GRPO's outcome advantage plus ``alpha *`` the progress of each token's step.

    ``adv[i, t] = (out_i + alpha * A_{i, step_ids[i, t]}) * response_mask[i, t]`` with out_i verl's grpo
    advantage (``norm_adv_by_std_in_grpo`` read from ``config``). With alpha = 0 it equals verl's ``grpo``.
    Returns ``(advantages, returns)`` with ``returns = advantages``, as verl's grpo.
    """
    return _per_step(_grpo_outcome(name, inputs.outcome_rewards, inputs, pav, config), inputs, pav)


@register_estimator("pav_rloo")
def _pav_rloo(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``pav_rloo``: RLOO's outcome advantage (``R_i`` minus the mean of the other responses of its prompt,
    as verl's ``rloo``) plus ``alpha *`` the progress of each token's step. With alpha = 0 it equals verl's rloo.
    """
    groups, num_groups = _groups(name, inputs)
    return _per_step(adv.leave_one_out_outcome(inputs.outcome_rewards, groups, num_groups), inputs, pav)


@register_estimator("pav_reinforce")
def _pav_reinforce(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``pav_reinforce``: the PAV paper's online-RL form, ``out_i = R_i - mean_batch R`` plus
    ``alpha *`` the progress of each token's step. ``index`` is not needed.
    """
    return _per_step(adv.batch_baseline_outcome(inputs.outcome_rewards), inputs, pav)


@register_estimator("prm_aggregate")
def _prm_aggregate(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``prm_aggregate`` (Pan et al. 2023): one trajectory reward from the step scores, group-normalised.

    ``reward_i = [R_i] + w * agg_h p_{i,h}`` (``agg`` = ``pav.aggregation``, p = progress or value per
    ``pav.process_term``, R_i included when ``pav.aggregate_with_outcome``), then GRPO's group normalisation,
    broadcast over the response tokens.
    """
    reward = pav.aggregate_weight * adv.aggregate_step_scores(inputs.scores, inputs.num_steps, pav.aggregation)
    if pav.aggregate_with_outcome:
        reward = reward + inputs.outcome_rewards
    return _grpo_outcome(name, reward, inputs, pav, config)[:, None] * inputs.response_mask


# Credit assignment of the anchors (PURE, PRIME): the process scores become rewards at the end of each step,
# summed over later tokens; the outcome advantage is RLOO's, as both use.


@register_estimator("pav_pure")
def _pav_pure(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``pav_pure``: PURE's min-form credit assignment (Cheng et al. 2025) of the PAV process scores.

    Step rewards ``r = softmin_T-weighted p`` minus PURE's leave-one-out baseline (``pav.min_form_baseline``),
    placed at each step's last token and summed over later tokens, plus RLOO's outcome advantage:
    ``adv[i, t] = (out_i + alpha * sum_{t' >= t} d[i, t']) * response_mask[i, t]``, 0 on step-separator tokens
    (and on the EOS with ``pav.zero_eos_advantage``), whitened as PURE (``pav.min_form_whiten``):
    ``verl_prm.advantages.min_form_advantage``. With alpha = 0, ``zero_separator_advantage=false`` and
    ``min_form_whiten=false`` it equals verl's rloo.
    """
    groups, num_groups = _groups(name, inputs)
    outcome = adv.leave_one_out_outcome(inputs.outcome_rewards, groups, num_groups)
    return adv.min_form_advantage(
        outcome, inputs.scores, inputs.step_ids, inputs.num_steps, inputs.response_mask, pav.alpha,
        temperature=pav.min_form_temperature, baseline=pav.min_form_baseline,
        zero_separators=pav.zero_separator_advantage, zero_eos=pav.zero_eos_advantage, whiten=pav.min_form_whiten,
        groups=groups, num_groups=num_groups, keep=inputs.keep,
    )


@register_estimator("pav_prime")
def _pav_prime(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``pav_prime``: PRIME's leave-one-out process returns (Cui et al. 2025, ``compute_rloo_returns``) with
    the PAV process scores in place of the implicit PRM's rewards.

    ``q[i, h] = p[i, h] n/(n-1) - sum_g m_j/(n-1)`` at each step's last token, summed over later tokens, plus
    RLOO's outcome advantage, whitened over the batch's response tokens (``pav.whiten_returns``);
    ``pav.prime_reward_mask="response"`` applies the baseline at every response token, as PRIME's code does:
    ``verl_prm.advantages.leave_one_out_process_advantage``. With alpha = 0 and ``whiten_returns=false`` it
    equals verl's rloo.
    """
    groups, num_groups = _groups(name, inputs)
    outcome = adv.leave_one_out_outcome(inputs.outcome_rewards, groups, num_groups)
    return adv.leave_one_out_process_advantage(
        outcome, inputs.scores, inputs.step_ids, inputs.num_steps, inputs.response_mask, pav.alpha,
        whiten=pav.whiten_returns, reward_mask=pav.prime_reward_mask, groups=groups, num_groups=num_groups,
        keep=inputs.keep,
    )


# Tree-shaped groups (verl_prm.trees): the advantage of each leaf's segment from the tree's node values; they read
# the raw node values and the leaf counts, not the PAV process scores (alpha, Best-of-K, normalize, clip and
# drop_truncated do not apply).
TREE_ESTIMATORS = ("tree_rl", "spo_tree")


def _tree_tensors(name: str, inputs: EstimatorInputs, pav: PavConfig) -> tuple[torch.Tensor, ...]:
    """The tree tensors (``TREE_KEYS``): their shapes checked; the responses whose own node's value is outside
    [0, 1] (NaN included) or has no leaf flagged in ``inputs.tree_bad_rows`` (read with the step checks)."""
    tree = inputs.tree or {}
    missing = [key for key in TREE_KEYS if tree.get(key) is None]
    if missing:
        raise MissingStepTensorsError(
            f"advantage estimator {name!r} needs the step tensor{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)} (the "
            "leaves below each step's node and each response's own node: verl_prm.trees.TreeValues), which "
            "tree-shaped groups supply (verl_prm.critic.source=tree); with other step values use pav_grpo, "
            "pav_rloo, ...")
    counts, values, leaves = (tree[key] for key in TREE_KEYS)
    rows = inputs.step_values.shape[0]
    if counts.shape != inputs.step_values.shape or counts.dtype.is_floating_point:
        raise ValueError(f"{name}: leaf_counts must be an integer tensor of step_values' shape "
                         f"{tuple(inputs.step_values.shape)}, got {counts.dtype} {tuple(counts.shape)}")
    if values.shape != (rows,) or leaves.shape != (rows,) or leaves.dtype.is_floating_point:
        raise ValueError(f"{name}: response_values must be [{rows}] and response_leaf_counts an integer [{rows}], "
                         f"got {values.dtype} {tuple(values.shape)} and {leaves.dtype} {tuple(leaves.shape)}")
    inputs.tree_bad_rows = ~((values >= 0) & (values <= 1)) | (leaves < 1)  # NaN fails too
    return counts, values, leaves


def _tree_rule(name: str, inputs: EstimatorInputs, pav: PavConfig) -> torch.Tensor:
    """Each token gets the advantage of its step's segment (``verl_prm.trees.tree_step_advantages``); a token in
    no step (EOS, special tokens) that of the response's own node, its leaf (``verl_prm.trees.with_leaf_nodes``),
    which is its last step's segment when no other leaf shares that step, else a segment of its own below it. A
    response with no step is a leaf right below the prompt. Node values are success rates everywhere, the
    leaf's included (``response_values``, never the raw reward)."""
    counts, response_values, response_leaves = _tree_tensors(name, inputs, pav)
    values, node_counts = trees.with_leaf_nodes(inputs.step_values, counts, inputs.num_steps, response_values,
                                                response_leaves)
    group_leaves = None
    if name == "tree_rl" and pav.tree_rl_scale == "code":
        groups, num_groups = _groups(name, inputs)
        group_leaves = torch.bincount(groups, minlength=num_groups)[groups]
    num_steps = inputs.num_steps.to(values.device)
    step_advantages = trees.tree_step_advantages(name, values, inputs.prompt_values, node_counts, num_steps + 1,
                                                 scale=pav.tree_rl_scale, group_leaves=group_leaves,
                                                 segment_weight=pav.tree_segment_weight)
    width = step_advantages.shape[1]
    leaf = step_advantages.gather(1, num_steps.long().clamp(min=0, max=width - 1)[:, None])
    per_token = adv.step_scores_per_token(step_advantages, inputs.step_ids)
    per_token = torch.where(inputs.step_ids >= 0, per_token, leaf)
    return per_token * inputs.response_mask


@register_estimator("tree_rl")
def _tree_rl(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``tree_rl``: TreeRL's process advantage (Hou et al. 2025, https://github.com/THUDM/TreeRL) of tree-shaped
    groups: every token of a leaf's segment with node n gets ``(GA + LA) / sqrt(|L(n)|)``, GA = V(n) - V(root),
    LA = V(n) - V(parent(n)), V = the success rate of the leaves below a node (``verl_prm.trees``);
    ``pav.tree_rl_scale=code`` takes TreeRL's code's scale, ``pav.tree_segment_weight=once`` weighs each node
    once. Needs the tree tensors ``TREE_KEYS``. Returns ``(advantages, advantages)``.
    """
    return _tree_rule(name, inputs, pav)


@register_estimator("spo_tree")
def _spo_tree(name: str, inputs: EstimatorInputs, pav: PavConfig, config) -> torch.Tensor:
    """``spo_tree``: SPO-tree's segment advantage (Guo et al. 2025, https://github.com/AIFrameResearch/SPO) of
    tree-shaped groups: every token of a leaf's segment with node n gets ``V(n) - V(parent(n))``, V = the mean
    success rate of the leaves below a node (``verl_prm.trees``); ``pav.tree_segment_weight=once`` weighs each
    node once, as SPO-tree's edges. Needs the tree tensors ``TREE_KEYS``. Returns ``(advantages, advantages)``.
    """
    return _tree_rule(name, inputs, pav)

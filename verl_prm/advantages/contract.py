"""The tensor contract of the step inputs (docs: concepts.md) and its checks: shapes, argument values, and the
per-response flags of bad values that the estimators read from the host once per batch. Shapes as in
:mod:`verl_prm.advantages`.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def check_finite_argument(what: str, value: float) -> None:
    """A Python number argument (``alpha``) is finite: NaN or inf would reach every advantage."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")


def valid_steps(num_steps: torch.Tensor, max_steps: int) -> torch.Tensor:
    """Mask [B, S] of real steps: ``valid[i, h] = h < num_steps[i]``."""
    return torch.arange(max_steps, device=num_steps.device)[None, :] < num_steps[:, None]


def check_per_response(tensor: torch.Tensor, batch: int, what: str) -> None:
    """A [B] tensor of one entry per response (shape only: no host read)."""
    if tuple(tensor.shape) != (batch,):
        raise ValueError(
            f"{what} must have one entry per response, shape ({batch},), got shape {tuple(tensor.shape)}"
        )


GROUPS_ARGUMENT = "index (verl's uid of each response's prompt, as group ids)"
KEEP_ARGUMENT = "truncated (keep: which responses get a process term)"


def bad_input_rows(step_ids: torch.Tensor, step_values: torch.Tensor, prompt_values: torch.Tensor,
                   num_steps: torch.Tensor, outcome_rewards: torch.Tensor) -> torch.Tensor:
    """[B] bool: the responses that break the tensor contract of ``check_step_inputs``: ``num_steps`` outside
    [0, S]; a step id outside ``[-1, num_steps - 1]``; a real step's value or the prompt's value outside [0, 1]
    (NaN included); a non-finite outcome (``outcome_rewards``, the row sums of ``token_level_rewards``: a row
    holding NaN or +-inf, or one whose sum overflows). No host read."""
    small = bad_small_input_rows(step_values, prompt_values, num_steps, outcome_rewards)
    return bad_step_id_rows(step_ids, num_steps).to(small.device) | small


def bad_small_input_rows(step_values, prompt_values, num_steps, outcome_rewards) -> torch.Tensor:
    """The checks of ``bad_input_rows`` that read only the [B] and [B, S] tensors."""
    max_steps = step_values.shape[1]
    num_steps = num_steps.to(step_values.device)
    valid = torch.arange(max_steps, device=step_values.device)[None, :] < num_steps[:, None]
    bad_values = (valid & ~((step_values >= 0) & (step_values <= 1))).any(dim=1)
    bad_prompts = ~((prompt_values >= 0) & (prompt_values <= 1))
    bad_counts = (num_steps < 0) | (num_steps > max_steps)
    return bad_values | bad_prompts.to(bad_values.device) | bad_counts | ~torch.isfinite(outcome_rewards).to(
        bad_values.device)


def bad_step_id_rows(step_ids: torch.Tensor, num_steps: torch.Tensor) -> torch.Tensor:
    """[B] bool: responses holding a step id outside ``[-1, num_steps - 1]`` (one pass over ``step_ids``)."""
    if not step_ids.numel():
        return torch.zeros(step_ids.shape[0], dtype=torch.bool, device=step_ids.device)
    lowest, highest = torch.aminmax(step_ids.detach(), dim=1)
    return (lowest < -1) | (highest >= num_steps.detach().to(highest.device))


def check_step_shapes(step_ids, step_values, prompt_values, num_steps, response_mask, token_level_rewards=None) -> None:
    """The shape and dtype part of ``check_step_inputs`` (free: reads no tensor values)."""
    batch, length = response_mask.shape
    if step_ids.shape != (batch, length):
        raise ValueError(
            f"step_ids must have the shape of response_mask {tuple(response_mask.shape)}, got {tuple(step_ids.shape)}"
        )
    if step_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"step_ids must be int64 (or int32), got {step_ids.dtype}")
    if step_values.dim() != 2 or step_values.shape[0] != batch:
        raise ValueError(f"step_values must be [B={batch}, S], got {tuple(step_values.shape)}")
    if prompt_values.shape != (batch,):
        raise ValueError(f"prompt_values must be [B={batch}], got {tuple(prompt_values.shape)}")
    if num_steps.shape != (batch,):
        raise ValueError(f"num_steps must be [B={batch}], got {tuple(num_steps.shape)}")
    if not step_values.is_floating_point() or not prompt_values.is_floating_point():
        raise ValueError("step_values and prompt_values must be floating point")
    if token_level_rewards is not None and token_level_rewards.shape != (batch, length):
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same shape"
        )


def check_step_inputs(
    step_ids: torch.Tensor,
    step_values: torch.Tensor,
    prompt_values: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
    token_level_rewards: torch.Tensor | None = None,
    *,
    bad_rows: torch.Tensor | None = None,
) -> None:
    """Validate the step tensors (and ``token_level_rewards``, when given) against the contract; raise
    ``ValueError`` naming the first bad sample.

    Checked: ``0 <= num_steps <= S``; step ids in ``[-1, num_steps - 1]``; the values of the real steps and of
    the prompt in [0, 1] (NaN fails); every entry of ``token_level_rewards`` finite (verl sums the whole row,
    padding included, into the outcome).

    Cost. Shape checks are free. The value checks run on the tensors' own device as one [B] tensor of flags
    (``bad_input_rows``) that comes to the host in one read (one synchronisation on CUDA) per call. The two
    [B, T] inputs are checked through what an estimator computes anyway: the rewards through their row sums (the
    outcome; a row holding NaN or +-inf sums to NaN or +-inf), the step ids by a max reduction in the pass that
    reads them. ``bad_rows`` [B] bool: those flags as the estimators' fused lookup computes them
    (``process_advantage_and_bad_rows``), with the checks of the small tensors fused in; then the check is that
    one host read. Without it they are computed here (one pass over each [B, T] input). Only when a flag is set
    are the tensors read again, to name the sample.
    """
    check_step_shapes(step_ids, step_values, prompt_values, num_steps, response_mask, token_level_rewards)
    with torch.no_grad():
        if bad_rows is None:
            outcome = (token_level_rewards.detach().sum(dim=-1) if token_level_rewards is not None
                       else step_values.new_zeros(step_values.shape[0]))
            bad_rows = bad_input_rows(step_ids.detach(), step_values.detach(), prompt_values.detach(),
                                      num_steps.detach(), outcome)
        if not bad_rows.any().tolist():  # the one host read of a valid batch
            return
    _raise_first_bad_input(step_ids.detach(), step_values.detach().cpu(), prompt_values.detach().cpu(),
                           num_steps.detach().cpu(), None if token_level_rewards is None else
                           token_level_rewards.detach().cpu())


def _raise_first_bad_input(step_ids, values, prompts, num_steps, token_level_rewards) -> None:
    """The error of the first failed check, naming the sample (the tensors on the host: error path only)."""
    max_steps = values.shape[1]
    bad_num_steps = (num_steps < 0) | (num_steps > max_steps)
    bad_ids = bad_step_id_rows(step_ids, num_steps).cpu()
    bad_values = valid_steps(num_steps, max_steps) & ~((values >= 0) & (values <= 1))
    bad_prompts = ~((prompts >= 0) & (prompts <= 1))

    def first(bad: torch.Tensor) -> int:
        return int(torch.nonzero(bad)[0, 0])

    if bad_num_steps.any():
        i = first(bad_num_steps)
        raise ValueError(
            f"sample {i}: num_steps={int(num_steps[i])} is outside [0, S={max_steps}]; step_values must have "
            "a column for every step"
        )
    if bad_ids.any():
        i = first(bad_ids)
        row = step_ids[i].cpu()
        t = first((row < -1) | (row >= num_steps[i]))
        raise ValueError(
            f"sample {i}: token {t} has step_id {int(row[t])} but the response has "
            f"num_steps={int(num_steps[i])}; step ids must lie in [-1, num_steps - 1] (use -1 for tokens in no "
            "step), as verl_prm.steps.split_steps returns them"
        )
    if bad_values.any():
        i, h = (int(x) for x in torch.nonzero(bad_values)[0])
        raise ValueError(
            f"sample {i}: step_values[{i}, {h}] = {float(values[i, h])} is not a probability in [0, 1]; pass the "
            "critic's raw values (sigmoid outputs), not logits"
        )
    if bad_prompts.any():
        i = first(bad_prompts)
        raise ValueError(
            f"sample {i}: prompt_values[{i}] = {float(prompts[i])} is not a probability in [0, 1]; pass the "
            "critic's raw value of the prompt"
        )
    if token_level_rewards is None:
        raise ValueError("bad_rows flags responses that pass every check of the step tensors: pass the "
                         "token_level_rewards whose row sums it checked")
    bad = ~torch.isfinite(token_level_rewards)
    if not bad.any():  # every entry finite, but a row's sum overflows
        i = first(~torch.isfinite(token_level_rewards.sum(dim=-1)))
        raise ValueError(
            f"sample {i}: the sum of token_level_rewards[{i}] overflows to "
            f"{float(token_level_rewards[i].sum())}; the reward function must return finite scores of a "
            "representable size (verl sums the row into the response's outcome)"
        )
    i, t = (int(x) for x in torch.nonzero(bad.cpu())[0])
    raise ValueError(
        f"sample {i}: token_level_rewards[{i}, {t}] = {float(token_level_rewards[i, t])} is not finite; the reward "
        "function must return finite scores (verl sums the row into the response's outcome)"
    )

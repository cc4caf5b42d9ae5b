"""The math of process advantages (docs: concepts.md, "Progress and the effective reward"): small pure functions over torch tensors.

Reference: Setlur et al. 2024, "Rewarding Progress: Scaling Automated Process Verifiers for LLM Reasoning"
(the PAV paper), Eq. 5: the effective reward of step h is Q^pi(s_h, a_h) + alpha * A^mu(s_h, a_h), where the
process advantage (progress) A^mu is the change in the prover's value made by step h.

Shape convention, used by every function here:

    B: responses in the batch, T: padded response length, S: padded number of steps.
    step_ids       [B, T] int64   step (0-based) of each response token, -1 for tokens in no step
    step_values    [B, S] float   v_1..v_H of each response (prover values after each step); h >= H ignored
    prompt_values  [B]    float   v_0 (prover value of the prompt)
    num_steps      [B]    int64   H of each response (0 allowed)

Every function is vectorised over the batch (no Python loop over samples, steps or groups), does no
host-device synchronisation, and runs on CPU and CUDA tensors alike. Nothing here imports verl:
`verl_prm.estimators` registers these functions in verl's estimator registry.
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

import numpy as np
import torch

__all__ = [
    "AGGREGATIONS",
    "COMPILE_MODES",
    "FUSED_MIN_TOKENS",
    "aggregate_step_scores",
    "batch_baseline_outcome",
    "best_of_k",
    "check_step_inputs",
    "dense_step_rewards",
    "group_ids",
    "group_normalized_outcome",
    "leave_one_out_outcome",
    "leave_one_out_process_advantage",
    "leave_one_out_step_mean",
    "leave_one_out_step_rewards",
    "masked_whiten",
    "min_form_advantage",
    "min_form_step_rewards",
    "process_advantage",
    "process_scores",
    "rewards_to_go",
    "softmin_weights",
    "step_end_positions",
    "step_end_rewards",
    "step_progress",
    "step_scores_per_token",
    "valid_steps",
    "zero_signal_groups",
]

MIN_NORMALIZE_STD = 1e-3
# compile="auto" fuses the per-token lookup for batches of at least this many tokens; below it an eager call
# costs about a millisecond, and the one-time compilation (3-11 s on CPU) would not pay off.
FUSED_MIN_TOKENS = 1 << 20
COMPILE_MODES = ("auto", "always", "never")
AGGREGATIONS = ("min", "max", "mean", "sum", "product", "last")
Aggregation = Literal["min", "max", "mean", "sum", "product", "last"]


def best_of_k(q: torch.Tensor, k: int) -> torch.Tensor:
    """Value of the Best-of-K policy of a prover whose value is ``q``: ``1 - (1 - q)^k``.

    The Best-of-K policy of pi_b succeeds if any of K independent samples of pi_b succeeds, so a critic trained
    on Monte-Carlo labels of pi_b gives the BoK prover's value through this transform (PAV paper, Sec. 4).
    ``k = 1`` returns ``q`` unchanged.

    Args:
        q: values in [0, 1], any shape.
        k: integer >= 1.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"best_of_k: k must be an integer >= 1, got {k!r}")
    if k == 1:
        return q
    return 1.0 - torch.pow(1.0 - q, int(k))


def valid_steps(num_steps: torch.Tensor, max_steps: int) -> torch.Tensor:
    """Mask [B, S] of real steps: ``valid[i, h] = h < num_steps[i]``."""
    return torch.arange(max_steps, device=num_steps.device)[None, :] < num_steps[:, None]


def step_progress(step_values: torch.Tensor, prompt_values: torch.Tensor, num_steps: torch.Tensor) -> torch.Tensor:
    """Process advantage (progress) of each step: ``A_h = v_h - v_{h-1}`` with ``v_{-1} = prompt_values``.

    Indices are 0-based: ``A[i, 0] = step_values[i, 0] - prompt_values[i]``. The sum over the H real steps
    telescopes to ``v_{H-1} - v_0``. Entries at ``h >= num_steps[i]`` are 0 (whatever ``step_values`` holds
    there, NaN included).

    Args:
        step_values: [B, S] prover values after each step.
        prompt_values: [B] prover value of the prompt.
        num_steps: [B] number of real steps per response.

    Returns:
        [B, S] progress, 0 outside the real steps.
    """
    previous = torch.cat([prompt_values[:, None].to(step_values.dtype), step_values[:, :-1]], dim=1)
    progress = step_values - previous
    return torch.where(valid_steps(num_steps, step_values.shape[1]), progress, torch.zeros_like(progress))


def _lookup(table: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """``out[i, t] = table[i, clamp(step_ids[i, t], -1, S - 1) + 1]`` for a table of S + 1 columns whose column
    0 stands for "no step" (-1).

    The clamp keeps an out-of-range id (possible when ``pav.check_inputs`` is off) inside its own row: without
    it the flat index would read a neighbouring response's value. It costs one in-place pass over the int32 copy
    (within the run-to-run noise of ``verl-prm bench advantages --threads 1``)."""
    batch, columns = table.shape
    # One flat index_select over int32 indices: it reads the [B, T] step ids once and allocates no int64
    # [B, T] temporary (memory traffic dominates this function; on CPU a fresh 32 MB buffer also costs page
    # faults on every call).
    index_dtype = torch.int32 if batch * columns < 2**31 else torch.int64
    row_starts = torch.arange(batch, device=step_ids.device, dtype=index_dtype)[:, None] * columns + 1
    # copy=True: int32 step_ids would otherwise be the same tensor, and add_ would change the caller's ids
    flat_index = step_ids.to(index_dtype, copy=True).clamp_(-1, columns - 2).add_(row_starts)
    return table.reshape(-1).index_select(0, flat_index.reshape(-1)).view(step_ids.shape)


def step_scores_per_token(step_scores: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """Broadcast per-step scores to the tokens of each step: ``out[i, t] = step_scores[i, step_ids[i, t]]``.

    Tokens in no step (``step_ids == -1``) get 0. ``step_ids`` must lie in [-1, S - 1]; an id outside is clamped
    into it (it reads its own row, never another response's).

    Args:
        step_scores: [B, S] one score per step.
        step_ids: [B, T] step of each token, -1 for none.

    Returns:
        [B, T] score of the step each token belongs to.
    """
    return _lookup(torch.nn.functional.pad(step_scores, (1, 0)), step_ids)


def group_ids(index, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Contiguous group ids 0..G-1 of verl's ``index`` (the ``uid`` of each response's prompt).

    ``index`` is verl's host-side numpy array of uids (any hashable, sortable labels), a list, or a torch
    tensor (then grouped on its own device with ``torch.unique``).

    Returns:
        ``(groups [B] int64, G)``.
    """
    if isinstance(index, torch.Tensor):
        uniques, inverse = torch.unique(index.reshape(-1), return_inverse=True)
        return inverse.to(device if device is not None else index.device), int(uniques.numel())
    labels = np.asarray(index)
    if labels.ndim != 1:
        raise ValueError(f"index must be one label per response (1-D), got shape {labels.shape}")
    try:
        uniques, inverse = np.unique(labels, return_inverse=True)
    except TypeError as error:
        raise TypeError(
            "index labels must be mutually comparable (verl's uids are strings); got mixed types "
            f"{sorted({type(x).__name__ for x in labels.tolist()})}"
        ) from error
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device), int(len(uniques))


def _check_per_response(tensor: torch.Tensor, batch: int, what: str) -> None:
    """A [B] tensor of one entry per response (shape only: no host read)."""
    if tuple(tensor.shape) != (batch,):
        raise ValueError(
            f"{what} must have one entry per response, shape ({batch},), got shape {tuple(tensor.shape)}"
        )


_GROUPS = "index (verl's uid of each response's prompt, as group ids)"
_KEEP = "truncated (keep: which responses get a process term)"


def _group_sums(values: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    _check_per_response(groups, values.shape[0], _GROUPS)
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, groups, values)


def group_normalized_outcome(
    scores: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    *,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """GRPO's outcome advantage, exactly as verl's ``grpo`` estimator computes it.

    ``out_i = (R_i - mean_g R) / (std_g R + epsilon)`` with the unbiased std over the group g of response i;
    a group of one has mean 0 and std 1. With ``norm_by_std=False``: ``out_i = R_i - mean_g R`` (Dr. GRPO).

    Args:
        scores: [B] outcome R_i of each response.
        groups: [B] group id in 0..G-1 (see ``group_ids``).
        num_groups: G.
    """
    counts = _group_sums(torch.ones_like(scores), groups, num_groups)
    mean = _group_sums(scores, groups, num_groups) / counts
    squared_deviation = _group_sums((scores - mean[groups]) ** 2, groups, num_groups)
    std = torch.sqrt(squared_deviation / (counts - 1).clamp_min(1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    centered = scores - mean[groups]
    return centered / (std[groups] + epsilon) if norm_by_std else centered


def zero_signal_groups(scores: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[G] bool: groups whose outcome scores are all equal, ``max_{i in g} R_i == min_{i in g} R_i``.

    Such a group has a zero group-relative outcome advantage on every response (GRPO and RLOO learn nothing
    from it); only a process term gives its responses a signal. ``scores`` [B], ``groups`` [B] ids in [0, G).
    A group id without responses counts as no signal.
    """
    _check_per_response(groups, scores.shape[0], _GROUPS)
    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((num_groups,), torch.inf, dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, groups, scores, reduce="amax")
    low = low.scatter_reduce(0, groups, scores, reduce="amin")
    return (high <= low) | torch.isinf(high)


def leave_one_out_outcome(scores: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """RLOO's outcome advantage, as verl's ``rloo``: ``out_i = R_i - mean_{j in g, j != i} R_j``.

    Equivalently ``(n R_i - sum_g R) / (n - 1)`` for a group of n > 1; a group of one keeps ``R_i``.
    """
    counts = _group_sums(torch.ones_like(scores), groups, num_groups)[groups]
    totals = _group_sums(scores, groups, num_groups)[groups]
    loo = (counts * scores - totals) / (counts - 1).clamp_min(1)
    return torch.where(counts > 1, loo, scores)


def batch_baseline_outcome(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE with a batch-mean baseline (the PAV paper's online RL): ``out_i = R_i - mean_batch R``."""
    return scores - scores.mean()


def process_scores(
    step_values: torch.Tensor,
    prompt_values: torch.Tensor,
    num_steps: torch.Tensor,
    *,
    best_of_k_k: int = 1,
    use_values: bool = False,
    clip: float | None = None,
    normalize: bool = False,
    keep: torch.Tensor | None = None,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Per-step process scores: progress of the (Best-of-K transformed) prover values, with the safeguards.

    In order:
      1. ``v = best_of_k(step_values, K)``, ``v_0 = best_of_k(prompt_values, K)``;
      2. ``p_h = v_h - v_{h-1}`` (``step_progress``), or ``p_h = v_h`` when ``use_values`` (the reward-hackable
         Q-as-reward ablation of the paper's App. G);
      3. ``clip``: ``p_h <- clamp(p_h, -clip, clip)``;
      4. ``keep`` [B] bool: responses where it is False get no process score (e.g. truncated responses);
      5. ``normalize``: ``p_h <- p_h / (std + epsilon)``, std the unbiased std of p over the real steps of the
         kept responses in the batch; left unscaled when there are fewer than two such steps or
         ``std < MIN_NORMALIZE_STD`` (a constant term has no scale, and dividing by ~0 would blow it up).

    Returns:
        [B, S] scores, 0 at ``h >= num_steps`` and for responses not kept.
    """
    values = best_of_k(step_values, best_of_k_k)
    if use_values:
        valid = valid_steps(num_steps, values.shape[1])
        scores = torch.where(valid, values, torch.zeros_like(values))
    else:
        scores = step_progress(values, best_of_k(prompt_values, best_of_k_k), num_steps)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    if keep is not None:
        _check_per_response(keep, scores.shape[0], _KEEP)
        scores = scores * keep[:, None].to(scores.dtype)
    if normalize:
        counted = valid_steps(num_steps, scores.shape[1])
        if keep is not None:
            counted = counted & keep[:, None].bool()
        counted = counted.to(scores.dtype)
        n = counted.sum()
        mean = (scores * counted).sum() / n.clamp_min(1)
        variance = (((scores - mean) * counted) ** 2).sum() / (n - 1).clamp_min(1)
        std = torch.sqrt(variance)
        # A (nearly) constant process term has no scale to normalise: dividing by ~0 would blow it up.
        usable = (n > 1) & (std >= MIN_NORMALIZE_STD)
        scores = scores / torch.where(usable, std + epsilon, torch.ones_like(std))
    return scores


def process_advantage(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    compile: str = "auto",
) -> torch.Tensor:
    """Token advantages of the effective reward (PAV paper Eq. 5).

    ``adv[i, t] = (out_i + alpha * p_{i, step_ids[i, t]}) * response_mask[i, t]``, where tokens in no step
    (``step_ids = -1``) get ``out_i * response_mask[i, t]``. The process score of step h enters only the tokens
    of step h; it is not summed into a return over later steps.

    Args:
        outcome_advantage: [B] out_i (GRPO, RLOO or batch-baseline outcome advantage).
        step_scores: [B, S] process score of each step (``process_scores``).
        step_ids: [B, T]; response_mask: [B, T].
        alpha: weight of the process term.
        compile: how the per-token lookup runs. ``"never"``: eager PyTorch (four passes over [B, T]).
            ``"always"``: one fused kernel made by ``torch.compile`` (compiled once per process and input
            dtypes; needs a C++ compiler on CPU, Triton on GPU). ``"auto"``: the fused kernel for batches of at
            least ``FUSED_MIN_TOKENS`` tokens, eager below; if compilation fails it warns once and stays eager.
            All three give the same numbers.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    # Column 0 of the table is the "no step" entry: out_i alone.
    table = torch.add(outcome_advantage[:, None], torch.nn.functional.pad(step_scores, (1, 0)), alpha=alpha)
    table = table.to(outcome_advantage.dtype)
    if compile == "always" or (compile == "auto" and step_ids.numel() >= FUSED_MIN_TOKENS):
        return _fused_masked_lookup(table, step_ids, response_mask, fall_back=compile == "auto")
    return _lookup(table, step_ids).mul_(response_mask)


def _masked_lookup(table: torch.Tensor, step_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``out[i, t] = table[i, step_ids[i, t] + 1] * response_mask[i, t]``, written as one expression so that
    ``torch.compile`` makes it a single pass that reads ``step_ids`` and the mask once and writes ``out``. Ids are
    clamped as in ``_lookup`` (free inside the fused kernel; on CUDA an out-of-range gather would be a device-side
    assert that ends the process)."""
    columns = table.shape[1]
    return torch.gather(table, 1, (step_ids.long() + 1).clamp(0, columns - 1)) * response_mask.to(table.dtype)


_compiled_lookup = None
_compile_failed: str | None = None
_compile_lock = threading.Lock()
_log = logging.getLogger(__name__)


def _fused_masked_lookup(table, step_ids, response_mask, *, fall_back: bool) -> torch.Tensor:
    """The compiled ``_masked_lookup``; with ``fall_back``, a failed compilation warns once and runs eager."""
    global _compiled_lookup, _compile_failed
    if fall_back and _compile_failed is not None:
        return _lookup(table, step_ids).mul_(response_mask)
    with _compile_lock:
        if _compiled_lookup is None:
            # dynamic=True: one kernel for every batch size and response length (no recompiles as they change).
            _compiled_lookup = torch.compile(_masked_lookup, dynamic=True)
    try:
        return _compiled_lookup(table, step_ids, response_mask)
    except torch._dynamo.exc.TorchDynamoException as error:  # compilation failed (no C++ compiler, no Triton)
        if not fall_back:
            raise
        eager = _lookup(table, step_ids).mul_(response_mask)  # bad inputs raise their own error here
        _compile_failed = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        _log.warning(
            "verl-prm: torch.compile of the per-token advantage lookup failed (%s); using eager PyTorch, which "
            "is about 1.5x slower on large CPU batches. Set algorithm.pav.compile=never to skip the attempt.",
            _compile_failed,
        )
        return eager


def aggregate_step_scores(step_scores: torch.Tensor, num_steps: torch.Tensor, how: Aggregation) -> torch.Tensor:
    """One score per response from its step scores (Pan et al. 2023's aggregation functions).

    Over the real steps h < H of response i: ``min``, ``max``, ``mean``, ``sum``, ``product`` or ``last``
    (the score of step H-1). A response with no steps gets 0 for every aggregation (no process evidence).

    Args:
        step_scores: [B, S]; num_steps: [B]; how: one of ``AGGREGATIONS``.

    Returns:
        [B] aggregated score.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    batch, max_steps = step_scores.shape
    zeros = step_scores.new_zeros(batch)
    if max_steps == 0:
        return zeros
    valid = valid_steps(num_steps, max_steps)
    if how in ("sum", "mean"):
        total = torch.where(valid, step_scores, torch.zeros_like(step_scores)).sum(dim=1)
        result = total if how == "sum" else total / num_steps.clamp_min(1).to(step_scores.dtype)
    elif how == "min":
        result = torch.where(valid, step_scores, torch.full_like(step_scores, float("inf"))).amin(dim=1)
    elif how == "max":
        result = torch.where(valid, step_scores, torch.full_like(step_scores, float("-inf"))).amax(dim=1)
    elif how == "product":
        result = torch.where(valid, step_scores, torch.ones_like(step_scores)).prod(dim=1)
    else:  # last
        last = (num_steps - 1).clamp(min=0, max=max_steps - 1)
        result = torch.gather(step_scores, 1, last[:, None].long()).squeeze(1)
    return torch.where(num_steps > 0, result, zeros)


def dense_step_rewards(step_scores: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """Per-token rewards with step h's score at the last token of step h, 0 elsewhere: ``[B, T]``.

    This is the form a learned-critic PPO run (verl's GAE) takes the process term in: added to
    ``token_level_rewards``, each step's progress is rewarded once, where the step ends.
    """
    following = torch.nn.functional.pad(step_ids[:, 1:], (0, 1), value=-1)
    is_step_end = (step_ids >= 0) & (following != step_ids)
    return step_scores_per_token(step_scores, step_ids) * is_step_end.to(step_scores.dtype)


def check_step_inputs(
    step_ids: torch.Tensor,
    step_values: torch.Tensor,
    prompt_values: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
) -> None:
    """Validate the step tensors against the contract; raise ``ValueError`` naming the first bad sample.

    Shape checks are free; the value checks read the tensors on the host once (one synchronisation), so the
    estimators run them only while ``pav.check_inputs`` is on (the default).
    """
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
    max_steps = step_values.shape[1]
    num_steps_h = num_steps.detach().cpu()
    valid = valid_steps(num_steps_h, max_steps)
    values_h = step_values.detach().cpu().float()
    prompt_h = prompt_values.detach().cpu().float()

    def first(bad: torch.Tensor) -> int:
        return int(torch.nonzero(bad)[0, 0])

    bad = (num_steps_h < 0) | (num_steps_h > max_steps)
    if bad.any():
        i = first(bad)
        raise ValueError(
            f"sample {i}: num_steps={int(num_steps_h[i])} is outside [0, S={max_steps}]; step_values must have "
            "a column for every step"
        )
    if step_ids.numel():
        # One pass over [B, T] on the tensors' own device; only [B] row extremes come to the host.
        lowest, highest = torch.aminmax(step_ids.detach(), dim=1)
        bad_rows = ((lowest < -1) | (highest >= num_steps.to(highest.device))).cpu()
    else:
        bad_rows = torch.zeros(batch, dtype=torch.bool)
    if bad_rows.any():
        i = first(bad_rows)
        row = step_ids[i].detach().cpu()
        t = first((row < -1) | (row >= num_steps_h[i]))
        raise ValueError(
            f"sample {i}: token {t} has step_id {int(row[t])} but the response has "
            f"num_steps={int(num_steps_h[i])}; step ids must lie in [-1, num_steps - 1] (use -1 for tokens in no "
            "step), as verl_prm.steps.split_steps returns them"
        )
    in_range = (values_h >= 0) & (values_h <= 1)
    bad = valid & ~in_range
    if bad.any():
        i, h = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"sample {i}: step_values[{i}, {h}] = {float(values_h[i, h])} is not a probability in [0, 1]; pass the "
            "critic's raw values (sigmoid outputs), not logits"
        )
    bad = ~((prompt_h >= 0) & (prompt_h <= 1))
    if bad.any():
        i = first(bad)
        raise ValueError(
            f"sample {i}: prompt_values[{i}] = {float(prompt_h[i])} is not a probability in [0, 1]; pass the "
            "critic's raw value of the prompt"
        )


# ------------------------------------------------------------------------------------------------------------
# Credit assignment of the anchors: PURE's min-form (Cheng et al. 2025) and PRIME's leave-one-out process
# returns (Cui et al. 2025), over the process scores p [B, S] of ``process_scores``. Both place step h's reward
# at the last token of step h and sum rewards over later tokens (returns, gamma = 1), unlike
# ``process_advantage``, whose process term of step h enters only the tokens of step h.


def step_end_positions(step_ids: torch.Tensor, max_steps: int) -> torch.Tensor:
    """Position of the last token of each step: ``ends[i, h] = max{t : step_ids[i, t] = h}``, -1 for a step with
    no token (and for h >= H). Exact when a step's tokens are interrupted by tokens in no step. Ids outside
    ``[-1, S-1]`` are clamped into it (they pass unchecked only with ``check_inputs=false``).

    Args:
        step_ids: [B, T] step of each token, -1 for none; max_steps: S.

    Returns:
        [B, S] int64.
    """
    batch, length = step_ids.shape
    positions = torch.arange(length, device=step_ids.device).expand(batch, length)
    # column 0 collects the tokens in no step (-1) and is dropped
    ends = torch.full((batch, max_steps + 1), -1, dtype=torch.long, device=step_ids.device)
    # ids outside [-1, S-1] (possible only with check_inputs=false) are clamped, as in process_advantage: a bad
    # id then lands in its own row, never out of bounds
    columns = step_ids.long().clamp(-1, max_steps - 1) + 1
    ends = ends.scatter_reduce(1, columns, positions, reduce="amax", include_self=True)
    return ends[:, 1:]


def step_end_rewards(step_rewards: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """Token rewards ``d[i, t] = step_rewards[i, h]`` at the last token t of step h (``step_end_positions``), 0
    elsewhere: [B, T]. A step with no token has nowhere to go (``verl_prm.steps.split_steps`` makes none)."""
    ends = step_end_positions(step_ids, step_rewards.shape[1])
    has_token = ends >= 0
    rewards = torch.zeros(step_ids.shape, dtype=step_rewards.dtype, device=step_rewards.device)
    placed = torch.where(has_token, step_rewards, torch.zeros_like(step_rewards))
    return rewards.scatter_add_(1, ends.clamp(min=0), placed)


def rewards_to_go(token_rewards: torch.Tensor) -> torch.Tensor:
    """Undiscounted returns ``G[i, t] = sum_{t' >= t} d[i, t']`` (gamma = 1), the reverse cumulative sum: [B, T]."""
    return token_rewards.flip(1).cumsum(1).flip(1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased variance over the tokens where ``mask``
    is set (verl's ``masked_whiten``, which PRIME applies to its returns); 0 where ``mask`` is not set. With fewer
    than two such tokens there is no variance: the values are only centred."""
    weights = mask.to(values.dtype)
    count = weights.sum()
    mean = (values * weights).sum() / count.clamp_min(1)
    variance = (((values - mean) ** 2) * weights).sum() / (count - 1).clamp_min(1)
    scale = torch.where(count > 1, torch.rsqrt(variance + 1e-8), torch.ones_like(variance))
    return (values - mean) * scale * weights


def softmin_weights(step_scores: torch.Tensor, num_steps: torch.Tensor, temperature: float) -> torch.Tensor:
    """PURE's min-form weights over the real steps of each response (Cheng et al. 2025, "Stop Summation").

    ``w[i, h] = exp(-p[i, h] / T) / sum_{k < H_i} exp(-p[i, k] / T)`` for h < H_i, 0 beyond. ``T = 0`` is the
    limit T -> 0: ``w = 1/m`` on the m steps that attain ``min_h p[i, h]``, 0 elsewhere. A response with no step
    has no weights.

    Args:
        step_scores: [B, S] p; num_steps: [B] H; temperature: T >= 0 (PURE uses 0.1).

    Returns:
        [B, S] weights; each row with H_i > 0 sums to 1.
    """
    valid = valid_steps(num_steps, step_scores.shape[1])
    zeros = torch.zeros_like(step_scores)
    if step_scores.shape[1] == 0:
        return zeros
    if temperature > 0:
        logits = torch.where(valid, -step_scores / temperature, torch.full_like(step_scores, float("-inf")))
        weights = torch.softmax(logits, dim=1)  # a row without steps is NaN here and is zeroed below
    else:
        masked = torch.where(valid, step_scores, torch.full_like(step_scores, float("inf")))
        at_min = valid & (masked == masked.amin(dim=1, keepdim=True))
        weights = at_min.to(step_scores.dtype) / at_min.sum(dim=1, keepdim=True).clamp_min(1).to(step_scores.dtype)
    return torch.where(valid, weights, zeros)


def min_form_step_rewards(step_scores: torch.Tensor, num_steps: torch.Tensor, temperature: float) -> torch.Tensor:
    """PURE's min-form process rewards: ``r[i, h] = w[i, h] * p[i, h]`` with ``w = softmin_weights``.

    Their sum over a response's steps is a soft minimum of its step scores (the hard minimum at ``T = 0``), so the
    return of every token is governed by the worst step instead of the sum of all steps. 0 at h >= H_i.
    """
    valid = valid_steps(num_steps, step_scores.shape[1])
    scores = torch.where(valid, step_scores, torch.zeros_like(step_scores))
    return softmin_weights(step_scores, num_steps, temperature) * scores


def _leave_one_out_counts(step_rewards, num_steps, groups, num_groups, keep):
    """Per response: its mean step reward m_i, whether it is counted (H_i > 0 and kept), and the group's count
    and sum of m over counted responses (broadcast to the response)."""
    valid = valid_steps(num_steps, step_rewards.shape[1])
    totals = torch.where(valid, step_rewards, torch.zeros_like(step_rewards)).sum(dim=1)
    means = totals / num_steps.clamp_min(1).to(step_rewards.dtype)
    counted = num_steps > 0
    if keep is not None:
        _check_per_response(keep, step_rewards.shape[0], _KEEP)
        counted = counted & keep.bool()
    counted_f = counted.to(step_rewards.dtype)
    group_count = _group_sums(counted_f, groups, num_groups)[groups]
    group_total = _group_sums(means * counted_f, groups, num_groups)[groups]
    return means, counted, counted_f, group_count, group_total


def leave_one_out_step_mean(
    step_rewards: torch.Tensor,
    num_steps: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PURE's "step" baseline: the mean, over the other responses of the same prompt, of their mean step reward.

    ``b_i = (1 / |O_i|) sum_{j in O_i} m_j`` with ``m_j = (1 / H_j) sum_{h < H_j} r[j, h]`` and O_i the responses
    of i's group other than i that have steps (and are kept, when ``keep`` [B] bool is given); ``b_i = 0`` when
    O_i is empty.

    Returns:
        [B] baseline.
    """
    means, counted, counted_f, group_count, group_total = _leave_one_out_counts(step_rewards, num_steps, groups,
                                                                               num_groups, keep)
    others = group_count - counted_f
    baseline = (group_total - means * counted_f) / others.clamp_min(1)
    return torch.where(others > 0, baseline, torch.zeros_like(baseline))


def min_form_advantage(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    groups: torch.Tensor,
    num_groups: int,
    temperature: float = 0.1,
    baseline: bool = True,
    zero_separators: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PURE's min-form credit assignment (Cheng et al. 2025) with the process scores p as the PRM's rewards.

    1. ``r = min_form_step_rewards(p, T)`` (softmin-weighted step rewards);
    2. ``q[i, h] = r[i, h] - b_i`` for the real steps h < H_i, with ``b = leave_one_out_step_mean(r)`` when
       ``baseline`` (PURE's ``reward_baseline=step``), else ``q = r``; ``q = 0`` for responses not in ``keep``;
    3. ``d[i, t] = q[i, h]`` at the last token t of step h (``step_end_rewards``);
    4. ``adv[i, t] = (out_i + alpha * sum_{t' >= t} d[i, t']) * response_mask[i, t]``;
    5. ``zero_separators``: ``adv[i, t] = 0`` at the last token of every step h < H_i - 1 (the token that holds
       the step delimiter; PURE gives its step-separator tokens no loss). The last step's last token is answer
       text and keeps its advantage.

    Args:
        outcome_advantage: [B] out_i (RLOO of the outcome in the ``pav_pure`` estimator, as in PURE).
        step_scores: [B, S] p; step_ids: [B, T]; num_steps: [B]; response_mask: [B, T].
        alpha: weight of the process return. groups, num_groups: prompt groups (``group_ids``).
        temperature: T >= 0 of the softmin (PURE: 0.1; 0: the hard minimum).
        keep: [B] bool, responses that get a process term (and enter the baseline); default all.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    valid = valid_steps(num_steps, step_scores.shape[1])
    rewards = min_form_step_rewards(step_scores, num_steps, temperature)
    if baseline:
        rewards = rewards - leave_one_out_step_mean(rewards, num_steps, groups, num_groups, keep)[:, None]
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    if keep is not None:
        _check_per_response(keep, rewards.shape[0], _KEEP)
        rewards = rewards * keep[:, None].to(rewards.dtype)
    returns = rewards_to_go(step_end_rewards(rewards, step_ids))
    advantages = (outcome_advantage[:, None] + alpha * returns).to(outcome_advantage.dtype)
    advantages = advantages * response_mask.to(advantages.dtype)
    if zero_separators:
        advantages = advantages * (~_separator_tokens(step_ids, num_steps, step_scores.shape[1])).to(advantages.dtype)
    return advantages


def _separator_tokens(step_ids: torch.Tensor, num_steps: torch.Tensor, max_steps: int) -> torch.Tensor:
    """[B, T] bool: the last token of every step h < H_i - 1."""
    batch, length = step_ids.shape
    ends = step_end_positions(step_ids, max_steps)
    marked = (torch.arange(max_steps, device=step_ids.device)[None, :] < (num_steps[:, None] - 1)) & (ends >= 0)
    # distinct steps end at distinct tokens; unmarked steps write False into the spare column `length`
    target = torch.where(marked, ends, torch.full_like(ends, length))
    tokens = torch.zeros((batch, length + 1), dtype=torch.bool, device=step_ids.device)
    return tokens.scatter_(1, target, marked)[:, :length]


def leave_one_out_step_rewards(
    step_scores: torch.Tensor,
    num_steps: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's leave-one-out on process rewards (Cui et al. 2025, ``compute_rloo_returns``), one reward per step.

    ``q[i, h] = p[i, h] * n / (n - 1) - (sum_{j in g} m_j) / (n - 1)`` for the real steps h < H_i, with
    ``m_j = (1 / H_j) sum_{h < H_j} p[j, h]`` and the sum and n over the responses j of i's group g that have
    steps (and are kept, when ``keep`` [B] bool is given). Equivalently
    ``q[i, h] = p[i, h] - (sum_{j != i} m_j + m_i - p[i, h]) / (n - 1)``. A group with n = 1 keeps ``q = p`` (no
    other response to compare with); responses not counted get ``q = 0``.

    Returns:
        [B, S] transformed step rewards, 0 at h >= H_i.
    """
    valid = valid_steps(num_steps, step_scores.shape[1])
    scores = torch.where(valid, step_scores, torch.zeros_like(step_scores))
    _, counted, _, group_count, group_total = _leave_one_out_counts(scores, num_steps, groups, num_groups, keep)
    n = group_count[:, None]
    loo = (scores * n - group_total[:, None]) / (n - 1).clamp_min(1)
    rewards = torch.where(n > 1, loo, scores)
    return torch.where(valid & counted[:, None], rewards, torch.zeros_like(rewards))


def leave_one_out_process_advantage(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    groups: torch.Tensor,
    num_groups: int,
    whiten: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's advantage (Cui et al. 2025, ``compute_rloo_returns``) with the process scores p as the process
    rewards in place of the implicit PRM's.

    1. ``q = leave_one_out_step_rewards(p)``; ``d[i, t] = q[i, h]`` at the last token t of step h;
    2. ``G[i, t] = out_i + alpha * sum_{t' >= t} d[i, t']`` (gamma = 1; out_i is PRIME's leave-one-out outcome,
       whose reward sits at the last token, so its return reaches every token of the response);
    3. ``adv = masked_whiten(G, response_mask)`` when ``whiten`` (PRIME whitens the summed returns over the
       batch's response tokens), else ``G * response_mask``.

    Args:
        outcome_advantage: [B] out_i (``leave_one_out_outcome`` of the outcome in the ``pav_prime`` estimator).
        step_scores: [B, S]; step_ids: [B, T]; num_steps: [B]; response_mask: [B, T]; alpha: process weight.
        groups, num_groups: prompt groups. keep: [B] bool, responses that get a process term; default all.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    rewards = leave_one_out_step_rewards(step_scores, num_steps, groups, num_groups, keep)
    returns = outcome_advantage[:, None] + alpha * rewards_to_go(step_end_rewards(rewards, step_ids))
    returns = returns.to(outcome_advantage.dtype)
    if whiten:
        return masked_whiten(returns, response_mask)
    return returns * response_mask.to(returns.dtype)

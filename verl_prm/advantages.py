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
host-device synchronisation and no hidden transfer (``group_ids`` of host labels makes the one explicit upload,
asynchronous), and runs on CPU and CUDA tensors alike. Nothing here imports verl: `verl_prm.estimators`
registers these functions in verl's estimator registry.

Checks. The functions check what costs no host read: shapes, Python arguments (``alpha`` and the temperature
finite and in range, option names). They never read tensor values, so NaN or inf in a tensor argument
propagates to the result unchecked. The estimators are the checked door: with ``algorithm.pav.check_inputs``
(the default) :func:`check_step_inputs` validates every input tensor, ``token_level_rewards`` included, in one
host read per batch.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

import numpy as np
import torch

from verl_prm.choices import AGGREGATIONS, COMPILE_MODES, MIN_FORM_BASELINES, PRIME_REWARD_MASKS, Aggregation

__all__ = [
    "FUSED_MIN_TOKENS",
    "MIN_SOFTMIN_TEMPERATURE",
    "aggregate_step_scores",
    "batch_baseline_outcome",
    "best_of_k",
    "check_softmin_temperature",
    "check_step_inputs",
    "check_step_shapes",
    "group_ids",
    "group_normalized_outcome",
    "leave_one_out_outcome",
    "leave_one_out_process_advantage",
    "leave_one_out_response_rewards",
    "leave_one_out_step_mean",
    "leave_one_out_step_rewards",
    "leave_one_out_token_baseline",
    "masked_whiten",
    "min_form_advantage",
    "min_form_step_rewards",
    "process_advantage",
    "process_advantage_and_bad_rows",
    "bad_input_rows",
    "bad_step_id_rows",
    "process_scores",
    "pure_whiten",
    "response_end_positions",
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
# Smallest positive softmin temperature: the logits -p/T stay finite in float32 (max 3.4e38) for |p| <= 1000, the
# bound of the estimators' process scores (progress or values in [-1, 1], divided by a std >= 1e-3 when
# pav.normalize is on): 1000 / 1e-30 = 1e33.
MIN_SOFTMIN_TEMPERATURE = 1e-30


def _check_finite(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")


def best_of_k(q: torch.Tensor, k: int) -> torch.Tensor:
    """Value of the Best-of-K policy of a prover whose value is ``q``: ``1 - (1 - q)^k``.

    The Best-of-K policy of pi_b succeeds if any of K independent samples of pi_b succeeds, so a critic trained
    on Monte-Carlo labels of pi_b gives the BoK prover's value through this transform (PAV paper, Sec. 4; its
    best provers were Bo4). ``k = 1`` returns ``q`` unchanged.

    This is the one description of Best-of-K; every setting of it refers here. It must be applied once to a
    critic's raw values: the estimators and the search apply it (``algorithm.pav.best_of_k``, ``--best-of-k``), so
    a critic that already gives Best-of-K values keeps K = 1 there: one loaded with
    ``ProverCritic(best_of_k=K)``, or one trained by ``verl-prm train --best-of-k K`` (whose labels were
    transformed from their counts, ``verl_prm.labeling.format.best_of_k_from_counts``). The verl hook therefore
    loads its critic with K = 1, and the TRL trainer refuses a critic and ``pav.best_of_k`` that both apply it.

    Args:
        q: values in [0, 1], any shape.
        k: integer >= 1.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"best_of_k: k must be an integer >= 1, got {k!r}")
    if k == 1:
        return q
    return 1.0 - _integer_power(1.0 - q, int(k))


def _integer_power(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x ** k`` for an integer ``k >= 1`` by repeated squaring: log2(k) multiplies (``torch.pow`` with an integer
    exponent above 3 runs a scalar loop on CPU, measured ~20x a multiply on a [2048, 32] tensor)."""
    result = None
    while True:
        if k & 1:
            result = x if result is None else result * x
        k >>= 1
        if not k:
            return result
        x = x * x


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
    """Group ids of verl's ``index`` (the ``uid`` of each response's prompt): responses with equal labels share
    an id in [0, G).

    - Host labels (verl's numpy array of uids, a list; any mutually comparable labels): grouped on the host
      (ids in sorted label order), ids 0..G-1 with G the exact number of groups, on ``device``. For a CUDA ``device`` this is
      one explicit upload, from pinned memory and asynchronous (no host synchronisation).
    - A torch tensor of integer labels (e.g. ids made once per batch by this function): grouped on its own
      device without leaving it and without a host read (a stable sort; ids dense in sorted label order), with
      ``G = B``, the number of responses: an upper bound of the group count (a group id without responses is
      an empty slot in every group sum). ``device`` must be None or the tensor's device.

    Returns:
        ``(groups [B] int64, G)``.
    """
    if isinstance(index, torch.Tensor):
        if device is not None and torch.device(device) != index.device:
            raise ValueError(
                f"index is a tensor on {index.device} but the batch is on {torch.device(device)}: pass the group "
                "ids on the batch's device (group_ids(uids, device) makes them once per batch)"
            )
        return _device_group_ids(index.reshape(-1))
    labels = np.asarray(index)
    if labels.ndim != 1:
        raise ValueError(f"index must be one label per response (1-D), got shape {labels.shape}")
    codes, count = _sorted_label_ids(labels.tolist())
    ids = torch.from_numpy(codes)
    if device is not None and torch.device(device).type == "cuda":
        # pinned + non_blocking: the copy is queued on the stream and the host does not wait for it
        ids = ids.pin_memory().to(device, non_blocking=True)
    elif device is not None and torch.device(device).type != "cpu":
        ids = ids.to(device)
    return ids, count


def _sorted_label_ids(labels: list) -> tuple[np.ndarray, int]:
    """``(ids [B] int64, G)``: ids of host labels in sorted label order (``np.unique(labels,
    return_inverse=True)``'s), computed by numbering the labels in a dict by first appearance and sorting only the
    G distinct ones (measured 2-4x faster than ``np.unique``, which sorts all B labels with Python comparisons)."""
    first_seen: dict = {}
    codes = np.fromiter((first_seen.setdefault(label, len(first_seen)) for label in labels), dtype=np.int64,
                        count=len(labels))
    distinct = list(first_seen)
    try:
        order = sorted(range(len(distinct)), key=distinct.__getitem__)
    except TypeError as error:
        raise TypeError(
            "index labels must be mutually comparable (verl's uids are strings); got mixed types "
            f"{sorted({type(x).__name__ for x in distinct})}"
        ) from error
    rank = np.empty(len(distinct), dtype=np.int64)
    rank[order] = np.arange(len(distinct))
    return rank[codes], len(distinct)


def _device_group_ids(labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group ids of integer ``labels`` [B] on their own device, no host read: sort, mark where the sorted
    label changes, count the changes (``cumsum``), scatter back. Returns ``(ids, B)``."""
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"index as a tensor must hold integer labels (group ids), got dtype {labels.dtype}")
    batch = labels.shape[0]
    sorted_labels, order = torch.sort(labels, stable=True)
    starts = torch.ones(batch, dtype=torch.long, device=labels.device)
    if batch > 1:
        starts[1:] = (sorted_labels[1:] != sorted_labels[:-1]).long()
    dense = torch.cumsum(starts, 0) - 1
    return torch.empty_like(dense).scatter_(0, order, dense), batch


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
    return process_advantage_and_bad_rows(outcome_advantage, step_scores, step_ids, response_mask, alpha,
                                          compile=compile)[0]


def process_advantage_and_bad_rows(
    outcome_advantage: torch.Tensor,
    step_scores: torch.Tensor,
    step_ids: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    *,
    checked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    compile: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``process_advantage``, and with ``checked = (step_values, prompt_values, num_steps, outcome_rewards)`` the
    responses that break the tensor contract (``bad_input_rows``).

    Returns ``(advantages [B, T], bad_rows [B] bool or None)``. The fused kernel computes the flags in the pass
    that reads ``step_ids`` for the lookup, so the estimators' input check costs no pass of its own and no extra
    small kernels (``check_step_inputs(bad_rows=...)``); the eager path computes them with ``bad_input_rows``.
    Without ``checked`` the fused kernel computes no flags.
    """
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    _check_finite("alpha", alpha)
    # Column 0 of the table is the "no step" entry: out_i alone.
    table = torch.add(outcome_advantage[:, None], torch.nn.functional.pad(step_scores, (1, 0)), alpha=alpha)
    table = table.to(outcome_advantage.dtype)
    if step_ids.numel() and (compile == "always" or (compile == "auto" and step_ids.numel() >= FUSED_MIN_TOKENS)):
        return _fused_masked_lookup(table, step_ids, response_mask, checked, fall_back=compile == "auto")
    return _eager_masked_lookup(table, step_ids, response_mask, checked)


def bad_input_rows(step_ids: torch.Tensor, step_values: torch.Tensor, prompt_values: torch.Tensor,
                   num_steps: torch.Tensor, outcome_rewards: torch.Tensor) -> torch.Tensor:
    """[B] bool: the responses that break the tensor contract of ``check_step_inputs``: ``num_steps`` outside
    [0, S]; a step id outside ``[-1, num_steps - 1]``; a real step's value or the prompt's value outside [0, 1]
    (NaN included); a non-finite outcome (``outcome_rewards``, the row sums of ``token_level_rewards``: a row
    holding NaN or +-inf, or one whose sum overflows). No host read."""
    small = _bad_small_input_rows(step_values, prompt_values, num_steps, outcome_rewards)
    return bad_step_id_rows(step_ids, num_steps).to(small.device) | small


def _bad_small_input_rows(step_values, prompt_values, num_steps, outcome_rewards) -> torch.Tensor:
    """The checks of ``bad_input_rows`` that read only the [B] and [B, S] tensors."""
    max_steps = step_values.shape[1]
    num_steps = num_steps.to(step_values.device)
    valid = torch.arange(max_steps, device=step_values.device)[None, :] < num_steps[:, None]
    bad_values = (valid & ~((step_values >= 0) & (step_values <= 1))).any(dim=1)
    bad_prompts = ~((prompt_values >= 0) & (prompt_values <= 1))
    bad_counts = (num_steps < 0) | (num_steps > max_steps)
    return bad_values | bad_prompts.to(bad_values.device) | bad_counts | ~torch.isfinite(outcome_rewards).to(
        bad_values.device)


def _masked_lookup(table: torch.Tensor, step_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``out[i, t] = table[i, step_ids[i, t] + 1] * response_mask[i, t]``, ids clamped as in ``_lookup`` (free inside
    the fused kernel; on CUDA an out-of-range gather would be a device-side assert that ends the process)."""
    columns = table.shape[1]
    return torch.gather(table, 1, (step_ids.long() + 1).clamp(0, columns - 1)) * response_mask.to(table.dtype)


def _checked_masked_lookup(table, step_ids, response_mask, step_values, prompt_values, num_steps,
                           outcome_rewards) -> tuple[torch.Tensor, torch.Tensor]:
    """``_masked_lookup`` and ``bad_input_rows``, written as expressions over the same inputs so that
    ``torch.compile`` makes the lookup and the step-id check one pass that reads ``step_ids`` and the mask once
    and writes ``out``, with the checks of the small tensors fused in. The step-id check is
    ``max_t max(step_ids[i, t] - (num_steps[i] - 1), -1 - step_ids[i, t]) > 0``: a max reduction vectorises (an
    ``any`` over booleans measured 40% slower)."""
    out = _masked_lookup(table, step_ids, response_mask)
    overshoot = torch.maximum(step_ids - (num_steps[:, None] - 1), -1 - step_ids).amax(dim=1)
    return out, (overshoot > 0) | _bad_small_input_rows(step_values, prompt_values, num_steps, outcome_rewards)


def _eager_masked_lookup(table, step_ids, response_mask, checked):
    advantages = _lookup(table, step_ids).mul_(response_mask)
    return advantages, (bad_input_rows(step_ids, *checked) if checked is not None else None)


_compiled_lookups: dict[bool, Callable] = {}
_compile_failed: str | None = None
_compile_lock = threading.Lock()
_log = logging.getLogger(__name__)


def _fused_masked_lookup(table, step_ids, response_mask, checked, *, fall_back: bool):
    """The compiled ``_checked_masked_lookup`` (``_masked_lookup`` without ``checked``); with ``fall_back``, a
    failed compilation warns once and runs eager."""
    global _compile_failed
    if fall_back and _compile_failed is not None:
        return _eager_masked_lookup(table, step_ids, response_mask, checked)
    with _compile_lock:
        if (checked is not None) not in _compiled_lookups:
            # dynamic=True: one kernel for every batch size and response length (no recompiles as they change).
            # No bounds assert on the gather: its index is clamped in the kernel, and the assert (a branch per
            # element) measured ~30% of the kernel's time on CPU.
            _compiled_lookups[checked is not None] = torch.compile(
                _checked_masked_lookup if checked is not None else _masked_lookup, dynamic=True,
                options={"assert_indirect_indexing": False})
    try:
        if checked is None:
            return _compiled_lookups[False](table, step_ids, response_mask), None
        step_values, prompt_values, num_steps, outcome_rewards = checked
        return _compiled_lookups[True](table, step_ids, response_mask, step_values, prompt_values,
                                       num_steps.to(step_ids.device), outcome_rewards)
    except torch._dynamo.exc.TorchDynamoException as error:  # compilation failed (no C++ compiler, no Triton)
        if not fall_back:
            raise
        eager = _eager_masked_lookup(table, step_ids, response_mask, checked)  # bad inputs raise their own error
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


def check_softmin_temperature(what: str, temperature: float) -> None:
    """``temperature`` is 0 (the hard minimum) or a finite number >= ``MIN_SOFTMIN_TEMPERATURE``."""
    number = not isinstance(temperature, bool) and isinstance(temperature, (int, float, np.floating, np.integer))
    if not number or not (temperature == 0 or MIN_SOFTMIN_TEMPERATURE <= temperature < math.inf):
        raise ValueError(
            f"{what} must be 0 (the hard minimum) or a finite number >= {MIN_SOFTMIN_TEMPERATURE:g} (below it the "
            f"softmin logits -p/T overflow float32 and the weights become NaN), got {temperature!r}"
        )


def softmin_weights(step_scores: torch.Tensor, num_steps: torch.Tensor, temperature: float) -> torch.Tensor:
    """PURE's min-form weights over the real steps of each response (Cheng et al. 2025, "Stop Summation").

    ``w[i, h] = exp(-p[i, h] / T) / sum_{k < H_i} exp(-p[i, k] / T)`` for h < H_i, 0 beyond. ``T = 0`` is the
    limit T -> 0: ``w = 1/m`` on the m steps that attain ``min_h p[i, h]``, 0 elsewhere. A response with no step
    has no weights.

    The softmax runs in at least float32 (a float16 ``-p / T`` would overflow already at ``|p| / T > 65504``).

    Args:
        step_scores: [B, S] p; num_steps: [B] H; temperature: T = 0 or ``MIN_SOFTMIN_TEMPERATURE`` <= T < inf
            (PURE uses 0.1). Below the bound ``-p / T`` overflows float32 (for ``|p| <= 1000``) and the softmax
            would be NaN: a ``ValueError`` says so.

    Returns:
        [B, S] weights in the dtype of ``step_scores``; each row with H_i > 0 sums to 1.
    """
    check_softmin_temperature("temperature", temperature)
    valid = valid_steps(num_steps, step_scores.shape[1])
    zeros = torch.zeros_like(step_scores)
    if step_scores.shape[1] == 0:
        return zeros
    if temperature > 0:
        wide = step_scores.to(torch.promote_types(step_scores.dtype, torch.float32))
        logits = torch.where(valid, -wide / temperature, torch.full_like(wide, float("-inf")))
        # a row without steps is NaN here and is zeroed below
        weights = torch.softmax(logits, dim=1).to(step_scores.dtype)
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


def leave_one_out_token_baseline(
    step_rewards: torch.Tensor,
    step_ids: torch.Tensor,
    num_steps: torch.Tensor,
    response_mask: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PURE's "token" baseline (its README's fix of the "step" baseline, its training script's choice): the
    other responses' process reward per token, times the tokens of the step.

    ``b[i, h] = n[i, h] * (sum_{j in O_i} R_j) / (sum_{j in O_i} L_j)`` with ``R_j = sum_{h < H_j} r[j, h]``,
    ``L_j`` the response tokens of j (``response_mask``), ``n[i, h]`` the response tokens of step h of i
    (``step_ids == h``) and O_i the responses of i's group other than i that have steps (and are kept, when
    ``keep`` [B] bool is given); ``b = 0`` when O_i is empty. A longer step carries a larger baseline, so writing
    fewer, longer steps earns nothing (the "step" baseline favours fewer steps).

    Returns:
        [B, S] baseline, 0 at h >= H_i.
    """
    batch, max_steps = step_rewards.shape
    valid = valid_steps(num_steps, max_steps)
    in_response = response_mask != 0
    totals = torch.where(valid, step_rewards, torch.zeros_like(step_rewards)).sum(dim=1)
    lengths = in_response.sum(dim=1).to(step_rewards.dtype)
    counted = num_steps > 0
    if keep is not None:
        _check_per_response(keep, batch, _KEEP)
        counted = counted & keep.bool()
    counted_f = counted.to(step_rewards.dtype)
    others_reward = _group_sums(totals * counted_f, groups, num_groups)[groups] - totals * counted_f
    others_tokens = _group_sums(lengths * counted_f, groups, num_groups)[groups] - lengths * counted_f
    per_token = torch.where(others_tokens > 0, others_reward / others_tokens.clamp_min(1), torch.zeros_like(totals))
    # tokens of each step; column 0 collects the tokens in no step and is dropped (ids clamped as everywhere)
    columns = step_ids.long().clamp(-1, max_steps - 1) + 1
    step_tokens = torch.zeros((batch, max_steps + 1), dtype=step_rewards.dtype, device=step_rewards.device)
    step_tokens = step_tokens.scatter_add_(1, columns, in_response.to(step_rewards.dtype))[:, 1:]
    return torch.where(valid, step_tokens * per_token[:, None], torch.zeros_like(step_rewards))


def response_end_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: the last position t with ``response_mask[i, t]`` set (the response's EOS, or its last token when
    it was cut at the length limit); ``T - 1`` for an empty row (where every advantage is 0 anyway)."""
    length = response_mask.shape[1]
    return (length - 1) - (response_mask != 0).flip(1).to(torch.uint8).argmax(dim=1)


def pure_whiten(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """PURE's advantage whitening (CJReinforce/PURE, ``replay_buffer.py`` ``normalize``, on by default there).

    With Z the response tokens whose advantage is exactly 0 (step separators, EOS when zeroed) and
    ``n = |response tokens| - |Z|``: ``mean = sum(adv) / n``, ``var = sum_{response tokens} (adv - mean)^2 / n``
    (Z left out of the count but kept in the variance, as PURE does), ``out = (adv - mean) / sqrt(max(var, 1e-8))``
    on the counted tokens, 0 on Z and outside the mask. With n = 0 everything stays 0. PURE whitens its replay
    buffer's items after removing their padding, so its n also counts response tokens only.
    """
    weights = (response_mask != 0).to(advantages.dtype)
    counted = (response_mask != 0) & (advantages != 0)
    n = counted.sum().to(advantages.dtype)
    mean = (advantages * weights).sum() / n.clamp_min(1)
    variance = (((advantages - mean) * weights) ** 2).sum() / n.clamp_min(1)
    whitened = (advantages - mean) * torch.rsqrt(variance.clamp_min(1e-8))
    return torch.where(counted, whitened, torch.zeros_like(whitened))


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
    baseline: str = "token",
    zero_separators: bool = True,
    zero_eos: bool = False,
    whiten: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PURE's min-form credit assignment (Cheng et al. 2025) with the process scores p as the PRM's rewards.

    1. ``r = min_form_step_rewards(p, T)`` (softmin-weighted step rewards);
    2. ``q[i, h] = r[i, h] - b[i, h]`` for the real steps h < H_i, with b PURE's ``reward_baseline``:
       ``"token"`` (``leave_one_out_token_baseline``), ``"step"`` (``leave_one_out_step_mean``, the same for
       every step) or ``"none"`` (b = 0); ``q = 0`` for responses not in ``keep``;
    3. ``d[i, t] = q[i, h]`` at the last token t of step h (``step_end_rewards``);
    4. ``adv[i, t] = (out_i + alpha * sum_{t' >= t} d[i, t']) * response_mask[i, t]``;
    5. ``zero_separators``: ``adv[i, t] = 0`` at the last token of every step h < H_i - 1 (the token that holds
       the step delimiter; PURE gives its step-separator tokens no loss). The last step's last token is answer
       text and keeps its advantage;
    6. ``zero_eos``: ``adv = 0`` also at the response's last token (``response_end_positions``), as PURE, whose
       reward mask (which it also zeroes) includes the EOS;
    7. ``whiten``: ``adv = pure_whiten(adv, response_mask)``.

    Unchecked: NaN or inf in a tensor argument reaches the result (the estimator ``pav_pure`` checks its inputs).

    Args:
        outcome_advantage: [B] out_i (RLOO of the outcome in the ``pav_pure`` estimator, as in PURE).
        step_scores: [B, S] p; step_ids: [B, T]; num_steps: [B]; response_mask: [B, T].
        alpha: weight of the process return. groups, num_groups: prompt groups (``group_ids``).
        temperature: T of the softmin (PURE: 0.1; 0: the hard minimum; see ``softmin_weights``).
        baseline: one of ``MIN_FORM_BASELINES``.
        keep: [B] bool, responses that get a process term (and enter the baseline); default all.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    _check_finite("alpha", alpha)
    if baseline not in MIN_FORM_BASELINES:
        raise ValueError(f"baseline must be one of {MIN_FORM_BASELINES}, got {baseline!r}")
    valid = valid_steps(num_steps, step_scores.shape[1])
    rewards = min_form_step_rewards(step_scores, num_steps, temperature)
    if baseline == "step":
        rewards = rewards - leave_one_out_step_mean(rewards, num_steps, groups, num_groups, keep)[:, None]
    elif baseline == "token":
        rewards = rewards - leave_one_out_token_baseline(rewards, step_ids, num_steps, response_mask, groups,
                                                         num_groups, keep)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    if keep is not None:
        _check_per_response(keep, rewards.shape[0], _KEEP)
        rewards = rewards * keep[:, None].to(rewards.dtype)
    returns = rewards_to_go(step_end_rewards(rewards, step_ids))
    advantages = (outcome_advantage[:, None] + alpha * returns).to(outcome_advantage.dtype)
    advantages = advantages * response_mask.to(advantages.dtype)
    if zero_separators:
        advantages = advantages * (~_separator_tokens(step_ids, num_steps, step_scores.shape[1])).to(advantages.dtype)
    if zero_eos:
        advantages = advantages.scatter(1, response_end_positions(response_mask)[:, None], 0.0)
    if whiten:
        advantages = pure_whiten(advantages, response_mask)
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
    """PRIME's leave-one-out on process rewards (Cui et al. 2025, ``compute_rloo_returns``), one reward per step
    (PRIME's reward mask restricted to the step-end tokens).

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


def leave_one_out_response_rewards(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's leave-one-out with its own reward mask, the whole response (``compute_rloo_returns`` with
    ``reward_mask = eos_mask``), over token rewards d [B, T] (here: the step scores at the step ends, 0 elsewhere).

    ``q[i, t] = d[i, t] * n / (n - 1) - (sum_{j in g} m_j) / (n - 1)`` at every response token t, with
    ``m_j = sum_t d[j, t] / L_j`` the mean over j's L_j response tokens and n the kept responses of the group
    with at least one token. The baseline is subtracted at every token, so a token's return carries
    ``-(tokens from t on) * baseline``: a length term PRIME's implicit PRM (a reward at every token) expects and
    step-level scores do not have. n = 1 keeps ``q = d``; responses not counted get ``q = 0``.

    Returns:
        [B, T], 0 outside ``response_mask``.
    """
    in_response = response_mask != 0
    lengths = in_response.sum(dim=1)
    rewards = torch.where(in_response, token_rewards, torch.zeros_like(token_rewards))
    means = rewards.sum(dim=1) / lengths.clamp_min(1).to(rewards.dtype)
    counted = lengths > 0
    if keep is not None:
        _check_per_response(keep, rewards.shape[0], _KEEP)
        counted = counted & keep.bool()
    counted_f = counted.to(rewards.dtype)
    n = _group_sums(counted_f, groups, num_groups)[groups][:, None]
    total = _group_sums(means * counted_f, groups, num_groups)[groups][:, None]
    loo = torch.where(n > 1, (rewards * n - total) / (n - 1).clamp_min(1), rewards)
    return torch.where(in_response & counted[:, None], loo, torch.zeros_like(loo))


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
    reward_mask: str = "step_end",
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's advantage (Cui et al. 2025, ``compute_rloo_returns``) with the process scores p as the process
    rewards in place of the implicit PRM's.

    1. the leave-one-out step rewards, placed at the last token t of step h: with ``reward_mask="step_end"``
       ``d[i, t] = q[i, h]``, ``q = leave_one_out_step_rewards(p)`` (one reward per step); with
       ``"response"`` (PRIME's own mask, the whole response) ``d = leave_one_out_response_rewards(p at the step
       ends)``, the baseline at every response token;
    2. ``G[i, t] = out_i + alpha * sum_{t' >= t} d[i, t']`` (gamma = 1; out_i is PRIME's leave-one-out outcome,
       whose reward sits at the last token, so its return reaches every token of the response);
    3. ``adv = masked_whiten(G, response_mask)`` when ``whiten`` (PRIME whitens the summed returns over the
       batch's response tokens), else ``G * response_mask``.

    Unchecked: NaN or inf in a tensor argument reaches the result (the estimator ``pav_prime`` checks its inputs).

    Args:
        outcome_advantage: [B] out_i (``leave_one_out_outcome`` of the outcome in the ``pav_prime`` estimator).
        step_scores: [B, S]; step_ids: [B, T]; num_steps: [B]; response_mask: [B, T]; alpha: process weight.
        groups, num_groups: prompt groups. reward_mask: one of ``PRIME_REWARD_MASKS``.
        keep: [B] bool, responses that get a process term; default all.

    Returns:
        [B, T] advantages in the dtype of ``outcome_advantage``.
    """
    _check_finite("alpha", alpha)
    if reward_mask not in PRIME_REWARD_MASKS:
        raise ValueError(f"reward_mask must be one of {PRIME_REWARD_MASKS}, got {reward_mask!r}")
    if reward_mask == "step_end":
        token_rewards = step_end_rewards(leave_one_out_step_rewards(step_scores, num_steps, groups, num_groups, keep),
                                         step_ids)
    else:
        valid = valid_steps(num_steps, step_scores.shape[1])
        scores = torch.where(valid, step_scores, torch.zeros_like(step_scores))
        if keep is not None:
            _check_per_response(keep, scores.shape[0], _KEEP)
            scores = scores * keep[:, None].to(scores.dtype)
        token_rewards = leave_one_out_response_rewards(step_end_rewards(scores, step_ids), response_mask, groups,
                                                       num_groups, keep)
    returns = outcome_advantage[:, None] + alpha * rewards_to_go(token_rewards)
    returns = returns.to(outcome_advantage.dtype)
    if whiten:
        return masked_whiten(returns, response_mask)
    return returns * response_mask.to(returns.dtype)

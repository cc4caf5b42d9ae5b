"""Prompt groups and the outcome advantages of verl's estimators (GRPO, RLOO, a batch baseline) that the process
term is added to. Shapes as in :mod:`verl_prm.advantages`.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_prm.advantages.contract import GROUPS_ARGUMENT, check_per_response


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


def group_sums(values: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    check_per_response(groups, values.shape[0], GROUPS_ARGUMENT)
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
    counts = group_sums(torch.ones_like(scores), groups, num_groups)
    mean = group_sums(scores, groups, num_groups) / counts
    squared_deviation = group_sums((scores - mean[groups]) ** 2, groups, num_groups)
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
    check_per_response(groups, scores.shape[0], GROUPS_ARGUMENT)
    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((num_groups,), torch.inf, dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, groups, scores, reduce="amax")
    low = low.scatter_reduce(0, groups, scores, reduce="amin")
    return (high <= low) | torch.isinf(high)


def leave_one_out_outcome(scores: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """RLOO's outcome advantage, as verl's ``rloo``: ``out_i = R_i - mean_{j in g, j != i} R_j``.

    Equivalently ``(n R_i - sum_g R) / (n - 1)`` for a group of n > 1; a group of one keeps ``R_i``.
    """
    counts = group_sums(torch.ones_like(scores), groups, num_groups)[groups]
    totals = group_sums(scores, groups, num_groups)[groups]
    loo = (counts * scores - totals) / (counts - 1).clamp_min(1)
    return torch.where(counts > 1, loo, scores)


def batch_baseline_outcome(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE with a batch-mean baseline (the PAV paper's online RL): ``out_i = R_i - mean_batch R``."""
    return scores - scores.mean()

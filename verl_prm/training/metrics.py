"""Evaluation metrics of a value critic against value labels: MSE, AUROC, expected calibration error, and the
reliability diagram (mean label against mean value per bin); AUROC, and the paired difference of two scorings'
AUROCs, with a bootstrap interval over groups (problems)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["mse", "auroc", "expected_calibration_error", "GroupedAUROC", "grouped_bootstrap_auroc",
           "grouped_bootstrap_auroc_difference", "calibration_slope", "plot_reliability", "reliability_bins",
           "value_metrics"]


def _flat(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


def mse(predictions, targets) -> float:
    """Mean of (p - q)^2 over all entries; NaN for no entries."""
    p, q = _flat(predictions), _flat(targets)
    if p.shape != q.shape:
        raise ValueError(f"mse: {p.shape[0]} predictions but {q.shape[0]} targets")
    return float(np.mean((p - q) ** 2)) if p.size else float("nan")


def auroc(scores, labels) -> float:
    """Area under the ROC curve by the rank statistic (Mann-Whitney U), ties counted one half:

        AUROC = (sum of the ranks of the positives - P (P + 1) / 2) / (P N)

    where ranks are 1-based over all scores and tied scores share their average rank. Equals the probability
    that a random positive scores above a random negative (+ 1/2 the probability of a tie).

    Args:
        scores: [n] floats. labels: [n] booleans or 0/1.
    Returns:
        float in [0, 1]; NaN when either class is empty.
    """
    s = _flat(scores)
    y = np.asarray(labels).reshape(-1).astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"auroc: {s.shape[0]} scores but {y.shape[0]} labels")
    positives, negatives = int(y.sum()), int((~y).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    unique, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # group g occupies ranks start_g + 1 .. start_g + counts_g; its average rank is start_g + (counts_g + 1) / 2
    starts = np.cumsum(counts) - counts
    average_rank = starts + (counts + 1) / 2.0
    ranks = average_rank[inverse]
    u = ranks[y].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))


class GroupedAUROC(NamedTuple):
    """The AUROC of all items, its bootstrap interval ``[low, high]``, and the resamples left out of the
    interval because they held one class only (their AUROC is undefined)."""

    auroc: float
    low: float
    high: float
    skipped: int


# groups x resamples of one chunk of the vectorised bootstrap (bounds its memory to ~ 100 MB)
_BOOTSTRAP_CHUNK_CELLS = 4_000_000


def grouped_bootstrap_auroc(scores, labels, groups, *, resamples: int = 2000, seed: int = 0, level: float = 0.95,
                            min_valid_share: float = 0.5) -> GroupedAUROC:
    """:func:`auroc` of all items with a percentile bootstrap interval that resamples whole groups (problems):
    items of one group (the steps of one problem's rollouts) are not independent, so the group is the unit.

    The G distinct groups in sorted order (``numpy.unique``) are drawn G times with replacement per resample:
    resample b is row b of ``numpy.random.default_rng(seed).integers(0, G, size=(resamples, G))``. A group drawn
    m times counts m times, so resample b's AUROC is the Mann-Whitney statistic with the multiplicities
    ``w_i = m_b(group of i)`` as weights:

        AUROC_b = sum_{i pos, j neg} w_i w_j ([s_i > s_j] + 1/2 [s_i = s_j]) / ((sum_{i pos} w_i) (sum_{j neg} w_j))

    computed as ``sum_{g, h} m_g m_h W[g, h]`` over the pair wins of groups, ``W[g, h] = sum_{i pos in g, j neg
    in h} ([s_i > s_j] + 1/2 [s_i = s_j])`` (:func:`_group_pair_wins`), over ``(sum_g m_g P_g) (sum_g m_g N_g)``
    (``P_g``, ``N_g``: group g's positives and negatives). A resample with one class has no AUROC: it is skipped
    and counted. The interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's linear
    interpolation) of the others.

    Args:
        scores: [n] finite floats. labels: [n] booleans or 0/1. groups: [n] group keys (e.g. question texts).
        resamples: integer >= 2. seed: integer. level: in (0, 1).
        min_valid_share: the least share of resamples that must have both classes, in (0, 1].
    Returns:
        :class:`GroupedAUROC` (auroc, low, high, skipped).
    Raises:
        ValueError: bad arguments, one class in all items, or fewer than ``min_valid_share`` of the resamples
        with both classes (naming the counts).
    """
    s, y, group, num_groups = _bootstrap_inputs("grouped_bootstrap_auroc", [scores], labels, groups)
    _check_bootstrap_knobs("grouped_bootstrap_auroc", resamples, seed, level, min_valid_share)
    point = auroc(s[0], y)
    values = _resampled_aurocs(s[0], y, group, num_groups, resamples, seed)
    valid = _enough_valid("grouped_bootstrap_auroc", values, resamples, num_groups, min_valid_share)
    low, high = np.quantile(valid, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return GroupedAUROC(point, float(low), float(high), int(resamples - valid.size))


def grouped_bootstrap_auroc_difference(scores_a, scores_b, labels, groups, *, resamples: int = 2000, seed: int = 0,
                                       level: float = 0.95, min_valid_share: float = 0.5) -> GroupedAUROC:
    """The paired difference ``AUROC(scores_a) - AUROC(scores_b)`` of two scorings of the same items, with a
    percentile bootstrap interval over groups: resample b draws the groups of :func:`grouped_bootstrap_auroc`
    (the same ``seed``, the same draws) and both AUROCs are read on it,

        D_b = AUROC_b(a) - AUROC_b(b),

    so what the two scorings share (which problems were drawn) cancels, and the interval is the ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles of the ``D_b`` of the resamples with both classes (the skipped ones are
    the same for both: they depend on the labels only).

    Returns:
        :class:`GroupedAUROC` whose ``auroc`` is the difference of the two AUROCs of all items.
    Raises:
        ValueError: as :func:`grouped_bootstrap_auroc`, for either scoring.
    """
    s, y, group, num_groups = _bootstrap_inputs("grouped_bootstrap_auroc_difference", [scores_a, scores_b], labels,
                                                groups)
    _check_bootstrap_knobs("grouped_bootstrap_auroc_difference", resamples, seed, level, min_valid_share)
    point = auroc(s[0], y) - auroc(s[1], y)
    values = (_resampled_aurocs(s[0], y, group, num_groups, resamples, seed)
              - _resampled_aurocs(s[1], y, group, num_groups, resamples, seed))
    valid = _enough_valid("grouped_bootstrap_auroc_difference", values, resamples, num_groups, min_valid_share)
    low, high = np.quantile(valid, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return GroupedAUROC(point, float(low), float(high), int(resamples - valid.size))


def _bootstrap_inputs(name: str, scorings, labels, groups) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The scorings as [k, n] float64, the labels as bool, each item's group index (sorted distinct keys) and
    the group count; refuses mismatched sizes, non-finite scores and labels of one class."""
    arrays = [_flat(scores) for scores in scorings]
    y = np.asarray(labels).reshape(-1).astype(bool)
    group_keys = np.asarray(groups).reshape(-1)
    if any(a.size != y.size for a in arrays) or group_keys.size != y.size:
        sizes = ", ".join(f"{a.size} scores" for a in arrays)
        raise ValueError(f"{name}: {sizes}, {y.size} labels, {group_keys.size} groups")
    s = np.stack(arrays)
    if not np.isfinite(s).all():
        which, item = (int(v[0]) for v in np.nonzero(~np.isfinite(s)))
        label = f"score {item}" if len(scorings) == 1 else f"scoring {which}, score {item},"
        raise ValueError(f"{name}: {label} is {s[which, item]}; every score must be finite")
    if y.all() or not y.any():
        raise ValueError(f"{name}: all {y.size} items are of one class ({int(y.sum())} positive): the AUROC needs both")
    _, group = np.unique(group_keys, return_inverse=True)
    return s, y, group, int(group.max()) + 1


def _resampled_aurocs(s: np.ndarray, y: np.ndarray, group: np.ndarray, num_groups: int, resamples: int,
                      seed: int) -> np.ndarray:
    """[resamples] AUROCs, resample b drawing row b of ``default_rng(seed).integers(0, G, size=(resamples, G))``
    (NaN where a resample holds one class): ``sum_{g, h} m_g m_h W[g, h] / ((sum_g m_g P_g) (sum_g m_g N_g))``."""
    pairs = _group_pair_wins(s, y, group, num_groups)
    positives = np.bincount(group[y], minlength=num_groups).astype(np.float64)
    negatives = np.bincount(group[~y], minlength=num_groups).astype(np.float64)
    draws = np.random.default_rng(seed).integers(0, num_groups, size=(resamples, num_groups))
    values = np.empty(resamples)
    chunk = max(1, _BOOTSTRAP_CHUNK_CELLS // num_groups)
    for begin in range(0, resamples, chunk):
        rows = draws[begin : begin + chunk]
        flat = (rows + num_groups * np.arange(len(rows))[:, None]).reshape(-1)
        multiplicity = np.bincount(flat, minlength=len(rows) * num_groups).reshape(len(rows), num_groups)
        multiplicity = multiplicity.astype(np.float64)
        wins = ((multiplicity @ pairs) * multiplicity).sum(axis=1)  # sum_{g, h} m_g m_h W[g, h]
        with np.errstate(invalid="ignore", divide="ignore"):
            values[begin : begin + len(rows)] = wins / ((multiplicity @ positives) * (multiplicity @ negatives))
    return values


def _enough_valid(name: str, values: np.ndarray, resamples: int, num_groups: int,
                  min_valid_share: float) -> np.ndarray:
    valid = values[np.isfinite(values)]
    if valid.size < max(2, math.ceil(min_valid_share * resamples)):
        raise ValueError(f"{name}: only {valid.size} of {resamples} resamples of the {num_groups} "
                         f"groups hold both classes (need {min_valid_share:g} of them): too few groups with "
                         "positives or negatives for an interval; add groups (problems)")
    return valid


def _group_pair_wins(s: np.ndarray, y: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """``W[g, h] = sum_{i pos in g, j neg in h} ([s_i > s_j] + 1/2 [s_i = s_j])``: [G, G], one column per group
    of negatives (its sorted scores searched for every positive's)."""
    wins = np.zeros((num_groups, num_groups))
    positive_scores, positive_groups = s[y], group[y]
    for h in range(num_groups):
        negative_scores = np.sort(s[~y & (group == h)])
        below = np.searchsorted(negative_scores, positive_scores, side="left")
        at = np.searchsorted(negative_scores, positive_scores, side="right") - below
        wins[:, h] = np.bincount(positive_groups, weights=below + 0.5 * at, minlength=num_groups)
    return wins


def _check_bootstrap_knobs(name: str, resamples, seed, level, min_valid_share) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, (int, np.integer)) or resamples < 2:
        raise ValueError(f"{name}: resamples must be an integer >= 2, got {resamples!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"{name}: seed must be an integer, got {seed!r}")
    if not (isinstance(level, (int, float)) and 0.0 < level < 1.0):
        raise ValueError(f"{name}: level must be in (0, 1), got {level!r}")
    if not (isinstance(min_valid_share, (int, float)) and 0.0 < min_valid_share <= 1.0):
        raise ValueError(f"{name}: min_valid_share must be in (0, 1], got {min_valid_share!r}")


def expected_calibration_error(predictions, targets, num_bins: int = 10) -> float:
    """ECE with equal-width bins of the prediction on [0, 1] (soft targets allowed):

        ECE = sum_b (n_b / n) * | mean_{i in b} p_i - mean_{i in b} q_i |

    A prediction of exactly 1 falls in the last bin. NaN for no entries.
    """
    p, q = _flat(predictions), _flat(targets)
    if p.shape != q.shape:
        raise ValueError(f"expected_calibration_error: {p.shape[0]} predictions but {q.shape[0]} targets")
    if p.size == 0:
        return float("nan")
    bins = _bin_index(p, num_bins)
    gap = np.bincount(bins, weights=p, minlength=num_bins) - np.bincount(bins, weights=q, minlength=num_bins)
    return float(np.abs(gap).sum() / p.size)  # sum_b |sum p - sum q| / n == sum_b n_b/n |mean p - mean q|


def _bin_index(p: np.ndarray, num_bins: int) -> np.ndarray:
    """Equal-width bin b = floor(p * num_bins) of each prediction, clipped to [0, num_bins - 1]."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
    return np.clip(np.floor(p * num_bins).astype(np.int64), 0, num_bins - 1)


def reliability_bins(predictions, targets, num_bins: int = 10) -> dict[str, np.ndarray]:
    """The reliability diagram's data, bins as in :func:`expected_calibration_error`:

        count_b = n_b,  mean_value_b = mean_{i in b} p_i,  mean_label_b = mean_{i in b} q_i   (NaN when n_b = 0)

    Returns:
        {"count": [num_bins] int64, "mean_value": [num_bins], "mean_label": [num_bins], "edges": [num_bins + 1]}
    """
    p, q = _flat(predictions), _flat(targets)
    if p.shape != q.shape:
        raise ValueError(f"reliability_bins: {p.shape[0]} predictions but {q.shape[0]} targets")
    bins = _bin_index(p, num_bins)
    count = np.bincount(bins, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_value = np.bincount(bins, weights=p, minlength=num_bins) / count
        mean_label = np.bincount(bins, weights=q, minlength=num_bins) / count
    return {"count": count, "mean_value": mean_value, "mean_label": mean_label,
            "edges": np.linspace(0.0, 1.0, num_bins + 1)}


def plot_reliability(path, curves: dict, num_bins: int = 10, title: str = "reliability") -> None:
    """Write a reliability diagram (PNG) to ``path``: for each named curve ``name: (predictions, targets)`` the
    mean label against the mean value of each non-empty bin, each point marked with its count; the diagonal is
    perfect calibration; the legend gives each curve's ECE."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.5, 5.0))
    axis.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="calibrated")
    for name, (predictions, targets) in curves.items():
        data = reliability_bins(predictions, targets, num_bins)
        kept = data["count"] > 0
        ece = expected_calibration_error(predictions, targets, num_bins)
        line, = axis.plot(data["mean_value"][kept], data["mean_label"][kept], marker="o",
                          label=f"{name} (ECE {ece:.3f})")
        for x, y, n in zip(data["mean_value"][kept], data["mean_label"][kept], data["count"][kept]):
            axis.annotate(str(int(n)), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7,
                          color=line.get_color())
    axis.set(xlim=(0, 1), ylim=(0, 1), xlabel="mean value in bin", ylabel="mean held-out label in bin",
             title=f"{title} ({num_bins} equal-width bins; numbers: labels per bin)")
    axis.title.set_fontsize(9)
    axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def calibration_slope(predictions, targets, weights=None) -> float:
    """The weighted least-squares slope of the targets on the predictions,

        slope = sum_n w_n (p_n - p_bar) (q_n - q_bar) / sum_n w_n (p_n - p_bar)^2,   bars: w-weighted means.

    1 when the predictions have the targets' size (a calibrated predictor's E[q | p] = p); above 1 when they are
    flatter than the labels (a shrunk head), below 1 when steeper. NaN when the predictions are constant or
    there is no item.
    """
    p, q = _flat(predictions), _flat(targets)
    w = np.ones_like(p) if weights is None else _flat(weights)
    if not p.shape == q.shape == w.shape:
        raise ValueError(f"calibration_slope: {p.size} predictions, {q.size} targets, {w.size} weights")
    if p.size == 0 or not w.sum() > 0:
        return float("nan")
    dp = p - np.average(p, weights=w)
    spread = float(np.sum(w * dp * dp))
    if spread <= 1e-12 * float(np.sum(w)):
        return float("nan")
    return float(np.sum(w * dp * (q - np.average(q, weights=w))) / spread)


def value_metrics(predictions, targets, num_bins: int = 10) -> dict[str, float]:
    """MSE, AUROC (positives: q >= 0.5, the classes of the class-balanced sampling), ECE, and the MSE of the
    best constant predictor (the targets' mean) for reference."""
    p, q = _flat(predictions), _flat(targets)
    return {
        "mse": mse(p, q),
        "auroc": auroc(p, q >= 0.5),
        "ece": expected_calibration_error(p, q, num_bins),
        "mse_constant": mse(np.full_like(q, q.mean()), q) if q.size else float("nan"),
        "num_steps": float(q.size),
    }

"""Evaluation metrics of a value critic against value labels: MSE, AUROC, expected calibration error, and the
reliability diagram (mean label against mean value per bin)."""

from __future__ import annotations

import numpy as np

__all__ = ["mse", "auroc", "expected_calibration_error", "plot_reliability", "reliability_bins", "value_metrics"]


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

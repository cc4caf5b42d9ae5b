"""Statistics of the recipe's RL curves: seed means, a level every arm is compared at, the area under the curve,
and a bootstrap over seeds for their standard errors.

A curve is the held-out accuracy at verl's evaluation steps, read as a piecewise-linear function of the step
(or of the sampled responses, proportional to it). Sample efficiency is the steps an arm needs to reach a
level L on its seed-mean curve, against the steps GRPO needs; L is GRPO's own accuracy at a fraction of the
budget (2/3 by default), so GRPO reaches it by construction before its last step and the ratio does not hinge
on GRPO's noisiest point, its last. The standard errors come from resampling seeds within each arm
(:func:`bootstrap`), recomputing the seed-mean curves and the statistic on every resample.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

__all__ = ["bootstrap", "bootstrap_se", "first_crossing", "interpolate", "mean_curve", "normalised_auc"]


def mean_curve(curves: Sequence[Sequence[Sequence[float]]]) -> tuple[list[tuple], list[float]]:
    """The seed mean of curves of ``(step, samples, accuracy)`` rows and its standard error at each step:
    ``mean_t = (1/n) sum_s a_{s,t}``, ``se_t = std_{ddof=1}(a_{., t}) / sqrt(n)`` (nan for one seed).

    Every curve must have the same evaluation steps (a run that stopped early is an error, not a shorter mean)."""
    if not curves:
        raise ValueError("mean_curve needs at least one curve")
    steps = [tuple(int(row[0]) for row in curve) for curve in curves]
    for index, seed_steps in enumerate(steps):
        if seed_steps != steps[0]:
            raise ValueError(f"curve {index} is evaluated at steps {list(seed_steps)}, curve 0 at {list(steps[0])}: "
                             "every seed's run must have the same evaluations (an incomplete run?)")
    values = np.array([[float(row[2]) for row in curve] for curve in curves])
    mean = [(int(row[0]), int(row[1]), float(value)) for row, value in zip(curves[0], values.mean(axis=0))]
    n = len(curves)
    se = (values.std(axis=0, ddof=1) / np.sqrt(n)).tolist() if n > 1 else [float("nan")] * len(mean)
    return mean, [float(x) for x in se]


def _checked(xs: Sequence[float], ys: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if xs.ndim != 1 or xs.shape != ys.shape or len(xs) == 0:
        raise ValueError(f"a curve needs as many x as y values (>= 1), got {xs.shape} and {ys.shape}")
    if not (np.isfinite(xs).all() and np.isfinite(ys).all()):
        raise ValueError(f"a curve must be finite, got x {xs.tolist()} and y {ys.tolist()}")
    if (np.diff(xs) <= 0).any():
        raise ValueError(f"a curve's x must increase strictly, got {xs.tolist()}")
    return xs, ys


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The piecewise-linear curve through ``(xs[i], ys[i])`` at ``x``: ``y_i + (x - x_i) / (x_{i+1} - x_i) *
    (y_{i+1} - y_i)`` on the segment ``x_i <= x <= x_{i+1}`` (``y_i`` exactly at a point). ``x`` outside
    ``[xs[0], xs[-1]]`` is an error: the curve says nothing there."""
    xs, ys = _checked(xs, ys)
    if not xs[0] <= x <= xs[-1]:  # also NaN
        raise ValueError(f"x = {x!r} is outside the curve's range [{xs[0]:g}, {xs[-1]:g}]")
    i = int(np.searchsorted(xs, x, side="right")) - 1
    if xs[i] == x:
        return float(ys[i])
    return float(ys[i] + (x - xs[i]) / (xs[i + 1] - xs[i]) * (ys[i + 1] - ys[i]))


def first_crossing(xs: Sequence[float], ys: Sequence[float], level: float) -> float | None:
    """The least x at which the piecewise-linear curve reaches ``level``: ``xs[0]`` if ``ys[0] >= level``; else
    on the first segment with ``y_i < level <= y_{i+1}``, ``x = x_i + (level - y_i) / (y_{i+1} - y_i) *
    (x_{i+1} - x_i)``; None if the curve never reaches it (``max(ys) < level``)."""
    xs, ys = _checked(xs, ys)
    if not np.isfinite(level):
        raise ValueError(f"level must be finite, got {level!r}")
    if ys[0] >= level:
        return float(xs[0])
    for i in range(len(xs) - 1):
        if ys[i] < level <= ys[i + 1]:
            return float(xs[i] + (level - ys[i]) / (ys[i + 1] - ys[i]) * (xs[i + 1] - xs[i]))
    return None


def normalised_auc(xs: Sequence[float], ys: Sequence[float], budget: float) -> float:
    """The area under the piecewise-linear curve over ``[0, budget]`` divided by ``budget`` (the trapezoid rule,
    exact for it): ``(1 / B) sum_i (x_{i+1} - x_i) (y_i + y_{i+1}) / 2``, the curve's mean accuracy over the
    budget. The curve must start at 0 and end at ``budget``."""
    xs, ys = _checked(xs, ys)
    if not (np.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be finite and > 0, got {budget!r}")
    if xs[0] != 0 or xs[-1] != budget:
        raise ValueError(f"the curve spans [{xs[0]:g}, {xs[-1]:g}], the budget is [0, {budget:g}]: the area needs "
                         "an evaluation before training and one at the last step")
    return float(np.sum(np.diff(xs) * (ys[:-1] + ys[1:]) / 2) / budget)


def bootstrap(statistic: Callable[[dict], Sequence[float]], groups: Mapping[str, Sequence], *, resamples: int,
              seed: int) -> np.ndarray:
    """``statistic`` on ``resamples`` bootstrap resamples of ``groups`` (arm -> its seeds' items): in each
    resample every arm's n items are drawn n times with replacement, independently of the other arms (in the
    order of ``groups``, from ``numpy.random.default_rng(seed)``, so the same seed gives the same resamples).
    ``statistic`` maps {arm: resampled items} to a vector (nan where it is undefined, e.g. a level never
    reached); returns the [resamples, k] array of its values."""
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 2:
        raise ValueError(f"resamples must be an integer >= 2, got {resamples!r}")
    empty = [name for name, items in groups.items() if len(items) == 0]
    if empty:
        raise ValueError(f"bootstrap groups {empty} have no items")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(resamples):
        sample = {name: [items[i] for i in rng.integers(0, len(items), len(items))] for name, items in groups.items()}
        rows.append(np.atleast_1d(np.asarray(statistic(sample), dtype=float)))
    return np.array(rows)


def bootstrap_se(values: Sequence[float]) -> tuple[float, float]:
    """(standard error, undefined share) of one statistic's bootstrap values: ``sqrt(1/(m-1) sum_b (t_b -
    mean t)^2)`` over the m finite values (the bootstrap estimate of the statistic's standard error), and the
    share of resamples where it is undefined (nan or infinite). The error is nan with fewer than 2 finite
    values."""
    values = np.asarray(values, dtype=float)
    finite = values[np.isfinite(values)]
    se = float(finite.std(ddof=1)) if len(finite) > 1 else float("nan")
    return se, float(1 - len(finite) / len(values)) if len(values) else float("nan")

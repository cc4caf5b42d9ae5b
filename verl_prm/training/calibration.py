"""Post-hoc calibration of a learned PAV: a monotone map from the critic's raw value to the Monte-Carlo value,
fitted on held-out labels (docs: labels.md, "Calibration").

Why: the process term of the effective reward is alpha * (v_h - v_{h-1}). A critic that ranks prefixes well but
squashes its values (its drop at a wrong step a fraction of the prover's) passes on only that fraction of the
process term. A strictly increasing map keeps the ranking and restores the size.

Methods (both fitted in float64 on pairs (raw value v_i, label q_i) with weights w_i, :func:`label_weights`):

- ``platt`` (the default): ``c(v) = sigmoid(a * logit(v) + b)`` with ``a > 0`` (Platt 1999, "Probabilistic
  outputs for support vector machines", fitted here on logit(v) with soft labels by Newton's method). Two
  parameters, strictly increasing everywhere (the ranking and every step's sign of v_h - v_{h-1} are kept), and
  exactly the form of a value head whose logits are scaled and shifted (``a > 1`` undoes a squash).
- ``isotonic``: pool-adjacent-violators on (v, q) weighted by w, the pooled blocks joined linearly through
  their weighted centroids (centred isotonic regression, Oron & Flournoy 2017, "Centered isotonic regression:
  point and interval estimation for dose-response studies"), constant beyond the first and last centroid. Any
  monotone distortion, but the map is flat outside the centroids' range and needs more labels.

The fitted map is stored next to the weights it was fitted for (``calibration.json``, with a digest of those
weights, :func:`verl_prm.checkpoints.weights_digest`) and applied by ``ProverCritic`` to every value it returns.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from verl_prm.training.head_fit import fit_logistic_head

__all__ = [
    "CALIBRATION_FILE",
    "CALIBRATION_METHODS",
    "DEFAULT_CALIBRATION",
    "MIN_CALIBRATION_LABELS",
    "Calibration",
    "CalibrationError",
    "apply_isotonic",
    "apply_platt",
    "checkpoint_calibration",
    "cross_fitted_values",
    "fit_calibration",
    "fit_isotonic",
    "fit_platt",
    "label_weights",
    "platt_features",
    "pool_adjacent_violators",
    "read_calibration",
    "write_calibration",
]

CALIBRATION_FILE = "calibration.json"
CALIBRATION_METHODS = ("platt", "isotonic", "none")
DEFAULT_CALIBRATION = "platt"
# Fewest held-out labelled steps a map is fitted on: the mean of 32 labels has a standard error up to
# 0.5 / sqrt(32) = 0.088, about the size of the squashed drop being corrected; fewer labels fit noise.
MIN_CALIBRATION_LABELS = 32
# Platt reads logit(v): v is clipped to [eps, 1 - eps] so that exact 0 and 1 stay finite.
PLATT_EPSILON = 1e-6
_FORMAT = "verl-prm calibration"
_VERSION = 1


class CalibrationError(ValueError):
    """A calibration cannot be fitted, read or used as it is; the message names the file or input and the fix."""


def label_weights(counts) -> np.ndarray:
    """Weight of each held-out label in a fit: its Monte-Carlo count n_i, the precision of a binomial mean.

        w_i = n_i                     if n_i > 0
            = max(1, max_j n_j)       if n_i = 0   (exact, inferred or converted labels: as precise as the
                                                    best-sampled label, not weightless)
    """
    n = np.asarray(counts, dtype=np.float64).reshape(-1)
    if n.size and (not np.all(np.isfinite(n)) or np.any(n < 0)):
        raise CalibrationError("label counts must be finite and >= 0")
    reference = max(1.0, float(n.max())) if n.size else 1.0
    return np.where(n > 0, n, reference)


def _check_pairs(values, targets, weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    q = np.asarray(targets, dtype=np.float64).reshape(-1)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if not v.shape == q.shape == w.shape:
        raise CalibrationError(f"calibration fit: {v.size} values, {q.size} labels, {w.size} weights")
    for what, array in (("values", v), ("labels", q), ("weights", w)):
        if not np.all(np.isfinite(array)):
            raise CalibrationError(f"calibration fit: the held-out {what} hold NaN or inf")
    if np.any((q < 0) | (q > 1)):
        raise CalibrationError("calibration fit: held-out labels must lie in [0, 1]")
    if np.any(w <= 0):
        raise CalibrationError("calibration fit: label weights must be > 0")
    if v.size < MIN_CALIBRATION_LABELS:
        raise CalibrationError(f"calibration fit: {v.size} held-out labels, fewer than the minimum "
                               f"{MIN_CALIBRATION_LABELS}: hold out more prompts (--eval-fraction, --eval-labels) "
                               "or pass --calibration none")
    return v, q, w


def pool_adjacent_violators(x, y, w) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted isotonic regression by pool-adjacent-violators, as blocks of pooled points.

    Minimises sum_i w_i (f_i - y_i)^2 over non-decreasing f (points in the order of x; equal x pooled first,
    so tied values get one fitted value). Adjacent blocks are pooled while the left one's weighted mean is
    >= the right one's, so the block means come out strictly increasing:

        block B: weight W_B = sum_{i in B} w_i,  mean Y_B = sum w_i y_i / W_B,  centroid X_B = sum w_i x_i / W_B

    Returns:
        (X [K], Y [K], W [K]) of the K blocks, X and Y strictly increasing.
    """
    x, y, w = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (x, y, w))
    order = np.argsort(x, kind="stable")
    x, y, w = x[order], y[order], w[order]
    unique, start = np.unique(x, return_index=True)
    sum_w = np.add.reduceat(w, start)
    sum_wy = np.add.reduceat(w * y, start)
    sum_wx = unique * sum_w
    blocks: list[list[float]] = []  # [sum_w, sum_wy, sum_wx]
    for bw, bwy, bwx in zip(sum_w, sum_wy, sum_wx):
        blocks.append([bw, bwy, bwx])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] >= blocks[-1][1] / blocks[-1][0]:
            last = blocks.pop()
            for k in range(3):
                blocks[-1][k] += last[k]
    array = np.array(blocks, dtype=np.float64).reshape(-1, 3)
    return array[:, 2] / array[:, 0], array[:, 1] / array[:, 0], array[:, 0]


def fit_isotonic(values, targets, weights) -> dict:
    """Centred isotonic map: {"x": block centroids, "y": block means} of :func:`pool_adjacent_violators`."""
    v, q, w = _check_pairs(values, targets, weights)
    x, y, _ = pool_adjacent_violators(v, q, w)
    if x.size < 2:
        raise CalibrationError("isotonic calibration: the held-out labels do not increase with the critic's value "
                               "(one pooled block: the map would be constant and erase every process term); the "
                               "critic has no ranking to calibrate, check it (eval/auroc) before calibrating")
    return {"x": x.tolist(), "y": y.tolist()}


def apply_isotonic(values, x, y) -> np.ndarray:
    """c(v) = linear interpolation of (x_k, y_k) at v; y_1 below x_1, y_K above x_K."""
    return np.interp(np.asarray(values, dtype=np.float64), np.asarray(x, np.float64), np.asarray(y, np.float64))


def platt_features(values) -> np.ndarray:
    """z = logit(clip(v, eps, 1 - eps)) = log(v / (1 - v)), eps = PLATT_EPSILON."""
    v = np.clip(np.asarray(values, dtype=np.float64), PLATT_EPSILON, 1.0 - PLATT_EPSILON)
    return np.log(v) - np.log1p(-v)


def _sigmoid(t: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * t))  # overflow-free


def _separated(z: np.ndarray, q: np.ndarray) -> bool:
    """True when the labels are (quasi-)separated by z, so that the cross-entropy has no finite minimiser.

    A soft label q_i is a weight q_i on outcome 1 and 1 - q_i on outcome 0 at z_i. The maximum-likelihood fit of
    a logistic model exists iff no (a, b) != 0 has a z_i + b >= 0 at every outcome-1 point and <= 0 at every
    outcome-0 point (Albert & Anderson 1984, "On the existence of maximum likelihood estimates in logistic
    regression models"). With one feature: every point with q < 1 lies at or below every point with q > 0 (a > 0),
    or at or above them (a < 0); an empty side counts as separated (all labels 1, or all 0).
    """
    ones, zeros = z[q > 0], z[q < 1]
    if not ones.size or not zeros.size:
        return True
    return bool(zeros.max() <= ones.min() or ones.max() <= zeros.min())


def fit_platt(values, targets, weights, max_iterations: int = 100, tolerance: float = 1e-12) -> dict:
    """Platt scaling c(v) = sigmoid(a z + b), z = :func:`platt_features` (v), fitted on

        L(a, b) = sum_i w_i [log(1 + exp(a z_i + b)) - q_i (a z_i + b)] / sum_i w_i   (weighted soft-label BCE)

    by the one weighted logistic Newton solver (``verl_prm.training.head_fit.fit_logistic_head`` with d = 1),
    until the gradient's max-norm is below ``tolerance``. Refuses equal values (no slope), labels separated by the
    value (:func:`_separated`: the slope grows without bound), a fit that does not converge and a slope a <= 0
    (labels falling as the value rises).

    Returns:
        {"slope": a, "intercept": b}
    """
    import torch

    v, q, w = _check_pairs(values, targets, weights)
    z = platt_features(v)
    if np.ptp(z) == 0.0:
        raise CalibrationError("Platt calibration: all held-out values are equal, so no slope can be fitted; "
                               "check the critic (it outputs a constant) or pass --calibration none")
    if _separated(z, q):
        raise CalibrationError("Platt calibration diverges: the held-out labels are separated by the value (no "
                               "finite slope fits them); pass --calibration isotonic")
    fit = fit_logistic_head(torch.from_numpy(z[:, None]), torch.from_numpy(q), torch.from_numpy(w),
                            max_iterations=max_iterations, tolerance=tolerance)
    slope, intercept = float(fit.weight[0]), float(fit.bias)
    if not fit.converged:
        raise CalibrationError(f"Platt calibration did not converge in {max_iterations} Newton steps (slope "
                               f"{slope:.3g}, gradient {fit.gradient_norm:.3g}): pass --calibration isotonic")
    if slope <= 0:
        raise CalibrationError(f"Platt calibration: fitted slope {slope:.4g} <= 0 (the held-out labels fall as "
                               "the critic's value rises); the critic ranks wrongly, check it (eval/auroc)")
    return {"slope": slope, "intercept": intercept}


def apply_platt(values, slope: float, intercept: float) -> np.ndarray:
    """c(v) = sigmoid(slope * logit(v) + intercept)."""
    return _sigmoid(slope * platt_features(values) + intercept)


@dataclass(frozen=True)
class Calibration:
    """A fitted monotone map of critic values (``method`` "platt" or "isotonic"; see the module docstring).

    Attributes:
        method: "platt" or "isotonic". parameters: {"slope", "intercept"} or {"x", "y"}.
        num_labels: held-out labelled steps it was fitted on. weights_digest: the checkpoint weights it belongs to.
        metrics: what the fit measured (ECE before/after, ...). source: the file it was read from (messages).
    """

    method: str
    parameters: dict
    num_labels: int
    weights_digest: str
    metrics: dict = field(default_factory=dict)
    source: str | None = None

    def __post_init__(self) -> None:
        _validate(self.method, self.parameters, self.source or "calibration")

    def __call__(self, values) -> np.ndarray:
        """The calibrated values (float64 array of the input's shape)."""
        if self.method == "platt":
            return apply_platt(values, self.parameters["slope"], self.parameters["intercept"])
        return apply_isotonic(values, self.parameters["x"], self.parameters["y"])

    def describe(self) -> str:
        if self.method == "platt":
            shape = f"slope {self.parameters['slope']:.4g}, intercept {self.parameters['intercept']:.4g}"
        else:
            shape = f"{len(self.parameters['x'])} breakpoints"
        where = f", from {self.source}" if self.source else ""
        return f"{self.method} calibration ({shape}; fitted on {self.num_labels} held-out labels{where})"

    def to_json(self) -> dict:
        return {"format": _FORMAT, "version": _VERSION, "method": self.method, "parameters": self.parameters,
                "num_labels": self.num_labels, "weights_digest": self.weights_digest, "metrics": self.metrics}


def _validate(method: str, parameters: dict, where: str) -> None:
    fix = "refit it with verl-prm train --calibration METHOD (rerun the finished run), or load with calibration='none'"
    if method == "platt":
        if not isinstance(parameters, dict) or set(parameters) != {"slope", "intercept"}:
            raise CalibrationError(f"{where}: platt parameters must be {{'slope', 'intercept'}}, got "
                                   f"{parameters!r}; {fix}")
        slope, intercept = parameters["slope"], parameters["intercept"]
        if not all(isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p)
                   for p in (slope, intercept)):
            raise CalibrationError(f"{where}: platt slope and intercept must be finite numbers, got {slope!r}, "
                                   f"{intercept!r}; {fix}")
        if slope <= 0:
            raise CalibrationError(f"{where}: platt slope {slope} <= 0 is not an increasing map (it would reverse "
                                   f"the critic's ranking); {fix}")
    elif method == "isotonic":
        if not isinstance(parameters, dict) or set(parameters) != {"x", "y"}:
            raise CalibrationError(f"{where}: isotonic parameters must be {{'x', 'y'}}, got {parameters!r}; {fix}")
        try:
            x, y = (np.asarray(parameters[k], dtype=np.float64) for k in ("x", "y"))
        except (TypeError, ValueError):
            raise CalibrationError(f"{where}: isotonic x and y must be lists of numbers; {fix}") from None
        if x.ndim != 1 or x.shape != y.shape or x.size < 2:
            raise CalibrationError(f"{where}: isotonic x and y must be lists of one length >= 2, got {x.size} and "
                                   f"{y.size}; {fix}")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise CalibrationError(f"{where}: isotonic breakpoints hold NaN or inf; {fix}")
        if np.any(np.diff(x) <= 0) or np.any(np.diff(y) < 0):
            k = int(np.flatnonzero((np.diff(x) <= 0) | (np.diff(y) < 0))[0])
            raise CalibrationError(f"{where}: isotonic map is not monotone at breakpoint {k + 1} (x {x[k]} -> "
                                   f"{x[k + 1]} must increase, y {y[k]} -> {y[k + 1]} must not decrease); {fix}")
        if np.any((y < 0) | (y > 1)):
            raise CalibrationError(f"{where}: isotonic values y must lie in [0, 1]; {fix}")
    else:
        raise CalibrationError(f"{where}: unknown calibration method {method!r}; expected 'platt' or 'isotonic'; "
                               f"{fix}")


def fit_calibration(method: str, values, targets, weights, weights_digest: str) -> Calibration:
    """Fit ``method`` ("platt" or "isotonic") on held-out (value, label, weight) triples."""
    if method == "platt":
        parameters = fit_platt(values, targets, weights)
    elif method == "isotonic":
        parameters = fit_isotonic(values, targets, weights)
    else:
        raise CalibrationError(f"unknown calibration method {method!r}; choose one of {CALIBRATION_METHODS}")
    return Calibration(method, parameters, int(np.size(values)), weights_digest)


def cross_fitted_values(method: str, values, targets, weights, groups, folds: int = 5) -> np.ndarray:
    """Out-of-fold calibrated values: the labels are cut into ``folds`` parts by group (a prompt's steps stay
    together: they share prefixes), and each part is calibrated by a map fitted on the other parts. Their ECE
    estimates the calibrated critic's ECE on new prompts; the ECE of the map on the labels it was fitted on is
    optimistic. Group g (in sorted order of the distinct groups) goes to part g mod folds.

    Raises CalibrationError when a part's complement cannot be fitted (e.g. fewer than MIN_CALIBRATION_LABELS).
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    _, group_index = np.unique(np.asarray(groups).reshape(-1), return_inverse=True)
    part = group_index % folds
    out = np.full_like(v, np.nan)
    q, w = np.asarray(targets, dtype=np.float64).reshape(-1), np.asarray(weights, dtype=np.float64).reshape(-1)
    for k in np.unique(part):
        held, rest = part == k, part != k
        out[held] = fit_calibration(method, v[rest], q[rest], w[rest], "")(v[held])
    return out


def write_calibration(calibration: Calibration, directory: str | Path) -> Path:
    """Write ``directory/calibration.json`` atomically (temporary file, then rename)."""
    path = Path(directory) / CALIBRATION_FILE
    temp = path.with_name(f".{CALIBRATION_FILE}.tmp")
    temp.write_text(json.dumps(calibration.to_json(), indent=2) + "\n")
    os.replace(temp, path)
    return path


def read_calibration(path: str | Path, checkpoint: str | Path | None = None) -> Calibration:
    """Read and check a calibration file; with ``checkpoint``, also that it was fitted for that checkpoint's
    weights (:func:`verl_prm.checkpoints.weights_digest`). Every problem is a CalibrationError naming the file."""
    from verl_prm.checkpoints import weights_digest

    path = Path(path)
    if path.is_dir():
        path = path / CALIBRATION_FILE
    if not path.is_file():
        raise CalibrationError(f"no calibration file {path}: fit one with verl-prm train --calibration platt (or "
                               "isotonic), or load with calibration='none'")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CalibrationError(f"{path} is not JSON ({error}); refit it with verl-prm train --calibration METHOD "
                               "or load with calibration='none'") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != _VERSION:
        raise CalibrationError(f"{path} is not a verl-prm calibration (format {_FORMAT!r} version {_VERSION}); "
                               "refit it with verl-prm train --calibration METHOD or load with calibration='none'")
    missing = [k for k in ("method", "parameters", "num_labels", "weights_digest") if k not in data]
    if missing:
        raise CalibrationError(f"{path} lacks {', '.join(missing)}; refit it with verl-prm train --calibration "
                               "METHOD or load with calibration='none'")
    calibration = Calibration(data["method"], data["parameters"], int(data["num_labels"]),
                              str(data["weights_digest"]), dict(data.get("metrics", {})), str(path))
    if checkpoint is not None:
        actual = weights_digest(checkpoint)
        if actual != calibration.weights_digest:
            raise CalibrationError(f"{path} was fitted for other weights (digest {calibration.weights_digest[:12]}) "
                                   f"than those of {checkpoint} ({actual[:12]}): refit it on this checkpoint with "
                                   "verl-prm train --calibration METHOD, or load with calibration='none'")
    return calibration


def checkpoint_calibration(checkpoint: str | Path, choice: str | os.PathLike = "auto") -> Calibration | None:
    """The calibration a critic loaded from ``checkpoint`` applies.

    ``"auto"``: ``checkpoint/calibration.json`` when the checkpoint is a local directory that has one, else
    None. ``"none"``: None. A path (a file, or a directory holding calibration.json): that file; it must exist.
    In every case a file that is read must match the checkpoint's weights.
    """
    if isinstance(choice, str) and choice == "none":
        return None
    if isinstance(choice, str) and choice == "auto":
        local = Path(checkpoint) / CALIBRATION_FILE
        return read_calibration(local, checkpoint) if local.is_file() else None
    return read_calibration(choice, checkpoint)

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
import numbers
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from verl_prm.checkpoints import weights_digest
from verl_prm.choices import CALIBRATION_METHODS
from verl_prm.training.head_fit import fit_logistic_head

__all__ = [
    "CALIBRATION_FILE",
    "DEFAULT_CALIBRATION",
    "MAX_PLATT_SLOPE",
    "MIN_CALIBRATED_SPAN",
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
DEFAULT_CALIBRATION = "platt"
# Fewest held-out labelled steps a map is fitted on: the mean of 32 labels has a standard error up to
# 0.5 / sqrt(32) = 0.088, about the size of the squashed drop being corrected; fewer labels fit noise.
MIN_CALIBRATION_LABELS = 32
# Platt reads logit(v): v is clipped to [eps, 1 - eps] so that exact 0 and 1 stay finite.
PLATT_EPSILON = 1e-6
# A map is flat when it takes every critic value in [0, 1] into a span below this: 1e-6 is about 16 float32 steps
# at 0.5 (the critic returns float32), so every value would become about one value and every process term
# alpha * (c(v_h) - c(v_{h-1})) about 0. Fitting (fit_calibration) and reading refuse such a map.
MIN_CALIBRATED_SPAN = 1e-6
# Steepest Platt slope: beyond it the map is a step function; fitting refuses it as diverged, reading too.
MAX_PLATT_SLOPE = 1e6
_FORMAT = "verl-prm calibration"
_SHA256 = re.compile(r"[0-9a-f]{64}")
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
        where, fix = (self.source, _FILE_FIX) if self.source else (f"the fitted {self.method} calibration", _FIT_FIX)
        _validate_map(self.method, self.parameters, where, fix)
        _validate_record(self.num_labels, self.weights_digest, self.metrics, where, fix, self.source is not None)
        low, high = self(np.array([0.0, 1.0]))
        if not high - low >= MIN_CALIBRATED_SPAN:
            raise CalibrationError(f"{where}: the {self.method} map is flat: it maps every critic value in [0, 1] "
                                   f"into [{low:.9g}, {high:.9g}], a span under {MIN_CALIBRATED_SPAN:g}, so every "
                                   f"process term would be about 0; {fix}")

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


_FILE_FIX = ("refit it with verl-prm train --calibration METHOD (rerun the finished run), or load with "
             "calibration='none'")
_FIT_FIX = ("the held-out labels give the critic's values no usable ranking: check it (eval/auroc), or pass "
            "--calibration none")


def _finite(value) -> float | None:
    """``value`` as a finite float; None for a bool, a non-number, NaN, inf or an integer too large for a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _validate_map(method, parameters, where: str, fix: str) -> None:
    """A strictly increasing Platt map (0 < slope <= MAX_PLATT_SLOPE), or a monotone isotonic map in [0, 1]."""
    if method == "platt":
        if not isinstance(parameters, dict) or set(parameters) != {"slope", "intercept"}:
            raise CalibrationError(f"{where}: platt parameters must be {{'slope', 'intercept'}}, got "
                                   f"{_shown(parameters)}; {fix}")
        slope, intercept = (_finite(parameters[k]) for k in ("slope", "intercept"))
        if slope is None or intercept is None:
            raise CalibrationError(f"{where}: platt slope and intercept must be finite numbers, got "
                                   f"{_shown(parameters['slope'])}, {_shown(parameters['intercept'])}; {fix}")
        if slope <= 0:
            raise CalibrationError(f"{where}: platt slope {slope} <= 0 is not an increasing map (it would reverse "
                                   f"the critic's ranking); {fix}")
        if slope > MAX_PLATT_SLOPE:
            raise CalibrationError(f"{where}: platt slope {slope:g} is above {MAX_PLATT_SLOPE:g}: a step function, "
                                   f"not a calibration (a fit refuses it as diverged); {fix}")
    elif method == "isotonic":
        if not isinstance(parameters, dict) or set(parameters) != {"x", "y"}:
            raise CalibrationError(f"{where}: isotonic parameters must be {{'x', 'y'}}, got {_shown(parameters)}; "
                                   f"{fix}")
        try:
            x, y = (np.asarray(parameters[k], dtype=np.float64) for k in ("x", "y"))
        except (TypeError, ValueError, OverflowError):
            raise CalibrationError(f"{where}: isotonic x and y must be lists of finite numbers; {fix}") from None
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
        raise CalibrationError(f"{where}: unknown calibration method {_shown(method)}; expected 'platt' or "
                               f"'isotonic'; {fix}")


def _validate_record(num_labels, weights_digest, metrics, where: str, fix: str, from_file: bool) -> None:
    """num_labels an integer >= MIN_CALIBRATION_LABELS (no fit uses fewer); metrics {name: number or text}; the
    weights digest a sha256 hex digest (a fitted map not yet tied to weights, as in cross-fitting, has "")."""
    integer = isinstance(num_labels, numbers.Integral) and not isinstance(num_labels, bool)
    if not integer or num_labels < MIN_CALIBRATION_LABELS:
        raise CalibrationError(f"{where}: num_labels (the held-out labels it was fitted on) must be an integer >= "
                               f"{MIN_CALIBRATION_LABELS}, got {_shown(num_labels)}; {fix}")
    if not isinstance(metrics, dict) or not all(isinstance(name, str) and (isinstance(value, str) or
                                                                           _finite(value) is not None)
                                                for name, value in metrics.items()):
        raise CalibrationError(f"{where}: metrics must be an object of numbers and strings, got {_shown(metrics)}; "
                               f"{fix}")
    if not isinstance(weights_digest, str) or (from_file or weights_digest) and not _SHA256.fullmatch(weights_digest):
        raise CalibrationError(f"{where}: weights_digest must be a sha256 digest (64 hex digits), got "
                               f"{_shown(weights_digest)}; {fix}")


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


def _read_json(path: Path):
    """The JSON of the calibration file ``path``; a CalibrationError naming it if it is absent, a dangling or
    looping link, a directory or another non-file, unreadable, or not JSON."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise CalibrationError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist: restore "
                                   f"that file or remove the link; {_FILE_FIX}") from None
        raise CalibrationError(f"no calibration file {path}: fit one with verl-prm train --calibration platt (or "
                               "isotonic), or load with calibration='none'") from None
    except OSError as error:
        raise CalibrationError(f"{path} cannot be read ({error.strerror}); {_FILE_FIX}") from None
    if stat.S_ISDIR(mode):
        raise CalibrationError(f"{path} is a directory, not a calibration file: remove it (move a calibration.json "
                               f"it holds in its place); {_FILE_FIX}")
    if not stat.S_ISREG(mode):
        raise CalibrationError(f"{path} is not a regular file; {_FILE_FIX}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise CalibrationError(f"{path} cannot be read ({error.strerror}); {_FILE_FIX}") from None
    except ValueError as error:  # not UTF-8, not JSON
        raise CalibrationError(f"{path} is not JSON ({error}); {_FILE_FIX}") from None


def _read_file(path: Path, checkpoint: str | Path | None) -> Calibration:
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != _VERSION:
        raise CalibrationError(f"{path} is not a verl-prm calibration (format {_FORMAT!r} version {_VERSION}); "
                               f"{_FILE_FIX}")
    missing = [k for k in ("method", "parameters", "num_labels", "weights_digest") if k not in data]
    if missing:
        raise CalibrationError(f"{path} lacks {', '.join(missing)}; {_FILE_FIX}")
    calibration = Calibration(data["method"], data["parameters"], data["num_labels"], data["weights_digest"],
                              data.get("metrics", {}), str(path))
    if checkpoint is not None:
        actual = weights_digest(checkpoint)
        if actual != calibration.weights_digest:
            raise CalibrationError(f"{path} was fitted for other weights (digest {calibration.weights_digest[:12]}) "
                                   f"than those of {checkpoint} ({actual[:12]}): refit it on this checkpoint with "
                                   "verl-prm train --calibration METHOD, or load with calibration='none'")
    return calibration


def read_calibration(path: str | Path, checkpoint: str | Path | None = None) -> Calibration:
    """Read and check a calibration file (or ``path/calibration.json`` of a directory); with ``checkpoint``, also
    that it was fitted for that checkpoint's weights (:func:`verl_prm.checkpoints.weights_digest`). Every problem
    is a CalibrationError naming the file (and the field) and the fix."""
    path = Path(path)
    if path.is_dir():
        path = path / CALIBRATION_FILE
    return _read_file(path, checkpoint)


def _present(path: Path) -> bool:
    """Whether anything is at ``path`` (a file, a directory, a dangling link): only a genuinely absent name is."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # e.g. a checkpoint directory that cannot be searched: reading it names the problem
        return True
    return True


def checkpoint_calibration(checkpoint: str | Path, choice: str | os.PathLike = "auto") -> Calibration | None:
    """The calibration a critic loaded from ``checkpoint`` applies: the one function that reads and checks it,
    for the critic workers and for the startup check of a verl run alike.

    ``"auto"``: ``checkpoint/calibration.json`` when there is anything of that name (a dangling link, a directory
    or an unreadable file is an error, not an uncalibrated critic), else None. ``"none"``: None. A path (a file,
    or a directory holding calibration.json): that file; it must exist. In every case a file that is read must
    be a valid, non-flat map fitted for the checkpoint's weights.
    """
    if isinstance(choice, str) and choice == "none":
        return None
    if isinstance(choice, str) and choice == "auto":
        local = Path(checkpoint) / CALIBRATION_FILE
        return _read_file(local, checkpoint) if _present(local) else None
    return read_calibration(choice, checkpoint)

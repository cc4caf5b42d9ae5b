"""A linear value head fitted to convergence on frozen features: weighted logistic regression on soft labels.

With the backbone frozen, a PAV's value head ``v = sigmoid(w . x + b)`` is a logistic regression of the labels on
the backbone's features ``x`` at each labelled step. Its loss is convex, so the optimum can be reached exactly
(Newton's method on the full batch) instead of approached by a few hundred sampled Adam steps, which can stop short of it
when the features are strongly informative (the fitted values then have too small a spread).

It is the library's one weighted-logistic solver: Platt calibration (``verl_prm.training.calibration.fit_platt``)
is the same fit with one feature, logit(v).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["HeadFit", "fit_logistic_head", "weighted_soft_bce"]



@dataclass(frozen=True)
class HeadFit:
    """A fitted head in the features' own units: ``logit = features @ weight + bias``."""

    weight: torch.Tensor  # [d], float64
    bias: float
    loss: float  # the weighted soft-label BCE at the fit
    gradient_norm: float  # max |d objective / d parameter| at the fit (l2 included), standardised units (0: optimum)
    iterations: int
    converged: bool  # gradient_norm <= tolerance


def weighted_soft_bce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The loss the head minimises, over N labelled steps with weights w_n >= 0 (sum > 0):

        L = - sum_n w_n [ q_n log sigmoid(z_n) + (1 - q_n) log(1 - sigmoid(z_n)) ] / sum_n w_n
    """
    import torch.nn.functional as F

    per_step = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    return (weights * per_step).sum() / weights.sum()


def fit_logistic_head(features: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None, *,
                      max_iterations: int = 100, fit_bias: bool = True, tolerance: float = 1e-8,
                      l2: float = 0.0) -> HeadFit:
    """``argmin_{w, b} weighted_soft_bce(features @ w + b, targets, weights) + (l2 / 2) |w'|^2`` by Newton's method,
    w' the weights on the standardised features (below; the bias is not penalised).

    The loss is convex in beta = (w, b); its minimum satisfies ``g = sum_n w_n (p_n - q_n) [x_n, 1] / sum w = 0``
    with ``p_n = sigmoid(x_n . w + b)``. Each iteration solves ``H d = g`` with the Hessian
    ``H = sum_n w_n p_n (1 - p_n) [x_n, 1] [x_n, 1]^T / sum w`` and steps ``beta <- beta - t d`` (t halved until
    the loss decreases enough). Newton's method is used rather than a first-order one because a backbone's hidden
    states are ill-conditioned (their covariance's eigenvalues span ~6 orders of magnitude after the final norm),
    where L-BFGS needs thousands of iterations. It costs O(N d^2) per iteration and O(d^2) memory: cheap for a
    value head of a few thousand features. The fit runs on standardised features ``(x - m) / s`` and is mapped
    back: ``weight = w' / s``, ``bias = b' - weight . m`` (without a bias: ``x / max|x|``, no shift).

    Args:
        features: [N, d] inputs of the head at each labelled step.
        targets: [N] soft labels q in [0, 1] (Monte-Carlo success rates).
        weights: [N] non-negative weights (None: all 1), e.g. the class-balancing weight of each step's rollout.
        max_iterations: Newton iterations at most (~10-30 reach the optimum).
        fit_bias: fit b (False: b = 0, for a head without a bias).
        tolerance: the gradient's max-norm (standardised units) at which the fit stops as converged.
        l2: the ridge penalty on the standardised weights (0: the plain maximum-likelihood fit). With about as
            many features as labelled steps (a 576-wide backbone, a few hundred labels) the plain fit interpolates
            the training labels and its held-out error exceeds a constant's; a penalty of order 1 keeps it a
            regression (``verl-prm train --head-l2``).
    """
    import torch

    if features.dim() != 2 or targets.dim() != 1 or features.shape[0] != targets.shape[0]:
        raise ValueError(f"fit_logistic_head: features must be [N, d] and targets [N], got {tuple(features.shape)} "
                         f"and {tuple(targets.shape)}")
    if features.shape[0] == 0:
        raise ValueError("fit_logistic_head: no labelled step to fit")
    x = features.detach().to(torch.float64)
    q = targets.detach().to(torch.float64)
    w = torch.ones_like(q) if weights is None else weights.detach().to(torch.float64)
    if w.shape != q.shape:
        raise ValueError(f"fit_logistic_head: weights must be [N] = {tuple(q.shape)}, got {tuple(w.shape)}")
    for name, tensor in (("features", x), ("targets", q), ("weights", w)):
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"fit_logistic_head: {name} hold a non-finite value")
    if not bool(((q >= 0) & (q <= 1)).all()):
        raise ValueError("fit_logistic_head: targets must be in [0, 1]")
    if bool((w < 0).any()) or not float(w.sum()) > 0:
        raise ValueError("fit_logistic_head: weights must be >= 0 with a positive sum")
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
        raise ValueError(f"fit_logistic_head: max_iterations must be an integer >= 1, got {max_iterations!r}")
    if isinstance(l2, bool) or not isinstance(l2, (int, float)) or not (math.isfinite(l2) and l2 >= 0):
        raise ValueError(f"fit_logistic_head: l2 must be a finite number >= 0, got {l2!r}")
    mean = x.mean(0) if fit_bias else torch.zeros(x.shape[1], dtype=torch.float64)
    # a constant feature has nothing to standardise: scale 1
    scale = x.std(0) if x.shape[0] > 1 else torch.ones(x.shape[1], dtype=torch.float64)
    scale = torch.where(scale > 1e-12, scale, torch.ones_like(scale))
    if not fit_bias:
        scale = x.abs().max(0).values.clamp_min(1e-12)
    z = (x - mean) / scale
    design = torch.cat([z, torch.ones(len(z), 1, dtype=torch.float64)], 1) if fit_bias else z
    total = w.sum()
    # a ridge far below the curvature of any direction the data span: it only makes H solvable where a feature
    # is constant or features coincide (those directions keep the coefficient 0)
    ridge = 1e-10 * torch.eye(design.shape[1], dtype=torch.float64)
    # the penalty's curvature: l2 on every weight, none on the bias
    penalty = torch.full((design.shape[1],), float(l2), dtype=torch.float64)
    if fit_bias:
        penalty[-1] = 0.0

    def objective(beta: torch.Tensor) -> torch.Tensor:
        return weighted_soft_bce(design @ beta, q, w) + 0.5 * (penalty * beta * beta).sum()

    beta = torch.zeros(design.shape[1], dtype=torch.float64)
    loss = objective(beta)
    iterations, gradient_norm = 0, float("inf")
    for iterations in range(max_iterations + 1):
        p = torch.sigmoid(design @ beta)
        gradient = design.T @ (w * (p - q)) / total + penalty * beta
        gradient_norm = float(gradient.abs().max())
        if gradient_norm <= tolerance or iterations == max_iterations:
            break
        hessian = design.T @ (design * (w * p * (1 - p) / total)[:, None]) + ridge + torch.diag(penalty)
        step = torch.linalg.solve(hessian, gradient)
        # backtracking (Armijo): Newton's full step can overshoot where the sigmoid saturates. The slack of a few
        # rounding errors of the loss lets the last quadratic steps through, whose decrease float64 cannot see.
        t, decrease, slack = 1.0, float(gradient @ step), 1e-14 * abs(float(loss))
        while True:
            candidate = beta - t * step
            candidate_loss = objective(candidate)
            accepted = bool(candidate_loss <= loss - 1e-4 * t * decrease + slack)
            if accepted or t < 1e-10:
                break
            t *= 0.5
        if not accepted:  # no decrease left along the Newton direction at float64 precision
            break
        beta, loss = candidate, candidate_loss
    weight = beta[: z.shape[1]]
    bias = beta[-1] if fit_bias else torch.zeros((), dtype=torch.float64)
    out_weight = weight / scale
    out_bias = float(bias) - float(out_weight @ mean)
    if not (bool(torch.isfinite(out_weight).all()) and torch.isfinite(loss)):
        raise ValueError("fit_logistic_head: the fit diverged (non-finite weights or loss)")
    return HeadFit(weight=out_weight, bias=out_bias, loss=float(weighted_soft_bce(design @ beta, q, w)), gradient_norm=gradient_norm,
                   iterations=iterations, converged=gradient_norm <= tolerance)

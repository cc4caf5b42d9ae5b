"""verl_prm.training.head_fit: the value head fitted to the optimum of its convex loss on frozen features, checked
against Newton's method (iteratively reweighted least squares, Hastie, Tibshirani & Friedman, The Elements of
Statistical Learning, 2nd ed., Sec. 4.4.1, with the observation weights w_n multiplying W and the residuals)."""

from __future__ import annotations

import re

import pytest
import torch

from verl_prm.training.head_fit import fit_logistic_head


def _newton_logistic(x: torch.Tensor, q: torch.Tensor, w: torch.Tensor, iterations: int = 50) -> torch.Tensor:
    """ESL Sec. 4.4.1: beta <- beta + (X^T W X)^-1 X^T (w * (q - p)), W = diag(w_n p_n (1 - p_n)), X with a ones
    column; soft targets q enter the score exactly as the 0/1 labels do. Returns [beta_features..., beta_0]."""
    design = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    beta = torch.zeros(design.shape[1], dtype=x.dtype)
    for _ in range(iterations):
        p = torch.sigmoid(design @ beta)
        hessian = design.T @ (design * (w * p * (1 - p))[:, None])
        beta = beta + torch.linalg.solve(hessian, design.T @ (w * (q - p)))
    return beta


def _data(n: int = 600, d: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # features of very different scales and offsets, as a backbone's hidden states have
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.tensor([1.0, 30.0, 0.01, 3.0, 0.5])[:d] + 5.0
    true_w = torch.tensor([0.8, -0.05, 90.0, 0.4, -1.5], dtype=torch.float64)[:d]
    p = torch.sigmoid((x - 5.0) @ true_w - 0.3)
    q = torch.bernoulli(p, generator=g) * 0.5 + torch.bernoulli(p, generator=g) * 0.5  # two-sample soft labels
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    return x, q, w, true_w, p


def test_the_fit_equals_newtons_method_on_weighted_soft_labels():
    x, q, w, _, _ = _data()
    fit = fit_logistic_head(x, q, w)
    reference = _newton_logistic(x, q, w)
    assert fit.converged
    torch.testing.assert_close(fit.weight, reference[:-1], rtol=1e-5, atol=1e-7)
    assert fit.bias == pytest.approx(float(reference[-1]), rel=1e-5)


def test_labels_equal_to_the_true_probabilities_give_back_the_generating_head():
    """With q_n = sigmoid(x_n . w* + b*) the loss is minimised pointwise at z_n = z_n*: the fit is w*, b*."""
    x, _, w, true_w, p = _data(seed=1)
    fit = fit_logistic_head(x, p, w)
    torch.testing.assert_close(fit.weight, true_w, rtol=1e-5, atol=1e-6)
    assert fit.bias == pytest.approx(-0.3 - float(true_w @ torch.full((5,), 5.0, dtype=torch.float64)), rel=1e-5)


def test_an_integer_weight_is_that_many_copies_of_the_row():
    x, q, _, _, _ = _data(n=200, seed=2)
    counts = torch.randint(1, 4, (200,), generator=torch.Generator().manual_seed(3))
    weighted = fit_logistic_head(x, q, counts.to(torch.float64))
    copied = fit_logistic_head(torch.repeat_interleave(x, counts, 0), torch.repeat_interleave(q, counts))
    torch.testing.assert_close(weighted.weight, copied.weight, rtol=1e-5, atol=1e-7)
    assert weighted.bias == pytest.approx(copied.bias, rel=1e-5)


def test_without_a_bias_the_fit_meets_the_first_order_condition_in_the_weights_only():
    x, q, w, _, _ = _data(seed=4)
    fit = fit_logistic_head(x, q, w, fit_bias=False)
    assert fit.bias == 0.0
    # d L / d weight_j = sum_n w_n (sigmoid(x_n . weight) - q_n) x_nj / sum_n w_n, term by term
    residual = [float(w[n] * (torch.sigmoid(x[n] @ fit.weight) - q[n])) for n in range(len(q))]
    for j in range(x.shape[1]):
        gradient = sum(r * float(x[n, j]) for n, r in enumerate(residual)) / float(w.sum())
        assert abs(gradient) < 1e-6 * float(x[:, j].abs().max())


def test_an_iteration_cap_that_stops_short_is_reported_not_converged():
    x, q, w, _, _ = _data(seed=5)
    assert not fit_logistic_head(x, q, w, max_iterations=1).converged


@pytest.mark.parametrize("change, message", [
    (dict(q=torch.tensor([0.5, 1.5])), "targets must be in [0, 1]"),
    (dict(x=torch.tensor([[1.0], [float("nan")]])), "features hold a non-finite value"),
    (dict(w=torch.tensor([0.0, 0.0])), "weights must be >= 0 with a positive sum"),
    (dict(w=torch.tensor([1.0, -1.0])), "weights must be >= 0 with a positive sum"),
    (dict(x=torch.zeros(0, 1), q=torch.zeros(0), w=torch.zeros(0)), "no labelled step to fit"),
    (dict(q=torch.tensor([0.5, 0.5, 0.5])), "features must be [N, d] and targets [N]"),
])
def test_bad_inputs_are_refused_by_name(change, message):
    inputs = dict(x=torch.tensor([[1.0], [2.0]]), q=torch.tensor([0.2, 0.8]), w=torch.tensor([1.0, 1.0]))
    inputs.update(change)
    with pytest.raises(ValueError, match=re.escape(message)):
        fit_logistic_head(inputs["x"], inputs["q"], inputs["w"])


def _ridge_newton_logistic(z: torch.Tensor, q: torch.Tensor, w: torch.Tensor, l2: float, iterations: int = 50):
    """Ridge logistic regression (ESL Sec. 4.4.4, the L2 analogue of Eq. 4.31: the penalty on the coefficients,
    not the intercept) on the mean loss sum_n w_n BCE_n / sum w + (l2 / 2) |beta|^2, by Newton's method on the
    standardised inputs ``z``: the penalty adds l2 beta to the gradient and l2 I to the Hessian."""
    design = torch.cat([z, torch.ones(z.shape[0], 1, dtype=z.dtype)], 1)
    penalty = torch.full((design.shape[1],), l2, dtype=z.dtype)
    penalty[-1] = 0.0
    beta = torch.zeros(design.shape[1], dtype=z.dtype)
    for _ in range(iterations):
        p = torch.sigmoid(design @ beta)
        gradient = design.T @ (w * (p - q)) / w.sum() + penalty * beta
        hessian = design.T @ (design * (w * p * (1 - p) / w.sum())[:, None]) + torch.diag(penalty)
        beta = beta - torch.linalg.solve(hessian, gradient)
    return beta


def test_the_l2_fit_equals_ridge_logistic_regression_on_the_standardised_features():
    x, q, w, _, _ = _data(seed=6)
    mean, scale = x.mean(0), x.std(0)
    reference = _ridge_newton_logistic((x - mean) / scale, q, w, l2=0.3)
    fit = fit_logistic_head(x, q, w, l2=0.3)
    assert fit.converged
    torch.testing.assert_close(fit.weight, reference[:-1] / scale, rtol=1e-6, atol=1e-9)
    assert fit.bias == pytest.approx(float(reference[-1]) - float((reference[:-1] / scale) @ mean), rel=1e-6)
    # a huge penalty leaves the bias alone: the weighted mean label's logit
    flat = fit_logistic_head(x, q, w, l2=1e9)
    assert float(flat.weight.abs().max()) < 1e-6
    assert flat.bias == pytest.approx(float(torch.logit((w * q).sum() / w.sum())), abs=1e-6)


def test_the_l2_fit_generalises_where_the_plain_fit_interpolates():
    """About as many features as labels (a backbone's width against a few hundred labelled steps): the plain fit's
    held-out squared error exceeds the constant's; the penalised fit's does not."""
    g = torch.Generator().manual_seed(7)
    n, d = 240, 160
    x = torch.randn(2 * n, d, generator=g, dtype=torch.float64)
    p = torch.sigmoid(x[:, :4] @ torch.tensor([1.0, -1.0, 0.5, 0.5], dtype=torch.float64))
    q = torch.bernoulli(p, generator=g)
    train, test = slice(0, n), slice(n, 2 * n)

    def held_out_mse(l2: float) -> float:
        fit = fit_logistic_head(x[train], q[train], max_iterations=200, l2=l2)
        return float(((torch.sigmoid(x[test] @ fit.weight + fit.bias) - q[test]) ** 2).mean())

    constant = float(((q[train].mean() - q[test]) ** 2).mean())
    assert held_out_mse(0.0) > constant > held_out_mse(0.2)


@pytest.mark.parametrize("l2", [-1.0, float("nan"), float("inf"), True])
def test_a_bad_l2_is_refused(l2):
    x, q, w, _, _ = _data(n=20, seed=8)
    with pytest.raises(ValueError, match="l2 must be a finite number >= 0"):
        fit_logistic_head(x, q, w, l2=l2)

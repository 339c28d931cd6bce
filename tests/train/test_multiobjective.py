"""Gradient combiners: sum equals one backward of the summed losses; PCGrad, CAGrad and GradNorm
against hand-derived or brute-force float64 answers; the Trainer trains on a dict of losses."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import ConfigError, KilnError
from kiln.train.multiobjective import GradientCombiner, cagrad, pcgrad


def _two_losses():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    b = torch.nn.Parameter(torch.randn(2))
    x = torch.randn(5, 3)
    y = x @ w + b
    return [w, b], {"a": (y[:, 0] - 1).pow(2).mean(), "b": (y ** 2).sum(1).mean() + y[:, 1].mean()}


def test_sum_is_one_backward_of_the_summed_losses():
    params, losses = _two_losses()
    GradientCombiner("sum").backward(losses, params, step=0)
    got = [p.grad.clone() for p in params]
    params, losses = _two_losses()
    (losses["a"] + losses["b"]).backward()
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


def test_pcgrad_projects_only_conflicts():
    g = torch.Generator().manual_seed(0)
    grads = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    # g1.g2 = -1 < 0: g1 -> g1 - (-1/2) g2 = (0.5, 0.5); g2 -> g2 - (-1/1) g1 = (0, 1); sum (0.5, 1.5)
    torch.testing.assert_close(pcgrad(grads, g), torch.tensor([0.5, 1.5], dtype=torch.float64))
    agree = torch.tensor([[1.0, 0.2], [0.5, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(pcgrad(agree, g), agree.sum(0))


def test_cagrad_matches_brute_force_over_the_simplex():
    torch.manual_seed(1)
    G = torch.randn(2, 6, dtype=torch.float64)
    G[1] = -0.6 * G[0] + 0.3 * torch.randn(6, dtype=torch.float64)  # conflicting objectives
    c = 0.5
    GG = G @ G.T
    g0_norm = GG.mean().sqrt()
    best, best_w = math.inf, None
    for t in torch.linspace(0, 1, 20001, dtype=torch.float64):
        w = torch.stack([t, 1 - t])
        value = float(w @ GG @ torch.full((2,), 0.5, dtype=torch.float64) + c * g0_norm * (w @ GG @ w).sqrt())
        if value < best:
            best, best_w = value, w
    gw = best_w @ G
    want = (G.mean(0) + c * g0_norm / gw.norm() * gw) / (1 + c ** 2)
    got = cagrad(G, c)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(cagrad(G, 0.0), G.mean(0))  # c = 0 is plain gradient descent on the mean
    d = got * (1 + c ** 2)
    assert float((G @ d).min()) >= float((G @ G.mean(0)).min())  # the worst objective does no worse than with g0


def test_gradnorm_balances_weights_and_checkpoints_them():
    comb = GradientCombiner("gradnorm", gradnorm_lr=0.02)
    grads = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    losses = torch.tensor([1.0, 1.0])
    first = comb.combine(grads, losses, step=0)
    torch.testing.assert_close(first, grads.sum(0))  # weights start at 1
    for step in range(1, 100):
        comb.combine(grads, losses, step)
    w = comb.weights
    assert math.isclose(float(w.sum()), 2.0, rel_tol=1e-6)
    assert abs(float(w[0] * 3.0 - w[1] * 1.0)) < 0.2, w  # the weighted gradient norms meet (2.0 at the start)
    other = GradientCombiner("gradnorm", gradnorm_lr=0.02)
    other.load_state_dict(comb.state_dict())
    torch.testing.assert_close(other.combine(grads, losses, 30), comb.combine(grads, losses, 30))
    with pytest.raises(KilnError, match=r"combined objectives by 'gradnorm', this run by 'pcgrad'"):
        GradientCombiner("pcgrad").load_state_dict(comb.state_dict())


@pytest.mark.parametrize("method", ["pcgrad", "cagrad", "gradnorm"])
def test_backward_accumulates_the_combined_gradient(method):
    params, losses = _two_losses()
    comb = GradientCombiner(method)
    total = comb.backward(losses, params, step=3)
    assert math.isclose(float(total), float((losses["a"] + losses["b"]).detach()), rel_tol=1e-6)
    params2, losses2 = _two_losses()
    ga = torch.autograd.grad(losses2["a"], params2, retain_graph=True)
    gb = torch.autograd.grad(losses2["b"], params2)
    flat = torch.stack([torch.cat([g.reshape(-1) for g in ga]), torch.cat([g.reshape(-1) for g in gb])])
    want = GradientCombiner(method).combine(flat, torch.stack([losses2["a"], losses2["b"]]).detach(), step=3)
    torch.testing.assert_close(torch.cat([p.grad.reshape(-1) for p in params]), want)


def test_user_errors():
    with pytest.raises(ConfigError, match=r"multi-objective method 'mgda' is not one of: sum, pcgrad, gradnorm, cagrad"):
        GradientCombiner("mgda")
    params, losses = _two_losses()
    comb = GradientCombiner("pcgrad")
    comb.backward(losses, params, step=0)
    params, losses = _two_losses()
    with pytest.raises(KilnError, match=r"the step returned losses \['a'\], earlier steps returned \['a', 'b'\]"):
        comb.backward({"a": losses["a"]}, params, step=1)

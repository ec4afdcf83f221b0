"""The low-rank Gaussian imputation model against direct conditional-Gaussian computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.data import lowrank
from gossip_pfl.expfam.imputation import LowRankGaussian, LowRankParams
from gossip_pfl.expfam.models import DTYPE

torch.set_num_threads(1)
D, R = 5, 2


def _theta(seed=0):
    g = torch.Generator().manual_seed(seed)
    return LowRankParams(torch.randn(D, generator=g, dtype=DTYPE),
                         torch.randn(D, R, generator=g, dtype=DTYPE),
                         torch.tensor(0.4, dtype=DTYPE))  # fmt: skip


def _direct(theta, y):
    """E[s | y_o] from the joint Gaussian of (y, z) by conditioning on y_o (Schur complement)."""
    mu, W, v = theta.mu.numpy(), theta.W.numpy(), float(theta.var)
    o = ~np.isnan(y)
    # joint of u = (y, z): mean (mu, 0), covariance [[W W^T + v I, W], [W^T, I]]
    cov = np.block([[W @ W.T + v * np.eye(D), W], [W.T, np.eye(R)]])
    mean = np.concatenate([mu, np.zeros(R)])
    obs = np.flatnonzero(o)
    rest = np.concatenate([np.flatnonzero(~o), D + np.arange(R)])
    K = cov[np.ix_(rest, obs)] @ np.linalg.inv(cov[np.ix_(obs, obs)])
    m_rest = mean[rest] + K @ (y[obs] - mean[obs])
    c_rest = cov[np.ix_(rest, rest)] - K @ cov[np.ix_(obs, rest)]
    # second moments of u = (y, z) given y_o
    Eu = np.zeros(D + R)
    Cu = np.zeros((D + R, D + R))
    Eu[obs] = y[obs]
    Eu[rest] = m_rest
    Cu[np.ix_(rest, rest)] = c_rest
    Euu = Cu + np.outer(Eu, Eu)
    zt = np.concatenate([[1.0], Eu[D:]])
    Ezz = np.zeros((R + 1, R + 1))
    Ezz[0] = Ezz[:, 0] = zt
    Ezz[1:, 1:] = Euu[D:, D:]
    Eyz = np.concatenate([Eu[:D, None], Euu[:D, D:]], axis=1)
    return np.concatenate([Ezz.ravel(), Eyz.ravel(), [np.trace(Euu[:D, :D])]]), Eu[:D]


def test_estep_matches_the_direct_conditional_gaussian():
    theta = _theta()
    g = np.random.default_rng(3)
    x = g.standard_normal((2, 6, D))
    x[g.random(x.shape) < 0.35] = np.nan
    x[0, 0] = np.nan
    x[0, 0, 2] = 1.3  # one observed entry
    model = LowRankGaussian(D, R)
    s = model.sbar(theta, torch.as_tensor(x)).numpy()
    filled = model.impute(theta, torch.as_tensor(x)).numpy()
    for i in range(2):
        for j in range(6):
            want, mean_y = _direct(theta, x[i, j])
            np.testing.assert_allclose(s[i, j], want, rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(filled[i, j], mean_y, rtol=1e-10, atol=1e-10)


def test_loglik_is_the_observed_marginal_density():
    theta = _theta(1)
    x = np.random.default_rng(4).standard_normal((1, 3, D))
    x[0, 1, [0, 3]] = np.nan
    ll = LowRankGaussian(D, R).sample_loglik(theta, torch.as_tensor(x)).numpy()[0]
    mu, W, v = theta.mu.numpy(), theta.W.numpy(), float(theta.var)
    for j in range(3):
        o = ~np.isnan(x[0, j])
        C = (W @ W.T + v * np.eye(D))[np.ix_(o, o)]
        r = x[0, j, o] - mu[o]
        want = -0.5 * (o.sum() * math.log(2 * math.pi) + np.linalg.slogdet(C)[1]
                       + r @ np.linalg.solve(C, r))  # fmt: skip
        assert ll[j] == pytest.approx(want, rel=1e-10)


def test_mstep_of_complete_statistics_is_least_squares():
    """With nothing missing and z known, T gives the least-squares [mu, W] and mean residual."""
    g = np.random.default_rng(5)
    z = g.standard_normal((400, R))
    y = 0.5 + z @ g.standard_normal((R, D)) + 0.2 * g.standard_normal((400, D))
    zt = np.concatenate([np.ones((400, 1)), z], 1)
    s = np.concatenate([(zt.T @ zt / 400).ravel(), (y.T @ zt / 400).ravel(), [(y**2).sum() / 400]])
    theta = LowRankGaussian(D, R).T(torch.as_tensor(s))
    A, *_ = np.linalg.lstsq(zt, y, rcond=None)
    np.testing.assert_allclose(theta.mu, A[0], atol=1e-10)
    np.testing.assert_allclose(theta.W, A[1:].T, atol=1e-10)
    assert float(theta.var) == pytest.approx(((y - zt @ A) ** 2).mean(), rel=1e-9)


def test_projection_restores_the_domain():
    """Random statistics (far off: the explained variance reaches 1e8, so sigma^2 comes from a
    cancellation) projected back: finite, sigma^2 >= min_var. 22 of these 300 draws fell
    below min_var before the floor had a margin for the cancellation."""
    model = LowRankGaussian(D, R)
    s = torch.randn(300, 4, model.q, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    s[:, 1, 0] = float("nan")
    fixed_s, fixed = model.project(s.flatten(0, 1))
    theta = model.T(fixed_s)
    assert fixed > 0 and torch.isfinite(fixed_s).all()
    assert (theta.var >= model.min_var * 0.999).all()


def test_bad_rank_and_all_missing_rows_are_one_line_errors():
    with pytest.raises(GossipError, match="expfam.rank"):
        LowRankGaussian(3, 3)
    with pytest.raises(GossipError, match="expfam.missing"):
        lowrank(n=2, m=20, dim=2, rank=1, missing=0.9)

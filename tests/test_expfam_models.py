"""Exponential-family GMMs in statistic space: closed-form M-step, E-step, projection."""

from __future__ import annotations

import pytest
import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.models import (
    DTYPE,
    GaussianMixtureDiagonal,
    GaussianMixtureShared,
    GMMParams,
    _lower_inverse,
    client_means,
    initial_params,
    mean_field,
    sample_batch,
)


def _labelled(n=3, m=200, G=3, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(G, d, generator=g, dtype=DTYPE) * 3
    z = torch.randint(0, G, (n, m), generator=g)
    x = mu[z] + torch.randn(n, m, d, generator=g, dtype=DTYPE) * 0.7
    return x, z, mu


def _theta(G=3, d=2, seed=1, diag=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.softmax(torch.randn(G, generator=g, dtype=DTYPE), 0)
    mu = torch.randn(G, d, generator=g, dtype=DTYPE) * 2
    if diag:
        cov = torch.rand(G, d, generator=g, dtype=DTYPE) + 0.3
    else:
        A = torch.randn(d, d, generator=g, dtype=DTYPE)
        cov = A @ A.T + 0.5 * torch.eye(d, dtype=DTYPE)
    return GMMParams(w, mu, cov)


def test_shared_mstep_of_complete_stats_is_the_labelled_mle():
    x, z, _ = _labelled()
    model = GaussianMixtureShared.from_data(x, 3)
    s = model.complete_stats(x, z).mean(dim=(0, 1))
    theta = model.T(s)
    y, zz = x.reshape(-1, 2), z.reshape(-1)
    N = y.shape[0]
    for l in range(3):
        assert theta.weights[l].item() == pytest.approx((zz == l).sum().item() / N, abs=1e-12)
        assert torch.allclose(theta.means[l], y[zz == l].mean(0), atol=1e-12)
    r = y - theta.means[zz]
    assert torch.allclose(theta.cov, r.T @ r / N, atol=1e-10)
    assert model.project(s)[1] == 0


def test_diagonal_mstep_of_complete_stats_is_the_labelled_mle():
    x, z, _ = _labelled(seed=3)
    model = GaussianMixtureDiagonal(3, 2)
    theta = model.T(model.complete_stats(x, z).mean(dim=(0, 1)))
    y, zz = x.reshape(-1, 2), z.reshape(-1)
    for l in range(3):
        yl = y[zz == l]
        assert torch.allclose(theta.means[l], yl.mean(0), atol=1e-12)
        assert torch.allclose(theta.cov[l], yl.var(0, unbiased=False), atol=1e-10)


def test_mstep_recovers_true_parameters_on_a_large_sample():
    g = torch.Generator().manual_seed(5)
    mu = torch.tensor([[-2.0, 0.0], [2.0, 1.0]], dtype=DTYPE)
    cov = torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=DTYPE)
    z = (torch.rand(4, 5000, generator=g) < 0.3).long()
    noise = torch.randn(4, 5000, 2, generator=g, dtype=DTYPE) @ torch.linalg.cholesky(cov).T
    x = mu[z] + noise
    model = GaussianMixtureShared.from_data(x, 2)
    theta = model.T(model.complete_stats(x, z).mean(dim=(0, 1)))
    assert theta.weights[1].item() == pytest.approx(0.3, abs=0.02)
    assert torch.allclose(theta.means, mu, atol=0.05)
    assert torch.allclose(theta.cov, cov, atol=0.05)


@pytest.mark.parametrize("d", [1, 2, 7])  # 7: the triangular inverse's general rows
def test_shared_estep_against_direct_density(d):
    x, _, _ = _labelled(n=2, m=7, d=d)
    model = GaussianMixtureShared.from_data(x, 3)
    theta = _theta(d=d)
    means, cov = theta.means.clone().requires_grad_(), theta.cov.clone().requires_grad_()
    theta = GMMParams(theta.weights, means, cov)
    r = model.responsibilities(theta, x)
    logd = torch.stack(
        [
            theta.weights[l].log()
            + torch.distributions.MultivariateNormal(means[l], cov).log_prob(x)
            for l in range(3)
        ],
        dim=-1,
    )
    tight = {"rtol": 1e-10, "atol": 1e-12}
    assert torch.allclose(r, torch.softmax(logd, -1), **tight)
    s = model.sbar(theta, x)
    s1, s2 = model.split(s)
    assert torch.allclose(s1, r) and torch.allclose(s2, r.unsqueeze(-1) * x.unsqueeze(-2))
    ll = model.loglik(theta, x)
    direct = torch.logsumexp(logd, -1).mean(-1)
    assert torch.allclose(ll, direct, **tight)
    # autograd goes through the E-step (the triangular inverse is built out of place)
    got = torch.autograd.grad(ll.sum(), (means, cov))
    want = torch.autograd.grad(direct.sum(), (means, cov))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("d", [1, 2, 7, 50])
@pytest.mark.parametrize("batch", [(), (4,), (2, 3)])
def test_lower_inverse_against_a_triangular_solve(d, batch):
    g = torch.Generator().manual_seed(d)
    A = torch.randn(*batch, d, d, generator=g, dtype=DTYPE)
    L = torch.linalg.cholesky(A @ A.mT + 0.1 * torch.eye(d, dtype=DTYPE))
    eye = torch.eye(d, dtype=DTYPE).expand(L.shape)
    want = torch.linalg.solve_triangular(L, eye, upper=False)
    got = _lower_inverse(L)
    assert got.shape == L.shape
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12 * float(want.abs().max()))
    assert torch.equal(got.triu(1), torch.zeros_like(got))


def test_diagonal_estep_against_direct_density():
    x, _, _ = _labelled(n=2, m=7)
    model = GaussianMixtureDiagonal(3, 2)
    theta = _theta(diag=True)
    r = model.responsibilities(theta, x)
    dens = torch.stack(
        [
            theta.weights[l]
            * torch.distributions.Normal(theta.means[l], theta.cov[l].sqrt())
            .log_prob(x)
            .sum(-1)
            .exp()
            for l in range(3)
        ],
        dim=-1,
    )
    assert torch.allclose(r, dens / dens.sum(-1, keepdim=True), atol=1e-12)


@pytest.mark.parametrize("d", [2, 7])
def test_per_client_theta_matches_separate_calls(d):
    x, _, _ = _labelled(n=2, m=5, d=d)
    model = GaussianMixtureShared.from_data(x, 3)
    t0, t1 = _theta(seed=1, d=d), _theta(seed=2, d=d)
    both = GMMParams(*(torch.stack([a, b]) for a, b in zip(vars(t0).values(), vars(t1).values())))
    s = model.sbar(both, x)  # one factor per client against a shared one
    tight = {"rtol": 1e-12, "atol": 1e-12}
    assert torch.allclose(s[0], model.sbar(t0, x[:1])[0], **tight)
    assert torch.allclose(s[1], model.sbar(t1, x[1:])[0], **tight)


@pytest.mark.parametrize("cls", [GaussianMixtureShared, GaussianMixtureDiagonal])
def test_projection_keeps_t_in_its_domain(cls):
    x, z, _ = _labelled(n=2, m=100)
    model = cls.from_data(x, 3)
    s = model.complete_stats(x, z).mean(dim=(0, 1))
    g = torch.Generator().manual_seed(0)
    noisy = s + 3.0 * torch.randn(500, model.q, generator=g, dtype=DTYPE) * s.abs().mean()
    noisy[0] = float("nan")
    noisy[1, 0] = float("inf")
    p, fixed = model.project(noisy)
    assert fixed > 0 and torch.isfinite(p).all()
    theta = model.T(p)
    assert torch.isfinite(theta.weights).all() and torch.isfinite(theta.means).all()
    assert (theta.weights >= 0).all()
    assert torch.allclose(theta.weights.sum(-1), torch.ones(500, dtype=DTYPE))
    if cls is GaussianMixtureShared:
        assert (torch.linalg.eigvalsh(theta.cov)[:, 0] > 0).all()
    else:
        assert (theta.cov > 0).all()
    again, fixed2 = model.project(p)  # idempotent up to rounding
    assert fixed2 == 0 or torch.allclose(again, p, atol=1e-12)


def test_full_batch_client_means_and_mean_field_at_fixed_point():
    x, _, _ = _labelled(n=3, m=20)
    model = GaussianMixtureShared.from_data(x, 3)
    theta = _theta()
    assert sample_batch(3, 20, None) is None and sample_batch(3, 20, 20) is None
    full = client_means(model, theta, x)
    assert torch.allclose(full, model.sbar(theta, x).mean(1))
    idx = sample_batch(3, 20, 5, torch.Generator().manual_seed(0))
    assert idx.shape == (3, 5) and all(len(set(r.tolist())) == 5 for r in idx)
    s = full.mean(0)
    for _ in range(300):  # EM in statistic space converges to a root of h
        s = s + mean_field(model, s, x)
    assert mean_field(model, s, x).norm() < 1e-6


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(GossipError, match="components"):
        GaussianMixtureDiagonal(0, 2)
    with pytest.raises(GossipError, match="second_moment"):
        GaussianMixtureShared(2, 2, torch.zeros(2, 2))
    with pytest.raises(GossipError, match="batch"):
        sample_batch(2, 10, 0)


@pytest.mark.parametrize("diagonal", [False, True])
def test_initial_params_are_in_the_domain(diagonal):
    x, _, _ = _labelled(n=2, m=30)
    cls = GaussianMixtureDiagonal if diagonal else GaussianMixtureShared
    model = cls.from_data(x, 3)
    theta = initial_params(x, 3, diagonal, torch.Generator().manual_seed(0))
    assert torch.allclose(theta.weights, torch.full((3,), 1 / 3, dtype=DTYPE))
    y = x.reshape(-1, 2)
    assert all((y == mu).all(-1).any() for mu in theta.means)
    s = model.sbar(theta, x).mean(dim=(0, 1))
    assert model.project(s)[1] == 0 and torch.isfinite(s).all()
    with pytest.raises(GossipError, match="components"):
        initial_params(x, 61, diagonal)

"""Star FedEM / naive / VR-FedEM in statistic space against exact EM and SPIDER-EM."""

from __future__ import annotations

import pytest
import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.compress import BlockQuantization, Identity, RandomDithering
from gossip_pfl.expfam.fedem import (
    fedem_init,
    fedem_round,
    initial_memories,
    naive_round,
    vr_fedem_outer,
    vr_init,
)
from gossip_pfl.expfam.models import (
    DTYPE,
    GaussianMixtureShared,
    GMMParams,
    client_means,
    mean_field,
    sample_batch,
)


def _data(n=4, m=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = torch.tensor([[-1.5, 0.0], [1.5, 0.5]], dtype=DTYPE)
    z = (torch.rand(n, m, generator=g) < 0.4).long()
    x = mu[z] + torch.randn(n, m, 2, generator=g, dtype=DTYPE)
    x[0] += 0.5  # heterogeneous clients
    return x


def _theta0():
    return GMMParams(
        torch.tensor([0.5, 0.5], dtype=DTYPE),
        torch.tensor([[-0.5, 0.2], [0.3, -0.1]], dtype=DTYPE),
        torch.eye(2, dtype=DTYPE),
    )


def _exact_em(theta: GMMParams, y: torch.Tensor, steps: int):
    """EM for the shared-covariance GMM in parameter space, written out directly."""
    out = []
    for _ in range(steps):
        dens = torch.stack(
            [
                theta.weights[l]
                * torch.distributions.MultivariateNormal(theta.means[l], theta.cov)
                .log_prob(y)
                .exp()
                for l in range(2)
            ],
            dim=-1,
        )
        r = dens / dens.sum(-1, keepdim=True)
        nk = r.sum(0)
        mu = (r.T @ y) / nk[:, None]
        cov = sum((r[:, l, None] * (y - mu[l])).T @ (y - mu[l]) for l in range(2)) / y.shape[0]
        theta = GMMParams(nk / y.shape[0], mu, cov)
        out.append(theta)
    return out


def _close(a: GMMParams, b: GMMParams, tol=1e-10):
    return all(
        torch.allclose(u, v, atol=tol, rtol=0) for u, v in zip(vars(a).values(), vars(b).values())
    )


def test_fedem_without_compression_full_batch_is_exact_em():
    x = _data()
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)
    V0 = torch.randn(4, model.q, generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    state = fedem_init(S0, V0)
    ref = _exact_em(model.T(S0), x.reshape(-1, 2), 15)
    S_naive = S0
    for k in range(15):
        state, info = fedem_round(model, x, state, quant=Identity(), gamma=1.0, alpha=0.3, p=1.0)
        S_naive, _ = naive_round(model, x, S_naive, quant=Identity(), gamma=1.0)
        assert _close(model.T(state.S), ref[k]), k
        assert _close(model.T(S_naive), ref[k]), k
        assert info["projected"] == 0 and info["active"] == 4
        assert info["expectations"] == 200 and info["bits"] == 4 * 64 * model.q


@pytest.mark.parametrize("quant", [Identity(), RandomDithering(levels=2), BlockQuantization(3)])
def test_memory_invariant_under_partial_participation(quant):
    x = _data(n=6, m=30)
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)
    state = fedem_init(S0, initial_memories(model, S0, x))
    g = torch.Generator().manual_seed(7)
    seen_partial = False
    for _ in range(40):
        old = state
        state, info = fedem_round(
            model, x, state, quant=quant, gamma=0.05, alpha=0.5, p=0.5, batch=5, generator=g
        )
        assert torch.allclose(state.V, state.V_i.mean(0), atol=1e-12, rtol=0)
        unchanged = (state.V_i == old.V_i).all(-1).sum().item()
        assert unchanged >= 6 - info["active"]
        seen_partial |= 0 < info["active"] < 6
        assert info["bits"] == info["active"] * quant.bits(model.q)
        assert torch.isfinite(state.S).all()
    assert seen_partial


def test_partial_participation_scales_the_received_sum_by_one_over_p():
    """One round at p = 0.5, full batches, no compression, against Alg. 4 written out:
    H = V + (1 / (n p)) sum_{i active} (S_i - S - V_i), S' = S + gamma H, V' = V + (alpha / n)
    sum_{i active} (S_i - S - V_i); the naive baseline's H = (1 / (n p)) sum (S_i - S). The
    active set is the round's first draw: n uniforms below p."""
    x = _data(n=6, m=30)
    n, p, gamma, alpha = 6, 0.5, 0.05, 0.5
    model = GaussianMixtureShared.from_data(x, 2)
    S = client_means(model, _theta0(), x).mean(0)
    state = fedem_init(S, initial_memories(model, S, x) + 0.01)  # memories away from S_i - S
    seed = 3
    active = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=DTYPE) < p
    assert 0 < int(active.sum()) < n
    S_i = client_means(model, model.T(S), x)  # every client's full-batch statistics
    delta = (S_i - S - state.V_i)[active].sum(0)
    new, info = fedem_round(model, x, state, quant=Identity(), gamma=gamma, alpha=alpha, p=p,
                            generator=torch.Generator().manual_seed(seed))  # fmt: skip
    assert info["projected"] == 0 and info["active"] == int(active.sum())
    H = state.V + delta / (n * p)
    torch.testing.assert_close(new.S, S + gamma * H, rtol=0, atol=1e-12)
    torch.testing.assert_close(new.V, state.V + alpha * delta / n, rtol=0, atol=1e-12)
    naive, _ = naive_round(model, x, S, quant=Identity(), gamma=gamma, p=p,
                           generator=torch.Generator().manual_seed(seed))  # fmt: skip
    H_naive = (S_i - S)[active].sum(0) / (n * p)
    torch.testing.assert_close(naive, S + gamma * H_naive, rtol=0, atol=1e-12)


def test_round_with_no_active_worker_moves_by_the_memory():
    x = _data(n=2, m=10)
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)
    state = fedem_init(S0, initial_memories(model, S0, x))
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # p = 0.05: most rounds have nobody
        new, info = fedem_round(
            model, x, state, quant=Identity(), gamma=0.1, alpha=1, p=0.05, generator=g
        )
        if info["active"] == 0:
            assert torch.allclose(new.S, model.project(state.S + 0.1 * state.V)[0])
            assert torch.equal(new.V_i, state.V_i)
            return
        state = new
    pytest.fail("no empty round drawn")


def test_seeded_rounds_repeat():
    x = _data()
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)

    def run():
        st, g = fedem_init(S0, n=4), torch.Generator().manual_seed(11)
        for _ in range(5):
            st, _ = fedem_round(
                model,
                x,
                st,
                quant=RandomDithering(1),
                gamma=0.1,
                alpha=0.5,
                p=0.75,
                batch=7,
                generator=g,
            )
        return st.S

    assert torch.equal(run(), run())


def test_vr_fedem_one_worker_uncompressed_is_spider_em():
    x = _data(n=1, m=80)
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)
    gamma, b, k_in = 0.3, 6, 5
    state = vr_init(S0, initial_memories(model, S0, x))
    g = torch.Generator().manual_seed(5)
    S_ref, g_ref = S0.clone(), torch.Generator().manual_seed(5)
    for _ in range(3):
        state, infos = vr_fedem_outer(
            model,
            x,
            state,
            k_in=k_in,
            quant=Identity(),
            gamma=gamma,
            alpha=0.5,
            batch=b,
            generator=g,
        )
        # SPIDER-EM (Fort, Moulines, Wai 2020), written out
        est, S_prev = client_means(model, model.T(S_ref), x)[0], S_ref
        for _ in range(k_in):
            idx = sample_batch(1, 80, b, g_ref)
            diff = client_means(model, model.T(S_ref), x, idx) - client_means(
                model, model.T(S_prev), x, idx
            )
            est = est + diff[0]
            S_prev, S_ref = S_ref, S_ref + gamma * (est - S_ref)
        assert torch.allclose(state.S, S_ref, atol=1e-10, rtol=0)
        assert all(i["projected"] == 0 for i in infos)
        assert infos[0]["expectations"] == 80 + 2 * b and infos[1]["expectations"] == 2 * b


def test_vr_fedem_full_batch_gamma_one_is_exact_em():
    x = _data()
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)
    state = vr_init(S0, initial_memories(model, S0, x))
    ref = _exact_em(model.T(S0), x.reshape(-1, 2), 8)
    state, _ = vr_fedem_outer(
        model, x, state, k_in=8, quant=Identity(), gamma=1.0, alpha=0.5, batch=None
    )
    assert _close(model.T(state.S), ref[-1])
    assert torch.allclose(state.V, state.V_i.mean(0), atol=1e-12, rtol=0)


def test_fedem_with_compression_approaches_a_root_of_h():
    x = _data(n=10, m=40, seed=2)
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)
    state = fedem_init(S0, initial_memories(model, S0, x))
    g = torch.Generator().manual_seed(1)
    h0 = mean_field(model, S0, x).norm().item()
    for _ in range(300):
        state, _ = fedem_round(
            model,
            x,
            state,
            quant=RandomDithering(levels=1),
            gamma=0.1,
            alpha=0.5,
            p=0.75,
            generator=g,
        )
    assert mean_field(model, state.S, x).norm().item() < 0.1 * h0


def test_bad_participation_is_a_one_line_error():
    x = _data(n=2, m=5)
    model = GaussianMixtureShared.from_data(x, 2)
    S0 = client_means(model, _theta0(), x).mean(0)
    with pytest.raises(GossipError, match="participation"):
        fedem_round(model, x, fedem_init(S0, n=2), quant=Identity(), gamma=1, alpha=1, p=0)
    with pytest.raises(GossipError, match="k_in"):
        vr_fedem_outer(
            model,
            x,
            vr_init(S0, torch.zeros(2, model.q, dtype=DTYPE)),
            k_in=0,
            quant=Identity(),
            gamma=1,
            alpha=1,
            batch=None,
        )

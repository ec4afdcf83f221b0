"""The synthetic mixture's worker splits (gossip_pfl.expfam.data.gmm2d, ``expfam.split``) and
what they are for: the naive baseline's compression noise is set by the workers' heterogeneity,
FedEM's memories take it away."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.compress import BlockQuantization
from gossip_pfl.expfam.data import gmm2d
from gossip_pfl.expfam.fedem import fedem_init, fedem_round, initial_memories, naive_round
from gossip_pfl.expfam.models import (
    DTYPE,
    GaussianMixtureShared,
    GMMParams,
    client_means,
    initial_params,
    mean_field,
)

torch.set_num_threads(1)


def _component0_share(data) -> np.ndarray:
    """Each worker's fraction of samples from component 0."""
    z = data.labels.numpy()
    return np.array([(z[i, :c] == 0).mean() for i, c in enumerate(data.counts)])


def test_sorted_split_gives_each_worker_one_component():
    data = gmm2d(n=10, m=40, seed=3, split="sorted")
    np.testing.assert_array_equal(_component0_share(data), [1.0] * 5 + [0.0] * 5)
    assert data.meta["weights"] == pytest.approx([0.5, 0.5])
    # unequal sizes: still whole workers per component, the weights follow the counts
    data = gmm2d(n=6, m=30, seed=3, sizes="unequal", split="sorted")
    np.testing.assert_array_equal(_component0_share(data), [1, 1, 1, 0, 0, 0])
    share0 = data.counts[:3].sum() / data.counts.sum()
    assert data.meta["weights"] == pytest.approx([share0, 1 - share0])


@pytest.mark.parametrize("split", ["iid", "mixed"])
def test_iid_and_mixed_splits_draw_each_worker_at_its_share(split):
    """Per worker, the fraction of component 0 is within 4 binomial sd of its share (1/2 for
    iid; the worker's own, in [0.1, 0.9], for mixed)."""
    m = 2000
    data = gmm2d(n=20, m=m, seed=4, split=split)
    share = np.asarray(data.meta["shares"])
    if split == "iid":
        np.testing.assert_array_equal(share, 0.5)
    else:
        assert share.min() >= 0.1 and share.max() <= 0.9 and share.std() > 0.1
    sd = np.sqrt(share * (1 - share) / m)
    assert np.all(np.abs(_component0_share(data) - share) < 4 * sd)


def test_mixed_is_the_default_and_splits_share_the_noise_draws():
    """The default split is mixed (unchanged data), and the split only moves samples between
    the components: the Gaussian noise around each sample's mean is the same draw."""
    base = gmm2d(n=8, m=25, seed=2)
    np.testing.assert_array_equal(base.x, gmm2d(n=8, m=25, seed=2, split="mixed").x)
    mu = torch.tensor(base.meta["means"], dtype=DTYPE)
    other = gmm2d(n=8, m=25, seed=2, split="sorted")
    noise = base.x - mu[base.labels.long()]
    np.testing.assert_allclose(other.x - mu[other.labels.long()], noise, atol=1e-12)


def test_bad_split_is_a_one_line_error():
    with pytest.raises(GossipError, match="expfam.split"):
        gmm2d(n=4, m=5, split="by_label")
    base = {"algorithm": {"name": "fedem_em"}, "expfam": {"split": "by_label"}}
    with pytest.raises(GossipError, match="expfam.split"):
        load_config(base=base)


def _heterogeneity(split: str) -> float:
    """mean_i ||sbar_i - sbar||^2 at the true parameters: what the naive baseline compresses at
    the fixed point (S_i - S_k does not go to zero)."""
    data = gmm2d(n=20, m=200, seed=1, split=split)
    model = GaussianMixtureShared.from_data(data.x.reshape(1, -1, 2), 2)
    m = data.meta
    theta = GMMParams(*(torch.tensor(m[k], dtype=DTYPE) for k in ("weights", "means", "cov")))
    s = client_means(model, theta, data.x)
    return float(((s - s.mean(0)) ** 2).sum(-1).mean())


def test_sorted_split_is_the_most_heterogeneous():
    iid, mixed, ordered = (_heterogeneity(s) for s in ("iid", "mixed", "sorted"))
    assert iid < 0.02 < 0.1 * ordered
    assert iid < mixed < ordered


def test_compressed_naive_stalls_on_the_sorted_split_while_fedem_converges():
    """Full local passes and p = 1, so compression is the only noise: FedEM's compressed
    increments S_i - S - V_i go to zero and ||h||^2 falls like EM's; the naive baseline
    compresses S_i - S, whose size heterogeneity sets, and stays on a floor."""
    data = gmm2d(n=10, m=50, seed=1, split="sorted")
    x = data.x
    model = GaussianMixtureShared.from_data(x.reshape(1, -1, 2), 2)
    theta0 = initial_params(x, 2, False, torch.Generator().manual_seed(0))
    S0 = client_means(model, theta0, x).mean(0)
    quant = BlockQuantization(blocks=6)  # one block: omega = sqrt(6) - 1
    g_fed, g_naive = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    state = fedem_init(S0, initial_memories(model, S0, x))
    S = S0.clone()
    for _ in range(400):
        state, _ = fedem_round(model, x, state, quant=quant, gamma=0.2, alpha=0.3,
                               generator=g_fed)  # fmt: skip
        S, _ = naive_round(model, x, S, quant=quant, gamma=0.2, generator=g_naive)
    fed = float((mean_field(model, state.S, x) ** 2).sum())
    naive = float((mean_field(model, S, x) ** 2).sum())
    assert fed < 1e-12
    assert naive > 1e-6

"""Data sets for federated EM: each is a padded ``(n, m_max, d)`` float64 tensor over n workers.

- ``gmm2d``: the synthetic 2-D Gaussian mixture of the paper's first experiment (two components,
  one shared covariance). Its true parameters are not given in the paper; ours are in
  ``meta``. ``split`` says how heterogeneous the workers are (the paper does not say how it
  splits its data): ``iid`` (every worker draws component 0 with probability 1/2), ``mixed``
  (worker i with its own probability, uniform in [0.1, 0.9]) or ``sorted`` (the first half of
  the workers hold component 0 only, the others component 1 only).
- ``fashion_mnist``: Fashion-MNIST (70,000 images) in place of the paper's MNIST: constant pixels
  dropped, projected on the 20 leading principal components (numpy SVD), shuffled and split
  over the workers.
- ``lowrank``: y = mu + W z + sigma eps with z ~ N(0, I_r), and a fraction of the entries marked
  missing (NaN); the complete values are kept in ``truth`` to score imputations.

Unequal worker sizes (``sizes: unequal``): worker i holds about 2 m (i + 1) / (n + 1) samples
(mean m); rows past a worker's count are padding (zeros, ``mask`` False).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.models import DTYPE


@dataclass
class ExpFamData:
    """Workers' samples, padded: ``x`` (n, m_max, d) (NaN: missing), ``counts`` (n,)."""

    name: str
    x: torch.Tensor
    counts: np.ndarray
    labels: torch.Tensor | None = None  #: the mixture component of each sample, if known
    truth: torch.Tensor | None = None  #: complete values (lowrank), shaped like x
    meta: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    @property
    def dim(self) -> int:
        return int(self.x.shape[-1])

    @property
    def mask(self) -> torch.Tensor:
        """(n, m_max) True on real samples."""
        m = torch.arange(self.x.shape[1])
        return m[None, :] < torch.as_tensor(self.counts)[:, None]

    @property
    def weights(self) -> np.ndarray:
        """N_i / N: how the workers' statistics are averaged."""
        return self.counts / self.counts.sum()


def worker_sizes(n: int, m: int, sizes: str) -> np.ndarray:
    """Samples per worker: ``equal`` (m each) or ``unequal`` (about 2 m (i+1)/(n+1), >= 1)."""
    if sizes == "equal":
        return np.full(n, m, dtype=np.int64)
    if sizes == "unequal":
        return np.maximum(1, np.round(2 * m * np.arange(1, n + 1) / (n + 1))).astype(np.int64)
    raise GossipError(f"config key 'expfam.sizes' must be equal|unequal, got {sizes!r}")


def _pad(rows: list[np.ndarray], fill: float = 0.0) -> torch.Tensor:
    m_max = max(len(r) for r in rows)
    out = np.full((len(rows), m_max, *rows[0].shape[1:]), fill, dtype=np.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.as_tensor(out, dtype=DTYPE)


#: gmm2d's worker splits: how each worker's P(component 0) is set
SPLITS = ("iid", "mixed", "sorted")


def component_shares(n: int, split: str, rng: np.random.Generator) -> np.ndarray:
    """Each worker's probability of drawing component 0 under ``split`` (see the module)."""
    share = rng.uniform(0.1, 0.9, size=n)  # drawn for every split: the samples' draws line up
    if split == "mixed":
        return share
    if split == "iid":
        return np.full(n, 0.5)
    if split == "sorted":
        return (np.arange(n) < n // 2).astype(np.float64)
    raise GossipError(f"config key 'expfam.split' must be {'|'.join(SPLITS)}, got {split!r}")


def gmm2d(
    n: int = 100, m: int = 100, seed: int = 0, sizes: str = "equal", split: str = "mixed"
) -> ExpFamData:
    """The synthetic 2-D mixture: N = n m samples (10^4 in the paper), split over the workers
    as ``split`` says."""
    rng = np.random.default_rng([seed, 1001])
    mu = np.array([[-1.0, -1.0], [1.5, 1.0]])
    cov = np.array([[1.0, 0.3], [0.3, 0.7]])
    chol = np.linalg.cholesky(cov)
    share = component_shares(n, split, rng)  # heterogeneity: each worker's P(component 0)
    xs, zs = [], []
    for i, mi in enumerate(worker_sizes(n, m, sizes)):
        z = (rng.random(mi) >= share[i]).astype(np.int64)
        xs.append(mu[z] + rng.standard_normal((mi, 2)) @ chol.T)
        zs.append(z)
    counts = np.array([len(z) for z in zs])
    weights = np.array([np.mean(share * counts) / counts.mean(), 0.0])
    weights[1] = 1 - weights[0]
    meta = {"weights": weights.tolist(), "means": mu.tolist(), "cov": cov.tolist(),
            "split": split, "shares": share.tolist()}  # fmt: skip
    return ExpFamData("gmm2d", _pad(xs), counts, _pad([z[:, None] for z in zs])[..., 0], meta=meta)


def fashion_mnist(
    n: int = 100, m: int = 0, seed: int = 0, sizes: str = "equal", dim: int = 20, root=None
) -> ExpFamData:
    """Fashion-MNIST train + test, constant pixels dropped, PCA to ``dim``, split over n
    workers (m per worker; 0: all 70,000 images shared out)."""
    from gossip_pfl.data.images import load_fashion_mnist

    data = load_fashion_mnist(root)
    x = np.concatenate([data.x_train, data.x_test]).reshape(-1, 28 * 28).astype(np.float64)
    y = np.concatenate([data.y_train, data.y_test])
    keep = x.std(0) > 0  # pixels that are the same in every image carry nothing
    x = x[:, keep]
    x -= x.mean(0)
    # right singular vectors of the centred data = the covariance's eigenvectors
    _, _, vt = np.linalg.svd(x.T @ x / len(x), hermitian=True)
    z = x @ vt[:dim].T
    m = m or len(z) // n
    counts = worker_sizes(n, m, sizes)
    if counts.sum() > len(z):
        raise GossipError(
            f"config key 'expfam.samples': {n} workers x {m} samples need {counts.sum()} "
            f"images, Fashion-MNIST has {len(z)}"
        )
    order = np.random.default_rng([seed, 1002]).permutation(len(z))
    starts = np.concatenate([[0], np.cumsum(counts)])
    parts = [order[a:b] for a, b in zip(starts, starts[1:])]
    meta = {"dropped_pixels": int((~keep).sum()), "pca_dim": dim}
    return ExpFamData(
        "fashion_mnist",
        _pad([z[p] for p in parts]),
        counts,
        _pad([y[p].astype(np.float64)[:, None] for p in parts])[..., 0],
        meta=meta,
    )


def lowrank(
    n: int = 10,
    m: int = 200,
    seed: int = 0,
    sizes: str = "equal",
    dim: int = 10,
    rank: int = 2,
    missing: float = 0.2,
    noise: float = 0.3,
) -> ExpFamData:
    """Low-rank Gaussian data with a fraction ``missing`` of the entries set to NaN."""
    if not 1 <= rank < dim:
        raise GossipError(f"config key 'expfam.rank' must be in 1..{dim - 1} (dim), got {rank}")
    rng = np.random.default_rng([seed, 1003])
    W = rng.standard_normal((dim, rank))
    mu = rng.standard_normal(dim)
    full, seen = [], []
    for mi in worker_sizes(n, m, sizes):
        y = mu + rng.standard_normal((mi, rank)) @ W.T + noise * rng.standard_normal((mi, dim))
        hide = rng.random((mi, dim)) < missing
        full.append(y)
        seen.append(np.where(hide, np.nan, y))
    meta = {"mu": mu.tolist(), "W": W.tolist(), "noise": noise, "missing": missing}
    data = ExpFamData("lowrank", _pad(seen), np.array([len(y) for y in full]), None,
                      _pad(full), meta)  # fmt: skip
    check_rows(data, "expfam.missing")
    return data


def check_rows(data: ExpFamData, key: str) -> None:
    """A sample with every entry missing carries nothing: a one-line error naming ``key``."""
    empty = torch.isnan(data.x).all(-1) & data.mask
    if empty.any():
        i, j = (int(v) for v in empty.nonzero()[0])
        raise GossipError(
            f"config key '{key}': worker {i} sample {j} has every entry missing (NaN); "
            f"{int(empty.sum())} such rows"
        )


def build_data(e, seed: int) -> ExpFamData:
    """The data set named by the config's ``expfam`` section."""
    if e.data == "gmm2d":
        return gmm2d(e.clients, e.samples, seed, e.sizes, e.split)
    if e.data == "fashion_mnist":
        return fashion_mnist(e.clients, e.samples, seed, e.sizes, e.pca)
    if e.data == "lowrank":
        return lowrank(e.clients, e.samples, seed, e.sizes, e.dim, e.rank, e.missing)
    raise GossipError(
        f"config key 'expfam.data' must be gmm2d|fashion_mnist|lowrank, got {e.data!r}"
    )

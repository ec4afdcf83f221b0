"""Exponential-family latent-variable models in sufficient-statistic space (seed 001, App. F.1).

Every model works on flat statistics vectors of length ``q`` with any leading axes (the client
axis first), so that compressors and the hub's memories handle plain tensors:

- ``sbar(theta, x)``: per-sample conditional expectations E[s(y, Z) | y; theta]; ``x`` is
  ``(n, m, d)`` (n clients, m samples each), the result ``(n, m, q)``. ``theta`` is one parameter
  set (broadcast to every client) or one per client (leading axis n).
- ``T(s)``: the M-step map, statistics ``(..., q)`` to parameters with the same leading axes.
- ``project(s)``: ``(s', fixed)``, s' in T's domain and ``fixed`` the number of entries changed.
  Compression noise can push s out of the domain; the result is finite even for NaN input.
- ``loglik(theta, x)``: the per-client mean log-likelihood ``(n,)``.

Closed forms need float64; the models cast their inputs to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gossip_pfl.errors import GossipError

DTYPE = torch.float64


@dataclass(frozen=True)
class GMMParams:
    """Mixture parameters, optionally with leading (client) axes.

    ``weights`` ``(..., G)``; ``means`` ``(..., G, d)``; ``cov``: the shared covariance
    ``(..., d, d)`` or, for the diagonal model, the per-component variances ``(..., G, d)``.
    """

    weights: torch.Tensor
    means: torch.Tensor
    cov: torch.Tensor


def _check_sizes(G: int, d: int) -> None:
    if int(G) < 1:
        raise GossipError(f"components: G must be >= 1, got {G}")
    if int(d) < 1:
        raise GossipError(f"dim: d must be >= 1, got {d}")


def _check_x(x: torch.Tensor, d: int) -> torch.Tensor:
    x = torch.as_tensor(x, dtype=DTYPE)
    if x.dim() != 3 or x.shape[-1] != d:
        raise GossipError(f"data: expected shape (clients, samples, {d}), got {tuple(x.shape)}")
    return x


def _lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """The inverse of lower-triangular ``L`` (..., d, d), by forward substitution in d row
    steps (out of place, so autograd can differentiate it). Not LAPACK's batched solves: they
    are one small call per matrix (one per sample and client in the E-step's (n, m, d, G)
    solve), and with two threads MKL woke the other for each: an evaluation of 70,000
    Fashion-MNIST images took about 3.4 s against 0.1 s."""
    d = L.shape[-1]
    eye = torch.eye(d, dtype=L.dtype, device=L.device).expand(L.shape)
    rows = []
    for i in range(d):  # row i of L^-1: (e_i - L[i, :i] X[:i]) / L[i, i]
        row = eye[..., i, :]
        if i:
            row = row - (L[..., i : i + 1, :i] @ torch.stack(rows, -2)).squeeze(-2)
        rows.append(row / L[..., i, i, None])
    return torch.stack(rows, -2)


def _per_client(t: torch.Tensor, n: int, event_dims: int) -> torch.Tensor:
    """Give a parameter tensor a leading client axis of size n (broadcast if absent)."""
    t = t.to(DTYPE)
    if t.dim() == event_dims:
        t = t.unsqueeze(0)
    return t.expand(n, *t.shape[1:])


def _clean(s: torch.Tensor) -> tuple[torch.Tensor, int]:
    """float64 copy with non-finite entries set to 0, and how many there were."""
    s = torch.as_tensor(s, dtype=DTYPE).clone()
    bad = ~torch.isfinite(s)
    s[bad] = 0.0
    return s, int(bad.sum())


class GaussianMixtureShared:
    """Mixture of G Gaussians in R^d with one shared covariance (App. F.1).

    s(y, z) = (1{z=l}, y 1{z=l})_{l=1..G}, flattened as ``[G weights | G*d means]``, q = G(1+d).
    The M-step needs the global second moment ``M2 = (1/N) sum y y^T`` (collected once; only the
    hub computes T): Sigma = M2 - sum_l s1_l mu_l mu_l^T.
    """

    def __init__(
        self,
        G: int,
        d: int,
        second_moment: torch.Tensor,
        min_weight: float = 1e-8,
        min_cov_ratio: float = 1e-8,
    ):
        _check_sizes(G, d)
        self.G, self.d = int(G), int(d)
        self.q = self.G * (1 + self.d)
        M2 = torch.as_tensor(second_moment, dtype=DTYPE)
        if M2.shape != (self.d, self.d):
            raise GossipError(f"second_moment: expected shape ({d}, {d}), got {tuple(M2.shape)}")
        try:
            self._L2 = torch.linalg.cholesky(M2)
        except RuntimeError as e:  # singular data
            raise GossipError("second_moment: (1/N) sum y y^T is not positive definite") from e
        self.M2 = M2
        self.min_weight = float(min_weight)
        self.min_cov_ratio = float(min_cov_ratio)

    @classmethod
    def from_data(cls, x: torch.Tensor, G: int, **kw) -> GaussianMixtureShared:
        """Model whose M2 is the mean of y y^T over all clients' samples ``x`` (n, m, d)."""
        x = torch.as_tensor(x, dtype=DTYPE)
        y = x.reshape(-1, x.shape[-1])
        return cls(G, x.shape[-1], y.T @ y / y.shape[0], **kw)

    # -- layout ---------------------------------------------------------------------------
    def split(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s1 (..., G), s2 (..., G, d))`` views of flat statistics."""
        return s[..., : self.G], s[..., self.G :].unflatten(-1, (self.G, self.d))

    def join(self, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
        return torch.cat([s1, s2.flatten(-2)], dim=-1)

    # -- interface ------------------------------------------------------------------------
    def complete_stats(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """s(y, z) per sample for labelled data: x (n, m, d), z (n, m) in [0, G) -> (n, m, q)."""
        x = _check_x(x, self.d)
        onehot = torch.nn.functional.one_hot(torch.as_tensor(z).long(), self.G).to(DTYPE)
        return self.join(onehot, onehot.unsqueeze(-1) * x.unsqueeze(-2))

    def log_joint(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        """log pi_l + log N(y; mu_l, Sigma), shape (n, m, G)."""
        x = _check_x(x, self.d)
        n = x.shape[0]
        w = _per_client(theta.weights, n, 1)
        mu = _per_client(theta.means, n, 2)
        # a shared Sigma (no client axis) is factored once, not once per client
        L = torch.linalg.cholesky(theta.cov.to(DTYPE))  # (d, d) or (n, d, d)
        diff = x.unsqueeze(2) - mu.unsqueeze(1)  # (n, m, G, d)
        Li = _per_client(_lower_inverse(L), n, 2)
        z = diff.flatten(1, 2) @ Li.mT  # L^-1 (y - mu_l), (n, m G, d)
        maha = (z**2).sum(-1).view(diff.shape[:3])  # (n, m, G)
        logdet = _per_client(2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1), n, 0)
        lognorm = -0.5 * (self.d * math.log(2 * math.pi) + logdet)
        return torch.log(w).unsqueeze(1) + lognorm[:, None, None] - 0.5 * maha

    def responsibilities(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.log_joint(theta, x), dim=-1)

    def sbar(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        x = _check_x(x, self.d)
        r = self.responsibilities(theta, x)
        return self.join(r, r.unsqueeze(-1) * x.unsqueeze(-2))

    def loglik(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(self.log_joint(theta, x), dim=-1).mean(-1)

    def T(self, s: torch.Tensor) -> GMMParams:
        s = torch.as_tensor(s, dtype=DTYPE)
        s1, s2 = self.split(s)
        weights = s1 / s1.sum(-1, keepdim=True)
        means = s2 / s1.unsqueeze(-1)
        cov = self.M2 - torch.einsum("...g,...gi,...gj->...ij", s1, means, means)
        return GMMParams(weights, means, 0.5 * (cov + cov.transpose(-1, -2)))

    def project(self, s: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Clamp weights to >= min_weight, then shrink the means towards 0 where Sigma would
        not be positive definite: s2 *= c with M2 - c^2 B >= min_cov_ratio * M2,
        B = sum_l s2_l s2_l^T / s1_l. Returns the statistics and the number of entries changed.
        """
        s, fixed = _clean(s)
        s1, s2 = self.split(s)
        low = s1 < self.min_weight
        fixed += int(low.sum())
        s1 = torch.where(low, torch.full_like(s1, self.min_weight), s1)
        B = torch.einsum("...gi,...gj->...ij", s2, s2 / s1.unsqueeze(-1))
        Li = torch.linalg.solve_triangular(self._L2, torch.eye(self.d, dtype=DTYPE), upper=False)
        lam = torch.linalg.eigvalsh(Li @ B @ Li.T)[..., -1]  # largest, (...)
        limit = 1.0 - self.min_cov_ratio
        shrink = lam > limit
        c = torch.where(shrink, torch.sqrt(limit / lam.clamp_min(1e-300)), torch.ones_like(lam))
        fixed += int(shrink.sum()) * self.G * self.d
        s2 = s2 * c[..., None, None]
        return self.join(s1, s2), fixed


class GaussianMixtureDiagonal:
    """Mixture of G Gaussians in R^d, each with its own diagonal covariance.

    s(y, z) = (1{z=l}, y 1{z=l}, y^2 1{z=l})_{l}, flattened as ``[G | G*d | G*d]``,
    q = G(1+2d). T: pi = s0/sum s0, mu = s1/s0, var = s2/s0 - mu^2.
    """

    def __init__(self, G: int, d: int, min_weight: float = 1e-8, min_var: float = 1e-6):
        _check_sizes(G, d)
        self.G, self.d = int(G), int(d)
        self.q = self.G * (1 + 2 * self.d)
        self.min_weight = float(min_weight)
        self.min_var = float(min_var)

    @classmethod
    def from_data(cls, x: torch.Tensor, G: int, **kw) -> GaussianMixtureDiagonal:
        """Same signature as :meth:`GaussianMixtureShared.from_data` (needs only d)."""
        return cls(G, torch.as_tensor(x).shape[-1], **kw)

    def split(self, s: torch.Tensor):
        G, d = self.G, self.d
        return (
            s[..., :G],
            s[..., G : G + G * d].unflatten(-1, (G, d)),
            s[..., G + G * d :].unflatten(-1, (G, d)),
        )

    def join(self, s0, s1, s2) -> torch.Tensor:
        return torch.cat([s0, s1.flatten(-2), s2.flatten(-2)], dim=-1)

    def complete_stats(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = _check_x(x, self.d)
        oh = torch.nn.functional.one_hot(torch.as_tensor(z).long(), self.G).to(DTYPE)
        xe = x.unsqueeze(-2)
        return self.join(oh, oh.unsqueeze(-1) * xe, oh.unsqueeze(-1) * xe**2)

    def log_joint(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        x = _check_x(x, self.d)
        n = x.shape[0]
        w = _per_client(theta.weights, n, 1)
        mu = _per_client(theta.means, n, 2)
        var = _per_client(theta.cov, n, 2)
        diff = x.unsqueeze(2) - mu.unsqueeze(1)  # (n, m, G, d)
        maha = (diff**2 / var.unsqueeze(1)).sum(-1)
        lognorm = -0.5 * (self.d * math.log(2 * math.pi) + torch.log(var).sum(-1))  # (n, G)
        return torch.log(w).unsqueeze(1) + lognorm.unsqueeze(1) - 0.5 * maha

    def responsibilities(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.log_joint(theta, x), dim=-1)

    def sbar(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        x = _check_x(x, self.d)
        r = self.responsibilities(theta, x).unsqueeze(-1)
        xe = x.unsqueeze(-2)
        return self.join(r.squeeze(-1), r * xe, r * xe**2)

    def loglik(self, theta: GMMParams, x: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(self.log_joint(theta, x), dim=-1).mean(-1)

    def T(self, s: torch.Tensor) -> GMMParams:
        s = torch.as_tensor(s, dtype=DTYPE)
        s0, s1, s2 = self.split(s)
        weights = s0 / s0.sum(-1, keepdim=True)
        means = s1 / s0.unsqueeze(-1)
        var = s2 / s0.unsqueeze(-1) - means**2
        return GMMParams(weights, means, var)

    def project(self, s: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Clamp weights to >= min_weight and raise s2 where the variance would fall below
        max(min_var, 1e-8 mu^2)."""
        s, fixed = _clean(s)
        s0, s1, s2 = self.split(s)
        low = s0 < self.min_weight
        fixed += int(low.sum())
        s0 = torch.where(low, torch.full_like(s0, self.min_weight), s0)
        mu2 = (s1 / s0.unsqueeze(-1)) ** 2
        # relative floor too: s2/s0 - mu^2 loses min_var to rounding when mu^2 >> min_var
        var_floor = torch.clamp(1e-8 * mu2, min=self.min_var)
        bad = s2 / s0.unsqueeze(-1) - mu2 < var_floor
        fixed += int(bad.sum())
        s2 = torch.where(bad, s0.unsqueeze(-1) * (mu2 + var_floor), s2)
        return self.join(s0, s1, s2), fixed


def initial_params(x: torch.Tensor, G: int, diagonal: bool, generator=None) -> GMMParams:
    """The paper's MNIST initialisation: pi = 1/G, means drawn from the examples (without
    replacement), the empirical covariance (shared) or per-coordinate variances (diagonal)."""
    x = torch.as_tensor(x, dtype=DTYPE)
    y = x.reshape(-1, x.shape[-1])
    if G > y.shape[0]:
        raise GossipError(
            f"config key 'expfam.components': G = {G} exceeds the {y.shape[0]} examples"
        )
    pick = torch.randperm(y.shape[0], generator=generator)[:G]
    yc = y - y.mean(0)
    if diagonal:
        cov = (yc**2).mean(0).expand(G, -1).clone()
    else:
        cov = yc.T @ yc / y.shape[0]
    return GMMParams(torch.full((G,), 1.0 / G, dtype=DTYPE), y[pick].clone(), cov)


def sample_batch(n: int, m: int, batch: int | None, generator=None) -> torch.Tensor | None:
    """Per-client minibatch indices ``(n, batch)`` drawn without replacement; None for the full
    batch (``batch`` None or >= m)."""
    if batch is None or batch >= m:
        return None
    if batch < 1:
        raise GossipError(f"batch: must be >= 1, got {batch}")
    return torch.rand(n, m, generator=generator, dtype=DTYPE).argsort(dim=1)[:, :batch]


def client_means(model, theta, x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """sbar_i(theta): mean over each client's samples, or over the samples ``idx`` (n, b)
    (from :func:`sample_batch`). Returns ``(n, q)``."""
    x = torch.as_tensor(x, dtype=DTYPE)
    if idx is not None:
        x = torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return model.sbar(theta, x).mean(1)


def mean_field(model, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h(s) = sbar(T(s)) - s over all clients' full data (equal client sizes)."""
    return client_means(model, model.T(s), x).mean(0) - s

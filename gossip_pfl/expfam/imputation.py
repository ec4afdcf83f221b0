"""Low-rank Gaussian model for missing-value imputation (seed 001's eBird experiment), in
sufficient-statistic space.

y = mu + W z + sigma eps, z ~ N(0, I_r), eps ~ N(0, I_d); entries of y marked NaN are missing.
The latent variables are z and the missing entries. With z~ = (1, z) and A = [mu, W] (d, r+1),
the complete-data statistics are

    s = ( z~ z~^T  (r+1)^2 | y z~^T  d (r+1) | ||y||^2  1 ),   q = (r+1)^2 + d (r+1) + 1,

T(s): A = s_yz s_zz^{-1}, sigma^2 = (s_yy - tr(A s_yz^T)) / d. The E-step conditions on the
observed entries o of each sample: z | y_o ~ N(C^{-1} W_o^T (y_o - mu_o) / sigma^2, C^{-1}) with
C = I + W_o^T W_o / sigma^2; a missing entry j has E[y_j z~^T] = A_j E[z~ z~^T] and
E[y_j^2] = A_j E[z~ z~^T] A_j^T + sigma^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.models import DTYPE, _clean, _per_client


@dataclass(frozen=True)
class LowRankParams:
    """``mu`` (..., d), ``W`` (..., d, r), ``var`` (...) (sigma^2)."""

    mu: torch.Tensor
    W: torch.Tensor
    var: torch.Tensor


class LowRankGaussian:
    """The imputation model of rank ``r`` in R^d (r < d)."""

    def __init__(self, d: int, r: int, min_var: float = 1e-6, min_eig: float = 1e-8):
        if int(d) < 2:
            raise GossipError(
                f"config key 'expfam.dim': the imputation model needs d >= 2, got {d}"
            )
        if not 1 <= int(r) < int(d):
            raise GossipError(
                f"config key 'expfam.rank' must be in 1..{int(d) - 1} (below the dimension "
                f"{d}), got {r}"
            )
        self.d, self.r = int(d), int(r)
        self.k = self.r + 1
        self.q = self.k * self.k + self.d * self.k + 1
        self.min_var, self.min_eig = float(min_var), float(min_eig)

    def split(self, s: torch.Tensor):
        k, d = self.k, self.d
        zz = s[..., : k * k].unflatten(-1, (k, k))
        yz = s[..., k * k : k * k + d * k].unflatten(-1, (d, k))
        return zz, yz, s[..., -1]

    def join(self, zz, yz, yy) -> torch.Tensor:
        return torch.cat([zz.flatten(-2), yz.flatten(-2), yy.unsqueeze(-1)], dim=-1)

    # -- E-step ----------------------------------------------------------------------------
    def _posterior(self, theta: LowRankParams, x: torch.Tensor):
        """Per sample: observed mask, zero-filled y, A, E[z~], E[z~ z~^T], and the pieces of
        the marginal likelihood."""
        x = torch.as_tensor(x, dtype=DTYPE)
        if x.dim() != 3 or x.shape[-1] != self.d:
            raise GossipError(f"data: expected shape (clients, samples, {self.d}), got "
                              f"{tuple(x.shape)}")  # fmt: skip
        n = x.shape[0]
        mu = _per_client(theta.mu, n, 1)  # (n, d)
        W = _per_client(theta.W, n, 2)  # (n, d, r)
        var = torch.as_tensor(theta.var, dtype=DTYPE)
        var = (var.unsqueeze(0) if var.dim() == 0 else var).expand(n)  # (n,)
        o = ~torch.isnan(x)
        y0 = torch.where(o, x, torch.zeros_like(x))
        Wo = W.unsqueeze(1) * o.unsqueeze(-1)  # (n, m, d, r)
        v = var[:, None, None]
        C = torch.einsum("nmdr,nmds->nmrs", Wo, Wo) / v[..., None] + torch.eye(self.r, dtype=DTYPE)
        resid = (y0 - mu.unsqueeze(1)) * o  # (n, m, d)
        b = torch.einsum("nmdr,nmd->nmr", Wo, resid) / v  # (n, m, r)
        L = torch.linalg.cholesky(C)
        mz = torch.cholesky_solve(b.unsqueeze(-1), L).squeeze(-1)  # (n, m, r)
        Sz = torch.cholesky_inverse(L)  # (n, m, r, r)
        ones = torch.ones_like(mz[..., :1])
        zt = torch.cat([ones, mz], -1)  # E[z~] (n, m, k)
        Ezz = zt.unsqueeze(-1) * zt.unsqueeze(-2)
        Ezz[..., 1:, 1:] += Sz
        A = torch.cat([mu.unsqueeze(-1), W], -1)  # (n, d, k)
        return o, y0, A, var, zt, Ezz, (L, b, resid)

    def sbar(self, theta: LowRankParams, x: torch.Tensor) -> torch.Tensor:
        """Per-sample E[s | y_o] (n, m, q)."""
        o, y0, A, var, zt, Ezz, _ = self._posterior(theta, x)
        AE = torch.einsum("ndk,nmkl->nmdl", A, Ezz)  # missing rows: A_j E[z~ z~^T]
        yz = torch.where(o.unsqueeze(-1), y0.unsqueeze(-1) * zt.unsqueeze(-2), AE)
        y2_missing = torch.einsum("nmdl,ndl->nmd", AE, A) + var[:, None, None]
        yy = torch.where(o, y0 * y0, y2_missing).sum(-1)
        return self.join(Ezz, yz, yy)

    def sample_loglik(self, theta: LowRankParams, x: torch.Tensor) -> torch.Tensor:
        """log N(y_o; mu_o, W_o W_o^T + sigma^2 I) per sample (n, m), by Woodbury."""
        o, _, _, var, _, _, (L, b, resid) = self._posterior(theta, x)
        d_o = o.sum(-1).to(DTYPE)
        v = var[:, None]
        logdet = d_o * torch.log(v) + 2 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
        bc = torch.cholesky_solve(b.unsqueeze(-1), L).squeeze(-1)
        quad = (resid * resid).sum(-1) / v - (b * bc).sum(-1)
        return -0.5 * (d_o * math.log(2 * math.pi) + logdet + quad)

    def loglik(self, theta: LowRankParams, x: torch.Tensor) -> torch.Tensor:
        return self.sample_loglik(theta, x).mean(-1)

    def impute(self, theta: LowRankParams, x: torch.Tensor) -> torch.Tensor:
        """x with each missing entry replaced by E[y_j | y_o] = mu_j + W_j E[z | y_o]."""
        o, y0, A, _, zt, _, _ = self._posterior(theta, x)
        pred = torch.einsum("ndk,nmk->nmd", A, zt)
        return torch.where(o, y0, pred)

    # -- M-step ----------------------------------------------------------------------------
    def T(self, s: torch.Tensor) -> LowRankParams:
        s = torch.as_tensor(s, dtype=DTYPE)
        zz, yz, yy = self.split(s)
        A = torch.linalg.solve(zz, yz.transpose(-1, -2)).transpose(-1, -2)  # (.., d, k)
        var = (yy - (A * yz).sum((-1, -2))) / self.d
        return LowRankParams(A[..., 0], A[..., 1:], var)

    def project(self, s: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Symmetrise s_zz and lift its eigenvalues to >= min_eig; then raise s_yy where
        sigma^2 would fall below min_var. Returns the statistics and the entries changed."""
        s, fixed = _clean(s)
        zz, yz, yy = self.split(s)
        zz = 0.5 * (zz + zz.transpose(-1, -2))
        lam, U = torch.linalg.eigh(zz)
        low = lam < self.min_eig
        if low.any():
            fixed += int(low.sum())
            zz = U @ torch.diag_embed(lam.clamp_min(self.min_eig)) @ U.transpose(-1, -2)
        A = torch.linalg.solve(zz, yz.transpose(-1, -2)).transpose(-1, -2)
        explained = (A * yz).sum((-1, -2))
        # + a margin for the cancellation in sigma^2 = (s_yy - explained) / d, where explained
        # can be 1e8 (far off statistics): without it sigma^2 came out below min_var
        floor = explained + self.d * self.min_var + 1e-12 * explained.abs()
        bad = yy < floor
        fixed += int(bad.sum())
        return self.join(zz, yz, torch.where(bad, floor, yy)), fixed


def initial_lowrank(x: torch.Tensor, r: int) -> LowRankParams:
    """mu = the observed means, W = the r leading principal directions of the mean-filled data
    (scaled by their standard deviations), sigma^2 = the mean leftover variance."""
    x = torch.as_tensor(x, dtype=DTYPE)
    y = x.reshape(-1, x.shape[-1])
    y = y[~torch.isnan(y).all(-1)]
    mu = torch.nanmean(y, 0)
    unseen = torch.isnan(mu).nonzero()[:, 0].tolist()
    if unseen:  # (its mean, and every statistic after it, would be NaN)
        more = f" (and {len(unseen) - 1} more)" if len(unseen) > 1 else ""
        raise GossipError(
            f"feature {unseen[0]}{more} is missing in every sample: give the clients more "
            "samples (expfam.samples) or lower expfam.missing"
        )
    yc = torch.where(torch.isnan(y), torch.zeros_like(y), y - mu)
    lam, U = torch.linalg.eigh(yc.T @ yc / len(yc))
    lam, U = lam.flip(0), U.flip(1)
    var = lam[r:].mean().clamp_min(1e-3)
    W = U[:, :r] * (lam[:r] - var).clamp_min(1e-3).sqrt()
    return LowRankParams(mu, W, var)

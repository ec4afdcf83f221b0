"""Unbiased compressors for statistics vectors (seed 001, assumption A6 and Appendix B).

Each compressor maps ``x`` ``(..., q)`` to a tensor of the same shape, compressing every vector
along the last axis independently, with E[C(x)] = x and E||C(x) - x||^2 <= omega ||x||^2.
``omega(q)`` is that bound for vectors of length q and ``bits(q)`` what one vector costs on the
wire (a fixed-length code; floats count ``float_bits``). Randomness comes only from the
``generator`` argument, or from ``u`` (uniforms shaped like ``x``) where the caller draws them
itself (the federated runs draw them per (seed, client, round)), so seeded runs repeat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gossip_pfl.errors import GossipError


def _norm(x: torch.Tensor, r: float, keepdim: bool = True) -> torch.Tensor:
    """||x||_r over the last dimension. torch sums |x_i|^r, which underflows to 0 (or
    overflows) for a large r: r = 1e4 made every message 0. Such vectors are computed again
    as m ||x / m||_r, m = max |x_i|; the others keep torch's rounding."""
    out = torch.linalg.vector_norm(x, ord=r, dim=-1, keepdim=True)
    m = x.abs().amax(dim=-1, keepdim=True)
    bad = ((out == 0) & (m > 0)) | ~torch.isfinite(out)
    if bad.any():
        scaled = torch.linalg.vector_norm(x / m.clamp_min(torch.finfo(x.dtype).tiny), ord=r,
                                          dim=-1, keepdim=True)  # fmt: skip
        out = torch.where(bad, m * scaled, out)
    return out if keepdim else out.squeeze(-1)


def _ratio_to_l2(q: int, r: float) -> float:
    """max ||x||_r / ||x||_2 over R^q: 1 for r >= 2, q^(1/r - 1/2) for 1 <= r < 2."""
    return 1.0 if r >= 2 else float(q) ** (1.0 / r - 0.5)


@dataclass(frozen=True)
class Identity:
    """No compression: omega = 0, q floats."""

    float_bits: int = 64

    def __call__(
        self, x: torch.Tensor, generator: torch.Generator | None = None, u=None
    ) -> torch.Tensor:
        return x.clone()

    def omega(self, q: int) -> float:
        return 0.0

    def bits(self, q: int) -> int:
        return self.float_bits * q


@dataclass(frozen=True)
class RandomDithering:
    """QSGD-style random dithering with ``levels`` s and norm ``r`` (Alistarh et al. 2017):
    C(x) = (||x||_r / s) sign(x) floor(s |x| / ||x||_r + U), U ~ Uniform[0, 1]^q.

    Per coordinate the error variance is (||x||_r/s)^2 f(1-f), f the fractional part of
    s|x_j|/||x||_r, which gives E||C(x)-x||^2 <= ||x||_r^2 min(q/(4 s^2), ||x||_1/(s ||x||_r)),
    hence omega = min(q c^2 / (4 s^2), sqrt(q) c / s) with c = max ||x||_r/||x||_2.
    Bits: one float for the norm and, per coordinate, a sign bit and ceil(log2(s+1)) for the level.
    """

    levels: int = 1
    norm: float = 2.0
    float_bits: int = 64

    def __post_init__(self):
        if int(self.levels) != self.levels or self.levels < 1:
            raise GossipError(
                f"levels: the number of levels s must be an integer >= 1, got {self.levels}"
            )
        if not self.norm >= 1:
            raise GossipError(f"norm: r must be >= 1 (or inf), got {self.norm}")

    def __call__(
        self, x: torch.Tensor, generator: torch.Generator | None = None, u=None
    ) -> torch.Tensor:
        s = float(self.levels)
        nrm = _norm(x, self.norm)
        safe = torch.where(nrm > 0, nrm, torch.ones_like(nrm))
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype) if u is None else u
        level = torch.floor(s * x.abs() / safe + u)
        out = (safe / s) * torch.sign(x) * level
        return torch.where(nrm > 0, out, torch.zeros_like(x))

    def omega(self, q: int) -> float:
        s, c = float(self.levels), _ratio_to_l2(q, self.norm)
        return min(q * c * c / (4 * s * s), math.sqrt(q) * c / s)

    def bits(self, q: int) -> int:
        return self.float_bits + q * (1 + math.ceil(math.log2(self.levels + 1)))


@dataclass(frozen=True)
class BlockQuantization:
    """Block-p quantization (seed 001, App. B): split x into blocks x_(l); each block is sent as
    ||x_(l)||_p sign(x_(l)) * Bernoulli(|x_(l)j| / ||x_(l)||_p). Zero blocks are sent as zeros.

    ``blocks`` is a block length (the last block may be shorter) or a tuple of lengths that sum
    to q. E||C(x)-x||^2 = sum_l (||x_l||_1 ||x_l||_p - ||x_l||_2^2) (:meth:`variance`), so
    omega = max_l (sqrt(q_l) c_l - 1), c_l = max ||x||_p/||x||_2 on R^{q_l}; for p = 2,
    max_l (sqrt(q_l) - 1) as in the paper. Bits: one float per block, 2 bits per coordinate.
    """

    blocks: int | tuple[int, ...] = 8
    p: float = 2.0
    float_bits: int = 64

    def __post_init__(self):
        if not self.p >= 1:
            raise GossipError(f"p: the block norm must be >= 1 (or inf), got {self.p}")
        sizes = (self.blocks,) if isinstance(self.blocks, int) else tuple(self.blocks)
        if not sizes or any(int(b) != b or b < 1 for b in sizes):
            raise GossipError(f"blocks: block lengths must be integers >= 1, got {self.blocks}")

    def sizes(self, q: int) -> list[int]:
        if isinstance(self.blocks, int):
            b = self.blocks
            return [b] * (q // b) + ([q % b] if q % b else [])
        if sum(self.blocks) != q:
            raise GossipError(f"blocks: lengths {self.blocks} do not sum to q = {q}")
        return list(self.blocks)

    def __call__(
        self, x: torch.Tensor, generator: torch.Generator | None = None, u=None
    ) -> torch.Tensor:
        sizes = self.sizes(x.shape[-1])
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype) if u is None else u
        parts = []
        for blk, ub in zip(torch.split(x, sizes, dim=-1), torch.split(u, sizes, dim=-1)):
            nrm = _norm(blk, self.p)
            safe = torch.where(nrm > 0, nrm, torch.ones_like(nrm))
            prob = (blk.abs() / safe).clamp(max=1.0)
            keep = ub < prob
            parts.append(torch.where(keep, nrm * torch.sign(blk), torch.zeros_like(blk)))
        return torch.cat(parts, dim=-1)

    def variance(self, x: torch.Tensor) -> torch.Tensor:
        """Exact E||C(x) - x||^2 for each vector of ``x``."""
        out = torch.zeros(x.shape[:-1], dtype=x.dtype)
        for blk in torch.split(x, self.sizes(x.shape[-1]), dim=-1):
            l1 = torch.linalg.vector_norm(blk, 1, dim=-1)
            lp = _norm(blk, self.p, keepdim=False)
            out = out + l1 * lp - (blk**2).sum(-1)
        return out

    def omega(self, q: int) -> float:
        return max(math.sqrt(b) * _ratio_to_l2(b, self.p) - 1.0 for b in self.sizes(q))

    def bits(self, q: int) -> int:
        return self.float_bits * len(self.sizes(q)) + 2 * q


def build_compressor(name: str, **opts):
    """``identity``, ``dithering`` (levels, norm) or ``block`` (blocks, p)."""
    table = {"identity": Identity, "dithering": RandomDithering, "block": BlockQuantization}
    if name not in table:
        raise GossipError(f"compressor: unknown {name!r}; choose one of {', '.join(table)}")
    return table[name](**opts)

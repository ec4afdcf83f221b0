"""Compressors for statistics: unbiasedness, variance bound (omega), bits, zero vectors."""

from __future__ import annotations

import math

import pytest
import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.compress import (
    BlockQuantization,
    Identity,
    RandomDithering,
    build_compressor,
)

DRAWS = 40_000
COMPRESSORS = [
    Identity(),
    RandomDithering(levels=1, norm=2),
    RandomDithering(levels=4, norm=2),
    RandomDithering(levels=2, norm=1),
    RandomDithering(levels=3, norm=math.inf),
    BlockQuantization(blocks=4, p=2),
    BlockQuantization(blocks=(3, 7, 2), p=1),
    BlockQuantization(blocks=5, p=math.inf),
    # |x_i|^r underflows for a large r: every message was 0 (the norm came out 0)
    RandomDithering(levels=2, norm=1e4),
    BlockQuantization(blocks=4, p=1e4),
]


def _x(q=12, seed=0):
    x = torch.randn(q, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x[3] = 0.0
    return x


@pytest.mark.parametrize("comp", COMPRESSORS, ids=repr)
def test_unbiased_and_within_omega(comp):
    x = _x()
    q = x.numel()
    out = comp(x.expand(DRAWS, q), torch.Generator().manual_seed(1))
    assert out.shape == (DRAWS, q)
    err2 = ((out - x) ** 2).sum(-1)
    # unbiased: each coordinate's sample mean within 5 standard errors
    se = (out.var(0, unbiased=True) / DRAWS).sqrt()
    assert ((out.mean(0) - x).abs() <= 5 * se + 1e-12).all()
    # variance bound, with 5 standard errors of slack on the empirical mean
    bound = comp.omega(q) * (x**2).sum()
    assert err2.mean() <= bound + 5 * err2.std() / math.sqrt(DRAWS) + 1e-12
    assert out[:, 3].abs().max() == 0  # a zero coordinate is never sent as nonzero


def test_block_variance_formula_matches_draws():
    comp = BlockQuantization(blocks=(3, 7, 2), p=2)
    x = _x(seed=4)
    out = comp(x.expand(DRAWS, 12), torch.Generator().manual_seed(2))
    emp = ((out - x) ** 2).sum(-1).mean()
    assert emp.item() == pytest.approx(comp.variance(x).item(), rel=0.03)
    assert comp.omega(12) == pytest.approx(math.sqrt(7) - 1)


def test_zero_vectors_and_zero_blocks_stay_zero():
    x = torch.zeros(3, 10, dtype=torch.float64)
    x[1, :2] = 1.0  # second row: first block nonzero, the rest zero
    g = torch.Generator().manual_seed(0)
    for comp in COMPRESSORS[:5] + [BlockQuantization(blocks=(2, 3, 5)), BlockQuantization(2)]:
        out = comp(x, g)
        assert torch.isfinite(out).all()
        assert (out[0] == 0).all() and (out[2] == 0).all() and (out[1, 2:] == 0).all()


def test_bits_and_omega_values():
    q = 16
    assert Identity().bits(q) == 64 * q and Identity(float_bits=32).bits(q) == 512
    assert RandomDithering(levels=1).bits(q) == 64 + q * 2
    assert RandomDithering(levels=4).bits(q) == 64 + q * 4
    assert BlockQuantization(blocks=4).bits(q) == 4 * 64 + 2 * q
    assert BlockQuantization(blocks=5).bits(q) == 4 * 64 + 2 * q  # 5 + 5 + 5 + 1
    assert RandomDithering(levels=1, norm=2).omega(q) == pytest.approx(4.0)  # min(q/4, sqrt q)
    assert RandomDithering(levels=8, norm=2).omega(q) == pytest.approx(16 / 256)
    assert BlockQuantization(blocks=4, p=2).omega(q) == pytest.approx(1.0)
    assert BlockQuantization(blocks=4, p=1).omega(q) == pytest.approx(3.0)
    for comp in COMPRESSORS[1:]:
        if getattr(comp, "blocks", None) != (3, 7, 2):  # that one is for q = 12
            assert comp.bits(q) < Identity().bits(q)


def test_bad_options_are_one_line_errors():
    with pytest.raises(GossipError, match="levels"):
        RandomDithering(levels=0)
    with pytest.raises(GossipError, match="norm"):
        RandomDithering(norm=0.5)
    with pytest.raises(GossipError, match="blocks"):
        BlockQuantization(blocks=(2, 0))
    with pytest.raises(GossipError, match="blocks"):
        BlockQuantization(blocks=(2, 3))(torch.zeros(6, dtype=torch.float64))
    with pytest.raises(GossipError, match="compressor"):
        build_compressor("topk")
    assert build_compressor("dithering", levels=2).levels == 2


# block 1: [3, -4, 0, 1], block 2: [2, -1, 1.5, 0.5]; each block's p-norm by hand (p = 1e4 is the
# max norm to float64 precision, as p = inf is exactly)
BLOCK_NORMS = {1.0: (8.0, 5.0), 3.0: (92 ** (1 / 3), 12.5 ** (1 / 3)), 1e4: (4.0, 2.0),
               float("inf"): (4.0, 2.0)}  # fmt: skip


@pytest.mark.parametrize("p", sorted(BLOCK_NORMS))
def test_block_norm_key_sets_the_scale_of_each_block(p, tmp_path):
    """expfam.block_norm reaches the run's compressor: on a hand-made vector of two blocks of
    4, every coordinate sent is +-||block||_p (hand-computed norms) with the coordinate's sign,
    and the mean of many draws is x within 5 standard errors of the Bernoulli variance
    |x_j| ||block||_p - x_j^2 (hand formula; 0 for a coordinate whose |x_j| is the norm)."""
    from gossip_pfl.config import load_config
    from gossip_pfl.expfam.data import gmm2d
    from gossip_pfl.expfam.run import ExpFamRun

    cfg = load_config(base={
        "seed": 5, "rounds": 1, "algorithm": {"name": "fedem_em"}, "out": str(tmp_path),
        "runtime": {"device": "cpu"},
        "expfam": {"clients": 6, "samples": 30, "compressor": "block", "block": 4,
                   "block_norm": p},
    })  # fmt: skip
    run = ExpFamRun(cfg, dataset=gmm2d(n=6, m=30, seed=1), log=lambda *a: None)
    run.comm.close()
    x = torch.tensor([3.0, -4.0, 0.0, 1.0, 2.0, -1.0, 1.5, 0.5], dtype=torch.float64)
    scale = torch.tensor([BLOCK_NORMS[p][0]] * 4 + [BLOCK_NORMS[p][1]] * 4, dtype=torch.float64)
    draws = 20_000
    out = run.quant(x.expand(draws, 8), torch.Generator().manual_seed(3))
    sent = out != 0
    assert sent.any(0)[x != 0].all() and not sent[:, x == 0].any()
    expected = (torch.sign(x) * scale).expand(draws, 8)
    torch.testing.assert_close(out[sent], expected[sent], rtol=1e-12, atol=0)
    var = x.abs() * scale - x**2
    assert (var >= -1e-12).all()
    se = (var.clamp_min(0) / draws).sqrt()
    assert ((out.mean(0) - x).abs() <= 5 * se + 1e-12).all()

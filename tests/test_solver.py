"""LocalSGD's in-place step (views for a slice of peers; one gather and one copy back for
indexed ones) against its definition: torch.optim.SGD's update per peer (dampening 0), bit for
bit against the formula written one term at a time (the GPU's fused forms to float rounding),
and to float tolerance against torch.optim.SGD itself over several steps. Peers outside the
step are left alone."""

from __future__ import annotations

import pytest
import torch

from gossip_pfl.runtime.solver import LocalSGD

L, M, P = 5, 2, 37  # 37: a scalar tail after the vector lanes

# decay and proximal terms as large as the gradient, so that a rounding of their sums that
# differs (a fused multiply-add) shows
SOLVERS = {
    "momentum and decay": LocalSGD(lr=0.3, momentum=0.9, weight_decay=0.7),
    "plain": LocalSGD(lr=0.3),
    "proximal, no momentum": LocalSGD(lr=0.1, weight_decay=0.3, prox_mu=0.6),
    "proximal with momentum": LocalSGD(lr=0.1, momentum=0.5, prox_mu=0.6),
}
ROWS = {"every peer": slice(None), "a slice": slice(1, 4), "indexed": [0, 2, 3]}


def definition(solver, theta, grad, mom, rows, scale, factor, anchor, correction):
    """The step as it was written before it worked in place: one operation per term, on
    copies."""
    theta, mom = theta.clone(), mom.clone()
    p = theta[rows]
    g = grad + solver.weight_decay * p if solver.weight_decay else grad
    if solver.prox_mu:
        g = g + solver.prox_mu * (p - anchor[rows])
    if correction is not None:
        g = g + correction
    if solver.momentum:
        g = solver.momentum * mom[rows] + g
        mom[rows] = g
    theta[rows] = p - (solver.lr * factor) * scale[rows, None, None] * g
    return theta, mom


def draw(seed: int, a: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, M, P, generator=g), torch.randn(a, M, P, generator=g),
            torch.randn(L, M, P, generator=g))  # fmt: skip


@pytest.mark.parametrize("name", SOLVERS)
@pytest.mark.parametrize("where", ROWS)
@pytest.mark.parametrize("corrected", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("by_peer", [True, False])
def test_step_gives_the_definitions_bits(name, where, corrected, fused, by_peer, monkeypatch):
    """The CPU's step: the definition's bits. The fused forms a GPU's step takes
    (``solver.FUSED_ON``), forced on the CPU: its numbers to float rounding; with one step
    size for every peer (``lr_scale`` None) that is torch.optim.SGD's fused kernel."""
    from gossip_pfl.runtime import solver as module

    monkeypatch.setattr(module, "FUSED_ON", ("cpu",) if fused else ())
    monkeypatch.setattr(module, "KERNEL_ELEMENTS", 2 * M * P)  # two rows a block
    kernel = []  # the fused kernel's calls

    def fused_sgd(params, grads, momenta, lr, **kw):
        # what a GPU's kernel needs: its step size a float32 tensor on the parameters' device
        assert lr.dtype == torch.float32 and lr.device == params[0].device and lr.dim() == 0
        assert all(len(p) <= 2 for p in params)
        kernel.append(len(params))
        return real(params, grads, momenta, lr=lr, **kw)

    real = torch._fused_sgd_
    monkeypatch.setattr(torch, "_fused_sgd_", fused_sgd)
    solver, rows = SOLVERS[name], ROWS[where]
    rows = rows if isinstance(rows, slice) else torch.tensor(rows)
    a = len(range(L)[rows]) if isinstance(rows, slice) else len(rows)
    theta, grad, anchor = draw(0, a)
    state = solver.init(theta)
    state.momentum.normal_(generator=torch.Generator().manual_seed(1))
    scale = torch.rand(L, generator=torch.Generator().manual_seed(2)) + 0.5
    if not by_peer:
        scale = torch.ones(L)
    correction = (
        torch.randn(a, M, P, generator=torch.Generator().manual_seed(4)) if corrected else None
    )
    want_theta, want_mom = definition(solver, theta, grad, state.momentum, rows, scale, 0.1,
                                      anchor, correction)  # fmt: skip
    inputs = [t.clone() for t in (grad, anchor, *([correction] if corrected else []))]
    solver.step(theta, grad, state, rows, scale if by_peer else None, 0.1, anchor, correction)
    assert len(kernel) == (fused and not by_peer)
    assert kernel in ([], [-(-a // 2)])  # the rows in blocks of two
    if fused:
        torch.testing.assert_close(theta, want_theta, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state.momentum, want_mom, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(theta, want_theta)
        assert torch.equal(state.momentum, want_mom)
    # the caller's gradient, anchor and correction are not scratch buffers
    for before, after in zip(inputs, (grad, anchor, correction)):
        assert torch.equal(before, after)
    took = torch.zeros(L, dtype=torch.bool)
    took[rows] = True
    assert torch.equal(state.eta[took], (solver.lr * 0.1) * scale[took].double())
    assert (state.eta[~took] == 0).all()


@pytest.mark.parametrize("on", ["cpu", "fused"])
def test_fused_kernel_takes_the_schedules_factor_as_a_number_or_a_tensor(on, monkeypatch):
    """A CUDA graph's step takes the schedule's factor as a 0-dim float64 tensor filled every
    round: the fused kernel's step (forced on the CPU) and the CPU's then give the bits of
    the factor as a Python number, momentum, parameters and step sizes taken."""
    from gossip_pfl.runtime import solver as module

    monkeypatch.setattr(module, "FUSED_ON", ("cpu",) if on == "fused" else ())
    solver = SOLVERS["momentum and decay"]
    runs = []
    for factor in (0.1, torch.tensor(0.1, dtype=torch.float64)):
        theta, grad, _ = draw(5, 3)
        state = solver.init(theta)
        solver.step(theta, grad, state, slice(1, 4), None, factor)
        solver.step(theta, grad, state, torch.tensor([0, 2, 4]), None, factor)
        runs.append((theta, state.momentum, state.eta))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert torch.equal(runs[0][2], torch.full((L,), solver.lr * 0.1, dtype=torch.float64))


@pytest.mark.parametrize("factor", ["number", "tensor"])
def test_one_step_size_without_the_kernel_takes_the_forms(factor, monkeypatch):
    """A build without the fused kernel's tensor step size (before PyTorch 2.3): one step size
    for every peer takes the GPU's forms (forced here), to float rounding of the definition."""
    from gossip_pfl.runtime import solver as module

    monkeypatch.setattr(module, "FUSED_ON", ("cpu",))
    monkeypatch.setattr(module, "FUSED_KERNEL", False)
    monkeypatch.setattr(torch, "_fused_sgd_", None)  # not called
    solver = SOLVERS["momentum and decay"]
    f = 0.1 if factor == "number" else torch.tensor(0.1, dtype=torch.float64)
    for rows in (slice(1, 4), torch.tensor([0, 2, 3])):
        theta, grad, _ = draw(6, 3)
        state = solver.init(theta)
        state.momentum.normal_(generator=torch.Generator().manual_seed(7))
        want = definition(solver, theta, grad, state.momentum, rows, torch.ones(L), 0.1, None,
                          None)  # fmt: skip
        solver.step(theta, grad, state, rows, None, f)
        torch.testing.assert_close(theta, want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state.momentum, want[1], rtol=1e-6, atol=1e-6)


def test_steps_equal_torch_optim_sgd_per_peer():
    """Five steps, a different subset of peers each, against one torch.optim.SGD per peer with
    that peer's step size."""
    solver = SOLVERS["momentum and decay"]
    theta = torch.randn(L, M, P, generator=torch.Generator().manual_seed(3))
    scale = torch.tensor([1.0, 0.5, 2.0, 1.5, 0.8])
    state = solver.init(theta)
    params = [theta[i].clone().requires_grad_() for i in range(L)]
    opts = [torch.optim.SGD([params[i]], lr=solver.lr * float(scale[i]), momentum=0.9,
                            weight_decay=0.7) for i in range(L)]  # fmt: skip
    subsets = [slice(None), [0, 1, 4], slice(0, 2), [3], [1, 2, 3, 4]]
    for k, subset in enumerate(subsets):
        rows = subset if isinstance(subset, slice) else torch.tensor(subset)
        peers = list(range(L))[subset] if isinstance(subset, slice) else subset
        grad = torch.randn(len(peers), M, P, generator=torch.Generator().manual_seed(10 + k))
        solver.step(theta, grad, state, rows, scale)
        for j, i in enumerate(peers):
            params[i].grad = grad[j].clone()
            opts[i].step()
    want = torch.stack([p.detach() for p in params])
    torch.testing.assert_close(theta, want, rtol=1e-6, atol=1e-6)

"""The local solver's step at the full FedEM CNN's size, for a GPU machine: momentum SGD with
weight decay (``gossip_pfl.runtime.solver.LocalSGD.step``) on 100 peers x M = 3 x 2.17 million
parameters, for a step holding every peer (a slice: views updated in place) and one holding
half of them (indexed: gathered, stepped, copied back), in three forms side by side:

- **step sizes by peer** (a tensor ``lr_scale``, D-FedEM's client weighting): on a GPU the
  fused forms of ``solver.FUSED_ON``, 9 passes over the rows (17 indexed); on a CPU one
  kernel per term, 15 (23);
- **one step size** (``lr_scale`` None, every other run): on a GPU torch.optim.SGD's fused
  kernel (``torch._fused_sgd_``), 5 passes (13 indexed); on a CPU as above;
- **compiled**: the formula as one function under ``torch.compile`` (about 5 passes).

All three start from the same state with the same step sizes; the table gives the largest
differences from the first form (float rounding: fused multiply-adds, the kernel's own
rounding).

On an H100 the eager steps took about 300 of a FedEM round's 884 GPU milliseconds, and the
gathers and write-backs about 150 more (docs/speed-notes.md), before the fused forms and the
reordered plan. On a CPU the eager step keeps each term its own kernel so that it gives the
same bits on every placement; a fused kernel rounds differently (a fused multiply-add), so
this prints the largest difference too.

On the 2-core CPU (20 peers, ``--peers 20 --params 2170000``) the compiled step took 53 ms
against 279 for a slice (0.19x) and 211 against 327 indexed (0.65x), with the eager step's bits
(inductor compiles C++ with -ffp-contract=off). In the trainer, a FedEM round of the full CNN
(20 clients, 5% of the images, ``bench_cnn.py --device cpu --fraction 0.05 --peers 20``) took
5.06 s against 5.54 (0.91x), after a first compile of 3.5 s (11 s with an empty inductor
cache): 4 rounds took 33.98 s against 32.71 (``bench_wall.py``). So the trainer keeps the eager
step; a GPU, where the step is a third of the round, is still to measure.

    python benchmarks/bench_solver.py [--device cuda] [--params 2170000] [--iters 20]
    python benchmarks/bench_solver.py --device cpu --params 20000 --iters 3   # a smoke test

On this 2-core CPU with the GPU's forms forced (``solver.FUSED_ON = ("cpu",)``, 10 peers, 2.17
million parameters, 5 iterations; the CPU does not take them, for its placements' bits), the
fused kernel took 12.98 ms against 89.69 for the 9-pass forms on a slice (0.14x: their
temporaries are fresh pages) and 82.58 against 121.85 indexed (0.68x).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from bench_conv import timed  # three warm-up calls (the compiler's first), then the median

from gossip_pfl.runtime.solver import LocalSGD

LR, MOMENTUM, DECAY = 0.2, 0.9, 5e-4


def fused_step(
    theta: torch.Tensor,
    grad: torch.Tensor,
    momentum: torch.Tensor,
    rows: torch.Tensor | slice,
    lr: torch.Tensor,
) -> None:
    """LocalSGD.step's formula (dampening 0) on the peers ``rows`` (indices, or a slice whose
    views are updated in place), written for a compiler to fuse: ``lr`` (L,) is each peer's
    step size."""
    if isinstance(rows, slice):
        p, m = theta[rows], momentum[rows]
        m.copy_(m * MOMENTUM + (grad + DECAY * p))
        p.copy_(p - lr[rows][:, None, None] * m)
        return
    p = theta.index_select(0, rows)
    m = momentum.index_select(0, rows) * MOMENTUM + (grad + DECAY * p)
    momentum.index_copy_(0, rows, m)
    theta.index_copy_(0, rows, p - lr.index_select(0, rows)[:, None, None] * m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--components", type=int, default=3)
    ap.add_argument("--params", type=int, default=2_170_000, help="a component's parameters")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out the compiled step (its first compile: tens of seconds)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    L, M, P = args.peers, args.components, args.params
    gen = torch.Generator(device=device).manual_seed(0)
    theta = torch.randn(L, M, P, device=device, generator=gen)
    solver = LocalSGD(LR, momentum=MOMENTUM, weight_decay=DECAY)
    compiled = None if args.no_compile else torch.compile(fused_step, dynamic=True)
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"# {L} peers x M = {M} x {P:,} parameters, {device}{gpu}")
    print("| step | peers | eager ms, step sizes by peer | eager ms, one step size | "
          "compiled ms | one size / by peer | compiled / by peer | GB/s at 5 passes (one "
          "size) | largest difference (one size; compiled) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, A in (("slice", L), ("indexed", L // 2)):
        times, diffs = compare(solver, compiled, theta, A, gen, args.iters)
        by_peer, one, comp = times
        gbps = 5 * A * M * P * theta.element_size() / one / 1e9
        print(f"| {name} | {A} | {1e3 * by_peer:.2f} | {1e3 * one:.2f} | {1e3 * comp:.2f} | "
              f"{one / by_peer:.2f} | {comp / by_peer:.2f} | {gbps:.0f} | "
              f"{diffs[0]:.1e}; {diffs[1]:.1e} |", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()


def compare(
    solver: LocalSGD,
    compiled: Callable[..., None] | None,
    theta: torch.Tensor,
    A: int,
    gen: torch.Generator,
    iters: int,
) -> tuple[tuple[float, float, float], tuple[float, float]]:
    """Seconds of the eager step with a step size by peer, the eager step with one step size
    for all (``lr_scale`` None: the fused kernel on a GPU) and the compiled step, on A of
    theta's peers (every other one; all of them as a slice); and the largest relative
    differences from the first after one step of each from the same state (NaN: no compiled
    step)."""
    L, device = theta.shape[0], theta.device
    index = torch.arange(0, L, L // A, device=device)[:A]
    rows = index if A < L else slice(None)
    grad = torch.randn(A, *theta.shape[1:], device=device, generator=gen)
    state = solver.init(theta)
    state.momentum.normal_(generator=gen).mul_(0.1)
    ones = torch.ones(L, device=device)  # step sizes by peer, all equal: comparable bits
    runs = []  # (step, its state) per form, from the same start
    for form in ("by peer", "one size", "compiled")[: 2 if compiled is None else 3]:
        th, st = theta.clone(), LocalSGD.init(solver, theta)
        st.momentum.copy_(state.momentum)
        if form == "compiled":
            runs.append(partial(compiled, th, grad, st.momentum, rows, (LR * ones).float()))
        else:
            runs.append(partial(solver.step, th, grad, st, rows, ones if form == "by peer"
                                else None))  # fmt: skip
        runs[-1]()
        runs[-1].theta = th
    first = runs[0].theta
    diffs = tuple(float((r.theta - first).abs().max() / first.abs().max()) for r in runs[1:])
    times = tuple(timed(r, device, iters) for r in runs)
    nan = (float("nan"),) * (3 - len(runs))
    return times + nan, diffs + nan


if __name__ == "__main__":
    main()

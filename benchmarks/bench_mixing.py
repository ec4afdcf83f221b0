"""One process, 1,000 peers x M = 3 components x 10,000 parameters on a ring: the runtime's
mixing step against one bare sparse matrix product over the stacked tensor, both as
``torch.sparse.mm`` computes it and as ``torch.addmm`` does (the BLAS library's sparse kernel,
what the runtime calls), each into a fresh tensor and into a reused one.

Goal (issue 3): mixing step within 2x of the bare product. Prints a table of medians.

    python benchmarks/bench_mixing.py [--peers 1000] [--components 3] [--params 10000]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch

from gossip_pfl.runtime.comm import LocalComm
from gossip_pfl.runtime.exchange import Exchanger
from gossip_pfl.runtime.placement import Placement
from topologies import MixingSchedule, schedule_from_spec


def ring_schedule(n: int) -> MixingSchedule:
    """Ring with weights 1/3 (max-degree rule), built sparsely by the topology module."""
    return schedule_from_spec({"n": n, "graph": "ring", "weights": "max_degree"})


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--components", type=int, default=3)
    ap.add_argument("--params", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    n, d = args.peers, args.components * args.params
    schedule = ring_schedule(n)
    state = torch.randn(n, d)
    exchanger = Exchanger(Placement(n, 1), LocalComm(torch.device("cpu")))
    phase = schedule.phases(0)[0]
    w = torch.sparse_coo_tensor(
        torch.as_tensor(np.stack([phase.rows, phase.cols])),
        torch.as_tensor(phase.weights, dtype=torch.float32),
        (n, n),
        check_invariants=False,
    ).coalesce()

    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        csr = w.to_sparse_csr()
    out = torch.empty_like(state)
    spare = [torch.empty_like(state)]

    def runtime_step():  # what a round does: schedule -> phase -> (cached) plan -> mix into
        for k, ph in enumerate(schedule.phases(1)):  # the buffer the previous round freed
            spare[0] = exchanger.mix(state, exchanger.plan(ph, key=(0, k)), out=spare[0])

    def runtime_step_uncached():
        for ph in schedule.phases(1):
            spare[0] = exchanger.mix(state, exchanger.plan(ph), out=spare[0])

    def addmm():
        torch.addmm(out, csr, state, beta=0, out=out)

    rows = [
        ("bare torch.sparse.mm, CSR (new tensor)", lambda: torch.sparse.mm(csr, state)),
        ("bare torch.addmm, CSR (into a buffer)", addmm),
        ("runtime mixing step (plan cached, period 1)", runtime_step),
        ("runtime mixing step (plan rebuilt)", runtime_step_uncached),
    ]
    times = [median_time(fn, args.repeats) for _, fn in rows]
    print(
        f"# {n} peers x {args.components} components x {args.params} params, ring, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'step':<44} {'median s':>10} {'vs sparse.mm':>13} {'vs addmm':>9}")
    for (label, _), sec in zip(rows, times):
        print(f"{label:<44} {sec:>10.4f} {sec / times[0]:>13.2f} {sec / times[1]:>9.2f}")


if __name__ == "__main__":
    main()

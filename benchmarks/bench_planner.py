"""The round planner's host work for the fused linear round on a GPU: the minibatch plan
(``round_batches``) and its layout for the two uploads (``linear_host``), both drawn a round
ahead on the planner's thread, with the layout in NumPy and in the compiled loop side by side.

On a GPU the round's own thread is the bottleneck: it dispatches small operations and takes
the GIL back after each. ``stalls`` measures what the planner's thread costs it: the round's
thread runs a tiny torch operation in a loop (each call drops and retakes the GIL, as a
GPU's dispatch does) while the planner's work runs on a thread beside it; the time it loses
in waits over 20 us (the GIL held by the other thread, or the core taken) is added up.

    OMP_NUM_THREADS=1 python benchmarks/bench_planner.py [--peers 300] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial
from pathlib import Path

import torch

from gossip_pfl.config import load_config
from gossip_pfl.runtime import data
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent


def seconds(fn, repeats: int) -> float:
    """Median seconds of ``fn(k)`` for k = 0, 1, ..."""
    times = []
    for k in range(repeats):
        t0 = time.perf_counter()
        fn(k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stalls(fn, repeats: int) -> float:
    """Median seconds this thread waits (gaps over 20 us between tiny torch operations)
    while ``fn(k)`` runs on another thread."""
    x, out = torch.zeros(4), []
    for k in range(repeats):
        worker, lost = threading.Thread(target=fn, args=(k,)), 0.0
        worker.start()
        last = time.perf_counter()
        while worker.is_alive():
            x.add_(1.0)  # drops the GIL inside, takes it back after
            now = time.perf_counter()
            if now - last > 20e-6:
                lost += now - last
            last = now
        worker.join()
        out.append(lost)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs/synthetic/dfedem.yaml",
                      [f"data.n_clients={args.peers}", "runtime.device=cpu",
                       "out=runs/bench_planner"])  # fmt: skip
    tr = Trainer(cfg, log=lambda *a: None)
    a = cfg.algorithm
    key = (tr.counts, tr.train_ids[tr.peers], cfg.seed)
    compiled = data._compiled()
    if not compiled:
        raise SystemExit("bench_planner.py: numba does not load here; nothing to compare")
    plans = [data.round_batches(*key, k, a.batch_size, 1, None, 0, True) for k in range(4)]

    def plan(k: int) -> None:
        data.round_batches(*key, k, a.batch_size, 1, None, 0, True)

    def layout(k: int) -> None:
        data.linear_host(a.batch_size, *plans[k % 4], dense=True)

    def both(k: int) -> None:
        data._plan(*key, k, a.batch_size, 1, None, 0,
                   partial(data.linear_host, a.batch_size, dense=True), True)  # fmt: skip

    host = data.linear_host(a.batch_size, *plans[0], dense=True)
    mib = (host.floats.nbytes + host.ints.nbytes) / 2**20
    print(f"# {args.peers} peers, B = {a.batch_size}: {mib:.2f} MiB of uploads a round; "
          f"median of {args.repeats}, ms")  # fmt: skip
    print("| layout | round_batches | linear_host | round's thread stalled during both |")
    print("|---|---|---|---|")
    real = data.linear_host
    for name, layout_fn in (("NumPy", partial(_numpy_layout, real, compiled)), ("compiled", real)):
        data.linear_host = layout_fn  # (the shuffles stay compiled in both rows)
        try:
            row = [seconds(plan, args.repeats), seconds(layout, args.repeats),
                   stalls(both, args.repeats)]  # fmt: skip
        finally:
            data.linear_host = real
        print(f"| {name} | " + " | ".join(f"{1e3 * v:.3f}" for v in row) + " |")


def _numpy_layout(real, compiled, *args, **kw):
    """``data.linear_host`` with NumPy's layout: the compiled loops hidden for this call."""
    data._KERNELS = False
    try:
        return real(*args, **kw)
    finally:
        data._KERNELS = compiled


if __name__ == "__main__":
    main()

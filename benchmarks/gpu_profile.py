"""Where a round of the synthetic D-FedEM goes on a GPU: the host's and the GPU's time per
phase, the BLAS library's effect, what a CUDA graph of the round's SGD steps would save, and
the profiler's tables (by host time, then by GPU time). For a GPU machine:

    python benchmarks/gpu_profile.py [--set KEY=VALUE ...]

``synced`` times each phase with the device synchronised around it (what the run loop's
phase times see); ``unsynced`` lets the host run ahead, as a run does between those points.
The graph is captured from the steps of one round's plan and replayed on the same plan; its
result is compared with the eager steps' bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gossip_pfl.config import load_config
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_profile.py: no CUDA device here", file=sys.stderr)
        sys.exit(2)
    cfg = load_config(ROOT / "configs/synthetic/dfedem.yaml",
                      ["runtime.device=cuda", "out=runs/gpu_profile", *args.set])  # fmt: skip
    t0 = time.perf_counter()
    tr = Trainer(cfg, log=lambda *a: None)
    print(f"setup {time.perf_counter() - t0:.1f} s; {tr.forward.describe()}", flush=True)
    sync = torch.cuda.synchronize
    t = 0

    def rounds(n: int) -> None:
        nonlocal t
        for _ in range(n):
            active = tr.sample(t)
            tr.local_work(t, active)
            tr.communicate(t, active)
            t += 1

    def clock() -> float:
        sync()
        return time.perf_counter()

    # the first rounds pay for the process's first use of each kernel (CUDA loads them
    # lazily), the graph's capture and cuBLAS's handles: inside a run's wall_seconds
    firsts = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        pass  # the profiler's own start (CUPTI), outside the first round's time
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as first_round:
        a0 = clock()
        rounds(1)
        firsts.append(clock() - a0)
    for _ in range(2):
        a0 = clock()
        rounds(1)
        firsts.append(clock() - a0)
    print("first rounds ms (the first profiled):", [round(1e3 * e, 2) for e in firsts])
    print(first_round.key_averages().table(sort_by="cpu_time_total", row_limit=15,
                                           max_name_column_width=50))  # fmt: skip
    phases = {"sample": [], "local_work": [], "communicate": []}
    for _ in range(20):
        a0 = clock()
        active = tr.sample(t)
        a1 = clock()
        tr.local_work(t, active)
        a2 = clock()
        tr.communicate(t, active)
        a3 = clock()
        t += 1
        for k, dt in zip(phases, (a1 - a0, a2 - a1, a3 - a2)):
            phases[k].append(dt)
    print("synced ms:", {k: round(1e3 * statistics.median(v), 3) for k, v in phases.items()})
    for lib in ("default", "cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except RuntimeError as err:  # a build without cuBLASLt
            print(f"{lib}: {err}")
            continue
        a0 = clock()
        rounds(20)
        print(f"unsynced ms a round, BLAS {lib}: {(clock() - a0) / 20 * 1e3:.3f}", flush=True)
    torch.backends.cuda.preferred_blas_library("default")
    evals = []
    # the first evaluation took 182 to 191 ms on an H100, the next ones 4 to 5: profile it
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as first:
        a0 = clock()
        tr.metrics_row(t)
        evals.append(clock() - a0)
    for _ in range(2):
        a0 = clock()
        tr.metrics_row(t)
        evals.append(clock() - a0)
    print("evaluation ms (the first profiled):", [round(1e3 * e, 2) for e in evals])
    print(first.key_averages().table(sort_by="cpu_time_total", row_limit=15,
                                     max_name_column_width=50))  # fmt: skip
    graph_of_steps(tr, rounds)
    uploads(tr)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rounds(3)
        sync()
    table = prof.key_averages().table
    print(table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
    print(table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))


def graph_of_steps(tr: Trainer, rounds) -> None:
    """Eager against replayed time of one round's SGD steps (the fused linear path)."""
    forward, seen = tr.forward, {}
    eager = forward._linear_sgd_steps
    forward._linear_sgd_steps = lambda *a: (seen.setdefault("args", a), eager(*a))[1]
    # the probe round eager: with runtime.cuda_graphs its graph, captured before, replays
    # without calling the steps
    graphs, forward.graphs = forward.graphs, None
    try:
        rounds(1)
    finally:
        forward._linear_sgd_steps, forward.graphs = eager, graphs
    if "args" not in seen:
        print("graph: this config does not take the fused linear steps")
        return
    theta, inputs, plan = seen["args"][:3]  # then shared_buffer
    start = theta.clone()
    torch.cuda.synchronize()
    a0 = time.perf_counter()
    for _ in range(20):
        eager(theta, inputs, plan)
    torch.cuda.synchronize()
    eager_s = (time.perf_counter() - a0) / 20
    theta.copy_(start)
    eager(theta, inputs, plan)
    want = theta.clone()
    side = torch.cuda.Stream()  # capture's warm-up on a side stream, as torch's docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        theta.copy_(start)
        eager(theta, inputs, plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    theta.copy_(start)
    with torch.cuda.graph(graph):
        eager(theta, inputs, plan)
    theta.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(theta, want)
    a0 = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    graph_s = (time.perf_counter() - a0) / 20
    print(f"graph of a round's {len(plan.pos)} steps: eager {eager_s * 1e3:.3f} ms, "
          f"replayed {graph_s * 1e3:.3f} ms, the same bits: {same}")  # fmt: skip


def uploads(tr: Trainer) -> None:
    """A round's plan uploads (the fused linear path's two arrays, data.linear_uploads) from
    pageable memory, as the code made them up to a803af0, against ``data.Uploads`` (two
    page-locked buffers a name, used in turn): the host's time for a round's uploads with the
    device idle, and with about 2 ms of work queued before them, as when the host runs ahead
    of the device (a pageable copy waits for that work)."""
    from gossip_pfl.runtime.data import Uploads, linear_host, round_batches

    idx, weight = round_batches(tr.counts, tr.train_ids[tr.peers], tr.cfg.seed, 0,
                                tr.cfg.algorithm.batch_size)  # fmt: skip
    host = linear_host(tr.cfg.algorithm.batch_size, idx, weight, dense=True)
    arrays = {"floats": host.floats, "ints": host.ints}
    device = tr.device
    total = sum(a.nbytes for a in arrays.values())
    up = Uploads(device)

    def pageable() -> None:
        for a in arrays.values():
            torch.as_tensor(a, device=device)

    def staged() -> None:
        for name, a in arrays.items():
            up(name, a)

    for name, fn in (("pageable", pageable), ("page-locked, in turn (data.Uploads)", staged)):
        fn()
        for busy in (0, 4_000_000):  # device cycles queued first: about 2 ms
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(busy)
                a0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - a0)
            torch.cuda.synchronize()
            print(f"plan uploads, {total / 2**20:.1f} MiB, {name}, device "
                  f"{'busy' if busy else 'idle'}: {statistics.median(times) * 1e3:.3f} ms "
                  "on the host")  # fmt: skip


if __name__ == "__main__":
    main()

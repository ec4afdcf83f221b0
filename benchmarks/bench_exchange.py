"""Exchange of a 10M-parameter model on a ring of 4 Gloo ranks (one peer per rank).

Compares, per gossip round (median over repeats, measured in one run):
  * the runtime's Exchanger.mix (plan, fused buffers, batch_isend_irecv, sparse mix),
  * a bare dist.batch_isend_irecv of the same bytes with both ring neighbours,
  * dist.all_reduce of the same buffer,
  * the mixing arithmetic alone (no exchange; every rank at once, as in a round), and the
    least memory traffic any mix has (read the own and the two received rows, write one),
and how busy the machine's cores are during the bare exchange (processes' CPU seconds over
wall seconds times cores): when the copies through loopback already keep the cores busy, the
mixing arithmetic cannot hide behind them and adds to the round.
  * the zmq transport (``runtime.transport: zmq``, gossip_pfl/runtime/zmq_comm.py): the same
    ring exchange with ZmqComm, as the collectives world (no acks) and as a peer-to-peer one
    (``p2p=True``: every message acknowledged), on its own loopback ports in the same processes,
    timed between the Gloo cases (issue 20's target: zmq <= 1.2 x bare batch_isend_irecv).
    The received rows are left in ZeroMQ's frames (``hold=True``, as Exchanger.mix asks:
    no copy into a tensor); "copied" fills the tensors, and "the same over zmq" is the whole
    Exchanger.mix, to compare with the runtime's over Gloo.
Goal (issue 3): runtime <= 1.1 x bare p2p, and below all_reduce.

    python benchmarks/bench_exchange.py [--params 10000000] [--ranks 4] [--repeats 10] [--no-zmq]
        [--io-threads N] [--no-malloc-tuning]   (the zmq transport as it was: 1, and no tuning)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from queue import Empty

import numpy as np


def _ring_phase(n: int):
    from topologies import Phase

    i = np.arange(n)
    rows = np.concatenate([i, i, i])
    cols = np.concatenate([i, (i + 1) % n, (i - 1) % n])
    return Phase(n, rows, cols, np.full(3 * n, 1 / 3))


def _worker(
    rank: int,
    world: int,
    port: int,
    params: int,
    repeats: int,
    queue,
    zmq_peers=None,
    zmq_opts=None,
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch
    import torch.distributed as dist

    from gossip_pfl.runtime.comm import init_comm
    from gossip_pfl.runtime.exchange import Exchanger
    from gossip_pfl.runtime.placement import Placement

    torch.set_num_threads(1)
    comm = init_comm("cpu", "gloo", 120)
    state = torch.randn(1, params, generator=torch.Generator().manual_seed(rank))
    exchanger = Exchanger(Placement(world, world, rank), comm)
    phase = _ring_phase(world)
    left, right = (rank - 1) % world, (rank + 1) % world

    spare = torch.empty_like(state)

    def ours():  # as the trainer does it: the output goes into a reused buffer
        exchanger.mix(state, exchanger.plan(phase, key=0), out=spare)

    def ours_replanned():  # a time-varying schedule: a new plan every round
        exchanger.mix(state, exchanger.plan(phase), out=spare)

    def ours_comm():
        exchanger.exchange(state, exchanger.plan(phase, key=0))

    recv_l, recv_r = torch.empty(params), torch.empty(params)

    def bare():
        ops = [
            dist.P2POp(dist.isend, state[0], left),
            dist.P2POp(dist.isend, state[0], right),
            dist.P2POp(dist.irecv, recv_l, left),
            dist.P2POp(dist.irecv, recv_r, right),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    buf = state[0].clone()
    received, w_recv = torch.randn(2, params), torch.full((1, 2), 1 / 3)

    def mix_only():  # what Exchanger.mix computes for this rank, without the exchange
        torch.mul(state, 1 / 3, out=spare)
        spare.addmm_(w_recv, received)

    def traffic_floor():  # the bytes any mix moves: read 3 x 40 MB, write 40 MB
        spare.copy_(state)
        received[0].sum()
        received[1].sum()

    def allreduce():
        dist.all_reduce(buf)

    zmq_cases = ()
    if zmq_peers:
        from gossip_pfl.runtime import zmq_comm
        from gossip_pfl.runtime.zmq_comm import ZmqComm

        zmq_comm.IO_THREADS = zmq_opts["io_threads"]
        if not zmq_opts["tune_malloc"]:  # glibc's allocator as it starts
            zmq_comm.keep_freed_memory = lambda: False

        zcomms = {
            "zmq": ZmqComm(rank, zmq_peers["zmq"], "cpu", 120),
            "zmq_p2p": ZmqComm(rank, zmq_peers["zmq_p2p"], "cpu", 120, p2p=True),
        }
        zrecv_l, zrecv_r = torch.empty(params), torch.empty(params)
        held = {}  # the last held exchange's rows, checked at the end

        def zmq_exchange(comm, hold=True):  # hold: the rows left in the frames, as mix does
            def fn():
                comm.set_tag(comm.tag[0] + 1, 0)
                p = comm.exchange({left: state[0], right: state[0]},
                                  {left: zrecv_l, right: zrecv_r}, hold=hold)  # fmt: skip
                p.wait_all()
                if getattr(p, "lost", None):
                    raise RuntimeError(f"zmq p2p exchange lost links {p.lost}")
                held.update(p.parts)

            return fn

        zex = Exchanger(Placement(world, world, rank), zcomms["zmq"])

        def zmq_mix():  # the runtime's mix over zmq (the received rows added from the frames)
            zcomms["zmq"].set_tag(zcomms["zmq"].tag[0] + 1, 0)
            zex.mix(state, zex.plan(phase, key=0), out=spare)

        zmq_cases = (("zmq", zmq_exchange(zcomms["zmq"])),
                     ("zmq_copy", zmq_exchange(zcomms["zmq"], hold=False)),
                     ("zmq_p2p", zmq_exchange(zcomms["zmq_p2p"])),
                     ("zmq_mix", zmq_mix))  # fmt: skip

    results = {}
    cpu = {}  # this process's CPU seconds and the wall seconds, per case
    cases = (
        ("bare", bare), *zmq_cases, ("comm", ours_comm), ("ours", ours),
        ("replanned", ours_replanned), ("allreduce", allreduce),
        ("mix", mix_only), ("floor", traffic_floor),
    )  # fmt: skip
    for name, fn in cases * 2:
        fn()
        dist.barrier()
        times = []
        c0, w0 = os.times(), time.perf_counter()
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        c1, w1 = os.times(), time.perf_counter()
        busy = (c1.user - c0.user) + (c1.system - c0.system)
        prev = cpu.get(name, (0.0, 0.0))
        cpu[name] = (prev[0] + busy, prev[1] + w1 - w0)
        results.setdefault(name, []).extend(times)
    if zmq_cases:  # the rows zmq received are the neighbours', copied and held
        for got, r in ((zrecv_l, left), (zrecv_r, right)):
            want = torch.randn(1, params, generator=torch.Generator().manual_seed(r))
            assert torch.equal(got, want[0]), f"rank {rank}: wrong row from rank {r}"
            assert torch.equal(torch.cat(held[r]), want[0]), f"rank {rank}: wrong frames from {r}"
        for c in zcomms.values():
            c.close()
    queue.put((rank, {k: statistics.median(v) for k, v in results.items()}, cpu))
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-zmq", action="store_true", help="leave out the zmq transport")
    ap.add_argument("--io-threads", type=int, default=None, help="zmq I/O threads per process")
    ap.add_argument(
        "--no-malloc-tuning", action="store_true", help="leave glibc's allocator settings alone"
    )
    args = ap.parse_args()
    socks = [socket.socket() for _ in range(1 + 2 * args.ranks)]
    try:  # all the ports at once, so that they differ
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    port, n = ports[0], args.ranks
    zmq_peers = None
    if not args.no_zmq:
        zmq_peers = {
            "zmq": {r: f"127.0.0.1:{ports[1 + r]}" for r in range(n)},
            "zmq_p2p": {r: f"127.0.0.1:{ports[1 + n + r]}" for r in range(n)},
        }
    from gossip_pfl.runtime import zmq_comm

    zmq_opts = {"io_threads": args.io_threads or zmq_comm.IO_THREADS,
                "tune_malloc": not args.no_malloc_tuning}  # fmt: skip
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker, args=(r, n, port, args.params, args.repeats, queue, zmq_peers, zmq_opts)
        )  # fmt: skip
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    reports = {}
    while len(reports) < args.ranks:  # a worker that dies must not leave us waiting
        try:
            rank, med, cpu = queue.get(timeout=5)
            reports[rank] = (med, cpu)
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"bench_exchange: a worker exited with code {dead[0]}") from None
    for p in procs:
        p.join()
    med = reports[0][0]
    cores = os.cpu_count() or 1
    busy = sum(cpu["bare"][0] for _, cpu in reports.values())
    wall = max(cpu["bare"][1] for _, cpu in reports.values())
    mb = args.params * 4 / 1e6
    print(
        f"# ring of {args.ranks} Gloo ranks, {args.params:,} float32 params ({mb:.0f} MB), "
        f"median of {2 * args.repeats} rounds"
    )
    print(f"{'exchange':<40} {'median s':>9} {'vs bare':>8}")
    labels = [("bare", "bare batch_isend_irecv (2 neighbours)")]
    if zmq_peers:
        labels += [("zmq", "zmq ZmqComm exchange (2 neighbours)"),
                   ("zmq_p2p", "zmq ZmqComm exchange, p2p (acks)"),
                   ("zmq_copy", "  zmq, copied into the tensors")]  # fmt: skip
    for name, label in (
        *labels,
        ("comm", "runtime Exchanger.exchange (bytes only)"),
        ("ours", "runtime Exchanger.mix (exchange + mix)"),
        *((("zmq_mix", "  the same over zmq"),) if zmq_peers else ()),
        ("replanned", "  the same, planned anew every round"),
        ("allreduce", "dist.all_reduce (same buffer)"),
        ("mix", "mixing arithmetic alone (no exchange)"),
        ("floor", "its memory traffic (copy + 2 sums)"),
    ):
        print(f"{label:<40} {med[name]:>9.4f} {med[name] / med['bare']:>8.2f}")
    print(f"# cores busy during the bare exchange: {busy / (wall * cores):.0%} of {cores}")
    if zmq_peers:
        print(f"# zmq: {zmq_opts['io_threads']} I/O thread(s), allocator "
              f"{'tuned' if zmq_opts['tune_malloc'] else 'as glibc starts'}; load average "
              f"{os.getloadavg()[0]:.2f}")  # fmt: skip
        print(f"# zmq / Gloo batch_isend_irecv: {med['zmq'] / med['bare']:.2f}x, p2p "
              f"{med['zmq_p2p'] / med['bare']:.2f}x (target <= 1.2x); Exchanger.mix over zmq "
              f"/ over Gloo: {med['zmq_mix'] / med['ours']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

"""Scale: synthetic D-FedEM (linear model, M = 3) with many peers on one CPU process: seconds
per round (local work + gossip, median; wall and CPU time of all threads, which other jobs on
the machine disturb less) and peak memory, for growing peer counts. Each count
runs in a fresh process, so its peak resident memory is its own.

    OMP_NUM_THREADS=1 python benchmarks/bench_scale.py [--peers 1000,3000,10000] [--rounds 3]
        [--set KEY=VALUE ...]   # e.g. runtime.cpu_kernels=false: the torch operations

"plan ms" times a round's minibatch plan alone (round_batches; in a run it is drawn a round
ahead on a background thread).

The schedule is a ring (Metropolis weights, two neighbours: the gossip stays sparse); each
client keeps the synthetic generator's sizes and 20 test samples (evaluation is not timed).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(peers: int, rounds: int, sets: list[str]) -> dict:
    from gossip_pfl.config import load_config
    from gossip_pfl.data import load_dataset
    from gossip_pfl.runtime.data import round_batches
    from gossip_pfl.train import Trainer

    t0 = time.perf_counter()
    data = load_dataset("synthetic", n_clients=peers, n_test=20)
    cfg = load_config(
        base={
            "algorithm": {"name": "dfedem", "components": 3, "lr": 0.1, "batch_size": 128},
            "schedule": {"graph": "ring", "weights": "metropolis"},
            "runtime": {"device": "cpu"},
            "check_schedule": False,
            "out": "runs/bench_scale",
        },
        overrides=sets,
    )
    tr = Trainer(cfg, dataset=data, log=lambda *a: None)
    setup = time.perf_counter() - t0
    times, cpu = [], []
    for t in range(rounds + 1):  # round 0 warms up
        t0, c0 = time.perf_counter(), time.process_time()
        active = tr.sample(t)
        tr.local_work(t, active)
        tr.communicate(t, active)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    plan = []  # a round's minibatch plan alone (drawn on the planner's thread in a run)
    for t in range(5):
        t0 = time.perf_counter()
        round_batches(tr.counts, tr.train_ids[tr.peers], cfg.seed, t, 128, 1, None, 0, True)
        plan.append(time.perf_counter() - t0)
    return {
        "peers": peers,
        "samples": int(tr.counts.sum()),
        "n_max": int(tr.train.y.shape[1]),
        "seconds_per_round": statistics.median(times[1:]),
        "cpu_seconds_per_round": statistics.median(cpu[1:]),  # all threads: robust to load
        "plan_ms": 1e3 * statistics.median(plan),
        "setup_seconds": setup,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="1000,3000,10000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every count")  # fmt: skip
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.rounds, args.set)))
        return
    print("| peers | samples | padded to | s/round | CPU s/round | plan ms | peak RSS GB | "
          "GB per 1k peers | setup s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for n in map(int, args.peers.split(",")):
        cmd = [sys.executable, __file__, "--one", str(n), "--rounds", str(args.rounds)]
        cmd += [a for kv in args.set for a in ("--set", kv)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
            if out.returncode < 0:  # a signal: -9 is usually the kernel's out-of-memory killer
                why = f"killed by signal {-out.returncode} (out of memory?)"
            print(f"| {n} | failed: {why} |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {n} | {r['samples']} | {r['n_max']} | {r['seconds_per_round']:.3f} | "
            f"{r['cpu_seconds_per_round']:.3f} | {r['plan_ms']:.0f} | "
            f"{r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / n * 1000:.3f} | "
            f"{r['setup_seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()

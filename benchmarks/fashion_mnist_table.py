"""Fashion-MNIST study: Local, FedAvg, FedEM and D-FedEM from configs/fashion_mnist/, one process.

100 clients, FedEM's mixture split (M = 3 label groups, Dirichlet alpha = 0.4, >= 10 samples per
client). Prints test accuracy (mean over clients and bottom decile), rounds and wall time per
run, a Markdown table, and the total time (the study's budget: under 30 minutes on 2 CPU cores).
With several ``--seeds`` (training seeds; the partition stays data seed 0) every method runs
once per seed and the table adds the mean over seeds.

    python benchmarks/fashion_mnist_table.py [--rounds 100] [--only fedem,dfedem]
    python benchmarks/fashion_mnist_table.py --threads 1 --seeds 1235,1236 --only fedavg,fedem
    python benchmarks/fashion_mnist_table.py --threads 1 --only fedem_smoothed \
        --set runtime.precision=bf16 --out runs/fashion_mnist_bf16

The thread count changes the float rounding of the convolutions, and over 100 rounds that moves
a run by about a point, so compare runs made with the same ``--threads``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from gossip_pfl.config import load_config
from gossip_pfl.train import run

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "fashion_mnist"
METHODS = ["local", "fedavg", "fedem", "fedem_smoothed", "dfedem"]
LABELS = {
    "local": "Local",
    "fedavg": "FedAvg",
    "fedem": "FedEM",
    "fedem_smoothed": "FedEM, smoothed responsibilities (q_smoothing 0.1)",
    "dfedem": "D-FedEM (Erdos-Renyi 0.5, Metropolis, gossip client weighting)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="override rounds")
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument(
        "--seeds", default="", help="comma-separated training seeds (default: the configs')"
    )
    ap.add_argument("--out", default="runs/fashion_mnist", help="parent of the run directories")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: runtime.threads' default)"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run")  # fmt: skip
    args = ap.parse_args()
    names = args.only.split(",") if args.only else METHODS
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None]
    results: dict[str, list] = {name: [] for name in names}
    start = time.perf_counter()
    for seed in seeds:
        for name in names:
            out = f"{args.out}/{name}" if seed is None else f"{args.out}/seed{seed}/{name}"
            # runtime.threads, not torch.set_num_threads: the run sets its own thread count
            overrides = [f"out={out}", f"runtime.threads={args.threads}", *args.set]
            if args.rounds:
                overrides.append(f"rounds={args.rounds}")
            if seed is not None:
                overrides.append(f"seed={seed}")
            cfg = load_config(CONFIGS / f"{name}.yaml", overrides)
            s = run(cfg, log=lambda *a: None)
            mean, p10 = 100 * s["test_accuracy"], 100 * s["test_accuracy_p10"]
            results[name].append((mean, p10, s["rounds"], s["wall_seconds"]))
            print(
                f"{name:<14} seed {cfg.seed}  test acc. {mean:5.1f} / {p10:5.1f} %  "
                f"{s['rounds']} rounds  {s['wall_seconds']:7.1f} s",
                flush=True,
            )
    total = time.perf_counter() - start
    per_seed = " | ".join(f"seed {s}" for s in seeds if s is not None)
    head = "| method | test accuracy % (mean / bottom decile) | rounds | wall s |"
    if len(seeds) > 1:
        head = f"| method | {per_seed} | mean over seeds | rounds | wall s per run |"
    print("\n" + head)
    print("|---" * (head.count("|") - 1) + "|")
    for name, rows in results.items():
        cells = [f"{m:.1f} / {p:.1f}" for m, p, _, _ in rows]
        if len(rows) > 1:
            avg = np.mean([(m, p) for m, p, _, _ in rows], axis=0)
            cells.append(f"{avg[0]:.1f} / {avg[1]:.1f}")
        wall = np.mean([w for *_, w in rows])
        print(f"| {LABELS.get(name, name)} | {' | '.join(cells)} | {rows[0][2]} | {wall:.0f} |")
    print(f"\ntotal {total:.1f} s ({total / 60:.1f} min) for {len(seeds) * len(names)} runs")


if __name__ == "__main__":
    main()

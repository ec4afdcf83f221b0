"""The FedEM paper's synthetic benchmark: every method of configs/synthetic/, one process.

Prints test accuracy (mean over clients and bottom decile) next to the paper's Table 2, the
unseen-client accuracies, cluster recovery for the clustering variant, and wall time per run
and in total (issue 4's goals: D-FedEM in under 60 s, the whole table in under 15 minutes).

    python benchmarks/synthetic_table.py [--rounds 200] [--only fedem,dfedem] [--markdown]
        [--set algorithm.loss_divisor=batch_size] [--out runs/synthetic_table]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gossip_pfl.config import load_config
from gossip_pfl.train import run

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "synthetic"
# Paper, Table 2 (synthetic, test accuracy %, average / bottom decile) and Table 3 (unseen).
PAPER = {
    "local": "65.7 / 58.4",
    "fedavg": "68.2 / 58.9",
    "fedprox": "68.2 / 59.0",
    "fedavg_plus": "68.9 / 60.2",
    "clustered": "69.1 / 59.0",
    "pfedme": "69.2 / 61.2",
    "apfl": "69.1 (20% sampling)",
    "fedem": "74.7 / 66.7",
    "dfedem": "73.8",
    "dfedem_one_peer": "-",
    "fedavg_unseen": "unseen 68.6",
    "fedavg_plus_unseen": "unseen 69.1",
    "fedem_unseen": "unseen 73.0",
    "fedem_clustered": "clusters 100%",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="override rounds")
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    ap.add_argument("--out", default="runs/synthetic_table", help="runs go to OUT/NAME")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(PAPER)
    rows, start = [], time.perf_counter()
    for name in names:
        overrides = [f"out={args.out}/{name}", *args.set]
        if args.rounds:
            overrides.append(f"rounds={args.rounds}")
        cfg = load_config(CONFIGS / f"{name}.yaml", overrides)
        s = run(cfg, log=lambda *a: None)
        ours = f"{100 * s['test_accuracy']:.1f} / {100 * s['test_accuracy_p10']:.1f}"
        if "unseen_test_accuracy" in s:
            ours += f" (unseen {100 * s['unseen_test_accuracy']:.1f})"
        if "cluster_recovery" in s:
            ours += f" (clusters {100 * s['cluster_recovery']:.0f}%)"
        rows.append((name, ours, PAPER.get(name, "-"), s["wall_seconds"]))
        print(
            f"{name:<18} {ours:<28} paper {rows[-1][2]:<22} {s['wall_seconds']:6.1f} s", flush=True
        )
    total = time.perf_counter() - start
    if args.markdown:
        print("\n| method | ours: test acc. % (mean / bottom decile) | paper | wall s |")
        print("|---|---|---|---|")
        for name, ours, paper, wall in rows:
            print(f"| {name} | {ours} | {paper} | {wall:.1f} |")
    print(f"total {total:.1f} s for {len(rows)} runs")


if __name__ == "__main__":
    main()

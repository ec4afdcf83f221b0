"""Fashion-MNIST server-rules study: FedLi-LU, FedLi-LS and five baselines, one process.

The FedLi paper's setting (docs/server_rules_fashion_mnist.md), reduced for a CPU: 100 clients,
Dirichlet(0.1) label split of 30% of Fashion-MNIST, 10 clients per round, one local epoch of
batch 32, weight decay 1e-3, the small CNN. Configs: configs/fashion_mnist/server_rules/.
Each method runs once per training seed (the partition stays data seed 0); prints one line per
run, a Markdown table (mean +- std over seeds of the final test accuracy, mean over clients,
and the final train loss, weighted over clients) and the total wall time.

    python benchmarks/server_rules_table.py                     # 7 methods x seeds 1,2,3
    python benchmarks/server_rules_table.py --seeds 1 --rounds 100 --only fedavg,fedli_lu
    python benchmarks/server_rules_table.py --set algorithm.lr=0.01 --only fedadam

Not part of the test suite (it trains for tens of minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from gossip_pfl.config import load_config
from gossip_pfl.train import run

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "fashion_mnist" / "server_rules"
#: the paper's column order
METHODS = ["fedli_lu", "fedli_ls", "fedadam", "fedavg", "fedprox", "scaffold", "fedexp"]
LABELS = {
    "fedli_lu": "FedLi-LU (untuned)",
    "fedli_ls": "FedLi-LS (untuned)",
    "fedadam": "FedAdam",
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "scaffold": "SCAFFOLD",
    "fedexp": "FedExP",
}

#: the server step of the rules without a ``rule.lr``
SERVER = {
    "fedli_lu": "capped Polyak (eta 1)",
    "fedli_ls": "1 (average)",
    "fedavg": "1 (average)",
    "fedprox": "1 (average)",
    "fedexp": "adaptive >= 1",
}


def _pm(values: list[float], fmt: str) -> str:
    v = np.asarray(values, dtype=float)
    if not np.isfinite(v).all():
        return "diverged" if len(v) == 1 else f"{int((~np.isfinite(v)).sum())}/{len(v)} diverged"
    sd = v.std(ddof=1) if len(v) > 1 else 0.0
    return f"{fmt.format(v.mean())} ± {fmt.format(sd)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated training seeds")
    ap.add_argument("--rounds", type=int, default=None, help="override rounds (configs: 300)")
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE overrides")
    ap.add_argument("--out", default="runs/server_rules", help="parent of the run directories")
    ap.add_argument("--json", default="", help="also write the per-run results to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.only.split(",") if args.only else METHODS
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {name: [] for name in names}
    start = time.perf_counter()
    for seed in seeds:
        for name in names:
            overrides = [f"out={args.out}/seed{seed}/{name}", f"seed={seed}", *args.set]
            if args.rounds:
                overrides.append(f"rounds={args.rounds}")
            cfg = load_config(CONFIGS / f"{name}.yaml", overrides)
            try:
                s = run(cfg, log=lambda *a: None)
                acc, loss = 100 * s["test_accuracy"], s["train_loss"]
                rounds, wall = s["rounds"], s["wall_seconds"]
            except Exception as err:  # a diverged run (non-finite parameters) stops the trainer
                print(f"{name:<9} seed {seed}  failed: {str(err).splitlines()[0][:120]}")
                acc, loss, rounds, wall = math.nan, math.nan, cfg.rounds, math.nan
            results[name].append(
                {"seed": seed, "test_accuracy": acc, "train_loss": loss, "rounds": rounds,
                 "wall_seconds": wall, "client_lr": cfg.algorithm.lr, "server_lr": cfg.rule.lr}
            )  # fmt: skip
            print(
                f"{name:<9} seed {seed}  test acc. {acc:5.2f} %  train loss {loss:.4f}  "
                f"{rounds} rounds  {wall:6.1f} s",
                flush=True,
            )
    total = time.perf_counter() - start
    print(f"\n{len(seeds)} seeds ({', '.join(map(str, seeds))}), mean ± std over seeds\n")
    print("| method | client lr | server step | test accuracy % | train loss | rounds | s / run |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        r0 = rows[0]
        server = SERVER.get(name, "-") if r0["server_lr"] is None else f"{r0['server_lr']:g}"
        client = "Armijo" if name == "fedli_ls" else f"{r0['client_lr']:g}"
        wall = np.nanmean([r["wall_seconds"] for r in rows])
        # "untuned": the config's own steps; a --set of a step is a tuning (FedLi-LS's client
        # step is its line search's)
        steps = ("line_search.",) if name == "fedli_ls" else ("algorithm.lr=", "rule.lr=")
        tuned = any(s.startswith(steps) for s in args.set)
        label = LABELS.get(name, name)
        if tuned:
            label = label.replace(" (untuned)", "")
        print(
            f"| {label} | {client} | {server} "
            f"| {_pm([r['test_accuracy'] for r in rows], '{:.2f}')} "
            f"| {_pm([r['train_loss'] for r in rows], '{:.4f}')} | {r0['rounds']} | {wall:.0f} |"
        )
    print(f"\ntotal {total:.1f} s ({total / 60:.1f} min) for {len(seeds) * len(names)} runs, "
          f"{args.threads} torch thread(s)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "total_s": total}, indent=1))


if __name__ == "__main__":
    main()

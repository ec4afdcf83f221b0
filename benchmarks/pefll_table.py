"""The PeFLL study on Fashion-MNIST: PeFLL, FedAvg, FedEM, pFedMe and Local from
configs/fashion_mnist/pefll/, test accuracy on seen and unseen clients and bytes per round, and
the descriptor analysis (Spearman correlation between clients' label-distribution distance and
descriptor distance on Dirichlet(0.1) clients). Writes a Markdown table.

    python benchmarks/pefll_table.py --rounds 100 --seeds 1234,1235,1236 --out runs/pefll_table
    python benchmarks/pefll_table.py --only descriptors --rounds 100
    python benchmarks/pefll_table.py --only pefll,fedavg --rounds 20 --seeds 1234

Each run is one process (one thread: the rounding of the convolutions follows the thread count).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from gossip_pfl.config import load_config
from gossip_pfl.train import run

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "fashion_mnist" / "pefll"
METHODS = ["pefll", "fedavg", "fedem", "pfedme", "local"]
LABELS = {"pefll": "PeFLL", "fedavg": "FedAvg", "fedem": "FedEM (M = 3)", "pfedme": "pFedMe",
          "local": "Local"}  # fmt: skip


def quiet(*_a, **_k) -> None:
    pass


def one_run(method: str, seed: int, rounds: int, out: Path) -> dict:
    """One config at one training seed; the summary plus bytes per round from metrics.jsonl."""
    folder = out / f"{method}_s{seed}"
    done = folder / "result.json"  # a finished run is not repeated: seeds can run in parallel
    if done.is_file() and json.loads(done.read_text()).get("rounds") == rounds:
        return json.loads(done.read_text())
    cfg = load_config(CONFIGS / f"{method}.yaml", [f"seed={seed}", f"rounds={rounds}",
                      f"eval.every={rounds}", f"out={folder}", "runtime.device=cpu"])  # fmt: skip
    t0 = time.perf_counter()
    summary = run(cfg, log=quiet)
    last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
    result = {
        "rounds": rounds,
        "test": summary["test_accuracy"],
        "unseen": summary.get("unseen_test_accuracy", float("nan")),
        "bytes_per_round": last["model_bytes"] / rounds,
        "seconds": time.perf_counter() - t0,
    }
    done.write_text(json.dumps(result) + "\n")
    return result


def descriptor_analysis(rounds: int, seed: int, out: Path, alpha: float = 0.1) -> dict:
    """Spearman's rho between the pairwise L1 distance of the clients' label distributions and
    the Euclidean distance of their descriptors (all training data), before and after training
    PeFLL on a Dirichlet(alpha) split (no unseen clients)."""
    from scipy.stats import spearmanr

    from gossip_pfl.pefll_run import PeFLLRun

    cfg = load_config(CONFIGS / "pefll.yaml", [
        f"seed={seed}", f"rounds={rounds}", f"eval.every={rounds}", f"out={out / 'descriptors'}",
        "data.unseen_fraction=0.0", "runtime.device=cpu", "pefll.descriptor_batch=6",
        # >= 10 samples a client (6 for training): Dirichlet(0.1) leaves some clients tiny
        f"data.partition={{kind: dirichlet, alpha: {alpha}, min_size: 10}}",
    ])  # fmt: skip
    workload = PeFLLRun(cfg, log=quiet)
    ds = workload.dataset
    hist = np.stack([np.bincount(ds.clients[i].y_train, minlength=ds.num_classes)
                     for i in workload.train_ids]).astype(float)  # fmt: skip
    hist /= hist.sum(1, keepdims=True)
    label_dist = np.abs(hist[:, None] - hist[None]).sum(-1)
    iu = np.triu_indices(len(hist), 1)

    def rho() -> float:
        v = workload.client_descriptors()
        desc_dist = np.linalg.norm(v[:, None] - v[None], axis=-1)
        return float(spearmanr(label_dist[iu], desc_dist[iu]).statistic)

    before = rho()
    summary = workload.run()
    return {"before": before, "after": rho(), "rounds": rounds, "clients": len(hist),
            "test": summary["test_accuracy"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seeds", default="1234,1235,1236")
    ap.add_argument("--only", default=",".join(METHODS + ["descriptors"]))
    ap.add_argument("--out", default="runs/pefll_table")
    ap.add_argument("--table", default=None, help="write the Markdown table here too")
    ap.add_argument(
        "--cached",
        action="store_true",
        help="collect finished runs from --out only (missing seeds are skipped)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    only = args.only.split(",")
    lines = [f"{args.rounds} rounds, seeds {', '.join(map(str, seeds))}; mean (min-max) over "
             "seeds", "",
             "| method | seen test acc. | unseen test acc. | bytes per round | s per run |",
             "|---|---|---|---|---|"]  # fmt: skip
    # --cached: the descriptor analysis of the run that wrote the folder's results.json
    earlier = out / "results.json"
    previous = json.loads(earlier.read_text()) if args.cached and earlier.is_file() else {}
    results = {}
    for method in (m for m in METHODS if m in only):
        if args.cached:
            files = [out / f"{method}_s{s}" / "result.json" for s in seeds]
            res = [json.loads(f.read_text()) for f in files if f.is_file()]
            if not res:
                continue
        else:
            res = [one_run(method, s, args.rounds, out) for s in seeds]
        results[method] = res
        print(method, json.dumps(res), flush=True)

        def cell(key, res=res):
            vals = np.array([r[key] for r in res]) * 100
            return f"{vals.mean():.1f} ({vals.min():.1f}-{vals.max():.1f})"

        mb = np.mean([r["bytes_per_round"] for r in res]) / 2**20
        secs = np.mean([r["seconds"] for r in res])
        n = f" ({len(res)} seed{'s' * (len(res) > 1)})" if len(res) < len(seeds) else ""
        lines.append(f"| {LABELS[method]}{n} | {cell('test')} | {cell('unseen')} | "
                     f"{mb:.1f} MiB | {secs:.0f} |")  # fmt: skip
    if not results:  # (descriptors only: no method table)
        lines = []
    d = None
    if "descriptors" in only and args.cached:
        d = previous.get("descriptors")
    elif "descriptors" in only:
        d = descriptor_analysis(args.rounds, seeds[0], out)
    if d:
        results["descriptors"] = d
        print("descriptors", json.dumps(d), flush=True)
        lines += ["", f"Descriptor analysis (Dirichlet(0.1), {d['clients']} clients, seed "
                  f"{seeds[0]}): Spearman rho between label-distribution distance and "
                  f"descriptor distance {d['before']:.3f} before training, {d['after']:.3f} "
                  f"after {d['rounds']} rounds (test accuracy {100 * d['test']:.1f})."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.table:
        Path(args.table).write_text(text)


if __name__ == "__main__":
    main()

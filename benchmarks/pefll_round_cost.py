"""What a PeFLL round costs against a FedAvg round with the same client model (LeNet), the same
participants and the same k local steps: seconds per round (local work + communication,
evaluation excluded) and bytes per round, from configs/fashion_mnist/pefll/.

    python benchmarks/pefll_round_cost.py [--rounds 5] [--steps 20] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from gossip_pfl.config import load_config
from gossip_pfl.models import build_model
from gossip_pfl.runtime.participation import participant_count
from gossip_pfl.train import run

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "fashion_mnist" / "pefll"


def seconds_per_round(method: str, rounds: int, steps: int, out: Path) -> tuple[float, float]:
    """(seconds, bytes) per round of ``method`` with k = ``steps``."""
    key = "pefll.local_steps" if method == "pefll" else "algorithm.local_steps"
    cfg = load_config(CONFIGS / f"{method}.yaml", [f"rounds={rounds}", f"eval.every={rounds}",
                      f"{key}={steps}", f"out={out}", "runtime.device=cpu"])  # fmt: skip
    run(cfg, log=lambda *a, **k: None)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return (last["seconds_local"] + last["seconds_exchange"]) / rounds, last["model_bytes"] / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    best = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for method in ("fedavg", "pefll"):
                out = Path(tmp) / f"{method}{r}"
                s, b = seconds_per_round(method, args.rounds, args.steps, out)
                best[method] = min(best.get(method, (s, b)), (s, b))
    (sa, ba), (sp, bp) = best["fedavg"], best["pefll"]
    print(f"k = {args.steps}, {args.rounds} rounds, best of {args.repeats}:")
    print(f"  FedAvg  {sa:.3f} s/round  {ba / 2**20:.2f} MiB/round")
    print(f"  PeFLL   {sp:.3f} s/round  {bp / 2**20:.2f} MiB/round")
    print(f"  ratio   {sp / sa:.2f}x time  {bp / ba:.2f}x bytes")
    # the paper's count for FedAvg: the model down to and back from each participant only
    # (the runtime's star also sends the new model to every client that sat out)
    cfg = load_config(CONFIGS / "fedavg.yaml")
    S = participant_count(cfg.participation, 90)
    P = sum(p.numel() for p in build_model("lenet", (1, 28, 28), 10).parameters())
    up_down = 2 * S * P * 4
    print(
        f"  FedAvg to and from its {S} participants only: {up_down / 2**20:.2f} MiB/round; "
        f"PeFLL {bp / up_down:.2f}x that"
    )


if __name__ == "__main__":
    main()

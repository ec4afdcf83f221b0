"""FedEM rounds on the Fashion-MNIST study's CNN: one call over all peers vs cache-sized calls.

The study's FedEM config (100 clients, M = 3, narrow FedEM CNN, batch 32): median seconds of a
round of local work (E-step + one local epoch) and of the E-step alone, with the whole step in
one batched call (``runtime.step_chunk`` and ``eval.chunk`` large) and with the CNN's CPU hint
(about 8 MiB of first-conv output per call, the default). Needs the Fashion-MNIST files.

    python benchmarks/bench_cnn_calls.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from gossip_pfl.config import load_config
from gossip_pfl.train import Trainer

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "fashion_mnist" / "fedem.yaml"


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{'calls':<34} {'samples/call':>12} {'round s':>8} {'E-step s':>9}")
    base = None
    for label, step_chunk, eval_chunk in (
        ("one call over all peers", 1 << 30, 1 << 30),
        ("cache-sized (model hint, default)", 0, 0),
    ):
        overrides = ["out=runs/bench_cnn_calls", f"runtime.step_chunk={step_chunk}"]
        cfg = load_config(CONFIG, overrides + [f"eval.chunk={eval_chunk}"])
        trainer = Trainer(cfg, log=lambda *a: None)
        trainer.local_work(0)  # warm-up
        theta = trainer.nodes[: len(trainer.peers)]
        rounds = [timed(trainer.local_work, t) for t in range(1, args.rounds + 1)]
        estep = [timed(trainer.train_losses, theta) for _ in range(args.rounds)]
        r, e = statistics.median(rounds), statistics.median(estep)
        base = base or r
        per_call = "all" if step_chunk else str(trainer.step_chunk)
        print(f"{label:<34} {per_call:>12} {r:>8.2f} {e:>9.2f}   ({base / r:.1f}x)")


if __name__ == "__main__":
    main()

"""Batched local work against per-peer loops: 300 peers, a linear model, one local epoch.

Three ways to do the same round (same minibatches, same SGD, same parameters at the end):
  * classic per-peer loop: every peer its own nn.Module and torch.optim.SGD, peers one after
    the other (how the released FedEM code and most FL simulators train);
  * the runtime's fallback (runtime.batching: loop): batched data and optimizer, the model
    called once per peer and component;
  * the runtime's batched path: every peer and component in one call.
Goal (issue 3): batched at least 10x faster than the per-peer loop.

    python benchmarks/bench_local.py [--peers 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from gossip_pfl.config import load_config
from gossip_pfl.data import load_dataset
from gossip_pfl.train import Trainer


def classic_loop(trainer: Trainer, t: int) -> None:
    """One D-FedEM round of local work, peer by peer and component by component, each with its
    own nn.Module and torch.optim.SGD: E-step on the peer's data, pi update, then one local
    epoch per component on the q-weighted loss (M = 1: plain local SGD)."""
    import torch
    import torch.nn.functional as F

    from gossip_pfl.models import Linear
    from gossip_pfl.runtime.data import round_batches

    a = trainer.cfg.algorithm
    peers = trainer.train_ids[trainer.peers]
    idx, weight = round_batches(trainer.counts, peers, trainer.cfg.seed, t, a.batch_size)
    model = Linear(trainer.dataset.input_shape, 1)
    for i in range(len(trainer.peers)):
        n_i = int(trainer.counts[i])
        x_all, y_all = trainer.train.x[i, :n_i], trainer.train.y[i, :n_i].float()
        q = torch.ones(1, n_i)
        if trainer.M > 1:  # E-step with the components held before the update
            with torch.no_grad():
                losses = []
                for m in range(trainer.M):
                    _load(model, trainer, trainer.nodes[i, m])
                    logits = model(x_all)[:, 0]
                    losses.append(
                        F.binary_cross_entropy_with_logits(logits, y_all, reduction="none")
                    )
                log_pi = torch.log(trainer.personal["pi"][i])
                q = torch.softmax(log_pi[:, None] - torch.stack(losses), dim=0)
                trainer.personal["pi"][i] = q.mean(1)
        for m in range(trainer.M):
            _load(model, trainer, trainer.nodes[i, m])
            opt = torch.optim.SGD(model.parameters(), lr=a.lr * float(trainer.lr_scale[i]))
            for s in range(idx.shape[0]):
                n = int(weight[s, i].sum())
                if n == 0:
                    break
                b = torch.as_tensor(idx[s, i, :n])
                opt.zero_grad()
                logits = model(x_all[b])[:, 0]
                per = F.binary_cross_entropy_with_logits(logits, y_all[b], reduction="none")
                # the batch's mean (loss_divisor: batch, the default), or the sum over B
                div = n if a.loss_divisor == "batch" else a.batch_size
                ((q[m, b] * per).sum() / div).backward()
                opt.step()
            with torch.no_grad():
                trainer.nodes[i, m].copy_(trainer.layout.flatten(model))


def _load(model, trainer: Trainer, flat) -> None:
    import torch

    params = trainer.layout.unflatten(flat)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def make_trainer(data, components: int, batching: str) -> Trainer:
    cfg = load_config(
        base={
            "algorithm": {"name": "dfedem", "components": components, "lr": 0.1},
            "schedule": {"graph": "ring", "weights": "metropolis"},
            "runtime": {"batching": batching},
            "out": "runs/bench_local",
        }
    )
    return Trainer(cfg, dataset=data, log=lambda *a: None)


def seconds_per_round(step, trainer: Trainer, rounds: int) -> float:
    """Median over rounds 1..R (round 0 warms up) of one round of local work."""
    times = []
    for t in range(rounds + 1):
        t0 = time.perf_counter()
        step(trainer, t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    data = load_dataset("synthetic", n_clients=args.peers, n_test=10)
    print(
        f"# {args.peers} peers, synthetic data (d = 150, {data.sizes().sum()} samples), linear "
        "model, batch 128, one local epoch per round; median seconds per round"
    )
    print(f"{'M':>2} {'path':<52} {'s/round':>8} {'speed-up':>9}")
    for m in (1, 3):
        results = {}
        for name, batching, step in (
            ("classic per-peer loop (nn.Module + optim.SGD)", "loop", classic_loop),
            ("runtime fallback (per-peer model calls)", "loop", Trainer.local_work),
            ("runtime batched (model's batched layers)", "vmap", Trainer.local_work),
        ):
            trainer = make_trainer(data, m, batching)
            results[name] = (seconds_per_round(step, trainer, args.rounds), trainer)
        base = results["classic per-peer loop (nn.Module + optim.SGD)"]
        for name, (sec, trainer) in results.items():
            same = np.allclose(trainer.shared_parameters(), base[1].shared_parameters(),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
            note = "" if same else "  (parameters differ!)"
            print(f"{m:>2} {name:<52} {sec:>8.3f} {base[0] / sec:>9.1f}{note}")


if __name__ == "__main__":
    main()

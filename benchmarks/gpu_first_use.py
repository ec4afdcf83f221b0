"""What a fresh process pays the first time it calls each operation, on a run of the synthetic
D-FedEM: a GPU loads a kernel's code at its first launch (CUDA's lazy loading), and the
fourth lease measured 1.3 to 156 ms for the first call of some operations against 0.1 to
0.5 ms after (docs/speed-notes.md). A fresh run's 200 rounds took 0.5 to 0.7 s longer than the
same rounds run again in one process; this says which operations that is.

    python benchmarks/gpu_first_use.py [--rounds 3] [--top 25] [--set KEY=VALUE ...]

Every operation the run dispatches (after the trainer's setup, through a ``TorchDispatchMode``)
whose name and dtypes are new is timed alone, the device synchronised before and after; the
calls after it are not timed. The steps run eagerly (``runtime.cuda_graphs: false``): a graph
holds the same kernels, and a capture cannot be synchronised inside. Then, in the same
process, the same rounds and an evaluation are timed again. Prints the operations by their
first call's milliseconds, where each was first called (round 0, 1, ... or the evaluation),
and the totals. ``--device cpu`` checks the script on a machine without a GPU (the times
are then a CPU's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_ops import one_round  # (run from benchmarks/: its folder is on the path)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gossip_pfl.config import load_config
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent


class FirstCalls(TorchDispatchMode):
    """Times the first call of each (operation, dtypes), the device synchronised around it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.where = "setup"
        self.first: dict[tuple, tuple[float, str]] = {}  # (op, dtypes) -> (seconds, where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        dtypes = tuple(sorted({str(v.dtype)[6:] for v in leaves if isinstance(v, torch.Tensor)}))
        key = (str(func.overloadpacket).removeprefix("aten."), dtypes)
        if key in self.first:
            return func(*args, **kwargs)
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        self.first[key] = (time.perf_counter() - t0, self.where)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="operations listed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_first_use.py: no CUDA device here (--device cpu checks the script)",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    cfg = load_config(ROOT / "configs/synthetic/dfedem.yaml",
                      [f"runtime.device={args.device}", "runtime.cuda_graphs=false",
                       "out=runs/gpu_first_use", *args.set])  # fmt: skip
    tr = Trainer(cfg, log=lambda *a: None)
    with FirstCalls(torch.device("cpu")):  # the mode's own first use imports for about 1 s
        torch.ones(1).add(1)
    mode = FirstCalls(tr.device)

    def timed(where: str, fn) -> float:
        mode.sync()
        t0 = time.perf_counter()
        mode.where = where
        fn()
        mode.sync()
        return time.perf_counter() - t0

    with mode:
        fresh = [timed(f"round {t}", lambda t=t: one_round(tr, t)) for t in range(args.rounds)]
        fresh.append(timed("evaluation", lambda: tr.metrics_row(args.rounds - 1)))
    again = [timed("again", lambda t=t: one_round(tr, t)) for t in range(args.rounds)]
    again.append(timed("again", lambda: tr.metrics_row(args.rounds - 1)))
    firsts = sorted(mode.first.items(), key=lambda kv: -kv[1][0])
    print(f"# {tr.device} ({torch.cuda.get_device_name() if tr.device.type == 'cuda' else 'cpu'}),"
          f" torch {torch.__version__}; {len(firsts)} operations first called here")  # fmt: skip
    print("| operation | dtypes | first call ms | where |")
    print("|---|---|---|---|")
    for (op, dtypes), (s, where) in firsts[: args.top]:
        print(f"| {op} | {','.join(dtypes)} | {1e3 * s:.2f} | {where} |")
    total = sum(s for s, _ in mode.first.values())
    print(f"first calls, all: {1e3 * total:.1f} ms")
    names = [f"round {t}" for t in range(args.rounds)] + ["evaluation"]
    for name, a, b in zip(names, fresh, again):
        print(f"{name}: {1e3 * a:.1f} ms fresh (under the mode, first calls timed alone), "
              f"{1e3 * b:.1f} ms again (without it)")  # fmt: skip


if __name__ == "__main__":
    main()

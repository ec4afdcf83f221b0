"""The compiled CPU loops alone (``gossip_pfl/runtime/kernels.py``), on a real run's inputs:
the synthetic D-FedEM's round (``sgd_round``: E-step and SGD steps of all 300 peers) and its
evaluation (``mixture_scores`` over the 906 MB test split), against another commit's
kernels.py, alternating, with each loop's numbers checked against this tree's.

    python benchmarks/bench_kernels.py [--base 7ad379b] [--threads 1,2] [--repeats 9]

The inputs come from a run of configs/synthetic/dfedem.yaml: rounds 20 to 23's plans and
parameters, and the parameters after them. The base's kernels.py is imported from its
checkout under runs/bench_wall/ (bench_wall.py's, made once; compiled there once). Prints
one markdown row per loop and thread count: medians in ms, their ratio, and the largest
difference from this tree's outputs (0: the same bits).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from bench_wall import worktree

from gossip_pfl.config import load_config
from gossip_pfl.runtime import kernels
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
# sgd_round's outputs (theta, q, new_pi); mixture_scores' (nll, correct)
WRITES = {"sgd_round": (0, 8, 11), "mixture_scores": (5, 6)}


def base_kernels(rev: str):
    """kernels.py of ``rev``'s checkout (bench_wall's), imported as a module of its own. Its
    loops cache in a folder of their own: a cache beside the checkout's file names this
    module, and a run of the checkout (bench_wall's base) then failed to load its loops and
    ran the torch operations instead, without a word."""
    import numba

    path = worktree(rev) / "gossip_pfl" / "runtime" / "kernels.py"
    spec = importlib.util.spec_from_file_location(f"kernels_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's cache finds a loop's module by name
    kept = numba.config.CACHE_DIR  # (read as the loops are decorated)
    numba.config.CACHE_DIR = str(ROOT / "runs" / "bench_kernels" / "numba-cache")
    try:
        spec.loader.exec_module(module)
    finally:
        numba.config.CACHE_DIR = kept
    return module


def capture(rounds: range) -> dict:
    """Each loop's (work, arguments) from a run: sgd_round's for ``rounds``, mixture_scores'
    on the test split after them."""
    cfg = load_config(ROOT / "configs/synthetic/dfedem.yaml", ["out=runs/bench_kernels/run"])
    tr = Trainer(cfg, log=lambda *a: None)
    calls: dict = {"sgd_round": [], "mixture_scores": []}
    plain = tr.forward._compiled
    now = [0]

    def keep(name, split, *args):
        if name == "sgd_round" and now[0] in rounds:
            copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
            calls[name].append((split.host_counts.copy(), copies))
        plain(name, split, *args)

    tr.forward._compiled = keep
    for t in range(rounds.stop):
        now[0] = t
        active = tr.sample(t)
        tr.local_work(t, active)
        tr.communicate(t, active)
    sp, L = tr.test, len(tr.peers)
    theta = tr.nodes[:L].contiguous().numpy()
    pi = tr.personal["pi"].float().contiguous().numpy()
    args = [theta, pi, sp.x.flatten(2).numpy(), sp.host_y, sp.host_counts, np.zeros(L), np.zeros(L)]
    calls["mixture_scores"].append((sp.host_counts, args))
    return calls


def call(module, name: str, threads: int, work, args) -> tuple[float, list]:
    """One timed call on fresh copies of the arrays the loop writes; (seconds, outputs)."""
    args = [a.copy() if i in WRITES[name] else a for i, a in enumerate(args)]
    # an older kernel may take fewer arguments (sgd_round before affine and shift): the
    # arguments added since come last, and run() adds two (lo, hi) before them
    args = args[: getattr(module, name).py_func.__code__.co_argcount - 2]
    t0 = time.perf_counter()
    module.run(getattr(module, name), threads, work, *args)
    return time.perf_counter() - t0, [args[i] for i in WRITES[name]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the commit whose kernels.py to compare with")
    ap.add_argument("--threads", default="1,2", help="threads, comma-separated")
    ap.add_argument("--repeats", type=int, default=9, help="calls per loop, tree and threads")
    args = ap.parse_args()
    calls = capture(range(20, 24))
    trees = {"this tree": kernels}
    if args.base:
        trees[args.base] = base_kernels(args.base)
    print(
        f"| loop | threads | {' | '.join(f'{k} ms' for k in trees)} | ratio | largest difference |"
    )
    print("|---|---|" + "---|" * (len(trees) + 2))
    for name, cases in calls.items():
        want = [call(kernels, name, 1, *c)[1] for c in cases]
        for module in trees.values():  # compiled or loaded before the timing
            call(module, name, 1, *cases[0])
        for threads in (int(t) for t in args.threads.split(",")):
            times: dict = {k: [] for k in trees}
            diff = 0.0
            for _ in range(args.repeats):
                for key, module in trees.items():  # alternating: drift weighs on both
                    for c, ref in zip(cases, want):
                        dt, out = call(module, name, threads, *c)
                        times[key].append(dt)
                        diff = max(diff, *(float(np.abs(o - r).max()) for o, r in zip(out, ref)))
            # per call: sgd_round's cases are four rounds
            med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            ratio = f"{med['this tree'] / med[args.base]:.2f}" if args.base else ""
            cells = " | ".join(f"{m:.2f}" for m in med.values())
            print(f"| {name} | {threads} | {cells} | {ratio} | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

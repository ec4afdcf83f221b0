"""Two runs side by side: do they slow each other more than the cores they share explain?

Runs a config (by default the synthetic D-FedEM, configs/synthetic/dfedem.yaml; ``--rounds``
rounds, evaluated at the end) with ``gossip-pfl run`` alone and then two at once, with each
thread count in ``--threads`` (0: the default of gossip_pfl/runtime/threads.py, i.e. all the
cores this process may use when nothing else says otherwise). OMP_NUM_THREADS is removed from
the runs' environment, so runtime.threads alone decides; OpenMP's other variables pass through
(``OMP_WAIT_POLICY=ACTIVE`` or ``GOMP_SPINCOUNT=N`` before the command: idle threads spin).
Reports each run's ``wall_seconds`` and the slowdown of a pair against one run alone; with c
cores and t threads per run, sharing explains a slowdown of max(1, 2 t / c) at most.

    python benchmarks/bench_threads.py [--rounds 40] [--threads 1,0] [--config C] [--set K=V]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gossip_pfl.runtime.threads import available_cores, default_threads

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "synthetic" / "dfedem.yaml"


def start(out: Path, rounds: int, threads: int, config=CONFIG, sets=()) -> subprocess.Popen:
    # the caller's settings first: the rounds, device and threads this table reports win
    cmd = [sys.executable, "-m", "gossip_pfl.cli", "run", str(config),
           *(a for kv in sets for a in ("--set", kv)), "--set", f"rounds={rounds}",
           "--set", f"eval.every={rounds}", "--set", "runtime.device=cpu",
           "--set", f"runtime.threads={threads}", "--out", str(out), "--quiet"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def wall(procs: list[subprocess.Popen], outs: list[Path]) -> list[float]:
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"run failed: {err.strip().splitlines()[-1]}")
    return [json.loads((o / "summary.json").read_text())["wall_seconds"] for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", default="1,0", help="thread counts per run (0: default)")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    cores = available_cores()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    waits = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    config = Path(args.config).resolve()  # the runs start in the repository's root
    print(f"# {cores} cores in this process's affinity mask; {' '.join([args.config, *args.set])}"
          f", {args.rounds} rounds; wall_seconds per run; idle OpenMP threads: "
          f"{waits or 'the command default (OMP_WAIT_POLICY=PASSIVE)'}")  # fmt: skip
    print("| threads per run | alone s | side by side s (each) | slowdown | sharing explains |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for k, threads in enumerate(map(int, args.threads.split(","))):
            t = threads or default_threads(env)[0]
            run = (args.rounds, threads, config, args.set)
            alone = wall([start(Path(tmp, f"a{k}"), *run)], [Path(tmp, f"a{k}")])
            outs = [Path(tmp, f"p{k}_{i}") for i in range(2)]
            pair = wall([start(o, *run) for o in outs], outs)
            slow = max(pair) / alone[0]
            label = f"{t}" + (" (default)" if threads == 0 else "")
            print(f"| {label} | {alone[0]:.2f} | {pair[0]:.2f}, {pair[1]:.2f} | {slow:.2f}x | "
                  f"<= {max(1.0, 2 * t / cores):.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()

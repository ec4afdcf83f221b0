"""The time an aggregation rule adds to a FedAvg round: 300 clients, synthetic data, a linear
model, one local epoch (configs/synthetic/fedavg.yaml), one process, CPU.

Every method is a Trainer on the same data and setting; only the rule (or the algorithm that
names it) changes. The methods take their rounds interleaved (round t of every method, in an
order rotated each round, before round t + 1 of any), so a slow patch of a shared machine hits
them all alike, in --blocks blocks with freshly built trainers (so no method keeps a lucky or
unlucky memory placement). After --warmup rounds per block, each round is timed in two parts,
as ``Trainer.run`` does, by the wall clock and by this thread's CPU time (``time.thread_time``,
which leaves out the time other processes hold the core; the garbage collector is held off
inside the timed steps and run between rounds):

  * local work: ``sample(t)`` + ``local_work(t, active)`` (client steps, the round-start copy a
    rule needs, the scalars and tensors it reads);
  * communicate: ``communicate(t, active)`` (the star's phases with the hub's rule between).

The tables give medians over all measured rounds: round time (local + communicate) and its
ratio to FedAvg's (target: a server rule adds under 5%), and the communicate step alone with
its ratio. FedLi-LS's clients search a step size by backtracking (Armijo), so its extra time is
shown as "client line search", not as rule overhead; SCAFFOLD's clients correct each step by a
control variate and send it beside theta: its round (client correction + rule) and its
communicate step (rule, twice the message) are both shown. Two settings: every client in every
round, and ``participation: 30`` (30 of 300 clients a round).

Seven trainers share the process, and with glibc's default malloc they disturb each other:
its mmap and trim thresholds move with the sizes freed, so what one trainer allocates (the line
search's trial copies most) decides whether another's big per-step temporaries (the batch
gather: 23 MB at 300 clients) stay in the heap or go back to the OS and fault in again on every
step. Measured here: thousands of page faults a round for SCAFFOLD and FedLi-LS (and at times
FedAvg), SCAFFOLD then 20-50% slower than FedAvg; alone in a process neither faults. So the
script reruns itself under GLIBC_TUNABLES with a fixed mmap threshold (256 MiB) and trim
threshold (1 GiB), as one trainer per process would see it; --system-malloc keeps the default.
The "faults" column shows minor page faults per round.

    OMP_NUM_THREADS=1 python benchmarks/bench_rules.py [--rounds 20] [--blocks 3] [--warmup 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from gossip_pfl.config import load_config
from gossip_pfl.data import load_dataset
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "configs" / "synthetic" / "fedavg.yaml"

#: glibc's malloc with a fixed mmap threshold and trim threshold (the default; --system-malloc)
FIXED_MALLOC = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824"

#: label -> (--set overrides on fedavg.yaml, what the extra time is)
METHODS = {
    "fedavg": ([], "reference (rule average)"),
    "fedavgm": (["algorithm.name=fedavgm"], "rule"),
    "fedadam": (["algorithm.name=fedadam"], "rule"),
    "fedexp": (["algorithm.name=fedexp"], "rule"),
    "fedli_lu": (["algorithm.name=fedli_lu"], "rule"),
    "fedli_ls (step one)": (["algorithm.name=fedli_ls", "rule.step=one"], "client line search"),
    "scaffold": (["algorithm.name=scaffold"], "client correction + rule"),
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_trainers(data, participation, overrides) -> dict[str, Trainer]:
    trainers = {}
    for label, (sets, _) in METHODS.items():
        cfg = load_config(
            BASE,
            [
                *sets,
                f"participation={participation}",
                "runtime.device=cpu",
                "out=runs/bench_rules",
                *overrides,
            ],
        )
        trainers[label] = Trainer(cfg, dataset=data, log=lambda *a: None)
    return trainers


def _minor_faults() -> int:
    """Page faults this thread has taken (first touches of memory the allocator got from the
    OS), where Linux counts them per thread; else the process's."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def measure(trainers: dict[str, Trainer], rounds: int, warmup: int) -> dict[str, dict]:
    """Round by round, every method once (rotated order): per method and measured round, the
    wall and CPU seconds of the local work and of the communicate step, and the page faults."""
    labels = list(trainers)
    clocks = ("local", "comm", "cpu_local", "cpu_comm", "faults")
    times = {k: {c: [] for c in clocks} for k in labels}
    gc.collect()
    gc.freeze()  # what exists now is never scanned again; tensors go by reference counting
    gc.disable()  # no collector pass inside a timed step
    try:
        for t in range(warmup + rounds):
            shift = t % len(labels)
            for label in labels[shift:] + labels[:shift]:
                tr = trainers[label]
                f0 = _minor_faults()
                c0, t0 = time.thread_time(), time.perf_counter()
                active = tr.sample(t)
                tr.local_work(t, active)
                c1, t1 = time.thread_time(), time.perf_counter()
                tr.communicate(t, active)
                c2, t2 = time.thread_time(), time.perf_counter()
                f2 = _minor_faults()
                if t >= warmup:
                    tm = times[label]
                    tm["local"].append(t1 - t0)
                    tm["comm"].append(t2 - t1)
                    tm["cpu_local"].append(c1 - c0)
                    tm["cpu_comm"].append(c2 - c1)
                    tm["faults"].append(f2 - f0)
            gc.collect()  # between rounds, untimed
    finally:
        gc.enable()
        gc.unfreeze()
    return times


def _medians(tm: dict, cpu: bool) -> tuple[float, float, list[float]]:
    local, comm = (tm["cpu_local"], tm["cpu_comm"]) if cpu else (tm["local"], tm["comm"])
    rounds = [a + b for a, b in zip(local, comm)]
    return statistics.median(rounds), statistics.median(comm), rounds


def report(title: str, times: dict[str, dict]) -> None:
    """One row per method: wall-clock and CPU-time (this thread's) medians and ratios."""
    n_rounds = len(times["fedavg"]["local"])
    print(f"\n## {title}: {n_rounds} measured rounds per method, milliseconds")
    print(
        f"{'':<20} {'--------------- wall clock ---------------':>44}   "
        f"{'------- CPU time (thread) -------':>33}"
    )
    print(
        f"{'method':<20} {'round':>8} {'ratio':>6} {'paired':>7} {'comm':>7} {'ratio':>6} "
        f"{'+round':>7}   {'round':>8} {'ratio':>6} {'comm':>7} {'ratio':>6} {'faults':>7}  "
        "extra time is"
    )
    ref = {cpu: _medians(times["fedavg"], cpu) for cpu in (False, True)}
    for label, tm in times.items():
        (rnd, comm, rounds), (crnd, ccomm, _) = _medians(tm, False), _medians(tm, True)
        (b_rnd, b_comm, b_rounds), (cb_rnd, cb_comm, _) = ref[False], ref[True]
        # paired: this round over FedAvg's same round (they ran side by side), then the median
        paired = statistics.median(r / b for r, b in zip(rounds, b_rounds))
        print(
            f"{label:<20} {rnd * 1e3:>8.2f} {rnd / b_rnd:>6.3f} {paired:>7.3f} "
            f"{comm * 1e3:>7.3f} {comm / b_comm:>6.2f} {(rnd - b_rnd) * 1e3:>+7.2f}   "
            f"{crnd * 1e3:>8.2f} {crnd / cb_rnd:>6.3f} {ccomm * 1e3:>7.3f} "
            f"{ccomm / cb_comm:>6.2f} {statistics.median(tm['faults']):>7.0f}  "
            f"{METHODS[label][1]}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="measured rounds per method and block")
    ap.add_argument(
        "--blocks",
        type=int,
        default=3,
        help="blocks of rounds, each with freshly built trainers (pooled medians)",
    )
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first, per block")
    ap.add_argument(
        "--participation",
        type=int,
        nargs="*",
        default=[300, 30],
        help="clients per round, one table each (default: 300 30)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra override for every method (e.g. algorithm.local_epochs=2)",
    )
    ap.add_argument(
        "--system-malloc",
        action="store_true",
        help="keep glibc's default (dynamic) mmap and trim thresholds; by default "
        "the script reruns itself with fixed ones (see the module docstring)",
    )
    args = ap.parse_args()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not args.system_malloc and FIXED_MALLOC not in tunables:
        env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, FIXED_MALLOC]))}
        os.execvpe(sys.executable, [sys.executable, *sys.argv], env)  # read at process start
    torch.set_num_threads(1)
    base = load_config(BASE)
    # the rounds never touch the test split: a small one keeps the data quick to build
    data = load_dataset(base.data.name, **{**base.data.options, "n_test": 10})
    n = len(data.clients)
    print(
        f"# machine: {cpu_model()}, {os.cpu_count()} logical CPUs, torch "
        f"{torch.__version__} with {torch.get_num_threads()} thread(s) "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"load average {os.getloadavg()[0]:.2f} at start; GLIBC_TUNABLES="
        f"{os.environ.get('GLIBC_TUNABLES', 'unset')}"
    )
    print(
        f"# {n} clients, synthetic data (d = 150, {data.sizes().sum()} training samples), "
        f"linear model, lr 0.1, batch 128, one local epoch; rule defaults (fedli_ls: step "
        f"one); {args.blocks} blocks of {args.rounds} rounds, each with fresh trainers and "
        f"{args.warmup} warm-up rounds; medians over all measured rounds"
    )
    print(
        "# round = sample + local_work + communicate, comm = communicate alone; ratio = "
        "median / FedAvg's median; paired = median over rounds of (this round / FedAvg's "
        "same round); +round = median - FedAvg's (wall); CPU time = this thread's "
        "(time.thread_time: not the time other processes hold the core); faults = minor page "
        "faults per round (median)"
    )
    start = time.perf_counter()
    for k in args.participation:
        times = None
        for _ in range(args.blocks):  # fresh trainers each block: new buffers, new placement
            trainers = make_trainers(data, k, args.overrides)
            block = measure(trainers, args.rounds, args.warmup)
            del trainers
            if times is None:
                times = block
            else:
                for label, tm in block.items():
                    for clock, values in tm.items():
                        times[label][clock] += values
        report(f"participation {k} of {n}", times)
    print(
        f"\n# {time.perf_counter() - start:.0f} s in all; load average "
        f"{os.getloadavg()[0]:.2f} at the end"
    )


if __name__ == "__main__":
    main()

"""Operations per round, a figure that does not depend on the machine: how many aten operators
the host dispatches for one round (local work + communicate) and for one evaluation, counted by
torch.profiler, next to the seconds the same round takes here.

Two workloads: the synthetic D-FedEM (configs/synthetic/dfedem.yaml: 300 peers, M = 3, linear
model) and the Fashion-MNIST FedEM CNN (configs/fashion_mnist/fedem.yaml; skipped without the
image files). ``ops`` counts the aten operators called from Python (each one a dispatch);
``compute ops`` leaves out those that only make a view (no kernel on any device: about the
kernel launches on a GPU); ``all ops`` adds the operators they call in turn; ``waits`` counts
those that would make the host wait for a GPU (:class:`Waits`: a value read back, a
nonzero, a boolean mask), in a round after the timed ones.

    OMP_NUM_THREADS=1 python benchmarks/bench_ops.py [--rounds 5] [--only synthetic]
        [--set KEY=VALUE ...] [--json runs/bench_ops.json] [--gpu-layout]

``--gpu-layout`` counts, on a CPU, what a GPU's round dispatches: the dense layout (every
peer in every step, the evaluation in wide pieces), the torch operations instead of the
compiled loops, the GPU's forms (the plan reordered, the convolutions as products, the
solver's fused kernel, the finite check queued), and the CUDA graphs the config asks for
simulated (``GraphReplay(simulate=True)``), each replay counted as the one launch it would be.
The page-locked staging of the uploads, the CUDA events and the pooling's GPU form are not
in it (a few operations more a round).

Writes the JSON (one record per workload) and prints one markdown table row per workload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import gossip_pfl.train as train
from gossip_pfl import models
from gossip_pfl.config import load_config
from gossip_pfl.data.images import FASHION_MNIST_ROOT
from gossip_pfl.runtime import data, solver, stack
from gossip_pfl.runtime.graphs import SIMULATED_REPLAY
from gossip_pfl.runtime.threads import available_cores
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "synthetic": (ROOT / "configs/synthetic/dfedem.yaml", []),
    "cnn": (ROOT / "configs/fashion_mnist/fedem.yaml", []),
}


#: operators that only make a new view of a tensor (no kernel on any device)
METADATA = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::transpose", "aten::permute",
    "aten::flatten", "aten::unflatten", "aten::unsqueeze", "aten::squeeze", "aten::slice",
    "aten::select", "aten::expand", "aten::expand_as", "aten::as_strided", "aten::alias",
    "aten::t", "aten::detach", "aten::lift_fresh", "aten::view_as", "aten::_unsafe_view",
    "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk", "aten::narrow",
    "aten::numpy_T", "aten::result_type", "aten::is_nonzero", "aten::resolve_conj",
    "aten::resolve_neg", "aten::to",
}  # fmt: skip


def aten_counts(fn) -> dict[str, int]:
    """aten operators ``fn()`` dispatches: called from Python (top-level), those of them that
    compute (not a view; ``aten::to`` counted by its copy), and all, nested ones included. A
    simulated graph's replay counts as one of each (its launch), its operations as none."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    top = compute = total = 0
    for ev in prof.events():
        replay = ev.name == SIMULATED_REPLAY
        if not (ev.name.startswith("aten::") or replay) or _in_replay(ev):
            continue
        total += 1
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if replay:
            top, compute = top + 1, compute + 1
        elif parent is None:
            top += 1
            compute += ev.name not in METADATA
        elif ev.name == "aten::_to_copy" and parent.name == "aten::to":
            compute += 1  # a conversion that copies
    return {"top_level": top, "compute": compute, "all": total}


def _in_replay(ev) -> bool:
    parent = ev.cpu_parent
    while parent is not None and parent.name != SIMULATED_REPLAY:
        parent = parent.cpu_parent
    return parent is not None


class Waits(TorchDispatchMode):
    """The operations whose result the host needs at once: a value read back (``.item()``,
    ``.cpu()``, ``.numpy()``, ``.tolist()``, a copy to the host), a nonzero's count, a
    boolean mask's rows. On a GPU each waits for the device, and a CUDA graph cannot hold
    it. On a CPU a read back dispatches nothing, so the tensor methods are watched while
    the mode is on; a host tensor read there (one a GPU run would keep on the host too)
    counts as well. An upload from pageable memory waits too; this cannot see it."""

    NAMES = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select",
             "_unique", "_unique2", "unique_dim", "unique_consecutive"}  # fmt: skip
    READS = ("cpu", "numpy", "tolist")  # (``item`` dispatches _local_scalar_dense)
    #: reads of host memory that a GPU run reads there too, without a copy or a wait: the
    #: queued finite check's flag (on a GPU a page-locked copy queued a round before)
    HOST_READS = {"_finite_checked"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self._methods: dict = {}

    def __enter__(self):
        for name in self.READS:
            method = self._methods[name] = getattr(torch.Tensor, name)

            def watched(t, *args, _name=name, _method=method, **kwargs):
                caller = sys._getframe(1)
                if caller.f_code.co_name not in self.HOST_READS:
                    where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
                    self.seen.append(f"Tensor.{_name} ({where})")
                return _method(t, *args, **kwargs)

            setattr(torch.Tensor, name, watched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).removeprefix("aten.")
        indices = args[1] if name.startswith("index") and len(args) > 1 else ()
        masks = isinstance(indices, (list, tuple)) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
        )
        out = func(*args, **(kwargs or {}))
        to_host = name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor) and (
            out.device.type == "cpu" and any(isinstance(a, torch.Tensor) and a.is_cuda
                                             for a in args))  # fmt: skip
        if name in self.NAMES or masks or to_host:
            self.seen.append(str(func))
        return out


#: the switches of a GPU's forms: (module, name, the value that turns them on for a CPU)
GPU_FORMS = (
    (data, "dense_layout", lambda device: True),
    (train, "dense_layout", lambda device: True),
    (train, "QUEUE_CHECK_ON", ("cpu",)),
    (train, "REORDER_ON", ("cpu",)),
    (solver, "FUSED_ON", ("cpu",)),
    (models, "CONV_AS_PRODUCTS", ("cpu",)),
    (stack, "PIECES_AT_ONCE_ON", ()),  # (in turn, as a GPU: the simulated graphs see them)
)


@contextmanager
def gpu_forms():
    """Inside: a trainer made on the CPU takes a GPU's forms (``--gpu-layout``: the dense
    layout, the plan reordered, the fused solver, the queued finite check, the convolutions
    as products, pieces of calls in turn); restored after."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in GPU_FORMS]
    try:
        for module, name, value in GPU_FORMS:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def round_ops(trainer: Trainer, gpu: bool, warm: int = 3) -> dict[str, int]:
    """:func:`aten_counts` of round ``warm`` after ``warm`` rounds (the graphs' first
    calls: the E-step's first round is eager, the next two are the two stacks' first);
    ``gpu``: the trainer was made inside :func:`gpu_forms`, and its CUDA graphs are
    simulated here first."""
    if gpu:
        trainer.use_cuda_graphs(simulate=True)
    for t in range(warm):
        one_round(trainer, t)
    return aten_counts(lambda: one_round(trainer, warm))


def one_round(trainer: Trainer, t: int) -> None:
    active = trainer.sample(t)
    trainer.local_work(t, active)
    trainer.communicate(t, active)


def measure(name: str, config: Path, overrides: list[str], rounds: int, gpu: bool = False) -> dict:
    if gpu:
        overrides = ["runtime.cpu_kernels=false", *overrides]
    cfg = load_config(config, ["runtime.device=cpu", f"out=runs/bench_ops/{name}", *overrides])
    if gpu and cfg.runtime.device != "cpu":
        raise SystemExit("bench_ops.py: --gpu-layout simulates a GPU on the CPU; on a GPU, "
                         "run without it")  # fmt: skip
    with gpu_forms() if gpu else nullcontext():
        return _measure(name, config, overrides, rounds, gpu, cfg)


def _measure(name, config, overrides, rounds, gpu, cfg) -> dict:
    trainer = Trainer(cfg, log=lambda *a: None)
    # warm-up: plans, caches, first allocations; where graphs are captured (simulated, or on
    # a GPU) their first calls: a GPU's count at one warm round was a capture round's (248
    # operations for the synthetic D-FedEM on an H200, lease 5)
    warm = 3 if gpu or trainer.device.type == "cuda" else 1
    ops = round_ops(trainer, gpu, warm)  # (one round's: exact)
    times = []
    for t in range(warm + 1, warm + 1 + rounds):
        t0 = time.perf_counter()
        one_round(trainer, t)
        times.append(time.perf_counter() - t0)
    with Waits() as waits:  # (a round more, untimed: the mode costs host time)
        one_round(trainer, warm + 1 + rounds)
    t0 = time.perf_counter()
    trainer.metrics_row(warm + 1 + rounds)
    eval_s = time.perf_counter() - t0
    eval_ops = aten_counts(lambda: trainer.metrics_row(warm + 1 + rounds))
    return {
        "workload": name,
        "config": str(config.relative_to(ROOT)),
        "overrides": overrides,
        "peers": trainer.n_peers,
        "components": trainer.M,
        "ops_per_round": ops["top_level"],
        "compute_ops_per_round": ops["compute"],
        "ops_per_round_all": ops["all"],
        "seconds_per_round": statistics.median(times),
        "waits_per_round": len(waits.seen),
        "ops_per_eval": eval_ops["top_level"],
        "compute_ops_per_eval": eval_ops["compute"],
        "seconds_per_eval": eval_s,
        "threads": torch.get_num_threads(),
        "device": str(trainer.device),
        "local_work": trainer.forward.describe(),
        "gpu_layout": gpu,
    }


def machine() -> str:
    """The CPU, the SIMD level torch dispatches to and the cores: a round's seconds move by 2x
    between machines of one name (AMD EPYC with AVX-512 or with AVX2), operation counts do not."""
    from bench_rules import cpu_model

    simd = torch.backends.cpu.get_cpu_capability()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu_model()} ({simd}, {available_cores()} cores{gpu})"


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    ap.add_argument("--only", choices=sorted(WORKLOADS), action="append")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every workload")  # fmt: skip
    ap.add_argument("--json", type=Path, default=ROOT / "runs" / "bench_ops.json")
    ap.add_argument("--gpu-layout", action="store_true",
                    help="count a GPU's round on this CPU (the docstring says how)")  # fmt: skip
    args = ap.parse_args()
    records = []
    for name in args.only or list(WORKLOADS):
        config, overrides = WORKLOADS[name]
        roots = [s.split("=", 1)[1] for s in args.set if s.startswith("data.root=")]
        root = Path(roots[-1]) if roots else FASHION_MNIST_ROOT
        if name == "cnn" and not root.is_dir():  # (any other error is one)
            print(f"# {name}: skipped (no Fashion-MNIST files in {root})")
            continue
        records.append(measure(name, config, overrides + args.set, args.rounds, args.gpu_layout))
    rev = commit()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    host = machine()
    args.json.write_text(
        json.dumps({"commit": rev, "machine": host, "records": records}, indent=2) + "\n"
    )
    how = ", the GPU's layout" if args.gpu_layout else ""
    print(f"# commit {rev}, {host}{how}; written to {args.json}")
    print("| workload | peers x M | ops/round | compute ops/round | all ops/round | "
          "waits/round | s/round | ops/eval | s/eval | threads |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(
            f"| {r['workload']} | {r['peers']} x {r['components']} | {r['ops_per_round']} | "
            f"{r['compute_ops_per_round']} | {r['ops_per_round_all']} | "
            f"{r['waits_per_round']} | {r['seconds_per_round']:.4f} | {r['ops_per_eval']} | "
            f"{r['seconds_per_eval']:.3f} | {r['threads']} |"
        )


if __name__ == "__main__":
    main()

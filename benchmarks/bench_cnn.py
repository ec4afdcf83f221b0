"""The CNN targets of the speed issue, in one command for a GPU machine: FedEM's local work per
round on the full FedEM CNN (conv 32/64, 2048 hidden units) over all 70,000 Fashion-MNIST
images split over 100 clients with M = 3, against the floor of one model trained on the same
images with the same batch size; float32, TF32 and bf16; peak memory; and, with
``--max-peers``, the most peers one device holds.

    python benchmarks/bench_cnn.py [--device cuda] [--rounds 3] [--modes float32,tf32,bf16]
        [--step-graphs off,on] [--max-peers 3200 [--bisect 2]] [--profile]
        [--json runs/bench_cnn.json]
    # a smoke test on a CPU (narrow model, 5% of the images, 10 clients):
    python benchmarks/bench_cnn.py --device cpu --fraction 0.05 --peers 10 \
        --channels 8,16 --hidden 64

``local s`` is the median over ``--rounds`` of ``Trainer.local_work`` (E-step, one epoch of
momentum SGD on every peer and component, what is sent), after one warm-up round, the device
synchronised around each; evaluation and mixing are not in it (``first s``: the warm-up
round, with ``--step-graphs on`` the captures of its step shapes' CUDA graphs,
``runtime.cuda_graph_steps``). The floor is a plain PyTorch
loop: one model of the same architecture, SGD with the config's momentum and weight decay, one
epoch over every client's training images (the images and labels resident on the device,
batches drawn by a permutation on the device): the fewest kernels an epoch of those images can
take at that batch size. FedEM trains M = 3 models per client, so it does three times the
floor's work: the issue's target is 2x the float32 floor (0.45 s on an H100, where the floor
measured 0.22 s). Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak
resident memory on a CPU. Needs the Fashion-MNIST files (docs/data.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gossip_pfl import models
from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.models import build_model
from gossip_pfl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "fashion_mnist" / "fedem.yaml"
#: --conv -> models.CONV_AS_PRODUCTS (auto: the module's own, by device)
CONV_FORMS = {"auto": None, "groups": (), "products": ("cpu", "cuda")}
#: mode -> (runtime.precision, runtime.tf32)
MODES = {"float32": ("float32", False), "tf32": ("float32", True), "bf16": ("bf16", False)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def overrides(args, peers: int, mode: str, graphs: bool = False) -> list[str]:
    precision, tf32 = MODES[mode]
    # past --peers (--max-peers) the images thin out, and the config's skewed partition had no
    # draw with 10 images a client for 400 clients (an H200 call): near-equal clients there
    # (alpha 100), three images at least (one per split). The peers' model stacks fill the
    # device, not their images.
    scale = ["data.partition.alpha=100", "data.partition.min_size=3"] if peers > args.peers else []
    return [
        *scale,
        f"runtime.device={args.device}",
        f"runtime.precision={precision}",
        f"runtime.tf32={str(tf32).lower()}",
        f"runtime.cuda_graph_steps={str(graphs).lower()}",
        "runtime.deterministic=false",  # cuDNN picks its fastest kernels, as a user's run may
        f"data.n_clients={peers}",
        f"data.fraction={args.fraction}",
        f"model.channels=[{args.channels}]",
        f"model.hidden={args.hidden}",
        "out=runs/bench_cnn",
    ]


def fedem_round(args, peers: int, mode: str, graphs: bool = False) -> tuple[dict, Trainer]:
    """Median seconds of FedEM's local work per round and the peak memory."""
    cfg = load_config(CONFIG, overrides(args, peers, mode, graphs))
    trainer = Trainer(cfg, log=lambda *a: None)
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    trainer.local_work(0)  # warm-up: plans, caches, cuDNN's choices, the graphs' captures
    sync(device)
    first = time.perf_counter() - t0
    times = []
    for t in range(1, args.rounds + 1):
        sync(device)
        t0 = time.perf_counter()
        trainer.local_work(t)
        sync(device)
        times.append(time.perf_counter() - t0)
    samples = int(trainer.train.mask.sum())
    graphs = trainer.step_graphs  # None where off, or after a failed capture
    row = {"peers": peers, "mode": mode, "step_graphs": graphs is not None,
           "graphs": 0 if graphs is None else len(graphs.graphs),
           "local_s": statistics.median(times), "first_s": first,
           "peak_gb": peak_gb(device), "train_samples": samples}  # fmt: skip
    return row, trainer


def profile_round(trainer: Trainer, t: int, rows: int = 25) -> str:
    """One round of local work under torch.profiler, by device time (CPU time on a CPU), with
    its phases labelled: the E-step (the surrogate's ``begin_round``), the gradients
    (``shared_grad``) and the solver's steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(fn, label):
        def run(*a, **k):
            with record_function(label):
                return fn(*a, **k)

        return run

    device = trainer.device
    cuda = device.type == "cuda"
    # the classes' methods, wrapped for this round (both objects are frozen dataclasses)
    phases = [(type(trainer.surrogate), "begin_round", "phase: E-step"),
              (type(trainer.surrogate), "shared_grad", "phase: gradients"),
              (type(trainer.solver), "step", "phase: solver step")]  # fmt: skip
    methods = [cls.__dict__.get(name) for cls, name, _ in phases]
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    try:
        for cls, name, label in phases:
            setattr(cls, name, labelled(getattr(cls, name), label))
        with profile(activities=acts, record_shapes=True) as prof:
            trainer.local_work(t)
            sync(device)
    finally:
        for (cls, name, _), method in zip(phases, methods):
            if method is not None:
                setattr(cls, name, method)
            elif name in cls.__dict__:  # inherited: drop the wrapper
                delattr(cls, name)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=key, row_limit=rows, max_name_column_width=48)
    # the host's spans (a GPU's copies of the annotations are rows of their own)
    spans = [e for e in averages if e.key.startswith("phase: ") and e.device_type.name == "CPU"]
    lines = [f"{e.key}: {e.cpu_time_total / 1e3:.1f} ms on the host"
             + (f", {e.device_time_total / 1e3:.1f} ms on the GPU" if cuda else "")
             + f" ({e.count} calls)" for e in spans]  # fmt: skip
    # which copies a round's time goes to, by their operands' shapes (lease 5: the strided
    # copies were 139 of the GPU's 558 ms, and laying the patches out otherwise did not move
    # them); the steps' own operations (eager steps: graphs hide them)
    time_of = (lambda e: e.device_time_total) if cuda else (lambda e: e.cpu_time_total)
    copies = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                     if e.key in COPIES and e.device_type.name == "CPU"),
                    key=time_of, reverse=True)[:12]  # fmt: skip
    lines.append("| copy | calls | ms | shapes |\n|---|---|---|---|")
    lines += [f"| {e.key} | {e.count} | {time_of(e) / 1e3:.1f} | {e.input_shapes} |"
              for e in copies]  # fmt: skip
    return "\n".join([table, *lines])


#: the operations that copy a tensor (``profile_round``'s table of copies by shape)
COPIES = {
    "aten::copy_",
    "aten::clone",
    "aten::contiguous",
    "aten::_to_copy",
    "aten::reshape",
    "aten::index",
    "aten::index_select",
    "aten::gather",
    "aten::cat",
    "aten::stack",
}


def floor_epoch(args, trainer: Trainer, mode: str) -> float:
    """Median seconds of one epoch of one model over the same images (see the docstring)."""
    cfg, device = trainer.cfg, trainer.device
    split = trainer.train
    keep = split.mask.reshape(-1).bool()
    x = split.x.flatten(0, 1)[keep].contiguous()
    y = split.y.flatten(0, 1)[keep].contiguous()
    ds = trainer.dataset
    model = build_model(cfg.model.name, tuple(ds.input_shape), ds.num_classes,
                        **cfg.model.options).to(device)  # fmt: skip
    a = cfg.algorithm
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum,
                          weight_decay=a.weight_decay)  # fmt: skip
    bf16 = MODES[mode][0] == "bf16"
    gen = torch.Generator(device=device).manual_seed(0)

    def epoch() -> None:
        order = torch.randperm(len(y), device=device, generator=gen)
        for idx in order.split(a.batch_size):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(x[idx])
            loss = F.cross_entropy(logits.float(), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    epoch()  # warm-up
    times = []
    for _ in range(args.rounds):
        sync(device)
        t0 = time.perf_counter()
        epoch()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def most_peers(args, mode: str) -> list[dict]:
    """FedEM rounds for twice as many peers each time, up to ``--max-peers`` or the first that
    does not fit the device's memory; then ``--bisect`` more halfway between the most peers
    that fit and the fewest that did not."""
    rows, fit, over, peers = [], args.peers, None, args.peers * 2
    while peers <= args.max_peers:
        rows.append(peers_row(args, peers, mode))
        if rows[-1]["local_s"] is None:
            over = peers if rows[-1]["error"] == "out of memory" else None
            break
        fit, peers = peers, peers * 2
    for _ in range(args.bisect if over else 0):
        peers = (fit + over) // 2
        if peers == fit:
            break
        rows.append(peers_row(args, peers, mode))
        if rows[-1]["local_s"] is not None:
            fit = peers
        elif rows[-1]["error"] == "out of memory":
            over = peers
        else:
            break
    return rows


def peers_row(args, peers: int, mode: str) -> dict:
    """:func:`fedem_round`'s row for ``peers``, or a row naming why it could not run."""
    try:
        row = fedem_round(args, peers, mode)[0]  # the trainer is freed here
    except torch.cuda.OutOfMemoryError:
        row = {"peers": peers, "mode": mode, "local_s": None, "peak_gb": None,
               "error": "out of memory"}  # fmt: skip
    except GossipError as err:  # the data cannot make that many clients
        row = {"peers": peers, "mode": mode, "local_s": None, "peak_gb": None,
               "error": str(err)}  # fmt: skip
    finally:
        gc.collect()  # the failed round's tensors, before the next one allocates
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"# {json.dumps(row)}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds and floor epochs")
    ap.add_argument("--modes", default="float32,tf32,bf16", help=f"of {', '.join(MODES)}")
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--fraction", type=float, default=1.0, help="of the 70,000 images")
    ap.add_argument("--channels", default="32,64", help="the CNN's two conv widths")
    ap.add_argument("--hidden", type=int, default=2048, help="the CNN's dense width")
    ap.add_argument("--max-peers", type=int, default=0,
                    help="double the peers up to this many (first mode only); 0: skip")  # fmt: skip
    ap.add_argument("--bisect", type=int, default=0,
                    help="after a peer count runs out of memory, this many more halfway "
                    "between it and the last that fit")  # fmt: skip
    ap.add_argument("--profile", action="store_true",
                    help="profile a round after the timed ones (the first --conv form and "
                    "mode, and the first whose steps are graphed): operations, then "
                    "phases")  # fmt: skip
    ap.add_argument("--conv", default="auto",
                    help="the convolutions' forms, side by side: auto (the device's), groups, "
                    "products (gossip_pfl.models.conv_blocks)")  # fmt: skip
    ap.add_argument("--step-graphs", default="on",
                    help="runtime.cuda_graph_steps, side by side: off, on or off,on")  # fmt: skip
    ap.add_argument("--no-floor", action="store_true", help="skip the one-model floor")
    ap.add_argument("--json", type=Path, default=ROOT / "runs" / "bench_cnn.json")
    args = ap.parse_args()
    convs = args.conv.split(",")
    unknown = [c for c in convs if c not in CONV_FORMS]
    if unknown:
        ap.error(f"--conv: unknown {', '.join(unknown)}; known: {', '.join(CONV_FORMS)}")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}; known: {', '.join(MODES)}")
    if args.device == "cpu":
        modes = [m for m in modes if m != "tf32"]  # TF32 is a CUDA setting
    graph_set = {"off": False, "on": True}
    if any(g not in graph_set for g in args.step_graphs.split(",")):
        ap.error(f"--step-graphs: {args.step_graphs!r}; known: off, on, off,on")
    graphs = [graph_set[g] for g in args.step_graphs.split(",")]
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if on_cpu:  # CUDA graphs: a CPU run takes plain steps (one row, not two)
        graphs = [False]

    own = models.CONV_AS_PRODUCTS
    devices = {c: own if CONV_FORMS[c] is None else CONV_FORMS[c] for c in convs}
    rows = []
    for conv in convs:
        models.CONV_AS_PRODUCTS = devices[conv]
        for mode, graphed in ((m, g) for m in modes for g in graphs):
            row, trainer = fedem_round(args, args.peers, mode, graphed)
            row["conv"] = conv
            # the first row, and the first with its steps graphed
            on = row["step_graphs"]
            if args.profile and (not rows or (on and not any(r["step_graphs"] for r in rows))):
                print(f"# profile: {mode}, step graphs {'on' if on else 'off'}", flush=True)
                print(profile_round(trainer, args.rounds + 1), flush=True)
            if not args.no_floor and conv == convs[0] and graphed == graphs[0]:
                row["floor_s"] = floor_epoch(args, trainer, mode)
            rows.append(row)
            print(f"# {json.dumps(row)}", flush=True)  # as it goes: a run cut short keeps these
            del trainer
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    models.CONV_AS_PRODUCTS = devices[convs[0]]
    scale = most_peers(args, modes[0]) if args.max_peers else []
    for row in scale:
        row["conv"] = convs[0]
    from bench_ops import commit, machine

    record = {"commit": commit(), "machine": machine(), "device": args.device,
              "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows, "scale": scale}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(f"# commit {record['commit']}, {record['machine']}, device {args.device}; "
          f"written to {args.json}")  # fmt: skip
    f32 = next((r["floor_s"] for r in rows if r["mode"] == "float32" and "floor_s" in r), None)
    print("| conv | mode | step graphs | peers x M | train samples | FedEM local s/round | "
          "first s | one-model floor s/epoch | local / float32 floor | peak GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['local_s'] / f32:.2f}" if f32 else "-"
        floor = f"{r['floor_s']:.3f}" if "floor_s" in r else "-"
        print(f"| {r['conv']} | {r['mode']} | {'on' if r['step_graphs'] else 'off'} | "
              f"{r['peers']} x 3 | {r['train_samples']} | {r['local_s']:.3f} | "
              f"{r['first_s']:.3f} | {floor} | {ratio} | {r['peak_gb']:.2f} |")  # fmt: skip
    for r in scale:
        fits = r["error"] if r["local_s"] is None else (
            f"{r['local_s']:.3f} s/round, {r['peak_gb']:.2f} GiB")  # fmt: skip
        print(f"# {r['peers']} peers ({r['conv']}, {r['mode']}): {fits}")


if __name__ == "__main__":
    main()

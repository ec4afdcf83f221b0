"""``gossip-pfl consensus`` and ``gossip-pfl topology {describe,export}``.

Schedules come from YAML spec files (:func:`topologies.spec.load_schedule`); with no spec,
``consensus`` runs a built-in demo of five schedules at ``n = 16``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gossip_pfl.cli import nonempty
from gossip_pfl.errors import one_line
from topologies import MixingSchedule, TopologyError
from topologies.analysis import (
    connectivity_tau,
    consensus_run,
    describe,
    schedule_rho,
    union_components,
)

#: the built-in demo of ``gossip-pfl consensus`` (no spec given): name -> spec dict
DEMO_SPECS: dict[str, dict[str, Any]] = {
    "ring": {"n": 16, "graph": "ring", "weights": "metropolis"},
    "one_peer_exponential": {"n": 16, "graph": "one_peer_exponential"},
    "base_k1": {"n": 16, "graph": "base", "graph_args": {"k": 1}},
    "er_metropolis": {
        "n": 16,
        "graph": "erdos_renyi",
        "graph_args": {"p": 0.5},
        "weights": "metropolis",
        "seed": 0,
    },
    "ring_link_failure": {
        "n": 16,
        "graph": "ring",
        "weights": "metropolis",
        "time_varying": {"kind": "link_failure", "q": 0.1},
        "seed": 0,
    },
}

DIM = 8  # columns of x_0 in consensus runs


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``consensus`` and ``topology`` to the ``gossip-pfl`` subcommands."""
    c = subparsers.add_parser(
        "consensus",
        help="compare how fast schedules reach consensus",
        description="Run x_{t+1} = W_t x_t from random x_0 for each schedule; print a table and "
        "write curves (CSV, JSON, PNG). Without SPEC, run a built-in demo at n=16.",
    )
    c.add_argument(
        "specs",
        nargs="*",
        metavar="SPEC",
        help="schedule spec YAMLs or graph files (edge list, .npy, .npz, .graphml, .gml)",
    )
    c.add_argument(
        "--rounds",
        type=_positive_int,
        default=300,
        help="rounds of x_{t+1} = W_t x_t to run (default %(default)s)",
    )
    c.add_argument(
        "--out",
        type=nonempty,
        default="runs/consensus",
        help="folder for consensus.csv, consensus.json and consensus.png (default %(default)s)",
    )
    c.add_argument(
        "--json", action="store_true", help="print the table as JSON only (files still written)"
    )
    c.add_argument("--seed", type=_seed, default=0, help="seed of x_0 (default 0)")
    _add_horizon(c)
    c.set_defaults(func=cmd_consensus)

    t = subparsers.add_parser(
        "topology",
        help="inspect or export a schedule",
        description="Describe a schedule (connectivity, spectrum, stochasticity) or export its "
        "mixing matrices.",
    )
    tsub = t.add_subparsers(dest="topology_command", required=True)
    d = tsub.add_parser(
        "describe",
        help="connectivity, spectral and stochasticity summary",
        description="Print n, edges_per_round, max_degree, doubly_stochastic, symmetric, "
        "nonnegative, rho, tau, contraction, is_random, period and p of a schedule.",
    )
    d.add_argument(
        "spec",
        metavar="SPEC",
        help="a schedule spec YAML, or a graph file: edge list 'u v' per line (integers or "
        "names), .npy adjacency, .npz matrices, .graphml or .gml",
    )
    d.add_argument("--json", action="store_true", help="print the summary as JSON only")
    _add_horizon(d)
    d.add_argument(
        "--trials",
        type=_positive_int,
        default=20,
        help="windows sampled to estimate p, the mixing parameter of E||W X - Xbar||^2 <= "
        "(1 - p) ||X - Xbar||^2 over a window of tau rounds (default %(default)s)",
    )
    d.add_argument("--seed", type=_seed, default=0, help="seed of the sampled windows (default 0)")
    d.set_defaults(func=cmd_describe)

    e = tsub.add_parser(
        "export",
        help="write W_0 .. W_{R-1} to an .npz file",
        description="Write the effective mixing matrices of rounds 0 .. R-1 of a schedule to an "
        ".npz file (one array W of shape (R, n, n), and the nodes' labels when the graph names "
        "them), e.g. to analyse them elsewhere.",
    )
    e.add_argument(
        "spec",
        metavar="SPEC",
        help="a schedule spec YAML, or a graph file (edge list, .npy, .npz, .graphml, .gml)",
    )
    e.add_argument("--rounds", type=_positive_int, required=True, help="R, the rounds to write")
    e.add_argument(
        "-o",
        "--output",
        type=nonempty,
        required=True,
        metavar="OUT.npz",
        help="the file to write (a folder: SPEC's name .npz in it)",
    )
    e.set_defaults(func=cmd_export)


def _add_horizon(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--horizon",
        type=_positive_int,
        default=100,
        help="largest tau searched; random schedules: rounds examined (default %(default)s)",
    )


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_seed = _int_at_least(0, "a non-negative integer (a NumPy seed)")


# --------------------------------------------------------------------------- loading


#: suffixes of schedule spec files; any other file is read as a graph (n from the file)
SPEC_SUFFIXES = (".yaml", ".yml")


def load(path: str) -> MixingSchedule:
    """The schedule of a spec file, or of a graph file (edge list, .npy, .npz, .graphml, .gml)
    with its default weights; every failure becomes a one-line TopologyError."""
    from topologies.spec import load_schedule, schedule_from_spec

    try:
        if Path(path).suffix.lower() in SPEC_SUFFIXES or not Path(path).is_file():
            return load_schedule(path)  # raises one-line TopologyErrors for missing/bad files
        return schedule_from_spec({"graph": str(Path(path).resolve())})
    except OSError as err:  # unreadable file (permissions, a folder, ...)
        raise TopologyError(f"{path}: {one_line(err)}") from None


def _peek_spec(path: str) -> tuple[int | None, dict]:
    """(the ``n``, the mapping) of a spec file, read without building its graph ((None, {}):
    not a readable spec file, or no int ``n``: load says what is wrong)."""
    if Path(path).suffix.lower() not in SPEC_SUFFIXES or not Path(path).is_file():
        return None, {}
    try:
        spec = yaml.safe_load(Path(path).read_text())
        n = spec.get("n")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return None, {}
    return (n if isinstance(n, int) and not isinstance(n, bool) else None), spec


def _load_for_analysis(path: str) -> MixingSchedule:
    """:func:`load` for the dense analyses: a spec file that gives ``n`` is checked against
    this machine's memory before its graph is built (n = 300,000 took a second to build for
    nothing); every schedule once loaded."""
    n, spec = _peek_spec(path)
    family, args = spec.get("graph"), spec.get("graph_args") or {}
    if n is not None and (family != "erdos_renyi" or isinstance(args, dict)):
        p = args.get("p", 1) if family == "erdos_renyi" else 1
        # (a p that load refuses, NaN or 40, is left to say so: no estimate from it)
        real = isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1
        dense = family in ("complete", "erdos_renyi") and real
        _check_dense(path, n, round(p * n * (n - 1) / 2) if dense else 0, family)
    schedule = load(path)
    _check_dense(path, schedule.n)
    return schedule


#: bytes an edge takes while a schedule is built from a networkx graph (the graph, the weight
#: rule's arrays, the phase): 317 and 329 measured for complete graphs of 1,000 and 3,000 nodes
EDGE_BYTES = 330


def _check_dense(source: str, n: int, edges: int = 0, family: str = "") -> None:
    """The analyses hold a few dense n x n float64 matrices (window products, spectra), and
    a dense graph (``edges`` of a complete or Erdos-Renyi ``family``) takes more to build:
    refuse an n that would not fit in this machine's memory, before numpy and networkx try
    (n = 30,000 was killed for memory, n = 100,000 asked for 74.5 GiB at once; a complete
    graph of 30,000 nodes built for minutes towards 148 GB)."""
    from gossip_pfl.runtime.threads import beyond_memory

    # (None where the OS does not say: numpy tries)
    if not (beyond := beyond_memory(3 * n * n * 8 + edges * EDGE_BYTES)):
        return
    if edges:
        raise TopologyError(
            f"{source}: n = {n:,}: the {family} graph's {edges:,} edges take about "
            f"{EDGE_BYTES} bytes each to build, beside the analysis's 3 x n^2 x 8 bytes: "
            f"{beyond}"
        )
    raise TopologyError(
        f"{source}: n = {n:,}: the analysis holds three dense n x n matrices at a time, "
        f"3 x n^2 x 8 bytes = {beyond}"
    )


def _check_export(source: str, rounds: int, n: int) -> None:
    """export holds W (rounds, n, n) float64 in memory: refuse one that would not fit, before
    numpy tries (10^8 rounds of a 16-peer ring ran for minutes towards 205 GB)."""
    from gossip_pfl.runtime.threads import beyond_memory

    if beyond := beyond_memory(rounds * n * n * 8, "W"):
        raise TopologyError(
            f"{source}: --rounds {rounds:,} x n^2 = {n:,}^2 x 8 bytes = {beyond}; "
            "export fewer rounds"
        )


def _from_dict(spec: dict) -> MixingSchedule:
    from topologies.spec import schedule_from_spec

    return schedule_from_spec(dict(spec))


def _tau(name: str, schedule: MixingSchedule, horizon: int) -> int:
    tau = connectivity_tau(schedule, horizon)
    if tau is None:
        raise TopologyError(_not_connected(name, horizon, schedule))
    return tau


def _not_connected(name: str, horizon: int, schedule: MixingSchedule) -> str:
    """Why no window of at most ``horizon`` rounds connects the peers: the components of
    their links' union (a ring whose links all fail said only "increase --horizon")."""
    parts = union_components(schedule, horizon)
    why = ""
    if len(parts) > 1:
        why = (f": over these rounds their links join the {schedule.n} peers into {len(parts)} "
               f"components (the smallest holds peers {sorted(parts[0])[:5]})")  # fmt: skip
    return (
        f"{name}: schedule is not connected within the horizon of {horizon} rounds "
        f"(no tau <= {horizon}){why}; increase --horizon if its links join later"
    )


def _named(paths: list[str]) -> list[tuple[str, str]]:
    """``(name, path)`` with names = file stems, made unique by a ``-2``, ``-3``... suffix
    (unique among all the names: ``a.yaml a-2.yaml x/a.yaml`` gave two ``a-2``)."""
    taken: set[str] = set()
    out = []
    for p in paths:
        stem = name = Path(p).stem
        k = 1
        while name in taken:
            k += 1
            name = f"{stem}-{k}"
        taken.add(name)
        out.append((name, p))
    return out


# --------------------------------------------------------------------------- consensus


def cmd_consensus(args: argparse.Namespace) -> int:
    demo = not args.specs
    if demo:
        items = [(name, f"<demo:{name}>", _from_dict(s)) for name, s in DEMO_SPECS.items()]
    else:
        items = [(name, p, _load_for_analysis(p)) for name, p in _named(args.specs)]
    rows, curves = zip(*(_study(*item, args) for item in items))
    files = _write_consensus(Path(args.out), list(rows), list(curves), args)
    for row in rows:
        row.update(files)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if demo:
        names = ", ".join(DEMO_SPECS)
        print(f"no SPEC given: built-in demo, {len(items)} schedules at n=16 ({names})")
    print(
        f"consensus: x_{{t+1}} = W_t x_t for {args.rounds} rounds from a random x_0 "
        f"(n x {DIM}, seed {args.seed}); error = ||x_t - mean|| / ||x_0 - mean||"
    )
    print(_table(rows))
    print(f"wrote {files['csv']}, {files['json']}, {files['png']}")
    return 0


def _study(name: str, source: str, schedule: MixingSchedule, args) -> tuple[dict, Any]:
    """One table row and the consensus run of one schedule."""
    if schedule.n < 2:  # its values agree from the start: there is no error to divide by
        raise TopologyError(f"{source}: n = {schedule.n}: a single node is always in "
                            "consensus, nothing to measure (give n >= 2)")  # fmt: skip
    _check_dense(source, schedule.n)
    tau = _tau(name, schedule, args.horizon)  # first: a disconnected schedule fails fast
    res = consensus_run(schedule, args.rounds, dim=DIM, seed=args.seed)
    row = {
        "name": name,
        "spec": source,
        "n": schedule.n,
        "rho": schedule_rho(schedule, args.horizon),
        "tau": tau,
        "messages_per_round": float(res.messages.mean()),
        "rounds_to_1e-3": res.rounds_to(1e-3),
        "rounds_to_1e-6": res.rounds_to(1e-6),
        "final_error": res.final_error,
    }
    return row, res


COLUMNS = [
    ("schedule", "name", "{}"),
    ("n", "n", "{}"),
    ("rho", "rho", "{:.4f}"),
    ("tau", "tau", "{}"),
    ("msgs/round", "messages_per_round", "{:.1f}"),
    ("to 1e-3", "rounds_to_1e-3", "{}"),
    ("to 1e-6", "rounds_to_1e-6", "{}"),
    ("final error", "final_error", "{:.2e}"),
]


def _table(rows: list[dict] | tuple[dict, ...]) -> str:
    cells = [[h for h, _, _ in COLUMNS]]
    for row in rows:
        cells.append(["-" if row[k] is None else f.format(row[k]) for _, k, f in COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = []
    for r in cells:
        first = r[0].ljust(widths[0])
        lines.append("  ".join([first] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _write_consensus(out: Path, rows: list[dict], curves: list, args) -> dict[str, str]:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TopologyError(f"cannot create {out}: {one_line(err)}") from None
    files = {k: str(out / f"consensus.{k}") for k in ("csv", "json", "png")}
    for path in files.values():  # a folder in a file's place: an IsADirectoryError traceback
        if Path(path).is_dir():
            raise TopologyError(f"cannot write {path}: it is a folder")

    def write_csv(path: Path) -> None:
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["round"] + [r["name"] for r in rows])
            for t in range(args.rounds + 1):
                w.writerow([t] + [f"{c.errors[t]:.6e}" for c in curves])

    doc = {
        "rounds": args.rounds,
        "seed": args.seed,
        "dim": DIM,
        "horizon": args.horizon,
        "schedules": [
            {**r, "errors": c.errors.tolist(), "messages": c.messages.tolist()}
            for r, c in zip(rows, curves)
        ],
    }
    _write_at_once({files["csv"]: write_csv,
                    files["json"]: lambda path: path.write_text(json.dumps(doc, indent=1)),
                    files["png"]: lambda path: _plot(path, rows, curves)})  # fmt: skip
    return files


def _write_at_once(saves: dict) -> None:
    """``{path: save}`` written beside, then all put in place (rundir.replace_all): a full
    disk leaves the old files whole, none cut, and one line naming the file."""
    from gossip_pfl.rundir import replace_all

    try:
        replace_all(saves)
    except OSError as err:
        why = err.strerror or one_line(err)
        raise TopologyError(f"cannot write {err.filename}: {why}") from None


def _plot(path: str | Path, rows: list[dict], curves: list) -> None:
    # Figure + Agg canvas directly: no pyplot, so no global backend switch in the caller
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    by_round, by_msgs = fig.subplots(1, 2)
    floor = 1e-16  # exact averaging reaches 0, which a log axis cannot show
    # a line style and marker per schedule as well as a colour: schedules that average
    # alike (one_peer_exponential and base_k1 at n = 16) drew one line over the other
    styles = [(ls, mk) for mk in ("o", "s", "^", "D", "v") for ls in ("-", "--", ":", "-.")]
    for i, (row, res) in enumerate(zip(rows, curves)):
        err = np.maximum(res.errors, floor)
        ls, mk = styles[i % len(styles)]
        look = {"label": row["name"], "linestyle": ls, "marker": mk, "markevery": 0.1,
                "markersize": 4, "markerfacecolor": "none"}  # fmt: skip
        by_round.plot(np.arange(len(err)), err, **look)
        by_msgs.plot(res.cumulative_messages, err, **look)
    for ax, xlabel in ((by_round, "round"), (by_msgs, "messages sent (cumulative)")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("consensus distance (relative)")
        ax.grid(True, which="major", alpha=0.3)
    by_round.legend(fontsize="small")
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------- topology


def cmd_describe(args: argparse.Namespace) -> int:
    schedule = _load_for_analysis(args.spec)
    info = describe(schedule, horizon=args.horizon, trials=args.trials, seed=args.seed)
    if info["tau"] is None:
        raise TopologyError(_not_connected(Path(args.spec).stem, args.horizon, schedule))
    labels = getattr(schedule, "labels", None)
    if labels is not None:  # peer i is the graph's node labels[i]
        info["labels"] = [x if isinstance(x, (int, float)) else str(x) for x in labels]
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(map(len, info))
    print(f"{args.spec} (rounds 0..{args.horizon - 1})")
    for key, value in info.items():
        print(f"  {key.ljust(width)}  {_fmt(value)}")
    if not info["doubly_stochastic"]:  # (a negative p read as a bug)
        print("  (not doubly stochastic: rho, contraction and p are taken against the plain "
              "average, which these rounds move)")  # fmt: skip
    return 0


def _fmt(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.6g}"
    if isinstance(value, list):  # node labels: peer 0's first
        shown = ", ".join(f"{i}={x}" for i, x in enumerate(value[:4]))
        return shown + (f", ... ({len(value)} nodes)" if len(value) > 4 else "")
    return str(value)


def cmd_export(args: argparse.Namespace) -> int:
    from topologies.spec import save_npz

    if (n := _peek_spec(args.spec)[0]) is not None:  # before its graph is built (a hang)
        _check_export(args.spec, args.rounds, n)
    schedule = load(args.spec)
    _check_export(args.spec, args.rounds, schedule.n)
    out = Path(args.output)
    if out.is_dir() or args.output.endswith(("/", os.sep)):  # (DIR.npz was written beside it)
        out = out / f"{Path(args.spec).stem}.npz"
    if out.suffix != ".npz":  # NumPy adds it: say the name that is written
        out = out.with_name(out.name + ".npz")
    if out.exists() and out.resolve() == Path(args.spec).resolve():  # (it was replaced)
        raise TopologyError(f"cannot write {out}: it is the schedule being exported")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # mkdir said "[Errno 17] File exists"
        raise TopologyError(f"cannot write {out}: {blocker} is a file, not a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TopologyError(f"cannot write {out}: {one_line(err)}") from None
    _write_at_once({out: lambda path: save_npz(schedule, path, rounds=args.rounds)})
    print(f"wrote {out}: W with shape ({args.rounds}, {schedule.n}, {schedule.n})")
    return 0

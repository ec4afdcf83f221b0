"""``gossip-pfl plot RUN_DIR [RUN_DIR ...]``: PNGs comparing finished (or running) runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from gossip_pfl.cli import nonempty
from gossip_pfl.errors import GossipError

#: --out when several runs are compared (one run: RUN_DIR/plots)
MULTI_RUN_OUT = "runs/plots"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plot`` to the ``gossip-pfl`` subcommands."""
    from gossip_pfl.plots import PLOTS

    figures = ", ".join(f"{name}.png" for name in PLOTS)
    p = subparsers.add_parser(
        "plot",
        help="plot accuracy, loss, consensus, traffic and mixture weights of runs",
        description="Read metrics.jsonl and summary.json of each RUN_DIR (written by "
        f"'gossip-pfl run') and write {figures}, and mixture_weights_vs_round.png when a run "
        "has mixture weights (D-FedEM, FedEM), one colour per run.",
    )
    p.add_argument(
        "runs",
        nargs="+",
        type=nonempty,
        metavar="RUN_DIR",
        help="output folders of 'gossip-pfl run' (a run still going is plotted up to its "
        "last evaluation)",
    )
    p.add_argument(
        "--out",
        type=nonempty,
        metavar="DIR",
        help=f"output folder (default: RUN_DIR/plots for one run, {MULTI_RUN_OUT} for several)",
    )
    p.add_argument(
        "--labels",
        metavar="A,B,...",
        help="comma-separated legend labels, one per RUN_DIR "
        "(default: algorithm name and run folder name)",
    )
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from gossip_pfl import plots

    labels = None
    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
        if len(labels) != len(args.runs):
            raise GossipError(
                f"--labels has {len(labels)} label(s) but {len(args.runs)} RUN_DIR(s) were "
                "given; pass one comma-separated label per run"
            )
        if not all(labels):
            raise GossipError(f"--labels {args.labels!r} has an empty label")
    runs = [plots.load_run(path) for path in args.runs]
    out = Path(args.out) if args.out else default_out(args.runs)
    em = [run for run in runs if run.rows and "h_sq" in run.rows[0]]
    if em:  # EM's rows have no accuracies: the model runs' figures came out empty
        if len(runs) > 1:
            raise GossipError(f"{em[0].path} is an EM run (h_sq, H_sq against epochs): plot it "
                              "alone; it has no accuracies to compare with other runs")  # fmt: skip
        from gossip_pfl.expfam.run import plot_run

        try:
            paths = plot_run(em[0].path, out, labels[0] if labels else None)
        except OSError as err:
            raise GossipError(f"cannot write {out}: {err.strerror or err}") from None
        for path in paths:
            print(f"wrote {path}")
        return 0
    for run, label in zip(runs, labels or [""] * len(runs)):
        run.label = label
    paths = plots.write_plots(runs, out)
    names = plots.default_labels(runs) if labels is None else labels
    print(f"plotted {len(runs)} run(s): " + ", ".join(names))
    for path in paths:
        print(f"wrote {path}")
    return 0


def default_out(run_dirs: list[str]) -> Path:
    """RUN_DIR/plots for one run, ``runs/plots`` for several."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "plots"
    return Path(MULTI_RUN_OUT)

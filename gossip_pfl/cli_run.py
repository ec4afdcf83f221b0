"""``gossip-pfl run``: one config, one process or torchrun ranks."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from gossip_pfl.cli import nonempty
from gossip_pfl.config import load_config, path_override, read_yaml
from gossip_pfl.errors import GossipError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train from a YAML config (no config: the embedded demo)",
        description="Train from a YAML config. Under torchrun every rank runs the same command.",
    )
    p.add_argument("config", nargs="?", help="run config YAML (default: the embedded demo)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set algorithm.lr=0.05 (repeatable)",
    )
    p.add_argument("--out", type=nonempty, help="output directory (overrides the config's 'out')")
    p.add_argument("--quiet", action="store_true", help="print only errors and the summary")
    p.add_argument(
        "--no-plots",
        action="store_true",
        help="write no figures (a sweep draws them later with gossip-pfl plot)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in the output folder (default: refuse)",
    )
    p.add_argument(
        "--resume",
        type=nonempty,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint",
    )
    p.set_defaults(func=cmd_run)


def default_config() -> dict:
    """The embedded demo config shipped with the package."""
    text = resources.files("gossip_pfl").joinpath("defaults/demo.yaml").read_text()
    import yaml

    return yaml.safe_load(text)


def cmd_run(args: argparse.Namespace) -> int:
    from gossip_pfl.rundir import RunStopped, SigtermAsInterrupt, check_out_dir, is_peer_run

    overrides = list(args.overrides) + ([path_override("out", args.out)] if args.out else [])
    if args.resume:
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise GossipError(f"--resume {args.resume} continues the run in its own folder; "
                              f"drop --out {args.out}")  # fmt: skip
        moved = [
            o
            for o in args.overrides
            if o.split("=", 1)[0].strip() == "out"
            and Path(o.split("=", 1)[-1].strip()).resolve() != Path(args.resume).resolve()
        ]
        if moved:  # (it was dropped, unsaid: the resume wrote into RUN_DIR)
            raise GossipError(f"--resume {args.resume} continues the run in its own folder; "
                              f"drop --set {moved[0]}")  # fmt: skip
        if is_peer_run(Path(args.resume)):  # (said: config file not found)
            raise GossipError(f"--resume {args.resume}: a peer-to-peer run (peers-local); "
                              f"continue it with gossip-pfl peers-local --resume "
                              f"{args.resume}")  # fmt: skip
        # the run's own resolved config, unless one is given (then it must match the checkpoint)
        source = args.config or str(Path(args.resume) / "config.yaml")
        cfg = load_config(source, overrides + [path_override("out", args.resume)], unread=False,
                          saved=args.config is None)  # fmt: skip
    elif args.config:
        read_yaml(args.config)  # a missing or malformed file fails here, naming it
        cfg = load_config(args.config, overrides)
    else:
        cfg = load_config(None, overrides, base=default_config())
    check_out_dir(Path(cfg.out), bool(args.resume), args.overwrite)  # before any data is built
    # torch loads only now (2 s or more): a bad config or folder is reported at once
    from gossip_pfl import checkpoint
    from gossip_pfl.train import run

    log = (lambda *a, **k: None) if args.quiet else print
    try:
        summary = run(cfg, log=log, resume=bool(args.resume))
    except RunStopped as stop:
        if _is_rank0():
            print(f"gossip-pfl: {stop}")
        return stop.code
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once
        if _is_rank0():
            saved = (Path(cfg.out) / checkpoint.FILE).is_file()
            hint = f"; continue from the last checkpoint with: gossip-pfl run --resume {cfg.out}"
            print("gossip-pfl: interrupted" + (hint if saved else " (no checkpoint was saved)"),
                  file=sys.stderr)  # fmt: skip
        return 130
    if _is_rank0():
        from gossip_pfl.algorithms import get_algorithm
        from gossip_pfl.train import workload_class

        workload = workload_class(get_algorithm(cfg.algorithm.name).workload)
        keys = tuple(k for k in workload.summary_keys if k in summary)
        width = max(map(len, keys))
        print(f"results ({cfg.algorithm.name}, written to {Path(cfg.out) / 'summary.json'}):")
        for k in keys:
            v = summary[k]
            if isinstance(v, list):
                v = " ".join(f"{w:.3f}" for w in v)
            form = workload.summary_formats.get(k, ".4f")
            print(f"  {k:<{width}}  {v:{form}}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
        # (after the results: a Ctrl-C, or SIGTERM, while they are drawn loses nothing else)
        with SigtermAsInterrupt() as term:
            try:
                plots = [] if args.no_plots else workload.write_plots(Path(cfg.out))
            except KeyboardInterrupt:
                print(f"gossip-pfl: interrupted while drawing the figures; the run is finished "
                      f"({Path(cfg.out) / 'summary.json'}): draw them with gossip-pfl plot "
                      f"{cfg.out}", file=sys.stderr)  # fmt: skip
                return 143 if term.received else 130
        if plots:
            print(f"plots: {plots[0].parent}/ ({', '.join(p.name for p in plots)})")
    return 0


def _is_rank0() -> bool:
    from gossip_pfl.runtime.comm import world_from_env

    return world_from_env()[0] == 0

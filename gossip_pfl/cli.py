"""The ``gossip-pfl`` command: a thin dispatcher over the subcommand modules."""

from __future__ import annotations

import argparse
import sys

from gossip_pfl.errors import GossipError
from topologies import TopologyError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossip-pfl",
        description="Decentralized personalized federated learning over gossip topologies.",
    )
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("gossip-pfl")
    except PackageNotFoundError:  # running from a source tree that was not installed
        ver = "unknown"
    parser.add_argument("--version", action="version", version=f"gossip-pfl {ver}")
    sub = parser.add_subparsers(dest="command", required=True)
    from gossip_pfl import cli_peer, cli_plot, cli_run, cli_topology

    cli_run.register(sub)
    cli_peer.register(sub)
    cli_topology.register(sub)
    cli_plot.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (GossipError, TopologyError) as err:
        print(f"gossip-pfl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gossip-pfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

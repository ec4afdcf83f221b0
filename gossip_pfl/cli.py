"""The ``gossip-pfl`` command: a thin dispatcher over the subcommand modules."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

# Before torch (and so OpenMP) loads: idle OpenMP threads sleep instead of spinning. Two runs
# side by side, each with a thread per core, were 2x to 10x slower than alone with spinning
# threads, 1.4x to 1.6x with sleeping ones; a run alone is as fast (docs/speed-notes.md).
# A variable already set wins (OMP_WAIT_POLICY=ACTIVE spins).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before numpy loads: the same for OpenBLAS's threads, which spin 2^28 cycles after a call
# before they sleep. Two `topology describe` side by side took 44 s against 6 s alone; asleep
# after 2^4 cycles, 13 s (the shared cores explain 12), and a run alone is as fast.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from gossip_pfl.errors import GossipError, one_line  # noqa: E402
from topologies import TopologyError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, like every other error of the command (argparse
    prints the usage block first); subcommand parsers are made of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def nonempty(text: str) -> str:
    """A path argument: an empty one (``--out ''``) fell back to the config's, unsaid."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return text


def _out_of_memory(err: RuntimeError) -> bool:
    """torch's "can't allocate memory" (CPU) or its OutOfMemoryError (CUDA)."""
    torch = sys.modules.get("torch")  # (not loaded: not torch's error)
    oom = getattr(torch, "OutOfMemoryError", ())
    return torch is not None and (isinstance(err, oom) or "can't allocate memory" in str(err))


def _allocation(text: str) -> str:
    """The size torch's message names ("allocate 60000000000 bytes", "allocate 20.00 GiB")."""
    import re

    if m := re.search(r"allocate (\d+) bytes", text):
        return f"{int(m.group(1)) / 2**30:,.1f} GiB"
    m = re.search(r"allocate ([\d.]+ [KMGT]iB)", text)
    return m.group(1) if m else "what it needed"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, like the errors (not Python's file, line and source text)."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    print(f"gossip-pfl: warning{kind}: {message}", file=file or sys.stderr)


def entry() -> int:
    """The ``gossip-pfl`` command and ``python -m gossip_pfl``: :func:`main`, after which
    another Ctrl-C while the process winds down (its threads joined at exit: a stopped run's
    next batch plan, drawn ahead) ends it at once instead of printing their traceback."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a bare command: what there is to run
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            code = int(args.func(args) or 0)
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            return code
    except (GossipError, TopologyError) as err:
        print(f"gossip-pfl: error: {err}", file=sys.stderr)
        return 2
    except MemoryError as err:  # numpy names the array it could not allocate
        why = f": {one_line(err)}" if str(err) else ""
        print(f"gossip-pfl: error: out of memory{why} (a smaller problem fits)", file=sys.stderr)
        return 2
    except RuntimeError as err:  # torch's allocators raise RuntimeError, not MemoryError
        if not _out_of_memory(err):
            raise
        print(f"gossip-pfl: error: out of memory: torch could not allocate "
              f"{_allocation(str(err))} (a smaller problem fits)", file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("gossip-pfl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head` stopped reading: no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Peer-to-peer runs over pyzmq (``runtime.transport: zmq``; docs/p2p.md).

    gossip-pfl peer CONFIG --peers PEERS.yaml --id K [--resume]   one process, any start order
    gossip-pfl peers-local CONFIG -n N [--out RUN_DIR]             N processes on 127.0.0.1
    gossip-pfl peers-local --resume RUN_DIR [--set rounds=R]       continue them all
    gossip-pfl merge RUN_DIR                                       metrics.jsonl + summary.json

There is no process group and no all-reduce: process K holds a block of peers (as rank K does
under torchrun) and writes RUN_DIR/peers/K/ on its own: config.yaml, metrics.jsonl (its peers'
values, one list entry per peer), links.jsonl (every exchange: the links, those lost, and how
the mix changed the sum of the rows on a seeded sample of coordinates), checkpoint.pt,
kept/R.pt (its last checkpoints at multiples of checkpoint_every: processes stopped at
different rounds resume at the latest round all hold) and summary.json. ``merge`` turns them
into the usual RUN_DIR/metrics.jsonl and summary.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gossip_pfl.cli import nonempty
from gossip_pfl.config import load_config, path_override, read_yaml
from gossip_pfl.errors import KILLED_EXIT, GossipError
from gossip_pfl.metrics import client_accuracies, mixture_entries, score_entries
from gossip_pfl.rundir import (
    CHECKPOINT_FILE,
    REJOINS,
    RunLock,
    SigtermAsInterrupt,
    check_out_dir,
    check_processes_stopped,
    clear_outputs,
    is_number,
    is_peer_run,
    kept_rounds,
    read_rows,
    rewrite_rows,
    write,
    write_text,
)

if TYPE_CHECKING:
    from gossip_pfl.config import RunConfig


def register(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser, config_nargs: str | None = None) -> None:
        p.add_argument("config", nargs=config_nargs,
                       help="run config YAML (its schedule must be a gossip one)")  # fmt: skip
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a config key (repeatable)")  # fmt: skip
        p.add_argument("--out", type=nonempty,
                       help="the run folder RUN_DIR (overrides the config's 'out')")  # fmt: skip
        p.add_argument("--overwrite", action="store_true", help="replace a run already there")

    p = sub.add_parser("peer", help="start one peer-to-peer process (runtime.transport zmq)",
                       description="Start process K of a peer-to-peer run. Processes start in "
                       "any order and wait up to runtime.timeout_s for each other.")  # fmt: skip
    common(p)
    p.add_argument("--peers", help="peers file: process id -> host:port (default runtime.peers)")
    p.add_argument("--id", type=int, required=True, help="this process's id in the peers file")
    p.add_argument("--resume", action="store_true",
                   help="restart: resume from this process's checkpoint, rejoin at the current "
                   "round")  # fmt: skip
    p.add_argument("--wait-round", type=int, default=0, metavar="R",
                   help="with --resume: rejoin once the running peers reach round R (a kill "
                   "schedule's restart round)")  # fmt: skip
    p.add_argument("--after-pid", type=int, default=0, metavar="PID",
                   help="a standby restart: load the data now, take the port once process PID "
                   "has exited")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="print only errors")
    p.set_defaults(func=cmd_peer)

    p = sub.add_parser("peers-local", help="start N peer processes on 127.0.0.1, then merge",
                       description="Start N processes of a peer-to-peer run on loopback (logs "
                       "in RUN_DIR/logs/), restart those the kill schedule crashes, and merge "
                       "their outputs; or, with --resume RUN_DIR, continue a stopped "
                       "one.")  # fmt: skip
    common(p, config_nargs="?")
    p.add_argument("-n", type=int, help="number of processes")
    p.add_argument("--resume", metavar="RUN_DIR", type=nonempty,
                   help="continue the stopped peers-local run in RUN_DIR: every process from "
                   "its checkpoint, at the latest round all of them hold; --set may change "
                   "rounds")  # fmt: skip
    p.set_defaults(func=cmd_peers_local)

    p = sub.add_parser("merge", help="merge a peer-to-peer run's per-process outputs",
                       description="Merge RUN_DIR/peers/*/ into RUN_DIR/metrics.jsonl and "
                       "RUN_DIR/summary.json.")  # fmt: skip
    p.add_argument("run_dir", type=nonempty, help="the run folder whose peers/K/ folders to merge")
    p.set_defaults(func=cmd_merge)


def cmd_peer(args: argparse.Namespace) -> int:
    from gossip_pfl.data import load_dataset
    from gossip_pfl.peer import PeerTrainer
    from gossip_pfl.rundir import RunStopped, check_out_dir
    from gossip_pfl.runtime.comm import resolve_device
    from gossip_pfl.runtime.zmq_comm import Faults, ZmqComm, read_peers

    for flag, value in (("--wait-round", args.wait_round), ("--after-pid", args.after_pid)):
        if value < 0:
            raise GossipError(f"{flag} {value}: must be >= 0")
        if value and not args.resume:  # (a fresh process ignored them)
            raise GossipError(f"{flag} {value} is a restart's option: add --resume")
    read_yaml(args.config)  # a missing or malformed config fails here, naming it
    # (a restarted process resumes its run: its config is left as it started)
    unread = not args.resume
    # the process's own saved config (peers-local --resume), or the user's
    own = args.out and Path(args.out) / "peers" / str(args.id) / "config.yaml"
    saved = bool(args.resume and own and Path(args.config).resolve() == own.resolve())
    cfg = load_config(args.config, [*args.overrides, "runtime.transport=zmq"], unread=unread,
                      saved=saved)  # fmt: skip
    _check_workload(cfg)
    run_dir = Path(args.out or cfg.out)
    rt = cfg.runtime
    source = args.peers or rt.peers
    if not source:
        raise GossipError("no peers file: pass --peers PEERS.yaml or set runtime.peers")
    table = read_peers(source)
    if args.id not in table:
        raise GossipError(f"--id {args.id}: not in peers file {source} (ids 0..{len(table) - 1})")
    for kill in rt.faults.kill:
        if kill["id"] not in table:
            raise GossipError(f"runtime.faults.kill: id {kill['id']} is not in peers file {source}")
    out = run_dir / "peers" / str(args.id)
    overrides = [*args.overrides, "runtime.transport=zmq", path_override("out", out)]
    cfg = load_config(args.config, overrides, unread=unread, saved=saved)
    check_out_dir(out, args.resume, args.overwrite)
    dataset = load_dataset(cfg.data.name, **cfg.data.options)
    n = _training_peers(dataset)
    if len(table) > n:
        raise GossipError(
            f"peers file {source}: {len(table)} processes but the run has {n} peers: ids "
            f"{n}..{len(table) - 1} are outside the schedule (one or more peers per process)"
        )
    faults = Faults(rt.faults.drop, rt.faults.ack_drop,
                    cfg.seed if rt.faults.seed is None else rt.faults.seed)  # fmt: skip
    if args.after_pid:  # a standby: what it can load before the crash is not the restart's
        from gossip_pfl.runtime.data import warm_up

        warm_up()
    parent = os.getppid()
    while args.after_pid and _alive(args.after_pid):  # the crashed process may not have
        if os.getppid() != parent:  # bound our port yet: a bind now would take it. No
            # deadline while its launcher lives: a kill may come long after the start (a
            # standby gave up after runtime.timeout_s, then was put in its process's place)
            raise GossipError(f"--after-pid {args.after_pid}: its launcher is gone")
        time.sleep(0.05)
    deadline = time.monotonic() + rt.timeout_s
    while True:
        try:
            comm = ZmqComm(args.id, table, resolve_device(rt.device), rt.timeout_s,
                           p2p=True, link_timeout_s=rt.link_timeout_s, faults=faults)  # fmt: skip
            break
        except GossipError as err:
            # a standby restart (--wait-round) waits for the crashed process's port to free
            if not args.wait_round or "cannot listen" not in str(err):
                raise
            if time.monotonic() > deadline:
                raise GossipError(f"{err} (waited runtime.timeout_s for it to free)") from None
            time.sleep(0.05)
    out.mkdir(parents=True, exist_ok=True)
    log = (lambda *a, **k: None) if args.quiet else print
    try:
        trainer = PeerTrainer(cfg, dataset, comm, log)
        trainer.wait_round = args.wait_round
        summary = trainer.run(resume=args.resume)
    except RunStopped as stop:  # (not `run --resume`: a peer process resumes as it started)
        again = ["peer", args.config, "--peers", str(source), "--id", str(args.id),
                 *[x for o in args.overrides for x in ("--set", o)]]  # fmt: skip
        stop.resume = shlex.join(["gossip-pfl", *again, "--out", str(run_dir), "--resume"])
        print(f"gossip-pfl: {stop}")
        return stop.code
    finally:
        comm.close()
    log(f"process {args.id}: done, {summary['test_accuracy']:.4f} mean test accuracy of its "
        f"peers; links {summary['links']}")  # fmt: skip
    return 0


def _check_workload(cfg: RunConfig) -> None:
    """Peer processes run the model workload's gossip algorithms (PeerTrainer is a Trainer)."""
    from gossip_pfl.algorithms import get_algorithm

    if get_algorithm(cfg.algorithm.name).workload != "model":
        raise GossipError(
            f"runtime.transport zmq: algorithm '{cfg.algorithm.name}' is not a model-training "
            "algorithm; peer processes run dsgd, dfedem and local (gossip schedules)"
        )


def _training_peers(dataset) -> int:
    """The run's peers: its clients less the unseen ones."""
    return len(dataset.clients) - len(getattr(dataset, "unseen", []) or [])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: is it there (a zombie counts until its parent reaps it)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# ---- many processes on one machine ----------------------------------------------------
def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together while they are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cmd_peers_local(args: argparse.Namespace) -> int:
    if args.resume:
        return _resume_local(args)
    if args.config is None or args.n is None:
        raise GossipError("peers-local needs CONFIG and -n N (or --resume RUN_DIR)")
    if args.n < 1:
        raise GossipError(f"-n must be >= 1 (got {args.n})")
    read_yaml(args.config)
    cfg = load_config(args.config, [*args.overrides, "runtime.transport=zmq"])
    _check_workload(cfg)
    for kill in cfg.runtime.faults.kill:  # before any process starts (they would check alone)
        if kill["id"] >= args.n:
            raise GossipError(f"runtime.faults.kill: id {kill['id']} is not one of the "
                              f"-n {args.n} processes (ids 0..{args.n - 1})")  # fmt: skip
    from gossip_pfl.data import load_dataset  # numpy only: the launcher stays without torch

    # before any process starts: each would load the data only to find it has no peer
    n = _training_peers(load_dataset(cfg.data.name, **cfg.data.options))
    if args.n > n:
        raise GossipError(f"-n {args.n}: the run has {n} peers, so at most {n} processes "
                          "(one or more peers each)")  # fmt: skip
    run_dir = Path(args.out or cfg.out)
    # a file, or another run of any kind (a gossip-pfl run's folder was written over, its
    # checkpoint and figures left beside the new run's merged files)
    check_out_dir(run_dir, resume=False, overwrite=args.overwrite)
    if (run_dir / "peers").exists() and not args.overwrite:
        raise GossipError(
            f"out: {run_dir} holds another peer-to-peer run; choose another --out or "
            "replace it with --overwrite"
        )
    with _holding(run_dir):  # (a run still going there: refused before anything is touched)
        if args.overwrite and run_dir.is_dir():
            check_processes_stopped(run_dir)  # (a launcher stopped alone leaves them running)
            shutil.rmtree(run_dir / "peers", ignore_errors=True)
            # and the old run's merged files, logs (appended to), checkpoint and figures: a new
            # run that fails must not leave them beside its own processes' outputs
            shutil.rmtree(run_dir / "logs", ignore_errors=True)
            for name in ("metrics.jsonl", "config.yaml"):  # (a gossip-pfl run's config named it)
                (run_dir / name).unlink(missing_ok=True)
            clear_outputs(run_dir)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        peers = _write_peers(run_dir, args.n)
        base = ["peer", args.config, "--peers", str(peers), "--out", str(run_dir), "--quiet"]
        for o in args.overrides:
            base += ["--set", o]
        # each process's command to continue it, there from the start (a process killed outright
        # prints none)
        resume = "".join(f"gossip-pfl {shlex.join([*base, '--id', str(k), '--resume'])}\n"
                         for k in range(args.n))  # fmt: skip
        write_text(run_dir / "logs" / RESUME_COMMANDS, resume)
        restarts = {k["id"]: k["restart"] for k in cfg.runtime.faults.kill if "restart" in k}
        return _launch(run_dir, [[*base, "--id", str(k)] for k in range(args.n)], restarts)


def _resume_local(args: argparse.Namespace) -> int:
    """``peers-local --resume RUN_DIR``: every process of RUN_DIR resumed from its own folder
    (its config as it ran, ``--set`` added), on fresh ports, then merge. The folder may have
    moved since: nothing is read from the commands it started with."""
    run_dir = Path(args.resume)
    given = [f for f, v in (("CONFIG", args.config), ("-n", args.n), ("--out", args.out),
                            ("--overwrite", args.overwrite)) if v]  # fmt: skip
    if given:
        raise GossipError(f"--resume {run_dir} continues that run as it started: drop "
                          f"{', '.join(given)} (--set may change rounds)")  # fmt: skip
    if not is_peer_run(run_dir):
        raise GossipError(f"--resume {run_dir}: not a peers-local run's folder (it has no "
                          "peers.yaml and peers/)")  # fmt: skip
    peers = run_dir / "peers.yaml"
    table = read_yaml(peers)
    if not isinstance(table, dict) or not table:
        raise GossipError(f"--resume {run_dir}: {peers} names no processes")
    configs = [run_dir / "peers" / str(k) / "config.yaml" for k in range(len(table))]
    for k, config in enumerate(configs):
        if not config.is_file():
            raise GossipError(f"--resume {run_dir}: process {k} never started (no {config}); "
                              "start the run again")  # fmt: skip
    folders = [f for f in (run_dir / "peers").iterdir() if f.name.isdigit()]
    if len(folders) != len(table):  # (2 processes trained 3 processes' checkpoints)
        raise GossipError(f"--resume {run_dir}: {peers} names {len(table)} processes, but "
                          f"peers/ holds the folders of {len(folders)}")  # fmt: skip
    extra = [x for o in args.overrides for x in ("--set", o)]
    argvs = [["peer", str(config), "--peers", str(peers), "--out", str(run_dir), "--quiet",
              "--id", str(k), "--resume", *extra] for k, config in enumerate(configs)]  # fmt: skip
    cfg = load_config(configs[0], [*args.overrides, "runtime.transport=zmq"], unread=False,
                      saved=True)  # fmt: skip
    _check_finished(run_dir, configs, cfg.rounds)
    if any(o.split("=", 1)[0].strip() == "rounds" for o in args.overrides):
        _check_rounds(run_dir, len(configs), cfg.rounds)
    # the kill schedule still holds: a process that goes back before its kill crashes there
    # (a stop and resume dropped it, unsaid), its restart on standby (only where it can)
    kills = [k for k in cfg.runtime.faults.kill if "restart" in k]
    restarts = {k["id"]: k["restart"] for k in kills
                if k["round"] > _earliest(run_dir / "peers" / str(k["id"]))}  # fmt: skip
    with _holding(run_dir):  # (its launcher still going: refused before anything is touched)
        # the old ports may be taken now: all restart on new ones; and the commands that
        # continue each process, as they now are (the folder may have moved)
        _write_peers(run_dir, len(configs))
        write_text(run_dir / "logs" / RESUME_COMMANDS,
                   "".join(f"gossip-pfl {shlex.join(a)}\n" for a in argvs))  # fmt: skip
        return _launch(run_dir, argvs, restarts)


def _check_rounds(run_dir: Path, n: int, rounds: int) -> None:
    """A new ``rounds`` is not below any process's checkpoint (one refused, one declared
    itself finished there, the third waited runtime.timeout_s for them)."""
    from gossip_pfl import checkpoint  # (torch: only when rounds changes)

    for k in range(n):
        try:  # (read once; a damaged or missing one is the process's own to say)
            done = checkpoint.load(run_dir / "peers" / str(k)).get("rounds_done")
        except GossipError:
            continue
        if isinstance(done, int) and done > rounds:
            raise GossipError(f"--set rounds={rounds}: process {k}'s checkpoint is of "
                              f"round {done}; give rounds >= {done}")  # fmt: skip


def _earliest(folder: Path) -> int:
    """The earliest round a process's folder can resume at: its oldest kept checkpoint (0
    without a checkpoint; its own checkpoint's round is not read here, which needs torch)."""
    kept = kept_rounds(folder) if (folder / CHECKPOINT_FILE).is_file() else []
    return kept[0] if kept else 0


def _check_finished(run_dir: Path, configs: list[Path], rounds: int) -> None:
    """Processes that finished ``rounds`` do not join a resume: one that stopped earlier then
    waited runtime.timeout_s for them and said they did not answer."""
    done = [k for k, c in enumerate(configs) if _finished(c.parent / "summary.json", rounds)]
    if done and len(done) < len(configs):
        left = [k for k in range(len(configs)) if k not in done]
        raise GossipError(f"--resume {run_dir}: process(es) {done} finished their {rounds} "
                          f"rounds, {left} did not: they cannot go on alone (raise rounds "
                          "with --set rounds=N to go on with all of them)")  # fmt: skip


def _finished(summary: Path, rounds: int) -> bool:
    try:
        return json.loads(summary.read_text()).get("round") == rounds
    except (OSError, ValueError, AttributeError):
        return False


def _write_peers(run_dir: Path, n: int) -> Path:
    """RUN_DIR/peers.yaml: ``n`` processes on free loopback ports; its path."""
    peers = run_dir / "peers.yaml"
    write_text(peers, "".join(f"{k}: 127.0.0.1:{p}\n" for k, p in enumerate(free_ports(n))))
    return peers


@contextmanager
def _holding(run_dir: Path):
    """The launcher holds RUN_DIR while its processes run and it merges (rundir.RunLock):
    another launcher, or a run written over it, is refused (each deleted the processes'
    folders under them)."""
    write(run_dir / "logs", lambda p: p.mkdir(parents=True, exist_ok=True))
    lock = RunLock(run_dir).acquire()
    try:
        yield
    finally:
        lock.release()


def _launch(run_dir: Path, argvs: list[list[str]], restarts: dict[int, int]) -> int:
    """Start a process per command line (``gossip-pfl ARGV``; process k logs to
    RUN_DIR/logs/k.txt), restart those the kill schedule crashes, then merge."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # what the logs held before (a resume appends): a process that fails is named with a line
    # of its own (one killed at its start was named with the last session's last line)
    logs = [run_dir / "logs" / f"{k}.txt" for k in range(len(argvs))]
    before = [log.stat().st_size if log.is_file() else 0 for log in logs]
    # on Linux the processes fork from one server that loaded torch once (peer_server.py);
    # elsewhere (forking after torch has loaded is unsafe on macOS) each is an interpreter
    server = None
    if sys.platform.startswith("linux"):
        from gossip_pfl.peer_server import PeerServer

        server = PeerServer(env, str(run_dir / "logs" / "server.txt"))

    def start(k: int, rejoin: list[str] = ()):
        log = run_dir / "logs" / f"{k}.txt"
        argv = [*argvs[k], *rejoin]
        if server is not None:
            return server.start(argv, str(log))
        with open(log, "a") as out:  # (the child holds its own copy)
            cmd = [sys.executable, "-m", "gossip_pfl", *argv]
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    running: dict = {}  # (filled by _watch: a SIGTERM passes on to them)
    # SIGTERM to the launcher alone (`timeout`, a scheduler) as a Ctrl-C: it left its
    # processes running and said nothing
    with SigtermAsInterrupt() as term:
        try:
            codes = _watch(start, len(argvs), restarts, running)
        except BaseException as err:  # (Ctrl-C, an error: no start still queued may fork one)
            if term.received:  # each ends its round and saves its checkpoint, as on Ctrl-C
                for proc in running.values():
                    with contextlib.suppress(OSError):
                        os.kill(proc.pid, signal.SIGTERM)
                for proc in running.values():
                    proc.wait()
            # the hint first: a second Ctrl-C while the server closes cannot lose it
            if isinstance(err, KeyboardInterrupt):
                commands = run_dir / "logs" / RESUME_COMMANDS
                print(f"gossip-pfl: to continue: gossip-pfl peers-local --resume {run_dir} (or "
                      f"run every command of {commands} at once, then gossip-pfl merge "
                      f"{run_dir}; docs/p2p.md)", file=sys.stderr)  # fmt: skip
            if server is not None:
                server.close(abort=True)
            if term.received:
                return 128 + signal.SIGTERM
            raise
        else:
            if server is not None:
                server.close()
    lines = [_since(log, size) for log, size in zip(logs, before, strict=True)]
    failed = {k: c for k, c in codes.items() if c not in (0, KILLED_EXIT)}
    if failed:
        k, code = sorted(failed.items())[0]
        last = lines[k][-1] if lines[k] else f"(nothing in {logs[k]})"
        print(f"gossip-pfl: process {k} exited with code {code}: {last}", file=sys.stderr)
        return code if code > 0 else 1
    # where each went on (a roll-back to the round all held, a rejoin): said in its log only
    for said in lines:
        for line in said:
            if re.match(r"process \d+: (resumes|rejoins) at", line):
                print(line)
    summary = merge(run_dir)
    _print_summary(summary, run_dir)
    return 0


def _since(log: Path, size: int) -> list[str]:
    """The lines a process's log gained past ``size`` bytes (a resume appends to it)."""
    if not log.is_file():
        return []
    with open(log, "rb") as fh:
        fh.seek(size)
        return fh.read().decode(errors="replace").strip().splitlines()


#: RUN_DIR/logs/RESUME_COMMANDS: a peers-local run's commands to continue each process
RESUME_COMMANDS = "resume.txt"


def _watch(start, n: int, restarts: dict[int, int], running: dict | None = None) -> dict[int, int]:
    """Start processes ``0..n-1`` (``start(k, extra_args)``), restart those the kill schedule
    crashes, and wait for all; their exit codes by id. ``running``: filled with the processes
    still running, by id."""
    running = {} if running is None else running
    for k in range(n):
        running[k] = start(k)
    # a restart's process starts now, on standby: it loads its data, takes the port once the
    # crashed process has exited (and been reaped), then waits for the others to reach the
    # restart round
    standby = {k: start(k, ["--resume", "--wait-round", str(r), "--after-pid",
                            str(running[k].pid)]) for k, r in restarts.items()}  # fmt: skip
    codes: dict[int, int] = {}
    while running or standby:  # each process is bounded by its own timeouts
        for k, p in list(running.items()):
            if p.poll() is None:
                continue
            del running[k]
            if p.returncode == KILLED_EXIT and k in standby:
                running[k] = standby.pop(k)
            else:
                codes[k] = p.returncode
        if not running:  # a standby whose process was never killed
            for p in standby.values():
                p.kill()
                p.wait()
            standby = {}
        time.sleep(0.05)
    return codes


# ---- merging ---------------------------------------------------------------------------
def merge(run_dir: str | Path) -> dict:
    """Combine RUN_DIR/peers/*/ into RUN_DIR/metrics.jsonl and RUN_DIR/summary.json; returns
    the summary. Per round: the usual accuracies and losses over the peers that reported it
    (``peers_reporting``); at the end, the consensus distance from the processes' last
    checkpoints; over the run, the links lost, the ends that disagreed, and the drift of the
    peers' average that the mixing caused (0 up to rounding when every link was decided alike
    by its two ends)."""
    run_dir = Path(run_dir)
    folders = sorted((p for p in (run_dir / "peers").glob("*") if p.name.isdigit()),
                     key=lambda p: int(p.name))  # fmt: skip
    if not folders:
        raise GossipError(f"merge: no process outputs in {run_dir / 'peers'}")
    per_process = {
        int(f.name): [_metrics_row(f / "metrics.jsonl", r) for r in read_rows(f / "metrics.jsonl")]
        for f in folders
    }
    algorithm, rounds_total = _run_config(folders[0] / "config.yaml")
    _check_same_config(folders)
    rounds = sorted({r["round"] for rows in per_process.values() for r in rows})
    merged = []
    for rnd in rounds:
        rows = {k: r for k, rows in per_process.items() for r in rows if r["round"] == rnd}
        merged.append(_merge_round(rnd, rows))
    if not merged:
        raise GossipError(f"merge: no metrics rows in {run_dir / 'peers'}/*/metrics.jsonl")
    links = _merge_links(folders)
    rejoins = _rejoins(folders)
    final = _final_consensus(folders, merged[-1])
    rewrite_rows(run_dir / "metrics.jsonl", merged)
    last = merged[-1]
    summary = {
        "algorithm": algorithm,
        "transport": "zmq",
        "rounds": rounds_total,
        "processes": len(folders),
        **{
            k: last[k]
            for k in (
                "test_accuracy",
                "test_accuracy_p10",
                "test_accuracy_weighted",
                "train_accuracy",
                "train_loss",
                "peers_reporting",
            )
        },  # fmt: skip
        **final,
        # the slowest process's loop, evaluations included (as gossip-pfl run's)
        "wall_seconds": max(
            (_wall_seconds(f / "summary.json") for f in folders if (f / "summary.json").is_file()),
            default=float("nan"),
        ),
        "bytes_sent": last["bytes_sent"],
        "client_test_accuracy": last["client_test_accuracy"],
        **{k: v for k, v in last.items() if k.startswith("mixture_")},
        "links": links,
        **({"rejoins": rejoins} if rejoins else {}),
    }
    write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


#: a process's metrics row: its peers' values, one list entry per peer
_PER_PEER = ("peer_train_accuracy", "peer_train_loss", "peer_train_count",
             "peer_test_accuracy", "peer_test_loss", "peer_test_count")  # fmt: skip


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _numbers(x, length: int | None = None) -> bool:
    """A list of numbers (of ``length``)."""
    return (isinstance(x, list) and (length is None or len(x) == length)
            and all(is_number(v) for v in x))  # fmt: skip


def _metrics_row(path: Path, row: dict) -> dict:
    """A process's metrics row with what merge reads checked; a damaged one is named by file,
    round and key (a KeyError or IndexError deep in the merge said neither)."""
    if not _is_count(row.get("round")):
        raise GossipError(f"{path}: a row's round is {row.get('round')!r}, not a round number")
    where = f"{path}, round {row['round']}"
    peers = row.get("peers")
    if not (isinstance(peers, list) and peers and all(_is_count(p) for p in peers)
            and len(set(peers)) == len(peers)):  # fmt: skip
        raise GossipError(f"{where}: peers is {peers!r}, not a list of distinct peer ids")
    for key in _PER_PEER:
        if not _numbers(row.get(key), len(peers)):
            raise GossipError(f"{where}: {key} is not {len(peers)} numbers (one per peer)")
    for key in ("bytes_sent", "messages_sent"):
        if not _is_count(row.get(key)):
            raise GossipError(f"{where}: {key} is {row.get(key)!r}, not a count")
    pi = row.get("peer_pi")
    if pi is not None and not (isinstance(pi, list) and len(pi) == len(peers) and pi
                               and all(_numbers(w, len(pi[0])) for w in pi)):  # fmt: skip
        raise GossipError(f"{where}: peer_pi is not {len(peers)} lists of mixture weights")
    return row


def _check_same_config(folders: list[Path]) -> None:
    """Every process ran process 0's config (where it wrote and how it ran aside): processes
    started with different --set trained together and merged into one run's figures."""
    from gossip_pfl.checkpoint import PEER_PROCESS, config_differences

    first = read_yaml(folders[0] / "config.yaml")
    for f in folders[1:]:
        keys = config_differences(first, read_yaml(f / "config.yaml"), skip=PEER_PROCESS)
        if keys:
            raise GossipError(f"merge: process {f.name} ran another config than process "
                              f"{folders[0].name} (keys differ: {', '.join(keys)})")  # fmt: skip


def _run_config(path: Path) -> tuple[str, int]:
    """The run's algorithm and rounds, from a process's config.yaml."""
    cfg = read_yaml(path)
    name = cfg.get("algorithm", {}).get("name") if isinstance(cfg.get("algorithm"), dict) else None
    if not isinstance(name, str) or not _is_count(cfg.get("rounds")):
        raise GossipError(f"{path}: not a run's config (no algorithm.name or rounds)")
    return name, cfg["rounds"]


def _wall_seconds(path: Path) -> float:
    """A process's ``wall_seconds`` from its summary; a damaged summary is named."""
    try:
        value = json.loads(path.read_text())["wall_seconds"]
    except (ValueError, TypeError, KeyError, IndexError) as e:  # JSONDecodeError: a ValueError
        raise GossipError(f"{path}: not a process summary with wall_seconds ({e!r})") from None
    if not is_number(value):
        raise GossipError(f"{path}: wall_seconds is {value!r}, not a number")
    return float(value)


def _merge_round(rnd: int, by_process: dict[int, dict]) -> dict:
    """One merged row from each process's row of round ``rnd`` (checked by _metrics_row)."""
    owner: dict[int, int] = {}
    for k, r in by_process.items():
        for p in r["peers"]:
            if p in owner:  # two processes' outputs in one folder, or a copied one
                raise GossipError(f"merge: round {rnd}: peer {p} is reported by process "
                                  f"{owner[p]} and by process {k}")  # fmt: skip
            owner[p] = k
    rows = list(by_process.values())
    peers = np.concatenate([r["peers"] for r in rows])
    order = np.argsort(peers)

    def cat(key):
        return np.concatenate([np.asarray(r[key], dtype=np.float64) for r in rows])[order]

    tr_acc, tr_loss, tr_n = (
        cat("peer_train_accuracy"),
        cat("peer_train_loss"),
        cat("peer_train_count"),
    )
    te_acc, te_loss, te_n = cat("peer_test_accuracy"), cat("peer_test_loss"), cat("peer_test_count")
    n_total = int(peers.max()) + 1
    client = [None] * n_total
    for p, a in zip(peers[order], client_accuracies(te_acc, te_n)):  # (None: no test sample)
        client[int(p)] = a
    row = {
        "round": rnd,
        "peers_reporting": len(peers),
        **score_entries((tr_loss, tr_acc, tr_n), (te_loss, te_acc, te_n)),
        "bytes_sent": int(sum(r["bytes_sent"] for r in rows)),
        "messages_sent": int(sum(r["messages_sent"] for r in rows)),
        "client_test_accuracy": client,
    }
    if all(r.get("peer_pi") is not None for r in rows):  # (a null one: no weights there)
        row.update(mixture_entries(np.concatenate([r["peer_pi"] for r in rows])[order]))
    return row


def _rejoins(folders: list[Path]) -> dict[str, list[list[int]]]:
    """Each process's resumes at a later round than its checkpoint's, [checkpoint, start]:
    its peers did not train the rounds between (a restart into a running run, or processes
    resumed together that held no round in common)."""
    out = {}
    for f in folders:
        rows = read_rows(f / REJOINS)
        for e in rows:
            if not (_is_count(e.get("checkpoint")) and _is_count(e.get("start"))):
                raise GossipError(f"{f / REJOINS}: a row without checkpoint and start rounds")
        if rows:
            out[f.name] = [[e["checkpoint"], e["start"]] for e in rows]
    return out


def _merge_links(folders: list[Path]) -> dict:
    """Links lost and disagreements over the run, and the drift of the average: per mixing
    step, the change of the sum of every process's rows (on the sampled coordinates), over
    the number of peers, relative to the size of the average."""
    steps: dict[tuple, dict[int, dict]] = {}
    width = None  # the sampled coordinates: the same for every process and step
    for f in folders:
        for e in read_rows(f / "links.jsonl"):
            where = f"{f / 'links.jsonl'}, round {e.get('round')!r}"
            if not (_is_count(e.get("round")) and _is_count(e.get("phase"))):
                raise GossipError(f"{where}: a row without a round and phase number")
            for key in ("links", "lost"):
                if not (isinstance(e.get(key), list) and all(_is_count(j) for j in e[key])):
                    raise GossipError(f"{where}: {key} is {e.get(key)!r}, not a list of ids")
            if width is None and isinstance(e.get("before"), list):
                width = len(e["before"])
            for key in ("before", "change"):
                if not _numbers(e.get(key), width):
                    raise GossipError(f"{where}: {key} is not {width} numbers (the sample)")
            steps.setdefault((e["round"], e["phase"]), {})[int(f.name)] = e
    lost_ends = disagree = ends = 0
    worst, total_change, size = 0.0, None, 1e-30
    for _, by in sorted(steps.items()):
        counted = {k: set(e["links"]) - set(e["lost"]) for k, e in by.items()}
        for k, e in by.items():
            ends += len(e["links"])
            lost_ends += len(e["lost"])
            for j in e["links"]:
                if j in by and k < j and k in by[j]["links"]:
                    disagree += (j in counted[k]) != (k in counted[j])
        change = np.sum([e["change"] for e in by.values()], axis=0)
        before = np.linalg.norm(np.sum([e["before"] for e in by.values()], axis=0))
        size = max(before, 1e-30)
        worst = max(worst, float(np.linalg.norm(change) / size))
        total_change = change if total_change is None else total_change + change
    return {
        "exchanges": len(steps),
        "link_ends": ends,
        "link_ends_lost": lost_ends,
        "disagreements": disagree,
        # the average's largest relative change in one mixing step, and over the whole run
        "drift_max_step": worst,
        "drift_total": 0.0 if total_change is None else float(np.linalg.norm(total_change) / size),
    }


def _final_consensus(folders: list[Path], last: dict) -> dict:
    """The consensus distance after the last round, from the processes' checkpoints (each
    holds its own peers' rows), when every process saved that round."""
    from gossip_pfl import checkpoint

    states = []
    for f in folders:
        try:
            state = checkpoint.load(f)
        except GossipError as err:
            warnings.warn(f"merge: no consensus distance ({err})", stacklevel=2)
            return {}
        if state["rounds_done"] != last["round"]:  # e.g. a process killed for good
            warnings.warn(f"merge: no consensus distance (process {f.name}'s checkpoint is of "
                          f"round {state['rounds_done']}, the run's last is {last['round']})",
                          stacklevel=2)  # fmt: skip
            return {}
        states.append(state)
    _check_disjoint(folders, states)
    shared = sum(s["shared"].double() for s in states)  # rows of other processes are zeros
    mean = shared.mean(0)
    dist = ((shared - mean) ** 2).sum(dim=(0, 2)) / shared.shape[0]
    return {"consensus_distance": dist.tolist()}


def _check_disjoint(folders: list[Path], states: list[dict]) -> None:
    """Each peer's rows in exactly one process's checkpoint (its last metrics row names its
    peers): a checkpoint copied into another process's folder summed a peer twice and left
    another out, a consensus distance 50x too large and no word said."""
    owner: dict[int, str] = {}
    n = states[0]["shared"].shape[0]
    for f, state in zip(folders, states):
        rows = state.get("rows") or [{}]
        peers = rows[-1].get("peers") if isinstance(rows[-1], dict) else None
        if state["shared"].shape != states[0]["shared"].shape or not isinstance(peers, list):
            raise GossipError(f"merge: {f / CHECKPOINT_FILE} is not one of this run's checkpoints")
        for p in peers:
            if p in owner:
                raise GossipError(f"merge: peer {p} is in the checkpoints of process {owner[p]} "
                                  f"and of process {f.name}: was one copied?")  # fmt: skip
            owner[p] = f.name
    if sorted(owner) != list(range(n)):
        missing = sorted(set(range(n)) - set(owner)) or ["?"]
        raise GossipError(f"merge: no checkpoint holds peer {missing[0]} ({len(owner)} peers "
                          f"in {len(folders)} checkpoints, of {n})")  # fmt: skip


def _print_summary(summary: dict, run_dir: Path) -> None:
    print(f"results ({summary['algorithm']}, {summary['processes']} processes, merged into "
          f"{run_dir / 'summary.json'}):")  # fmt: skip
    for k in ("test_accuracy", "test_accuracy_p10", "train_accuracy", "peers_reporting",
              "consensus_distance", "wall_seconds"):  # fmt: skip
        v = summary.get(k)
        if isinstance(v, list):
            v = " ".join(f"{w:.3g}" for w in v)
        if v is not None:
            print(f"  {k:<20}  {v:.4f}" if isinstance(v, float) else f"  {k:<20}  {v}")
    ln = summary["links"]
    print(f"  links                 {ln['link_ends_lost']} of {ln['link_ends']} link ends lost, "
          f"{ln['disagreements']} disagreements, drift {ln['drift_total']:.3g}")  # fmt: skip
    for k, spans in summary.get("rejoins", {}).items():
        skipped = ", ".join(f"{a + 1}-{b}" for a, b in spans)
        print(
            f"  rejoined              process {k}'s peers did not train rounds {skipped} "
            "(it resumed at a later round than its checkpoint's: docs/p2p.md)"
        )


def cmd_merge(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if run_dir.is_dir():  # a run still going: its rows so far, merged as a run's results
        RunLock(run_dir).acquire().release()  # (its launcher)
        check_processes_stopped(run_dir)  # (processes whose launcher was stopped alone)
    summary = merge(run_dir)
    _print_summary(summary, Path(args.run_dir))
    return 0

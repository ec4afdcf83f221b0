"""Peer-to-peer runs over pyzmq on loopback: peer processes give the one-process results, a
lost link is decided alike by both ends (so the average is kept), a killed peer restarts and
rejoins, bad messages are never mixed in, and bad peers files stop with one line (exit 2)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gossip_pfl import cli_peer
from gossip_pfl.cli import main
from gossip_pfl.cli_peer import free_ports
from gossip_pfl.errors import GossipError

zmq = pytest.importorskip("zmq")
zc = pytest.importorskip("gossip_pfl.runtime.zmq_comm")

ROOT = Path(__file__).resolve().parent.parent

CONFIG = {
    "seed": 1234,
    "rounds": 6,
    "data": {"name": "synthetic", "n_clients": 8, "n_test": 200, "dim": 20, "cache": False},
    "model": {"name": "linear"},
    "eval": {"every": 3},
    "algorithm": {"name": "dfedem", "components": 3, "lr": 0.1, "batch_size": 32},
    "schedule": {"graph": "ring", "weights": "metropolis"},
    "runtime": {"device": "cpu", "timeout_s": 60, "link_timeout_s": 20},
    "checkpoint_every": 2,
}


def _config(tmp_path: Path, **runtime) -> Path:
    cfg = {**CONFIG, "runtime": {**CONFIG["runtime"], **runtime}, "out": str(tmp_path / "run")}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _ports(n: int) -> dict[int, str]:
    """n distinct free loopback addresses, by rank."""
    return {r: f"127.0.0.1:{port}" for r, port in enumerate(free_ports(n))}


def _cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "gossip_pfl", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)  # fmt: skip


def _same_results(one: Path, run: Path) -> dict:
    """A merged peer-to-peer run's summary against one process's (float32 rounding apart)."""
    a = json.loads((one / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    for key in ("test_accuracy", "test_accuracy_p10", "train_accuracy", "train_loss"):
        assert abs(a[key] - b[key]) < 1e-4, key
    np.testing.assert_allclose(b["client_test_accuracy"], a["client_test_accuracy"], atol=1e-4)
    np.testing.assert_allclose(b["consensus_distance"], a["consensus_distance"], rtol=1e-4)
    np.testing.assert_allclose(b["mixture_weights"], a["mixture_weights"], atol=1e-4)
    assert b["peers_reporting"] == 8 and b["processes"] == 3
    return b


def test_peer_processes_equal_one_process(tmp_path, capsys):
    """D-FedEM on the synthetic data: 3 peer processes (3, 3 and 2 peers), merged, against
    the same config in one process (torch transport). Then the same processes stopped at
    different rounds resume together as the uninterrupted run goes on (below)."""
    cfg = _config(tmp_path)
    # the reference in this process (no interpreter start-up): the peers need their own
    assert main(["run", str(cfg), "--out", str(tmp_path / "one"), "--quiet", "--no-plots"]) == 0
    assert main(["peers-local", str(cfg), "-n", "3"]) == 0
    shutil.copytree(tmp_path / "run", tmp_path / "stopped")  # (for the resume below)
    b = _same_results(tmp_path / "one", tmp_path / "run")
    links = b["links"]
    assert links["link_ends_lost"] == 0 and links["disagreements"] == 0
    assert links["drift_total"] < 1e-5  # float32 rounding only
    merged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in merged] == [3, 6]

    def strict(text):  # JSON proper: no NaN (a peer's rows held a NaN consensus distance)
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text[:60]}"))

    for f in (tmp_path / "run" / "peers").glob("*/metrics.jsonl"):
        [strict(line) for line in f.read_text().splitlines()]
    # a process killed while writing a row leaves it cut short: merge leaves that row out
    rows = tmp_path / "run" / "peers" / "1" / "metrics.jsonl"
    rows.write_text(rows.read_text() + '{"round": 9, "pe')
    assert main(["merge", str(tmp_path / "run")]) == 0
    again = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [strict(x) for x in again] == merged
    # a checkpoint copied over another process's: peer 0 twice, peers 3 to 5 nowhere (merge
    # gave a consensus distance 50x too large)
    shutil.copy(tmp_path / "run/peers/0/checkpoint.pt", tmp_path / "run/peers/1/checkpoint.pt")
    with pytest.raises(GossipError, match="peer 0 is in the checkpoints of process 0 and of "
                                          "process 1: was one copied"):  # fmt: skip
        cli_peer.merge(tmp_path / "run")

    # Processes stopped at different rounds: process 1 after round 4 (killed after its
    # round-4 checkpoint), processes 0 and 2 after round 6. Resumed together to round 8, all
    # go back to the latest round all three hold, and the run ends as one of 8 rounds does
    # (before, all started at 6, process 1's peers skipping rounds 5-6). That would be round
    # 4, but process 0's kept/4.pt is damaged: left out (it was agreed on, then replaced the
    # process's good checkpoint), they go back to round 2
    run, one = tmp_path / "stopped", tmp_path / "one8"
    shutil.copy(run / "peers/1/kept/4.pt", run / "peers/1/checkpoint.pt")
    (run / "peers/1/summary.json").unlink()
    damaged = bytearray((run / "peers/0/kept/4.pt").read_bytes())
    damaged[-100] ^= 0xFF
    (run / "peers/0/kept/4.pt").write_bytes(bytes(damaged))
    capsys.readouterr()
    assert main(["peers-local", "--resume", str(run), "--set", "rounds=8"]) == 0
    said = capsys.readouterr().out  # (in each process's log; the launcher passes it on)
    for k, first in enumerate((6, 4, 6)):
        assert f"process {k}: resumes at round 2, where every process can go on (its own " \
               f"checkpoint: {first})" in said, said  # fmt: skip
    for k in range(3):  # each went back to round 2
        rounds = [json.loads(x)["round"] for x in (run / f"peers/{k}/links.jsonl").open()]
        assert rounds == [*range(6), *range(2, 8)], (k, rounds)
    assert "4.pt: checkpoint is corrupt" in (run / "logs/0.txt").read_text()
    assert main(["run", str(cfg), "--out", str(one), "--set", "rounds=8", "--quiet",
                 "--no-plots"]) == 0  # fmt: skip
    merged = _same_results(one, run)
    assert "rejoins" not in merged and merged["links"]["link_ends_lost"] == 0
    # (3 processes, checkpoint_every 2: the last 3 multiples, to span 3 rounds)
    assert sorted(p.name for p in (run / "peers/0/kept").iterdir()) == ["4.pt", "6.pt", "8.pt"]


def test_peers_local_resume_reads_the_run_folder(tmp_path, capsys, monkeypatch):
    """What `peers-local --resume` finds in the folder, before any process starts: the kill
    schedule still holds (a stop and resume dropped its crash, unsaid: a process that goes
    back before it crashes there, its restart on standby); processes that finished cannot go
    on with one that stopped earlier (it waited timeout_s for them, then said they did not
    answer); a peers file that names fewer processes than the folder holds (two processes
    trained three processes' checkpoints)."""
    launched = []
    monkeypatch.setattr(cli_peer, "_launch", lambda run_dir, argvs, restarts:
                        launched.append((len(argvs), restarts)) or 0)  # fmt: skip
    run = tmp_path / "run"
    kill = {"kill": [{"id": 1, "round": 3, "restart": 5}]}
    cfg = {**CONFIG, "runtime": {**CONFIG["runtime"], "transport": "zmq", "faults": kill}}
    for k in range(3):
        (run / "peers" / str(k)).mkdir(parents=True)
        (run / "peers" / str(k) / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "peers.yaml").write_text(yaml.safe_dump(_ports(3)))
    assert main(["peers-local", "--resume", str(run)]) == 0
    assert launched == [(3, {1: 5})]
    # process 1 can go back no further than its oldest kept round, 4: past its kill at 3,
    # so no restart waits on standby (it gave up after runtime.timeout_s, with an error line)
    (run / "peers/1/kept").mkdir()
    for name in ("checkpoint.pt", "kept/4.pt", "kept/6.pt"):
        (run / "peers/1" / name).write_bytes(b"")
    assert main(["peers-local", "--resume", str(run)]) == 0
    assert launched[-1] == (3, {})
    (run / "peers/2/summary.json").write_text(json.dumps({"round": 6}))
    assert main(["peers-local", "--resume", str(run)]) == 2
    assert "process(es) [2] finished their 6 rounds, [0, 1] did not: they cannot go on alone " \
           "(raise rounds with --set rounds=N" in capsys.readouterr().err  # fmt: skip
    assert main(["peers-local", "--resume", str(run), "--set", "rounds=9"]) == 0
    from gossip_pfl import checkpoint  # rounds below a checkpoint's: one process refused,

    checkpoint.save({"rounds_done": 10}, run / "peers/0")  # one ended, one waited timeout_s
    assert main(["peers-local", "--resume", str(run), "--set", "rounds=9"]) == 2
    assert "--set rounds=9: process 0's checkpoint is of round 10; give rounds >= 10" in \
        capsys.readouterr().err  # fmt: skip
    (run / "peers.yaml").write_text(yaml.safe_dump(_ports(2)))
    assert main(["peers-local", "--resume", str(run), "--set", "rounds=9"]) == 2
    assert "peers.yaml names 2 processes, but peers/ holds the folders of 3" in \
        capsys.readouterr().err  # fmt: skip
    assert len(launched) == 3


def test_a_damaged_or_lost_checkpoint_resumes_from_the_latest_kept_one(tmp_path):
    """A process whose checkpoint.pt was damaged failed alone while the others ran on (the
    run could not be resumed again); one whose checkpoint.pt was gone restarted from round 0,
    its peers skipping every round. Both resume from the latest whole kept checkpoint, with a
    warning; with none, as before (the damage named, or the initial state)."""
    from gossip_pfl import checkpoint
    from gossip_pfl.peer import PeerTrainer

    def tr():
        return PeerTrainer.__new__(PeerTrainer)

    (tmp_path / "kept").mkdir()
    for r in (2, 4, 5):  # kept 2 and 4, then the latest
        checkpoint.save({"rounds_done": r}, tmp_path)
        if r < 5:
            shutil.copy(tmp_path / "checkpoint.pt", tmp_path / f"kept/{r}.pt")
    assert tr()._own_checkpoint(tmp_path) == "checkpoint.pt"  # whole: itself
    assert checkpoint.load(tmp_path)["rounds_done"] == 5
    (tmp_path / "checkpoint.pt").write_bytes(b"cut")
    with pytest.warns(UserWarning, match="checkpoint.pt: damaged; resuming from kept/4.pt"):
        assert tr()._own_checkpoint(tmp_path) == "checkpoint.pt"
    assert checkpoint.load(tmp_path)["rounds_done"] == 4
    (tmp_path / "checkpoint.pt").unlink()
    (tmp_path / "kept/4.pt").write_bytes(b"cut")  # (and the latest kept one damaged)
    with pytest.warns(UserWarning) as said:
        assert tr()._own_checkpoint(tmp_path) == "checkpoint.pt"
    said = [str(w.message) for w in said]
    assert len(said) == 2 and "kept/4.pt: not a gossip-pfl checkpoint" in said[0], said
    assert said[1].endswith("checkpoint.pt: none there; resuming from kept/2.pt"), said
    assert checkpoint.load(tmp_path)["rounds_done"] == 2
    shutil.rmtree(tmp_path / "kept")
    (tmp_path / "checkpoint.pt").unlink()
    assert tr()._own_checkpoint(tmp_path) is None


def test_a_process_keeps_enough_checkpoints_to_span_the_processes():
    """As many kept rounds as processes (where every link lands no process gets further
    ahead), at least 2, at most 16 (each older one a full copy; a hello names at most 255)."""
    from types import SimpleNamespace

    from gossip_pfl.peer import PeerTrainer

    tr = PeerTrainer.__new__(PeerTrainer)
    for world, every, keep in [(1, 5, 2), (3, 2, 3), (4, 2, 3), (5, 2, 4), (300, 1, 16)]:
        tr.cfg, tr.comm = SimpleNamespace(checkpoint_every=every), SimpleNamespace(world_size=world)
        assert tr.keep() == keep, (world, every)


def test_a_process_that_never_exchanges_answers_before_it_closes():
    """Local exchanges nothing, so its processes meet only by their hellos. Process 1 starts
    after process 0's first hellos found nobody; 0 hears it, answers and closes at once: it
    closed without lingering for a peer of no exchange, its answer and hellos were thrown
    away, and process 1 waited runtime.timeout_s and exited 2 (`peers-local` of Local failed
    in 1 run of 2)."""
    peers = _ports(2)
    first = zc.ZmqComm(0, peers, "cpu", 5, p2p=True, link_timeout_s=1)

    def run_first():
        try:
            first.join(0, need_all=True)
        finally:
            first.close()

    thread = threading.Thread(target=run_first)
    thread.start()
    time.sleep(0.5)  # its first hellos find nobody
    second = zc.ZmqComm(1, peers, "cpu", 5, p2p=True, link_timeout_s=1)
    try:
        assert second.join(0, need_all=True) == 0
    finally:
        second.close()
        thread.join(10)


def _threads(n: int, fn, *args) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=fn, args=(*args[k], out, k)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _ring_rows(n: int):
    """One float64 row of 7 per rank, and a ring's mixing phase (self and both neighbours,
    weight 1/3 each)."""
    from topologies import Phase

    x = torch.randn(n, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    i = np.arange(n)
    phase = Phase(n, np.concatenate([i, i, i]), np.concatenate([i, (i + 1) % n, (i - 1) % n]),
                  np.full(3 * n, 1 / 3))  # fmt: skip
    return x, phase


@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_lost_links_are_decided_alike_by_both_ends(drop):
    """Seeded link drops: both ends of every dropped link give it up, and a mix that moves
    their weight to the diagonal keeps the average (to rounding)."""
    from gossip_pfl.runtime.exchange import Exchanger
    from gossip_pfl.runtime.placement import Placement

    n, rounds, peers = 4, 6, _ports(4)
    faults = zc.Faults(drop=drop, seed=3)
    comms = [zc.ZmqComm(k, peers, "cpu", 10, p2p=True, link_timeout_s=0.5, faults=faults)
             for k in range(n)]  # fmt: skip
    x, phase = _ring_rows(n)

    def worker(comm, out, k):
        ex = Exchanger(Placement(n, n, k), comm)
        state, lost = x[k : k + 1].clone(), []
        for t in range(rounds):
            comm.set_tag(t, 0)
            state = ex.mix(state, ex.plan(phase, key=0))
            lost.append(comm.last_links["lost"])
        out[k] = (state, lost)

    try:
        out = _threads(n, worker, *[(c,) for c in comms])
    finally:
        for c in comms:
            c.close()
    assert sorted(out) == list(range(n))
    for t in range(rounds):
        drawn = {(a, (a + 1) % n) for a in range(n)
                 if faults.link_down((t, 0, 0, 0), a, (a + 1) % n)}  # fmt: skip
        for a, b in [(a, (a + 1) % n) for a in range(n)]:
            assert (b in out[a][1][t]) == (a in out[b][1][t])  # both ends decided alike
            # every drawn link is lost; a link may also be lost when a dropped one made an end
            # wait out the link timeout (it then comes late to its other neighbours)
            assert (a, b) not in drawn or b in out[a][1][t]
    final = torch.cat([s for s, _ in out.values()])
    torch.testing.assert_close(final.mean(0), x.mean(0), rtol=0, atol=1e-12)
    if drop:
        assert any(lost for _, ls in out.values() for lost in ls)


def test_a_one_process_run_waits_for_nobody():
    """A peers file of one process (`peers-local -n 1`): its start and a restart join at once
    (they waited runtime.timeout_s for an empty list of ranks, then stopped), and a mix over
    a self-loop gives the rows back."""
    from gossip_pfl.runtime.exchange import Exchanger
    from gossip_pfl.runtime.placement import Placement
    from topologies import Phase

    comm = zc.ZmqComm(0, _ports(1), "cpu", 20, p2p=True, link_timeout_s=5)
    try:
        start = time.monotonic()
        assert comm.join(0, need_all=True) == 0
        assert comm.join(3, need_all=False, wait_round=3) == 3
        x = torch.arange(6.0).view(2, 3)
        ex = Exchanger(Placement(2, 1, 0), comm)
        comm.set_tag(3, 0)
        out = ex.mix(x, ex.plan(Phase(2, np.arange(2), np.arange(2), np.ones(2)), key=0))
        torch.testing.assert_close(out, x)
        assert comm.last_links["lost"] == [] and time.monotonic() - start < 5
    finally:
        comm.close()


@pytest.mark.parametrize(
    ("firsts", "holds", "expected"),
    [
        # stopped after rounds 5, 4 and 5 (rank 1 killed after its round-4 checkpoint): all
        # go back to 4, the latest round each holds a checkpoint of
        ([5, 4, 5], [[2, 4, 5], [2, 4], [2, 4, 5]], [4, 4, 4]),
        ([6, 6, 6], [[4, 6], [4, 6], [4, 6]], [6, 6, 6]),  # stopped together: no going back
        # no round in common (stopped too far apart): the rejoin, at the latest round named
        ([9, 3, 9], [[6, 8, 9], [2, 3], [6, 8, 9]], [9, 9, 9]),
        # rank 2 is running at round 7 (no checkpoints named): the others rejoin it there
        ([5, 4, 7], [[2, 4, 5], [2, 4], []], [7, 7, 7]),
    ],
)
def test_processes_resuming_together_start_at_the_latest_round_all_hold(firsts, holds, expected):
    """join with the rounds each process holds checkpoints of: the start each one takes, and
    that a process that resumed so tells a latecomer the round it agreed on."""
    n, peers = 3, _ports(3)
    comms = [zc.ZmqComm(k, peers, "cpu", 10, p2p=True, link_timeout_s=2) for k in range(n)]

    def worker(comm, out, k):
        out[k] = comm.join(firsts[k], need_all=False, holds=tuple(holds[k]))

    try:
        out = _threads(n, worker, *[(c,) for c in comms])
    finally:
        for c in comms:
            c.close()
    assert [out.get(k) for k in range(n)] == expected
    resumed = bool(holds[2]) and set(holds[0]) & set(holds[1]) & set(holds[2])
    # those that resumed together say the round in their hellos (a latecomer starts there)
    assert [c.agreed_round for c in comms] == [expected[0] if resumed else None] * n


def test_a_latecomer_resumes_at_the_round_the_others_agreed_on():
    """A process that hears the others already resumed (their hellos name the round they
    agreed on) starts there if it holds that round, and rejoins the running peers if not."""
    comm = zc.ZmqComm(0, _ports(3), "cpu", 10, p2p=True, link_timeout_s=2)
    try:
        comm._said = {1: (zc.AGREED, (4,)), 2: (zc.RESUMING, (2, 4, 5))}
        assert comm._resume_round((2, 4, 5), [1, 2], [1, 2]) == 4
        assert comm._resume_round((2, 5), [1, 2], [1, 2]) is None  # it lacks round 4
        assert comm._resume_round((2, 4, 5), [1], [1, 2]) is None  # 2 not heard in time
        comm._said[2] = (zc.AGREED, (6,))  # two rounds agreed: no agreement
        assert comm._resume_round((2, 4, 6), [1, 2], [1, 2]) is None
        comm._said[2] = (0, ())  # one running: the rejoin
        assert comm._resume_round((2, 4, 5), [1, 2], [1, 2]) is None
        # while joining, rows of rounds before a running peer's are dropped as they come (a
        # restart kept them all); a resuming peer's round is its checkpoint's: no such bound
        comm._heard = {1: 9, 2: 7}
        assert comm._running_round() == 7
        comm._said[2] = (zc.RESUMING, (2, 4, 7))
        assert comm._running_round() == -1
        # after agreeing: the others' outcomes. One that fell back (it decided without
        # hearing everyone) makes this one fall back too; all agreeing, or silence for a
        # link timeout, confirms (the silent ones are then as lost links)
        comm.link_timeout_s = 0.2
        comm._said = {1: (zc.AGREED, (4,)), 2: (0, ())}
        assert not comm._confirmed([1, 2], 4, 5)
        comm._said[2] = (zc.AGREED, (2,))
        assert not comm._confirmed([1, 2], 4, 5)
        comm._said[2] = (zc.AGREED, (4,))
        assert comm._confirmed([1, 2], 4, 5)
        comm._said[2] = (zc.RESUMING, (2, 4, 7))
        start = time.monotonic()
        assert comm._confirmed([1, 2], 4, 5) and time.monotonic() - start >= 0.2
    finally:
        comm.close()


def test_a_late_process_goes_back_to_where_the_others_went_on():
    """Processes 0 and 1 (checkpoints of round 6) decide without process 2 (round 8, late by
    more than a link timeout) and go on at 6; process 2 went on at 8, a round past them,
    alone: it holds round 6, so it goes back there too."""
    assert _resume_at([(4, 6), (4, 6), (6, 8)], (0, 0, 1.6)) == [6, 6, 6]


def _resume_at(holds: list[tuple], delays: tuple) -> list:
    """The round each process starts at, process k resuming from checkpoints of the rounds
    ``holds[k]`` (its latest last) ``delays[k]`` seconds after the first (link timeout 1 s)."""
    n, peers = len(holds), _ports(len(holds))
    comms = [zc.ZmqComm(k, peers, "cpu", 10, p2p=True, link_timeout_s=1) for k in range(n)]

    def worker(comm, out, k):
        time.sleep(delays[k])
        out[k] = comm.join(holds[k][-1], need_all=False, holds=holds[k])

    try:
        out = _threads(n, worker, *[(c,) for c in comms])
    finally:
        for c in comms:
            c.close()
    return [out.get(k) for k in range(n)]


def test_a_restart_on_standby_rejoins_whatever_its_peers_agreed():
    """The kill schedule's restart (``wait_round``) soon after a resume heard its peers'
    "agreed on round 2" hellos, went back to round 2 while they ran on, and crashed again at
    its kill round: it rejoins the running peers at their round."""
    peers = _ports(2)
    restart, running = (zc.ZmqComm(k, peers, "cpu", 10, p2p=True, link_timeout_s=2)
                        for k in range(2))  # fmt: skip
    running.agreed_round, running._round = 2, 3  # resumed at 2, now in round 3
    stop = threading.Event()

    def answer():  # what a running process does between its exchanges
        while not stop.is_set():
            if running._pull.poll(20):
                got = running._read_header()
                if got and got[0][2] == zc.HELLO:
                    running._hello(*got)
                    running._answer_hellos()

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        assert restart.join(2, need_all=False, wait_round=3, holds=(2,)) == 3
    finally:
        stop.set()
        thread.join(5)
        restart.close()
        running.close()


@pytest.mark.parametrize(
    ("delays", "expected"), [((0, 0, 0.1, 0.2), 4), ((0, 0, 0.5, 1.2), 6), ((0, 0, 0.5, 1.6), 6)]
)
def test_processes_resuming_at_different_times_start_at_one_round(delays, expected):
    """Four processes resuming from rounds 6, 6, 6 and 4, joining at the times given (link
    timeout 1 s). Started together they agree on round 4; with the last one more than a link
    timeout late, the first two started at 6 while the others went back to 4 (each decided
    alone, on the processes it had heard): now those that decide without hearing everyone
    fall back to the rejoin and say so at once, and the others follow them to round 6."""
    assert _resume_at([(4, 6), (4, 6), (4, 6), (4,)], delays) == [expected] * 4


def test_a_dead_peer_loses_only_its_own_links():
    """A ring of 4 where rank 0 dies at round 2: ranks 1 and 3 wait a link timeout for it and
    come late to rank 2, which is already in the next round. Their keepalives extend rank 2's
    deadline, so only rank 0's links are lost (without them rank 2 lost its links to 1 and 3
    too, and they then lost theirs to 2: a cascade round the ring). Ranks 1 and 3 work longer
    per round than rank 2, so their late message lands after rank 2's own deadline."""
    from gossip_pfl.runtime.exchange import Exchanger
    from gossip_pfl.runtime.placement import Placement

    n, rounds, dies, peers = 4, 5, 2, _ports(4)
    work = [0.0, 0.2, 0.0, 0.2]  # seconds of "local training" per round
    comms = [zc.ZmqComm(k, peers, "cpu", 10, p2p=True, link_timeout_s=1.0) for k in range(n)]
    x, phase = _ring_rows(n)

    def worker(comm, out, k):
        ex = Exchanger(Placement(n, n, k), comm)
        state, lost, before = x[k : k + 1].clone(), [], None
        for t in range(rounds):
            if k == 0 and t == dies:
                break  # dead: sends nothing more
            if t == dies:
                before = state.clone()
            time.sleep(work[k])
            comm.set_tag(t, 0)
            state = ex.mix(state, ex.plan(phase, key=0))
            lost.append(comm.last_links["lost"])
        out[k] = (state, lost, before)

    start = time.monotonic()
    try:
        out = _threads(n, worker, *[(c,) for c in comms])
    finally:
        for c in comms:
            c.close()
    wall = time.monotonic() - start
    assert sorted(out) == list(range(n))
    for k in (1, 2, 3):
        for t, lost in enumerate(out[k][1]):
            # rank 0's links only, from the round it died; never 1-2 or 2-3
            assert lost == ([0] if t >= dies and k != 2 else []), (k, t, lost)
    assert out[0][1] == [[]] * dies
    assert sum(c.stats["extended"] for c in comms) > 0  # the keepalives were what saved them
    # the survivors decided alike, so their sum is kept from the round rank 0 died
    kept = sum(out[k][2] for k in (1, 2, 3))
    torch.testing.assert_close(sum(out[k][0] for k in (1, 2, 3)), kept, rtol=0, atol=1e-12)
    assert wall < 1.0 + rounds * 0.2 + 3.0  # one link timeout lost, not one per round


def test_bad_messages_are_dropped_and_a_silent_neighbour_is_a_lost_link():
    peers = _ports(2)
    comm = zc.ZmqComm(0, peers, "cpu", 5, p2p=True, link_timeout_s=0.5)
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.connect(f"tcp://{peers[0]}")
    pull.bind(f"tcp://{peers[1]}")  # what rank 1 would receive

    def send(key, sender, tensor, kind=zc.EXCHANGE):
        t = tensor.contiguous()
        head = zc._HEAD.pack(zc._MAGIC, key[0], key[1], kind, key[2], sender,
                             zc._CODE[t.dtype], t.dim())  # fmt: skip
        head += b"".join(zc._DIM.pack(d) for d in t.shape)
        push.send_multipart([head, t.numpy().tobytes()])

    try:
        good = torch.arange(4.0)
        send((0, 0, 0), 1, torch.ones(5))  # wrong shape
        send((0, 0, 0), 9, good + 1)  # unknown sender
        push.send_multipart([b"junk", b"x"])  # malformed
        send((0, 0, 0), 1, good)
        send((0, 0, 0), 1, torch.zeros(0), kind=zc.ACK)  # rank 1 got ours
        comm.set_tag(0, 0)
        recv = torch.full((4,), -1.0)
        pending = comm.exchange({1: torch.ones(4)}, {1: recv})
        pending.wait_all()
        assert pending.lost == set() and torch.equal(recv, good)
        assert comm.stats["bad"] == 2 and comm.stats["unknown"] == 1
        assert pull.poll(2000)  # our data reached rank 1, then our ack of its message
        kinds = []
        while pull.poll(200):
            kinds.append(zc._HEAD.unpack_from(pull.recv_multipart()[0])[3])
        assert kinds == [zc.EXCHANGE, zc.ACK]
        # round 1: rank 1 sends nothing: the link is lost after the link timeout, no error
        comm.set_tag(1, 0)
        start = time.monotonic()
        pending = comm.exchange({1: torch.ones(4)}, {1: recv})
        pending.wait_all()
        assert pending.lost == {1} and time.monotonic() - start < 1.5
        with pytest.raises(Exception, match="no collectives"):
            comm.all_reduce_sum(torch.ones(1))
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
        comm.close()


def test_killed_peer_restarts_from_its_checkpoint_and_rejoins(tmp_path):
    """docs/p2p.md's kill command, as the page gives it (the page's test leaves it to this
    one): process 2 crashes at round 2 and restarts at round 5 of a 30-round run."""
    line = next(x for x in (ROOT / "docs" / "p2p.md").read_text().splitlines()
                if x.startswith("gossip-pfl peers-local") and "faults.kill" in x)  # fmt: skip
    argv = shlex.split(line)[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "run")
    argv[1] = str(ROOT / argv[1])  # the config
    p2p = _cli(*argv, timeout=120)
    assert p2p.returncode == 0, p2p.stderr
    run = tmp_path / "run"
    assert "killed at round 2" in (run / "logs" / "2.txt").read_text()
    rounds = [json.loads(x)["round"] for x in (run / "peers" / "2" / "links.jsonl").open()]
    # it ran rounds 0-1, crashed, and came back at the others' round (>= 5), not at 2
    assert rounds[:2] == [0, 1] and rounds[2] >= 5 and rounds[-1] == 29
    summary = json.loads((run / "summary.json").read_text())
    assert summary["peers_reporting"] == 8  # every peer reports the last round
    # merge says which rounds its peers did not train: from its round-2 checkpoint to rejoining
    assert summary["rejoins"] == {"2": [[2, rounds[2]]]}
    assert f"process 2's peers did not train rounds 3-{rounds[2]} " in p2p.stdout
    peer2 = json.loads((run / "peers" / "2" / "summary.json").read_text())
    assert peer2["round"] == 30


@pytest.mark.parametrize(
    ("peers", "message"),
    [
        ({0: "A", 2: "B"}, r"rank id\(s\) \[1\] missing"),
        ({0: "A", 1: "A"}, "share the address"),
        ({k: f"P{k}" for k in range(9)}, "9 processes but the run has 8 peers"),
        ({0: "A", 1: "B"}, "did not answer within runtime.timeout_s"),  # 1 never starts
        ({0: "A", 1: "B", "busy": 0}, "cannot listen on"),  # our port is taken
    ],
)
def test_bad_peers_files_exit_2_with_one_line(tmp_path, capsys, peers, message):
    ports = _ports(10)
    names = {v: ports[i] for i, v in enumerate(sorted({str(v) for v in peers.values()}))}
    table = {k: names[str(v)] for k, v in peers.items() if k != "busy"}
    holder = None
    if "busy" in peers:
        holder = socket.socket()
        host, port = table[0].split(":")
        holder.bind((host, int(port)))
        holder.listen()
    f = tmp_path / "peers.yaml"
    f.write_text(yaml.safe_dump(table))
    cfg = _config(tmp_path, timeout_s=1)
    try:
        code = main(["peer", str(cfg), "--peers", str(f), "--id", "0", "--quiet"])
    finally:
        if holder is not None:
            holder.close()
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("kill", "message"),
    [
        # the restart would wait for a round the others never reach (rounds = 6)
        ("[{id: 1, round: 2, restart: 6}]", "restart rounds must be < rounds = 6"),
        # a process killed at round 0 may die before it announced itself: a race
        ("[{id: 1, round: 0}]", "round: R >= 1"),
        ("[{id: 1, round: 0, restart: 2}]", "round: R >= 1"),
        ("[{id: 1, round: 3, restart: 3}]", "restart: R2 > R"),
        # process 7 of 4 (with a restart this was a KeyError, its 4 processes left running)
        ("[{id: 7, round: 1, restart: 2}]", r"id 7 is not one of the -n 4 processes \(ids 0..3\)"),
        # more processes than peers: each loaded its data to find out (about 20 s)
        ("[]", r"-n 9: the run has 8 peers, so at most 8 processes"),
    ],
)
def test_bad_launches_stop_before_any_process_starts(tmp_path, capsys, kill, message):
    cfg = _config(tmp_path)
    start = time.monotonic()
    n = "9" if kill == "[]" else "4"
    code = main(["peers-local", str(cfg), "-n", n, "--set", f"runtime.faults.kill={kill}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "run" / "logs").exists() and time.monotonic() - start < 5


def test_a_failed_process_is_named_with_its_code_and_last_line(tmp_path, capsys, monkeypatch):
    """A process of peers-local that fails (here: its port is taken by the time it listens)
    stops the launch with one line naming the process, its exit code and its log's last
    line, and that code."""
    from gossip_pfl import cli_peer

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    monkeypatch.setattr(cli_peer, "free_ports", lambda n: [busy, *free_ports(n - 1)])
    cfg = _config(tmp_path, timeout_s=2)
    try:
        code = main(["peers-local", str(cfg), "-n", "2"])
    finally:
        holder.close()
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.fullmatch(rf"gossip-pfl: process 0 exited with code 2: gossip-pfl: .*cannot "
                        rf"listen on tcp://127\.0\.0\.1:{busy} .*", err), err  # fmt: skip
    # the other process waited for it, then stopped on its own timeout (runtime.timeout_s)
    assert "did not answer within runtime.timeout_s" in (tmp_path / "run/logs/1.txt").read_text()


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie that no one reaped has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process server: Linux")
def test_a_dead_process_server_stops_the_launch_and_its_processes(tmp_path, capsys, monkeypatch):
    """peers-local's process server killed once it has forked process 0: one line naming it
    and its exit code, exit 2, and process 0 stopped (SIGTERM) rather than left running."""
    import signal

    from gossip_pfl import peer_server

    started, start = [], peer_server.PeerServer.start

    def start_then_die(self, argv, log):
        served = start(self, argv, log)
        started.append(served.pid)
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return served

    monkeypatch.setattr(peer_server.PeerServer, "start", start_then_die)
    code = main(["peers-local", str(_config(tmp_path, timeout_s=30)), "-n", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == "gossip-pfl: error: peers-local: its process server exited with code -9", err
    [pid] = started
    deadline = time.monotonic() + 20
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


def test_a_stopped_peer_process_says_how_to_resume_it(tmp_path):
    """SIGTERM to a peer process: it checkpoints and says the `peer ... --resume` command that
    continues it (it said `run --resume`, which a peer-to-peer folder is refused), and that
    command, run, finishes the run."""
    import signal

    cfg = _config(tmp_path, timeout_s=30)
    peers = tmp_path / "peers.yaml"
    peers.write_text(yaml.safe_dump(_ports(1)))
    run = tmp_path / "run"
    argv = ["peer", str(cfg), "--peers", str(peers), "--id", "0", "--set", "rounds=100000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gossip_pfl", *argv, "--out", str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = run / "peers" / "0" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    # a row, not the file: the file is written before the loop takes SIGTERM (on a loaded
    # machine the signal landed in between and killed the process, -15)
    while (
        time.monotonic() < deadline
        and proc.poll() is None
        and not (metrics.exists() and metrics.read_text())
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    stopped = re.search(r"stopped by SIGTERM after round (\d+); .*continue with: (.*)", stdout)
    assert stopped, stdout + stderr
    hint = stopped.group(2)
    assert shlex.split(hint) == ["gossip-pfl", *argv, "--out", str(run), "--resume"], hint
    done = int(stopped.group(1))  # (its checkpoint's round; metrics rows come every 3)
    resumed = shlex.split(hint)[1:] + ["--set", f"rounds={done + 2}"]
    assert main(resumed) == 0
    summary = json.loads((run / "peers" / "0" / "summary.json").read_text())
    assert summary["round"] == done + 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process server: Linux")
def test_the_process_server_reports_every_exit(tmp_path, monkeypatch):
    """The process server's replies: two processes that fail at once (exit 2), their exits
    read together with a start's reply and a launcher slow to read (an exit left unparsed
    behind a pid hung the launcher), and a line printed as the server starts (on its stdout,
    not on the replies' pipe). A kill of a process that has ended is not sent to its pid; a
    SIGINT to the server alone stops it forking, not serving."""
    import signal

    from gossip_pfl import peer_server

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('print("hello from sitecustomize", flush=True)\n')
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    select = peer_server.select.select

    def slow(*args):
        time.sleep(0.3)
        return select(*args)

    server = peer_server.PeerServer(env, str(tmp_path / "server.txt"))
    try:
        monkeypatch.setattr(peer_server.select, "select", slow)
        a = server.start(["peer"], str(tmp_path / "a.txt"))  # (argparse: exits 2 at once)
        b = server.start(["peer"], str(tmp_path / "b.txt"))
        assert a.wait() == 2 and b.wait() == 2
        b.kill()  # (ended: nothing to kill)
        assert "arguments are required" in (tmp_path / "a.txt").read_text()
        # a SIGINT to the server alone: it forks no more, and the run it serves goes on
        os.kill(server.proc.pid, signal.SIGINT)
        with pytest.raises(GossipError, match="was interrupted .* starts no more processes"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # (until the signal has been handled)
                assert server.start(["peer"], str(tmp_path / "c.txt")).wait() == 2
        assert server.proc.poll() is None
    finally:
        server.close()
    assert server.proc.returncode == 0
    assert "hello from sitecustomize" in (tmp_path / "server.txt").read_text()


def test_a_server_schedule_keeps_the_peers_average(tmp_path, capsys):
    """FedAvg's two phases through an aggregating hub, one process (in this one): the hub's
    own row is no peer, so its model appearing in the up phase is no drift (it read 0.026)."""
    cfg = _config(tmp_path)
    peers = tmp_path / "peers.yaml"
    peers.write_text(yaml.safe_dump(_ports(1)))
    args = ["--peers", str(peers), "--id", "0", "--quiet", "--set", "schedule={graph: server}"]
    assert main(["peer", str(cfg), *args]) == 0
    assert main(["merge", str(tmp_path / "run")]) == 0
    links = json.loads((tmp_path / "run" / "summary.json").read_text())["links"]
    assert links["exchanges"] == 2 * CONFIG["rounds"]  # up and down phases
    assert links["drift_total"] < 1e-6 and links["drift_max_step"] < 1e-6, links
    # a checkpoint merge cannot read: the summary has no consensus distance, and says why
    assert "consensus_distance" in json.loads((tmp_path / "run" / "summary.json").read_text())
    (tmp_path / "run" / "peers" / "0" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "run")]) == 0
    assert "gossip-pfl: warning: merge: no consensus distance (" in capsys.readouterr().err
    assert "consensus_distance" not in json.loads((tmp_path / "run" / "summary.json").read_text())


def test_a_peer_process_run_again_with_overwrite_starts_its_links_anew(tmp_path):
    """links.jsonl is appended to (a restart adds to it): a fresh run with --overwrite kept the
    old run's exchanges, and merge counted both runs'. Its kept checkpoints go too (a resume
    would name the old run's rounds). One process (in this one) of one ring."""
    cfg = _config(tmp_path)
    peers = tmp_path / "peers.yaml"
    peers.write_text(yaml.safe_dump(_ports(1)))
    args = ["--peers", str(peers), "--id", "0", "--quiet"]
    assert main(["peer", str(cfg), *args, "--set", "rounds=6"]) == 0
    links = tmp_path / "run" / "peers" / "0" / "links.jsonl"  # the process's own folder
    assert len(links.read_text().splitlines()) == 6
    kept = links.parent / "kept"
    assert sorted(p.name for p in kept.iterdir()) == ["4.pt", "6.pt"]  # (checkpoint_every 2)
    assert main(["peer", str(cfg), *args, "--set", "rounds=3", "--overwrite"]) == 0
    assert [json.loads(r)["round"] for r in links.read_text().splitlines()] == [0, 1, 2]
    assert sorted(p.name for p in kept.iterdir()) == ["2.pt"]


def test_ctrl_c_of_peers_local_says_where_each_process_says_how_to_go_on(tmp_path, capsys,
                                                                       monkeypatch):  # fmt: skip
    """Ctrl-C printed only 'interrupted'; the commands to continue each process are in
    logs/resume.txt from the start (a process killed outright prints none; docs/p2p.md)."""
    from gossip_pfl import cli_peer

    def interrupted(start, n, restarts, running):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_peer, "_watch", interrupted)
    run = tmp_path / "run"
    assert main(["peers-local", str(_config(tmp_path)), "-n", "2", "--out", str(run)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gossip-pfl: to continue: gossip-pfl peers-local --resume {run} (or run "
                   f"every command of {run / 'logs'}/resume.txt at once, then gossip-pfl merge "
                   f"{run}; docs/p2p.md)", "gossip-pfl: interrupted"]  # fmt: skip
    commands = [shlex.split(x) for x in (run / "logs" / "resume.txt").read_text().splitlines()]
    for k, argv in enumerate(commands):
        assert argv[:2] == ["gossip-pfl", "peer"] and argv[-3:] == ["--id", str(k), "--resume"]
        assert argv[argv.index("--out") + 1] == str(run)
    assert len(commands) == 2


def test_sigterm_to_peers_local_stops_its_processes_as_ctrl_c_does(tmp_path, capsys,
                                                                   monkeypatch):  # fmt: skip
    """SIGTERM to the launcher alone (`timeout`, a scheduler) ended it without a word, its
    processes left running: it now passes the signal on (each ends its round, saves its
    checkpoint), waits for them, says how to go on and exits 143."""
    import signal

    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
                              "print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout.readline().strip() == "up"

    def terminated(start, n, restarts, running):
        running[0] = child  # (a process of the run)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # (the launcher's handler raises before this ends)

    def unhandled(signum, frame):  # (without the launcher's own handler: a failure, not the
        raise AssertionError("SIGTERM reached the default handler")  # test worker killed)

    monkeypatch.setattr(cli_peer, "_watch", terminated)
    run = tmp_path / "run"
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        code = main(["peers-local", str(_config(tmp_path)), "-n", "2", "--out", str(run)])
        assert signal.getsignal(signal.SIGTERM) is unhandled  # (given back)
    finally:
        signal.signal(signal.SIGTERM, before)
        if child.poll() is None:
            child.kill()
    assert code == 143 and child.wait(5) == 143
    err = capsys.readouterr().err
    assert f"to continue: gossip-pfl peers-local --resume {run}" in err


def test_a_peer_without_test_samples_is_left_out_of_its_process_mean(tmp_path):
    """A process's progress figure (its row's and summary's ``test_accuracy``) is the mean over
    its peers that have test samples, as the merged run's is: a peer without any counted 0."""
    from _helpers import toy_dataset

    from gossip_pfl.config import load_config
    from gossip_pfl.peer import PeerTrainer
    from gossip_pfl.runtime.zmq_comm import ZmqComm

    data = toy_dataset(4)
    c = data.clients[3]
    data.clients[3] = type(c)(c.x_train, c.y_train, c.x_val, c.y_val, c.x_test[:0], c.y_test[:0])
    base = {
        **CONFIG,
        "data": {},
        "rounds": 2,
        "eval": {"every": 2},
        "checkpoint_every": 0,
        "runtime": {**CONFIG["runtime"], "transport": "zmq"},
        "out": str(tmp_path / "p"),
    }
    cfg = load_config(base=base)
    (tmp_path / "p").mkdir()  # the peer command makes it
    with ZmqComm(0, _ports(1), "cpu", 20, p2p=True) as comm:
        trainer = PeerTrainer(cfg, data, comm, lambda *a, **k: None)
        summary = trainer.run()
    row = json.loads((tmp_path / "p" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["peer_test_count"][3] == 0
    assert row["test_accuracy"] == pytest.approx(np.mean(row["peer_test_accuracy"][:3]))
    assert summary["test_accuracy"] == row["test_accuracy"]


def test_peers_local_keeps_another_runs_folder_and_names_a_file(tmp_path, capsys):
    """peers-local checked only for another peer-to-peer run: over a gossip-pfl run's folder
    it wrote its merged metrics and summary beside that run's checkpoint and figures; an --out
    under a file was a traceback. Both are one line, before any process starts."""
    cfg = _config(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text("{}")
    (other / "checkpoint.pt").write_bytes(b"kept")
    assert main(["peers-local", str(cfg), "-n", "2", "--out", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another run (summary.json, checkpoint.pt)" in err[0], err
    assert (other / "checkpoint.pt").read_bytes() == b"kept" and not (other / "peers").exists()
    assert main(["peers-local", str(cfg), "-n", "2", "--out", str(other / "summary.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file, not a folder" in err[0], err

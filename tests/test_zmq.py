"""The pyzmq transport on loopback: exchanges move the right rows between processes started in
any order, all_reduce_sum is bit-identical on every rank, and bad, stale or missing messages are
dropped, counted or reported within the timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _helpers import run_ranks, run_threads

from gossip_pfl.cli_peer import free_ports
from gossip_pfl.errors import GossipError
from gossip_pfl.runtime.comm import Comm, LocalComm, build_comm

zmq = pytest.importorskip("zmq")
zc = pytest.importorskip("gossip_pfl.runtime.zmq_comm")


def _peers(n: int) -> dict[int, str]:
    """n distinct free loopback addresses, by rank."""
    return {r: f"127.0.0.1:{port}" for r, port in enumerate(free_ports(n))}


def _rows(rank: int, rnd: int) -> torch.Tensor:
    """Rank ``rank``'s (3, 5) state in round ``rnd``: every entry distinct."""
    return torch.arange(15, dtype=torch.float32).view(3, 5) + 100 * rank + 1000 * rnd


def _vector(rank: int) -> torch.Tensor:
    # values of mixed magnitude, so a different order of additions would change the last bits
    g = torch.Generator().manual_seed(rank)
    return torch.randn(257, generator=g) * 10.0 ** torch.randint(-4, 5, (257,), generator=g)


def _ring_worker(peers, delays):
    rank, n = int(os.environ["RANK"]), len(peers)
    time.sleep(delays[rank])  # start in any order
    comm = build_comm("zmq", "cpu", 20.0, peers=peers, rank=rank)
    assert isinstance(comm, Comm)
    left, right = (rank - 1) % n, (rank + 1) % n
    got = []
    try:
        for rnd in range(3):
            comm.set_tag(rnd, 0)
            state = _rows(rank, rnd)
            # two rows to the right, one (not contiguous in memory: a column slice) to the left
            sends = {right: state[0:2], left: state[2:3, 1:4]}
            recvs = {left: torch.full((2, 5), float("nan")), right: torch.full((1, 3), -1.0)}
            comm.exchange(sends, recvs).wait_all()
            got.append((recvs[left].clone(), recvs[right].clone()))
            total = comm.all_reduce_sum(_vector(rank + rnd))
        return got, total.cpu().numpy().tobytes(), dict(comm.stats)
    finally:
        comm.close()


def test_ring_exchange_and_all_reduce_across_processes_started_in_any_order():
    peers = _peers(4)
    results = run_ranks(4, _ring_worker, peers, [0.8, 0.0, 0.4, 1.2], timeout=60)
    assert all(status == "ok" for status, _ in results), results
    for rank, (_, (got, total, stats)) in enumerate(results):
        left, right = (rank - 1) % 4, (rank + 1) % 4
        for rnd, (from_left, from_right) in enumerate(got):
            assert torch.equal(from_left, _rows(left, rnd)[0:2])
            assert torch.equal(from_right, _rows(right, rnd)[2:3, 1:4])
        assert stats == dict.fromkeys(stats, 0)
        # the last round's sum: ranks' tensors added in rank order, bit for bit on every rank
        expected = _vector(0 + 2).clone()
        for r in range(1, 4):
            expected += _vector(r + 2)
        assert total == expected.cpu().numpy().tobytes()


def _send_raw(sock, key, sender, tensor, payload=None):
    t = tensor.contiguous()
    head = zc._HEAD.pack(zc._MAGIC, *key, sender, zc._CODE[t.dtype], t.dim())
    head += b"".join(zc._DIM.pack(d) for d in t.shape)
    sock.send_multipart([head, t.cpu().numpy().tobytes() if payload is None else payload])


@pytest.fixture
def comm0():
    peers = _peers(3)
    comm = zc.ZmqComm(0, peers, timeout_s=0.5)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://{peers[0]}")
    yield comm, push
    push.close()
    ctx.term()
    comm.close()


def test_stale_bad_and_unknown_messages_are_dropped_and_future_ones_queued(comm0):
    comm, push = comm0
    good = torch.arange(6, dtype=torch.float32).view(2, 3)
    ex = zc.EXCHANGE
    _send_raw(push, (1, 0, ex, 0), 1, good + 1)  # stale: round 1 is over when it is read
    _send_raw(push, (2, 0, ex, 0), 1, torch.ones(3, 2))  # wrong shape
    _send_raw(push, (2, 0, ex, 0), 1, torch.ones(2, 3, dtype=torch.float64))  # wrong dtype
    _send_raw(push, (2, 0, ex, 0), 7, good + 2)  # unknown sender
    _send_raw(push, (2, 0, ex, 0), 2, good + 3)  # a rank this exchange does not receive from
    _send_raw(push, (2, 0, ex, 0), 1, good, payload=b"short")  # payload shorter than its header
    push.send_multipart([b"junk", b"x"])  # malformed
    _send_raw(push, (3, 1, ex, 0), 1, good + 4)  # a later tag: queued
    _send_raw(push, (2, 0, ex, 0), 1, good)  # the one that counts
    comm.set_tag(2, 0)
    time.sleep(0.2)
    recv = torch.zeros(2, 3)
    comm.exchange({}, {1: recv}).wait_all()
    assert torch.equal(recv, good)
    comm.set_tag(3, 1)  # the queued message is served without waiting for the socket
    comm.exchange({}, {1: recv}).wait_all()
    assert torch.equal(recv, good + 4)
    # the stale one is read during the first wait (before the good one) or left on the socket;
    # either way it never lands in a tensor
    assert comm.stats["bad"] == 4 and comm.stats["unknown"] == 1
    assert comm.stats["unexpected"] == 1 and comm.stats["stale"] == 1


@pytest.mark.parametrize("hold", [False, True])
def test_held_frames_cut_at_odd_bytes_are_copied(comm0, hold):
    """A payload whose frames do not split at whole elements (another sender's cut) lands as
    its values, copied into the tensor, whether or not the exchange holds frames."""
    comm, push = comm0
    want = torch.tensor([1.5, 2.5, -3.0])
    head = zc._HEAD.pack(zc._MAGIC, 4, 0, zc.EXCHANGE, 0, 1, zc._CODE[torch.float32], 1)
    data = want.numpy().tobytes()
    push.send_multipart([head + zc._DIM.pack(3), data[:3], data[3:8], data[8:]])
    comm.set_tag(4, 0)
    recv = torch.zeros(3)
    p = comm.exchange({}, {1: recv}, hold=hold)
    p.wait_all()
    assert torch.equal(recv, want) and not p.parts
    assert comm.stats["bad"] == 0


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("p2p", [False, True])
def test_payloads_in_many_frames_land_whole(monkeypatch, p2p, hold):
    """Payloads travel in frames of at most CHUNK bytes (made small here): sizes around a
    frame's edge, a non-contiguous tensor, and a message queued early (a later tag) arrive
    whole, copied into the tensor or (hold) left in the frames (16 KiB ones: libzmq keeps
    frames under 8 KiB in a shared buffer, at any address, and those are copied)."""
    values = 4096 if hold else 16  # float32 values per frame
    monkeypatch.setattr(zc, "CHUNK", 4 * values)
    peers = _peers(2)
    comms = [zc.ZmqComm(r, peers, "cpu", 20, p2p=p2p) for r in range(2)]
    sizes = [0, 1, values - 1, values, values + 1, 2 * values + 1, 3 * values]
    got, errors, parts_held = {}, [], []

    def worker(r):
        try:
            c, other = comms[r], 1 - r
            for t, n in enumerate(sizes):
                c.set_tag(t, 0)
                x = torch.arange(2 * n, dtype=torch.float32).view(n, 2)[:, 1] + 1000 * r + t
                y = torch.full((n,), float("nan"))
                if r == 1:  # rank 0 is a tag ahead: rank 1 finds its messages queued
                    time.sleep(0.05)
                p = c.exchange({other: x}, {other: y}, hold=hold)
                p.wait_all()
                assert not getattr(p, "lost", None)
                assert hold or not p.parts
                # held (unless libzmq placed a frame at an odd address: then copied into y)
                parts = p.parts.get(other)
                parts_held.append(len(parts or ()))
                got[(r, t)] = torch.cat(parts) if parts else y.clone()
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    run_threads(worker, 2, comms, 60)
    assert not errors, errors
    assert max(parts_held) == (3 if hold else 0)  # three whole frames held as three tensors
    for t, n in enumerate(sizes):
        for r in range(2):
            want = torch.arange(2 * n, dtype=torch.float32).view(n, 2)[:, 1] + 1000 * (1 - r) + t
            assert torch.equal(got[(r, t)], want), (r, t)
    assert all(v == 0 for c in comms for k, v in c.stats.items() if k != "ahead")


def test_a_missing_neighbour_raises_within_the_timeout(comm0):
    comm, _ = comm0
    comm.set_tag(5, 2)
    start = time.monotonic()
    pending = comm.exchange({}, {1: torch.zeros(4), 2: torch.zeros(4)})
    waited = r"round 5, phase 2 timed out after 0.5 s .*rank\(s\) \[1, 2\]"
    with pytest.raises(GossipError, match=waited):
        pending.wait_all()
    assert time.monotonic() - start < 1.5
    # the transport is usable again for the next operation
    comm.set_tag(6, 0)
    with pytest.raises(GossipError, match=r"rank\(s\) \[2\]"):
        comm.exchange({}, {2: torch.zeros(1)}).wait_all()


def test_a_send_to_a_peer_that_never_starts_times_out():
    peers = _peers(2)
    with zc.ZmqComm(0, peers, timeout_s=0.5) as comm:
        # big enough not to fit the kernel's socket buffers while nobody listens
        pending = comm.exchange({1: torch.zeros(1 << 16)}, {})
        with pytest.raises(GossipError, match=r"sending to rank\(s\) \[1\]"):
            pending.wait_all()


@pytest.mark.parametrize(
    ("peers", "message"),
    [
        ({0: "127.0.0.1:5000", 2: "127.0.0.1:5001"}, r"rank id\(s\) \[1\] missing"),
        ({0: "127.0.0.1:5000", 1: "127.0.0.1:5000"}, "ranks 0 and 1 share the address"),
        ({0: "127.0.0.1", 1: "127.0.0.1:5001"}, "is not host:port"),
        ({0: "127.0.0.1:5000", "x": "127.0.0.1:5001"}, "is not an integer"),
        ([], "expected a mapping"),
        ({0: "127.0.0.1:5000", 1.7: "127.0.0.1:5001"}, "rank id 1.7 is not an integer"),
        ({0: "127.0.0.1:5000", True: "127.0.0.1:5001"}, "rank id True is not an integer"),
    ],
)
def test_bad_peers_tables(peers, message):
    with pytest.raises(GossipError, match=message):
        zc.read_peers(peers)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # YAML keeps the last of two equal keys: the file would be a world of one process
        ("0: 127.0.0.1:5000\n0: 127.0.0.1:5001\n", "line 2: .*key 0 given twice"),
        ("0: 127.0.0.1:5000\n1: 127.0.0.1:5001\n1.0: 127.0.0.1:5002\n", "key 1.0 given twice"),
        ("0: 127.0.0.1:5000\n1.7: 127.0.0.1:5001\n", "rank id 1.7 is not an integer"),
        ("0: [127.0.0.1:5000\n", "malformed YAML"),
        # docs/p2p.md's own example, unquoted, was this error without a hint
        ("0: 127.0.0.1:5000\n1: [::1]:5001\n", r"line 2: malformed YAML .*; quote an IPv6 "
                                                r"address: 4: '\[fd00::9\]:7000'$"),
    ],
)  # fmt: skip
def test_bad_peers_files_name_the_file_and_line(tmp_path, text, message):
    f = tmp_path / "peers.yaml"
    f.write_text(text)
    with pytest.raises(GossipError, match=message) as err:
        zc.read_peers(f)
    assert str(err.value).startswith(f"peers file {f}") and "\n" not in str(err.value)
    with pytest.raises(GossipError, match="peers file not found"):
        zc.read_peers(tmp_path / "none.yaml")


def test_peers_file_port_in_use_and_registry(tmp_path):
    peers = _peers(2)
    f = tmp_path / "peers.yaml"
    f.write_text("".join(f"{r}: {a}\n" for r, a in peers.items()))
    assert zc.read_peers(f) == peers
    with zc.ZmqComm(1, f, timeout_s=1) as comm:
        assert (comm.rank, comm.world_size, comm.device.type) == (1, 2, "cpu")
        with pytest.raises(GossipError, match="cannot listen on"):
            zc.ZmqComm(1, f)
    with pytest.raises(GossipError, match="not in the peers table"):
        zc.ZmqComm(2, f)
    with pytest.raises(GossipError, match="runtime.transport must be one of"):
        build_comm("carrier-pigeon")
    assert isinstance(LocalComm(torch.device("cpu")), Comm)


def test_one_rank_world_and_tags_only_move_forward():
    with zc.ZmqComm(0, _peers(1), timeout_s=1) as comm:
        x = torch.tensor([1.5])
        assert comm.all_reduce_sum(x) is x and x.item() == 1.5
        comm.set_tag(3, 1)
        with pytest.raises(GossipError, match="before the current"):
            comm.set_tag(3, 0)


def _mix_phases(n: int) -> list:
    """Two phases on n nodes: a ring, then a ring with chords i -> i + 3 (non-contiguous
    sends), with random row-stochastic weights."""
    import numpy as np

    from topologies import Phase

    rng = np.random.default_rng(0)
    phases = []
    for hops in ([-1, 1], [-1, 1, 3]):
        rows = np.repeat(np.arange(n), len(hops) + 1)
        cols = np.concatenate([[i, *((i + h) % n for h in hops)] for i in range(n)])
        w = rng.random((n, len(hops) + 1))
        phases.append(Phase(n, rows, cols, (w / w.sum(1, keepdims=True)).ravel()))
    return phases


def _exchanger_worker(peers, n, transport):
    from gossip_pfl.runtime import exchange
    from gossip_pfl.runtime.comm import init_comm
    from gossip_pfl.runtime.exchange import Exchanger, _rowwise
    from gossip_pfl.runtime.placement import Placement

    rank, world = int(os.environ["RANK"]), len(peers)
    x = torch.randn(n, 33, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if transport == "zmq":
        # frames of 5 float64 and mixing chunks of 7 columns: rows cut across frames and
        # chunks, where Gloo's arrive whole (the mix must not depend on it)
        zc.CHUNK, exchange.ROWWISE_CHUNK = 40, 7
        comm = build_comm("zmq", "cpu", 20.0, peers=peers, rank=rank)
    else:
        comm = init_comm("cpu", "gloo", 20.0)
    placement = Placement(n, world, rank)
    ex = Exchanger(placement, comm)
    state = x[placement.peers].clone()
    try:
        for k, phase in enumerate(_mix_phases(n)):
            comm.set_tag(0, k)
            assert _rowwise(ex.plan(phase))  # the received rows are added one by one
            state = ex.mix(state, ex.plan(phase))
    finally:
        comm.close()
    return state


def test_exchanger_over_zmq_mixes_as_over_gloo():
    n = 10  # blocks of 3, 3, 2, 2 peers on 4 ranks
    # two runs: a zmq peer port picked while the other run's MASTER_PORT is free could collide
    runs = {
        t: run_ranks(4, _exchanger_worker, _peers(4), n, t, timeout=60) for t in ("zmq", "gloo")
    }
    assert all(status == "ok" for res in runs.values() for status, _ in res), runs
    x = torch.randn(n, 33, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for phase in _mix_phases(n):
        x = torch.as_tensor(phase.dense()) @ x
    got_zmq = torch.cat([state for _, state in runs["zmq"]])
    got_gloo = torch.cat([state for _, state in runs["gloo"]])
    assert torch.equal(got_zmq, got_gloo)  # the same rows arrive, so the same products
    torch.testing.assert_close(got_zmq, x, rtol=1e-12, atol=1e-12)


def _zmq_trainer(cfg, peers):
    from _helpers import toy_dataset

    from gossip_pfl.train import Trainer

    comm = build_comm("zmq", "cpu", 30.0, peers=peers, rank=int(os.environ["RANK"]))
    try:
        trainer = Trainer(cfg, dataset=toy_dataset(8), comm=comm, log=lambda *a: None)
        summary = trainer.run()
    finally:
        comm.close()
    theta, pi = trainer.shared_parameters(), trainer.personal["pi"].cpu().numpy()
    return {int(p): (theta[i], pi[i], summary) for i, p in enumerate(trainer.peers)}, comm.stats


def test_dfedem_over_zmq_equals_one_process(tmp_path):
    """The Trainer, unchanged (it sets no tag: every operation runs under (0, 0), matched by
    call order), runs D-FedEM over ZmqComm on 4 processes as in one process."""
    import numpy as np
    from test_runtime import make_cfg, train_and_collect

    single = train_and_collect(make_cfg(tmp_path / "one", "ring", "dfedem", components=3))
    cfg = make_cfg(tmp_path / "zmq", "ring", "dfedem", components=3)
    results = run_ranks(4, _zmq_trainer, cfg, _peers(4), timeout=90)
    assert all(status == "ok" for status, _ in results), results
    multi = {}
    for _, (peers, stats) in results:
        multi.update(peers)
        assert stats == dict.fromkeys(stats, 0)
    assert sorted(multi) == sorted(single)
    for peer, (theta, pi, summary) in single.items():
        np.testing.assert_allclose(multi[peer][0], theta, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(multi[peer][1], pi, rtol=1e-6, atol=1e-7)
        for key in ("test_accuracy", "train_accuracy", "test_accuracy_p10"):
            assert abs(multi[peer][2][key] - summary[key]) < 1e-6
        assert abs(multi[peer][2]["train_loss"] - summary["train_loss"]) < 1e-6


def test_ipv6_hosts_in_brackets():
    """A peers file may name IPv6 hosts as URLs do ([::1]:port): two ranks on the IPv6
    loopback sum a tensor. A bare IPv6 host is ambiguous with the port and is refused."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    peers = {r: f"[::1]:{port}" for r, port in enumerate(free_ports(2))}
    comms = [zc.ZmqComm(r, peers, "cpu", 20) for r in range(2)]
    out = {}

    def worker(r):
        out[r] = comms[r].all_reduce_sum(torch.tensor([1.0 + r, 10.0 * r]))

    run_threads(worker, 2, comms, 30)
    assert all(torch.equal(out[r], torch.tensor([3.0, 10.0])) for r in range(2)), out
    with pytest.raises(GossipError, match=r"write an IPv6 host in brackets, \[::1\]:5555"):
        zc.read_peers({0: "::1:5555"})


def test_processes_started_with_different_configs_are_refused_as_they_join():
    """Each hello carries the run's config digest: processes started with different --set
    trained together (merge refused them only at the end). Both stop as they join, naming
    the other; with the same digest (or none, 0) they join."""
    peers = _peers(2)
    for digests, refused in (((7, 7), False), ((7, 0), False), ((7, 9), True)):
        comms = [zc.ZmqComm(r, peers, "cpu", 10, p2p=True, link_timeout_s=2) for r in range(2)]
        errors: dict[int, str] = {}

        def worker(r, comms=comms, digests=digests, errors=errors):
            comms[r].config_digest = digests[r]
            try:
                comms[r].join(0, need_all=True)
            except GossipError as err:
                errors[r] = str(err)

        run_threads(worker, 2, comms, 20)
        if refused:
            assert errors == {r: f"rank {r}: process(es) [{1 - r}] were started with another "
                                 "config than this one; give every process the same config "
                                 "and --set" for r in range(2)}, errors  # fmt: skip
        else:
            assert errors == {}, errors

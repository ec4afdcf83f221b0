"""A peer-to-peer transport over pyzmq (TCP): no rendezvous, no process group, no fixed start order.

Each process holds one rank (a block of peers, as under torchrun) and knows every other rank's
address from a peers file (YAML: ``rank id -> host:port``) or a dict.

Sockets: one PULL socket per rank, bound on its own address, and one PUSH socket per rank it
sends to, connected to that rank's address (opened on first use). PUSH/PULL rather than
ROUTER/DEALER because every message already says who sent it in its header, there are no
replies to route, and a PUSH socket connected to one peer queues messages until that peer is up
(ZeroMQ reconnects in the background): processes may start in any order, where a ROUTER drops
messages to an identity that has not connected yet. One PULL per rank fair-queues all senders,
so a rank waits on a single socket.

Messages are a fixed-size header frame (magic, round, phase, kind, sequence number, sender,
dtype and shape) and the tensor's bytes, in frames of at most ``CHUNK`` bytes (1 MiB). Sends are
zero-copy for contiguous CPU tensors (ZeroMQ holds the tensor's memory until the bytes have
left; ``ZmqPending.wait_all`` waits for that; pyzmq copies frames under 64 KiB instead, and
``close`` lingers so those still leave). A message for the operation being waited on is received
straight into the preallocated tensor (``recv_into``, frame by frame), after its header was
checked; nothing is pickled. With ``exchange(..., hold=True)`` (what the Exchanger asks when it
adds the received rows one by one) the frames are kept instead and handed over as tensors over
ZeroMQ's own buffers (``ZmqPending.parts``): no copy at all, which was 0.2-0.4x of Gloo's
exchange time on 2 cores. The frames matter for speed: libzmq receives a frame into a buffer
it allocates, so one 40 MB frame costs a fresh 40 MB allocation (page faults) per message, where
1 MiB frames reuse the heap and stay in cache for the copy into the tensor (3x faster on a
ring of 4 processes with 10M float32 parameters; benchmarks/bench_exchange.py).

Tags: the caller calls ``comm.set_tag(round, phase)`` before the phase's exchange (the
Trainer's round loop, once per phase; ``all_reduce_sum`` calls in the same round go under the
same tag). Within one tag, exchanges and all-reduces are numbered in call order (each kind its
own counter), so every rank must make the same calls in the same order after each
``set_tag``, as with torch.distributed's collectives. A message is then:

- for the operation being waited on, from an expected sender: received into its tensor;
- for a later operation or tag: queued (ZeroMQ's buffer, then ours) until that operation;
- for an operation this rank has finished (an earlier tag, or an earlier number in this one),
  or a second copy: dropped, and counted in ``stats['stale']`` / ``stats['duplicate']``;
- malformed, of the wrong dtype or shape, from a rank not in the peers table, or from a rank
  this operation does not receive from: dropped, logged and counted, never copied in.

Waiting is bounded: after ``timeout_s`` without the expected messages, ``wait_all`` raises a
``GossipError`` naming the ranks it waited for.

Peer to peer (``p2p=True``, what ``gossip-pfl peer`` builds; docs/p2p.md): no collectives
(``collectives`` is False and ``all_reduce_sum`` refuses), and a lost link is not an error.

- Start: ``join`` sends a hello to every process (every ``HELLO_EVERY_S``) and waits for
  theirs; a fresh start needs them all within ``timeout_s``, a restart needs one, and starts at
  the round the running peers name (it asks a peer again as soon as it answers with an earlier
  round than the restart's, so it follows it round by round). Processes that resume together
  (none running) name the checkpoints they hold, and start at the latest round all of them
  hold: they stopped at different rounds, and go on as the uninterrupted run would.
- Link faults: in an exchange every message that lands is acknowledged at once; the link with
  rank r counts only when r's message landed here and r's ack of ours came back (both ends hold
  each other's rows). It is given up after ``link_timeout_s``, or at once when r is seen past
  this exchange (on one connection, r's ack would have come before its later messages); the
  Exchanger then moves its weight to the diagonal (``ZmqPending.lost``). The ends disagree only
  when an ack is late past the other's deadline (or dropped by fault injection); merge reports
  those cases and the drift of the average they cause. A neighbour that sent nothing in its
  last exchange (dead?) is not waited for until it sends again; a lost link's socket is reset,
  so nothing piles up for a dead peer.
- Keepalives: a rank waiting on a neighbour tells its other neighbours every ``ALIVE_EVERY``
  link timeout that it is alive and in exchange k; one that waits for it at a later exchange
  then extends its deadline for it (up to ``timeout_s``). Without them, a rank late by a link
  timeout (waiting on a dead peer) lost its links to its other neighbours too, which made them
  late to theirs: a cascade, one hop per round.
- Fault injection (``Faults``): seeded per-link drops (known to both ends, not waited for)
  and per-ack losses.

``all_reduce_sum`` is all-to-all: every rank sends its tensor to every other rank, then each
adds the world's tensors in rank order, so all ranks get bit-identical sums. It moves
``(world - 1)`` tensors per rank, fine for metrics (a few numbers) on a few dozen ranks.
"""

from __future__ import annotations

import logging
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from gossip_pfl.errors import GossipError
from gossip_pfl.runtime.threads import keep_freed_memory

log = logging.getLogger(__name__)

EXCHANGE, REDUCE, ACK, HELLO, ALIVE = 0, 1, 2, 3, 4
#: seconds between a joining process's announcements (hellos)
HELLO_EVERY_S = 0.25
#: once every process has answered, how long join goes on reading what is already queued
DRAIN_S = 0.05
#: a hello's phase field: bit 0, the sender wants a reply; bit 1, it is resuming and its dims
#: are the rounds it holds checkpoints of; bit 2, it resumed at the round its one dim names,
#: the latest that the processes resuming with it all held
WANTS_REPLY, RESUMING, AGREED = 1, 2, 4
#: a process waiting on a neighbour tells its other neighbours it is alive every this fraction
#: of the link timeout (a keepalive); each one extends their deadline for it by a link timeout
ALIVE_EVERY = 0.25
_KINDS = {EXCHANGE: "exchange", REDUCE: "all_reduce", ACK: "ack", HELLO: "hello",
          ALIVE: "keepalive"}  # fmt: skip
# magic, round, phase, kind, seq, sender, dtype code, ndim; then ndim int64 dims
_HEAD = struct.Struct("<4sqiBiiBB")
_MAGIC = b"GPZ1"
_DIM = struct.Struct("<q")
_MAX_DIMS = 16
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


def read_peers(peers: str | Path | dict) -> dict[int, str]:
    """``{rank: "host:port"}`` from a YAML file or a dict; ranks must be 0..n-1, addresses
    distinct. Raises GossipError with one line naming the problem."""
    if isinstance(peers, (str, Path)):
        from topologies import TopologyError
        from topologies.spec import read_mapping

        where = f"peers file {peers}"
        try:  # one line for a missing file, bad YAML or an id given twice
            raw = read_mapping(peers, "peers file")
        except TopologyError as err:
            msg = str(err)  # "peers file not found: ..." or "PATH line N: ..."
            if "malformed YAML" in msg and "[" in Path(peers).read_text(errors="replace"):
                msg += "; quote an IPv6 address: 4: '[fd00::9]:7000'"  # (YAML reads [ as a list)
            raise GossipError(msg if msg.startswith("peers") else f"peers file {msg}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise GossipError(f"{where}: {getattr(err, 'strerror', None) or err}") from None
    else:
        raw, where = peers, "peers"
    if not isinstance(raw, dict) or not raw:
        raise GossipError(f"{where}: expected a mapping of rank id -> host:port")
    table: dict[int, str] = {}
    for key, addr in raw.items():
        # an int, or a string of digits: int(1.7) or int(True) would pass as another rank
        is_int = isinstance(key, int) and not isinstance(key, bool)
        if not (is_int or (isinstance(key, str) and key.strip().isdigit())):
            raise GossipError(f"{where}: rank id {key!r} is not an integer")
        rank = int(key)
        if rank < 0 or rank in table:
            raise GossipError(f"{where}: bad or repeated rank id {key!r}")
        table[rank] = _check_address(str(addr), f"{where}: rank {rank}")
    missing = sorted(set(range(len(table))) - set(table))
    if missing:
        raise GossipError(
            f"{where}: rank id(s) {missing} missing (ids must be 0..{len(table) - 1})"
        )
    seen: dict[str, int] = {}
    for rank, addr in sorted(table.items()):
        if addr in seen:
            raise GossipError(f"{where}: ranks {seen[addr]} and {rank} share the address {addr}")
        seen[addr] = rank
    return dict(sorted(table.items()))


def _check_address(addr: str, what: str) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:5555``, as in a URL)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise GossipError(f"{what}: address {addr!r} is not host:port")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise GossipError(f"{what}: address {addr!r}: write an IPv6 host in brackets, "
                          f"[{host}]:{port}")  # fmt: skip
    return f"{host}:{int(port)}"


#: the largest payload frame (bytes); a tensor's bytes travel in frames of this size
CHUNK = 1 << 20
#: ZeroMQ I/O threads per process: with two, the frames from two neighbours are read from
#: their TCP connections in parallel while this thread copies the previous ones into tensors
IO_THREADS = 2


def _as_bytes(t: torch.Tensor):
    """A writable/readable byte view of a contiguous CPU tensor's memory (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _copy_frames(buffers: list, into: torch.Tensor) -> None:
    """A payload's frame buffers, in order, into the bytes of a contiguous CPU tensor."""
    view, at = _as_bytes(into), 0
    for b in buffers:
        view[at : at + len(b)] = b
        at += len(b)


@dataclass(frozen=True)
class Faults:
    """Seeded fault injection (tests, benchmarks). In each exchange the link between two
    ranks is down with probability ``drop`` (both ends draw the same number, send nothing
    and count the link lost at once: neither waits, so a drop does not make them late for
    their other neighbours), and each acknowledgement is lost with probability
    ``ack_drop`` (the one case where the ends may disagree). Draws depend on (seed, round,
    phase, ranks) only, so a fault run repeats."""

    drop: float = 0.0
    ack_drop: float = 0.0
    seed: int = 0

    def _u(self, *key: int) -> float:
        return float(np.random.default_rng([self.seed, *key]).random())

    def link_down(self, key, a: int, b: int) -> bool:
        return (
            self.drop > 0 and self._u(key[0], key[1], key[3], min(a, b), max(a, b), 0) < self.drop
        )

    def ack_lost(self, key, sender: int, receiver: int) -> bool:
        return (
            self.ack_drop > 0
            and self._u(key[0], key[1], key[3], sender, receiver, 1) < self.ack_drop
        )


@dataclass
class _Msg:
    sender: int
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    data: object = None  # the payload frames (zmq.Frame) of a queued message


@dataclass
class ZmqPending:
    """Exchange (or all-reduce) in flight; ``wait_all`` receives and checks what is due."""

    comm: ZmqComm
    key: tuple[int, int, int, int]
    recvs: dict[int, torch.Tensor]  # sender -> preallocated tensor (on comm.device)
    trackers: list = field(default_factory=list)
    keep: list = field(default_factory=list)  # tensors ZeroMQ may still read from
    done: bool = False
    #: ``exchange(hold=True)``: received rows left in ZeroMQ's frames, by sender (1-D tensors
    #: over the frames, in order; ``recvs[sender]`` is then not filled)
    parts: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    sends: set[int] = field(default_factory=set)  # ranks sent to (p2p: they owe an ack)
    #: p2p only: the ranks whose link did not count in this exchange (their rows are not to be
    #: used; see ZmqComm's docstring, "Link faults")
    lost: set[int] = field(default_factory=set)
    #: p2p only: the links that fault injection took down (both ends know it: not waited for)
    down: set[int] = field(default_factory=set)

    def wait_all(self) -> None:
        if self.done:
            return
        try:
            if self.comm.p2p and self.key[2] == EXCHANGE:
                self.lost = self.comm._settle(
                    self.key, self.recvs, self.sends, self.trackers, self.down
                )
            else:
                self.comm._receive(self.key, self.recvs)
                self.comm._wait_sent(self.key, self.trackers)
        finally:
            self.done = True
            self.comm._finish(self.key)
        self.keep.clear()


class ZmqComm:
    """One rank of a peer-to-peer world over ZeroMQ; see the module docstring."""

    backend = "zmq"
    #: ``exchange(..., hold=True)`` leaves received rows in ZeroMQ's frames (``pending.parts``):
    #: no copy into the receive buffer, which cost 0.2-0.4x of Gloo's exchange time
    zero_copy = True

    def __init__(
        self,
        rank: int,
        peers: str | Path | dict,
        device: str | torch.device = "cpu",
        timeout_s: float = 300.0,
        bind_host: str | None = None,
        *,
        p2p: bool = False,
        link_timeout_s: float | None = None,
        faults: Faults | None = None,
    ):
        self.peers = read_peers(peers)
        # p2p: no world-wide collectives, lost links are tolerated (see "Link faults" above)
        self.p2p = bool(p2p)
        self.collectives = not self.p2p
        self.link_timeout_s = float(link_timeout_s or timeout_s)
        self.faults = faults or Faults()
        self._heard: dict[int, int] = {}  # rank -> the round its last hello named
        self._said: dict[int, tuple] = {}  # rank -> its last hello's (RESUMING/AGREED, dims)
        self._holds: tuple[int, ...] = ()  # while resuming: the rounds of our checkpoints
        #: the round this process resumed at, agreed with those resuming with it (None: not so)
        self.agreed_round: int | None = None
        self._silent: set[int] = set()  # neighbours that sent nothing in their last exchange
        self._reply_to: set[int] = set()  # peers whose hello awaits an answer
        #: the run's config digest (positive, 31 bits; 0: not checked), sent in every hello: a
        #: process started with another config is refused as it joins
        self.config_digest = 0
        self._other_config: set[int] = set()  # peers whose hello named another digest
        self._live: set[int] = set()  # the links that counted in the last exchange
        self._exchanged = False  # whether an exchange ran (self._live is its links)
        self._near: set[int] = set()  # every rank linked in an exchange so far (keepalives)
        self.last_links: dict = {}  # the last p2p exchange's links and the ones lost
        if rank not in self.peers:
            raise GossipError(
                f"rank {rank} is not in the peers table (ids 0..{len(self.peers) - 1})"
            )
        self.rank = rank
        self.world_size = len(self.peers)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.stats = {"stale": 0, "duplicate": 0, "bad": 0, "unknown": 0, "unexpected": 0}
        if self.p2p:  # links given up, neighbours seen past an exchange, messages the fault
            # injection suppressed, and deadlines a neighbour's keepalive extended
            self.stats.update(lost=0, ahead=0, injected=0, extended=0)
        self._round, self._phase = 0, 0
        self._next = {EXCHANGE: 0, REDUCE: 0}  # next sequence number per kind, under the tag
        self._queue: dict[tuple, dict[int, _Msg]] = {}  # key -> sender -> queued message
        self._active: tuple | None = None
        self._filled: set[int] = set()  # senders received for the active operation
        self._parts: dict | None = None  # the active exchange's held frames (hold=True)
        # libzmq mallocs every received frame in its I/O thread; with glibc's defaults the
        # heap's top goes back to the kernel whenever a few frames are freed at once, and the
        # next frames fault their pages in again (about half the bytes received here)
        keep_freed_memory()
        self._ctx = zmq.Context(io_threads=IO_THREADS)
        self._ctx.ipv6 = True  # IPv6 hosts ([::1]) too; IPv4 ones work as before
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        host, port = self.peers[rank].rsplit(":", 1)
        here = f"tcp://{bind_host or host}:{port}"
        try:
            self._pull.bind(here)
        except zmq.ZMQError as err:
            self._ctx.destroy(linger=0)
            raise GossipError(f"rank {rank}: cannot listen on {here} ({err})") from None
        self._push: dict[int, zmq.Socket] = {}

    # ------------------------------------------------------------------ tags
    def set_tag(self, round: int, phase: int = 0) -> None:  # noqa: A002 - the protocol's word
        """Tag the operations that follow with (round, phase). Tags only move forward; setting
        the current tag again keeps the operation counters."""
        tag = (int(round), int(phase))
        if tag == (self._round, self._phase):
            return
        if tag < (self._round, self._phase):
            raise GossipError(
                f"rank {self.rank}: tag {tag} is before the current ({self._round}, {self._phase})"
            )
        self._round, self._phase = tag
        self._next = {EXCHANGE: 0, REDUCE: 0}
        # queued messages for tags now past can never be used
        for key in [k for k in self._queue if k[:2] < tag]:
            self.stats["stale"] += len(self._queue.pop(key))

    @property
    def tag(self) -> tuple[int, int]:
        return self._round, self._phase

    def _take_key(self, kind: int) -> tuple[int, int, int, int]:
        if self._active is not None:
            raise RuntimeError(
                f"rank {self.rank}: an operation is still pending; wait_all it first"
            )
        key = (self._round, self._phase, kind, self._next[kind])
        self._next[kind] += 1
        self._active = key
        return key

    def _finish(self, key) -> None:
        self._active = None
        self._parts = None  # the held frames now belong to the pending exchange alone
        self._queue.pop(key, None)

    def _is_past(self, key) -> bool:
        if key[:2] != (self._round, self._phase):
            return key[:2] < (self._round, self._phase)
        return key[3] < self._next.get(key[2], 0) and key != self._active

    # ------------------------------------------------------------------ sending
    def _socket(self, peer: int) -> zmq.Socket:
        sock = self._push.get(peer)
        if sock is None:
            if peer not in self.peers or peer == self.rank:
                raise GossipError(f"rank {self.rank}: no peer {peer} to send to")
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{self.peers[peer]}")
            self._push[peer] = sock
        return sock

    def _send(self, peer: int, key, tensor: torch.Tensor, pending: ZmqPending) -> None:
        t = tensor.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()  # a staging copy, kept alive until sent
        if t.dtype not in _CODE or t.dim() > _MAX_DIMS:
            raise GossipError(f"rank {self.rank}: cannot send a {t.dtype} tensor of {t.dim()} dims")
        head = _HEAD.pack(
            _MAGIC, key[0], key[1], key[2], key[3], self.rank, _CODE[t.dtype], t.dim()
        )
        head += b"".join(_DIM.pack(d) for d in t.shape)
        sock = self._socket(peer)
        if self.p2p:  # never block on a dead peer's full queue: that is a lost link
            try:
                sock.send(head, zmq.SNDMORE | zmq.NOBLOCK)
            except zmq.Again:
                return
        else:
            sock.send(head, zmq.SNDMORE)
        data = _as_bytes(t)
        last = (max(len(data), 1) - 1) // CHUNK * CHUNK  # where the last frame starts
        for at in range(0, last + 1, CHUNK):  # once for an empty tensor
            flags = zmq.SNDMORE if at < last else 0
            tracker = sock.send(data[at : at + CHUNK], flags, copy=False, track=True)
            pending.trackers.append((peer, tracker))
        pending.keep.append(t)

    def _wait_sent(self, key, trackers) -> None:
        deadline = time.monotonic() + self.timeout_s
        late = []
        for peer, tracker in trackers:
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                late.append(peer)
        if late:
            raise GossipError(
                f"rank {self.rank}: {self._what(key)} timed out after {self.timeout_s:g} s "
                f"sending to rank(s) {late}; a peer process probably died or has not started"
            )

    # ------------------------------------------------------------------ receiving
    def _read_header(self):
        """The next message's header, parsed; None (message drained, counted) if it is
        malformed or from a rank not in the peers table."""
        head = self._pull.recv()
        more = self._pull.getsockopt(zmq.RCVMORE)
        ok = len(head) >= _HEAD.size and head[:4] == _MAGIC and more
        if ok:
            magic, rnd, phase, kind, seq, sender, code, ndim = _HEAD.unpack_from(head)
            ok = len(head) == _HEAD.size + ndim * _DIM.size and code < len(_DTYPES)
            ok = ok and kind in _KINDS
        if not ok:
            self._drain(more)
            self.stats["bad"] += 1
            log.warning(
                "rank %d: dropped a malformed message (%d-byte header)", self.rank, len(head)
            )
            return None
        shape = tuple(_DIM.unpack_from(head, _HEAD.size + i * _DIM.size)[0] for i in range(ndim))
        key, msg = (rnd, phase, kind, seq), _Msg(sender, _DTYPES[code], shape)
        if sender not in self.peers or sender == self.rank:
            why = "not a rank of the peers table"
            if sender == self.rank:  # e.g. 127.0.0.1:P for one id and localhost:P for another
                why = "its own: two ids of the peers file reach this address"
            self._drop("unknown", key, msg, why)
            return None
        return key, msg

    def _recv_payload(self, view: memoryview) -> int:
        """Receive the payload frames of the message being read into ``view``, in order;
        returns the payload's size in bytes (more than ``len(view)`` if it did not fit: the
        excess is read and discarded)."""
        n = 0
        while True:
            if n < len(view):
                n += self._pull.recv_into(view[n:])  # a frame's full size, even if truncated
            else:
                n += len(self._pull.recv(copy=False))
            if not self._pull.getsockopt(zmq.RCVMORE):
                return n

    def _drain(self, more) -> None:
        while more:
            self._pull.recv(copy=False)
            more = self._pull.getsockopt(zmq.RCVMORE)

    def _drop(self, what: str, key, msg: _Msg, why: str) -> None:
        """Drop a message whose payload is still on the socket: read it off, count, log."""
        self._drain(True)
        self._count_drop(what, key, msg, why)

    def _count_drop(self, what: str, key, msg: _Msg, why: str) -> None:
        self.stats[what] += 1
        log.warning(
            "rank %d: dropped a message from rank %d for %s: %s",
            self.rank,
            msg.sender,
            self._what(key),
            why,
        )

    def _fits(self, msg: _Msg, into: torch.Tensor) -> str | None:
        if msg.dtype != into.dtype or msg.shape != tuple(into.shape):
            return (
                f"{msg.dtype} {list(msg.shape)} where {into.dtype} {list(into.shape)} was expected"
            )
        return None

    def _receive(self, key, recvs: dict[int, torch.Tensor]) -> None:
        """Fill every ``recvs[sender]`` with that sender's message for ``key``."""
        waiting = dict(recvs)
        for msg in self._queue.pop(key, {}).values():  # arrived early
            self._place(key, msg, waiting)
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0 or not self._pull.poll(max(1, int(left * 1000))):
                raise GossipError(
                    f"rank {self.rank}: {self._what(key)} timed out after {self.timeout_s:g} s "
                    f"waiting for rank(s) {sorted(waiting)}; a peer process probably died or "
                    "has not started"
                )
            got = self._read_header()
            if got is None:
                continue
            mkey, msg = got
            if mkey == key:
                self._take(key, msg, waiting)
            elif self._is_past(mkey):
                self._drop("stale", mkey, msg, "that operation is over")
            else:  # a later operation: keep it
                if self._queue_early(mkey, msg):
                    log.warning(
                        "rank %d: dropped a second message from rank %d for %s",
                        self.rank,
                        msg.sender,
                        self._what(mkey),
                    )

    def _take(self, key, msg: _Msg, waiting: dict) -> bool:
        """Receive the payload of an on-time message straight into its tensor; True if it
        landed."""
        into = waiting.get(msg.sender)
        if into is None:
            what = "duplicate" if msg.sender in self._filled else "unexpected"
            self._drop(what, key, msg, "not expected (or already received)")
            return False
        why = self._fits(msg, into)
        if why:
            self._drop("bad", key, msg, why)
            return False
        if self._holding(into):
            frames = [self._pull.recv(copy=False)]
            while self._pull.getsockopt(zmq.RCVMORE):
                frames.append(self._pull.recv(copy=False))
            return self._hold(key, msg, frames, into, waiting)
        staged = into if into.device.type == "cpu" and into.is_contiguous() else None
        buf = staged if staged is not None else torch.empty(into.shape, dtype=into.dtype)
        n = self._recv_payload(_as_bytes(buf))
        if n != buf.numel() * buf.element_size():
            # the header lied about the payload: the tensor may hold part of it, but it is not
            # marked received, so a timeout follows unless a good copy comes
            self._count_drop("bad", key, msg, f"{n} payload bytes for {list(msg.shape)}")
            return False
        if staged is None:
            into.copy_(buf)
        return self._landed(msg.sender, waiting)

    def _landed(self, sender: int, waiting: dict) -> bool:
        """``sender``'s tensor is filled: no longer waited for; True."""
        del waiting[sender]
        self._filled.add(sender)
        return True

    def _place(self, key, msg: _Msg, waiting: dict) -> bool:
        """Copy a queued (early) message into its tensor, after the same checks; True if it
        landed."""
        into = waiting.get(msg.sender)
        why = "not expected" if into is None else self._fits(msg, into)
        size = sum(len(f.buffer) for f in msg.data)
        if why is None and size != into.numel() * into.element_size():
            why = "payload size does not match its header"
        if why:  # its payload was read with it when it was queued
            self._count_drop("unexpected" if into is None else "bad", key, msg, why)
            return False
        if self._holding(into):
            return self._hold(key, msg, msg.data, into, waiting)
        if into.device.type == "cpu" and into.is_contiguous():
            dest = into
        else:
            dest = torch.empty(into.shape, dtype=into.dtype)
        _copy_frames([f.buffer for f in msg.data], dest)
        if dest is not into:
            into.copy_(dest)
        return self._landed(msg.sender, waiting)

    def _holding(self, into: torch.Tensor) -> bool:
        """Whether the active exchange keeps the frames meant for ``into`` (hold=True)."""
        return self._parts is not None and into.device.type == "cpu" and into.is_contiguous()

    def _hold(self, key, msg: _Msg, frames: list, into: torch.Tensor, waiting: dict) -> bool:
        """Keep a message's payload frames as ``into``'s parts (1-D tensors over ZeroMQ's
        buffers, no copy; ``into`` is a contiguous CPU tensor) after checking their size; True
        if it landed."""
        size, esize = sum(len(f.buffer) for f in frames), into.element_size()
        if size != into.numel() * esize:
            self._count_drop("bad", key, msg, f"{size} payload bytes for {list(msg.shape)}")
            return False
        bufs = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames if len(f.buffer)]
        # our sends cut frames at whole elements (CHUNK is a multiple of every element size);
        # bytes cut otherwise, or a frame libzmq placed at an odd address, are copied instead
        if all(len(b) % esize == 0 and b.ctypes.data % esize == 0 for b in bufs):
            self._parts[msg.sender] = [torch.from_numpy(b).view(into.dtype) for b in bufs]
        else:
            _copy_frames(bufs, into)
        return self._landed(msg.sender, waiting)

    def _what(self, key) -> str:
        return f"{_KINDS[key[2]]} #{key[3]} of round {key[0]}, phase {key[1]}"

    # ------------------------------------------------------------------ peer to peer
    def _control(self, peer: int, key, kind: int, dims: tuple[int, ...] = ()) -> None:
        """A header-only message (ack, hello; ``dims``: a few ints in the shape's place);
        dropped, never blocking, if the peer's queue is full (a dead peer's)."""
        head = _HEAD.pack(_MAGIC, key[0], key[1], kind, key[3], self.rank, 0, len(dims))
        head += b"".join(_DIM.pack(d) for d in dims)
        try:
            self._socket(peer).send_multipart([head, b""], zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _reset(self, peer: int) -> None:
        """Forget what is still queued for ``peer`` (a lost link): a dead peer's messages would
        otherwise pile up, and a restarted one would get them all; the next send reconnects."""
        sock = self._push.pop(peer, None)
        if sock is not None:
            sock.close(linger=0)

    def _hello(self, mkey, msg: _Msg) -> None:
        """A peer announced itself (mkey[0]: its round; mkey[1]: WANTS_REPLY, RESUMING and
        AGREED bits, of which the shape's dims; mkey[3]: its config's digest)."""
        self._drain(True)
        self._heard[msg.sender] = mkey[0]
        self._said[msg.sender] = (mkey[1] & (RESUMING | AGREED), msg.shape)
        if mkey[1] & WANTS_REPLY:
            self._reply_to.add(msg.sender)
        if mkey[3] and self.config_digest and mkey[3] != self.config_digest:
            self._other_config.add(msg.sender)

    def _hello_to(self, peer: int, rnd: int, reply: bool) -> None:
        """Announce this process to ``peer``: its round, whether it wants a reply, its
        config's digest, and the rounds it can resume from (resuming) or resumed at (agreed)."""
        flags, dims = int(reply), ()
        if self._holds:
            flags, dims = flags | RESUMING, self._holds
        elif self.agreed_round is not None and self._round < self.agreed_round + self.world_size:
            # (said for as many rounds as there are processes: until then a process that
            # is late to resume holds its neighbours back, so that they wait for it there)
            flags, dims = flags | AGREED, (self.agreed_round,)
        self._control(peer, (rnd, flags, HELLO, self.config_digest), HELLO, dims)

    def _answer_hellos(self, rnd: int | None = None) -> None:
        """Tell the peers that asked which round this process is at (after a lost link's
        socket was reset, so that the reply is not discarded with it); ``rnd``: joining, the
        round of its checkpoint (its tag is then the earliest it may start at, which made a
        rejoin's start depend on which of its messages came last)."""
        for r in sorted(self._reply_to):
            self._hello_to(r, self._round if rnd is None else rnd, reply=False)
        self._reply_to.clear()

    def _queue_early(self, mkey, msg: _Msg) -> bool:
        """Keep a message for a later operation (its payload frames read off the socket);
        True if it was a second copy (dropped, counted)."""
        frames = [self._pull.recv(copy=False)]
        while self._pull.getsockopt(zmq.RCVMORE):
            frames.append(self._pull.recv(copy=False))
        slot = self._queue.setdefault(mkey, {})
        if msg.sender in slot:
            self.stats["duplicate"] += 1
            return True
        msg.data = frames
        slot[msg.sender] = msg
        return False

    def join(
        self, first_round: int, need_all: bool, wait_round: int = 0, holds: tuple[int, ...] = ()
    ) -> int:
        """Announce this process to every other one and wait for theirs; returns the round to
        start at: ``first_round``, or the latest round a running peer names (a restarted
        peer rejoins at the current round), or, resuming with others that all resume too,
        the latest of the rounds ``holds`` (those this process has checkpoints of) that every
        one of them holds (:meth:`_resume_round`; ``agreed_round`` says so).

        ``need_all`` (a fresh start): every process must answer within ``timeout_s``, else a
        one-line GossipError names the silent ranks and their addresses. Otherwise (a restart)
        one answer is enough (the others get one link timeout more), once a peer names round
        ``wait_round`` or later (the kill schedule's restart round; waiting is bounded by
        ``timeout_s`` without any answer). Announcements repeat every ``HELLO_EVERY_S`` seconds (at
        most the link timeout): a running peer answers between two of its exchanges.
        """
        # (the earliest round it may start at: the exchanges of those that started there
        # are kept for it)
        self.set_tag(min([first_round, *holds]), 0)
        self._silent.clear()
        others = [r for r in self.peers if r != self.rank]
        if not others:  # a one-process run: nobody to wait for (waiting would time out)
            return first_round
        self._holds = tuple(sorted(holds))
        try:
            self._await_hellos(first_round, need_all, wait_round, others)
        finally:
            self._holds = ()
        heard = [r for r in others if r in self._heard]
        # a restart on standby (wait_round) rejoins a running run whatever its peers say
        agreed = None if wait_round else self._resume_round(holds, heard, others)
        if agreed is not None:  # all resuming: the round agreed, unless one fell back
            self.agreed_round = agreed
            self.set_tag(agreed, 0)
            self._tell(others, first_round)  # (the round it names stays its checkpoint's)
            if self._confirmed(others, agreed, first_round):
                return agreed
            self.agreed_round = None
        start = max([first_round, *(self._heard[r] for r in heard)])  # rejoin (or a start)
        running = [self._heard[r] for r in heard if not self._said.get(r, (0, ()))[0]]
        if not wait_round and running and max(running) < first_round and max(running) in holds:
            # late to a resume the others went on with at an earlier round, one it holds: it
            # goes back there too (it started a round past them, alone)
            start = max(running)
        self.set_tag(start, 0)  # queued messages of the rounds skipped are dropped as stale
        if holds:  # the outcome to everyone at once: one still joining must not go on
            self._tell(others, start)  # reading this one's "resuming" hello
        return start

    def _tell(self, others: list[int], rnd: int) -> None:
        """This process's outcome to every other one: the round agreed (``agreed_round``),
        or running at round ``rnd``."""
        for r in others:
            self._hello_to(r, rnd, reply=False)

    def _confirmed(self, others: list[int], agreed: int, first_round: int) -> bool:
        """After agreeing on round ``agreed``: every other process's outcome, up to a link
        timeout. False if one fell back (it decided without hearing everyone, as this one
        heard the last of them: one at the round agreed, the others at the latest named);
        True when all agreed, or when the others said nothing more in time."""
        deadline = time.monotonic() + self.link_timeout_s
        while True:
            said = [self._said.get(r, (0, ())) for r in others]
            if any(not flags or (flags & AGREED and dims[:1] != (agreed,)) for flags, dims in said):
                return False
            if all(flags & AGREED for flags, _ in said):
                return True
            wait = deadline - time.monotonic()
            if wait <= 0:  # (the silent ones: dead or slow, as lost links then)
                return True
            got = self._next_header(wait)
            if got is None:
                continue
            mkey, msg = got
            if mkey[2] == HELLO:
                self._hello(mkey, msg)
                self._answer_hellos(first_round)
            else:
                self._keep_for_later(mkey, msg, stale=mkey[:2] < self.tag)

    def _next_header(self, wait: float):
        """The next message's header within ``wait`` seconds (None: none came, or it was
        dropped)."""
        if not self._pull.poll(max(1, int(wait * 1000))):
            return None
        return self._read_header()

    def _keep_for_later(self, mkey, msg: _Msg, stale: bool) -> None:
        """A joining process's message that is no hello: a keepalive (a running peer waiting
        on another: nothing for it), one of an operation that is over (``stale``: dropped), or
        one for an operation to come (queued)."""
        if mkey[2] == ALIVE:
            self._drain(True)
        elif stale:
            self._drop("stale", mkey, msg, "that operation is over")
        else:
            self._queue_early(mkey, msg)

    def _resume_round(
        self, holds: tuple[int, ...], heard: list[int], others: list[int]
    ) -> int | None:
        """The round to resume at if every process is resuming with this one (all heard):
        the latest round all of them hold a checkpoint of (or that those already resumed
        agreed on: computed from the same rounds, it is the same); None otherwise (one is
        running or was not heard in time, or they hold no round in common: they stopped too
        far apart), and the rejoin skips rounds instead. Each decides alone, so those that
        heard everyone agree, and one that did not falls back and says so at once (join's
        last hellos), which makes those still joining fall back too."""
        said = [self._said.get(r, (0, ())) for r in heard]
        if not holds or len(heard) < len(others) or not all(flags for flags, _ in said):
            return None
        common = set(holds)
        for flags, dims in said:
            if flags & RESUMING:
                common &= set(dims)
        agreed = {dims[0] for flags, dims in said if flags & AGREED and dims}
        if len(agreed) > 1:
            return None
        target = agreed.pop() if agreed else max(common, default=None)
        return target if target in common else None

    def _running_round(self) -> int:
        """The latest round a running peer named (-1: none): a joining process starts there
        or later, so messages of earlier rounds are of no use (a restart kept every row its
        neighbours sent while it joined); a resuming peer's round is its checkpoint's, and
        the start may be earlier."""
        running = [self._heard[r] for r, (flags, _) in self._said.items() if not flags]
        return max(running, default=-1)

    def _await_hellos(
        self, first_round: int, need_all: bool, wait_round: int, others: list[int]
    ) -> None:
        """join's waiting: until every other process has answered (or, a restart, one has
        and the others had a link timeout more), announcing this one every HELLO_EVERY_S."""
        deadline = time.monotonic() + self.timeout_s
        first_heard, announced, drained = None, -math.inf, 0.0
        # a few header-only messages: often enough that a restart waiting for round
        # ``wait_round`` hears of it while the others are there (they may pass many rounds in
        # one link timeout)
        every = min(self.link_timeout_s, HELLO_EVERY_S)
        while True:
            now = time.monotonic()
            if now - announced >= every:
                for r in others:
                    self._hello_to(r, first_round, reply=True)
                announced = now
            missing = [r for r in others if r not in self._heard]
            latest = max(self._heard.values(), default=-1)
            if not missing and latest >= wait_round:
                # what is already here first: a late process found the others' "resuming"
                # hellos queued before the outcome they sent when they decided
                drained = drained or now + DRAIN_S
                if now >= drained or not self._pull.poll(0):
                    break
            if not need_all and first_heard is not None and latest >= wait_round:
                deadline = min(deadline, first_heard + self.link_timeout_s)
            if now >= deadline:
                if need_all or not self._heard:
                    where = ", ".join(f"{r} at {self.peers[r]}" for r in missing[:4])
                    raise GossipError(
                        f"rank {self.rank}: rank(s) {missing} did not answer within "
                        f"runtime.timeout_s = {self.timeout_s:g} s ({where}): not started, "
                        "or the host is unreachable"
                    )
                if latest >= wait_round:
                    break
                raise GossipError(
                    f"rank {self.rank}: the running peers did not reach round {wait_round} "
                    f"within runtime.timeout_s = {self.timeout_s:g} s of their last answer"
                )
            got = self._next_header(min(deadline, announced + every) - now)
            if got is None:
                continue
            mkey, msg = got
            if mkey[2] == HELLO:
                if mkey[0] > latest:  # a peer is running: wait timeout_s from its answer
                    deadline = max(deadline, time.monotonic() + self.timeout_s)
                before = self._heard.get(msg.sender)
                first_heard = first_heard or time.monotonic()
                self._hello(mkey, msg)
                if self._other_config:  # they trained together, merge refused them at the end
                    other = sorted(self._other_config)
                    for r in other:  # this process's digest, so that they stop too (close
                        self._hello_to(r, first_round, reply=False)  # lingers for them)
                    raise GossipError(
                        f"rank {self.rank}: process(es) {other} were started with another "
                        "config than this one; give every process the same config and --set"
                    )
                self._answer_hellos(first_round)
                # a restart asks a running peer below the restart round again at once: a fast
                # run can pass that round and end between two announcements, unheard
                if not need_all and mkey[0] < wait_round and (before is None or mkey[0] > before):
                    self._hello_to(msg.sender, first_round, reply=True)
            else:
                stale = mkey[:2] < self.tag or mkey[0] < self._running_round()
                self._keep_for_later(mkey, msg, stale)

    def _settle(
        self, key, recvs: dict[int, torch.Tensor], sends: set[int], trackers, down=frozenset()
    ) -> set[int]:
        """The p2p wait: fill ``recvs``, acknowledge every message that lands, collect the
        acknowledgements of ``sends``; returns the ranks whose link did not count.

        A link with rank r counts when r's message landed here and (if this rank sent to r)
        r's ack came back, i.e. both ends hold each other's rows. It is given up when its
        deadline passes (the link timeout, extended by r's keepalives up to ``timeout_s``), or
        at once when r is seen past this operation (r already decided: its ack would have
        come before its later messages, on the same connection). The links in ``down`` (fault
        injection: both ends drew the same number) are lost without a wait. While it waits,
        this rank sends a keepalive to its other neighbours every ``ALIVE_EVERY`` link timeout,
        so that those already at a later exchange wait for it instead of dropping its link
        (which would make them late to theirs in turn: a cascade, one hop per round).
        """
        waiting = {r: t for r, t in recvs.items() if r not in down}
        need_ack = set(sends) - set(down)
        links = set(recvs) | set(sends)
        self._near |= links
        op = (key[0], key[1], key[3])
        # a neighbour whose message for a later exchange is already queued sent it before ours
        # for this one existed: it has decided this link without us
        ahead = {s for k, slot in self._queue.items() if (k[0], k[1], k[3]) > op for s in slot}
        ahead &= links
        self.stats["ahead"] += len(ahead)
        for sender in self._queue.pop((key[0], key[1], ACK, key[3]), {}):
            need_ack.discard(sender)
        heard = set()  # senders of an exchange message or an ack during this wait
        for msg in self._queue.pop(key, {}).values():
            heard.add(msg.sender)
            if self._place(key, msg, waiting):
                self._ack(msg.sender, key)
        now = time.monotonic()
        cap, lt = now + self.timeout_s, self.link_timeout_s
        until = dict.fromkeys(links, now + lt)  # per link: when it is given up
        every = lt * ALIVE_EVERY
        alive_at = now + every

        def extend(r: int) -> None:  # r's deadline: a link timeout from now, within timeout_s
            until[r] = min(cap, max(until[r], time.monotonic() + lt))

        while True:
            now = time.monotonic()
            left_open = {r for r in links if r not in ahead and (r in waiting or r in need_ack)}
            # a neighbour silent since the last exchange (dead?) is not waited for, unless it
            # sent something during this wait: what has arrived from it is read, and its link
            # counts only if complete
            silent = {r for r in left_open if r in self._silent and r not in heard}
            waited = [r for r in left_open - silent if until[r] > now]
            if waited:
                if now >= alive_at:
                    self._keepalive(key, self._near - left_open - self._silent)
                    alive_at = now + every
                ms = max(1, math.ceil((min(alive_at, *(until[r] for r in waited)) - now) * 1e3))
            elif silent and not left_open - silent:
                ms = 0  # read what has already arrived
            else:
                break
            if not self._pull.poll(ms):
                if ms == 0:
                    break
                continue
            got = self._read_header()
            if got is None:
                continue
            mkey, msg = got
            sender, kind = msg.sender, mkey[2]
            mop = (mkey[0], mkey[1], mkey[3])
            if kind in (EXCHANGE, ACK):  # a hello ends no silence: the peer may still wait
                if sender in until and sender in self._silent and sender not in heard:
                    extend(sender)  # it is back: wait for it (a fresh link timeout)
                heard.add(sender)
            if kind == HELLO:
                self._hello(mkey, msg)
            elif kind == ALIVE:
                self._drain(True)
                if sender not in left_open:
                    continue  # a neighbour this rank does not wait for
                if mop < op:  # alive and coming: wait one more link timeout for it
                    extend(sender)
                    self.stats["extended"] += 1
                elif mop > op:  # it has decided this exchange
                    ahead.add(sender)
                    self.stats["ahead"] += 1
            elif kind not in (EXCHANGE, ACK):
                self._drop("bad", mkey, msg, "no collectives in a peer-to-peer world")
            elif mop == op and kind == ACK:
                self._drain(True)
                if sender in need_ack:
                    need_ack.discard(sender)
                else:
                    self._count_drop("unexpected", mkey, msg, "an ack for nothing sent")
            elif mop == op:
                if self._take(key, msg, waiting):
                    self._ack(sender, key)
            elif mop < op:
                self._drop("stale", mkey, msg, "that operation is over")
            else:  # from a later operation: the sender has moved on
                self._queue_early(mkey, msg)
                if sender in links and sender not in ahead:
                    ahead.add(sender)
                    self.stats["ahead"] += 1
        done = {r for r in links if r not in waiting and r not in need_ack and r not in down}
        for r in links - done - set(down):  # nothing was sent on an injected drop
            self._reset(r)
        self._silent -= heard | done
        self._live, self._exchanged = done, True
        self._answer_hellos()
        self._silent |= {r for r in links - done if r not in heard and r in waiting}
        lost = set(recvs) - done
        self.stats["lost"] += len(lost)
        if lost:
            log.info("rank %d: %s: link(s) with %s lost", self.rank, self._what(key), sorted(lost))
        self.last_links = {"round": key[0], "phase": key[1], "links": sorted(links),
                           "lost": sorted(links - done)}  # fmt: skip
        # an acked message has left; the others' sockets were just reset
        self._wait_sent(key, [(r, t) for r, t in trackers if r in done])
        return lost

    def _keepalive(self, key, ranks) -> None:
        """Tell ``ranks`` that this rank is alive and still in exchange ``key``."""
        for r in sorted(ranks):
            self._control(r, key, ALIVE)

    def _ack(self, peer: int, key) -> None:
        if self.faults.ack_lost(key, self.rank, peer):
            self.stats["injected"] += 1
            return
        self._control(peer, key, ACK)

    # ------------------------------------------------------------------ the interface
    def exchange(
        self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], hold: bool = False
    ):
        """Send each ``sends[r]`` to rank r and post the receive of each ``recvs[r]`` from rank
        r, under the current tag; the returned ``ZmqPending.wait_all`` fills ``recvs`` (with
        ``hold``, the CPU ones are left in ZeroMQ's frames instead: ``pending.parts``)."""
        key = self._take_key(EXCHANGE)
        pending = ZmqPending(self, key, dict(recvs), sends=set(sends))
        self._parts = pending.parts if hold else None
        if self.p2p and self.faults.drop:  # both ends draw the same number: neither waits
            pending.down = {r for r in {*sends, *recvs} if self.faults.link_down(key, self.rank, r)}
            self.stats["injected"] += len(pending.down)
        self._filled = set()
        try:
            for peer, tensor in sends.items():
                if peer not in pending.down:
                    self._send(peer, key, tensor, pending)
        except BaseException:
            self._finish(key)
            raise
        return pending

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place, added in rank order (bit-identical on every
        rank); returns it."""
        self._parts = None
        if self.world_size == 1:
            return tensor
        if self.p2p:
            raise GossipError(
                f"rank {self.rank}: all_reduce_sum over a peer-to-peer world (p2p=True has no "
                "collectives: check comm.collectives first)"
            )
        key = self._take_key(REDUCE)
        pending = ZmqPending(self, key, {})
        self._filled = set()
        try:
            mine = tensor.detach().to("cpu").contiguous()
            for peer in self.peers:
                if peer != self.rank:
                    self._send(peer, key, mine, pending)
            parts = {r: torch.empty_like(mine) for r in self.peers if r != self.rank}
            pending.recvs = parts
        except BaseException:
            self._finish(key)
            raise
        pending.wait_all()
        parts[self.rank] = mine
        total = parts[0].clone()
        for r in range(1, self.world_size):
            total += parts[r]
        with torch.no_grad():
            tensor.copy_(total)
        return tensor

    def close(self) -> None:
        """Close the sockets. Messages still queued for a live peer get up to ``timeout_s`` to
        leave (pyzmq copies small messages and reports them sent at once, so the last
        exchange's may still be queued); those for a dead peer are then discarded."""
        # p2p: what is left is at most the last acks, and a peer that still wants them waits
        # no longer than the link timeout
        for peer, sock in self._push.items():
            linger = self.timeout_s
            if self.p2p:  # hellos for a peer that never came are not worth waiting for, but
                # for one started with another config they tell it to stop (a second at most:
                # it may have stopped already); before any exchange (Local has none) the
                # peers heard from are live: a last answer to a hello may still be queued
                live = self._live if self._exchanged else self._heard
                linger = self.link_timeout_s if peer in live else 0
                if peer in self._other_config:
                    linger = min(self.link_timeout_s, 1.0)
            sock.close(linger=int(linger * 1000))
        self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

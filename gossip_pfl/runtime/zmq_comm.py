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

Messages are two frames: a fixed-size header (magic, round, phase, kind, sequence number,
sender, dtype and shape) and the tensor's bytes. Sends are zero-copy for contiguous CPU tensors
(ZeroMQ holds the tensor's memory until the bytes have left; ``Pending.wait_all`` waits for
that; pyzmq copies messages under 64 KiB instead, and ``close`` lingers so those still leave).
A message for the operation being waited on is received straight into the preallocated tensor
(``recv_into``), after its header was checked; nothing is pickled.

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

``all_reduce_sum`` is all-to-all: every rank sends its tensor to every other rank, then each
adds the world's tensors in rank order, so all ranks get bit-identical sums. It moves
``(world - 1)`` tensors per rank, fine for metrics (a few numbers) on a few dozen ranks.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from gossip_pfl.errors import GossipError

log = logging.getLogger(__name__)

EXCHANGE, REDUCE = 0, 1
_KINDS = {EXCHANGE: "exchange", REDUCE: "all_reduce"}
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
        import yaml

        path = Path(peers)
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as err:
            raise GossipError(f"peers file {path}: {err.strerror or err}") from None
        except yaml.YAMLError as err:
            raise GossipError(
                f"peers file {path}: not valid YAML ({err})".splitlines()[0]
            ) from None
        where = f"peers file {path}"
    else:
        raw, where = peers, "peers"
    if not isinstance(raw, dict) or not raw:
        raise GossipError(f"{where}: expected a mapping of rank id -> host:port")
    table: dict[int, str] = {}
    for key, addr in raw.items():
        try:
            rank = int(key)
        except (TypeError, ValueError):
            raise GossipError(f"{where}: rank id {key!r} is not an integer") from None
        if isinstance(key, bool) or rank < 0 or rank in table:
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
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise GossipError(f"{what}: address {addr!r} is not host:port")
    return f"{host}:{int(port)}"


def _as_bytes(t: torch.Tensor):
    """A writable/readable byte view of a contiguous CPU tensor's memory (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class _Msg:
    sender: int
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    data: object = None  # a zmq.Frame (queued messages)


@dataclass
class ZmqPending:
    """Exchange (or all-reduce) in flight; ``wait_all`` receives and checks what is due."""

    comm: ZmqComm
    key: tuple[int, int, int, int]
    recvs: dict[int, torch.Tensor]  # sender -> preallocated tensor (on comm.device)
    trackers: list = field(default_factory=list)
    keep: list = field(default_factory=list)  # tensors ZeroMQ may still read from
    done: bool = False

    def wait_all(self) -> None:
        if self.done:
            return
        try:
            self.comm._receive(self.key, self.recvs)
            self.comm._wait_sent(self.key, self.trackers)
        finally:
            self.done = True
            self.comm._finish(self.key)
        self.keep.clear()


class ZmqComm:
    """One rank of a peer-to-peer world over ZeroMQ; see the module docstring."""

    backend = "zmq"

    def __init__(
        self,
        rank: int,
        peers: str | Path | dict,
        device: str | torch.device = "cpu",
        timeout_s: float = 300.0,
        bind_host: str | None = None,
    ):
        self.peers = read_peers(peers)
        if rank not in self.peers:
            raise GossipError(
                f"rank {rank} is not in the peers table (ids 0..{len(self.peers) - 1})"
            )
        self.rank = rank
        self.world_size = len(self.peers)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.stats = {"stale": 0, "duplicate": 0, "bad": 0, "unknown": 0, "unexpected": 0}
        self._round, self._phase = 0, 0
        self._next = {EXCHANGE: 0, REDUCE: 0}  # next sequence number per kind, under the tag
        self._queue: dict[tuple, dict[int, _Msg]] = {}  # key -> sender -> queued message
        self._active: tuple | None = None
        self._filled: set[int] = set()  # senders received for the active operation
        self._ctx = zmq.Context()
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
        self._queue.pop(key, None)

    def _is_past(self, key) -> bool:
        if key[:2] != (self._round, self._phase):
            return key[:2] < (self._round, self._phase)
        return key[3] < self._next[key[2]] and key != self._active

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
        sock.send(head, zmq.SNDMORE)
        tracker = sock.send(_as_bytes(t), copy=False, track=True)
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
        """The next message's header, parsed; None (message drained) if it is malformed."""
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
        return (rnd, phase, kind, seq), _Msg(sender, _DTYPES[code], shape)

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
            if msg.sender not in self.peers or msg.sender == self.rank:
                self._drop("unknown", mkey, msg, "not a rank of the peers table")
            elif mkey == key:
                self._take(key, msg, waiting)
            elif self._is_past(mkey):
                self._drop("stale", mkey, msg, "that operation is over")
            else:  # a later operation: keep it
                frame = self._pull.recv(copy=False)
                self._drain(self._pull.getsockopt(zmq.RCVMORE))
                slot = self._queue.setdefault(mkey, {})
                if msg.sender in slot:
                    self.stats["duplicate"] += 1
                    log.warning(
                        "rank %d: dropped a second message from rank %d for %s",
                        self.rank,
                        msg.sender,
                        self._what(mkey),
                    )
                else:
                    msg.data = frame
                    slot[msg.sender] = msg

    def _take(self, key, msg: _Msg, waiting: dict) -> None:
        """Receive the payload of an on-time message straight into its tensor."""
        into = waiting.get(msg.sender)
        if into is None:
            what = "duplicate" if msg.sender in self._filled else "unexpected"
            self._drop(what, key, msg, "not expected (or already received)")
            return
        why = self._fits(msg, into)
        if why:
            self._drop("bad", key, msg, why)
            return
        staged = into if into.device.type == "cpu" and into.is_contiguous() else None
        buf = staged if staged is not None else torch.empty(into.shape, dtype=into.dtype)
        n = self._pull.recv_into(_as_bytes(buf)) if buf.numel() else len(self._pull.recv())
        self._drain(self._pull.getsockopt(zmq.RCVMORE))
        if n != buf.numel() * buf.element_size():
            # the header lied about the payload: the tensor may hold part of it, but it is not
            # marked received, so a timeout follows unless a good copy comes
            self.stats["bad"] += 1
            log.warning(
                "rank %d: dropped a message from rank %d for %s: %d payload bytes for %s",
                self.rank,
                msg.sender,
                self._what(key),
                n,
                list(msg.shape),
            )
            return
        if staged is None:
            into.copy_(buf)
        del waiting[msg.sender]
        self._filled.add(msg.sender)

    def _place(self, key, msg: _Msg, waiting: dict) -> None:
        """Copy a queued (early) message into its tensor, after the same checks."""
        into = waiting.get(msg.sender)
        why = "not expected" if into is None else self._fits(msg, into)
        if why is None and len(msg.data.buffer) != into.numel() * into.element_size():
            why = "payload size does not match its header"
        if why:  # its payload was read with it when it was queued
            self._count_drop("unexpected" if into is None else "bad", key, msg, why)
            return
        src = torch.frombuffer(msg.data.buffer, dtype=into.dtype) if into.numel() else into
        into.copy_(src.view(into.shape))
        del waiting[msg.sender]
        self._filled.add(msg.sender)

    def _what(self, key) -> str:
        return f"{_KINDS[key[2]]} #{key[3]} of round {key[0]}, phase {key[1]}"

    # ------------------------------------------------------------------ the interface
    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]):
        """Send each ``sends[r]`` to rank r and post the receive of each ``recvs[r]`` from rank
        r, under the current tag; the returned ``ZmqPending.wait_all`` fills ``recvs``."""
        key = self._take_key(EXCHANGE)
        pending = ZmqPending(self, key, dict(recvs))
        self._filled = set()
        try:
            for peer, tensor in sends.items():
                self._send(peer, key, tensor, pending)
        except BaseException:
            self._finish(key)
            raise
        return pending

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place, added in rank order (bit-identical on every
        rank); returns it."""
        if self.world_size == 1:
            return tensor
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
        for sock in self._push.values():
            sock.close(linger=int(self.timeout_s * 1000))
        self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""Neighbour exchange and mixing: ``theta_i <- sum_j W_t[i, j] theta_j`` for a rank's nodes.

Every rank derives the same phase from the schedule, so each works out on its own which rows it
must send to and receive from every other rank: no negotiation messages. Per phase, one fused
flat buffer travels per neighbouring rank (all components, all peers needed), and the mix itself
is a matrix product over the rank's own rows plus, for the received ones, one product over the
receive buffer or, when local and received rows are few (``ROWWISE_LOCAL``, ``ROWWISE_ROWS``),
each row added in turn straight from where the transport left it (zmq's frames: no copy into
the buffer; :func:`add_rows`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gossip_pfl.runtime.comm import row_index, upload
from gossip_pfl.runtime.placement import Placement
from topologies import Phase


@dataclass
class PhasePlan:
    """What one rank sends, receives and multiplies for one phase.

    The mixing matrix is kept in two column blocks: one over the rank's own rows and one over
    every row it receives, which land next to each other in one buffer (in the order of the
    sending ranks), so the received part of the mix is one product over that buffer.
    """

    sends: dict[int, torch.Tensor | slice]  # rank -> local rows to send (sorted by node id)
    recv_counts: dict[int, int]  # rank -> rows to receive (sorted by node id)
    own: torch.Tensor  # W over the rank's own rows (L x L)
    received: torch.Tensor | None  # W over the received rows (L x sum of recv_counts)
    #: per sending rank, each local row's total weight on that rank's rows (computed at the
    #: first lost link: a lost link's weight goes to the diagonal)
    recv_mass: dict[int, torch.Tensor] = field(default_factory=dict)


# A block is a dense matrix when it is tiny (a few peers per rank, e.g. one large model per GPU)
# or at least a quarter full; else a CSR matrix. Measured on CPU with 40 MB of rows: over 64
# peers a ring's sparse product is 2x faster than the dense one, a quarter-full block costs the
# same both ways, and a full one is 4x faster dense; the crossover sits near a quarter full
# for 8 and 16 peers too.
DENSE_BLOCK_ENTRIES = 64
DENSE_BLOCK_FILL = 0.25


def _block(rows, cols, vals, shape, device) -> torch.Tensor:
    entries = shape[0] * shape[1]
    if entries <= DENSE_BLOCK_ENTRIES or len(vals) >= DENSE_BLOCK_FILL * entries:
        # duplicates summed in order, as index_put_'s accumulate does on a CPU; 4x faster than
        # zeros plus index_put_ at 300 x 300 (a time-varying W is planned every round)
        flat = np.bincount(rows * shape[1] + cols, weights=vals, minlength=entries)
        dense = torch.from_numpy(flat.reshape(shape).astype(np.float64, copy=False))
        return upload(dense, device)  # (partial participation plans a phase every round)
    coo = torch.sparse_coo_tensor(
        torch.as_tensor(np.stack([rows, cols])),
        torch.as_tensor(vals, dtype=torch.float64),
        shape,
        check_invariants=False,
    )
    with warnings.catch_warnings():  # "sparse CSR support is in beta": it is what we want
        warnings.simplefilter("ignore", UserWarning)
        csr = coo.coalesce().to_sparse_csr()
        # its three parts uploaded as the dense block is: a sparse tensor's .to(device) copies
        # them from pageable memory, each copy a wait for the device
        parts = [upload(t, device) for t in (csr.crow_indices(), csr.col_indices(), csr.values())]
        return torch.sparse_csr_tensor(*parts, shape, check_invariants=False)


def weight_by_size(phase: Phase, sizes: np.ndarray) -> Phase:
    """The phase with neighbour j weighted by its sample count n_j:
    ``W_ij n_j / sum_k W_ik n_k`` (row-stochastic; a node in no row keeps its value).

    On a complete graph with ``W = J / n`` this is the server's ``n_j / sum n`` average. Every
    rank derives it from the schedule, so it costs no traffic and no pass over the parameters.
    Auxiliary nodes past the peers (a hub) count as size 1: a hub's row is then the peers'
    size-weighted average, and a peer that copies the hub still copies it.
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    if phase.size > len(sizes):
        sizes = np.concatenate([sizes, np.ones(phase.size - len(sizes))])
    scaled = phase.weights * sizes[phase.cols]
    totals = np.bincount(phase.rows, weights=scaled, minlength=phase.size)
    return Phase(phase.size, phase.rows, phase.cols, scaled / totals[phase.rows])


def plan_phase(phase: Phase, placement: Placement, device: torch.device) -> PhasePlan:
    """Work out this rank's sends, receives and mixing blocks for ``phase``."""
    local = placement.nodes(phase.size)
    n_local = len(local)
    pos = np.full(phase.size, -1, dtype=np.int64)
    pos[local] = np.arange(n_local)
    me = placement.rank
    row_owner = placement.owner(phase.rows)
    # A node with no row keeps its value; one whose row holds only zeros becomes zero, as in
    # Phase.dense(). Zero weights then move nothing.
    listed = np.zeros(n_local, dtype=bool)
    listed[pos[phase.rows[row_owner == me]]] = True
    keep = phase.weights != 0
    rows, cols, weights = phase.rows[keep], phase.cols[keep], phase.weights[keep]
    row_owner, col_owner = row_owner[keep], placement.owner(cols)

    # Sends: my nodes that feed rows held elsewhere, grouped by the receiving rank.
    out = (col_owner == me) & (row_owner != me)
    sends = {}
    for r in np.unique(row_owner[out]):
        sends[int(r)] = row_index(pos[np.unique(cols[out & (row_owner == r)])], device)

    # My rows: a block over my own nodes (nodes with no row keep their value) ...
    mine = row_owner == me
    rows, cols, weights, col_owner = rows[mine], cols[mine], weights[mine], col_owner[mine]
    own = col_owner == me
    idle = np.flatnonzero(~listed)
    own_block = _block(
        np.concatenate([pos[rows[own]], idle]),
        np.concatenate([pos[cols[own]], idle]),
        np.concatenate([weights[own], np.ones(len(idle))]),
        (n_local, n_local),
        device,
    )
    # ... and one over the rows I receive, grouped by sending rank, each group by node id.
    remote = ~own
    nodes = np.unique(cols[remote])  # by node id; each node has one owner
    owners = placement.owner(nodes)
    order = np.argsort(owners, kind="stable")  # the buffer's order: by rank, then node id
    senders, counts = np.unique(owners, return_counts=True)
    recv_counts = dict(zip(senders.tolist(), counts.tolist()))
    slot = np.empty(len(nodes), dtype=np.int64)
    slot[order] = np.arange(len(nodes))
    c = slot[np.searchsorted(nodes, cols[remote])]  # each received weight's buffer row
    shape = (n_local, len(nodes))
    received = _block(pos[rows[remote]], c, weights[remote], shape, device) if len(nodes) else None
    return PhasePlan(sends, recv_counts, own_block, received)


@dataclass
class Exchanger:
    """Mixes a rank's stacked shared state (local nodes x D) through schedule phases."""

    placement: Placement
    comm: object  # LocalComm | TorchComm | ZmqComm
    bytes_sent: int = 0
    messages_sent: int = 0
    #: called as on_mix(state, out, lost) after every mix (peer-to-peer runs log their links)
    on_mix: Callable | None = None
    _cache: dict = field(default_factory=dict)
    _recv: dict = field(default_factory=dict)  # (D, dtype, device) -> receive buffer

    def recv_buffers(
        self, plan: PhasePlan, like: torch.Tensor
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The rows ``plan`` receives: one (rows, D) buffer shaped like ``like``'s rows, and its
        row slices by sending rank. The memory is reused from phase to phase and plan to plan
        (grown when a phase receives more rows): fresh 40 MB buffers cost page faults that a
        bare p2p loop does not pay, 2x its time when a time-varying W is planned every round.
        So one exchange at a time per Exchanger (phases run one after the other)."""
        total = sum(plan.recv_counts.values())
        key = (like.shape[1], like.dtype, like.device)
        if key not in self._recv or len(self._recv[key]) < total:
            self._recv[key] = like.new_empty((total, like.shape[1]))
        whole = self._recv[key][:total]
        starts = np.cumsum([0, *plan.recv_counts.values()])
        return whole, {r: whole[a:b] for r, a, b in zip(plan.recv_counts, starts, starts[1:])}

    def plan(self, phase: Phase, key=None) -> PhasePlan:
        """The plan for ``phase``; ``key`` (e.g. ``(t % period, k)``) reuses plans across rounds."""
        if key is not None and key in self._cache:
            return self._cache[key]
        plan = plan_phase(phase, self.placement, self.comm.device)
        if key is not None:
            self._cache[key] = plan
        return plan

    def start(self, state: torch.Tensor, plan: PhasePlan, hold: bool = False):
        """Post the phase's sends and receives; returns (pending, the receive buffer, its row
        slices by sending rank). ``hold``: a transport that can (``zero_copy``) may leave
        the received rows in its own buffers (``pending.parts``) instead of the buffer."""
        sends = {r: state[idx] for r, idx in plan.sends.items()}
        whole, recvs = self.recv_buffers(plan, state)
        if hold and getattr(self.comm, "zero_copy", False):
            pending = self.comm.exchange(sends, recvs, hold=True)
        else:
            pending = self.comm.exchange(sends, recvs)
        self.messages_sent += len(sends)
        self.bytes_sent += sum(b.numel() * b.element_size() for b in sends.values())
        return pending, whole, recvs

    def exchange(self, state: torch.Tensor, plan: PhasePlan) -> dict[int, torch.Tensor]:
        """Communication only: the rows this rank receives in this phase, by sending rank
        (views of the receive buffer: valid until the next ``exchange`` or ``mix``)."""
        pending, _, recvs = self.start(state, plan)
        pending.wait_all()
        return recvs

    def mix(
        self, state: torch.Tensor, plan: PhasePlan, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One phase: exchange the needed rows, then ``new = W_own @ state + W_recv @ recv``.

        ``state`` is (local nodes, D); the result goes into ``out`` (a spare tensor of the same
        shape, not ``state``: its rows may still be on the wire) or a new tensor.
        """
        rowwise = _rowwise(plan)
        pending, whole, recvs = self.start(state, plan, hold=rowwise)
        if plan.own.dtype != state.dtype:  # cast once, reused by later rounds
            plan.own = plan.own.to(state.dtype)
            plan.received = None if plan.received is None else plan.received.to(state.dtype)
        # The own block is computed while the neighbours' bytes are still on the wire.
        out = _matmul(plan.own, state, out)
        pending.wait_all()
        lost = getattr(pending, "lost", None)  # a peer-to-peer link that did not count
        if lost:
            drop_links(plan, lost, state, out, recvs)
        if rowwise:  # a few received rows: one pass over the output, from wherever they lie
            held, first, senders = getattr(pending, "parts", {}), 0, []
            for r, count in plan.recv_counts.items():
                if r not in (lost or ()):
                    senders.append((first, count, held.get(r) or [recvs[r].reshape(-1)]))
                first += count
            add_rows(out, plan.received, senders)
        elif plan.received is not None:  # one product over the whole buffer, in place
            out.addmm_(plan.received, whole)
        if self.on_mix is not None:
            self.on_mix(state, out, lost or set())
        return out


#: received rows and local rows up to which the mix adds the received rows one by one
#: (:func:`add_rows`) rather than in one product: the same numbers on every transport and
#: however the rows arrived in pieces, so zmq need not copy its frames. One product is faster
#: for more rows (1.3x to 40x with tens to thousands of local rows, narrow chunks), and
#: about as fast for one local row (the copy it saves over zmq costs more).
ROWWISE_ROWS = 8
ROWWISE_LOCAL = 4
#: elements of :func:`add_rows`' temporary (local rows x columns per step): on a CPU 1 MB of
#: float32, which stays in cache; on a GPU 64 MB of float32 (few kernel launches, bounded
#: memory)
ROWWISE_CHUNK = 1 << 18
ROWWISE_CHUNK_GPU = 1 << 24


def _rowwise(plan: PhasePlan) -> bool:
    """Whether the phase adds its received rows one by one (a dense block, few rows)."""
    block = plan.received
    if block is None or block.layout != torch.strided:
        return False
    return block.shape[0] <= ROWWISE_LOCAL and block.shape[1] <= ROWWISE_ROWS


def add_rows(out: torch.Tensor, weights: torch.Tensor, senders: list) -> None:
    """``out += weights @ rows`` with the rows added one at a time in buffer order, each as a
    product then a sum (two correctly rounded operations per element, so the result does not
    depend on how the rows are cut: the zmq transport's frames give the bits of torch's one
    buffer). ``senders``: (its first weight column, rows, parts) in buffer order, where the
    parts are 1-D tensors that together are the sender's (rows, D) flattened; a sender left
    out (a lost link) adds nothing.

    The columns go in chunks, every row of a chunk before the next chunk, so the output is
    read and written once, as in one product."""
    L, D = out.shape
    # chunks for a CPU's cache; on a GPU large ones (few kernel launches, a bounded temporary)
    chunk = ROWWISE_CHUNK if out.device.type == "cpu" else ROWWISE_CHUNK_GPU
    step = max(1, chunk // max(1, L))
    tmp = out.new_empty((L, min(step, D)))
    rows = []  # (weight column, parts, their start offsets, row index)
    for first, count, parts in senders:
        starts = np.cumsum([0, *(p.numel() for p in parts)])
        rows += [(first + i, parts, starts, i) for i in range(count)]
    cols = {c: weights[:, c : c + 1] for c, *_ in rows}
    for c0 in range(0, D, step):
        c1 = min(D, c0 + step)
        t = tmp[:, : c1 - c0]
        for c, parts, starts, i in rows:
            lo, hi = i * D + c0, i * D + c1  # this chunk in the rank's flat rows
            k = int(np.searchsorted(starts, lo, side="right")) - 1
            while lo < hi:
                a, b = int(lo - starts[k]), int(min(hi, starts[k + 1]) - starts[k])
                at = int(lo - (i * D + c0))
                torch.mul(parts[k][a:b], cols[c], out=t[:, at : at + b - a])
                lo, k = starts[k] + b, k + 1
            out[:, c0:c1].add_(t)


def drop_links(plan: PhasePlan, lost, state, out, recvs: dict[int, torch.Tensor]) -> None:
    """Mix as if the links with the ``lost`` ranks were not in W_t: their rows' weights go to
    each local row's diagonal (``out += mass * state``) and their (maybe partial) rows are
    zeroed. Both ends of a link do this when both decide it lost, so a symmetric W_t stays
    doubly stochastic and the average is kept."""
    for r in sorted(lost):
        if r not in recvs:
            continue
        if r not in plan.recv_mass:
            total = sum(plan.recv_counts.values())
            starts = dict(zip(plan.recv_counts, np.cumsum([0, *plan.recv_counts.values()])))
            pick = torch.zeros(total, 1, dtype=plan.received.dtype, device=out.device)
            pick[starts[r] : starts[r] + plan.recv_counts[r]] = 1
            plan.recv_mass[r] = (plan.received @ pick)[:, 0]  # dense or CSR
        recvs[r].zero_()
        out.addcmul_(state, plan.recv_mass[r].to(state.dtype)[:, None])


def _matmul(block: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """block @ x into ``out`` (or a new tensor)."""
    if block.layout != torch.strided:
        # torch.sparse.mm runs the same MKL product but into a fresh zero-filled tensor, which
        # would then be copied: addmm into the reused output skips both (7x faster on a
        # 1,000-peer ring). beta = 0: out's old values are not read (documented for NaN too).
        out = x.new_zeros((block.shape[0], x.shape[1])) if out is None else out
        return torch.addmm(out, block, x, beta=0, out=out)
    if block.shape == (1, 1):  # one peer per rank: a scaled copy, not a GEMM
        return torch.mul(x, block[0, 0], out=out)
    return torch.mm(block, x, out=out)

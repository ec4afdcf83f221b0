"""A rank's peers' data as padded tensors, and the seeded minibatch plan of a round.

Peers hold different numbers of samples. Each peer's data is padded to the rank's largest peer,
and each step draws a (L, B) index batch with a (L, B) weight mask: padded slots get weight 0,
so one batched step trains every peer on its own minibatch. Minibatch order depends only on
(seed, peer, round), never on the placement.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

import numpy as np
import torch

from gossip_pfl.errors import GossipError


@dataclass
class PaddedSplit:
    """(L, N_max, *in) inputs, (L, N_max) labels and the true count of every peer."""

    x: torch.Tensor
    y: torch.Tensor
    counts: torch.Tensor  # (L,) int64

    @staticmethod
    def build(xs: list[np.ndarray], ys: list[np.ndarray], device: torch.device) -> PaddedSplit:
        """Pad and stack the peers' arrays. Inputs that already lie back to back in one
        array, with one count for all (the synthetic test split: 900 MB), are a view of it,
        not a copy: ``x`` may share the dataset's memory, so nothing may write into it."""
        counts = np.array([len(y) for y in ys], dtype=np.int64)
        n_max = max(1, int(counts.max(initial=0)))
        shape = xs[0].shape[1:]
        # float32 inputs, or int64 token ids (text) kept as integers for an embedding
        dtype = np.int64 if np.issubdtype(xs[0].dtype, np.integer) else np.float32
        x = _stacked(xs, dtype) if counts.min() == n_max else None
        if x is None:
            x = _lazy_zeros((len(xs), n_max, *shape), dtype)
            for i, xi in enumerate(xs):
                x[i, : len(xi)] = xi
        y = np.zeros((len(ys), n_max), dtype=np.int64)
        for i, yi in enumerate(ys):
            y[i, : len(yi)] = yi
        return PaddedSplit(
            torch.from_numpy(x).to(device),
            torch.from_numpy(y).to(device),
            torch.from_numpy(counts).to(device),
        )

    @staticmethod
    def of(clients: list, split: str, device: torch.device) -> PaddedSplit:
        """Split ``split`` ("train", "test", ...) of a list of ClientData."""
        pairs = [c.split(split) for c in clients]
        return PaddedSplit.build([x for x, _ in pairs], [y for _, y in pairs], device)

    @cached_property
    def mask(self) -> torch.Tensor:
        """(L, N_max) 1.0 on real samples, 0.0 on padding (built once: every round asks)."""
        ar = torch.arange(self.y.shape[1], device=self.y.device)
        return (ar[None, :] < self.counts[:, None]).to(torch.float32)

    def take_flat(self, flat: torch.Tensor, shape: tuple[int, int]):
        """Samples at ``flat`` positions of the (peer, sample) axis (a :class:`Step`'s):
        inputs (*shape, *in), labels ``shape``; one index_select each."""
        x = self.x.flatten(0, 1).index_select(0, flat).view(*shape, *self.x.shape[2:])
        return x, self.y.flatten().index_select(0, flat).view(shape)

    def take(self, rows: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``idx`` (A, B) of peers ``rows`` (A,): inputs (A, B, *in), labels (A, B).
        One index_select over the flattened (peer, sample) axis: several times faster than
        advanced indexing with two index tensors."""
        n = self.y.shape[1]
        flat = (rows[:, None] * n + idx).reshape(-1)
        x = self.x.flatten(0, 1).index_select(0, flat).view(*idx.shape, *self.x.shape[2:])
        return x, self.y.flatten().index_select(0, flat).view(idx.shape)

    @cached_property
    def host_counts(self) -> np.ndarray:
        """The counts on the host (planning chunks must not wait on the device)."""
        return self.counts.cpu().numpy()

    def chunk_plan(
        self, budget: int, active: np.ndarray | None = None, upload: Uploads | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor | slice, slice]]:
        """(rows, how to index them, sample slice) pieces that cover every real sample once,
        each holding at most about ``budget`` samples over all its peers; planned once per
        budget (counts never change). A piece starts where the previous one ended and ends
        where half of its peers have run out of samples (at least 32 positions wide, when the
        budget allows): client sizes are skewed, so padding costs at most about as much as the
        real work, in a few pieces (a handful of kernels each) rather than one per 32
        positions. A piece holding every peer indexes them with a slice, so its inputs are
        views, not copies (the synthetic test split is 900 MB: copying it cost more than the
        products). ``active`` (L,) bool: only those peers' samples (a round's participants;
        planned anew each time, its rows copied through ``upload``, see :func:`step_plan`)."""
        if active is not None and not active.all():
            return self._plan(budget, np.where(active, self.host_counts, 0), True, upload)
        plans = self.__dict__.setdefault("_plans", {})
        if budget not in plans:
            plans[budget] = self._plan(budget, self.host_counts)
        return plans[budget]

    def _plan(
        self, budget: int, counts: np.ndarray, subset: bool = False, upload: Uploads | None = None
    ) -> list:
        """:meth:`chunk_plan` of each peer's first ``counts`` (L,) samples (``subset``: of
        the peers with a count, the others sitting out), the rows in one copy."""
        L, device = len(counts), self.y.device
        upload = upload or Uploads(device, staged=False)
        n_max = int(counts.max(initial=0)) if subset else self.y.shape[1]
        if dense_layout(device) and 0 < L * n_max <= budget:
            # a GPU: one call over the padded stack (views), its padding cheaper than calls;
            # a round's participants: one call over their rows (a copy)
            if not subset:
                return [(torch.arange(L, device=device), slice(None), slice(0, n_max))]
            rows = upload("chunk_rows", np.flatnonzero(counts > 0))
            return [(rows, rows, slice(0, n_max))]
        pieces, start = [], 0  # (peers, sample slice, peers a call or 0 for a slice of all)
        while start < n_max:
            active = np.flatnonzero(counts > start)
            if len(active) == 0:
                break
            half = int(np.sort(counts[active])[(len(active) - 1) // 2])  # median peer's end
            cap = max(1, budget // len(active))  # all of them in one call
            width = max(min(half - start, cap), min(32, budget, n_max - start), 1)
            sl = slice(start, min(start + width, n_max))
            whole = len(active) == L and cap >= width
            pieces.append((active, sl, 0 if whole else max(1, budget // width)))
            start = sl.stop
        if not pieces:
            return []
        rows = upload("chunk_rows", np.concatenate([a for a, _, _ in pieces]))
        plan = []
        for (_, sl, per_call), r in zip(pieces, rows.split([len(a) for a, _, _ in pieces])):
            if per_call == 0:
                plan.append((r, slice(None), sl))
            else:
                plan.extend((c, c, sl) for c in r.split(per_call))
        return plan

    @cached_property
    def host_y(self) -> np.ndarray:
        """The labels on the host (the fused linear plan gathers them there)."""
        return self.y.cpu().numpy()

    @cached_property
    def offsets(self) -> np.ndarray:
        """(L,) position of each peer's first sample in :attr:`augmented` (peer-major)."""
        return np.concatenate([[0], np.cumsum(self.host_counts)[:-1]]).astype(np.int64)

    @cached_property
    def neg_labels(self) -> torch.Tensor:
        """(L * N_max,) float32 -y on the split's device, peer-major (the fused linear round
        gathers its batches' from it)."""
        return self.y.flatten().float().neg_()

    @cached_property
    def device_offsets(self) -> torch.Tensor:
        """:attr:`offsets` on the split's device, uploaded once."""
        return torch.as_tensor(self.offsets, device=self.y.device)

    @cached_property
    def augmented(self) -> torch.Tensor:
        """(real samples, features + 1): the real samples only (no padding), flattened, with a
        column of ones appended, peer-major (see :attr:`offsets`). A linear model's [W, b]
        row times it is the logit, and the gradient's outer product gives dW and db in one
        batched product. Built once (about the size of the real training inputs), through
        a bounded temporary. The real samples' rows come from the host's counts: a
        ``nonzero`` on a GPU waits for the device (and loads its kernels at its first use)."""
        flat = self.x.flatten(0, 1).flatten(1)
        counts, n_max = self.host_counts, self.y.shape[1]
        starts = np.repeat(np.arange(len(counts), dtype=np.int64) * n_max - self.offsets, counts)
        rows = torch.as_tensor(starts + np.arange(int(counts.sum())), device=flat.device)
        out = flat.new_empty(len(rows), flat.shape[1] + 1)
        out[:, -1] = 1
        for part, at in zip(out.split(1 << 16), rows.split(1 << 16)):
            part[:, :-1] = flat.index_select(0, at)
        return out

    def linear_pieces(self, budget: int, components: int) -> list[tuple]:
        """:meth:`chunk_plan`'s pieces for the closed-form linear model, cached: (rows or None
        for every peer, sample slice, inputs^T (A, in, width), float targets (A, M, width),
        mask (A, width)). A piece holding every peer is a view of the padded inputs; the
        others are gathered once here, not every round: at 10,000 peers that gather was the
        E-step's largest cost (the pieces follow the staircase of the sorted counts, so the
        copies hold about the real samples past the first piece, not the padding)."""
        key = ("_linear", budget, components)
        if key in self.__dict__:
            return self.__dict__[key]
        yf = self.y.to(self.x.dtype)
        pieces = []
        for rows, at, sl in self.chunk_plan(budget):
            full = isinstance(at, slice)
            x = self.x[:, sl] if full else self.x[:, sl].index_select(0, rows)
            tgt = yf[at, sl][:, None, :].expand(-1, components, -1)
            pieces.append((None if full else rows, sl, x.flatten(2).mT, tgt, self.mask[at, sl]))
        self.__dict__[key] = pieces
        return pieces

    def chunks(self, budget: int, active: np.ndarray | None = None):
        """Yield (rows, sample slice, x, y, mask) pieces of :meth:`chunk_plan`."""
        for piece in self.chunk_plan(budget, active):
            yield self.inputs(*piece)

    def inputs(self, rows, at, sl: slice) -> tuple:
        """(rows, sample slice, x, y, mask) of one piece of :meth:`chunk_plan` (a copy of
        the inputs when ``at`` is an index: made when the piece runs, one at a time)."""
        return rows, sl, self.x[at, sl], self.y[at, sl], self.mask[at, sl]


def _lazy_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros in fresh private pages the kernel maps only when written: padding that is
    never written costs no memory. (np.zeros asks for 2 MiB huge pages on large arrays, so
    writing each peer's samples mapped its whole padded row: at 10,000 synthetic peers
    5.6 GB resident for 1.3 GB of samples, and 9 s to build instead of 1.3 s.) Huge pages
    are declined for the mapping too, for kernels that would give them to every mapping."""
    count = int(np.prod(shape))
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags:  # no anonymous private mappings here (Windows)
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=flags)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def _stacked(xs: list[np.ndarray], dtype) -> np.ndarray | None:
    """``np.stack(xs)`` as a view when the arrays are equal-shaped, C-contiguous slices of
    one writable array laid back to back in order (clients cut from one flat array); None
    otherwise."""
    base, first = xs[0].base, xs[0]
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous or not base.flags.writeable:
        return None
    start = first.__array_interface__["data"][0]
    for i, xi in enumerate(xs):
        if (xi.base is not base or xi.dtype != dtype or xi.shape != first.shape
                or not xi.flags.c_contiguous
                or xi.__array_interface__["data"][0] != start + i * first.nbytes):  # fmt: skip
            return None
    offset = start - base.__array_interface__["data"][0]
    return np.ndarray((len(xs), *first.shape), dtype, buffer=base, offset=offset)


def client_ids(dataset) -> tuple[np.ndarray, np.ndarray]:
    """(training client ids, unseen client ids) of a dataset: unseen clients only evaluate.
    Every client needs a training sample (an unseen one's model comes from its training data:
    PeFLL's descriptor, FedEM's E-step, Clustered FL's nearest cluster), and the training
    clients a test sample between them."""
    unseen = np.array(sorted(set(getattr(dataset, "unseen", []) or [])), dtype=np.int64)
    train = np.setdiff1d(np.arange(len(dataset.clients)), unseen)
    for ids, who in ((train, "client"), (unseen, "unseen client")):
        # (a training client without one made the size-weighted sums 0 / 0: NaN, blamed on
        # the lr; an unseen one got the model of an all-zero descriptor)
        empty = [int(i) for i in ids if len(dataset.clients[i].y_train) == 0]
        if empty:
            more = f" (nor do {len(empty) - 1} more)" if len(empty) > 1 else ""
            raise GossipError(
                f"data.name {dataset.name!r}: {who} {empty[0]} has no training sample{more}; "
                "every client needs one (see data.val_fraction and the data's split)"
            )
    if not sum(dataset.clients[i].size("test") for i in train):  # (accuracies of 0 / 0)
        raise GossipError(f"dataset '{dataset.name}': no test samples (data.n_test, or the "
                          "test share of data.split): nothing to evaluate")  # fmt: skip
    return train, unseen


@dataclass
class RankData:
    """What one rank holds: its peers' train and test splits, and its share of the unseen
    clients (``unseen_pos``: positions in the unseen ids; their splits None when it has none)."""

    train: PaddedSplit
    test: PaddedSplit
    unseen_pos: np.ndarray
    unseen_train: PaddedSplit | None
    unseen_test: PaddedSplit | None

    @staticmethod
    def of(dataset, train_ids, unseen_ids, peers, rank: int, world_size: int, device) -> RankData:
        clients = [dataset.clients[train_ids[i]] for i in peers]
        # unseen clients are spread over ranks too
        pos = np.array_split(np.arange(len(unseen_ids)), world_size)[rank]
        held = [dataset.clients[unseen_ids[i]] for i in pos]
        return RankData(
            PaddedSplit.of(clients, "train", device),
            PaddedSplit.of(clients, "test", device),
            pos,
            PaddedSplit.of(held, "train", device) if held else None,
            PaddedSplit.of(held, "test", device) if held else None,
        )


#: devices where the trainer runs a reordered plan (:func:`step_plan`'s ``prefix``)
REORDER_ON: tuple[str, ...] = ("cuda",)


@dataclass
class Step:
    """One local step of a round's plan: the peers ``rows`` (A,) still in their epoch, their
    place ``sel`` in the stack the steps work on (a slice where that can be: their state is
    then a view), the flat (peer, sample) positions of their batch (A * width,) and its
    weights (A, width)."""

    rows: torch.Tensor
    sel: torch.Tensor | slice
    flat: torch.Tensor
    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)


def step_plan(
    idx: np.ndarray, weight: np.ndarray, n_max: int, device, prefix: bool = False,
    upload: Uploads | None = None,
) -> tuple[list[Step], torch.Tensor | None]:  # fmt: skip
    """A round's :func:`round_batches` plan as device tensors, uploaded at once, and the
    order of the stack its steps work on (None: the peers' own order).

    Only the peers still in their epoch take part in a step (small peers finish early), and
    its batch is cut to the longest real one: padding is front-to-back, and costs. All of it
    is worked out on the host and uploaded in three copies per round, then split into
    per-step views: a per-step nonzero() or upload would stop the host at every step on a
    GPU, and every step would pay a dozen small operations for it. The copies go through
    ``upload`` (a caller's :class:`Uploads`, kept across rounds): on a GPU, copies from
    pageable memory would each wait for the work queued before them (the round's E-step).

    A step of some of the peers gathers their rows and writes them back: with a CNN's
    millions of parameters a peer, five passes over them a step. With ``prefix``, where no peer
    sits out a step and comes back in a later one, and the steps leave out at least L
    peer-steps in all, the peers are instead ordered by their number of steps, most first
    (ties in rank order): every step's peers are then the first A of that order, its ``sel``
    is ``slice(0, A)`` of the stack reordered once for the round, and its ``rows`` are those
    peers in that order. The reordering costs about eight passes over the stack a round (in
    and out, through a temporary). A peer's numbers change only by rounding: the step's
    batched calls group its peers differently (the trainer takes it where ``REORDER_ON``
    says)."""
    filled = (weight > 0).sum(-1)  # (S, L) real samples of each peer's batch at step s
    S, L = filled.shape
    taking = filled > 0
    steps = taking.sum(0)  # (L,) steps each peer takes
    left_out = int((L - taking.sum(1))[taking.any(1)].sum())
    order = None
    if prefix and left_out >= L and np.array_equal(taking, np.arange(S)[:, None] < steps):
        order = np.argsort(-steps, kind="stable")
    rows, flat, wts, sizes = [], [], [], []
    for s in range(S):
        r = np.flatnonzero(taking[s]) if order is None else order[: int(taking[s].sum())]
        if len(r) == 0:
            continue
        width = int(filled[s].max())
        rows.append(r)
        flat.append((r[:, None] * n_max + idx[s, r, :width]).reshape(-1))
        wts.append(weight[s, r, :width].reshape(-1))
        sizes.append((len(r), width))
    if not sizes:
        return [], None
    upload = upload or Uploads(device, staged=False)
    up = lambda name, parts, dtype: upload(name, np.concatenate(parts).astype(dtype, copy=False))  # noqa: E731
    flat_d = up("plan_flat", flat, np.int64).split([a * w for a, w in sizes])
    wts_d = up("plan_weight", wts, np.float32).split([a * w for a, w in sizes])
    if order is None:
        rows_d = up("plan_rows", rows, np.int64).split([a for a, _ in sizes])
        sels = [slice(None) if a == L else r for r, (a, _) in zip(rows_d, sizes)]
    else:  # every step's rows are a prefix of the order
        order_d = up("plan_rows", [order], np.int64)
        rows_d = [order_d[:a] for a, _ in sizes]
        sels = [slice(None) if a == L else slice(0, a) for a, _ in sizes]
    plan = [
        Step(r, sel, f, w.view(a, width))
        for r, sel, f, w, (a, width) in zip(rows_d, sels, flat_d, wts_d, sizes)
    ]
    return plan, None if order is None else order_d


@dataclass
class LinearRound:
    """A round's plan for the fused closed-form linear SGD steps (see
    :meth:`gossip_pfl.runtime.stack.BatchedForward.linear_sgd_round`): per step, the peers
    (None: all of them), flat positions (A * B,) in :attr:`PaddedSplit.augmented`, the
    per-sample coefficient -step * q * weight / B (A, B, M | 1) and -y times it. Every step is
    cut to the full batch width B (a short last batch is padded with weight 0), so each step's
    tensors are pieces of one split, not views made per step."""

    rows: list
    pos: tuple
    coef: tuple
    ycoef: tuple
    neg_y: tuple = ()  # (A, B) -y, and the weights w / B (A, B): with ``keep``, for the
    weight: tuple = ()  # step's objective (FedLi-LU's)


@dataclass
class LinearHost:
    """The host side of a :class:`LinearRound`, a pure function of the round's minibatch
    plan (so the planner draws it ahead, :class:`BatchPlanner`, off the main thread): per step
    the peers still in their epoch (``sizes``: how many), and the round's two uploads, laid out
    as :func:`linear_uploads` sends them. ``floats`` (sum A, B): the sample weights / B
    (:func:`linear_uploads` scales them by each peer's -step in place); ``ints`` (sum A + sum A
    * B) int32: the steps' rows, then their sample indices. The labels are gathered on the
    device (:func:`linear_plan`), and the indices fit 32 bits: half the bytes of uploading
    -y and int64 indices, which the round's own thread copies into page-locked memory."""

    sizes: list
    floats: np.ndarray
    ints: np.ndarray
    scaled: bool = False  # floats holds -step * weight / B (linear_uploads did it)

    @property
    def r_all(self) -> np.ndarray:
        """(sum A,) each step's peers, step after step."""
        return self.ints[: len(self.floats)]

    @property
    def ix(self) -> np.ndarray:
        """(sum A, B) their samples' indices."""
        return self.ints[len(self.floats) :].reshape(self.floats.shape)


#: most samples a round's dense steps hold (:func:`linear_host`): past it (thousands of
#: peers) the padding's gathers and products would cost the GPU more than the host saves
DENSE_SAMPLES = 1 << 21


def linear_host(
    batch_size: int, idx: np.ndarray, weight: np.ndarray, dense: bool = False
) -> LinearHost:
    """:class:`LinearHost` of :func:`round_batches`' plan (idx, weight).

    ``dense``: every step holds every peer, those past their epoch with weight 0 (a GPU's
    choice: a step is then a few operations on views of the whole stack, without the rows'
    gathers and scatter-adds, whose deterministic CUDA form sorts; the extra products cost
    the GPU microseconds and save the host most of a round), up to :data:`DENSE_SAMPLES`
    samples a round. A zero-weight sample adds exactly 0 to its peer's parameters."""
    S, L, B = idx.shape
    compiled = _compiled()
    if compiled:  # without the GIL, which NumPy's many calls take and give back (below)
        taking = np.empty((S, L), dtype=np.bool_)
        compiled.step_peers(weight, taking)
    else:
        taking = weight.sum(-1) > 0  # (S, L): where the peer takes the step
    steps = np.flatnonzero(taking.any(-1))
    dense = dense and L * len(steps) * B <= DENSE_SAMPLES
    sizes = [L] * len(steps) if dense else taking[steps].sum(-1).tolist()
    A = sum(sizes)
    host = LinearHost(sizes, np.empty((A, B), np.float32), np.empty(A + A * B, np.int32))
    if not sizes:
        return host
    r_all, ix, floats = host.r_all, host.ix, host.floats
    if compiled:
        compiled.linear_host(idx, weight, steps, taking, dense, np.float32(1.0 / batch_size),
                             r_all, ix, floats)  # fmt: skip
        return host
    every = np.arange(L)
    rows = [(s, every if dense else np.flatnonzero(taking[s])) for s in steps]
    np.concatenate([r for _, r in rows], out=r_all)
    np.concatenate([idx[s, r] for s, r in rows], out=ix)
    np.concatenate([weight[s, r] for s, r in rows], out=floats)
    floats *= np.float32(1.0 / batch_size)
    return host


def dense_layout(device: torch.device) -> bool:
    """Whether work on ``device`` goes in few wide calls over the padded stack (every peer
    in every step, one piece per split) rather than the CPU's trimmed ones: on a GPU the host's
    launches, not the padding's flops, are what a round costs."""
    return device.type != "cpu"


class Uploads:
    """Host arrays to a device without waiting for its queue. On a GPU a copy from pageable
    memory first waits for every kernel queued before it, so each round's uploads stopped the
    host until the device had finished the round before; a copy from page-locked memory is
    queued like a kernel. So each array goes through one of two page-locked buffers kept per
    name and used in turn, and a buffer is written again only once its last copy has finished
    (an event: two uploads of that name later, long done). The copies are new device tensors,
    never the buffers. Elsewhere (a CPU) the arrays are taken as they are, with no copy;
    ``staged`` forces the buffers there (not page-locked, no events: a test of the turns)."""

    def __init__(self, device: torch.device, staged: bool | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.staged = self.cuda if staged is None else staged
        self.slots: dict[str, list] = {}  # name -> two [buffer, event of its last copy]
        self.turn: dict[str, int] = {}

    def __call__(self, name: str, array: np.ndarray) -> torch.Tensor:
        if not self.staged:
            return torch.as_tensor(array, device=self.device)
        k = self.turn[name] = 1 - self.turn.get(name, 1)
        slot = self.slots.setdefault(name, [[None, None], [None, None]])[k]
        buf, done = slot
        if done is not None:
            done.synchronize()
        src = torch.from_numpy(np.ascontiguousarray(array))
        if buf is None or buf.dtype != src.dtype or buf.numel() < src.numel():
            size = max(src.numel() + src.numel() // 4, 1)  # room to grow a little
            buf = slot[0] = torch.empty(size, dtype=src.dtype, pin_memory=self.cuda)
        staging = buf[: src.numel()].view(src.shape)
        staging.copy_(src)
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        out.copy_(staging, non_blocking=self.cuda)
        if self.cuda:
            slot[1] = torch.cuda.Event()
            slot[1].record(torch.cuda.current_stream(self.device))
        return out


def linear_uploads(
    host: LinearHost, split: PaddedSplit, neg_step: np.ndarray, upload: Uploads | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device's copy of a round's :class:`LinearHost` (None: no step): two uploads
    (through ``upload``; None: copies from pageable memory), the floats (sum A, B)
    -step * weight / B, and the int32 indices (sum A + sum A * B) rows then sample indices;
    :func:`linear_plan` works out the rest on the device. ``neg_step`` (L,) float32 is each
    peer's -lr * factor * lr_scale. The planner's thread laid them out, so the round's own
    thread only scales the weights, in place (once: a host is used for one round)."""
    if not host.sizes:
        return None
    if host.scaled:  # a second scaling would square the step
        raise RuntimeError("linear_uploads: this round's plan was already uploaded")
    host.scaled = True  # before the scaling: one that fails half-way is not retried
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN lr: the finite check names it
        host.floats *= neg_step[host.r_all][:, None]  # (sum A, B) f32
    upload = upload or Uploads(split.y.device, staged=False)
    return upload("floats", host.floats), upload("ints", host.ints)


def linear_plan(
    sizes: list, split: PaddedSplit, floats: torch.Tensor, ints: torch.Tensor,
    q: torch.Tensor | None, keep: bool = False,
) -> LinearRound:  # fmt: skip
    """A :class:`LinearRound` from :func:`linear_uploads`' tensors, in device operations only
    (so a CUDA graph can hold them): the samples' positions in :attr:`PaddedSplit.augmented`,
    and with ``q`` (L, M, N) (the responsibilities; None: weight 1) each sample's share of
    every component; with ``keep`` also each step's -y and ``floats`` (w / B in the
    gradient's units, from which a step's objective is worked out; else -lr w / B, whose
    zeros still say which peers a step of every peer leaves out)."""
    L, n_max = split.y.shape
    A, B = floats.shape
    rows, ix = ints.long().split([A, A * B])  # (uploaded as int32: half the bytes)
    ix = ix.view(A, B)
    # a padded or finished peer's places point at a real sample (weight 0: it adds nothing)
    last = max(0, len(split.augmented) - 1)  # its rows are the real samples
    pos = (split.device_offsets[rows][:, None] + ix).clamp_max_(last).view(-1)
    coef = floats[:, :, None]  # (sum A, B, 1)
    if q is not None:  # q[peer, m, sample]: one take over the flattened (L, M, N) tensor
        M = q.shape[1]
        first = (rows * (M * n_max))[:, None, None] + ix[:, :, None]
        coef = q.take(first + torch.arange(0, M * n_max, n_max, device=q.device)).mul_(coef)
    neg_y = split.neg_labels.take(rows[:, None] * n_max + ix)  # (sum A, B)
    ycoef = neg_y[:, :, None] * coef
    row_list = [None if a == L else r for a, r in zip(sizes, rows.split(sizes))]
    kept = (neg_y.split(sizes), floats.split(sizes)) if keep else ((), ())
    return LinearRound(row_list, pos.split([a * B for a in sizes]), coef.split(sizes),
                       ycoef.split(sizes), *kept)  # fmt: skip


def round_batches(
    counts: np.ndarray,
    peers: np.ndarray,
    seed: int,
    round_: int,
    batch_size: int,
    epochs: int = 1,
    steps: int | None = None,
    stream: int = 0,
    mean: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Minibatch plan of one round for a rank's peers.

    Returns ``idx`` (S, L, B) sample indices and ``weight`` (S, L, B): 1 for a real sample, 0
    for padding; with ``mean``, ``batch_size / b`` for each of a batch's b real samples, so
    that a weighted loss divided by ``batch_size`` is the batch's mean. Peer i takes
    ``epochs * ceil(n_i / B)`` steps, one permutation per epoch with a short last batch (or
    exactly ``steps`` full batches cut from a running stream of permutations); steps past a
    peer's end are all-zero weight, and the solver skips them. Each peer draws from its own
    generator seeded by (seed, peer, round, stream), so the plan of a peer does not depend on
    which other peers share its rank.
    """
    counts = np.asarray(counts, dtype=np.int64)
    nominal = batch_size
    # no batch holds more than the largest peer's samples: a wider B is only padding (the
    # same plan, and B = 10**7 made every step that wide); the loss still divides by B
    batch_size = min(batch_size, max(1, int(counts.max(initial=1))))
    per_epoch = -(-counts // batch_size)  # ceil(n_i / B)
    n_steps = steps if steps is not None else epochs * int(per_epoch.max(initial=0))
    # (L, S*B): each peer's plan is one contiguous row, filled with a few array operations
    # (a loop over batches costs more than the draws); returned as an (S, L, B) view.
    L, width = len(peers), n_steps * batch_size
    idx = np.zeros((L, width), dtype=np.int64)
    weight = np.zeros((L, width), dtype=np.float32)
    generators = _KeyedGenerators(seed, round_, stream, peers)
    # (the compiled draws are NumPy's for peers below 2**32 samples: its 32-bit branch)
    small = int(counts.max(initial=0)) < 2**32
    compiled = _compiled()
    if steps is None and small and generators.fits and compiled:
        # epochs: every peer's permutations in one compiled call (the same draws as below)
        compiled.permutations(generators.words, counts, epochs, per_epoch * batch_size,
                              idx, weight)  # fmt: skip
    else:
        _draw_plan(generators, counts, per_epoch, batch_size, epochs, steps, idx, weight)
    shape = (L, n_steps, batch_size)
    weight = weight.reshape(shape)
    if mean:  # each real sample's share of its batch, times the nominal B the loss divides by
        filled = weight.sum(-1, keepdims=True)
        np.divide(np.float32(nominal), filled, out=weight, where=weight > 0)
    return idx.reshape(shape).transpose(1, 0, 2), weight.transpose(1, 0, 2)


def _draw_plan(generators, counts, per_epoch, batch_size, epochs, steps, idx, weight) -> None:
    """:func:`round_batches`' draws peer by peer, into ``idx`` and ``weight`` (L, S * B)."""
    arange = np.arange(int(counts.max(initial=0)))
    for l, n_i in enumerate(counts):
        if n_i == 0:
            continue
        rng = generators.at(l)
        if steps is None:  # epochs: each epoch a permutation, the last batch may be short
            block = per_epoch[l] * batch_size
            for e in range(epochs):
                seg = idx[l, e * block : e * block + n_i]
                seg[:] = arange[:n_i]
                rng.shuffle(seg)  # in place: the same draws as rng.permutation(n_i)
                weight[l, e * block : e * block + n_i] = 1.0
        else:  # fixed steps: full batches of min(B, n_i) from a stream of permutations
            b = min(batch_size, int(n_i))
            perms = max(1, -(-steps * b // n_i))  # the generator is this call's alone
            order = np.concatenate([rng.permutation(n_i) for _ in range(perms)])
            idx[l].reshape(steps, batch_size)[:, :b] = order[: steps * b].reshape(steps, b)
            weight[l].reshape(steps, batch_size)[:, :b] = 1.0


class BatchPlanner:
    """:func:`round_batches` with the next round's plan drawn ahead, on one background thread,
    while this round computes; ``post(idx, weight)``, when given, is worked out there too
    (the fused linear step's host side, :func:`linear_host`). Both are pure functions of
    their arguments (one seeded generator per peer), so drawing them early changes no number;
    they are most of a round's host time on the linear model (the generators' seeding and
    shuffles, compiled loops that release the GIL), which the compute (kernels that release
    the GIL too) now hides. The guess is that the same peers take part with the same
    settings; when they do not (partial participation), the plan is drawn in place and the
    guess thrown away."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._ahead: dict[int, tuple[tuple, Future]] = {}  # stream -> (arguments, plan)
        warm_up()  # with the run's setup, not in its first round

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():  # a forked child has no thread
            self._pool, self._pid = ThreadPoolExecutor(1, "batch-plan"), os.getpid()
        return self._pool

    def __call__(
        self, counts: np.ndarray, peers: np.ndarray, seed: int, round_: int, batch_size: int,
        epochs: int = 1, steps: int | None = None, stream: int = 0, post=None,
        mean: bool = False,
    ) -> tuple:  # fmt: skip
        """(idx, weight) of :func:`round_batches`, the steps each peer takes (L,), and
        ``post(idx, weight)`` when given."""
        counts = np.asarray(counts, dtype=np.int64)
        key = (counts.tobytes(), np.asarray(peers).tobytes(), seed, batch_size, epochs, steps,
               post, mean)  # fmt: skip
        rest = (batch_size, epochs, steps, stream, post, mean)
        ahead = self._ahead.pop(stream, None)
        if ahead and ahead[0] == (*key, round_):
            plan = ahead[1].result()
        else:
            plan = _plan(counts, peers, seed, round_, *rest)
        nxt = self._executor().submit(_plan, counts, peers, seed, round_ + 1, *rest)
        self._ahead[stream] = ((*key, round_ + 1), nxt)
        return plan


def _plan(counts, peers, seed, round_, batch_size, epochs, steps, stream, post, mean) -> tuple:
    idx, weight = round_batches(
        counts, peers, seed, round_, batch_size, epochs, steps, stream, mean
    )
    taken = (weight.sum(-1) > 0).sum(0)  # (here, on the planner's thread: 0.1 ms a round)
    return (idx, weight, taken) if post is None else (idx, weight, taken, post(idx, weight))


def warm_up() -> None:
    """Load the plan's compiled loops now: numba's start takes about 0.3 s of mostly
    Python (which no thread would hide), and the shuffles' first call and the fused linear
    round's layout (:func:`linear_host`, loaded with their module) a few ms more; the
    first time in a process, a few microseconds after."""
    round_batches(np.array([2]), np.array([0]), 0, 0, 2)


def _compiled() -> SimpleNamespace | bool:
    """The plan's compiled loops (:mod:`gossip_pfl.runtime.kernels`): ``seeds``
    (``pcg64_seeds``), ``permutations``, and the fused linear round's layout ``step_peers``
    and ``linear_host`` (``linear_host_fill``); False without a loadable numba."""
    global _KERNELS
    if _KERNELS is None:
        try:
            from gossip_pfl.runtime.kernels import (
                linear_host_fill,
                pcg64_seeds,
                permutations,
                step_peers,
            )
        # no numba, or numba that cannot load (its cache=True raises RuntimeError where no
        # cache folder is writable): NumPy's own seeding and shuffles, the same numbers
        except (ImportError, RuntimeError, OSError):
            _KERNELS = False
        else:
            _KERNELS = SimpleNamespace(
                seeds=pcg64_seeds,
                permutations=permutations,
                step_peers=step_peers,
                linear_host=linear_host_fill,
            )
    return _KERNELS


_KERNELS = None


class _KeyedGenerators:
    """``default_rng([seed, peer, round_, stream])`` for many peers at a fraction of its cost:
    when every part of the key is below 2**32 (the words SeedSequence makes of the list),
    every peer's PCG64 state is worked out at once, instead of building a SeedSequence, a
    PCG64 and a Generator per peer (11 us a peer: 0.1 s a round at 10,000 peers). The states
    come from the compiled :func:`gossip_pfl.runtime.kernels.pcg64_seeds` where numba loads
    (10 us for 300 peers, without the GIL: the plan is drawn on a thread beside the round's
    compiled loops, which waited on the 0.5 ms of the Python seeding), else from
    :func:`_pcg64_states` (1.3 us a peer). :meth:`at` sets a state on one reused generator."""

    def __init__(self, seed: int, round_: int, stream: int, peers: np.ndarray):
        self.key = [seed, 0, round_, stream]
        peers = np.asarray(peers, dtype=np.int64)
        low = min(seed, round_, stream, int(peers.min(initial=0)))
        high = max(seed, round_, stream, int(peers.max(initial=0)))
        self.fits = 0 <= low and high < 2**32
        #: (peers, 4) uint64: each generator's state and increment as (high, low) words
        self.words: np.ndarray | None = None
        if self.fits:
            words = np.empty((len(peers), 4), dtype=np.uint32)
            words[:] = self.key
            words[:, 1] = peers
            compiled = _compiled()
            if compiled:
                self.words = np.empty((len(peers), 4), dtype=np.uint64)
                compiled.seeds(words, self.words)
            else:
                m = (1 << 64) - 1
                self.words = np.array(
                    [(s >> 64, s & m, i >> 64, i & m) for s, i in _pcg64_states(words)],
                    dtype=np.uint64,
                ).reshape(-1, 4)
            self.bit_generator = np.random.PCG64()
            self.generator = np.random.Generator(self.bit_generator)
        self.peers = peers

    def at(self, row: int) -> np.random.Generator:
        """The generator of ``peers[row]``, at its start (the previous one is reset)."""
        if not self.fits:
            self.key[1] = int(self.peers[row])
            return np.random.default_rng(self.key)
        s_hi, s_lo, i_hi, i_lo = (int(w) for w in self.words[row])
        state, inc = s_hi << 64 | s_lo, i_hi << 64 | i_lo
        self.bit_generator.state = {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0,
                                    "state": {"state": state, "inc": inc}}  # fmt: skip
        return self.generator


_M32 = np.uint64(0xFFFFFFFF)
_PCG64_MULT = 0x2360ED051FC65DA44385DF649FCCF645
_U128 = (1 << 128) - 1


def _pcg64_states(words: np.ndarray) -> list[tuple[int, int]]:
    """(state, inc) of ``PCG64(SeedSequence(words[k]))`` for each row of 4 uint32 words, all
    rows at once: NumPy's SeedSequence (its hash of the entropy into a pool of 4 words, then 8
    output words; numpy/random/bit_generator.pyx, after M. O'Neill's seed_seq) in uint64
    columns masked to 32 bits, then PCG64's seeding (pcg_setseq_128_srandom_r). Tested
    against NumPy itself over many keys (tests/test_speed.py)."""
    w = words.astype(np.uint64)
    h = 0x43B0D7E5  # SeedSequence's running hash constant, the same for every row

    def hashmix(v):
        nonlocal h
        v = (v ^ np.uint64(h)) & _M32
        h = (h * 0x931E8875) & 0xFFFFFFFF
        v = (v * np.uint64(h)) & _M32
        return v ^ (v >> np.uint64(16))

    def mix(x, y):
        r = (np.uint64(0xCA01F9DD) * x - np.uint64(0x4973F715) * y) & _M32
        return r ^ (r >> np.uint64(16))

    pool = [hashmix(w[:, i]) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    h, out = 0x8B51F9DD, []  # generate_state(4, uint64): 8 words, little-endian pairs
    for i in range(8):
        v = (pool[i % 4] ^ np.uint64(h)) & _M32
        h = (h * 0x58F38DED) & 0xFFFFFFFF
        v = (v * np.uint64(h)) & _M32
        out.append(v ^ (v >> np.uint64(16)))
    s = np.stack(out[0::2], 1) | (np.stack(out[1::2], 1) << np.uint64(32))  # (K, 4) uint64
    states = []
    for a, b, c, d in s.tolist():  # 128-bit integers: Python's
        init_state, inc = (a << 64) | b, (((c << 64) | d) << 1 | 1) & _U128
        state = ((inc + init_state) * _PCG64_MULT + inc) & _U128  # srandom_r: two steps from 0
        states.append((state, inc))
    return states

"""A round's fixed-shape GPU work as CUDA graphs: captured once per shape, then replayed every
round with its inputs copied into the graph's own buffers, so the host launches one graph where
it launched dozens of kernels (a synthetic round's SGD steps: 1.66 ms of launches, 0.47 ms
replayed, on an H200; docs/speed-notes.md). ``runtime.cuda_graphs`` (on by default) takes the
binary linear model's steps this way; ``runtime.cuda_graph_steps`` (on by default too) an
autograd model's local steps, a graph per step shape."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class _HostValues(TorchDispatchMode):
    """The operations a function runs and the host values they take (numbers, dtypes, shapes;
    not tensors' contents), for :class:`_Recorded`; and the memory of each tensor an
    operation reads that the call did not make (a captured graph reads those addresses, so
    a tensor taken afresh each round, from an attribute, would be the first round's there)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.made: set[int] = set()  # the storages this call's operations allocated
        self.held: dict[int, StorageWeakRef] = {}  # the others read, by address

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _leaves((args, kwargs), [])
        host = tuple(_host_value(v) for v in leaves)
        if func is torch.ops.aten.lift_fresh.default:  # a tensor made of Python numbers here
            # (``t[i] = 1``, ``torch.tensor(x)``): its values are host values, a graph's
            # constants (as text: NaN equals NaN, -0.0 is not 0.0); its memory this call's own
            host += (repr(args[0].tolist()),)
            self.made.add(_storage(args[0]))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        read = [_storage(v) for v in tensors]
        # where a tensor the call did not make lies: its memory, and which part of it
        outside = [(p, v) for p, v in zip(read, tensors) if p not in self.made]
        held = tuple((p, v.storage_offset(), v.stride()) for p, v in outside)
        for p, v in outside:
            if p not in self.held:
                self.held[p] = StorageWeakRef(v.untyped_storage())
        self.ops.append((str(func), host, held))
        out = func(*args, **kwargs)
        # new memory only: a view or an in-place result is the tensor it read
        outs = _leaves(out, [])
        self.made.update(p for v in outs if isinstance(v, torch.Tensor)
                         if (p := _storage(v)) not in read)  # fmt: skip
        return out


def _leaves(x: object, out: list) -> list:
    """The leaves of an operation's arguments or results, which are lists, tuples and
    dicts of tensors and numbers: what ``torch.utils._pytree.tree_flatten`` gives them, in
    a fifth of its time (half a simulated replay's)."""
    if isinstance(x, (list, tuple)):
        for v in x:
            _leaves(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    else:
        out.append(x)
    return out


def _host_value(v):
    """What a graph would keep of an operation's argument: a tensor's shape and type, a
    float as text (NaN then equals NaN, and -0.0 is not 0.0), anything else as it is."""
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    return repr(v) if isinstance(v, float) else v


#: the start of PyTorch's warning for an operation that synchronises with the device
SYNC_WARNING = "called a synchronizing CUDA operation"


def _waits_for_device(fn: Callable[..., None], inputs: tuple) -> RuntimeError | None:
    """Run ``fn(*inputs)`` on the current CUDA stream with PyTorch's synchronisation check
    set to warn; an error naming the first operation that waited for the device (a blocking
    copy to or from the host, ``.item()``, a stream's synchronisation), which a captured graph
    cannot hold, or None. The check does not see everything a capture refuses (a
    non-blocking copy from pageable memory, an event's wait): a capture can still fail.
    Other warnings are shown as they would have been (the filters still apply to them); the
    check's own are shown too where the process had it on. (Warnings are process-wide: one
    from another thread meanwhile counts too.)"""
    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.filterwarnings("always", message=SYNC_WARNING)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*inputs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    waits = None
    for w in seen:
        sync = str(w.message).startswith(SYNC_WARNING)
        if sync and waits is None:
            waits = RuntimeError(f"an operation waits for the device ({w.filename}:{w.lineno})")
        if not sync or mode:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return waits


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


#: the profiler's label of a simulated replay (benchmarks/bench_ops.py counts what is under
#: it as the one launch a graph would be)
SIMULATED_REPLAY = "gossip_pfl::simulated_graph_replay"


class _Recorded:
    """What :class:`GraphReplay` keeps instead of a graph when it ``simulate``s one: the
    buffers of the first call, the host values and held tensors its operations took, and a
    weak reference to each held tensor's memory. Not the function: a graph does not keep it
    alive either, so a tensor only its closure held is freed after the capture, and a graph
    would read whatever then takes its place. :meth:`replay` runs this call's function on
    the buffers and checks that it took the same host values and held tensors, and that
    none of the first call's has been freed (the new tensor may have taken its address).
    Stricter than a graph in corners no trainer path reaches: an empty tensor made anew
    (every empty storage lies at address 0) and a new tensor over the same memory (a
    ``from_numpy`` of a kept array) count as freed."""

    def __init__(self, fn: Callable[..., None], inputs: tuple, places: frozenset = frozenset()):
        self.inputs = inputs
        with _HostValues() as seen:
            fn(*inputs)
        self.ops, self.held = seen.ops, seen.held
        self.places = places  # storages read by their place (in the key): may be replaced

    def replay(self, fn: Callable[..., None]) -> None:
        with torch.profiler.record_function(SIMULATED_REPLAY), _HostValues() as seen:
            fn(*self.inputs)
        freed = next((i for i, op in enumerate(self.ops) if any(
            self.held[p].expired() for p, *_ in op[2] if p not in self.places)), None)  # fmt: skip
        if freed is not None:
            raise AssertionError(
                f"a graph would read freed memory: operation {freed} ({self.ops[freed][0]}) "
                f"read a tensor freed since the first call (a graph does not keep the "
                f"function it captured, nor what only that function held)"
            )
        if seen.ops != self.ops:
            at = next((i for i, (a, b) in enumerate(zip(seen.ops, self.ops)) if a != b),
                      min(len(seen.ops), len(self.ops)))  # fmt: skip
            raise AssertionError(
                f"a graph would replay other host values or tensors than this run reads: "
                f"operation {at} "
                f"was {self.ops[at] if at < len(self.ops) else None}, now "
                f"{seen.ops[at] if at < len(seen.ops) else None}"
            )


class GraphReplay:
    """``fn(*inputs)``, a function of tensors that works in place on tensors it holds (a
    round's parameters) and returns nothing, run as a CUDA graph per ``key`` (the shapes and
    the held tensors' addresses, as the caller builds it). A new key runs ``fn`` on a side
    stream (this call's work, and the warm-up a capture needs), then captures it; a known key
    copies ``inputs`` into its graph's buffers and replays. The last ``keep`` graphs are kept
    (partial participation changes a round's shapes among a few). ``fn`` may read nothing
    from the host that changes between calls (every changing value comes in ``inputs``) and
    must not synchronise with the host.

    ``share_pool``: the graphs take their temporaries from one memory pool, so that many
    graphs (a round's step shapes) cost one graph's memory. That is safe when no graph reads
    what another left in its temporaries: each reads only its buffers and tensors held outside
    the pool, and writes its results into held tensors.

    ``simulate`` (tests, on a CPU): keep the first call's buffers and what its operations
    took, run each later call's ``fn`` where a graph would replay, and check that it takes
    what a graph would: the same host values (numbers, dtypes, shapes: a step size a
    closure took anew each round is an error, not the first round's number), the same
    memory where it reads a tensor the call did not make (a tensor made anew and read from
    an attribute or a closure), and none freed since the first call (a graph does not keep
    its function's closure alive; a new tensor may have taken the freed one's address).
    The replay's numbers are then a graph's.

    A first run that waits for the device (PyTorch's synchronisation check sees an operation
    a graph cannot hold: a copy to the host, ``.item()``) is not captured, and a capture that
    raises is ended; either sets :attr:`failure`. This call's work was done by that first
    run, and every later call runs ``fn`` as it is."""

    def __init__(self, keep: int = 8, share_pool: bool = False, simulate: bool = False) -> None:
        self.keep, self.share_pool, self.simulate = keep, share_pool, simulate
        self.graphs: OrderedDict[Hashable, tuple] = OrderedDict()  # key -> (graph, inputs)
        self._pool = None  # the shared pool's handle, made at the first capture
        #: why a capture failed; from then on every call runs ``fn`` as it is, and the
        #: caller may say so once
        self.failure: str | None = None
        self._stream = None  # the captures' side stream

    def __call__(
        self, key: Hashable, fn: Callable[..., None], *inputs: torch.Tensor,
        places: tuple[torch.Tensor, ...] = (),
    ) -> None:  # fmt: skip
        """``places``: held tensors ``fn`` reads by their place in memory (a round's
        parameters, which the exchange may replace by a new tensor each round): their
        addresses join ``key``, so a graph replays on whatever tensor lies there now, and a
        tensor elsewhere gets a graph of its own."""
        key = (key, tuple(t.data_ptr() for t in places))
        if self.failure is not None:
            fn(*inputs)
            return
        if key in self.graphs:
            self.graphs.move_to_end(key)
            graph, mine = self.graphs[key]
            for buffer, new in zip(mine, inputs):
                buffer.copy_(new)
            if self.simulate:  # (runs this call's fn, checked against the first's)
                graph.replay(fn)
            else:
                graph.replay()
            return
        while len(self.graphs) >= self.keep:  # the oldest graph's memory goes first
            self.graphs.popitem(last=False)
        mine = tuple(t.clone() for t in inputs)
        if self.simulate:
            spots = frozenset(_storage(t) for t in places)
            self.graphs[key] = (_Recorded(fn, mine, spots), mine)  # (runs fn once)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        if self.share_pool and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side, graph = self._stream, torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                # this call's work, and the warm-up a capture needs; an operation in it that
                # waits for the device would spoil the capture, and a spoiled capture leaves
                # PyTorch's allocator as if capturing (its end fails before it tells the
                # allocator): no capture then
                failed = _waits_for_device(fn, mine)
                if failed is None:
                    failed = self._capture(graph, fn, mine)
        finally:  # (an error in the warm-up: the caller's next work waits for what it queued)
            torch.cuda.current_stream().wait_stream(side)
        if failed is not None:
            self.failure = str(failed).splitlines()[0] if str(failed) else type(failed).__name__
            self.graphs.clear()
            return
        self.graphs[key] = (graph, mine)

    def _capture(
        self, graph: torch.cuda.CUDAGraph, fn: Callable[..., None], inputs: tuple
    ) -> Exception | None:
        """Record ``fn(*inputs)`` into ``graph``; the error that spoiled it, if any. The
        capture is ended whatever ``fn`` raises, so the stream leaves capture mode (PyTorch's
        allocator does not where the end itself fails: its check comes first), and what is
        not a failure to capture (an interrupt) is raised after. capture_begin / capture_end,
        not torch.cuda.graph: that one synchronises and empties the allocator's caches before
        every capture (a round's first steps capture dozens)."""
        failed = None
        graph.capture_begin(pool=self._pool)
        try:
            fn(*inputs)  # recorded, not run
        except Exception as err:  # noqa: BLE001 - e.g. an operation a graph cannot hold
            failed = err
        finally:
            try:
                graph.capture_end()
            except RuntimeError as err:  # (invalidated by the failure above)
                failed = failed or err
        return failed

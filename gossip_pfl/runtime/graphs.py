"""A round's fixed-shape GPU work as CUDA graphs: captured once per shape, then replayed every
round with its inputs copied into the graph's own buffers, so the host launches one graph where
it launched dozens of kernels (a synthetic round's SGD steps: 1.66 ms of launches, 0.47 ms
replayed, on an H200; docs/benchmarks.md). ``runtime.cuda_graphs`` (on by default) takes the
binary linear model's steps this way; ``runtime.cuda_graph_steps`` (off until timed on a GPU)
an autograd model's local steps, a graph per step shape."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _HostValues(TorchDispatchMode):
    """The operations a function runs and the host values they take (numbers, dtypes, shapes;
    not tensors' contents), for :class:`_Recorded`; and the memory of each tensor an
    operation reads that the call did not make (a captured graph reads those addresses, so
    a tensor taken afresh each round, from an attribute, would be the first round's there)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.made: set[int] = set()  # the storages this call's operations allocated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        host = tuple(_host_value(v) for v in leaves)
        if func is torch.ops.aten.lift_fresh.default:  # a tensor made of Python numbers here
            # (``t[i] = 1``, ``torch.tensor(x)``): its values are host values, a graph's
            # constants (as text: NaN equals NaN, -0.0 is not 0.0); its memory this call's own
            host += (repr(args[0].tolist()),)
            self.made.add(_storage(args[0]))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        read = [_storage(v) for v in tensors]
        # where a tensor the call did not make lies: its memory, and which part of it
        held = tuple((p, v.storage_offset(), v.stride()) for p, v in zip(read, tensors)
                     if p not in self.made)  # fmt: skip
        self.ops.append((str(func), host, held))
        out = func(*args, **kwargs)
        # new memory only: a view or an in-place result is the tensor it read
        outs, _ = tree_flatten(out)
        self.made.update(p for v in outs if isinstance(v, torch.Tensor)
                         if (p := _storage(v)) not in read)  # fmt: skip
        return out


def _host_value(v):
    """What a graph would keep of an operation's argument: a tensor's shape and type, a
    float as text (NaN then equals NaN, and -0.0 is not 0.0), anything else as it is."""
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    return repr(v) if isinstance(v, float) else v


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


#: the profiler's label of a simulated replay (benchmarks/bench_ops.py counts what is under
#: it as the one launch a graph would be)
SIMULATED_REPLAY = "gossip_pfl::simulated_graph_replay"


class _Recorded:
    """What :class:`GraphReplay` keeps instead of a graph when it ``simulate``s one: the
    function of the first call, its buffers, and the host values and held tensors its
    operations took; each :meth:`replay` runs the function again and checks that they took
    the same ones."""

    def __init__(self, fn: Callable[..., None], inputs: tuple) -> None:
        self.fn, self.inputs = fn, inputs
        with _HostValues() as seen:
            fn(*inputs)
        self.ops = seen.ops

    def replay(self) -> None:
        with torch.profiler.record_function(SIMULATED_REPLAY), _HostValues() as seen:
            self.fn(*self.inputs)
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

    ``simulate`` (tests, on a CPU): keep the first call's ``fn``, closure and all, with its
    buffers, and run that again where a graph would replay. A value ``fn`` took from its
    closure (a step size, a tensor made anew every round) then stays what it was, as in a
    captured graph, and a comparison with eager steps finds it. A value it reads afresh (an
    attribute, a global) would change where a graph's would not: each replay checks that its
    operations take the host values (numbers, dtypes, shapes) of the first call, and read
    the same memory where they read a tensor the call did not make.

    A capture that raises (an operation a graph cannot hold, e.g. one that waits for the
    device) sets :attr:`failure`; this call's work was done by the run before it, and every
    later call runs ``fn`` as it is."""

    def __init__(self, keep: int = 8, share_pool: bool = False, simulate: bool = False) -> None:
        self.keep, self.share_pool, self.simulate = keep, share_pool, simulate
        self.graphs: OrderedDict[Hashable, tuple] = OrderedDict()  # key -> (graph, inputs)
        self._pool = None  # the shared pool's handle, made at the first capture
        #: why a capture failed; from then on every call runs ``fn`` as it is, and the
        #: caller may say so once
        self.failure: str | None = None
        self._stream = None  # the captures' side stream

    def __call__(self, key: Hashable, fn: Callable[..., None], *inputs: torch.Tensor) -> None:
        if self.failure is not None:
            fn(*inputs)
            return
        if key in self.graphs:
            self.graphs.move_to_end(key)
            graph, mine = self.graphs[key]
            for buffer, new in zip(mine, inputs):
                buffer.copy_(new)
            graph.replay()
            return
        while len(self.graphs) >= self.keep:  # the oldest graph's memory goes first
            self.graphs.popitem(last=False)
        mine = tuple(t.clone() for t in inputs)
        if self.simulate:
            self.graphs[key] = (_Recorded(fn, mine), mine)  # (runs fn once)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        if self.share_pool and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side, graph, failed = self._stream, torch.cuda.CUDAGraph(), None
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*mine)  # this call's work, and the warm-up a capture needs
            # capture_begin / capture_end, not torch.cuda.graph: that one synchronises and
            # empties the allocator's caches before every capture (a round's first steps
            # capture dozens), and leaves its stream current if the capture fails
            graph.capture_begin(pool=self._pool)
            try:
                fn(*mine)  # recorded, not run
            except RuntimeError as err:  # e.g. an operation that waits for the device
                failed = err
            try:
                graph.capture_end()
            except RuntimeError as err:  # (invalidated by the failure above)
                failed = failed or err
        torch.cuda.current_stream().wait_stream(side)
        if failed is not None:
            self.failure = str(failed).splitlines()[0] if str(failed) else type(failed).__name__
            self.graphs.clear()
            return
        self.graphs[key] = (graph, mine)

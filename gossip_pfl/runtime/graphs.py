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


class _Recorded:
    """What :class:`GraphReplay` keeps instead of a graph when it ``simulate``s one: the
    function of the first call and its buffers, run again by :meth:`replay`."""

    def __init__(self, fn: Callable[..., None], inputs: tuple) -> None:
        self.fn, self.inputs = fn, inputs

    def replay(self) -> None:
        self.fn(*self.inputs)


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
    buffers, and run that again where a graph would replay. A value ``fn`` took from the host
    at its first call (a step size, a tensor made anew every round) then stays what it was,
    as in a captured graph, and a comparison with eager steps finds it."""

    def __init__(self, keep: int = 8, share_pool: bool = False, simulate: bool = False) -> None:
        self.keep, self.share_pool, self.simulate = keep, share_pool, simulate
        self.graphs: OrderedDict[Hashable, tuple] = OrderedDict()  # key -> (graph, inputs)
        self._pool = None  # the shared pool's handle, made at the first capture
        #: why a capture failed (an operation a graph cannot hold); from then on every call
        #: runs ``fn`` as it is, and the caller may say so once
        self.failure: str | None = None

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
            fn(*mine)
            self.graphs[key] = (_Recorded(fn, mine), mine)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*mine)
        torch.cuda.current_stream().wait_stream(side)
        if self.share_pool and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                fn(*mine)  # recorded, not run: this call's work was done above
        except RuntimeError as err:  # e.g. an operation that waits for the device
            self.failure = str(err).splitlines()[0] if str(err) else type(err).__name__
            self.graphs.clear()
            return
        self.graphs[key] = (graph, mine)

"""A round's fixed-shape GPU work as CUDA graphs (``runtime.cuda_graphs``): captured once per
shape, then replayed every round with its inputs copied into the graph's own buffers, so the
host launches one graph where it launched dozens of kernels (a synthetic round's SGD steps:
1.66 ms of launches, 0.47 ms replayed, on an H200; docs/benchmarks.md). On by default."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch


class GraphReplay:
    """``fn(*inputs)``, a function of tensors that works in place on tensors it holds (a
    round's parameters) and returns nothing, run as a CUDA graph per ``key`` (the shapes and
    the held tensors' addresses, as the caller builds it). A new key runs ``fn`` on a side
    stream (this call's work, and the warm-up a capture needs), then captures it; a known key
    copies ``inputs`` into its graph's buffers and replays. The last ``keep`` graphs are kept
    (partial participation changes a round's shapes among a few). ``fn`` may read nothing
    from the host that changes between calls (every changing value comes in ``inputs``) and
    must not synchronise with the host."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.graphs: OrderedDict[Hashable, tuple] = OrderedDict()  # key -> (graph, inputs)

    def __call__(self, key: Hashable, fn: Callable[..., None], *inputs: torch.Tensor) -> None:
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
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*mine)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*mine)  # recorded, not run: this call's work was done above
        self.graphs[key] = (graph, mine)

"""A model's parameters for many peers and components as one flat tensor.

Shared state lives in one ``(nodes, M, P)`` tensor: the exchange moves rows of it, the local
solver updates it in place, and the model sees per-peer, per-component parameter views through
``torch.func.functional_call``. One flat buffer means one message per neighbouring rank and one
optimizer update for all peers at once.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call, vmap

from gossip_pfl.errors import GossipError


class ParamLayout:
    """Names, shapes and offsets of a model's parameters inside a flat vector."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)

    def flatten(self, model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter views of ``flat`` (..., P) -> {name: (..., *shape)}."""
        out, offset = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            out[name] = flat[..., offset : offset + size].unflatten(-1, shape)
            offset += size
        return out


def init_components(model_fn, layout: ParamLayout, components: int, seed: int) -> torch.Tensor:
    """(M, P) initial component parameters, component m drawn from seed (seed, m): the same on
    every rank, whatever the placement."""
    rows = []
    for m in range(components):
        torch.manual_seed(seed * 1009 + m)
        rows.append(layout.flatten(model_fn()))
    return torch.stack(rows)


class BatchedForward:
    """Evaluate the model for every (peer, component) pair at once.

    ``__call__(theta (L, M, P), x (L, B, *in)) -> logits (L, M, B, C)``. Three ways, chosen at
    construction: the model's own ``batched_forward(params, x)`` when it has one (layers written
    for a batch of weights, fastest), else nested ``vmap`` over ``functional_call``; models vmap
    cannot handle (e.g. BatchNorm updating running statistics) fall back to a per-peer,
    per-component loop.
    """

    def __init__(self, model: nn.Module, layout: ParamLayout, batching: str = "auto"):
        if batching not in ("auto", "vmap", "loop"):
            raise GossipError(f"runtime.batching must be auto, vmap or loop (got {batching!r})")
        self.model, self.layout = model, layout

        def single(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return functional_call(model, layout.unflatten(flat), (x,))

        self._single = single
        self._vmapped = vmap(vmap(single, in_dims=(0, None)), in_dims=(0, 0))
        self.mode, self.reason, self.requested = batching, "", batching
        self.native = getattr(model, "batched_forward", None)
        if batching != "loop":
            self.reason = self._vmap_failure()
            if self.reason and batching == "vmap":
                raise GossipError(
                    f"runtime.batching is 'vmap' but the model cannot be batched: {self.reason}"
                )
            self.mode = "loop" if self.reason else "vmap"

    def _vmap_failure(self) -> str:
        """Why vmap cannot run this model ('' if it can): try it on a tiny input."""
        if any(True for _ in self.model.buffers()):
            return "the model has buffers (e.g. BatchNorm statistics) that vmap cannot update"
        return ""

    def check(self, theta: torch.Tensor, x: torch.Tensor) -> None:
        """Run one tiny batch through the batched path that will run (the model's own layers
        when it has them); in auto mode switch to the loop when it fails."""
        if self.mode != "vmap":
            return
        try:
            self(theta[:1, :1], x[:1, :1])
        except Exception as err:  # noqa: BLE001 - any failure means "not batchable"
            self.reason = str(err).splitlines()[0][:160]
            if self.requested == "vmap":
                raise GossipError(
                    f"runtime.batching is 'vmap' but the model cannot be batched: {self.reason}"
                ) from None
            self.mode = "loop"

    def __call__(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "vmap":
            if self.native is not None:
                return self.native(self.layout.unflatten(theta), x)
            return self._vmapped(theta, x)
        return torch.stack(
            [
                torch.stack([self._single(theta[i, m], x[i]) for m in range(theta.shape[1])])
                for i in range(theta.shape[0])
            ]
        )

    def describe(self) -> str:
        if self.mode == "vmap":
            how = "the model's batched layers" if self.native else "vmap"
            return f"batched over peers and components ({how})"
        return f"per-peer loop ({self.reason or 'requested'})"

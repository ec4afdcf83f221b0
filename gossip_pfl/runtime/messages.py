"""Messages: a named bundle per peer, flattened into one row so the transport moves it as one
buffer per neighbouring rank.

A bundle is the shared parameters ``theta`` (M, P), then any other parameter-shaped tensors a
rule needs (e.g. SCAFFOLD's control variate), then named per-peer scalars (a client's last loss,
its last step size, ||Delta_i||^2). Mixing a bundle through W_t averages every column with the
same weights, so a rule on a peer (or on the hub) receives the weighted average of each kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bundle:
    """Layout of a message row: ``theta``, then ``tensors`` (each shaped like theta), then
    ``scalars`` (one column each).

    >>> b = Bundle((2, 3), tensors=("control",), scalars=("loss",))
    >>> b.width, b.columns()
    (13, {'theta': 6, 'control': 6, 'loss': 1})
    """

    shape: tuple[int, int]  #: (M, P) of theta
    tensors: tuple[str, ...] = ()
    scalars: tuple[str, ...] = ()

    @property
    def plain(self) -> bool:
        """Only theta: the parameters travel as they are, no packing copy."""
        return not self.tensors and not self.scalars

    def columns(self) -> dict[str, int]:
        size = self.shape[0] * self.shape[1]
        return {"theta": size, **{k: size for k in self.tensors}, **{k: 1 for k in self.scalars}}

    @property
    def width(self) -> int:
        return sum(self.columns().values())

    def pack(self, parts: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (R, width) from ``parts`` (theta and tensors (R, M, P), scalars (R,))."""
        theta = parts["theta"]
        rows = theta.shape[0]
        if self.plain and out is None:
            return theta.reshape(rows, -1)
        if out is None:
            out = theta.new_empty((rows, self.width))
        start = 0
        for name, width in self.columns().items():
            out[:, start : start + width].copy_(parts[name].reshape(rows, width))
            start += width
        return out

    def unpack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``rows`` (R, width) by kind: theta and tensors (R, M, P), scalars (R,)."""
        out, start = {}, 0
        for name, width in self.columns().items():
            part = rows[:, start : start + width]
            out[name] = part[:, 0] if name in self.scalars else part.view(-1, *self.shape)
            start += width
        return out

    def bytes_by_kind(self, messages: int, element_size: int) -> dict[str, int]:
        """Bytes that ``messages`` rows carry, by kind."""
        return {k: messages * w * element_size for k, w in self.columns().items()}

"""The local solver: minibatch SGD on every peer's shared variables at once.

Works on the ``(L, M, P)`` stack in place. Each peer has its own step-size multiplier (FedEM's
n_t/n weighting), and a step updates only the peers that still have a batch in it: a peer whose
epoch is over is left untouched, momentum and weight decay included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SGDState:
    """Private per-peer optimizer state (never mixed)."""

    momentum: torch.Tensor  # (L, M, P)


@dataclass(frozen=True)
class LocalSGD:
    """SGD with momentum and weight decay as ``torch.optim.SGD`` defines them (dampening 0),
    applied per peer with a mask; ``prox_mu`` adds FedProx's ``mu/2 ||u - u_anchor||^2``."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0

    def init(self, theta: torch.Tensor) -> SGDState:
        return SGDState(torch.zeros_like(theta))

    @torch.no_grad()
    def step(
        self,
        theta: torch.Tensor,
        grad: torch.Tensor,
        state: SGDState,
        rows: torch.Tensor,
        lr_scale: torch.Tensor,
        lr_factor: float = 1.0,
        anchor: torch.Tensor | None = None,
    ) -> None:
        """One in-place step on the peers ``rows`` (indices into theta's first axis, or a
        slice); ``grad`` holds their gradients in that order. ``lr_scale`` (L,) is a per-peer
        multiplier."""
        p = theta[rows]
        g = grad
        if self.weight_decay:
            g = g + self.weight_decay * p
        if self.prox_mu and anchor is not None:
            g = g + self.prox_mu * (p - anchor[rows])
        if self.momentum:
            g = self.momentum * state.momentum[rows] + g
            state.momentum[rows] = g
        theta[rows] = p - (self.lr * lr_factor) * lr_scale[rows, None, None] * g

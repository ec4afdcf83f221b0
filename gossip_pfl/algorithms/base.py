"""The surrogate interface (federated surrogate optimization, Alg. 3 and 5 of the FedEM paper).

An algorithm tells the runtime three things about a peer: how to update its personal variables
v at the start of a round (the argmin of the surrogate in v), the stochastic gradient of the
surrogate in the shared variables u for one minibatch, and how to predict. The runtime does the
local steps and mixes u over W_t. Everything works on a rank's peers at once: tensors have a
leading peer axis L (or A, the peers active in a step) and a component axis M.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from gossip_pfl.algorithms.losses import sample_loss


class Context(Protocol):
    """What a surrogate may use from the runtime (the Trainer provides it)."""

    forward: object  # BatchedForward: (theta (L, M, P), x (L, B, *in)) -> logits (L, M, B, C)
    task: str
    M: int
    track_loss: bool  # the rule reads the last minibatch's loss (FedLi)
    line_search: bool  # the solver evaluates the loss (Armijo)
    fuses_e_step: bool  # the round's loop works a mixture's E-step out (runtime.stack.PendingEStep)
    # in begin_round, the round's participants among the L peers, (L,) bool on the host; None:
    # every peer. What begin_round returns for the others is thrown away: it need not be
    # computed.
    participants: np.ndarray | None

    def train_losses(self, theta: torch.Tensor, split=None, active=None) -> torch.Tensor: ...

    def peer_pieces(self, n_peers: int, batch: int) -> list[slice]: ...

    def map_pieces(self, fn, pieces: list[slice]) -> list: ...  # fn over pieces, maybe at once


class Surrogate(Protocol):
    components: int
    task: str
    #: True (a surrogate without it is taken so): shared_grad reads and may write the step's
    #: rows of ``personal``, one row a peer (``rows``: positions in the stack, an index
    #: tensor or a slice; for a reordered round the trainer keeps those rows in the stack's
    #: order, so they are not peer ids); False: it reads neither
    step_reads_personal: bool

    def init_personal(self, peers: np.ndarray, theta0: torch.Tensor) -> dict[str, torch.Tensor]:
        """Private state of the peers with ids ``peers`` (L of them; the ids seed any random
        draw, so it does not depend on the placement); ``theta0`` (M, P) is the common initial
        shared state."""

    def begin_round(self, ctx: Context, theta: torch.Tensor, personal: dict, mask: torch.Tensor):
        """v-update before the local steps; returns (personal, q) with q (L, M, N) the weights
        of every training sample in the loss for u, or None for plain ERM (weight 1 on every
        real sample: the solver then skips gathering q per step)."""

    def shared_grad(
        self, ctx: Context, theta: torch.Tensor, personal: dict, rows, x, y, sw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient in u of the surrogate on one minibatch for the peers of ``theta``'s rows
        (``personal``'s ``rows``), and each peer's minibatch loss (A,); may update those
        peers' personal variables in place (pFedMe, APFL)."""

    def eval_state(self, theta: torch.Tensor, personal: dict) -> torch.Tensor:
        """The (L, M, P) parameters a peer predicts with (its personal model where it has one)."""

    def predict(self, logits: torch.Tensor, personal: dict) -> torch.Tensor:
        """logits (L, M, B, C) -> class probabilities (L, B, K)."""


def weighted_loss(ctx: Context, theta: torch.Tensor, x, y, sw, batch_size: int) -> torch.Tensor:
    """(sum_b sw_b * loss_b) / batch_size per peer, summed over components: (A,). With
    ``loss_divisor: batch`` the plan's weights hold batch_size / b for a batch of b samples,
    so this is the batch's mean (docs/algorithms.md, "Loss and participation")."""
    per = sample_loss(ctx.forward(theta, x), y, ctx.task)  # (A, M, B)
    return (per * sw).sum((1, 2)) / batch_size


def weighted_loss_grad(ctx: Context, theta: torch.Tensor, x, y, sw, batch_size: int):
    """Gradient of (sum_b sw_b * loss_b) / batch_size per peer and component (as
    :func:`weighted_loss`), by autograd through the batched forward, and that loss per peer
    (A,).

    Peers are independent, so the step may run in pieces of the peer axis (``ctx.peer_pieces``):
    a big convolutional step then keeps its activations near the cache instead of streaming
    hundreds of MB through memory. Each piece is its own autograd leaf (a slice of one leaf
    would cost a full-size gradient per piece), and with the model's own batched layers each
    parameter of it is (:meth:`BatchedForward.for_grad`): their gradients are then written
    once, into their places."""
    fwd = ctx.forward
    if fwd.closed_form:  # the linear model: no autograd graph at all
        need = ctx.track_loss or ctx.line_search
        return fwd.loss_grad(theta, x, y, sw, ctx.task, batch_size, need_loss=need)
    pieces = ctx.peer_pieces(theta.shape[0], x.shape[1])
    # pieces: each one's gradients written once into their places of one tensor
    grad = torch.empty_like(theta) if len(pieces) > 1 else None

    def piece(sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
        logits, leaves = fwd.for_grad(theta[sl], x[sl])
        weighted = sample_loss(logits, y[sl], ctx.task) * sw[sl]  # (A, M, B)
        # a parameter the loss does not reach gets zeros (as a view of the flat leaf did)
        parts = torch.autograd.grad(weighted.sum() / batch_size, leaves,
                                    materialize_grads=True)  # fmt: skip
        flat = fwd.flat_grad(parts, None if grad is None else grad[sl])
        return flat, weighted.detach().sum((1, 2)) / batch_size

    done = ctx.map_pieces(piece, pieces)  # on a CPU, several pieces at once
    loss = done[0][1] if len(done) == 1 else torch.cat([d[1] for d in done])
    return (done[0][0] if grad is None else grad), loss

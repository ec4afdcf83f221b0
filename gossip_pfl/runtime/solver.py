"""Local solvers: steps on every peer's shared variables at once, each an (init, step) pair that
owns its step-size schedule.

Works on the ``(L, M, P)`` stack in place. Each peer has its own step-size multiplier (FedEM's
n_t/n weighting), and a step updates only the peers that still have a batch in it: a peer whose
epoch is over is left untouched, momentum and weight decay included. Every solver records the
step size each peer took last (``state.eta``): FedLi's clients send it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: devices whose steps use fused forms: with one step size for every peer, the kernel of
#: ``torch.optim.SGD(fused=True)`` (``torch._fused_sgd_``), which reads the parameters, the
#: gradient and the momentum once and writes the parameters and the momentum once (5 passes
#: over the rows' parameters a step with momentum and weight decay, instead of 15); with a
#: step size by peer, forms such as a + alpha b and a + b c (9 passes). A GPU evaluates these
#: the same way at every element; a CPU rounds its vector lanes and its scalar tail
#: differently, which would tie a peer's bits to its place in the stack (placements differ
#: there), so the CPU keeps one operation per term.
FUSED_ON: tuple[str, ...] = ("cuda",)
#: the fused kernel with its step size in a tensor (PyTorch 2.3 on); older builds take the forms
FUSED_KERNEL = hasattr(getattr(torch.ops.aten, "_fused_sgd_", None), "tensor_lr")
#: elements of one tensor the kernel takes: older builds count a tensor's elements in 32 bits
KERNEL_ELEMENTS = 2**31 - 1


@dataclass
class SGDState:
    """Private per-peer optimizer state (never mixed)."""

    momentum: torch.Tensor  # (L, M, P)
    eta: torch.Tensor  # (L,) the last step size each peer took


@dataclass(frozen=True)
class LocalSGD:
    """SGD with momentum and weight decay as ``torch.optim.SGD`` defines them (dampening 0),
    applied per peer with a mask; ``prox_mu`` adds FedProx's ``mu/2 ||u - u_anchor||^2``;
    ``lr_decay`` are fractions of the run after which the step size is multiplied by 0.1."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0
    lr_decay: tuple[float, ...] = ()

    def init(self, theta: torch.Tensor) -> SGDState:
        eta = torch.zeros(theta.shape[0], dtype=torch.float64, device=theta.device)
        return SGDState(torch.zeros_like(theta), eta)

    def factor(self, t: int, rounds: int) -> float:
        """The step-size schedule: 0.1 per decay point passed."""
        return 0.1 ** sum(t >= f * rounds for f in self.lr_decay)

    def begin_round(self, state: SGDState) -> None:
        pass

    def permute_rows(self, state: SGDState, order: torch.Tensor, eta: bool = True) -> None:
        """Put the peers' state in ``order`` in place (row i takes row ``order[i]``'s), as
        the trainer does the stack for a reordered plan (:func:`gossip_pfl.runtime.data.
        step_plan`'s ``prefix``); the momentum only where a step reads it, the step sizes
        only with ``eta`` (steps with ``record=False`` leave them alone)."""
        if self.momentum:
            state.momentum.copy_(state.momentum[order])
        if eta:
            state.eta.copy_(state.eta[order])

    @property
    def plain(self) -> bool:
        """A step is theta -= lr g alone (no momentum, decay or proximal term): the trainer
        then applies it as one fused update per step instead of calling :meth:`step`."""
        return type(self) is LocalSGD and not (self.momentum or self.weight_decay or self.prox_mu)

    def direction(self, theta, grad, rows, anchor=None, correction=None) -> torch.Tensor:
        """The gradient with weight decay, the proximal term and a control-variate correction
        (SCAFFOLD's c - c_i) added."""
        return self._direction(theta[rows], grad, lambda t: t[rows], anchor, correction)

    def _direction(
        self, p, grad, take, anchor, correction, fused=False, decay=True
    ) -> torch.Tensor:  # fmt: skip
        """:meth:`direction` from the rows' parameters ``p``; ``take(t)`` gives a tensor's
        rows. Each operation as its own kernel unless ``fused`` (see :data:`FUSED_ON`); the
        weight decay left out unless ``decay``."""
        g = grad
        if self.weight_decay and decay:
            g = torch.add(grad, p, alpha=self.weight_decay) if fused else (
                torch.mul(p, self.weight_decay).add_(grad))  # fmt: skip
        if self.prox_mu and anchor is not None:
            g = g + self.prox_mu * (p - take(anchor))
        if correction is not None:
            g = g + correction
        return g

    @torch.no_grad()
    def step(
        self,
        theta: torch.Tensor,
        grad: torch.Tensor,
        state: SGDState,
        rows: torch.Tensor | slice,
        lr_scale: torch.Tensor | None,
        lr_factor: float | torch.Tensor = 1.0,
        anchor: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
        record: bool = True,
        **_,
    ) -> None:
        """One in-place step on the peers ``rows`` (indices into theta's first axis, or a
        slice); ``grad`` holds their gradients in that order. ``lr_scale`` (L,) is a per-peer
        multiplier (None: 1 for every peer); ``lr_factor`` the schedule's, a number or a
        0-dim float64 tensor (a CUDA graph's, filled every round). ``record``: write the step
        sizes taken into ``state.eta`` (a round's steps all take the round's size: the
        trainer records them once a round instead, 1 to 4 operations a step fewer).

        A slice's rows are views, updated in place; indexed rows are gathered once and copied
        back once. With a CNN's millions of parameters a peer the step is memory traffic:
        about 15 passes over the rows' parameters with weight decay and momentum (23 for
        indexed rows), where a copy per index and an operation per term took 19 (27); on the
        devices of :data:`FUSED_ON` 5 (13) with one step size for all, 9 (17) by peer."""
        full = isinstance(rows, slice)
        fused = theta.device.type in FUSED_ON
        take = (lambda t: t[rows]) if full else (lambda t: t.index_select(0, rows))
        p = take(theta)
        lr = self.lr * lr_factor
        if fused and lr_scale is None and FUSED_KERNEL:
            self._fused_step(p, grad, state, rows, take, lr, anchor, correction)
            if not full:
                theta.index_copy_(0, rows, p)
            if record:
                state.eta[rows] = lr
            return
        d = self._direction(p, grad, take, anchor, correction, fused)
        g = d
        if self.momentum:
            m = take(state.momentum)
            if fused:  # m <- d + momentum m, one pass
                g = torch.add(d, m, alpha=self.momentum, out=m)
            else:
                g = m.mul_(self.momentum).add_(d)
            if not full:
                state.momentum.index_copy_(0, rows, m)
        if lr_scale is not None:
            step = lr * lr_scale[rows, None, None]
        elif fused:  # (a build without the kernel) addcmul_ takes a tensor
            step = _device_scalar(lr, p)
        else:
            step = lr
        if fused:
            p.addcmul_(g, step, value=-1.0)
        else:
            # the step's product into the direction's own temporary (not the caller's grad):
            # on a CPU a fresh one is fresh pages, faulted in
            scratch = None if d is grad else d
            p.sub_(torch.mul(g, step, out=scratch))
        if not full:
            theta.index_copy_(0, rows, p)
        if record:
            state.eta[rows] = lr if lr_scale is None else lr * lr_scale[rows].double()

    def _fused_step(self, p, grad, state, rows, take, lr, anchor, correction) -> None:
        """:meth:`step` on the rows' parameters ``p`` (views, or a gathered copy) with one step
        size ``lr`` for all, in ``torch.optim.SGD(fused=True)``'s kernel: weight decay,
        momentum and the update in one pass (its rounding differs from the forms'). The step
        size goes in as a float32 tensor on the device, so that a CUDA graph takes a new one
        every round (a number would be frozen at capture); the rows in blocks of at most
        :data:`KERNEL_ELEMENTS` elements."""
        g = self._direction(p, grad, take, anchor, correction, fused=True, decay=False)
        lr = _device_scalar(lr, p, torch.float32)  # (the kernel reads a float32)
        m = take(state.momentum) if self.momentum else None
        rows_a_block = max(1, KERNEL_ELEMENTS // max(1, p[0].numel())) if len(p) else 1
        torch._fused_sgd_(
            list(p.split(rows_a_block)), list(g.contiguous().split(rows_a_block)),
            [] if m is None else list(m.split(rows_a_block)),
            weight_decay=self.weight_decay, momentum=self.momentum, lr=lr, dampening=0.0,
            nesterov=False, maximize=False, is_first_step=False,
        )  # fmt: skip
        if m is not None and not isinstance(rows, slice):
            state.momentum.index_copy_(0, rows, m)


def _device_scalar(
    value: float | torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``value`` (a number, or a 0-dim tensor: a CUDA graph's held factor) as a 0-dim tensor
    on ``like``'s device, in ``dtype`` (default ``like``'s): filled there, not uploaded."""
    dtype = dtype or like.dtype
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=dtype)
    return torch.full((), value, dtype=dtype, device=like.device)


@dataclass
class Search:
    """One line-search step's values for its peers (A,), which :meth:`LocalArmijo.trial`
    updates in place."""

    g: torch.Tensor  # (A, M, P) the direction
    f0: torch.Tensor  # the objective at the step's start (float64, as the rest)
    g2: torch.Tensor  # ||g||^2
    eta: torch.Tensor  # the step size the next trial tries
    step: torch.Tensor  # the step size taken (the last one tried)
    pending: torch.Tensor  # bool: still searching


@dataclass(frozen=True)
class LocalArmijo(LocalSGD):
    """SGD with a stochastic Armijo line search on each minibatch (FedLi-LS's client,
    Vaswani et al. 2019's SLS): from the reset step size, try eta, eta beta, eta beta^2, ...
    until ``f_B(w - eta g) <= f_B(w) - c eta ||g||^2`` on the same minibatch (weight decay and
    FedProx's proximal term in both f and g); at most ``max_trials`` trials (the last one is
    taken if none passes); no step when ``||g|| < 1e-8``. Each round starts at ``eta_max``;
    ``reset`` grow multiplies the last accepted eta by 2^(1 / batches per epoch) (capped at
    eta_max), keep reuses it, max restarts from eta_max every step. No momentum (the paper's
    Algorithm 3)."""

    c: float = 0.1
    beta: float = 0.9
    eta_max: float = 1.0
    max_trials: int = 100
    reset: str = "grow"

    def init(self, theta: torch.Tensor) -> SGDState:
        state = super().init(theta)
        state.eta.fill_(self.eta_max)
        return state

    def begin_round(self, state: SGDState) -> None:
        state.eta.fill_(self.eta_max)

    @torch.no_grad()
    def step(
        self,
        theta: torch.Tensor,
        grad: torch.Tensor,
        state: SGDState,
        rows: torch.Tensor | slice,
        lr_scale: torch.Tensor,
        lr_factor: float = 1.0,
        anchor: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
        loss: torch.Tensor | None = None,
        loss_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        batches: torch.Tensor | None = None,
    ) -> None:
        """``loss`` (A,) the minibatch loss at theta[rows]; ``loss_at(candidate, sub)`` the
        same minibatch's loss of candidate parameters for the step's peers ``sub``; ``batches``
        (A,) each peer's batches per epoch (for the grow reset). Each trial runs on the peers
        still searching (:meth:`trial` at ``sub``)."""
        p = theta[rows]
        s = self.begin(p, grad, state, rows, anchor, correction, loss, batches)
        a = anchor[rows] if self.prox_mu and anchor is not None else None
        for trial in range(self.max_trials):
            # (a nonzero is a wait for a GPU: the step graphs take the masked trials)
            sub = s.pending.nonzero()[:, 0]
            if len(sub) == 0:
                break
            self.trial(p, s, loss_at, trial == self.max_trials - 1, sub, a)
        self.end(theta, state, rows, p, s)

    def begin(
        self, p, grad, state: SGDState, rows, anchor, correction, loss, batches
    ) -> Search:  # fmt: skip
        """A step's search from its peers' parameters ``p`` (theta[rows]), direction and
        objective; the first step size to try (the reset from each peer's last). Peers with
        ||g|| < 1e-8 are not searching."""
        g = self._direction(p, grad, lambda t: t[rows], anchor, correction)
        f0 = loss.double() + self._decay(p)
        if self.prox_mu and anchor is not None:
            f0 = f0 + self.prox_loss(p, anchor[rows])
        g2 = g.double().flatten(1).pow(2).sum(1)
        eta = state.eta[rows].clone()
        if self.reset == "grow":
            eta = (eta * 2.0 ** (1.0 / batches.double())).clamp_max(self.eta_max)
        elif self.reset == "max":
            eta = torch.full_like(eta, self.eta_max)
        pending = g2 >= 1e-16  # ||g|| >= 1e-8; the others take no step
        step = torch.where(pending, eta, torch.zeros_like(eta))
        return Search(g, f0, g2, eta, step, pending)

    def trial(
        self, p: torch.Tensor, s: Search, loss_at: Callable, last: bool,
        sub: torch.Tensor | None = None, anchor: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """One trial of the search ``s`` from the step's parameters ``p``, in place: at
        ``sub``, the peers still searching (by index and ``where``: a boolean mask's rows
        would be a wait for a GPU), or at every peer, those done left as they are (None: no
        row count read back, a CUDA graph's form; the same values). ``last``: every peer
        takes the step size it tried. ``anchor``: FedProx's, the step's rows of it."""
        take = (lambda t: t) if sub is None else (lambda t: t[sub])
        tried = take(s.eta)
        cand = take(p) - tried.to(p.dtype)[:, None, None] * take(s.g)
        f1 = loss_at(cand, sub).double() + self._decay(cand)
        if anchor is not None:  # (FedProx's term: the objective's, searched)
            f1 = f1 + self.prox_loss(cand, take(anchor))
        ok = f1 <= take(s.f0) - self.c * tried * take(s.g2)
        done = ok | last
        then = torch.where(done, tried, tried * self.beta)
        if sub is None:  # (the step sizes before the next trial's: tried is a view of eta)
            s.step.copy_(torch.where(s.pending, tried, s.step))
            s.eta.copy_(torch.where(s.pending, then, s.eta))
            s.pending.logical_and_(~done)
        else:
            s.step[sub] = tried
            s.pending[sub] = ~done
            s.eta[sub] = then

    def end(self, theta: torch.Tensor, state: SGDState, rows, p: torch.Tensor, s: Search) -> None:
        """The step each peer's search took from ``p``, its step size recorded."""
        theta[rows] = p - s.step.to(p.dtype)[:, None, None] * s.g
        state.eta[rows] = torch.where(s.g2 >= 1e-16, s.step, state.eta[rows])

    def prox_loss(self, p: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """FedProx's term of the searched objective, ``mu/2 ||p - anchor||^2`` for each row
        (float64): the direction holds its gradient, so the Armijo test must hold the term
        (without it a search against the pull to the anchor took its smallest step)."""
        return 0.5 * self.prox_mu * (p.double() - anchor.double()).flatten(1).pow(2).sum(1)

    def _decay(self, p: torch.Tensor) -> torch.Tensor:
        if not self.weight_decay:
            return torch.zeros(p.shape[0], dtype=torch.float64, device=p.device)
        return 0.5 * self.weight_decay * p.double().flatten(1).pow(2).sum(1)

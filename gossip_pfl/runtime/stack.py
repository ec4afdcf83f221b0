"""A model's parameters for many peers and components as one flat tensor.

Shared state lives in one ``(nodes, M, P)`` tensor: the exchange moves rows of it, the local
solver updates it in place, and the model sees per-peer, per-component parameter views through
``torch.func.functional_call``. One flat buffer means one message per neighbouring rank and one
optimizer update for all peers at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from gossip_pfl.errors import GossipError
from gossip_pfl.models import Linear
from gossip_pfl.runtime.data import Uploads, linear_plan, linear_uploads
from gossip_pfl.runtime.graphs import GraphReplay

#: devices on which independent pieces of a step's or an evaluation's calls run at once, on
#: the run's torch threads (:meth:`BatchedForward.piece_threads`); a GPU runs them in turn
PIECES_AT_ONCE_ON: tuple[str, ...] = ("cpu",)


@dataclass(frozen=True)
class PendingEStep:
    """FedEM's E-step left to the round's compiled loop (:meth:`BatchedForward.
    linear_sgd_round` with compiled CPU loops): it fills each peer's responsibilities ``q``
    (L, M, N_max) and new mixture weights ``pi`` (L, M) from ``old_pi`` at the components
    as the round starts, just before that peer's steps, which then find its samples in the
    cache. The numbers are :meth:`MixtureSurrogate.update_personal`'s on the train losses,
    up to float rounding (tests/test_speed.py)."""

    old_pi: torch.Tensor
    smoothing: float  #: q's smoothing towards 1 / M (the surrogate's q_smoothing)
    q: torch.Tensor
    pi: torch.Tensor

    @classmethod
    def of(cls, pi: torch.Tensor, n_max: int, smoothing: float) -> PendingEStep:
        L, M = pi.shape
        q = torch.empty(L, M, n_max, dtype=torch.float32, device=pi.device)
        return cls(pi, smoothing, q, torch.empty(L, M, dtype=torch.float32, device=pi.device))


@dataclass(frozen=True)
class PersonalSteps:
    """A step of pFedMe or APFL (``kind``) for the fused linear round
    (:meth:`BatchedForward.linear_sgd_round`: :func:`gossip_pfl.runtime.kernels.
    personal_round`, or the torch operations' :class:`_StepTerms`): the personal models
    ``model`` (L, M, P) and APFL's weights ``alpha`` (L,), updated in place, and the
    surrogate's constants (those of the other kind unused)."""

    kind: str  #: "pfedme" | "apfl"
    model: torch.Tensor
    alpha: torch.Tensor | None = None
    lam: float = 0.0
    inner_steps: int = 0
    personal_lr: float = 0.0
    alpha_lr: float = 0.0


class ParamLayout:
    """Names, shapes and offsets of a model's parameters inside a flat vector."""

    def __init__(self, model: nn.Module):
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)

    def flatten(self, model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter views of ``flat`` (..., P), its last axis exactly P, -> {name: (...,
        *shape)} (one split, then a view each: a step's gradient call makes them, and on a
        GPU each dispatch is host time)."""
        parts = flat.split(self.sizes, -1)
        return {name: part.view(part.shape[:-1] + shape)  # (a 0-dim parameter too)
                for name, shape, part in zip(self.names, self.shapes, parts)}  # fmt: skip


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

    ``__call__(theta (L, M, P), x (L, B, *in)) -> logits (L, M, B, C)``. The ways, chosen at
    construction: the linear model's closed form, the model's own ``batched_forward(params,
    x)`` when it has one (layers written for a batch of weights, fastest), else nested ``vmap``
    over ``functional_call``; models vmap cannot handle (e.g. BatchNorm updating running
    statistics) fall back to a per-peer, per-component loop (at construction, or by
    :meth:`check` on a first tiny batch).
    """

    def __init__(
        self, model: nn.Module, layout: ParamLayout, batching: str = "auto",
        precision: str = "float32", cpu_kernels: bool = False,
        notice: Callable[[], None] | None = None,
    ):  # fmt: skip
        if batching not in ("auto", "vmap", "loop"):
            raise GossipError(f"runtime.batching must be auto, vmap or loop (got {batching!r})")
        if precision not in ("float32", "bf16"):
            raise GossipError(f"runtime.precision must be float32 or bf16 (got {precision!r})")
        self.model, self.layout, self.precision = model, layout, precision
        # auto on a linear model: logits and the loss gradient in closed form (loss_grad), a
        # handful of batched kernels per step instead of an autograd graph; vmap keeps autograd
        # (the plain path the fused one is tested against)
        self.closed_form = batching == "auto" and type(model) is Linear and precision == "float32"
        # on a CPU, the closed form's round, losses and scores as compiled loops (kernels.py)
        self.kernels = self.closed_form and cpu_kernels
        # on a GPU, the closed form's steps as one CUDA graph (runtime/graphs.py; the
        # trainer's runtime.cuda_graphs sets it)
        self.graphs: GraphReplay | None = None
        self._uploads: Uploads | None = None  # the fused round's uploads (linear_sgd_round)
        if self.kernels:
            try:  # numba loads only for these
                from gossip_pfl.runtime import kernels
            # a machine without numba (a lent GPU's), or one where it cannot load (no
            # writable cache folder): torch operations
            except (ImportError, RuntimeError, OSError):
                self.kernels = False
            else:
                self._kernels = kernels
                # loaded (or compiled) now, with the run's setup, as the plan's loops are: not
                # in its first round and evaluation (about 70 ms; 9 s without numba's cache,
                # when ``notice`` says so)
                self._notice = notice
                kernels.warm_up(kernels.COMMON, notice)

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
        """Why vmap cannot run this model ('' if it can) by its build (:meth:`check` then
        tries it on a tiny input)."""
        if any(True for _ in self.model.buffers()):
            return "the model has buffers (e.g. BatchNorm statistics) that vmap cannot update"
        return ""

    @property
    def thread_safe(self) -> bool:
        """Whether calls may run at once on several threads: the closed form and a model's own
        batched layers read only their arguments, while ``functional_call`` (vmap without
        them, the loop) swaps the one module's parameters for each call's."""
        return self.closed_form or (self.mode == "vmap" and self.native is not None)

    def piece_threads(self, device: torch.device) -> int:
        """How many independent pieces of calls run at once (``runtime/threads.py:
        map_pieces``): the run's torch threads on a CPU where calls may share this forward
        (:attr:`thread_safe`), else 1 (a GPU runs them in turn)."""
        at_once = device.type in PIECES_AT_ONCE_ON and self.thread_safe
        return torch.get_num_threads() if at_once else 1

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
        return self._in_precision(self._call, theta, x)

    def _in_precision(self, forward, params, x: torch.Tensor) -> torch.Tensor:
        """``forward(params, x)`` in the run's precision: bf16 autocasts it and gives the
        logits back in float32."""
        if self.precision == "bf16":
            # no cast cache (it saves only a parameter's second cast in one forward): a cache
            # kept past a CUDA graph's capture would hold the capture's memory
            with torch.autocast(x.device.type, dtype=torch.bfloat16, cache_enabled=False):
                return forward(params, x).float()
        return forward(params, x)

    @property
    def by_parameter(self) -> bool:
        """The forward is the model's own batched layers, which take each parameter as its
        own tensor (:meth:`forward_parameters`)."""
        return not self.closed_form and self.mode == "vmap" and self.native is not None

    def for_grad(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The logits of ``theta`` (L, M, P), detached, on ``x``, and the autograd leaves to
        take their gradient in: each parameter (:attr:`by_parameter`), else the stack itself.
        :meth:`flat_grad` lays the leaves' gradients out as theta."""
        if self.by_parameter:
            params = self.layout.unflatten(theta.detach())
            leaves = [v.requires_grad_(True) for v in params.values()]
            return self.forward_parameters(params, x), leaves
        leaf = theta.detach().requires_grad_(True)
        return self(leaf, x), [leaf]

    def flat_grad(self, parts: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradients of :meth:`for_grad`'s leaves as one (L, M, P) tensor, written into
        ``out`` when given, each in its place: one pass. (Not a ``cat`` of the flattened
        gradients: a linear layer's weight gradient comes transposed, so flattening copied
        it first, the CNN's 2.1 million of its 2.17 million parameters a model twice.)"""
        if not self.by_parameter:
            return parts[0] if out is None else out.copy_(parts[0])
        if out is None:
            out = parts[0].new_empty(*parts[0].shape[:2], self.layout.numel)
        for place, g in zip(self.layout.unflatten(out).values(), parts):
            place.copy_(g)
        return out

    def forward_parameters(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """:meth:`__call__` on ``params`` {name: (L, M, *shape)} (:attr:`by_parameter` only):
        autograd can then take each parameter's gradient as its own leaf. A leaf of the flat
        (L, M, P) stack with the parameters as its views costs, in the backward, a zero-filled
        full-size gradient per parameter, each summed into the next: on the FedEM CNN (eight
        parameters, 6.5 million values a peer) more memory traffic than the step."""
        return self._in_precision(self.native, params, x)

    def _call(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.closed_form:
            L, M = theta.shape[:2]
            return self._linear(theta, x).view(L, x.shape[1], M, -1).transpose(1, 2)
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

    def _linear(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits of the linear model as (L, B, M * C), a transposed view: the weights of every
        component times x^T in one batched product, the same product (and so the same
        rounding) as ``Linear.batched_forward``. x times the weights^T streams x faster (about
        2x on evaluation-sized inputs) but rounds differently: a test prediction on the
        boundary flips, and the synthetic table would move."""
        L, M, P = theta.shape
        x = x.flatten(2)
        i = x.shape[-1]
        c = P // (i + 1)
        w = theta[..., : c * i].reshape(L, M * c, i)  # a view for one output (binary)
        b = theta[..., c * i :].reshape(L, 1, M * c)
        return torch.bmm(w, x.transpose(1, 2)).transpose(1, 2) + b

    @torch.no_grad()
    def loss_grad(
        self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, sw: torch.Tensor,
        task: str, batch_size: int, need_loss: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Closed-form gradient of ``(sum_b sw_b * loss_b) / batch_size`` in theta (L, M, P),
        and that loss per peer (L,) (None unless ``need_loss``), for the linear model: the
        log-loss gradient in the logits is p - y, so dW = r^T x and db = sum_b r with
        r = (p - y) * sw / batch_size. The same numbers as autograd up to float rounding, in
        about ten batched kernels. x (L, B, *in), y (L, B), sw (L, M, B)."""
        L, M, P = theta.shape
        x = x.flatten(2)
        B, i = x.shape[1:]
        c = P // (i + 1)
        z = self._linear(theta, x)  # (L, B, M * c)
        swt = sw.transpose(1, 2) * (1.0 / batch_size)  # (L, B, M)
        if task == "binary":
            yf = y.to(z.dtype)[..., None]
            r = (torch.sigmoid(z) - yf) * swt  # (L, B, M)
        else:
            zc = z.view(L, B, M, c)
            onehot = F.one_hot(y, c).to(z.dtype)[:, :, None, :]
            r = ((torch.softmax(zc, -1) - onehot) * swt[..., None]).view(L, B, M * c)
        gw = torch.bmm(r.transpose(1, 2), x).view(L, M, c * i)
        grad = torch.cat([gw, r.sum(1).view(L, M, c)], -1)
        loss = None
        if need_loss:
            if task == "binary":
                per = F.binary_cross_entropy_with_logits(z, yf.expand_as(z), reduction="none")
                loss = (per * swt).sum((1, 2))
            else:
                per = -torch.log_softmax(zc, -1).gather(-1, y[:, :, None, None].expand(L, B, M, 1))
                loss = (per[..., 0] * swt).sum((1, 2))
        return grad, loss

    @torch.no_grad()
    def linear_sgd_round(
        self, theta: torch.Tensor, split, batches: tuple, neg_step: np.ndarray,
        q: torch.Tensor | PendingEStep | None, batch_size: int,
        affine: tuple[np.ndarray | None, torch.Tensor | None] | None = None,
        personal: PersonalSteps | None = None,
        losses: torch.Tensor | None = None,
        momentum: tuple[torch.Tensor | None, float, np.ndarray] | None = None,
    ) -> None:  # fmt: skip
        """A round of SGD on the binary linear model's log-loss, in place on theta
        (L, M, P = [W, b]). ``batches``: the round's plan over ``split``, (idx, weight) of
        :func:`gossip_pfl.runtime.data.round_batches` and, for the torch operations, its
        :class:`gossip_pfl.runtime.data.LinearHost`; ``neg_step`` (L,) each peer's -lr *
        factor * scale; ``q`` (L, M, N) the responsibilities (None: weight 1; a
        :class:`PendingEStep`: worked out in the loop, with :attr:`kernels`); the loss
        divides by ``batch_size``. On a CPU with :attr:`kernels`, a compiled loop per peer
        (:func:`gossip_pfl.runtime.kernels.sgd_round`); else :meth:`_linear_sgd_steps`, on a
        GPU with ``runtime.cuda_graphs`` replayed as a CUDA graph per shape. ``affine``:
        each step's added terms times -lr, (L, 2) FedProx's proximal term's and weight
        decay's coefficients or None, and (L, M, P) SCAFFOLD's correction on theta's device
        or None (the kernel's ``affine`` and ``shift``); None: plain SGD. ``momentum``: SGD's
        velocity (L, M, P) on theta's device, updated in place (None: no momentum, the torch
        operations' kept losses), the momentum, and (L,) each peer's -lr * factor * scale;
        then ``neg_step`` and ``affine`` are in the gradient's units (``neg_step`` 1 for
        every peer, the terms' own coefficients), and -lr is applied after. ``personal``
        (``q`` None; in torch operations with ``momentum``): each step is pFedMe's or APFL's
        (:func:`gossip_pfl.runtime.kernels.personal_round`). ``losses`` (L,) float64 (not
        with ``personal``; in torch operations with ``momentum``): each peer that steps
        keeps its last step's objective there, sum_b w_b q_bm log-loss(z_bm) / max(sum_b w_b,
        1) at the step's starting theta (FedLi's)."""
        idx, weight, *host = batches
        if (losses is not None or personal is not None) and not self.kernels and momentum is None:
            raise RuntimeError("the torch operations keep losses and take personal steps in "
                               "the gradient's units")  # fmt: skip
        if personal is not None and losses is not None:
            raise RuntimeError("the personal steps keep no losses")
        if personal is not None and self.kernels:
            self._personal_round(theta, split, idx, weight, neg_step, batch_size, affine,
                                 personal, momentum)  # fmt: skip
            return
        if self.kernels:
            none = np.zeros((0, 0), np.float32)
            pi, eps, new_pi = none, np.float32(0), none
            if isinstance(q, PendingEStep):
                pi, eps = q.old_pi.float().contiguous().numpy(), np.float32(q.smoothing)
                new_pi, q = q.pi.numpy(), q.q
            self._compiled("sgd_round", split, theta.numpy(), *self._plan_args(split, idx, weight),
                           neg_step * np.float32(1.0 / batch_size), _q_arg(q), pi, eps, new_pi,
                           *_affine_args(affine),
                           np.zeros(0) if losses is None else losses.numpy(),
                           *_momentum_args(momentum))  # fmt: skip
            return
        if isinstance(q, PendingEStep):
            raise RuntimeError("a pending E-step needs the compiled CPU loops (kernels)")
        host = host[0]
        if self._uploads is None or self._uploads.device != theta.device:
            self._uploads = Uploads(theta.device)  # page-locked buffers kept across rounds
        uploads = linear_uploads(host, split, neg_step, self._uploads)
        if uploads is None:  # no peer takes a step
            return
        # a graph's inputs (copied in at each replay), by name: the plan, q, the terms
        named = {"floats": uploads[0], "ints": uploads[1], "q": q,
                 **self._term_inputs(affine, momentum)}  # fmt: skip
        names = tuple(k for k, v in named.items() if v is not None)
        inputs = tuple(named[k] for k in names)
        velocity, mu = (None, None) if momentum is None else momentum[:2]

        def steps(*tensors, shared_buffer=True) -> None:
            given = dict(zip(names, tensors))
            terms = None
            if affine is not None or momentum is not None:
                terms = _StepTerms(theta, given, velocity, mu, losses, batch_size, personal)
            plan = linear_plan(host.sizes, split, given["floats"], given["ints"], given.get("q"),
                               keep=terms is not None)  # fmt: skip
            self._linear_sgd_steps(theta, split.augmented, plan, shared_buffer, terms)

        # a graph for the GPU layout's steps (every peer in each: views, no scatter-adds;
        # simulated on a CPU in tests and benchmarks/bench_ops.py --gpu-layout)
        graphed = self.graphs is not None and (theta.is_cuda or self.graphs.simulate)
        if graphed and min(host.sizes) == len(theta):
            split.device_offsets, split.neg_labels  # noqa: B018 - made before, not in, a graph
            key = (tuple(host.sizes), names, tuple(t.shape for t in inputs))
            mine = (velocity, losses, *((personal.model, personal.alpha) if personal else ()))
            places = (theta, split.augmented, *(t for t in mine if t is not None))
            self.graphs(key, partial(steps, shared_buffer=False), *inputs,
                        places=places)  # fmt: skip
        else:
            steps(*inputs)

    @torch.no_grad()
    def linear_armijo_round(
        self, theta: torch.Tensor, split, batches: tuple, q: torch.Tensor | None,
        batch_size: int, solver, eta: torch.Tensor, losses: torch.Tensor,
        batches_per_epoch: np.ndarray,
    ) -> None:  # fmt: skip
        """A round of ``solver``'s line search (:class:`gossip_pfl.runtime.solver.
        LocalArmijo`) on the binary linear model as one compiled call
        (:func:`gossip_pfl.runtime.kernels.armijo_round`, :attr:`kernels` only), in place on
        theta, the step sizes ``eta`` and the kept objectives ``losses`` (L,) float64; the
        plan ``batches`` and ``q`` as in :meth:`linear_sgd_round`."""
        if not self.kernels:
            raise RuntimeError("the line search's round needs the compiled loops")
        k = self._kernels
        idx, weight = batches[:2]
        reset = {"grow": k.RESET_GROW, "keep": k.RESET_KEEP, "max": k.RESET_MAX}[solver.reset]
        self._compiled("armijo_round", split, theta.numpy(), *self._plan_args(split, idx, weight),
                       _q_arg(q), eta.numpy(), losses.numpy(), batches_per_epoch, batch_size,
                       float(solver.weight_decay), float(solver.prox_mu), float(solver.c),
                       float(solver.beta), float(solver.eta_max), int(solver.max_trials),
                       reset)  # fmt: skip

    def _personal_round(self, theta, split, idx, weight, neg_step, batch_size, affine,
                        personal: PersonalSteps, momentum) -> None:  # fmt: skip
        """:meth:`linear_sgd_round`'s compiled loop with pFedMe's or APFL's steps."""
        k, f32 = self._kernels, np.float32
        alpha = np.zeros(0, f32) if personal.alpha is None else personal.alpha.numpy()
        kind = {"pfedme": k.PFEDME, "apfl": k.APFL}[personal.kind]
        self._compiled("personal_round", split, theta.numpy(),
                       *self._plan_args(split, idx, weight), neg_step, *_affine_args(affine),
                       personal.model.numpy(), alpha, kind, f32(1.0 / batch_size),
                       f32(personal.lam), personal.inner_steps, f32(personal.personal_lr),
                       f32(personal.alpha_lr), *_momentum_args(momentum))  # fmt: skip

    @staticmethod
    def _plan_args(split, idx: np.ndarray, weight: np.ndarray) -> tuple:
        """The compiled round's samples and plan (peer axis first)."""
        return (split.augmented.numpy(), split.offsets, split.host_counts, split.host_y,
                idx.transpose(1, 0, 2), weight.transpose(1, 0, 2))  # fmt: skip

    def warm_up(self, *names: str) -> None:
        """Load (or compile) the compiled loops ``names`` beside :data:`kernels.COMMON`
        (with the compiled loops only)."""
        if self.kernels:
            self._kernels.warm_up(names, self._notice)

    def _compiled(self, name: str, split, *args) -> None:
        """The compiled loop ``name`` of :mod:`gossip_pfl.runtime.kernels` over ``split``'s
        peers, on the run's torch threads."""
        k = self._kernels
        k.run(getattr(k, name), torch.get_num_threads(), split.host_counts, *args)

    def _term_inputs(self, affine, momentum) -> dict:
        """The device tensors of a fused torch round's added terms (:class:`_StepTerms`),
        by name; a term whose coefficients are all 0 is left out."""
        coef, shift = affine if affine is not None else (None, None)
        out = {}
        if coef is not None:
            for k, name in enumerate(("prox", "decay")):
                if coef[:, k].any():
                    out[name] = self._uploads(name, np.ascontiguousarray(coef[:, k]))
        out["shift"] = shift
        if momentum is not None:
            out["neg_lr"] = self._uploads("neg_lr", momentum[2])
        return out

    def _linear_sgd_steps(
        self, theta: torch.Tensor, inputs: torch.Tensor, plan, shared_buffer: bool = True,
        terms: _StepTerms | None = None,
    ) -> None:  # fmt: skip
        """The torch form of :meth:`linear_sgd_round`, for a
        :class:`gossip_pfl.runtime.data.LinearRound` plan over ``inputs`` (the split's
        :attr:`augmented` samples, a ones column last). A step is six
        operations: gather the batch, z = x theta^T (the bias through the ones column; x
        theta^T rather than theta x^T: 1.5x faster on a CPU), sigmoid, r = (sigmoid(z) - y) *
        coef (one addcmul: coef holds -step * q * weight / B), r^T (a view), theta += r^T x
        (one baddbmm: the weights' and the bias' update at once). The same numbers as the
        autograd path up to float rounding (tests/test_speed.py).

        The batches are gathered into one buffer kept across rounds, through views made once
        per step shape: a fresh buffer is fresh pages from the kernel every round (at 10,000
        peers 770 MB, and the page faults made the gather 4x slower than the copy). Without
        ``shared_buffer`` (a CUDA graph's capture) the buffer is this call's own: a graph
        holds it in its memory, where the shared one may be replaced by a larger one."""
        width = inputs.shape[1]
        need = max((p.numel() for p in plan.pos), default=0) * width
        if shared_buffer:
            buf = self.__dict__.get("_gather")
            if buf is None or buf.numel() < need or buf.device != inputs.device:
                buf = self._gather = inputs.new_empty(need)
                self._gather_views = {}
            views = self._gather_views
        else:
            buf, views = inputs.new_empty(need), {}
        theta_t = theta.mT  # (L, P, M)
        for k, (rows, pos, coef, ycoef) in enumerate(
            zip(plan.rows, plan.pos, plan.coef, plan.ycoef)
        ):
            shape = coef.shape[:2]  # (A, B)
            if shape not in views:
                flat = buf[: pos.numel() * width].view(pos.numel(), width)
                views[shape] = flat, flat.view(*shape, width)
            flat, x = views[shape]
            torch.index_select(inputs, 0, pos, out=flat)  # x: (A, B, P)
            # (A, M, P) rows, then the view: bmm is 3.5x faster on it than on the contiguous
            # (A, P, M) that index_select makes of theta_t
            th_t = theta_t if rows is None else theta.index_select(0, rows).mT
            if terms is not None:  # (momentum, FedProx's, weight decay, SCAFFOLD's, FedLi's,
                # pFedMe's, APFL's)

                def grad_at(w, logits=None, x=x, coef=coef, ycoef=ycoef) -> torch.Tensor:
                    z = torch.bmm(x, w.mT)  # (A, B, M)
                    if logits is not None:
                        logits(z)
                    r = torch.addcmul(ycoef, z.sigmoid_(), coef).mT  # (A, M, B)
                    return torch.bmm(r, x)

                terms.step(theta, rows, th_t.mT, grad_at, plan, k)
                continue
            r = torch.bmm(x, th_t).sigmoid_()  # (A, B, M)
            r = torch.addcmul(ycoef, r, coef).mT  # (A, M, B)
            if rows is None:
                theta.baddbmm_(r, x)
            else:
                theta.index_add_(0, rows, torch.bmm(r, x))

    @torch.no_grad()
    def linear_losses(self, theta: torch.Tensor, split, budget: int) -> torch.Tensor:
        """Every sample's log-loss under every component (L, M, N_max), 0 on padding, for the
        binary linear model: per piece of the split one product and one loss kernel, the
        inputs and targets cached (the train losses of the E-step, every round)."""
        L, M, P = theta.shape
        out = torch.zeros(L, M, split.y.shape[1], device=theta.device, dtype=theta.dtype)
        if self.kernels:
            self._compiled("bce_losses", split, theta.contiguous().numpy(),
                           split.augmented.numpy(), split.offsets, split.host_counts,
                           split.host_y, out.numpy())  # fmt: skip
            return out
        for rows, sl, z, tgt, _ in self._linear_logits(theta, split, budget):
            loss = F.binary_cross_entropy_with_logits(z, tgt, reduction="none")
            if rows is None:
                out[:, :, sl] = loss
            else:
                out[:, :, sl].index_copy_(0, rows, loss)
        return out

    @torch.no_grad()
    def linear_mixture_scores(
        self, theta: torch.Tensor, pi: torch.Tensor, split, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-peer summed log-loss and number correct (L,) float64 of the mixture prediction
        p = sum_m pi_m sigmoid(z_m) of the binary linear model on ``split``: the general
        path's numbers (surrogate.predict on the forward) without its (L, M, N, 2)
        probabilities, stacks and argmax; the class-0 probability is 1 - p (the general
        path sums pi_m (1 - sigmoid(z_m))), equal up to float rounding."""
        L = theta.shape[0]
        nll = torch.zeros(L, device=theta.device, dtype=torch.float64)
        correct = torch.zeros_like(nll)
        if self.kernels:
            self._compiled("mixture_scores", split, theta.contiguous().numpy(),
                           pi.float().contiguous().numpy(), split.x.flatten(2).numpy(),
                           split.host_y, split.host_counts, nll.numpy(),
                           correct.numpy())  # fmt: skip
            return nll, correct
        for rows, _, z, tgt, mask in self._linear_logits(theta, split, budget):
            w = pi if rows is None else pi.index_select(0, rows)
            p1 = torch.bmm(w.to(z.dtype)[:, None, :], z.sigmoid_())[:, 0]  # (A, width)
            y1 = tgt[:, 0] > 0.5
            p_true = torch.where(y1, p1, 1 - p1).clamp_min_(1e-12)
            loss = (p_true.log_().neg_() * mask).sum(-1).double()
            hit = (((p1 > 0.5) == y1) * mask).sum(-1).double()  # argmax of (1 - p, p)
            if rows is None:
                nll += loss
                correct += hit
            else:
                nll.index_add_(0, rows, loss)
                correct.index_add_(0, rows, hit)
        return nll, correct

    def _linear_logits(self, theta: torch.Tensor, split, budget: int):
        """Yield (rows, sample slice, logits (A, M, width), float targets, mask) per cached
        piece of ``split``. x times w^T, then + b: about 2x faster on a CPU than w times x^T
        (the forward's product, :meth:`_linear`; it streams x once), and rounded
        differently: the synthetic table's accuracies do not move (docs/speed-notes.md)."""
        P = theta.shape[-1]
        for rows, sl, xt, tgt, mask in split.linear_pieces(budget, theta.shape[1]):
            th = theta if rows is None else theta.index_select(0, rows)
            w, b = th.split([P - 1, 1], -1)
            yield rows, sl, torch.bmm(xt.mT, w.mT).mT.add_(b), tgt, mask

    def describe(self) -> str:
        return self._describe() + (", bf16 autocast" if self.precision == "bf16" else "")

    def _describe(self) -> str:
        if self.closed_form:
            how = "compiled CPU loops" if self.kernels else "closed-form step"
            how += ", its steps in a CUDA graph" if self.graphs is not None else ""
            return f"batched over peers and components (the model's batched layers, {how})"
        if self.mode == "vmap":
            how = "the model's batched layers" if self.native else "vmap"
            return f"batched over peers and components ({how})"
        return f"per-peer loop ({self.reason or 'requested'})"


def _q_arg(q: torch.Tensor | None) -> np.ndarray:
    """The compiled round's responsibilities (L, M, N) (empty: weight 1)."""
    return np.zeros((0, 0, 0), np.float32) if q is None else q.contiguous().numpy()


def _affine_args(
    affine: tuple[np.ndarray | None, torch.Tensor | None] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The compiled round's ``affine`` and ``shift`` (empty: none)."""
    coef, shift = affine if affine is not None else (None, None)
    coef = np.zeros((0, 2), np.float32) if coef is None else coef
    shift = np.zeros((0, 0, 0), np.float32) if shift is None else shift.contiguous().numpy()
    return coef, shift


def _momentum_args(momentum: tuple[torch.Tensor, float, np.ndarray] | None) -> tuple:
    """The compiled round's ``velocity`` and ``heavy`` (empty: no momentum)."""
    if momentum is None:
        return np.zeros((0, 0, 0), np.float32), np.zeros((0, 2), np.float32)
    velocity, mu, neg = momentum
    if velocity is None:  # (the kernels keep losses at -lr's weights)
        raise RuntimeError("the compiled loops take the gradient's units with momentum only")
    return velocity.numpy(), np.stack([np.full_like(neg, mu), neg], axis=1)


class _StepTerms:
    """The terms a fused round's torch steps add to the loss's part (:meth:`BatchedForward.
    _linear_sgd_steps`), on theta's device: FedProx's proximal term and weight decay (each
    peer's coefficient, times -lr without momentum), SCAFFOLD's correction, and momentum
    (the velocity, updated in place, and each peer's -lr), as :class:`gossip_pfl.runtime.
    solver.LocalSGD` takes them, up to float rounding; and FedLi-LU's kept losses
    (``losses`` (L,) float64, written in place). ``given``: the round's tensors by name
    (``prox``, ``decay``, ``shift``, ``neg_lr``: with it a step is in the gradient's units,
    -lr applied last); the proximal term's anchor is theta as this call finds it (the round's
    start). A step of every peer (``rows`` None: a GPU's dense layout holds those past their
    epoch too, with weight 0) leaves the peers without a sample in it as they are, velocity
    and kept loss included, as the solver does."""

    def __init__(
        self, theta: torch.Tensor, given: dict, velocity, mu, losses=None, batch_size: int = 1,
        personal: PersonalSteps | None = None,
    ) -> None:  # fmt: skip
        self.prox, self.decay = given.get("prox"), given.get("decay")
        self.shift, self.neg_lr = given.get("shift"), given.get("neg_lr")
        self.start = theta.clone() if self.prox is not None else None
        self.velocity, self.mu, self.losses = velocity, mu, losses
        self.inv_b = 1.0 / batch_size
        self.personal = personal

    def step(self, theta: torch.Tensor, rows, th: torch.Tensor, grad_at, plan, k: int) -> None:
        """Step ``k`` of ``plan`` on theta[rows] (None: every peer), ``th`` (A, M, P) their
        rows: ``grad_at(w, logits)`` is the loss's gradient at w (A, M, P) over the step's
        batch (in the plan's units), ``logits(z)`` called with its logits first."""
        # (a step of some peers holds only those with samples in it)
        active = None if rows is not None else plan.weight[k].ne(0).any(1)
        if self.personal is not None:
            g = self._personal_step(rows, th, grad_at, active)
        elif self.losses is not None:  # (FedLi-LU's objective, from the logits)
            g = grad_at(th, lambda z: self._keep_loss(rows, z, plan.neg_y[k], plan.coef[k],
                                                      plan.weight[k], active))  # fmt: skip
        else:
            g = grad_at(th)
        self._add(theta, rows, th, g, active)

    def _personal_step(self, rows, th, grad_at, active) -> torch.Tensor:
        """pFedMe's or APFL's step of the personal models (and APFL's weights), in place,
        as :mod:`gossip_pfl.algorithms.personal` takes it; returns the shared model's
        gradient."""
        ps = self.personal
        v = _take(ps.model, rows)
        if ps.kind == "pfedme":
            w = v
            for _ in range(ps.inner_steps):  # the prox, approximately
                w = w - ps.personal_lr * (grad_at(w) + ps.lam * (w - th))
            new_v, g = w, ps.lam * (th - w)
        else:  # APFL: v and alpha descend the mixed model's loss (each read before written)
            a = _take(ps.alpha, rows)[:, None, None]
            g_mixed = grad_at(a * v + (1 - a) * th)
            g_alpha = ((v - th) * g_mixed).sum(dim=(1, 2))
            new_v = v - ps.personal_lr * a * g_mixed
            new_a = (a[:, 0, 0] - ps.alpha_lr * g_alpha).clamp(0.0, 1.0)
            _put(ps.alpha, rows, new_a, active)
            g = grad_at(th)
        _put(ps.model, rows, new_v, active)
        return g

    def _keep_loss(self, rows, z, neg_y, coef, weight, active) -> None:
        """The step's objective into ``losses[rows]``: z (A, B, M) the logits at the step's
        start, ``neg_y`` (A, B) -y, ``coef`` (A, B, M | 1) q w / B, ``weight`` (A, B) w / B
        (B the nominal batch size)."""
        log_loss = F.softplus(z).addcmul_(neg_y[:, :, None], z)  # log(1 + e^z) - y z
        mean = (coef * log_loss).sum((1, 2)) / weight.sum(1).clamp_min(self.inv_b)
        _put(self.losses, rows, mean.to(self.losses.dtype), active)

    def _add(self, theta: torch.Tensor, rows, th: torch.Tensor, g: torch.Tensor,
             active) -> None:  # fmt: skip
        """theta[rows] (``th``, as the step starts) takes its step, ``g`` (A, M, P) the
        loss's part of it (times -lr, or in the gradient's units), overwritten; ``active``
        (A,): the peers that step (None: all)."""
        d = g
        if self.prox is not None:
            d.addcmul_(th - _take(self.start, rows), _take(self.prox, rows)[:, None, None])
        if self.decay is not None:
            d.addcmul_(th, _take(self.decay, rows)[:, None, None])
        if self.shift is not None:
            d.add_(_take(self.shift, rows))
        if self.velocity is not None:  # v = momentum v + d; theta += -lr v
            v = _take(self.velocity, rows) * self.mu + d
            _put(self.velocity, rows, v, active)  # (the others' velocity as it is)
            d = torch.mul(v, _take(self.neg_lr, rows)[:, None, None], out=d)
        elif self.neg_lr is not None:
            d.mul_(_take(self.neg_lr, rows)[:, None, None])
        if active is not None:
            d = torch.where(active[:, None, None], d, 0.0)
        if rows is None:
            theta.add_(d)
        else:
            theta.index_add_(0, rows, d)


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``t``'s rows ``rows`` (None: ``t`` itself, every peer's)."""
    return t if rows is None else t.index_select(0, rows)


def _put(held: torch.Tensor, rows, new: torch.Tensor, active) -> None:
    """``held[rows] = new`` (in place) for the peers that step (``active``; None: all)."""
    if rows is not None:
        held.index_copy_(0, rows, new)
    else:
        on = active.view(-1, *([1] * (new.dim() - 1)))
        held.copy_(torch.where(on, new, held))

"""Aggregation rules: what a hub (or, in gossip form, each peer) does with what it receives.

A rule is an optax-style pair with explicit state::

    state = rule.init(theta)                          # theta (R, M, P)
    theta, state = rule.update(inbox, state, theta)   # one round

``R`` is 1 on the server schedule (the hub's model and state) and L, a rank's peers, on a gossip
schedule: the same code is the hub rule and its gossip form. ``theta`` is the model each row held
when the round began (the hub's w_t; a peer's own model); ``inbox.mean`` holds, per row, the
weighted average of every message kind its senders sent (the participants on the star; the
neighbours through W_t in gossip), so the pseudo-gradient is ``theta - inbox.mean["theta"]``.

Rules read per-client scalars by name (``scalars``) and may carry parameter-shaped tensors
(``tensors``) beside theta both ways: clients send one (SCAFFOLD: the change of their control
variate), the hub sends back its state of the same name. A client part
(``Rule.client_part()``) changes the local steps and computes those messages.

Rules (Reddi et al. 2021, "Adaptive Federated Optimization"; Jhunjhunwala et al. 2023,
"FedExP"; Geetika, Uniyal, Chatterjee, "Towards hyper-parameter-free federated learning";
Karimireddy et al. 2020, "SCAFFOLD"; Sattler et al. 2020, "Clustered Federated Learning").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from gossip_pfl.algorithms import RULE_NAMES
from gossip_pfl.errors import GossipError

State = dict[str, torch.Tensor]


@dataclass
class Inbox:
    """What a rule receives in one round."""

    mean: dict[str, torch.Tensor]  #: kind -> per-row weighted average ((R, M, P) or (R,))
    #: hub only: each participant's scalars, kind -> (S,)
    clients: dict[str, torch.Tensor] = field(default_factory=dict)
    #: hub only: the participants' share of the total aggregation weight (1 on full rounds)
    mass: float = 1.0


def _norm2(x: torch.Tensor) -> torch.Tensor:
    """Per-row squared norm over every component and coordinate, in float64: (R,)."""
    return x.double().flatten(1).pow(2).sum(1)


def _rows(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row scalar (R,) broadcast against (R, M, P), in ``like``'s dtype."""
    return v.to(like.dtype)[:, None, None]


class Rule:
    """What the runtime reads of a rule besides ``init`` and ``update``; each rule overrides
    what differs (class attributes: the options are the dataclass fields)."""

    name: ClassVar[str]
    gossip: ClassVar[bool] = False  #: the same update works per peer on a gossip schedule
    scalars: ClassVar[tuple[str, ...]] = ()  #: per-client scalars it reads (their mean)
    tensors: ClassVar[tuple[str, ...]] = ()  #: parameter-shaped tensors carried both ways
    needs_theta: ClassVar[bool] = True  #: reads the round-start model (a copy is kept)
    per_client: ClassVar[tuple[str, ...]] = ()  #: scalars the hub reads client by client
    client_solver: ClassVar[str] = "sgd"  #: the clients' local solver: sgd | armijo

    def client_part(self):
        """The client side it needs beyond plain local steps (None for most)."""
        return None


@dataclass(frozen=True)
class Average(Rule):
    """FedAvg's weighted average (and decentralized SGD's W_t mix): theta <- the average."""

    name = "average"
    gossip = True
    needs_theta = False  # the round-start model is not read: no copy is kept

    def init(self, theta: torch.Tensor) -> State:
        return {}

    def update(self, inbox: Inbox, state: State, theta) -> tuple[torch.Tensor, State]:
        return inbox.mean["theta"], state


@dataclass(frozen=True)
class ServerOpt(Rule):
    """A server optimizer on the pseudo-gradient d = theta - mean(theta_i) (Reddi et al. 2021,
    Algorithm 2, in descent form):

    - ``sgd``: theta - lr d (FedAvg for lr = 1);
    - ``momentum`` (FedAvgM): m = beta1 m + d; theta - lr m;
    - ``adam``: m = beta1 m + (1 - beta1) d, v = beta2 v + (1 - beta2) d^2;
    - ``yogi``: v = v - (1 - beta2) d^2 sign(v - d^2);
    - ``adagrad``: v = v + d^2;
      the adaptive three step theta - lr m / (sqrt(v) + tau), v starting at tau^2, no bias
      correction (as the paper).
    """

    kind: str = "adam"
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    @property
    def name(self) -> str:
        return {"sgd": "server_sgd", "momentum": "fedavgm"}.get(self.kind, "fed" + self.kind)

    def init(self, theta: torch.Tensor) -> State:
        if self.kind == "sgd":
            return {}
        state = {"m": torch.zeros_like(theta)}
        if self.kind != "momentum":
            state["v"] = torch.full_like(theta, self.tau**2)
        return state

    def update(self, inbox: Inbox, state: State, theta) -> tuple[torch.Tensor, State]:
        d = theta - inbox.mean["theta"]
        if self.kind == "sgd":
            return theta - self.lr * d, state
        if self.kind == "momentum":
            m = self.beta1 * state["m"] + d
            return theta - self.lr * m, {"m": m}
        m = self.beta1 * state["m"] + (1 - self.beta1) * d
        d2, v = d * d, state["v"]
        if self.kind == "adam":
            v = self.beta2 * v + (1 - self.beta2) * d2
        elif self.kind == "yogi":
            v = v - (1 - self.beta2) * d2 * torch.sign(v - d2)
        else:  # adagrad
            v = v + d2
        return theta - self.lr * m / (v.sqrt() + self.tau), {"m": m, "v": v}


@dataclass(frozen=True)
class FedExP(Rule):
    """FedExP (Jhunjhunwala et al. 2023): extrapolate along the average update,
    ``eta_g = max(1, mean ||Delta_i||^2 / (2 (||Delta||^2 + eps)))``, ``theta - eta_g Delta``.
    Means are over the senders with the aggregation weights (the paper's 1/S for uniform
    weights). Gossip form (new): a peer uses its neighbours' W_t-weighted means."""

    eps: float = 1e-3
    name = "fedexp"
    gossip = True
    scalars = ("sq_delta",)

    def step_size(self, inbox: Inbox, theta: torch.Tensor) -> torch.Tensor:
        d2 = _norm2(theta - inbox.mean["theta"])
        ratio = inbox.mean["sq_delta"].double() / (2 * (d2 + self.eps))
        return ratio.clamp_min(1.0)

    def update(self, inbox: Inbox, state: State, theta) -> tuple[torch.Tensor, State]:
        eta = self.step_size(inbox, theta)
        return theta - _rows(eta, theta) * (theta - inbox.mean["theta"]), {"eta_g": eta}

    def init(self, theta: torch.Tensor) -> State:
        return {"eta_g": torch.ones(theta.shape[0], dtype=torch.float64, device=theta.device)}


@dataclass(frozen=True)
class FedLiLU(Rule):
    """FedLi-LU's server step (Algorithm 2, eq. 21 in the intended form of the digest):
    ``r = lam theta``, ``gamma = clip((f - eta <Delta, r>) / (eta ||Delta||^2), 0, 1)``,
    ``theta - eta (r + gamma Delta)`` with f the weighted mean of the clients' last losses.
    With lam = 0 the step along Delta is min(eta, f / ||Delta||^2): a capped Polyak step.
    No step along Delta when ||Delta|| = 0. Gossip form (new): per peer, over neighbours."""

    lam: float = 0.0
    eta: float = 1.0
    name = "fedli_lu"
    gossip = True
    scalars = ("loss",)

    def init(self, theta: torch.Tensor) -> State:
        return {"gamma": torch.zeros(theta.shape[0], dtype=torch.float64, device=theta.device)}

    def update(self, inbox: Inbox, state: State, theta) -> tuple[torch.Tensor, State]:
        d = theta - inbox.mean["theta"]
        r = self.lam * theta
        d2 = _norm2(d)
        inner = (d.double() * r.double()).flatten(1).sum(1)
        f = inbox.mean["loss"].double()
        gamma = (f - self.eta * inner) / (self.eta * d2.clamp_min(1e-300))
        gamma = torch.where(d2 > 0, gamma.clamp(0.0, 1.0), torch.zeros_like(gamma))
        return theta - self.eta * (r + _rows(gamma, theta) * d), {"gamma": gamma}


@dataclass(frozen=True)
class FedLiLS(Rule):
    """FedLi-LS's server step after clients' Armijo line searches: theta - s Delta with s = 1
    (``step: one``, the paper's choice for all its runs: the weighted average) or
    s = max_i eta_i over the participants (``step: max``, its non-convex heuristic)."""

    step: str = "one"
    name = "fedli_ls"
    client_solver = "armijo"  # its clients search their step (runtime.solver.LocalArmijo)
    scalars = ("eta",)

    @property
    def gossip(self) -> bool:  # max over clients needs the hub's view of every participant
        return self.step == "one"

    @property
    def per_client(self) -> tuple[str, ...]:  # the max over the participants' step sizes
        return ("eta",) if self.step == "max" else ()

    def init(self, theta: torch.Tensor) -> State:
        return {"step": torch.ones(theta.shape[0], dtype=torch.float64, device=theta.device)}

    def update(self, inbox: Inbox, state: State, theta) -> tuple[torch.Tensor, State]:
        if self.step == "one":
            return inbox.mean["theta"], state
        s = inbox.clients["eta"].double().max().expand(theta.shape[0])
        return theta - _rows(s, theta) * (theta - inbox.mean["theta"]), {"step": s}


@dataclass(frozen=True)
class Scaffold(Rule):
    """SCAFFOLD's server (option II): theta + lr (mean theta_i - theta); the hub's control
    variate c <- c + mass * mean(delta c_i), mass the participants' share of the aggregation
    weight (|S| / N for uniform weights), so c stays the weighted mean of the clients' c_i."""

    lr: float = 1.0
    name = "scaffold"
    tensors = ("control",)

    def client_part(self) -> ScaffoldClient:
        return ScaffoldClient()

    def init(self, theta: torch.Tensor) -> State:
        return {"control": torch.zeros_like(theta)}

    def update(self, inbox: Inbox, state: State, theta) -> tuple[torch.Tensor, State]:
        new = theta + self.lr * (inbox.mean["theta"] - theta)
        return new, {"control": state["control"] + inbox.mass * inbox.mean["control"]}


class ScaffoldClient:
    """SCAFFOLD's client part: local gradients corrected by c - c_i; after K_i local steps of
    size lr_i, c_i+ = c_i - c + (x - y) / (K_i lr_i) (option II), and the message carries
    delta c_i = c_i+ - c_i."""

    def init(self, theta: torch.Tensor) -> State:
        """Per-client state for L peers: own c_i and the last c received from the hub."""
        return {"c_i": torch.zeros_like(theta), "c": torch.zeros_like(theta)}

    def correction(self, state: State, rows) -> torch.Tensor:
        return state["c"][rows] - state["c_i"][rows]

    def finish(self, state, start, theta, steps, lr, active) -> tuple[dict, State]:
        """``steps`` (L,) local steps taken, ``lr`` (L,) their step size; returns the
        message tensors and the new state (only active clients change)."""
        k = (steps * lr).clamp_min(1e-30).to(theta.dtype)[:, None, None]
        new_ci = state["c_i"] - state["c"] + (start - theta) / k
        act = active[:, None, None]
        new_ci = torch.where(act, new_ci, state["c_i"])
        return {"control": new_ci - state["c_i"]}, {**state, "c_i": new_ci}

    def receive(self, state: State, parts: dict[str, torch.Tensor]) -> State:
        return {**state, "c": parts["control"].clone()}


#: each rule's server step size when ``rule.lr`` is not set
DEFAULT_LR = {"server_sgd": 1.0, "fedavgm": 1.0, "fedadam": 0.01, "fedyogi": 0.01,
              "fedadagrad": 0.01, "scaffold": 1.0}  # fmt: skip


#: the per-client scalars the clients send (gossip_pfl.train.Trainer.client_messages)
CLIENT_SCALARS = ("loss", "eta", "sq_delta")


def check_rule(rule: Rule) -> Rule:
    """``rule``, when the messages it declares are ones the runtime sends (a new scalar name
    was a KeyError deep in the bundle)."""
    for name in rule.scalars:
        if name not in CLIENT_SCALARS:
            raise GossipError(f"rule {rule.name!r} reads the per-client scalar {name!r}; the "
                              f"clients send {', '.join(CLIENT_SCALARS)} (a new one is computed "
                              "in gossip_pfl.train.Trainer.client_messages)")  # fmt: skip
    sent = ("theta", *rule.scalars, *rule.tensors)
    for name in rule.per_client:
        if name not in sent:
            raise GossipError(f"rule {rule.name!r} reads {name!r} client by client "
                              f"(per_client), but only {', '.join(sent)} travel")  # fmt: skip
    return rule


def gossip_rules(opts, n_peers: int) -> list[str]:
    """The names of the rules with a gossip form under the options ``opts``."""
    return [name for name in RULE_NAMES if build_rule(name, opts, n_peers).gossip]


def build_rule(name: str, opts, n_peers: int):
    """A rule from its name and the config's ``rule`` section."""
    lr = opts.lr if opts.lr is not None else DEFAULT_LR.get(name, 1.0)
    if name == "average":
        return Average()
    if name in ("server_sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        kind = {"server_sgd": "sgd", "fedavgm": "momentum"}.get(name, name[3:])
        beta1 = opts.momentum if name == "fedavgm" else opts.beta1
        return ServerOpt(kind, lr, beta1, opts.beta2, opts.tau)
    if name == "fedexp":
        return FedExP(opts.eps)
    if name == "fedli_lu":
        return FedLiLU(opts.lam, opts.eta)
    if name == "fedli_ls":
        return FedLiLS(opts.step)
    if name == "scaffold":
        return Scaffold(lr)
    if name == "clustered":
        from gossip_pfl.algorithms.clustered import ClusteredRule

        return ClusteredRule(n_peers, opts.tol1, opts.tol2)
    raise GossipError(f"unknown rule.name {name!r}; known: {', '.join(RULE_NAMES)}")

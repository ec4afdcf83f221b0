"""FedEM, the naive baseline and VR-FedEM on a star, over all clients' statistics at once.

Dieuleveut, Fort, Moulines, Robin, "Federated Expectation Maximization with heterogeneity
mitigation and variance reduction" (NeurIPS 2021). Single process, no runtime: every function
takes the hub's state and the clients' statistics as tensors with a leading client axis and
returns the new state and a dict of diagnostics, so a hub rule can call them. Only the hub
computes T; the statistics S it keeps are projected into T's domain after every step (the count
is reported).

Split for the runtime: a worker needs theta_k = T(S_k) (broadcast) and returns
Quant(Delta_i); the hub needs the sum of the received Quant(Delta_i). :func:`fedem_hub_update`
and :func:`worker_message` are those two halves; :func:`fedem_round` runs both in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gossip_pfl.errors import GossipError
from gossip_pfl.expfam.models import DTYPE, client_means, sample_batch


def _check_p(p: float) -> float:
    if not 0 < p <= 1:
        raise GossipError(f"participation: p must be in (0, 1], got {p}")
    return float(p)


@dataclass(frozen=True)
class FedEMState:
    """Hub statistics ``S`` (q,), hub memory ``V`` (q,) = mean of the workers' memories
    ``V_i`` (n, q) (the workers' own state, held here for the single-process simulation)."""

    S: torch.Tensor
    V: torch.Tensor
    V_i: torch.Tensor
    k: int = 0


def fedem_init(S0: torch.Tensor, V0_i: torch.Tensor | None = None, n: int | None = None):
    """State with S_0 and memories V_{0,i} (zeros when not given; theory uses h_i(S_0))."""
    S0 = torch.as_tensor(S0, dtype=DTYPE)
    if V0_i is None:
        if n is None:
            raise GossipError("fedem_init: give V0_i or the number of clients n")
        V0_i = torch.zeros(n, S0.numel(), dtype=DTYPE)
    V0_i = torch.as_tensor(V0_i, dtype=DTYPE)
    return FedEMState(S0.clone(), V0_i.mean(0), V0_i.clone(), 0)


def initial_memories(model, S0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """V_{0,i} = h_i(S_0) = sbar_i(T(S_0)) - S_0, the paper's choice (n*m expectations)."""
    return client_means(model, model.T(S0), x) - S0


def draw_active(n: int, p: float, generator=None) -> torch.Tensor:
    """Bernoulli(p) participation mask (n,) (all True for p = 1, no draw)."""
    if _check_p(p) == 1.0:
        return torch.ones(n, dtype=torch.bool)
    return torch.rand(n, generator=generator, dtype=DTYPE) < p


def worker_message(S_local, S, V_i, quant, alpha: float, generator=None):
    """Worker side: Delta_i = S_i - S_k - V_i; returns (Quant(Delta_i), V_i + alpha Quant)."""
    msg = quant(S_local - S - V_i, generator)
    return msg, V_i + alpha * msg


def fedem_hub_update(S, V, msg_sum, n: int, p: float, gamma: float, alpha: float, project):
    """Hub side. ``msg_sum`` is the sum of the received Quant(Delta_i).

    H = V_k + msg_sum / (n p); S_{k+1} = project(S_k + gamma H); V_{k+1} = V_k + alpha msg_sum / n.
    Returns (S_{k+1}, V_{k+1}, H, fixed).
    """
    H = V + msg_sum / (n * _check_p(p))
    S_new, fixed = project(S + gamma * H)
    return S_new, V + (alpha / n) * msg_sum, H, fixed


def _info(H, quant, q, n_active, expectations, fixed):
    return {
        "H_sq": float((H**2).sum()),
        "bits": int(n_active) * quant.bits(q),
        "active": int(n_active),
        "expectations": int(expectations),
        "projected": int(fixed),
    }


def fedem_round(
    model,
    x: torch.Tensor,
    state: FedEMState,
    *,
    quant,
    gamma: float,
    alpha: float,
    p: float = 1.0,
    batch: int | None = None,
    generator=None,
):
    """One FedEM round (Alg. 4): Bernoulli(p) participation, b-sample local estimates at
    theta_k = T(S_k), compressed memory updates. Inactive workers keep their V_i.

    Random draws, in order: the active mask, the minibatches of all clients, the quantization
    of the active clients' Delta (rows in client order).
    """
    n, m, q = x.shape[0], x.shape[1], state.S.numel()
    theta = model.T(state.S)
    active = draw_active(n, p, generator)
    idx = sample_batch(n, m, batch, generator)
    xa = x[active]
    S_local = client_means(model, theta, xa, None if idx is None else idx[active])
    msg, V_new_a = worker_message(S_local, state.S, state.V_i[active], quant, alpha, generator)
    V_i = state.V_i.clone()
    V_i[active] = V_new_a
    S, V, H, fixed = fedem_hub_update(
        state.S, state.V, msg.sum(0), n, p, gamma, alpha, model.project
    )
    n_act = int(active.sum())
    info = _info(H, quant, q, n_act, n_act * min(batch or m, m), fixed)
    return FedEMState(S, V, V_i, state.k + 1), info


def naive_round(
    model,
    x: torch.Tensor,
    S: torch.Tensor,
    *,
    quant,
    gamma: float,
    p: float = 1.0,
    batch: int | None = None,
    generator=None,
):
    """Naive compressed FedEM without memories: H = (np)^{-1} sum_{i in A} Quant(S_i - S_k).
    Same draw order as :func:`fedem_round`. Returns (S_{k+1}, info)."""
    n, m, q = x.shape[0], x.shape[1], S.numel()
    theta = model.T(S)
    active = draw_active(n, p, generator)
    idx = sample_batch(n, m, batch, generator)
    S_local = client_means(model, theta, x[active], None if idx is None else idx[active])
    msg = quant(S_local - S, generator)
    H = msg.sum(0) / (n * _check_p(p))
    S_new, fixed = model.project(S + gamma * H)
    n_act = int(active.sum())
    return S_new, _info(H, quant, q, n_act, n_act * min(batch or m, m), fixed)


# -- VR-FedEM (SPIDER estimator; full participation) -------------------------------------------


@dataclass(frozen=True)
class VRState:
    """Hub S = S_{t,k} and S_prev = S_{t,k-1}; workers' SPIDER estimates S_loc (n, q) and
    memories V_i (n, q); hub memory V = mean_i V_i."""

    S: torch.Tensor
    S_prev: torch.Tensor
    S_loc: torch.Tensor
    V: torch.Tensor
    V_i: torch.Tensor
    t: int = 0
    k: int = 0


def vr_init(S0: torch.Tensor, V0_i: torch.Tensor) -> VRState:
    S0 = torch.as_tensor(S0, dtype=DTYPE)
    V0_i = torch.as_tensor(V0_i, dtype=DTYPE)
    return VRState(S0.clone(), S0.clone(), torch.zeros_like(V0_i), V0_i.mean(0), V0_i.clone())


def vr_outer_start(model, x: torch.Tensor, state: VRState):
    """Start of an outer loop: S_{t,-1} = S_{t,0} = S and S_{t,0,i} = sbar_i(T(S)) (full pass,
    n*m expectations). Returns (state, expectations)."""
    S_loc = client_means(model, model.T(state.S), x)
    st = replace(state, S_prev=state.S.clone(), S_loc=S_loc, t=state.t + 1, k=0)
    return st, x.shape[0] * x.shape[1]


def vr_inner_step(
    model,
    x: torch.Tensor,
    state: VRState,
    *,
    quant,
    gamma: float,
    alpha: float,
    batch: int | None,
    generator=None,
):
    """One inner step: S_{t,k+1,i} = S_{t,k,i} + mean_B[sbar_ij(T(S_{t,k})) - sbar_ij(T(S_{t,k-1}))]
    on one minibatch B per worker, then the compressed memory update and the hub step as in
    FedEM with p = 1. Draws: the minibatches, then the quantization (client order)."""
    n, m, q = x.shape[0], x.shape[1], state.S.numel()
    idx = sample_batch(n, m, batch, generator)
    now = client_means(model, model.T(state.S), x, idx)
    before = client_means(model, model.T(state.S_prev), x, idx)
    S_loc = state.S_loc + (now - before)
    msg, V_i = worker_message(S_loc, state.S, state.V_i, quant, alpha, generator)
    S, V, H, fixed = fedem_hub_update(
        state.S, state.V, msg.sum(0), n, 1.0, gamma, alpha, model.project
    )
    info = _info(H, quant, q, n, 2 * n * min(batch or m, m), fixed)
    return VRState(S, state.S.clone(), S_loc, V, V_i, state.t, state.k + 1), info


def vr_fedem_outer(model, x, state: VRState, *, k_in: int, **kw):
    """One outer loop: the full pass, then ``k_in`` inner steps. Returns (state, [info...]);
    the full pass's expectations are added to the first step's count."""
    if k_in < 1:
        raise GossipError(f"k_in: must be >= 1, got {k_in}")
    state, first = vr_outer_start(model, x, state)
    infos = []
    for _ in range(k_in):
        state, info = vr_inner_step(model, x, state, **kw)
        infos.append(info)
    infos[0]["expectations"] += first
    return state, infos

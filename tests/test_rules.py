"""Aggregation rules and the clients' line search against independent truths: hand-written
optimizers and step formulas on hand-made tensors, the Armijo condition on its own minibatch,
SCAFFOLD's control-variate identity, the gossip forms on the server schedule, checkpoints,
placements, traffic by message kind and bad input."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from _helpers import free_port, run_ranks, stop_after_checkpoint, toy_dataset

from gossip_pfl.algorithms.rules import (
    FedExP,
    FedLiLS,
    FedLiLU,
    Inbox,
    Rule,
    Scaffold,
    ServerOpt,
)
from gossip_pfl.cli import main
from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.rundir import CHECKPOINT_FILE
from gossip_pfl.runtime.solver import LocalArmijo
from gossip_pfl.train import Trainer, run


def quiet(*_args, **_kw):
    pass


def cfg_for(out, name="fedavg", rounds=3, algo=None, **over):
    """A small CPU config for algorithm ``name``; ``algo`` adds algorithm keys, ``over``
    replaces top-level keys (dict values merge into their section: ``rule={...}``, ...)."""
    base = {
        "seed": 11,
        "rounds": rounds,
        "algorithm": {"name": name, "lr": 0.3, "batch_size": 16, **(algo or {})},
        "eval": {"every": rounds},
        "out": str(out),
        "runtime": {"device": "cpu"},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return load_config(base=base)


def trainer_for(cfg, n_clients=8) -> Trainer:
    return Trainer(cfg, dataset=toy_dataset(n_clients), log=quiet)


def run_rounds(trainer: Trainer, rounds: int) -> None:
    for t in range(rounds):
        active = trainer.sample(t)
        trainer.local_work(t, active)
        trainer.communicate(t, active)


# ---- 1. FedExP with one client is FedAvg -------------------------------------------------------


def test_fedexp_one_client_equals_fedavg(tmp_path):
    """One client: mean ||Delta_i||^2 = ||Delta||^2, so eta_g = max(1, 1/2 * d2/(d2 + eps)) = 1
    and the extrapolated step is the plain average."""
    finals = {}
    for name in ("fedavg", "fedexp"):
        trainer = trainer_for(cfg_for(tmp_path / name, name, rounds=4), n_clients=1)
        theta0 = trainer.nodes.clone()
        for t in range(4):
            active = trainer.sample(t)
            trainer.local_work(t, active)
            before = trainer.nodes[:1].clone()
            trainer.communicate(t, active)
            # one client: the new global model is that client's model
            torch.testing.assert_close(trainer.nodes[1], before[0], rtol=1e-6, atol=1e-7)
            if name == "fedexp":
                assert trainer.rule_state["eta_g"].tolist() == [1.0]
        finals[name] = trainer.nodes.clone()
    assert (finals["fedavg"] - theta0).abs().max() > 1e-2  # training moved the model
    torch.testing.assert_close(finals["fedexp"], finals["fedavg"], rtol=1e-6, atol=1e-6)


# ---- 2. FedLi-LU's capped Polyak step ----------------------------------------------------------


def test_fedli_lu_lam0_is_capped_polyak_step():
    """lam = 0: theta - min(eta, f / ||Delta||^2) Delta, with Delta = theta - mean; three rows:
    capped, uncapped, and Delta = 0 (nothing moves)."""
    eta = 0.5
    theta = torch.tensor(
        [[[1.0, 2.0, 0.0, 3.0]], [[0.0, -1.0, 2.0, 1.0]], [[0.3, 0.1, -0.2, 5.0]]],
        dtype=torch.float64,
    )
    delta = torch.tensor(
        [[[1.0, 0.0, 0.0, 0.0]], [[0.0, 2.0, 0.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]]],
        dtype=torch.float64,
    )
    # ||Delta||^2 = 1, 4, 0; f / ||Delta||^2 = 2 (> eta: capped), 0.1 (< eta: Polyak), -
    loss = torch.tensor([2.0, 0.4, 7.0], dtype=torch.float64)
    inbox = Inbox({"theta": theta - delta, "loss": loss})
    rule = FedLiLU(lam=0.0, eta=eta)
    new, state = rule.update(inbox, rule.init(theta), theta)
    steps = [0.5, 0.1, 0.0]  # min(eta, f / ||Delta||^2), none for Delta = 0
    for r, s in enumerate(steps):
        torch.testing.assert_close(new[r], theta[r] - s * delta[r], rtol=0, atol=1e-12)
    torch.testing.assert_close(new[2], theta[2], rtol=0, atol=0)
    torch.testing.assert_close(state["gamma"], torch.tensor(steps, dtype=torch.float64) / eta)


def test_fedli_lu_weight_decay_alone_when_delta_is_zero():
    """Delta = 0 and lam > 0: only the decay r = lam theta acts, theta (1 - eta lam)."""
    theta = torch.tensor([[[1.0, -2.0, 4.0]]], dtype=torch.float64)
    rule = FedLiLU(lam=0.1, eta=0.5)
    inbox = Inbox({"theta": theta.clone(), "loss": torch.tensor([3.0], dtype=torch.float64)})
    new, _ = rule.update(inbox, rule.init(theta), theta)
    torch.testing.assert_close(new, theta * (1 - 0.5 * 0.1), rtol=0, atol=1e-12)


# ---- 3. The Armijo line search -----------------------------------------------------------------


class LeastSquares:
    """Per-peer least squares f_i(w) = 1/(2B) ||X_i w - y_i||^2 on one minibatch, evaluated in
    float64 from float32 parameters; counts the solver's loss evaluations."""

    def __init__(self, L=5, B=7, P=4, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(L, B, P, generator=gen, dtype=torch.float64)
        self.y = torch.randn(L, B, generator=gen, dtype=torch.float64)
        self.calls: list[list[int]] = []

    def f(self, w: torch.Tensor, rows=None) -> torch.Tensor:
        """w (A, 1, P) -> (A,)."""
        x, y = (self.x, self.y) if rows is None else (self.x[rows], self.y[rows])
        r = torch.einsum("abp,ap->ab", x, w[:, 0].double()) - y
        return 0.5 * r.pow(2).mean(1)

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        r = torch.einsum("abp,ap->ab", self.x, w[:, 0].double()) - self.y
        return (torch.einsum("abp,ab->ap", self.x, r) / self.x.shape[1])[:, None].float()

    def loss_at(self, cand: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        self.calls.append(sub.tolist())
        return self.f(cand, sub)


def armijo_step(solver, problem, theta, state, grad=None, batches=3):
    L = theta.shape[0]
    grad = problem.grad(theta) if grad is None else grad
    problem.calls.clear()
    solver.step(
        theta, grad, state, slice(None), torch.ones(L), loss=problem.f(theta),
        loss_at=problem.loss_at, batches=torch.full((L,), batches),
    )  # fmt: skip
    return grad


@pytest.mark.parametrize("reset", ["grow", "keep", "max"])
def test_armijo_accepted_steps_satisfy_the_condition(reset):
    """Every accepted eta satisfies f_B(w - eta g) <= f_B(w) - c eta ||g||^2 on its minibatch,
    is eta0 beta^k for the step's first trial eta0, and (backtracking) the trial before it,
    eta / beta, did not satisfy it."""
    c, beta, eta_max, batches = 0.3, 0.5, 4.0, 3
    solver = LocalArmijo(0.1, c=c, beta=beta, eta_max=eta_max, reset=reset)
    problem = LeastSquares()
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(5, 1, 4, generator=gen)
    state = solver.init(theta)
    solver.begin_round(state)
    shrunk = 0
    for _ in range(6):
        w0, prev_eta = theta.clone(), state.eta.clone()
        g = armijo_step(solver, problem, theta, state, batches=batches)
        eta = state.eta
        if reset == "grow":
            eta0 = (prev_eta * 2 ** (1 / batches)).clamp_max(eta_max)
        elif reset == "keep":
            eta0 = prev_eta
        else:
            eta0 = torch.full_like(prev_eta, eta_max)
        g2 = g.double().flatten(1).pow(2).sum(1)
        f0 = problem.f(w0)
        torch.testing.assert_close(theta, w0 - eta.float()[:, None, None] * g)
        assert (problem.f(theta) <= f0 - c * eta * g2 + 1e-12).all()
        k = torch.log(eta / eta0) / np.log(beta)
        torch.testing.assert_close(k, k.round(), rtol=0, atol=1e-9)
        assert (k.round() >= 0).all()
        for i in (k.round() > 0).nonzero().flatten().tolist():
            bigger = eta[i] / beta
            cand = (w0[i : i + 1] - bigger.float() * g[i : i + 1]).double()
            assert problem.f(cand, [i])[0] > f0[i] - c * bigger * g2[i]
            shrunk += 1
    assert shrunk > 0  # the search did backtrack somewhere, so the check above ran


def test_armijo_with_fedproxs_term_searches_the_objective_it_descends():
    """With FedProx's mu the direction holds mu (w - anchor): the accepted eta satisfies the
    condition on F = f + mu/2 ||w - anchor||^2 and the trial before it did not. The search
    tested f alone, so a step against the pull to the anchor failed every trial (f = w^2 / 2,
    anchor 1, w = 0: eta 2.95e-5 where F takes 0.81)."""
    c, beta, mu = 0.1, 0.9, 1.0
    solver = LocalArmijo(0.1, prox_mu=mu, c=c, beta=beta, eta_max=1.0, reset="max")
    problem = LeastSquares()
    gen = torch.Generator().manual_seed(4)
    theta = torch.randn(5, 1, 4, generator=gen)
    anchor = theta + torch.randn(5, 1, 4, generator=gen)  # (the round's start, far off)
    state = solver.init(theta)
    w0 = theta.clone()
    solver.step(theta, problem.grad(theta), state, slice(None), torch.ones(5),
                anchor=anchor, loss=problem.f(theta), loss_at=problem.loss_at,
                batches=torch.ones(5))  # fmt: skip

    def F(w):
        return problem.f(w) + 0.5 * mu * (w - anchor).double().flatten(1).pow(2).sum(1)

    d = problem.grad(w0) + mu * (w0 - anchor)
    eta, d2 = state.eta, d.double().flatten(1).pow(2).sum(1)
    torch.testing.assert_close(theta, w0 - eta.float()[:, None, None] * d)
    assert (F(theta) <= F(w0) - c * eta * d2 + 1e-9).all()
    bigger = (eta / beta).clamp_max(1.0)
    tried = bigger < 1.0  # (backtracked: the trial before failed on F)
    before = w0 - bigger.float()[:, None, None] * d
    assert tried.any() and (F(before) > F(w0) - c * bigger * d2)[tried].all()
    assert (eta > 0.1).all()  # (on f alone the trials failed down to the smallest)


def test_armijo_zero_gradient_takes_no_step():
    solver = LocalArmijo(0.1, c=0.1, beta=0.5, eta_max=2.0, reset="max")
    problem = LeastSquares(L=3)
    theta = torch.randn(3, 1, 4, generator=torch.Generator().manual_seed(2))
    state = solver.init(theta)
    state.eta[1] = 0.125  # the last accepted step of peer 1: kept when it takes no step
    grad = problem.grad(theta)
    grad[1] = 0.0
    w0 = theta.clone()
    armijo_step(solver, problem, theta, state, grad=grad)
    assert torch.equal(theta[1], w0[1])
    assert state.eta[1].item() == 0.125
    assert all(1 not in sub for sub in problem.calls)  # never even evaluated
    assert not torch.equal(theta[0], w0[0]) and not torch.equal(theta[2], w0[2])


def test_armijo_max_trials_bounds_loss_evaluations():
    """No trial can pass (eta_max far too large): exactly max_trials evaluations, each peer in
    each at most once, and the last trial's eta_max beta^(max_trials - 1) is taken."""
    trials, beta, eta_max = 3, 0.5, 1e4
    solver = LocalArmijo(0.1, c=0.1, beta=beta, eta_max=eta_max, max_trials=trials, reset="max")
    problem = LeastSquares(L=4)
    theta = torch.randn(4, 1, 4, generator=torch.Generator().manual_seed(3))
    state = solver.init(theta)
    w0 = theta.clone()
    g = armijo_step(solver, problem, theta, state)
    assert len(problem.calls) == trials
    assert all(sorted(sub) == [0, 1, 2, 3] for sub in problem.calls)
    last = eta_max * beta ** (trials - 1)
    torch.testing.assert_close(state.eta, torch.full((4,), last, dtype=torch.float64))
    torch.testing.assert_close(theta, w0 - last * g)
    # with a generous budget the same search stops at the first passing trial instead
    solver = LocalArmijo(0.1, c=0.1, beta=beta, eta_max=eta_max, max_trials=100, reset="max")
    state = solver.init(w0)
    armijo_step(solver, problem, w0.clone(), state)
    assert trials < len(problem.calls) < 100


@pytest.mark.parametrize("max_trials", [100, 4])
def test_armijo_masked_trials_equal_the_trials_of_the_peers_still_searching(max_trials):
    """The step graphs' form of a search (every peer in every trial, those done left as they
    are; runtime.cuda_graph_steps) takes each trial to the same values as the eager form,
    which tries only the peers still searching: a peer with no gradient, peers that stop at
    different trials and, with 4 trials, peers that take the last one."""
    solver = LocalArmijo(0.1, c=0.1, beta=0.5, eta_max=64.0, max_trials=max_trials,
                         weight_decay=0.01, reset="grow")  # fmt: skip
    problem = LeastSquares(L=6)
    theta = torch.randn(6, 1, 4, generator=torch.Generator().manual_seed(4))
    theta[2] = 0.0  # (and no gradient: no direction, with the weight decay)
    state = solver.init(theta)
    state.eta.copy_(torch.tensor([64.0, 1.0, 0.5, 8.0, 0.01, 2.0]))
    grad = problem.grad(theta)
    grad[2] = 0.0
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    args = (state, rows, None, None, problem.f(theta), torch.full((6,), 3))
    p = theta[rows]
    eager, masked = solver.begin(p, grad, *args), solver.begin(p, grad, *args)
    assert not masked.pending[2]  # (no gradient: not searching)
    stops = []
    for trial in range(max_trials):
        sub = eager.pending.nonzero()[:, 0]
        if len(sub) == 0:
            break
        last = trial == max_trials - 1
        solver.trial(p, eager, problem.loss_at, last, sub)
        solver.trial(p, masked, lambda cand, _: problem.f(cand), last)
        for k in vars(eager):
            assert torch.equal(getattr(eager, k), getattr(masked, k)), (trial, k)
        stops.append(int(eager.pending.sum()))
    assert not masked.pending.any()
    assert len(set(stops)) > 2  # peers stopped at different trials
    if max_trials == 4:
        assert stops[-2] > 0  # someone took the last trial without passing


# ---- 4. The adaptive server optimizers ---------------------------------------------------------


@pytest.mark.parametrize("participation", [1.0, 3])
def test_fedadam_matches_hand_written_adam(participation, tmp_path):
    """Reddi et al. Alg. 2 on the pseudo-gradient Delta = sum_S p_i x_i - x (p_i = n_i / n_S):
    m = b1 m + (1 - b1) Delta, v = b2 v + (1 - b2) Delta^2 (v_-1 = tau^2),
    x + lr m / (sqrt v + tau)."""
    lr, b1, b2, tau = 0.05, 0.8, 0.95, 0.01
    cfg = cfg_for(tmp_path, "fedadam", participation=participation,
                  rule={"lr": lr, "beta1": b1, "beta2": b2, "tau": tau})  # fmt: skip
    trainer = trainer_for(cfg)
    L = trainer.n_peers
    sizes = trainer.sizes.astype(np.float64)
    x = trainer.nodes[L].double().clone()
    m, v = torch.zeros_like(x), torch.full_like(x, tau**2)
    for t in range(3):
        active = trainer.sample(t)
        assert active.sum() == (8 if participation == 1.0 else 3)
        trainer.local_work(t, active)
        clients = trainer.nodes[:L].double().clone()
        p = torch.as_tensor(np.where(active, sizes, 0) / sizes[active].sum())
        delta = torch.einsum("l,lmp->mp", p, clients) - x
        m = b1 * m + (1 - b1) * delta
        v = b2 * v + (1 - b2) * delta**2
        x = x + lr * m / (v.sqrt() + tau)
        trainer.communicate(t, active)
        torch.testing.assert_close(trainer.nodes[L].double(), x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(trainer.rule_state["v"][0].double(), v, rtol=1e-4, atol=1e-9)
        # every client downloads the new global model
        assert torch.equal(trainer.nodes[:L], trainer.nodes[L].expand(L, -1, -1))


def _hand_opt(kind, lr, b1, b2, tau, deltas, x):
    """Reddi et al.'s server optimizers element by element, in plain Python floats."""
    x = list(x)
    m, v = [0.0] * len(x), [tau * tau] * len(x)
    for delta in deltas:  # Delta = mean - x, as given
        for j, d in enumerate(delta):
            m[j] = b1 * m[j] + (1 - b1) * d
            if kind == "yogi":
                sign = (v[j] > d * d) - (v[j] < d * d)
                v[j] = v[j] - (1 - b2) * d * d * sign
            elif kind == "adagrad":
                v[j] = v[j] + d * d
            else:
                v[j] = b2 * v[j] + (1 - b2) * d * d
            x[j] = x[j] + lr * m[j] / (v[j] ** 0.5 + tau)
    return x, v


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_adaptive_server_updates_on_hand_tensors(kind):
    """Three rounds from hand-made pseudo-gradients with |Delta| both above and below sqrt(v),
    so Yogi's sign(v - Delta^2) takes both signs."""
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 0.2
    x0 = [1.0, -2.0, 0.5, 0.0]
    deltas = [[0.5, -0.1, 0.0, 2.0], [0.05, 0.3, -1.0, -2.0], [0.0, 0.01, 0.4, 0.1]]
    want_x, want_v = _hand_opt(kind, lr, b1, b2, tau, deltas, x0)
    rule = ServerOpt(kind, lr, b1, b2, tau)
    theta = torch.tensor(x0, dtype=torch.float64).view(1, 1, 4)
    state = rule.init(theta)
    for delta in deltas:
        mean = theta + torch.tensor(delta, dtype=torch.float64).view(1, 1, 4)
        theta, state = rule.update(Inbox({"theta": mean}), state, theta)
    np.testing.assert_allclose(theta.flatten().cpu().numpy(), want_x, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(state["v"].flatten().cpu().numpy(), want_v, rtol=1e-12, atol=1e-14)
    if kind == "yogi":  # Yogi is not Adam here: some v fell below Adam's
        adam_x, _ = _hand_opt("adam", lr, b1, b2, tau, deltas, x0)
        assert not np.allclose(want_x, adam_x)


def test_fedavgm_and_server_sgd_on_hand_tensors():
    """FedAvgM: m = b m + d, x - lr m (d = x - mean); server SGD: x - lr d."""
    x = torch.tensor([[[1.0, 2.0]]], dtype=torch.float64)
    means = [torch.tensor([[[0.0, 2.5]]], dtype=torch.float64),
             torch.tensor([[[0.5, 1.0]]], dtype=torch.float64)]  # fmt: skip
    rule = ServerOpt("momentum", lr=0.5, beta1=0.9)
    state, theta = rule.init(x), x
    theta, state = rule.update(Inbox({"theta": means[0]}), state, theta)  # d = (1, -0.5)
    torch.testing.assert_close(theta, torch.tensor([[[0.5, 2.25]]], dtype=torch.float64))
    theta, state = rule.update(Inbox({"theta": means[1]}), state, theta)  # d = (0, 1.25)
    # m = 0.9 (1, -0.5) + (0, 1.25) = (0.9, 0.8)
    torch.testing.assert_close(theta, torch.tensor([[[0.05, 1.85]]], dtype=torch.float64))
    sgd = ServerOpt("sgd", lr=1.0)
    out, _ = sgd.update(Inbox({"theta": means[0]}), sgd.init(x), x)
    torch.testing.assert_close(out, means[0])  # lr 1: FedAvg


# ---- 5. SCAFFOLD's control variates ------------------------------------------------------------


@pytest.mark.parametrize(
    "participation,aggregation",
    [(1.0, "size"), (3, "size"), (3, "uniform"), (1.0, "uniform")],
)
def test_scaffold_hub_control_is_weighted_mean_of_clients(participation, aggregation, tmp_path):
    """c = sum_i w_i c_i with w_i = n_i / sum n (size) or 1 / n (uniform) after every round,
    participants or not; and every client holds the hub's c after the download."""
    cfg = cfg_for(tmp_path, "scaffold", rounds=4, participation=participation,
                  aggregation=aggregation, algo={"lr": 0.1})  # fmt: skip
    trainer = trainer_for(cfg)
    n = trainer.n_peers
    w = trainer.sizes.astype(np.float64) if aggregation == "size" else np.ones(n)
    w = torch.as_tensor(w / w.sum())
    for t in range(4):
        active = trainer.sample(t)
        before = trainer.client_state["c_i"].clone()
        trainer.local_work(t, active)
        trainer.communicate(t, active)
        c_i = trainer.client_state["c_i"].double()
        # only participants change their c_i
        changed = (c_i != before.double()).flatten(1).any(1).cpu().numpy()
        np.testing.assert_array_equal(changed, active)
        c = trainer.rule_state["control"][0].double()
        torch.testing.assert_close(c, torch.einsum("l,lmp->mp", w, c_i), rtol=1e-5, atol=1e-6)
        assert c.abs().max() > 1e-3  # not trivially zero
        torch.testing.assert_close(
            trainer.client_state["c"], trainer.rule_state["control"].expand(n, -1, -1)
        )


def test_scaffold_first_round_client_control_is_mean_local_step(tmp_path):
    """Option II with c = c_i = 0: c_i+ = (x - y_i) / (K_i lr), K_i = ceil(n_i / B) the steps
    client i took in its one local epoch (small clients stop early)."""
    lr = 0.1
    trainer = trainer_for(cfg_for(tmp_path, "scaffold", algo={"lr": lr}))
    x = trainer.nodes[:8].double().clone()
    trainer.local_work(0)
    y = trainer.nodes[:8].double().clone()
    steps = torch.as_tensor(-(-trainer.sizes // 16), dtype=torch.float64)
    assert steps.tolist() == [2, 3, 3, 4, 5, 6, 7, 7]
    want = (x - y) / (steps * lr)[:, None, None]
    torch.testing.assert_close(trainer.client_state["c_i"].double(), want, rtol=1e-5, atol=1e-6)


# ---- 6. Gossip forms on the server schedule ----------------------------------------------------

TOY_SIZES = [20 + 13 * i for i in range(8)]  #: toy_dataset(8)'s client sizes
GOSSIP_ON_SERVER = {
    # the hub averages uniformly; the ServerSchedule without sizes weights uniformly too
    "uniform": ({"aggregation": "uniform"}, {"graph": "server"}, "none"),
    # the hub averages by size; the ServerSchedule is given the same sizes
    "sizes": ({}, {"graph": "server", "graph_args": {"sizes": TOY_SIZES}}, "none"),
    # the hub averages by size; the gossip weights neighbours by size (client_weighting gossip)
    "gossip_weighting": ({}, {"graph": "server"}, "gossip"),
}


@pytest.mark.parametrize("weights", ["uniform", "sizes", "gossip_weighting"])
@pytest.mark.parametrize("rule", ["fedexp", "fedli_lu"])
def test_gossip_form_on_server_schedule_equals_hub_rule(rule, weights, tmp_path):
    """dsgd with rule.name R on the ServerSchedule: every peer receives the same weighted mean
    the hub receives and applies R from the same start, so the peers end where the hub rule
    puts them. The dsgd side takes plain local steps (client_weighting none: no n_i T / n step
    multiplier), and both sides average with the same weights (see GOSSIP_ON_SERVER)."""
    hub_over, schedule, weighting = GOSSIP_ON_SERVER[weights]
    # FedLi-LU: eta large enough that the Polyak step f / ||d||^2 is taken, not the cap
    rule_opts = {"lam": 0.001, "eta": 5.0} if rule == "fedli_lu" else {}
    hub = trainer_for(cfg_for(tmp_path / "hub", rule, rounds=4, rule=rule_opts, **hub_over))
    gossip = trainer_for(
        cfg_for(tmp_path / "gossip", "dsgd", rounds=4, schedule=schedule,
                rule={"name": rule, **rule_opts}, algo={"client_weighting": weighting},
                check_schedule=False)  # the sized server's W_t is only row-stochastic
    )  # fmt: skip
    assert gossip.route == "gossip" and hub.route == "star"
    assert hub.sizes.tolist() == TOY_SIZES
    if weights != "gossip_weighting":  # the schedule's own weights are what the hub uses
        want = hub.agg_weights / hub.agg_weights.sum()
        np.testing.assert_allclose(gossip.schedule.matrix(0)[0], want, rtol=1e-12)
    key, rtol, atol = ("eta_g", 1e-6, 0.0) if rule == "fedexp" else ("gamma", 1e-5, 1e-9)
    not_plain = 0  # rounds where the rule did what the plain average would not
    for t in range(4):
        for trainer in (hub, gossip):
            trainer.local_work(t)
            trainer.communicate(t)
        torch.testing.assert_close(gossip.nodes[:8], hub.nodes[:8], rtol=1e-6, atol=1e-6)
        state = gossip.rule_state[key]
        torch.testing.assert_close(state, hub.rule_state[key].expand(8), rtol=rtol, atol=atol)
        not_plain += bool((state > 1).all() if rule == "fedexp" else (state < 1).all())
    assert not_plain >= 1


@dataclass(frozen=True)
class _Shrink(Rule):
    """A user's gossip rule that reads only its inbox (needs_theta False, like Average)."""

    name = "shrink"
    gossip = True
    needs_theta = False

    def init(self, theta):
        return {}

    def update(self, inbox, state, theta):
        assert theta is None  # no round-start copy is kept for it, as on the hub
        return 0.5 * inbox.mean["theta"], state


def test_a_gossip_rule_that_does_not_read_the_start_is_applied(tmp_path):
    """Each peer's rule runs after W_t's phases whatever its needs_theta: a rule reading only
    the inbox was skipped in gossip (the plain average was kept), though the hub applied it."""
    sched = {"graph": "ring", "weights": "metropolis"}
    plain, shrink = (trainer_for(cfg_for(tmp_path / k, "dsgd", schedule=sched)) for k in "ab")
    shrink.rule = _Shrink()
    for trainer in (plain, shrink):
        trainer.local_work(0)
    torch.testing.assert_close(shrink.nodes, plain.nodes)  # the same local steps
    for trainer in (plain, shrink):
        trainer.communicate(0)
    torch.testing.assert_close(shrink.nodes[:8], 0.5 * plain.nodes[:8])
    assert plain.nodes[:8].abs().max() > 1e-3


def test_a_new_entry_chooses_its_surrogate_by_field_not_by_name(tmp_path, monkeypatch):
    """pFedMe over a gossip schedule as one ALGORITHMS entry: it trains pFedMe's personal
    models and reads algorithm.inner_steps (the surrogate was picked by the literal names
    'pfedme' and 'apfl': a new name trained plain DSGD and refused inner_steps)."""
    from gossip_pfl import algorithms
    from gossip_pfl.algorithms.personal import PFedMeSurrogate

    spec = algorithms.AlgorithmSpec(True, "given", surrogate="pfedme")
    monkeypatch.setitem(algorithms.ALGORITHMS, "dpfedme", spec)
    sched = {"graph": "ring", "weights": "metropolis"}
    cfg = cfg_for(tmp_path, "dpfedme", algo={"inner_steps": 3, "mu": 2.0}, schedule=sched)
    trainer = trainer_for(cfg)
    assert isinstance(trainer.surrogate, PFedMeSurrogate)
    assert (trainer.surrogate.inner_steps, trainer.surrogate.lam) == (3, 2.0)


@pytest.mark.parametrize(
    "field, value",
    [("topology", "gossip"), ("solver", "Armijo"), ("surrogate", "pfedem"), ("rule", "avg")],
)
def test_an_algorithm_spec_with_a_typo_is_refused(field, value):
    """A typo in a new entry ran something else (solver 'Armijo' ran SGD; topology 'gossip'
    crashed later on a None schedule)."""
    from gossip_pfl.algorithms import AlgorithmSpec

    kw = {"single_model": True, "topology": "server", field: value}
    with pytest.raises(GossipError, match=f"AlgorithmSpec {field}='{value}'; known: "):
        AlgorithmSpec(**kw)


# ---- 7. Checkpoints --------------------------------------------------------------------------

CHECKPOINTED = {
    "fedadam": dict(algorithm="fedadam", rule={"lr": 0.05}, participation=5),
    "fedavgm": dict(algorithm="fedavgm", participation=5),
    "scaffold": dict(algorithm="scaffold", participation=5),
    "fedexp": dict(algorithm="fedexp"),
    "fedli_lu": dict(algorithm="fedli_lu", rule={"lam": 0.01}),
    "dsgd_fedexp": dict(
        algorithm="dsgd",
        rule={"name": "fedexp"},
        participation=5,
        schedule={"graph": "ring", "weights": "metropolis"},
    ),
}


def _ckpt_cfg(out, name):
    over = dict(CHECKPOINTED[name])
    return cfg_for(out, over.pop("algorithm"), rounds=6, checkpoint_every=3,
                   eval={"every": 3}, **over)  # fmt: skip


@pytest.mark.parametrize("name", list(CHECKPOINTED))
def test_rule_state_round_trips_a_checkpoint(name, tmp_path):
    full = trainer_for(_ckpt_cfg(tmp_path / "full", name))
    want = full.run()
    stop_after_checkpoint(trainer_for(_ckpt_cfg(tmp_path / "cut", name)), 3)
    resumed = trainer_for(_ckpt_cfg(tmp_path / "cut", name))
    got = resumed.run(resume=True)
    for key in ("test_accuracy", "train_loss", "train_accuracy"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    np.testing.assert_array_equal(resumed.nodes.cpu().numpy(), full.nodes.cpu().numpy())
    assert resumed.rule_state.keys() == full.rule_state.keys()
    for k, v in full.rule_state.items():
        np.testing.assert_array_equal(
            resumed.rule_state[k].cpu().numpy(), v.cpu().numpy(), err_msg=k
        )
    for k, v in full.client_state.items():
        np.testing.assert_array_equal(
            resumed.client_state[k].cpu().numpy(), v.cpu().numpy(), err_msg=k
        )
    assert resumed.kind_bytes == full.kind_bytes


# ---- 8. Placements ---------------------------------------------------------------------------

PLACED = {
    "fedadam_p3": dict(algorithm="fedadam", rule={"lr": 0.05}, participation=3),
    "scaffold_p0.5": dict(algorithm="scaffold", participation=0.5),
    "fedli_ls_max_p5": dict(
        algorithm="fedli_ls", rule={"step": "max"}, participation=5, line_search={"eta_max": 2.0}
    ),
    "dsgd_fedli_lu_ring_p5": dict(
        algorithm="dsgd",
        rule={"name": "fedli_lu"},
        participation=5,
        schedule={"graph": "ring", "weights": "metropolis"},
    ),
}
SUMMARY_KEYS = ("test_accuracy", "test_accuracy_weighted", "train_accuracy", "train_loss")


def _placed_summaries(out_dir, ports=None) -> dict:
    """Every PLACED config on this rank: {name: the summary's numbers}. Under several ranks
    each config's process group meets on its own port (``ports``): on the port of the group
    just closed, a rank that is done with it can reach the other ranks' old store before they
    close it, and that run never starts."""
    out = {}
    for k, (name, over) in enumerate(PLACED.items()):
        if ports is not None:
            os.environ["MASTER_PORT"] = str(ports[k])
        over = dict(over)
        cfg = cfg_for(f"{out_dir}/{name}", over.pop("algorithm"), rounds=3, **over)
        summary = run(cfg, dataset=toy_dataset(8), log=quiet)  # closes the process group
        out[name] = {k: summary[k] for k in (*SUMMARY_KEYS, "client_test_accuracy")}
    return out


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """One process, 2 and 4 Gloo ranks, each running every PLACED config (one spawn per
    world size keeps this affordable)."""
    root = tmp_path_factory.mktemp("placed")
    results = {1: _placed_summaries(root / "w1")}
    for world in (2, 4):
        ports = [free_port() for _ in PLACED]
        # a module-scoped fixture runs before conftest.py hides the GPU: hidden here
        ranks = run_ranks(world, _placed_summaries, str(root / f"w{world}"), ports,
                          env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
        for status, value in ranks:
            assert status == "ok", value
        assert all(v == ranks[0][1] for _, v in ranks)  # every rank reports the same
        results[world] = ranks[0][1]
    return results


@pytest.mark.parametrize("name", list(PLACED))
def test_placements_give_the_same_summary(name, placed):
    one = placed[1][name]
    for world in (2, 4):
        for key in SUMMARY_KEYS:
            assert placed[world][name][key] == pytest.approx(one[key], abs=1e-4), (world, key)
        np.testing.assert_allclose(placed[world][name]["client_test_accuracy"],
                                   one["client_test_accuracy"], atol=1e-4)  # fmt: skip


# ---- 9. Traffic by message kind ----------------------------------------------------------------


@pytest.mark.parametrize("participation", [1.0, 3])
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_kind_bytes_match_tensor_sizes(algorithm, participation, tmp_path):
    """Per round on the star: |S| messages up and n down, each carrying every kind's columns
    (theta: M P floats; SCAFFOLD's control: M P floats) in float32."""
    rounds = 3
    trainer = trainer_for(cfg_for(tmp_path, algorithm, rounds=rounds, participation=participation))
    run_rounds(trainer, rounds)
    n, k = trainer.n_peers, trainer.n_active
    P = trainer.layout.numel
    assert P == 6 and trainer.M == 1  # linear model on 5 features, one logit
    per_kind = rounds * (k + n) * P * 4
    kinds = ["theta"] + (["control"] if algorithm == "scaffold" else [])
    assert trainer.kind_bytes == dict.fromkeys(kinds, per_kind)
    assert trainer.traffic()["model_bytes"] == per_kind * len(kinds)


def test_kind_bytes_on_gossip_with_participation(tmp_path):
    """dsgd + fedexp on a ring, 5 of 8 peers a round: a message per directed link between two
    participants, carrying theta (M P floats) and sq_delta (one float)."""
    rounds = 3
    cfg = cfg_for(tmp_path, "dsgd", rounds=rounds, participation=5, rule={"name": "fedexp"},
                  schedule={"graph": "ring", "weights": "metropolis"})  # fmt: skip
    trainer = trainer_for(cfg)
    links = 0
    for t in range(rounds):
        active = trainer.sample(t)
        links += sum(int(active[i] and active[(i + d) % 8]) for i in range(8) for d in (-1, 1))
    run_rounds(trainer, rounds)
    assert 0 < links < rounds * 16
    assert trainer.kind_bytes == {"theta": links * 6 * 4, "sq_delta": links * 4}


# ---- 10. Bad input -----------------------------------------------------------------------------


def _cli_config(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "seed: 1\nrounds: 1\n"
        "data: {name: synthetic, n_clients: 8, dim: 5, n_test: 20, cache: false}\n"
        "algorithm: {name: fedavg, batch_size: 16}\n"
        "runtime: {device: cpu}\n"
    )
    return path


BAD = {
    "unknown_rule": (["rule.name=fedmagic"], "rule.name"),
    "participation_0": (["participation=0"], "participation"),
    "participation_negative": (["participation=-1"], "participation"),
    "participation_above_clients": (["participation=9"], "participation"),
    "participation_fraction_above_1": (["participation=1.5"], "participation"),
    "eta_max_zero": (["line_search.eta_max=0"], "line_search.eta_max"),
    "eta_max_negative": (["line_search.eta_max=-1"], "line_search.eta_max"),
    "c_zero": (["line_search.c=0"], "line_search.c"),
    "c_one": (["line_search.c=1"], "line_search.c"),
    "beta_zero": (["line_search.beta=0"], "line_search.beta"),
    "beta_above_one": (["line_search.beta=1.5"], "line_search.beta"),
    "no_gossip_form": (
        ["algorithm.name=dsgd", "rule.name=fedadam", "schedule={graph: ring}"],
        "rule.name",
    ),
    "server_algorithm_gossip_schedule": (["schedule={graph: ring}"], "schedule"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_one_line_cli_error_and_writes_nothing(case, tmp_path, capsys):
    overrides, key = BAD[case]
    out = tmp_path / "out"
    argv = ["run", str(_cli_config(tmp_path)), "--out", str(out), "--quiet"]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("gossip-pfl: error:") and key in err[0], err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "over,key",
    [
        (dict(rule={"name": "fedmagic"}), "rule.name"),
        (dict(participation=9), "participation"),
        (dict(algorithm="dsgd", rule={"name": "fedadam"}, schedule={"graph": "ring"}), "rule.name"),
        (dict(algorithm="dsgd", rule={"name": "scaffold"}, schedule={"graph": "ring"}),
         "rule.name"),
        (dict(algorithm="dsgd", rule={"name": "fedli_ls", "step": "max"},
              algo={"client_weighting": "none"}, schedule={"graph": "ring"}), "rule.name"),
        (dict(schedule={"graph": "ring"}), "schedule"),
        (dict(algorithm="clustered", participation=3), "participation"),
    ],
    ids=["unknown_rule", "participation_9_of_8", "fedadam_gossip", "scaffold_gossip",
         "fedli_ls_max_gossip", "fedavg_ring", "clustered_partial"],
)  # fmt: skip
def test_bad_input_in_the_trainer_names_the_key(over, key, tmp_path):
    over = dict(over)
    algorithm = over.pop("algorithm", "fedavg")
    with pytest.raises(GossipError) as err:
        trainer_for(cfg_for(tmp_path / "out", algorithm, **over))
    msg = str(err.value)
    assert "\n" not in msg and key in msg, msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("step", ["one", "max"])
def test_a_rule_without_a_gossip_form_lists_those_with_one(step, tmp_path):
    """The list comes from the rules themselves (rules.md's table: a new gossip rule appears
    in it); FedLi-LS has one with rule.step one only, which the message says."""
    rule = {"name": "fedli_ls", "step": step} if step == "max" else {"name": "fedadam"}
    cfg = cfg_for(tmp_path, "dsgd", rule=rule, schedule={"graph": "ring"},
                  algo={"client_weighting": "none"})  # fmt: skip
    with pytest.raises(GossipError, match=r"gossip rules: average, fedexp, fedli_lu, fedli_ls "):
        trainer_for(cfg)
    with pytest.raises(GossipError) as err:
        trainer_for(cfg)
    assert ("under these rule.* options" in str(err.value)) == (step == "max")


@pytest.mark.parametrize(
    "declares, words",
    [({"scalars": ("grad_norm",)}, "reads the per-client scalar 'grad_norm'; the clients send"),
     ({"per_client": ("c",)}, "reads 'c' client by client (per_client), but only theta travel"),
     ({"scalars": ("loss",), "per_client": ("loss", "theta")}, None)],
)  # fmt: skip
def test_a_rule_reading_messages_nobody_sends_is_refused(declares, words):
    """A new rule's scalar the clients do not compute was a KeyError inside the bundle."""
    from gossip_pfl.algorithms.rules import check_rule

    rule = dataclass(frozen=True)(type("Mine", (_Shrink,), {"name": "mine", **declares}))()
    if words is None:
        assert check_rule(rule) is rule
        return
    with pytest.raises(GossipError, match=re.escape(f"rule 'mine' {words}")):
        check_rule(rule)


@pytest.mark.parametrize(
    "section,key,value",
    [("line_search", "eta_max", 0.0), ("line_search", "c", 1.0), ("line_search", "beta", 0.0),
     ("line_search", "max_trials", 0), ("rule", "tau", 0.0), ("rule", "beta1", 1.0)],
)  # fmt: skip
def test_bad_rule_and_line_search_values_fail_in_load_config(section, key, value, tmp_path):
    with pytest.raises(GossipError, match=rf"config key '{section}\.{key}'"):
        cfg_for(tmp_path, "fedli_ls", **{section: {key: value}})


def test_summary_records_rule_and_participation(tmp_path):
    """The summary names the rule actually run and the clients per round."""
    cfg = cfg_for(tmp_path, "dsgd", rule={"name": "fedexp"}, participation=0.5,
                  schedule={"graph": "ring", "weights": "metropolis"})  # fmt: skip
    summary = trainer_for(cfg).run()
    assert summary["rule"] == "fedexp" and summary["participation"] == 4
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["rule"] == "fedexp"


def test_gossip_fedli_ls_clients_search_their_step(tmp_path):
    """The rule picks FedLi-LS's client solver in its gossip form too (dsgd + rule fedli_ls),
    and its peers report the step sizes their searches accepted (not algorithm.lr)."""
    cfg = cfg_for(tmp_path, "dsgd", rule={"name": "fedli_ls"}, schedule={"graph": "ring"},
                  algo={"client_weighting": "gossip"})  # fmt: skip
    trainer = Trainer(cfg, dataset=toy_dataset(8), log=quiet)
    assert isinstance(trainer.solver, LocalArmijo)
    trainer.run()
    eta = trainer.opt_state.eta
    assert (eta > 0).all() and (eta <= cfg.line_search.eta_max).all()
    assert not torch.allclose(eta, torch.full_like(eta, cfg.algorithm.lr))


@pytest.mark.parametrize("algorithm", ["pfedme", "apfl"])
def test_a_line_search_rule_for_personal_models_is_refused(algorithm, tmp_path):
    """FedLi-LS's rule searches each client's step on the shared model's loss, which pFedMe's
    and APFL's clients (a personal model each) do not give: refused in one line where the
    run failed in its first round (an AttributeError's traceback)."""
    cfg = cfg_for(tmp_path, algorithm, rule={"name": "fedli_ls"})
    with pytest.raises(GossipError, match=f"rule.name 'fedli_ls'.*algorithm.name '{algorithm}'"):
        Trainer(cfg, dataset=toy_dataset(8), log=quiet)


def test_participation_inside_the_schedule_is_refused(tmp_path):
    """A server schedule's own sampling would run beside 'participation': one way only."""
    sched = {"graph": "server", "graph_args": {"participation": 0.5}}
    cfg = cfg_for(tmp_path, "dsgd", schedule=sched)
    with pytest.raises(GossipError, match="top-level key 'participation'"):
        Trainer(cfg, dataset=toy_dataset(8), log=quiet)


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("gossip-pfl ")


def test_fedli_client_loss_is_the_mean_over_real_samples(tmp_path):
    """The loss a FedLi client sends is its last minibatch's mean loss over the samples it
    holds, not a sum divided by the nominal batch size: with one batch of twice the client's
    size it is the mean log-loss of the whole local data at the round-start model."""
    data = toy_dataset(1)
    client = data.clients[0]
    n = len(client.y_train)
    cfg = cfg_for(tmp_path, "fedli_lu", rounds=1, algo={"batch_size": 2 * n})
    trainer = Trainer(cfg, dataset=data, log=quiet)
    theta = trainer.nodes[0, 0].double()  # (P,) linear: weights then bias
    x = torch.as_tensor(client.x_train, dtype=torch.float64)
    y = torch.as_tensor(client.y_train, dtype=torch.float64)
    logits = x @ theta[:-1] + theta[-1]
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits, y).item()
    trainer.local_work(0)
    assert trainer.outbox["loss"].item() == pytest.approx(want, rel=1e-5)


# ---- 11. Server step formulas on hand-made tensors -----------------------------------------------


def test_fedli_lu_weight_decay_enters_gamma():
    """lam > 0, Delta != 0: gamma = (f - eta <Delta, lam theta>) / (eta ||Delta||^2) strictly
    inside (0, 1), and theta - eta (lam theta + gamma Delta); sums run over both components."""
    lam, eta, f = 0.1, 0.5, 0.75
    th = [[2.0, 0.0], [-1.0, 1.0]]  # (M, P) = (2, 2)
    dl = [[1.0, 1.0], [0.0, 1.0]]  # Delta = theta - mean
    inner = sum(d * lam * t for tr, dr in zip(th, dl) for t, d in zip(tr, dr))  # 0.3
    sq = sum(d * d for dr in dl for d in dr)  # 3
    gamma = (f - eta * inner) / (eta * sq)  # (0.75 - 0.15) / 1.5 = 0.4
    assert 0 < gamma < 1 and gamma != f / (eta * sq)  # the decay term changes gamma
    want = [[t - eta * (lam * t + gamma * d) for t, d in zip(tr, dr)] for tr, dr in zip(th, dl)]
    theta = torch.tensor([th], dtype=torch.float64)
    inbox = Inbox({"theta": theta - torch.tensor([dl], dtype=torch.float64),
                   "loss": torch.tensor([f], dtype=torch.float64)})  # fmt: skip
    rule = FedLiLU(lam=lam, eta=eta)
    new, state = rule.update(inbox, rule.init(theta), theta)
    torch.testing.assert_close(state["gamma"], torch.tensor([0.4], dtype=torch.float64))
    torch.testing.assert_close(new, torch.tensor([want], dtype=torch.float64), rtol=0, atol=1e-12)
    # [[1.7, -0.2], [-0.95, 0.75]]


def test_fedexp_extrapolates_with_the_halved_ratio():
    """Three weighted clients: eta_g = mean_p ||Delta_i||^2 / (2 (||sum p_i Delta_i||^2 + eps))
    > 1, and theta - eta_g sum p_i Delta_i, with Delta_i = theta - theta_i."""
    eps = 0.01
    p = [0.5, 0.25, 0.25]
    th = [1.0, -2.0, 0.5]
    deltas = [[2.0, 0.0, 0.0], [-1.0, 1.0, 0.0], [0.0, -1.0, 2.0]]
    d = [sum(pi * di[j] for pi, di in zip(p, deltas)) for j in range(3)]  # (0.75, 0, 0.5)
    mean_sq = sum(pi * sum(x * x for x in di) for pi, di in zip(p, deltas))  # 3.0
    d2 = sum(x * x for x in d)  # 0.8125
    eta_g = mean_sq / (2 * (d2 + eps))  # 1.8237...
    assert eta_g > 1
    theta = torch.tensor(th, dtype=torch.float64).view(1, 1, 3)
    clients = theta - torch.tensor(deltas, dtype=torch.float64).view(3, 1, 3)
    mean = torch.einsum("s,smp->mp", torch.tensor(p, dtype=torch.float64), clients)[None]
    inbox = Inbox({"theta": mean, "sq_delta": torch.tensor([mean_sq], dtype=torch.float64)})
    rule = FedExP(eps=eps)
    new, state = rule.update(inbox, rule.init(theta), theta)
    torch.testing.assert_close(state["eta_g"], torch.tensor([eta_g], dtype=torch.float64))
    want = [t - eta_g * x for t, x in zip(th, d)]
    torch.testing.assert_close(new.flatten(), torch.tensor(want, dtype=torch.float64),
                               rtol=0, atol=1e-12)  # fmt: skip


def test_fedli_ls_step_max_takes_the_largest_client_step():
    """step: max with clients' eta (0.3, 1.7, 0.9), their weighted mean 1.0: the hub moves
    theta - 1.7 Delta (Delta = theta - mean theta_i), not the min, the mean or FedAvg."""
    etas = [0.3, 1.7, 0.9]
    th, mn = [1.0, -1.0, 2.0], [0.5, 0.0, 2.5]  # Delta = (0.5, -1, -0.5)
    theta = torch.tensor(th, dtype=torch.float64).view(1, 1, 3)
    inbox = Inbox(
        {"theta": torch.tensor(mn, dtype=torch.float64).view(1, 1, 3),
         "eta": torch.tensor([1.0], dtype=torch.float64)},
        clients={"eta": torch.tensor(etas, dtype=torch.float64)},
    )  # fmt: skip
    rule = FedLiLS(step="max")
    assert rule.per_client == ("eta",)
    new, state = rule.update(inbox, rule.init(theta), theta)
    want = [t - 1.7 * (t - m) for t, m in zip(th, mn)]  # (0.15, 0.7, 2.85)
    torch.testing.assert_close(new.flatten(), torch.tensor(want, dtype=torch.float64),
                               rtol=0, atol=1e-12)  # fmt: skip
    assert state["step"].tolist() == [1.7]


def test_scaffold_server_lr_and_control_update():
    """lr = 0.5: x + lr (mean theta_i - x), half way to the clients' average; the hub's c moves
    by mass * mean delta c_i from a nonzero c (3 of 8 uniform clients: mass 3/8)."""
    lr, mass = 0.5, 3 / 8
    x, mn = [1.0, -2.0, 4.0], [3.0, -1.0, 0.0]
    c, dc = [0.2, -0.4, 1.0], [0.8, 0.8, -1.6]
    as_t = lambda v: torch.tensor(v, dtype=torch.float64).view(1, 1, 3)  # noqa: E731
    rule = Scaffold(lr=lr)
    inbox = Inbox({"theta": as_t(mn), "control": as_t(dc)}, mass=mass)
    new, state = rule.update(inbox, {"control": as_t(c)}, as_t(x))
    want = [a + lr * (m - a) for a, m in zip(x, mn)]  # (2, -1.5, 2)
    torch.testing.assert_close(new, as_t(want), rtol=0, atol=1e-12)
    want_c = [a + mass * b for a, b in zip(c, dc)]  # (0.5, -0.1, 0.4)
    torch.testing.assert_close(state["control"], as_t(want_c), rtol=0, atol=1e-12)


def test_a_rule_that_blows_up_the_last_round_is_neither_logged_nor_saved(tmp_path):
    """The models a round's rule made were checked only in the next round's local work: a
    last round's NaN/inf ran on to the summary (exit 0, the accuracy of NaN models). Now a
    log or a checkpoint checks them first, naming the rule's step."""
    # (the local steps alone stay finite with rule.lr 1; float32 holds rule.lr up to 3.4e38)
    rule = {"name": "fedavgm", "lr": 3e38}
    cfg = cfg_for(tmp_path, "fedavgm", rounds=1, algo={"lr": 3}, rule=rule)
    with pytest.raises(
        GossipError,
        match=r"round 1: the parameters .* became NaN/inf; lower "
        r"the steps: .*rule.lr \(now 3e\+38\)",
    ):
        trainer_for(cfg).run()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert not (tmp_path / CHECKPOINT_FILE).exists() and not (tmp_path / "summary.json").exists()

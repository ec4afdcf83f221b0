"""Consensus analysis against closed forms and brute force, on small dense schedules."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from topologies import MixingSchedule, Phase, TopologyError
from topologies import schedules as S
from topologies.analysis import (
    ExplicitSchedule,
    connectivity_tau,
    consensus_run,
    describe,
    estimate_p,
    rho,
    round_properties,
    spectral_gap,
    window_contraction,
)


def shift(n: int, k: int) -> np.ndarray:
    """Permutation matrix with ``(P x)_i = x_{i+k}``: peer ``i`` receives from ``i + k``."""
    return np.roll(np.eye(n), k, axis=1)


def ring(n: int) -> np.ndarray:
    return (np.eye(n) + shift(n, 1) + shift(n, -1)) / 3


def matching(n: int, offset: int) -> np.ndarray:
    """Average over the pairs ``(i, i+1)`` with ``i = offset, offset + 2, ...`` (mod n)."""
    W = np.eye(n)
    for i in range(offset, n + offset, 2):
        a, b = i % n, (i + 1) % n
        W[[a, a, b, b], [a, b, a, b]] = 0.5
    return W


def one_peer_exp(n: int) -> list[np.ndarray]:
    """One-peer exponential graph: in round k peer i averages with i + 2^k (directed)."""
    return [(np.eye(n) + shift(n, 2**k)) / 2 for k in range(int(np.log2(n)))]


def metropolis(G: nx.Graph) -> np.ndarray:
    n = G.number_of_nodes()
    W = np.zeros((n, n))
    for i, j in G.edges:
        W[i, j] = W[j, i] = 1 / (1 + max(G.degree[i], G.degree[j]))
    W[np.diag_indices(n)] = 1 - W.sum(1)
    return W


class CoinSchedule(MixingSchedule):
    """Random schedule: exact averaging with probability q, identity otherwise (per round)."""

    is_random = True
    period = None

    def __init__(self, n: int, q: float, seed: int = 0) -> None:
        self.n, self.q, self.seed = n, q, seed

    def phases(self, t: int) -> list[Phase]:
        heads = np.random.default_rng([self.seed, t]).random() < self.q
        return [
            Phase.from_dense(np.full((self.n, self.n), 1 / self.n) if heads else np.eye(self.n))
        ]


class HubSchedule(MixingSchedule):
    """Server-like: a sampled subset sends to hub node n, which sends the average back."""

    is_random = True
    period = None

    def __init__(self, n: int, k: int, seed: int = 0) -> None:
        self.n, self.k, self.seed = n, k, seed

    def phases(self, t: int) -> list[Phase]:
        n = self.n
        S = np.random.default_rng([self.seed, t]).choice(n, self.k, replace=False)
        up = Phase(n + 1, np.full(self.k, n), S.astype(np.int64), np.full(self.k, 1 / self.k))
        down = Phase(n + 1, S.astype(np.int64), np.full(self.k, n), np.ones(self.k))
        return [up, down]


class RandomGraphSchedule(MixingSchedule):
    """Random sparse graphs (each round: G(n, p) with Metropolis weights)."""

    is_random = True
    period = None

    def __init__(self, n: int, p: float, seed: int = 0) -> None:
        self.n, self.p, self.seed = n, p, seed

    def phases(self, t: int) -> list[Phase]:
        G = nx.gnp_random_graph(self.n, self.p, seed=self.seed * 100_003 + t)
        return [Phase.from_dense(metropolis(G))]


def brute_tau(schedule: MixingSchedule, horizon: int) -> int | None:
    mats = [schedule.matrix(t) for t in range(horizon)]
    for tau in range(1, horizon + 1):
        ok = True
        for t in range(horizon - tau + 1):
            A = sum(np.abs(W) for W in mats[t : t + tau])
            if not nx.is_connected(nx.from_numpy_array(A + A.T)):
                ok = False
                break
        if ok:
            return tau
    return None


# --------------------------------------------------------------------------- rho


@pytest.mark.parametrize("n", [4, 5, 8, 16, 31])
def test_rho_ring_closed_form(n):
    expected = 1 / 3 + 2 / 3 * np.cos(2 * np.pi / n)
    assert rho(ring(n)) == pytest.approx(expected, abs=1e-12)
    assert spectral_gap(ring(n)) == pytest.approx(1 - expected, abs=1e-12)


def test_rho_nonsymmetric_is_spectral_norm():
    W = one_peer_exp(8)[1]
    assert rho(W) == pytest.approx(np.linalg.norm(W - 1 / 8, 2))
    assert rho(np.full((5, 5), 0.2)) == pytest.approx(0, abs=1e-12)


# --------------------------------------------------------------------------- tau


def test_tau_alternating_matchings_is_2():
    n = 8
    s = ExplicitSchedule([matching(n, 0), matching(n, 1)])
    assert not nx.is_connected(nx.from_numpy_array(matching(n, 0)))
    assert connectivity_tau(s, horizon=20) == 2


def test_tau_none_when_never_connected():
    assert connectivity_tau(ExplicitSchedule([matching(8, 0)]), horizon=50) is None


def test_tau_static_connected_is_1():
    assert connectivity_tau(ExplicitSchedule([ring(10)]), horizon=5) == 1


def test_tau_one_peer_exponential_is_log2n():
    # rounds 1..log2(n)-1 alone keep evens and odds apart; only a full period connects
    assert connectivity_tau(ExplicitSchedule(one_peer_exp(16)), horizon=20) == 4


def test_tau_needs_every_window():
    n = 6
    A = metropolis(_edge_graph(n, [(0, 1), (1, 2), (3, 4), (4, 5)]))  # {0,1,2} {3,4,5}
    B = metropolis(_edge_graph(n, [(2, 3)]))
    C = np.eye(n)
    # (A, B) is connected but (B, C) and (C, A) are not: only windows of 3 always are
    s = ExplicitSchedule([A, B, C])
    assert connectivity_tau(s, horizon=30) == brute_tau(s, 30) == 3


def _edge_graph(n: int, edges: list[tuple[int, int]]) -> nx.Graph:
    G = nx.empty_graph(n)
    G.add_edges_from(edges)
    return G


def test_tau_horizon_too_short_is_none():
    mats = one_peer_exp(16)
    s = ExplicitSchedule(mats[1:] + mats[:1])  # the connected round comes last
    assert connectivity_tau(s, horizon=3) is None
    assert connectivity_tau(s, horizon=4) == 4
    assert connectivity_tau(s, horizon=8) == 4
    # periodic: every distinct window counts, also those reaching past the horizon
    assert connectivity_tau(ExplicitSchedule(mats), horizon=3) is None
    with pytest.raises(TopologyError):
        connectivity_tau(s, horizon=0)


@pytest.mark.parametrize("seed", range(4))
def test_tau_matches_brute_force_on_random_sparse_graphs(seed):
    s = RandomGraphSchedule(12, 0.08, seed=seed)
    assert connectivity_tau(s, horizon=25) == brute_tau(s, 25)


def test_tau_hub_is_fresh_each_round():
    # hub rounds connect only the sampled peers; the hub must not chain rounds together
    s = HubSchedule(10, 3, seed=1)
    assert connectivity_tau(s, horizon=40) == brute_tau(s, 40)
    assert connectivity_tau(HubSchedule(10, 10), horizon=5) == 1


def test_tau_fast_at_n1024():
    import time

    n = 1024
    s = ExplicitSchedule([matching(n, 0), matching(n, 1)])
    start = time.perf_counter()
    assert connectivity_tau(s, horizon=100) == 2
    assert time.perf_counter() - start < 5  # generous: about 0.1 s on a laptop


# --------------------------------------------------------------------------- contraction, p


def test_contraction_exact_averaging_product_is_zero():
    for n in (4, 8, 16):
        s = ExplicitSchedule(one_peer_exp(n))
        tau = int(np.log2(n))
        assert window_contraction(s, tau, windows=3) == pytest.approx(0, abs=1e-12)
        assert window_contraction(s, 1, windows=tau) == pytest.approx(1)


def birkhoff(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random nonsymmetric doubly stochastic matrix (convex mix of permutations)."""
    return sum(w * np.eye(n)[rng.permutation(n)] for w in rng.dirichlet(np.ones(3)))


def test_contraction_uses_later_rounds_on_the_left():
    # x_{t+1} = W_t x_t: the window product is W_1 W_0, whose norm differs from W_0 W_1's
    rng = np.random.default_rng(0)
    A, B = birkhoff(6, rng), birkhoff(6, rng)
    right, wrong = np.linalg.norm(B @ A - 1 / 6, 2), np.linalg.norm(A @ B - 1 / 6, 2)
    assert abs(right - wrong) > 1e-3
    s = ExplicitSchedule([A, B])
    assert window_contraction(s, 2) == pytest.approx(right)
    x0 = np.random.default_rng(1).standard_normal((6, 2))
    res = consensus_run(s, 2, x0=x0)
    y = B @ A @ x0
    assert res.errors[2] == pytest.approx(
        np.linalg.norm(y - y.mean(0)) / np.linalg.norm(x0 - x0.mean(0))
    )


def test_estimate_p_deterministic_is_exact():
    W = ring(9)
    assert estimate_p(ExplicitSchedule([W]), tau=1) == pytest.approx(1 - rho(W) ** 2)
    assert estimate_p(ExplicitSchedule([W]), tau=3) == pytest.approx(1 - rho(W) ** 6)
    s = ExplicitSchedule([matching(8, 0), matching(8, 1)])
    c = max(
        np.linalg.norm(matching(8, 1) @ matching(8, 0) - 1 / 8, 2),
        np.linalg.norm(matching(8, 0) @ matching(8, 1) - 1 / 8, 2),
    )
    # tau = 3 over period 2: windows start at even and odd rounds
    assert estimate_p(s, tau=2) == pytest.approx(1 - c**2)


def test_estimate_p_random_matches_expectation():
    # E[(W-J)^T (W-J)] = (1 - q)(I - J): p = q
    s = CoinSchedule(6, q=0.5, seed=3)
    assert estimate_p(s, tau=1, trials=2000, seed=1) == pytest.approx(0.5, abs=0.05)
    # two rounds: averaged unless both are identity: p = 1 - (1 - q)^2
    assert estimate_p(s, tau=2, trials=2000, seed=2) == pytest.approx(0.75, abs=0.05)


def test_estimate_p_random_exact_on_the_worst_direction():
    s = RandomGraphSchedule(8, 0.4, seed=0)
    p = estimate_p(s, tau=2, trials=50, seed=0)
    assert 0 < p < 1
    # the bound holds on average for the eigenvector it was computed for and any X
    rng = np.random.default_rng(0)
    X = rng.standard_normal((8, 3))
    X -= X.mean(0)
    starts = np.random.default_rng(0).choice(2**20, size=50, replace=False)
    lhs = np.mean(
        [np.linalg.norm(s.matrix(2 * int(l) + 1) @ s.matrix(2 * int(l)) @ X) ** 2 for l in starts]
    )
    assert lhs <= (1 - p) * np.linalg.norm(X) ** 2 + 1e-9


# --------------------------------------------------------------------------- consensus runs


def test_consensus_error_is_rho_power_on_slowest_mode():
    n = 16
    W = ring(n)
    x0 = np.cos(2 * np.pi * np.arange(n) / n)  # eigenvector of lambda_2
    res = consensus_run(ExplicitSchedule([W]), rounds=60, x0=x0)
    r = rho(W)
    np.testing.assert_allclose(res.errors, r ** np.arange(61), rtol=1e-9)


def test_consensus_random_start_bounded_and_rate_rho():
    n = 16
    W = ring(n)
    res = consensus_run(ExplicitSchedule([W]), rounds=300, dim=4, seed=5)
    r = rho(W)
    assert np.all(res.errors <= r ** np.arange(301) * (1 + 1e-9))
    ratio = res.errors[-1] / res.errors[-2]
    assert ratio == pytest.approx(r, rel=1e-3)
    assert res.messages.tolist() == [2 * n] * 300
    assert res.rounds_to(1e-3) == int(np.flatnonzero(res.errors <= 1e-3)[0])
    assert res.final_error == res.errors[-1]
    assert res.cumulative_messages[-1] == 600 * n


def test_consensus_exact_average_in_log2n_rounds():
    n = 32
    res = consensus_run(ExplicitSchedule(one_peer_exp(n)), rounds=5)
    assert res.errors[-1] < 1e-12
    assert res.rounds_to(1e-6) == 5
    assert res.messages.tolist() == [n] * 5


def test_consensus_hub_phases_match_dense_matrices():
    s = HubSchedule(10, 4, seed=2)
    x = np.random.default_rng(1).standard_normal((10, 2))
    given = x.copy()
    res = consensus_run(s, rounds=30, x0=x)
    np.testing.assert_array_equal(x, given)  # (the rounds after the first work in place)
    y = x.copy()
    for t in range(30):
        y = s.matrix(t) @ y
    spread = np.linalg.norm(y - y.mean(0)) / np.linalg.norm(x - x.mean(0))
    assert res.final_error == pytest.approx(spread, rel=1e-9, abs=1e-14)
    assert res.messages.tolist() == [8] * 30


def test_consensus_distance_for_row_stochastic():
    # a "server" that weights peer 0 heavily converges to a weighted average, not xbar
    n = 4
    pi = np.array([0.7, 0.1, 0.1, 0.1])
    W = np.tile(pi, (n, 1))
    res = consensus_run(ExplicitSchedule([W]), rounds=3, seed=0)
    assert res.errors[1] == pytest.approx(0, abs=1e-12)
    assert res.rounds_to(1e-6) == 1


def test_consensus_rejects_bad_input():
    with pytest.raises(TopologyError):
        consensus_run(ExplicitSchedule([ring(4)]), rounds=-1)
    with pytest.raises(TopologyError):
        consensus_run(ExplicitSchedule([ring(4)]), rounds=3, x0=np.ones(4))


@pytest.mark.parametrize(
    "matrices, says",
    [
        ([2 * np.eye(2)], "matrix 0: row 0 sums to 2"),  # (its "consensus" was 2^t x0)
        ([np.eye(2), [[1.5, -0.4], [0.0, 1.0]]], r"matrix 1: row 0 sums to 1.1"),
        ([np.eye(2), np.eye(3)], "square of size 2"),
    ],
)
def test_explicit_matrices_are_checked_as_every_schedules_are(matrices, says):
    with pytest.raises(TopologyError, match=says):
        ExplicitSchedule(matrices)
    # negative weights that keep the rows' sums (best constant weights uncapped) are studied
    signed = ExplicitSchedule([[[1.5, -0.5], [0.0, 1.0]]])
    assert round_properties(signed, horizon=1)["nonnegative"] is False


# --------------------------------------------------------------------------- properties, describe


DESCRIBE_KEYS = {
    "n",
    "edges_per_round",
    "max_degree",
    "doubly_stochastic",
    "symmetric",
    "nonnegative",
    "rho",
    "tau",
    "contraction",
    "is_random",
    "period",
    "p",
}


def test_round_properties_sparse_matches_dense():
    cases = [ring(7), one_peer_exp(8)[0], np.tile([0.7, 0.1, 0.1, 0.1], (4, 1)), matching(6, 1)]
    neg = ring(5).copy()
    neg[0, 0], neg[0, 1] = 1 / 3 + 0.1, 1 / 3 - 0.1 - 0.0
    neg[0, 2] = -0.0
    cases.append(neg)
    for W in cases:
        props = round_properties(ExplicitSchedule([W]), horizon=2)
        n = len(W)
        assert props == {
            "doubly_stochastic": bool(np.allclose(W.sum(0), 1) and np.allclose(W.sum(1), 1)),
            "symmetric": bool(np.allclose(W, W.T)),
            "nonnegative": bool((W >= 0).all()),
        }, (W, n)
    # a phase that touches some rows only: untouched rows keep weight 1 on themselves
    p = Phase(3, np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), np.full(4, 0.5))

    class Partial(MixingSchedule):
        n = 3

        def phases(self, t):
            return [p]

    assert round_properties(Partial()) == {
        "doubly_stochastic": True,
        "symmetric": True,
        "nonnegative": True,
    }
    assert describe(Partial(), horizon=3)["max_degree"] == 1


def test_describe_static_ring():
    n = 8
    d = describe(ExplicitSchedule([ring(n)]), horizon=10)
    assert set(d) == DESCRIBE_KEYS
    assert d["n"] == n and d["tau"] == 1 and d["period"] == 1 and d["is_random"] is False
    assert d["edges_per_round"] == 2 * n and d["max_degree"] == 2
    assert d["doubly_stochastic"] and d["symmetric"] and d["nonnegative"]
    assert d["rho"] == pytest.approx(rho(ring(n)))
    assert d["contraction"] == pytest.approx(rho(ring(n)))
    assert d["p"] == pytest.approx(1 - rho(ring(n)) ** 2)


def test_a_random_schedules_checks_draw_each_round_once(monkeypatch):
    """check_mixing and describe read a random schedule's rounds for its connectivity and
    its properties in one pass: a run's check drew each Erdos-Renyi graph twice (221 draws
    for 100 rounds, 17 of a 19.5 s run at n = 1,000). The answers are those of the passes
    apart."""
    from topologies.analysis import _scan, check_mixing

    schedule = S.RandomSchedule(30, "erdos_renyi", {"p": 0.2}, seed=1)
    built, build = [], schedule._build
    monkeypatch.setattr(schedule, "_build", lambda t: built.append(t) or build(t))
    check_mixing(schedule, horizon=10)
    assert built == list(range(10))
    built.clear()
    d = describe(schedule, horizon=10, trials=3)
    apart = _scan(schedule, 10, 1e-9)[0], connectivity_tau(schedule, 10)
    assert ({k: d[k] for k in apart[0]}, d["tau"]) == apart


def test_a_disconnected_rounds_rho_is_one_without_a_solve(monkeypatch):
    """A doubly stochastic, non-negative round whose links leave several groups has rho 1
    exactly, without its dense solve; a row-stochastic one or one with negative weights is
    solved (its rho may pass 1)."""
    import topologies.analysis as analysis

    halves = np.kron(np.eye(2), np.full((3, 3), 1 / 3))  # two groups, doubly stochastic
    pulled = halves.copy()
    pulled[0] = [0.1, 0.8, 0.1, 0, 0, 0]  # row-stochastic only
    signed = np.kron(np.eye(2), [[1.5, -0.5, 0], [-0.5, 1.5, 0], [0, 0, 1]])
    solves, solve = [], analysis.rho
    monkeypatch.setattr(analysis, "rho", lambda W: solves.append(1) or solve(W))
    for W, solved in ((halves, False), (pulled, True), (signed, True), (ring(6), True)):
        solves.clear()
        got = analysis.schedule_rho(ExplicitSchedule([W]))
        assert got == pytest.approx(solve(W), abs=1e-12) and bool(solves) is solved
    assert solve(pulled) > 1 + 1e-3 and solve(signed) > 1 + 1e-3  # (no shortcut would do)


def test_describe_solves_a_static_schedules_spectrum_once(monkeypatch):
    """Its rho and its contraction over windows of one round are the same n^3 solve (at
    n = 3,000 the second took 2.7 of describe's 4.6 s)."""
    import topologies.analysis as analysis

    solves, solve = [], analysis.rho
    monkeypatch.setattr(analysis, "rho", lambda W: solves.append(1) or solve(W))
    d = describe(ExplicitSchedule([ring(12)]), horizon=20)
    assert len(solves) == 1 and d["contraction"] == d["rho"] == pytest.approx(solve(ring(12)))


def test_describe_time_varying_and_random():
    d = describe(ExplicitSchedule(one_peer_exp(8)), horizon=12)
    assert set(d) == DESCRIBE_KEYS
    assert d["tau"] == 3 and d["contraction"] == pytest.approx(0, abs=1e-12)
    assert d["symmetric"] is False and d["doubly_stochastic"] is True
    assert d["rho"] == pytest.approx(1)  # rounds 1, 2 alone are disconnected
    assert d["max_degree"] == 1 and d["edges_per_round"] == 8

    d = describe(CoinSchedule(5, 0.5), horizon=30, trials=200)
    assert d["is_random"] is True and d["period"] is None
    assert d["p"] == pytest.approx(1 - 0.5 ** d["tau"], abs=0.1)

    d = describe(ExplicitSchedule([matching(8, 0)]), horizon=10)
    assert d["tau"] is None and d["contraction"] is None and d["p"] is None


@pytest.mark.parametrize(
    "density, columns",  # (the dense product; the sparse one: all columns, five at a time)
    [(0.5, 13), (0.02, 13), (0.02, 5)],
)
def test_a_phase_applies_as_its_dense_matrix(density, columns, monkeypatch):
    """Duplicate entries add up and rows that receive nothing keep their value, whichever
    product a phase's density picks, and however many columns the sparse one takes at once."""
    import topologies.analysis as analysis

    rng = np.random.default_rng(3)
    n, nnz = 60, int(density * 60**2)
    rows = rng.integers(0, n - 5, nnz)  # (the last five receive nothing)
    cols = rng.integers(0, n, nnz)
    rows, cols = np.r_[rows, rows[:9]], np.r_[cols, cols[:9]]  # nine entries twice
    phase = Phase(n, rows, cols, rng.random(rows.size))
    monkeypatch.setattr(analysis, "_BLOCK", columns * rows.size)  # (columns a block)
    z = rng.standard_normal((n, 13))
    assert (phase.rows.size > analysis._DENSE_FROM * n * n) is (density == 0.5)
    want = phase.dense() @ z
    np.testing.assert_allclose(analysis._apply_phase(phase, z), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(want[-5:], z[-5:])


def test_a_sparse_phase_over_a_windows_columns_is_a_dense_product(monkeypatch):
    """Applied to at least n / 4 columns (a window's product), a phase of density 1/512 to
    1/32 is BLAS's dense product (7x faster at n = 1,000, density 0.02), to fewer columns the
    gathers; the same matrix either way."""
    import topologies.analysis as analysis

    rng = np.random.default_rng(4)
    n = 400
    nnz = int(0.01 * n * n)
    phase = Phase(n, rng.integers(0, n, nnz), rng.integers(0, n, nnz), rng.random(nnz))
    dense, densified = phase.dense(), []
    monkeypatch.setattr(Phase, "dense", lambda self: densified.append(1) or dense)
    for columns, via_dense in ((n, True), (n // 4, True), (n // 4 - 1, False), (8, False)):
        z = rng.standard_normal((n, columns))
        got = analysis._apply_phase(phase, z)
        assert len(densified) == via_dense, columns
        np.testing.assert_allclose(got, dense @ z, rtol=1e-12, atol=1e-12)
        densified.clear()
    m = n // 2  # (density 1/800, as a ring of 2,400 peers: the gathers win)
    thin = Phase(n, rng.integers(0, n, m), rng.integers(0, n, m), rng.random(m))
    analysis._apply_phase(thin, np.eye(n))
    assert not densified


def test_a_window_of_many_periods_is_a_power_of_one_period(monkeypatch):
    """A periodic schedule's window of ``q`` periods and ``r`` rounds is ``R P^q`` (the window
    product round by round, to rounding), in a few rounds' applications: tau = 10^9 applied
    10^9 rounds."""
    import topologies.analysis as analysis

    rng = np.random.default_rng(0)
    mats = []
    for _ in range(3):
        m = rng.random((6, 6)) * (rng.random((6, 6)) < 0.4) + np.eye(6)
        mats.append(m / m.sum(1, keepdims=True))
    schedule = ExplicitSchedule(mats)
    for length in (1000, 1003):  # (q = 333, r = 1; q = 334, r = 1) from round 2
        want = np.eye(6)
        for t in range(2, 2 + length):
            want = schedule.matrix(t) @ want
        got = analysis._window_product(schedule, 2, length)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    applied = []
    apply_round = analysis._apply_round
    monkeypatch.setattr(
        analysis, "_apply_round", lambda *a, **k: applied.append(1) or apply_round(*a, **k)
    )
    assert 0 < window_contraction(schedule, tau=30_001) < 1
    assert len(applied) <= 2 * 3  # a period, and the rounds left over (not 30,001)
    # (the rows' sums drift by about rounds x 5e-17, as round by round: 1.7e-8 at 10^9)
    assert window_contraction(schedule, tau=10**9 + 1) == pytest.approx(
        window_contraction(schedule, tau=30_001), abs=1e-7
    )


def test_a_dense_graphs_window_is_a_product_not_a_gather():
    """describe of a complete graph at n = 1,000 gathered 10^6 x 1,000 floats: 75 s, 16 GB.
    At n = 400 the gather would hold 400^3 floats (512 MB); the product a few n x n ones."""
    import tracemalloc

    n = 400
    schedule = ExplicitSchedule([np.full((n, n), 1 / n)])
    tracemalloc.start()
    try:
        contraction = window_contraction(schedule, tau=2, windows=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert contraction < 1e-12 and peak < 16 * n * n * 8, peak


# --------------------------------------------------------------------------- real schedules

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "topologies").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_sparse_analysis_matches_dense_matrices(path):
    spec = pytest.importorskip("topologies.spec")
    if "fmmc" in path.name:
        pytest.importorskip("cvxpy")
    from topologies import validation

    s = spec.load_schedule(path)
    horizon = 12
    x0 = np.random.default_rng(0).standard_normal((s.n, 3))
    y = x0.copy()
    for t in range(horizon):
        y = s.matrix(t) @ y
    spread = np.linalg.norm(y - y.mean(0)) / np.linalg.norm(x0 - x0.mean(0))
    assert consensus_run(s, horizon, x0=x0).final_error == pytest.approx(spread, abs=1e-12)
    mats = [s.matrix(t) for t in range(horizon)]
    assert round_properties(s, horizon) == {
        "doubly_stochastic": all(validation.is_doubly_stochastic(W) for W in mats),
        "symmetric": all(validation.is_symmetric(W) for W in mats),
        "nonnegative": all(validation.is_nonnegative(W) for W in mats),
    }
    assert connectivity_tau(s, horizon) == brute_tau(s, horizon)


class _Aperiodic(MixingSchedule):
    """The same rounds with the period hidden: the analyses then read every round."""

    period = None

    def __init__(self, inner: MixingSchedule):
        self.inner, self.n, self.seed = inner, inner.n, inner.seed

    def phases(self, t: int):
        return self.inner.phases(t)


# (horizons past a period and tau: below them the periodic and the windowed reading differ
# by design, connectivity_tau's docstring)
@pytest.mark.parametrize("horizon", [7, 20, 22])
@pytest.mark.parametrize(
    "make",
    [
        lambda: S.OnePeerExponentialSchedule(8),  # period 3
        lambda: S.PeriodicSchedule([S.graph_schedule(8, "ring"), S.graph_schedule(8, "path")]),
    ],
)
def test_a_periodic_schedules_analysis_reads_one_period_and_agrees(make, horizon):
    """(A horizon of 10^9 on a ring read 10^9 rounds: minutes, then a hang.)"""
    s = make()
    fast, full = describe(s, horizon=horizon), describe(_Aperiodic(s), horizon=horizon)
    for key in ("edges_per_round", "max_degree", "doubly_stochastic", "symmetric", "tau"):
        assert fast[key] == pytest.approx(full[key]), key
    assert connectivity_tau(s, 10**5) == connectivity_tau(_Aperiodic(s), 3 * s.period)

"""Invariants of the weight rules, schedules, checks and consensus analysis, and of the runtime's
participation, exchange and metrics, each against a truth of its own: a closed form, an
invariant, a slow reference in plain numpy/networkx, or a second route to the same number.

Each test names the mutation of the code it was written to catch (a mutation-testing audit:
these mutants passed every other test)."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest

from topologies import MixingSchedule, Phase, TopologyError
from topologies import graphs as g
from topologies import schedules as s
from topologies import weights as wts
from topologies.analysis import (
    ConsensusResult,
    ExplicitSchedule,
    connectivity_tau,
    consensus_run,
    describe,
    estimate_p,
    rho,
    schedule_rho,
    window_contraction,
)
from topologies.validation import (
    check_doubly_stochastic,
    check_square,
    is_doubly_stochastic,
    is_symmetric,
    validate_schedule,
)


def norm_rho(w: np.ndarray) -> float:
    """||W - 11^T/n||_2 straight from numpy's spectral norm."""
    return float(np.linalg.norm(w - 1.0 / len(w), 2))


def edge_weights(w: np.ndarray, graph: nx.Graph) -> np.ndarray:
    return np.array([w[u, v] for u, v in graph.edges()])


# ----------------------------------------------------------------------------- weight rules


@pytest.mark.parametrize("n", [5, 10])
def test_best_constant_on_ring_path_and_star_is_the_closed_form(n):
    """Best constant weight alpha = 2 / (lambda_max + lambda_2) of the Laplacian, capped at
    1 / d_max, against the Laplacian's known spectra: ring 2 - 2 cos(2 pi k / n), path
    2 - 2 cos(pi k / n) (so alpha = 1/2), star with m leaves 0, 1, m + 1 (so 2 / (m + 2),
    capped to 1 / m). Catches lambda_3 taken for lambda_2 and a cap of 1 / (d_max + 1)."""
    ring_eig = 2 - 2 * np.cos(2 * np.pi * np.arange(n) / n)
    path_eig = 2 - 2 * np.cos(np.pi * np.arange(n) / n)
    m = n - 1
    cases = [
        (g.ring(n), 2 / (ring_eig.max() + np.sort(ring_eig)[1]), 1 / 2),
        (g.path(n), 2 / (path_eig.max() + np.sort(path_eig)[1]), 1 / 2),
        (g.star(n), 2 / (m + 2), 1 / m),
    ]
    for graph, alpha, cap in cases:
        for nonnegative, want in ((False, alpha), (True, min(alpha, cap))):
            w = wts.best_constant(graph, nonnegative=nonnegative)
            np.testing.assert_allclose(edge_weights(w, graph), want, rtol=1e-12)
            degrees = np.array([d for _, d in sorted(graph.degree())])
            np.testing.assert_allclose(np.diag(w), 1 - degrees * want, atol=1e-12)


def test_fmmc_cache_keeps_graphs_with_the_same_second_endpoints_apart(tmp_path, monkeypatch):
    """The star and the path on 4 nodes list edges (0,1),(0,2),(0,3) and (0,1),(1,2),(2,3):
    the same second endpoints. Each gets its own solver weights (here a stand-in solver's:
    the Metropolis weights of the edges it is given), solved, then read back from the cache
    in either order. Catches a cache key that hashes only one endpoint array."""
    monkeypatch.setenv("GOSSIP_PFL_CACHE", str(tmp_path))

    def solve(n, u, v, *_):
        deg = np.bincount(np.concatenate([u, v]), minlength=n)
        return 1.0 / (1.0 + np.maximum(deg[u], deg[v]))

    monkeypatch.setattr(wts, "_solve_fmmc", solve)
    star, path = g.star(4), g.path(4)
    assert [v for _, v in star.edges()] == [v for _, v in path.edges()]
    for _ in range(2):  # solved, then read back
        for graph in (star, path):
            np.testing.assert_allclose(wts.fmmc(graph), wts.metropolis(graph), atol=1e-15)
    assert len(list((tmp_path / "fmmc").glob("*.npy"))) == 2


@pytest.mark.parametrize(
    "noisy",
    [
        [0.6, 0.6, 0.3],  # node 1 (a second endpoint of edge 0) carries 1.2
        [0.4, 0.5, -1e-4],  # a small negative weight
    ],
)
def test_fmmc_cleans_the_solvers_weights_to_an_exactly_feasible_w(noisy, monkeypatch):
    """Whatever the solver returns, fmmc's W is exactly feasible: non-negative, symmetric,
    rows and columns summing to 1, zeros off the edges. Catches the clip of negative
    weights dropped and the overload measured at one end of each edge only."""
    monkeypatch.setattr(wts, "_solve_fmmc", lambda *a: np.array(noisy, dtype=float))
    path = g.path(4)  # edges (0,1), (1,2), (2,3)
    w = wts.fmmc(path, cache=False)
    assert w.min() >= 0 and np.array_equal(w, w.T)
    np.testing.assert_allclose(w.sum(0), 1, atol=1e-12)
    np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)
    assert w[0, 2] == w[0, 3] == w[1, 3] == 0


def test_uniform_refuses_equal_in_degrees_with_unequal_out_degrees():
    """uniform needs every in- and out-degree equal: with in-degrees all 1 but out-degrees
    2, 1, 0 its W would not be doubly stochastic. Catches the out-degree check dropped."""
    graph = nx.DiGraph([(0, 1), (0, 2), (1, 0)])
    assert sorted(d for _, d in graph.in_degree()) == [1, 1, 1]
    with pytest.raises(TopologyError, match="needs a regular graph"):
        wts.uniform(graph)


@pytest.mark.parametrize("rule", ["metropolis", "max_degree", "best_constant"])
def test_self_loops_do_not_change_the_weights(rule):
    """A self-loop is no link: a graph's weights are those of the graph without its
    self-loops (degrees count other peers only). Catches self-loops kept as edges."""
    graph = g.erdos_renyi(9, 0.4, seed=2)
    looped = graph.copy()
    looped.add_edges_from([(0, 0), (4, 4)])
    fn = wts.weight_rule(rule)
    np.testing.assert_array_equal(fn(looped), fn(graph))


# ----------------------------------------------------------------------------- schedules


def test_random_schedule_draws_a_fresh_graph_every_round():
    """Erdos-Renyi rounds are independent G(n, p) draws: each pair is linked in a share p of
    60 rounds (within 5 binomial standard deviations), and round t's W is the Metropolis
    matrix of graph(t) (the networkx route). Catches a round seed not mixed with t."""
    n, p, rounds = 8, 0.4, 60
    sched = s.RandomSchedule(n, "erdos_renyi", {"p": p}, seed=3)
    links = np.stack([(sched.matrix(t) > 0) & ~np.eye(n, dtype=bool) for t in range(rounds)])
    share = links.mean(0)[np.triu_indices(n, 1)]
    assert np.abs(share - p).max() < 5 * np.sqrt(p * (1 - p) / rounds)
    for t in (0, 7, 59):
        np.testing.assert_allclose(sched.matrix(t), wts.metropolis(sched.graph(t)), atol=1e-15)


def test_static_schedule_flags_follow_its_matrix():
    """A StaticSchedule's doubly_stochastic / symmetric flags are what numpy finds in its
    matrix, and validate_schedule accepts a row-stochastic one. Catches a doubly_stochastic
    flag that is always True."""
    mats = [
        np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),  # rows only
        np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]),  # doubly, not sym
        wts.metropolis(g.star(3)),
    ]
    for w in mats:
        sched = s.StaticSchedule(w)
        assert sched.doubly_stochastic == is_doubly_stochastic(w)
        assert sched.symmetric == is_symmetric(w)
        validate_schedule(sched)


def test_graph_schedule_weighs_an_undirected_family_by_metropolis():
    """graph_schedule's default rule for an undirected family is Metropolis: its W is the
    rule's matrix of the same seeded graph, on a graph where Metropolis and max-degree
    differ. Catches another default rule."""
    graph = g.erdos_renyi(12, 0.3, seed=1)
    want = wts.metropolis(graph)
    assert not np.allclose(want, wts.max_degree(graph))
    got = s.graph_schedule(12, "erdos_renyi", {"p": 0.3}, seed=1).matrix(0)
    np.testing.assert_allclose(got, want, atol=1e-15)


def test_periodic_items_run_on_their_own_clock():
    """Item k of an L-item cycle plays its own round t // L in round t: the one-peer
    exponential graph's rounds 0, 1, 2, ... come one a cycle. Catches the item asked for
    round t."""
    ope = s.OnePeerExponentialSchedule(8)
    per = s.PeriodicSchedule([s.graph_schedule(8, "ring"), ope])
    for k in range(6):
        np.testing.assert_array_equal(per.matrix(2 * k + 1), ope.matrix(k))
        np.testing.assert_array_equal(per.neighbors(2 * k + 1, 3)[0], ope.neighbors(k, 3)[0])


def test_periodic_flags_are_every_rounds_properties():
    """A cycle is symmetric / doubly stochastic when every round of a period is (numpy's
    checks of each W_t). Catches flags that take any item's claim for all."""
    ring = s.graph_schedule(6, "ring")
    rows_only = s.StaticSchedule(_row_stochastic(6))
    for items in ([ring, s.OnePeerExponentialSchedule(6)], [ring, rows_only], [ring, ring]):
        per = s.PeriodicSchedule(items)
        mats = [per.matrix(t) for t in range(per.period)]
        assert per.symmetric == all(is_symmetric(w) for w in mats)
        assert per.doubly_stochastic == all(is_doubly_stochastic(w) for w in mats)
        validate_schedule(per)


def _row_stochastic(n: int) -> np.ndarray:
    """Row-stochastic, not column-stochastic: peer 0 also reads peer 1."""
    w = np.eye(n)
    w[0, :2] = 0.5
    return w


@pytest.mark.parametrize("hub", ["aggregator", "peer"])
def test_server_samples_distinct_peers_uniformly_and_afresh(hub):
    """Each round takes exactly m distinct peers, every peer in a share m / n of 400 rounds
    (with hub 'peer': peer 0 always, the others (m - 1) / (n - 1)), within 5 binomial
    standard deviations. Catches the last peer never drawn, peer 0 drawn twice and a draw
    not mixed with the round."""
    n, m, rounds = 10, 3, 400
    sched = s.ServerSchedule(n, participation=m / n, hub=hub, seed=4)
    seen = np.zeros((rounds, n))
    for t in range(rounds):
        part = sched.participants(t)
        assert len(np.unique(part)) == len(part) == m
        seen[t, part] = 1
    if hub == "peer":
        assert seen[:, 0].all()
        share, expect = seen[:, 1:].mean(0), (m - 1) / (n - 1)
    else:
        share, expect = seen.mean(0), m / n
    assert np.abs(share - expect).max() < 5 * np.sqrt(expect * (1 - expect) / rounds)


@pytest.mark.parametrize("fraction", [0.05, 0.29, 0.35, 0.5, 0.61, 1.0])
@pytest.mark.parametrize("n", [7, 10])
def test_server_and_runtime_sample_the_same_number_of_peers(fraction, n):
    """The server schedule's participants and the runtime's participant_count agree on how
    many peers a fraction is. Catches either one truncating instead of rounding."""
    from gossip_pfl.runtime.participation import participant_count

    sched = s.ServerSchedule(n, participation=fraction, seed=1)
    assert len(sched.participants(3)) == participant_count(fraction, n)


def test_server_is_random_exactly_when_it_samples():
    """Full participation draws nothing: the same W every round, period 1, not random; a
    partial one draws its rounds. Catches full participation flagged random."""
    for fraction, n in ((1.0, 6), (0.5, 6)):
        sched = s.ServerSchedule(n, participation=fraction, seed=2)
        varies = any(not np.array_equal(sched.matrix(t), sched.matrix(0)) for t in range(1, 8))
        assert sched.is_random == varies
        assert sched.period == (None if varies else 1)


def test_link_failures_leave_an_isolated_peer_alone():
    """A peer with no link (node 2, between linked peers) keeps its value in every round
    while links fail around it: rows e_2, every W_t doubly stochastic and symmetric, its
    sparse rows equal to the dense ones. Catches the failed-weight sums taken over empty
    rows too."""
    graph = nx.Graph()
    graph.add_nodes_from(range(6))
    nx.add_cycle(graph, [0, 1, 3, 4, 5])
    sched = s.LinkFailureSchedule(graph, "metropolis", q=0.5, seed=1)
    validate_schedule(sched, rounds=12)
    for t in range(12):
        w = sched.matrix(t)
        np.testing.assert_array_equal(w[2], np.eye(6)[2])
        for i in range(6):
            cols, vals, self_w = sched.neighbors(t, i)
            row = np.zeros(6)
            row[cols], row[i] = vals, self_w
            np.testing.assert_array_equal(row, w[i])


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [[[np.nan, 0.0], [0.0, 1.0]], [[1.0, 0.0], [np.inf, 1.0]]])
def test_a_matrix_of_nan_or_inf_is_refused(bad):
    """A matrix is finite: NaN and inf are refused by every check (a NaN passed the sums'
    comparisons). Catches the finiteness check dropped."""
    with pytest.raises(TopologyError, match="is not finite"):
        check_square(bad)
    assert not is_doubly_stochastic(bad) and not is_symmetric(bad)
    with pytest.raises(TopologyError, match="is not finite"):
        s.StaticSchedule(np.asarray(bad))


def test_a_tolerance_of_zero_asks_for_exact_sums():
    """tol = 0 is a valid tolerance (a finite number >= 0): exact sums pass, a sum off by
    one ulp fails. Catches 0 refused as a tolerance."""
    assert is_doubly_stochastic(np.eye(3), tol=0) and is_symmetric(np.eye(3), tol=0)
    assert not is_doubly_stochastic(np.array([[0.5, 0.5], [0.5, 0.5 + 1e-15]]), tol=0)
    check_doubly_stochastic(np.full((4, 4), 0.25), tol=0)


def test_negative_entries_are_neither_doubly_stochastic_nor_valid():
    """Rows and columns summing to 1 with a negative entry: not doubly stochastic, and a
    schedule holding it fails validate_schedule even when asked for rows only. Catches the
    non-negativity checks dropped."""
    w = np.array([[1.5, -0.5], [-0.5, 1.5]])
    np.testing.assert_allclose(w.sum(0), 1)
    assert not is_doubly_stochastic(w)
    sched = ExplicitSchedule([w])
    with pytest.raises(TopologyError, match="round 0: entry"):
        validate_schedule(sched, doubly_stochastic=False, symmetric=False)


def test_validate_schedule_reads_every_round_of_a_period_with_their_claims():
    """A bad round is found wherever it lies in the period (a row-stochastic round of a
    schedule that makes no claim is checked as doubly stochastic); a schedule that makes no
    symmetry claim is not held to one. Catches rounds skipped and the defaults flipped."""
    good = wts.metropolis(g.ring(4))
    bad = _row_stochastic(4)
    for mats, t in (([bad, good, good], 0), ([good, good, bad], 2)):
        with pytest.raises(TopologyError, match=f"round {t}: column"):
            validate_schedule(ExplicitSchedule(mats))
    validate_schedule(ExplicitSchedule([s.OnePeerExponentialSchedule(4).matrix(0)]))


def test_validate_schedule_refuses_a_matrix_of_another_size():
    """A schedule whose W_t is not n x n is refused. Catches the size check dropped."""

    class Wrong(MixingSchedule):
        n = 3

        def phases(self, t):
            return [Phase.from_dense(np.eye(4))]

        def matrix(self, t):
            return np.eye(4)

    with pytest.raises(TopologyError, match="round 0: matrix is 4 x 4, expected n = 3"):
        validate_schedule(Wrong())


# ----------------------------------------------------------------------------- analysis


def test_rho_is_the_spectral_norm_of_w_minus_j():
    """rho(W) = ||W - 11^T/n||_2 (numpy's norm), for symmetric matrices whose largest
    deviation is a negative eigenvalue (the swap, Xiao-Boyd's uncapped star weights) and for
    non-symmetric ones. Catches the eigenvalues' absolute value dropped."""
    rng = np.random.default_rng(0)
    mats = [
        np.array([[0.0, 1.0], [1.0, 0.0]]),
        wts.best_constant(g.star(6), nonnegative=False),
        wts.metropolis(g.ring(6)),
        s.OnePeerExponentialSchedule(6).matrix(1),
    ]
    x = rng.random((5, 5))
    mats.append(x / x.sum(1, keepdims=True))
    for w in mats:
        assert rho(w) == pytest.approx(norm_rho(w), abs=1e-12)


def _slow_pair() -> list[np.ndarray]:
    """Two non-symmetric, slowly mixing doubly stochastic matrices on 4 peers: a window of
    100 rounds is far from exact averaging."""
    shift = np.roll(np.eye(4), 1, axis=1)
    swap = np.eye(4)[[1, 0, 2, 3]]
    return [0.99 * np.eye(4) + 0.01 * shift, 0.995 * np.eye(4) + 0.005 * swap]


def test_contraction_of_a_long_window_is_that_of_its_rounds_product():
    """A window of 101 rounds of a two-round cycle (computed as a period's power and the
    round left over) has the contraction of the product taken round by round, for the
    windows starting at 0 and 101. Catches the left-over round dropped."""
    mats = _slow_pair()
    sched = ExplicitSchedule(mats)
    want = []
    for start in (0, 101):
        p = np.eye(4)
        for t in range(start, start + 101):
            p = mats[t % 2] @ p
        want.append(norm_rho(p))
    assert 0.2 < min(want) and max(want) < 0.99  # far from both 0 and 1
    assert window_contraction(sched, tau=101, windows=2) == pytest.approx(max(want), abs=1e-12)


def _brute_tau(mats: list[np.ndarray], horizon: int) -> int | None:
    """Smallest tau whose every window in [0, horizon) has a connected union of links."""
    n = len(mats[0])
    links = [[(i, j) for i, j in zip(*np.nonzero(w)) if i != j] for w in mats]
    for tau in range(1, horizon + 1):
        ok = True
        for start in range(horizon - tau + 1):
            union = nx.Graph()
            union.add_nodes_from(range(n))
            for t in range(start, start + tau):
                union.add_edges_from(links[t])
            if not nx.is_connected(union):
                ok = False
                break
        if ok:
            return tau
    return None


@pytest.mark.parametrize("m", [1, 2])
def test_server_tau_is_the_union_of_its_rounds_effective_links(m):
    """A sampled server round links its participants only (through that round's hub): tau
    against a brute force over the effective W_t's links (one participant a round: never
    connected). Catches one hub shared by every round."""
    horizon = 24
    sched = s.ServerSchedule(6, participation=m / 6, seed=3)
    want = _brute_tau([sched.matrix(t) for t in range(horizon)], horizon)
    assert (want is None) == (m == 1)
    assert connectivity_tau(sched, horizon=horizon) == want


def test_p_of_a_cycle_reads_every_distinct_window():
    """For a deterministic cycle of 3 rounds and windows of 2 the windows start at rounds 0,
    2 and 4 = 1 mod 3, three distinct products: p = 1 - max rho^2 over them (a window that
    holds exact averaging has rho 0). Catches period // tau windows read instead."""
    mats = [
        np.full((4, 4), 0.25),
        wts.metropolis(g.path(4)),
        s.OnePeerExponentialSchedule(4).matrix(1),
    ]
    sched = ExplicitSchedule(mats)
    worst = max(norm_rho(mats[(l * 2 + 1) % 3] @ mats[(l * 2) % 3]) for l in range(3))
    assert worst > 0.1
    assert estimate_p(sched, tau=2) == pytest.approx(1 - worst**2, abs=1e-12)


def test_p_of_a_random_server_is_the_expectation_over_its_draws():
    """Monte-Carlo p of a server sampling 2 of 4 size-weighted peers against the exact
    E[(W - J)^T (W - J)] over the 6 equally likely participant pairs (a row-stochastic W:
    W^T W and W W^T differ). Catches (W - J)(W - J)^T averaged instead."""
    n, sizes = 4, np.array([1.0, 2.0, 3.0, 4.0])
    M = np.zeros((n, n))
    pairs = list(itertools.combinations(range(n), 2))
    for pair in pairs:
        part = list(pair)
        w = np.eye(n)
        w[part] = 0.0
        w[np.ix_(part, part)] = sizes[part] / sizes[part].sum()
        d = w - 1.0 / n
        M += d.T @ d / len(pairs)
    exact = 1 - np.linalg.eigvalsh(M)[-1]
    sched = s.ServerSchedule(n, participation=0.5, weights=sizes, seed=1)
    assert estimate_p(sched, tau=1, trials=1000, seed=0) == pytest.approx(exact, abs=0.04)


def test_random_schedule_rho_is_the_mean_over_its_first_rounds():
    """schedule_rho of a random schedule is the mean of rho(W_t) over the first
    min(horizon, trials) rounds (numpy's norms). Catches the max taken, and trials read past
    the horizon."""
    sched = s.RandomSchedule(8, "erdos_renyi", {"p": 0.5}, seed=2)
    rates = [norm_rho(sched.matrix(t)) for t in range(12)]
    assert max(rates) - min(rates) > 0.05
    assert schedule_rho(sched, horizon=12, trials=20) == pytest.approx(np.mean(rates), abs=1e-12)
    assert schedule_rho(sched, horizon=5, trials=20) == pytest.approx(np.mean(rates[:5]), abs=1e-12)


def test_describe_max_degree_counts_what_a_peer_receives():
    """max_degree is the largest in-degree (off-diagonal nonzeros of a row): a peer reading
    every other peer has n - 1, though each peer is read by one only. Catches columns
    counted."""
    w = np.eye(5)
    w[0] = 0.2
    assert describe(ExplicitSchedule([w]), horizon=3)["max_degree"] == 4


def test_consensus_run_counts_each_rounds_own_messages():
    """A run's messages are each round's off-diagonal nonzeros of W_t (links fail round by
    round). Catches round 0's count repeated."""
    sched = s.LinkFailureSchedule(g.ring(8), "metropolis", q=0.4, seed=1)
    res = consensus_run(sched, rounds=10)
    want = [int(np.count_nonzero(sched.matrix(t) - np.diag(np.diag(sched.matrix(t)))))
            for t in range(10)]  # fmt: skip
    assert len(set(want)) > 1
    assert res.messages.tolist() == want


def test_rounds_to_counts_an_error_equal_to_the_tolerance():
    """rounds_to is the first round with error <= tol, an error equal to it included.
    Catches < for <=."""
    res = ConsensusResult(np.array([1.0, 0.5, 0.25]), np.array([3, 3]))
    assert res.rounds_to(0.5) == 1 and res.rounds_to(0.25) == 2 and res.rounds_to(0.2) is None


def test_monte_carlo_p_follows_its_seed():
    """estimate_p's seed picks the sampled windows: the same seed repeats, another gives
    another estimate. Catches the seed ignored."""
    sched = s.RandomSchedule(8, "erdos_renyi", {"p": 0.3}, seed=0)
    a, b = (estimate_p(sched, tau=1, trials=5, seed=k) for k in (1, 2))
    assert a == estimate_p(sched, tau=1, trials=5, seed=1) and a != b


# ----------------------------------------------------------------------------- participation


def test_a_boolean_participation_is_refused():
    """participation True is neither a count nor a fraction (Python's bool is an int).
    Catches True taken as a count of 1."""
    from gossip_pfl.errors import GossipError
    from gossip_pfl.runtime.participation import participant_count

    for flag in (True, False):
        with pytest.raises(GossipError, match="count or a fraction"):
            participant_count(flag, 8)


def test_star_phases_average_as_the_server_schedule_does():
    """With every client taking part, the runtime's hub weights are the server schedule's
    to the bit (n_i / sum n over the participants). Catches the sizes not normalised first
    as ServerSchedule does."""
    from gossip_pfl.runtime.participation import star_phases

    rng = np.random.default_rng(0)
    for n in rng.integers(2, 30, size=40):
        sizes = rng.integers(1, 5000, size=n).astype(float)  # sample counts
        up, _ = star_phases(np.ones(n, dtype=bool), sizes)
        want = s.ServerSchedule(int(n), weights=sizes).phases(0)[0]
        np.testing.assert_array_equal(up.cols, want.cols)
        np.testing.assert_array_equal(up.weights, want.weights)


# ----------------------------------------------------------------------------- exchange


class _Stub:
    """A transport inside one process: each receive filled from ``posted[(src, dst)]`` (or
    with garbage), ``lost`` ranks reported as lost links."""

    def __init__(self, rank, posted, lost=()):
        import torch

        self.device, self.rank, self.posted, self.lost = torch.device("cpu"), rank, posted, lost

    def exchange(self, sends, recvs, hold=False):
        for src, buf in recvs.items():
            if (src, self.rank) in self.posted and src not in self.lost:
                buf.copy_(self.posted[src, self.rank])
            else:
                buf.fill_(1e3)  # what a link that did not count left there
        stub = type("P", (), {"wait_all": lambda self: None})()
        stub.lost = set(self.lost)
        return stub


def _mix_all(phase: Phase, x: np.ndarray, world: int, lost: dict | None = None):
    """Every rank's rows of the mix of ``x`` through plan_phase and Exchanger (rank r losing
    its links to the ranks ``lost[r]``), and the Exchangers."""
    import torch

    from gossip_pfl.runtime import exchange
    from gossip_pfl.runtime.placement import Placement

    placements = [Placement(phase.size, world, r) for r in range(world)]
    plans = [exchange.plan_phase(phase, p, torch.device("cpu")) for p in placements]
    states = [torch.as_tensor(x[p.peers]) for p in placements]
    posted = {(r, dst): states[r][i] for r in range(world) for dst, i in plans[r].sends.items()}
    out, exchangers = np.zeros_like(x), []
    for r, p in enumerate(placements):
        ex = exchange.Exchanger(p, _Stub(r, posted, (lost or {}).get(r, ())))
        out[p.peers] = ex.mix(states[r], plans[r]).numpy()
        exchangers.append(ex)
    return out, exchangers


@pytest.mark.parametrize("rowwise", [False, True])
def test_a_lost_link_mixes_as_if_its_weight_were_on_the_diagonal(rowwise, monkeypatch):
    """Rank 0 losing its links to rank 1 mixes its rows by W with those links' weights moved
    to the diagonal (numpy's W'), whatever the lost rows' buffer held; rank 1 gets all of
    W x. Catches a lost sender's rows left in the buffer for the product."""
    from gossip_pfl.runtime import exchange

    monkeypatch.setattr(exchange, "ROWWISE_ROWS", 10**6 if rowwise else 0)
    monkeypatch.setattr(exchange, "ROWWISE_LOCAL", 10**6 if rowwise else 0)
    n = 6
    w = wts.metropolis(g.ring(n))
    x = np.random.default_rng(0).standard_normal((n, 4))
    out, _ = _mix_all(Phase.from_dense(w), x, 2, lost={0: (1,)})
    cut = w.copy()
    for i in range(3):
        cut[i, i] += cut[i, 3:].sum()
        cut[i, 3:] = 0.0
    np.testing.assert_allclose(out[:3], (cut @ x)[:3], rtol=0, atol=1e-12)
    np.testing.assert_allclose(out[3:], (w @ x)[3:], rtol=0, atol=1e-12)


def test_traffic_counts_the_bytes_of_the_rows_other_ranks_read():
    """bytes_sent is every row another rank reads with a nonzero weight, times the row's
    bytes (float32: 4 a column), one message a receiving rank; an entry of weight zero
    (listed for the link 1 - 5 here) sends nothing. Catches elements counted as bytes and
    zero weights sent."""
    from gossip_pfl.runtime.placement import Placement

    n, d, world = 8, 5, 2
    w = wts.metropolis(g.ring(n))
    dense = Phase.from_dense(w)
    phase = Phase(n, np.r_[dense.rows, 5, 1], np.r_[dense.cols, 1, 5], np.r_[dense.weights, 0, 0])
    x = np.random.default_rng(1).standard_normal((n, d)).astype(np.float32)
    out, exchangers = _mix_all(phase, x, world)
    np.testing.assert_allclose(out, w @ x, rtol=1e-5, atol=1e-6)
    owner = Placement(n, world).owner(np.arange(n))
    rows, cols = np.nonzero(w)
    for r, ex in enumerate(exchangers):
        needed = {(owner[i], j) for i, j in zip(rows, cols) if owner[j] == r != owner[i]}
        assert ex.bytes_sent == len(needed) * d * 4
        assert ex.messages_sent == len({dst for dst, _ in needed})


# ----------------------------------------------------------------------------- metrics


def test_scores_weigh_training_by_samples_and_stay_finite_without_samples():
    """Training loss is the sample-weighted mean (by hand); with no test samples anywhere
    and no training samples, every figure is still a finite number. Catches the plain mean
    of the losses and a division by a zero count."""
    from gossip_pfl.metrics import score_entries

    train = (np.array([0.5, 2.0]), np.array([0.9, 0.1]), np.array([30, 10]))
    test = (np.array([0.7, 0.8]), np.array([0.6, 0.4]), np.array([4, 6]))
    got = score_entries(train, test)
    assert got["train_loss"] == pytest.approx((0.5 * 30 + 2.0 * 10) / 40)
    empty = (np.zeros(2), np.zeros(2), np.zeros(2, dtype=np.int64))
    got = score_entries(empty, empty)
    assert all(np.isfinite(v) for v in got.values()), got


def test_cluster_recovery_matches_groups_of_the_training_clients_only():
    """Recovery is computed for the training clients picked by train_ids (not the first
    ones), with more true groups than components (best matching by hand), and only for a
    one-hot truth for every client. Catches ids ignored, groups beyond the components and
    a soft truth accepted."""
    from gossip_pfl.metrics import component_recovery

    truth = np.eye(3)[[2, 2, 0, 0, 1, 1]]
    ids = np.array([4, 0, 1, 5])  # groups 1, 2, 2, 1
    assert component_recovery(truth, np.eye(2)[[0, 1, 1, 0]], ids) == 1.0
    # six clients, three groups, two components: at best two groups recovered (4 of 6)
    guess = np.eye(2)[[0, 0, 1, 1, 1, 1]]
    assert component_recovery(truth, guess, np.arange(6)) == pytest.approx(4 / 6)
    soft = truth.copy()
    soft[3] = [0.5, 0.5, 0.0]
    assert component_recovery(soft, guess, np.arange(6)) is None


def test_recovery_entry_is_empty_where_it_does_not_apply():
    """The summary's cluster_recovery: absent without a grouped truth or without mixture
    weights (a one-model run on grouped synthetic data), the share otherwise. Catches a null
    entry written and mixture weights read when there are none."""
    from gossip_pfl.metrics import recovery_entry

    truth, ids = np.eye(2)[[0, 0, 1, 1]], np.arange(4)
    assert recovery_entry(None, np.eye(2)[[0, 0, 1, 1]], ids) == {}
    assert recovery_entry(truth, None, ids) == {}
    assert recovery_entry(truth, np.eye(2)[[1, 1, 0, 0]], ids) == {"cluster_recovery": 1.0}

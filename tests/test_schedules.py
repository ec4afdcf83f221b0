"""Schedules: exact averaging, invariants, random access and sparse neighbours."""

import time

import networkx as nx
import numpy as np
import pytest

from topologies import MixingSchedule, Phase, TopologyError
from topologies import graphs as g
from topologies import schedules as s
from topologies.analysis import round_properties
from topologies.validation import is_doubly_stochastic, is_symmetric, validate_schedule


def product(schedule, rounds):
    w = np.eye(schedule.n)
    for t in range(rounds):
        w = schedule.matrix(t) @ w
    return w


def dense_row(schedule, t, i):
    cols, vals, self_w = schedule.neighbors(t, i)
    assert i not in cols
    row = np.zeros(schedule.n)
    row[cols] = vals
    row[i] = self_w
    return row


def assert_neighbors_match(schedule, rounds, exact=False):
    for t in rounds:
        w = schedule.matrix(t)
        for i in range(schedule.n):
            if exact:
                np.testing.assert_array_equal(dense_row(schedule, t, i), w[i])
            else:
                np.testing.assert_allclose(dense_row(schedule, t, i), w[i], atol=1e-12)


def test_static_dense_and_graph():
    static = s.StaticSchedule(np.full((4, 4), 0.25))
    assert static.period == 1 and not static.is_random and static.symmetric
    ring = s.graph_schedule(8, "ring", weights="max_degree")
    np.testing.assert_allclose(ring.matrix(0)[0, [7, 0, 1]], 1 / 3)
    assert_neighbors_match(ring, [0, 5])
    with pytest.raises(TopologyError, match="row 1 sums to 0.5"):
        s.StaticSchedule(np.array([[1.0, 0.0], [0.25, 0.25]]))


@pytest.mark.parametrize(
    "make, says",
    [  # (numpy's ValueError or Python's TypeError before)
        (lambda: s.StaticSchedule("abc"), "matrix must be numbers, got str"),
        (lambda: s.StaticSchedule([[1, 0], [0]]), "matrix must be numbers, got list"),
        (lambda: s.PeriodicSchedule(None), "periodic items must be a list, got NoneType"),
        (lambda: s.graph_schedule(5, "ring", graph_args=[1]), "graph_args must be a mapping"),
        (lambda: s.graph_schedule(5, "ring", seed="x"), "seed must be an int >= 0, got 'x'"),
        # (a TypeError, an IndexError, NaN errors, False before)
        (lambda: s.graph_schedule(8, "exponential", {"foo": 1}), "exponential: got an unexp"),
        (lambda: s.MatchingSchedule(3, nx.path_graph([1, 2, 3])), "relabel with graphs.from_"),
        (lambda: s.StaticSchedule(_nan_phase()), r"entry \(0, 0\) is not finite: nan"),
        (lambda: is_symmetric(np.eye(2), tol=float("nan")), "tol must be a finite number"),
        (lambda: is_doubly_stochastic(np.eye(2), tol=-1), "tol must be a finite number"),
        (lambda: round_properties(s.StaticSchedule(np.eye(2)), tol=np.nan), "tol must be a"),
        (lambda: s.LinkFailureSchedule(g.ring(5), seed=2**64), r"seed must be < 2\*\*64"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(make, says):
    with pytest.raises(TopologyError, match=says):
        make()


def _nan_phase() -> Phase:
    """A 3-node phase whose rows sum to 1 but for a NaN (NaN passes a sum's check)."""
    return Phase(3, np.array([0, 0, 1, 1, 2, 2]), np.array([0, 1, 0, 1, 2, 1]),
                 np.array([np.nan, 0.5, 0.5, 0.5, 0.5, 0.5]))  # fmt: skip


def test_exponential_schedule_matches_uniform_rule():
    from topologies.weights import uniform

    np.testing.assert_allclose(
        s.graph_schedule(12, "exponential").matrix(0), uniform(g.exponential(12))
    )


@pytest.mark.parametrize("n", [8, 16, 64])
def test_one_peer_exponential_exact_for_powers_of_two(n):
    sched = s.OnePeerExponentialSchedule(n)
    assert sched.period == int(np.log2(n))
    np.testing.assert_allclose(product(sched, sched.period), np.full((n, n), 1 / n), atol=1e-12)
    validate_schedule(sched)
    assert not is_symmetric(sched.matrix(0))
    assert_neighbors_match(sched, range(sched.period), exact=True)


def test_one_peer_exponential_not_exact_for_12():
    sched = s.OnePeerExponentialSchedule(12)
    assert sched.period == 4
    assert is_doubly_stochastic(sched.matrix(1))
    assert not np.allclose(product(sched, sched.period), 1 / 12)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("n", [12, 24, 100, 7, 25])
def test_base_graph_exact_average_with_degree_k(n, k):
    sched = s.BaseGraphSchedule(n, k)
    np.testing.assert_allclose(product(sched, sched.period), np.full((n, n), 1 / n), atol=1e-12)
    for t in range(sched.period):
        w = sched.matrix(t)
        assert is_symmetric(w) and is_doubly_stochastic(w)
        assert ((w > 0).sum(axis=1) - 1).max() <= k
    np.testing.assert_array_equal(sched.matrix(sched.period + 1), sched.matrix(1))


def test_base_graph_small_and_power_cases():
    assert s.BaseGraphSchedule(1).period == 1
    assert s.BaseGraphSchedule(8, 1).period == 3  # hypercube
    assert s.BaseGraphSchedule(9, 2).period == 2  # base-3 hyper-hypercube


def test_link_failure_invariants_and_neighbors():
    sched = s.LinkFailureSchedule(g.erdos_renyi(20, 0.3, seed=1), "metropolis", q=0.3, seed=5)
    validate_schedule(sched, rounds=6)
    assert_neighbors_match(sched, range(6), exact=True)
    off = [(sched.matrix(t) > 0).sum() for t in range(6)]
    assert len(set(off)) > 1  # different edges fail in different rounds
    full = s.LinkFailureSchedule(g.ring(6), "metropolis", q=1.0)
    np.testing.assert_array_equal(full.matrix(3), np.eye(6))


def test_link_failure_rate_and_mean_matrix_are_q_s():
    """Each link fails with probability q, independently: over 300 rounds the share of failed
    links is q within 4 binomial standard deviations, and the mean W_t is the closed form
    E[W_t] = (1 - q) W off the diagonal, W_ii + q sum_{j != i} W_ij on it."""
    q, rounds = 0.3, 300
    sched = s.LinkFailureSchedule(g.erdos_renyi(20, 0.3, seed=1), "metropolis", q=q, seed=5)
    W = s.LinkFailureSchedule(g.erdos_renyi(20, 0.3, seed=1), "metropolis", q=0.0).matrix(0)
    links = np.triu(W, 1) > 0
    mats = np.stack([sched.matrix(t) for t in range(rounds)])
    failed = (mats[:, links] == 0).mean()
    assert abs(failed - q) < 4 * np.sqrt(q * (1 - q) / (rounds * links.sum()))
    off = W - np.diag(np.diag(W))
    expected = (1 - q) * off + np.diag(np.diag(W) + q * off.sum(1))
    se = np.sqrt(q * (1 - q) / rounds)  # a coin's mean's standard error
    bound = 5 * se * (off + np.diag(np.sqrt((off**2).sum(1))))  # each entry's, 5 times
    assert np.all(np.abs(mats.mean(0) - expected) <= bound + 1e-12)


def test_link_failure_rejects_directed():
    with pytest.raises(TopologyError, match="undirected"):
        s.LinkFailureSchedule(g.exponential(8), "uniform", q=0.1)


RANDOM = {
    "random": lambda seed: s.RandomSchedule(12, "erdos_renyi", {"p": 0.4}, seed=seed),
    "matching": lambda seed: s.MatchingSchedule(9, seed=seed),
    "matching_graph": lambda seed: s.MatchingSchedule(9, g.torus(9), seed=seed),
    "link_failure": lambda seed: s.LinkFailureSchedule(g.ring(12), q=0.4, seed=seed),
    "server": lambda seed: s.ServerSchedule(12, participation=0.5, seed=seed),
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_access_and_seeds(name):
    a, b, c = RANDOM[name](3), RANDOM[name](3), RANDOM[name](4)
    assert a.is_random and a.period is None
    fresh = b.matrix(7)
    for t in range(7):
        a.matrix(t)
    np.testing.assert_array_equal(a.matrix(7), fresh)
    assert any(not np.array_equal(a.matrix(t), c.matrix(t)) for t in range(5))
    validate_schedule(a, rounds=4)
    assert_neighbors_match(a, [0, 7])


def test_matching_weights():
    sched = s.MatchingSchedule(7, seed=1)
    w = sched.matrix(0)
    assert sorted(np.diag(w)) == [0.5] * 6 + [1.0]
    assert is_symmetric(w) and is_doubly_stochastic(w)


def test_periodic_cycles_items():
    ring, star = s.graph_schedule(6, "ring"), s.graph_schedule(6, "star")
    per = s.PeriodicSchedule([ring, star])
    assert per.period == 2 and not per.is_random
    np.testing.assert_array_equal(per.matrix(3), star.matrix(0))
    np.testing.assert_array_equal(per.matrix(4), ring.matrix(0))
    mixed = s.PeriodicSchedule([ring, s.OnePeerExponentialSchedule(6)])
    assert mixed.period == 2 * 3
    with pytest.raises(TopologyError, match="different n"):
        s.PeriodicSchedule([ring, np.eye(3)])


def test_server_full_participation_is_one_p():
    sizes = np.array([1.0, 2.0, 3.0, 4.0])
    for hub in ("aggregator", "peer"):
        sched = s.ServerSchedule(4, weights=sizes, hub=hub)
        p = sizes / sizes.sum()
        np.testing.assert_allclose(sched.matrix(0), np.outer(np.ones(4), p))
        np.testing.assert_allclose(MixingSchedule.matrix(sched, 0), sched.matrix(0))
        assert_neighbors_match(sched, [0])
    assert s.ServerSchedule(4, hub="aggregator").phases(0)[0].size == 5
    assert not s.ServerSchedule(4, weights=sizes).doubly_stochastic


@pytest.mark.parametrize("hub", ["aggregator", "peer"])
def test_server_partial_participation(hub):
    sched = s.ServerSchedule(10, participation=0.3, hub=hub, seed=2)
    for t in range(4):
        part = sched.participants(t)
        assert len(part) == 3 and (hub == "aggregator" or 0 in part)
        w = sched.matrix(t)
        np.testing.assert_allclose(MixingSchedule.matrix(sched, t), w)
        for i in set(range(10)) - set(part.tolist()):
            np.testing.assert_array_equal(w[i], np.eye(10)[i])
        np.testing.assert_allclose(w[part][:, part], 1 / 3)
    assert sched.messages(0) == (6 if hub == "aggregator" else 4)


def test_server_errors():
    with pytest.raises(TopologyError, match="hub must be"):
        s.ServerSchedule(4, hub="cloud")
    with pytest.raises(TopologyError, match="participation must be in"):
        s.ServerSchedule(4, participation=0)
    with pytest.raises(TopologyError, match="sizes must have n=4 entries"):
        s.ServerSchedule(4, weights=[1, 2])


@pytest.mark.parametrize(
    "make, degree",
    [
        (lambda n: s.graph_schedule(n, "ring"), 2),
        (lambda n: s.graph_schedule(n, "exponential"), 17),
        (lambda n: s.graph_schedule(n, "random_regular", {"d": 4}, seed=0), 4),
        (lambda n: s.OnePeerExponentialSchedule(n), 1),
    ],
)
def test_neighbors_at_n_100000(make, degree):
    n = 100_000
    start = time.perf_counter()
    sched = make(n)
    for i in (0, 1, 54_321, n - 1):
        cols, vals, self_w = sched.neighbors(3, i)
        assert len(cols) == degree and i not in cols
        assert self_w + vals.sum() == pytest.approx(1.0)
    assert time.perf_counter() - start < 10
    cols, _, _ = sched.neighbors(3, 54_321)
    if degree == 2:
        assert sorted(cols.tolist()) == [54_320, 54_322]
    if degree == 1:
        assert cols.tolist() == [54_321 - 8]
    if degree == 17:
        assert sorted(cols.tolist()) == sorted((54_321 - 2**j) % n for j in range(17))


def test_names_and_flags():
    assert s.BaseGraphSchedule(12, 2).name == "base(n=12, k=2)"
    assert s.OnePeerExponentialSchedule(16).name == "one_peer_exponential(n=16)"
    assert "ring(n=8)" in s.graph_schedule(8, "ring").name
    with pytest.raises(TopologyError, match="random family"):
        s.RandomSchedule(8, "ring")


def test_a_phase_held_by_rows_sums_its_duplicates_in_their_order():
    """A schedule's rows (CSR from a phase's triplets): entries sorted by row and column, a
    duplicated entry summed in the order given (the bits of numpy's bincount over the
    triplets), a row that receives nothing keeping its value (self weight 1)."""
    rng = np.random.default_rng(5)
    n, m = 12, 150
    rows, cols = rng.integers(0, n - 2, m), rng.integers(0, n, m)  # (the last two: nothing)
    vals = rng.standard_normal(m) * 10.0 ** rng.integers(-8, 8, m)  # (the order shows)
    held = s._Rows(s.Phase(n, rows, cols, vals))
    key = rows * n + cols
    for k in np.unique(key):
        [at] = np.flatnonzero(held.rows * n + held.cols == k)
        want = np.bincount(np.zeros(int((key == k).sum()), np.int64), weights=vals[key == k])
        assert held.vals[at] == want[0]
    assert np.all(np.diff(held.rows * n + held.cols) > 0) and len(held.vals) < m
    for i in range(n):
        nbrs, weights, self_w = held.row(i)
        own = (rows == i) & (cols == i)
        assert np.isclose(self_w, vals[own].sum() if (rows == i).any() else 1.0)
        assert set(nbrs.tolist()) == set(cols[(rows == i) & (cols != i)].tolist())


def test_a_pair_given_twice_is_one_message():
    """Phase.messages counts (sender, receiver) pairs of nonzero summed weight: a pair given
    in two entries once, one whose entries cancel not at all, self weights never."""
    rows, cols = np.array([0, 0, 1, 1, 1, 2, 2]), np.array([1, 1, 0, 2, 2, 2, 0])
    weights = np.array([0.25, 0.25, 0.5, 0.5, -0.5, 1.0, 0.0])
    assert s.Phase(3, rows, cols, weights).messages == 2  # (0, 1) and (1, 0)
    rng = np.random.default_rng(1)
    for _ in range(20):  # against the dense matrix's off-diagonal nonzeros, sorted rows too
        n, m = 7, 30
        phase = s.Phase(n, rng.integers(0, n, m), rng.integers(0, n, m), rng.random(m))
        dense = phase.dense()
        want = np.count_nonzero(dense - np.diag(np.diag(dense)))
        assert phase.messages == want == s._Rows(phase).phase().messages


def test_a_matching_on_a_graph_is_the_greedy_one_edge_by_edge():
    """A random maximal matching of a graph's edges is the one that visiting the edges in the
    round's random order and taking each whose ends are both free makes (the Python loop it
    was), for graphs sparse and dense, whichever way round an edge is listed."""

    def one_by_one(edges: np.ndarray, n: int, seed: int, t: int) -> np.ndarray:
        partner = np.full(n, -1)
        rng = np.random.default_rng([seed, t])
        for u, v in edges[rng.permutation(len(edges))].tolist():
            if partner[u] < 0 and partner[v] < 0:
                partner[u], partner[v] = v, u
        return partner

    # (the last two have no edge: nobody pairs)
    for graph in (g.ring(9), g.erdos_renyi(40, 0.3, seed=1), g.erdos_renyi(120, 0.6, seed=2),
                  nx.relabel_nodes(g.torus(16), lambda k: 15 - k),
                  nx.empty_graph(4), nx.Graph([(0, 0), (1, 1)])):  # fmt: skip
        schedule = s.MatchingSchedule(graph.number_of_nodes(), graph, seed=5)
        edges = [e for e in graph.edges() if e[0] != e[1]]
        edges = np.array(edges, dtype=np.int64).reshape(-1, 2)
        for t in range(6):
            want = one_by_one(edges, graph.number_of_nodes(), 5, t)
            np.testing.assert_array_equal(schedule.partners(t), want)


def test_rows_keep_no_negative_zero():
    """A weight of -0.0 is held as +0.0, as numpy's bincount summed it (0.0 + w) before the
    rows' single sort."""
    held = s._Rows(s.Phase(2, np.array([1, 0]), np.array([1, 0]), np.array([-0.0, 1.0])))
    assert not np.signbit(held.vals).any() and held.vals.tolist() == [1.0, 0.0]

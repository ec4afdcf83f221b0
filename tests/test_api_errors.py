"""The topologies API on bad arguments: a one-line TopologyError naming the argument, where
these gave a plausible wrong answer, a raw NumPy / networkx exception, or a different graph
on every call."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

import topologies as T
from topologies import analysis as A
from topologies import schedules as S

SCHEDULES = {
    "static ring": lambda: S.graph_schedule(6, "ring"),
    "random": lambda: S.RandomSchedule(6, "erdos_renyi", {"p": 0.5}, seed=1),
    "matching": lambda: S.MatchingSchedule(6),
    "periodic": lambda: S.PeriodicSchedule([S.graph_schedule(6, "ring")] * 2),
    "one-peer exponential": lambda: S.OnePeerExponentialSchedule(6),
    "server": lambda: S.ServerSchedule(6),
    "explicit": lambda: A.ExplicitSchedule([np.full((6, 6), 1 / 6)]),
    "link failure": lambda: S.LinkFailureSchedule(T.ring(6), q=0.2),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_neighbors_and_matrix_check_the_peer_and_round(name):
    s = SCHEDULES[name]()
    # -1 read peer 5's row through NumPy's indexing; 6 a made-up isolated peer
    for i in (-1, 6, None, 1.0):
        with pytest.raises(T.TopologyError, match=r"peer i must be in 0\.\.5"):
            s.neighbors(0, i)
    # a negative, fractional or huge round was a NumPy error (a seed, an index, an overflow)
    for t in (-1, 1.5, 2**70, None):
        for call in (s.matrix, s.phases, s.messages, lambda t: s.neighbors(t, 0)):
            with pytest.raises(T.TopologyError, match=r"round t must be an int in \[0, 2\*\*48\)"):
                call(t)
    idx, w, self_w = s.neighbors(0, 5)  # the last peer is still fine
    np.testing.assert_allclose(s.matrix(0)[5, idx], w)
    assert s.matrix(0)[5, 5] == pytest.approx(self_w)


def test_consensus_run_takes_x0_of_shape_n_or_n_by_dim_only():
    s = S.graph_schedule(8, "ring")
    for bad in (np.arange(16.0), np.ones((4, 8)), np.arange(5.0)):  # reshaped, or a raw error
        with pytest.raises(T.TopologyError, match="x0 must have shape"):
            A.consensus_run(s, 3, x0=bad)
    with pytest.raises(T.TopologyError, match="rounds must be an int >= 0"):
        A.consensus_run(s, 2.5)
    with pytest.raises(T.TopologyError, match="x0 must be finite numbers"):
        A.consensus_run(s, 3, x0=np.full(8, np.nan))
    a = A.consensus_run(s, 3, x0=np.arange(8.0))
    b = A.consensus_run(s, 3, x0=np.arange(8.0)[:, None])
    np.testing.assert_array_equal(a.errors, b.errors)


def test_a_random_family_is_the_same_graph_every_call():
    a, b = (S.graph_schedule(12, "erdos_renyi", {"p": 0.4}) for _ in range(2))
    np.testing.assert_array_equal(a.matrix(0), b.matrix(0))  # drew from the OS before
    assert S.graph_schedule(12, "erdos_renyi", {"p": 0.4}, seed=5).seed == 5
    with pytest.raises(T.TopologyError, match="seed is the schedule's seed"):
        S.graph_schedule(12, "erdos_renyi", {"p": 0.4, "seed": 3})  # was overwritten, silently


def test_weight_rules_check_their_graph():
    two = nx.Graph([(0, 1), (2, 3)])
    for rule in (T.best_constant, T.fmmc):  # best_constant gave a permutation here
        with pytest.raises(T.TopologyError, match="needs a connected graph, got 2 components"):
            rule(two)
    np.testing.assert_allclose(T.metropolis(two).sum(0), 1)  # still doubly stochastic
    for rule in (T.metropolis, T.best_constant, T.uniform):
        with pytest.raises(T.TopologyError, match="empty graph"):
            rule(nx.Graph())
        with pytest.raises(T.TopologyError, match="needs nodes 0..n-1"):
            rule(nx.cycle_graph(["a", "b", "c"]))
    with pytest.raises(T.TopologyError, match="needs a simple graph"):  # edges counted twice
        T.metropolis(nx.MultiGraph([(0, 1), (0, 1), (1, 2)]))


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"n": 4, "graph": "ring", "weights": ["metropolis"]}, "weights: unknown weight rule"),
        ({"n": 4, "graph": "ring", "time_varying": {"kind": ["random"]}}, "unknown kind"),
        ({"n": 4, "graph": "server", "graph_args": {"sizes": "abc"}}, "sizes must be 4 numbers"),
        ({"graph": nx.DiGraph([(0, 1), (1, 2), (2, 0)]), "weights": "metropolis"},
         "DiGraph (n=3) is directed"),  # it named the exponential family
    ],
)  # fmt: skip
def test_spec_values_of_the_wrong_kind(spec, words):
    with pytest.raises(T.TopologyError) as err:
        T.schedule_from_spec(spec)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_huge_server_sizes_do_not_overflow():
    w = S.ServerSchedule(4, weights=[1e308, 1e308, 1, 1]).matrix(0)  # it was all NaN
    np.testing.assert_allclose(w[0], [0.5, 0.5, 0, 0], atol=1e-300)


def test_load_graph_of_an_npz_or_a_binary_file(tmp_path):
    np.savez(tmp_path / "w.npz", W=np.eye(3)[None])
    with pytest.raises(T.TopologyError, match="an .npz holds mixing matrices"):
        T.load_graph(tmp_path / "w.npz")
    (tmp_path / "latin.txt").write_bytes(b"0 1\n1 \xe9\n")
    with pytest.raises(T.TopologyError, match=r"latin.txt: not a text \(UTF-8\) edge list"):
        T.load_graph(tmp_path / "latin.txt")


def test_validation_and_rho_on_what_is_no_matrix():
    assert not T.is_doubly_stochastic("ab") and not T.is_square([[1, 0], [0]])  # raw errors
    assert not T.is_square(np.zeros((0, 0)))  # was True
    # a NaN tol passed every check, then read as False: a bad tol is an error
    with pytest.raises(T.TopologyError, match="tol must be a finite number >= 0"):
        T.is_doubly_stochastic([[2.0]], tol=float("nan"))
    with pytest.raises(T.TopologyError, match="tol must be a finite number >= 0"):
        T.validation.check_symmetric(np.eye(2), tol=-1)
    for bad in (np.ones((2, 3)), np.zeros((0, 0)), [1, 2]):  # rho 1.22, a ZeroDivisionError...
        with pytest.raises(T.TopologyError, match="matrix must be square"):
            A.rho(bad)
    with pytest.raises(T.TopologyError, match="horizon must be a positive number"):
        A.connectivity_tau(S.graph_schedule(6, "ring"), horizon=None)


def test_graph_families_check_their_seed():
    for seed in (-1, "a", 1.5):  # NumPy's raw errors
        with pytest.raises(T.TopologyError, match="seed must be an int >= 0 or None"):
            T.erdos_renyi(10, 0.5, seed=seed)


def test_npz_errors_are_not_wrapped_twice(tmp_path):
    np.savez(tmp_path / "x.npz", X=np.eye(2))
    with pytest.raises(T.TopologyError) as err:
        T.spec.load_npz(tmp_path / "x.npz")
    assert str(err.value) == f"{tmp_path / 'x.npz'}: no array 'W' (found X)"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # each was NumPy's or Python's own error (a seed, a shape, a comparison with None)
        (lambda s: A.consensus_run(s, 5, dim=-1), r"dim must be an int >= 1, got -1"),
        (lambda s: A.consensus_run(s, 5, dim=1.5), r"dim must be an int >= 1, got 1.5"),
        (lambda s: A.consensus_run(s, 5, seed=-1), r"seed must be an int >= 0, got -1"),
        (lambda s: A.estimate_p(s, 2, trials=None), r"trials must be an int >= 1, got None"),
        (lambda s: A.estimate_p(s, 1.5), r"tau must be an int >= 1, got 1.5"),
        (lambda s: A.window_contraction(s, 1.5), r"tau must be an int >= 1, got 1.5"),
        (lambda s: A.describe(s, horizon=10, trials=1.5), r"trials must be an int >= 1"),
        (lambda s: A.describe(s, horizon=10, seed=-1), r"seed must be an int >= 0"),
        (lambda s: A.check_mixing(s, None), r"horizon must be a positive number of rounds"),
        (lambda s: T.validate_schedule(s, 1.5), r"rounds must be an int >= 1, got 1.5"),
    ],
)
def test_analysis_arguments_are_checked(call, message):
    with pytest.raises(T.TopologyError, match=message):
        call(S.graph_schedule(6, "ring"))

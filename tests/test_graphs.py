"""Graph families and loaders."""

import networkx as nx
import numpy as np
import pytest

from topologies import TopologyError
from topologies import graphs as g


@pytest.mark.parametrize(
    "family, args, n, edges",
    [
        ("complete", {}, 5, 10),
        ("ring", {}, 6, 6),
        ("path", {}, 6, 5),
        ("star", {}, 6, 5),
        ("torus", {}, 16, 32),
        ("torus", {"rows": 3}, 12, 24),
        ("hypercube", {}, 16, 32),
        ("exponential", {}, 16, 64),
        ("exponential", {"k": 3}, 10, 30),
    ],
)
def test_deterministic_families(family, args, n, edges):
    graph = g.GRAPH_FAMILIES[family](n, **args)
    assert sorted(graph.nodes()) == list(range(n))
    assert graph.number_of_edges() == edges


def test_exponential_is_directed_shift():
    graph = g.exponential(12)
    assert graph.is_directed()
    assert sorted(graph.successors(5)) == sorted((5 + s) % 12 for s in (1, 2, 4, 8))


@pytest.mark.parametrize(
    "family, args",
    [
        ("erdos_renyi", {"p": 0.4}),
        ("random_regular", {"d": 3}),
        ("small_world", {"k": 4, "p": 0.2}),
    ],
)
def test_random_families_seeded_and_connected(family, args):
    fn = g.GRAPH_FAMILIES[family]
    a, b, c = fn(20, **args, seed=1), fn(20, **args, seed=1), fn(20, **args, seed=2)
    assert nx.is_connected(a)
    assert sorted(a.edges()) == sorted(b.edges())
    assert sorted(a.edges()) != sorted(c.edges())


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: g.ring(2), "ring needs n >= 3"),
        (lambda: g.star(1), "star needs n >= 2"),
        (lambda: g.hypercube(12), "power of 2"),
        (lambda: g.torus(12), "not a perfect square"),
        (lambda: g.torus(12, rows=5), "rows * cols == n"),
        (lambda: g.ring(3.5), "int n"),
        (lambda: g.erdos_renyi(10, 1.5), "p must be in (0, 1]"),
        (lambda: g.erdos_renyi(30, 0.01, seed=0, max_tries=3), "disconnected in all 3 tries"),
        (lambda: g.random_regular(5, 3), "n * d even"),
        (lambda: g.random_regular(5, 5), "d < n"),
        (lambda: g.small_world(10, 12, 0.1), "k < n"),
    ],
)
def test_family_errors(call, words):
    with pytest.raises(TopologyError, match=None) as err:
        call()
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def _networkx_erdos_renyi(n: int, p: float, seed: int) -> tuple[nx.Graph, int]:
    """The reference: networkx's G(n, p) redrawn until connected, as erdos_renyi was written
    (its seeds, one per try); and the tries it took."""
    for tries, s in enumerate(g._seeds(seed, 100), start=1):
        graph = nx.gnp_random_graph(n, p, seed=s)
        if nx.is_connected(graph):
            return graph, tries
    raise AssertionError("never connected")


@pytest.mark.parametrize("chunk", [g._CHUNK, 7])  # 7: coins in blocks that split rows
def test_erdos_renyi_coins_are_networkxs(monkeypatch, chunk):
    """The edges drawn as arrays are networkx's gnp_random_graph's for the same seed, in its
    order; and the array connectivity check is networkx's, connected or not."""
    monkeypatch.setattr(g, "_CHUNK", chunk)
    connected = set()
    for n in (2, 3, 17, 40, 120):
        for p in (0.02, 0.1, 0.3, 0.5, 0.97, 1.0):
            for s in g._seeds(n, 3):
                ref = nx.gnp_random_graph(n, p, seed=s)
                u, v = g._gnp_edges(n, p, s)
                assert list(zip(u.tolist(), v.tolist())) == list(ref.edges()), (n, p, s)
                assert g._connected(n, u, v) is nx.is_connected(ref), (n, p, s)
                connected.add(nx.is_connected(ref))
    assert connected == {True, False}


def test_erdos_renyi_is_the_networkx_redraw_loops_graph():
    """erdos_renyi gives the graph networkx's loop gave (nodes, edges in order, attributes),
    those that took several draws to connect too; and a random schedule's round is that
    graph's weights to the bit, without building it (metropolis, max_degree)."""
    from topologies.schedules import RandomSchedule, _round_seed, _Rows
    from topologies.weights import weight_rule

    redrawn = 0
    for n, p in ((30, 0.1), (120, 0.5), (200, 0.03)):
        for seed in range(4):
            ref, tries = _networkx_erdos_renyi(n, p, seed)
            graph = g.erdos_renyi(n, p, seed=seed)
            assert list(graph.nodes()) == list(ref.nodes()) and graph.graph == ref.graph
            assert list(graph.edges()) == list(ref.edges()), (n, p, seed)
            redrawn += tries > 1
    assert redrawn >= 2
    for rule in ("metropolis", "max_degree"):
        schedule = RandomSchedule(30, "erdos_renyi", {"p": 0.15}, weights=rule, seed=3)
        for t in range(4):
            ref, _ = _networkx_erdos_renyi(30, 0.15, _round_seed(3, t))
            want = _Rows(weight_rule(rule)(ref, sparse=True)).phase()
            [got] = schedule.phases(t)
            assert np.array_equal(got.rows, want.rows) and np.array_equal(got.cols, want.cols)
            assert np.array_equal(got.weights, want.weights), (rule, t)


def test_from_adjacency():
    a = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]])
    graph = g.from_adjacency(a)
    assert not graph.is_directed() and graph.number_of_edges() == 2
    directed = g.from_adjacency(np.roll(np.eye(3), 1, axis=1))
    assert directed.is_directed()


@pytest.mark.parametrize(
    "a, words",
    [
        (np.ones((2, 3)), "must be square"),
        (np.array([[0, -1], [-1, 0]]), "negative entry at (0, 1)"),
        (np.zeros((4, 4)), "graph is disconnected (4 components)"),
        (np.kron(np.eye(2), np.ones((2, 2))), "graph is disconnected (2 components)"),
        (np.array([["a", "b"], ["c", "d"]]), "adjacency matrix must be numeric"),  # a traceback
    ],
)
def test_from_adjacency_errors(a, words):
    with pytest.raises(TopologyError) as err:
        g.from_adjacency(a)
    assert words in str(err.value)


def test_from_adjacency_symmetric_required():
    """Its nonzeros' pattern: the values are not read (a weight rule sets the weights)."""
    with pytest.raises(TopologyError, match=r"has edge \(0, 1\) but not \(1, 0\)"):
        g.from_adjacency(np.array([[0, 1], [0, 0]]), directed=False)
    path = g.from_adjacency(np.array([[0, 1, 0], [2, 0, 3], [0, 1, 0]]))
    assert not path.is_directed() and sorted(path.edges()) == [(0, 1), (1, 2)]


def test_from_networkx_relabels():
    graph = g.from_networkx(nx.Graph([("x", "y"), ("y", "z"), ("z", "z")]))
    assert sorted(graph.nodes()) == [0, 1, 2]
    assert graph.number_of_edges() == 2  # self-loop dropped
    with pytest.raises(TopologyError, match="disconnected"):
        g.from_networkx(nx.Graph([(0, 1), (2, 3)]))


def test_load_graph_edge_list_and_npy(tmp_path):
    f = tmp_path / "g.txt"
    f.write_text("# square\n0 1\n1 2  # comment\n2 3\n3 0 0.5\n\n")
    assert g.load_graph(f).number_of_edges() == 4
    np.save(tmp_path / "a.npy", nx.to_numpy_array(g.ring(5)))
    assert g.load_graph(tmp_path / "a.npy").number_of_edges() == 5


def test_load_graph_errors(tmp_path):
    with pytest.raises(TopologyError, match="graph file not found: .*nope.txt"):
        g.load_graph(tmp_path / "nope.txt")
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1\n1 x\n")
    with pytest.raises(TopologyError, match="bad.txt: line 2: expected 'u v'"):
        g.load_graph(bad)
    np.save(tmp_path / "names.npy", np.array([["a", "b"], ["c", "d"]]))
    with pytest.raises(TopologyError, match="names.npy: adjacency matrix must be numeric"):
        g.load_graph(tmp_path / "names.npy")
    split = tmp_path / "split.txt"
    split.write_text("0 1\n2 3\n")
    with pytest.raises(TopologyError, match=r"split.txt: graph is disconnected \(2 components\)"):
        g.load_graph(split)

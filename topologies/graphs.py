"""Graph families and loaders. Every function returns a connected networkx graph on ``0 .. n-1``.

The families read like :mod:`networkx.generators`: ``family(n, <structural args>, seed=None)``,
validated up front with one-line :class:`~topologies.TopologyError` messages. Random families
are reproducible from ``seed``; every graph is checked to be connected (strongly connected for
the directed :func:`exponential` graph).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import networkx as nx
import numpy as np

from topologies._base import TopologyError, _complex, _connected, _is_int, _npy_why

__all__ = [
    "GRAPH_FAMILIES",
    "complete",
    "ring",
    "path",
    "star",
    "torus",
    "hypercube",
    "exponential",
    "erdos_renyi",
    "random_regular",
    "small_world",
    "from_adjacency",
    "from_networkx",
    "node_labels",
    "load_graph",
]


# ----------------------------------------------------------------------------- helpers


def _check_int(name: str, value, minimum: int) -> int:
    if not _is_int(value):
        raise TopologyError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise TopologyError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_n(family: str, n, minimum: int) -> int:
    if not _is_int(n):
        raise TopologyError(f"{family} needs an int n, got {n!r}")
    if n < minimum:
        raise TopologyError(f"{family} needs n >= {minimum}, got n={n}")
    return int(n)


def _check_prob(name: str, p, *, allow_zero: bool) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)):
        raise TopologyError(f"{name} must be a number in [0, 1], got {p!r}")
    low_ok = p >= 0 if allow_zero else p > 0
    if not (low_ok and p <= 1):
        bound = "[0, 1]" if allow_zero else "(0, 1]"
        raise TopologyError(f"{name} must be in {bound}, got {p}")
    return float(p)


def _require_connected(g: nx.Graph) -> nx.Graph:
    if g.number_of_nodes() == 0:
        raise TopologyError("graph has no nodes")
    if g.is_directed():
        k = nx.number_strongly_connected_components(g)
        if k > 1:
            raise TopologyError(f"directed graph is not strongly connected ({k} components)")
    else:
        k = nx.number_connected_components(g)
        if k > 1:
            raise TopologyError(f"graph is disconnected ({k} components)")
    return g


def _seeds(seed, count: int):
    """Independent integer seeds for networkx, one per try, all derived from ``seed``."""
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise TopologyError(f"seed must be an int >= 0 or None, got {seed!r}")
    rng = np.random.default_rng(seed)
    return (int(s) for s in rng.integers(0, 2**63 - 1, size=count))


# ----------------------------------------------------------------------------- deterministic


def complete(n: int) -> nx.Graph:
    """Complete graph: every peer is connected to every other peer.

    Parameters
    ----------
    n : int
        Number of nodes, ``n >= 1``.

    Examples
    --------
    >>> complete(4).number_of_edges()
    6
    """
    return nx.complete_graph(_check_n("complete", n, 1))


def ring(n: int) -> nx.Graph:
    """Cycle ``0 - 1 - ... - (n-1) - 0``; needs ``n >= 3`` (smaller rings are paths).

    Parameters
    ----------
    n : int
        Number of nodes, ``n >= 3``.

    Examples
    --------
    >>> sorted(ring(5).neighbors(0))
    [1, 4]
    """
    return nx.cycle_graph(_check_n("ring", n, 3))


def path(n: int) -> nx.Graph:
    """Path ``0 - 1 - ... - (n-1)``.

    Parameters
    ----------
    n : int
        Number of nodes, ``n >= 1``.

    Examples
    --------
    >>> path(4).number_of_edges()
    3
    """
    return nx.path_graph(_check_n("path", n, 1))


def star(n: int) -> nx.Graph:
    """Star with hub ``0`` connected to the leaves ``1 .. n-1``.

    Parameters
    ----------
    n : int
        Number of nodes including the hub, ``n >= 2``.

    Examples
    --------
    >>> star(5).degree(0)
    4
    """
    return nx.star_graph(_check_n("star", n, 2) - 1)


def torus(n: int, rows: int | None = None, cols: int | None = None) -> nx.Graph:
    """2-D torus (periodic grid) with node ``r * cols + c`` at row ``r``, column ``c``.

    Parameters
    ----------
    n : int
        Number of nodes, ``n = rows * cols``.
    rows, cols : int, optional
        Grid shape, each ``>= 3`` (smaller sides would create double edges). Give one, both,
        or neither (then ``n`` must be a perfect square).

    Examples
    --------
    >>> g = torus(12, rows=3)
    >>> sorted(g.neighbors(0))
    [1, 3, 4, 8]
    """
    n = _check_n("torus", n, 9)
    rows, cols = _torus_shape(n, rows, cols)
    g = nx.Graph()
    g.add_nodes_from(range(n))
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            g.add_edge(i, r * cols + (c + 1) % cols)
            g.add_edge(i, ((r + 1) % rows) * cols + c)
    return g


def _torus_shape(n: int, rows, cols) -> tuple[int, int]:
    if rows is None and cols is None:
        side = math.isqrt(n)
        if side * side != n:
            raise TopologyError(f"torus needs rows or cols when n={n} is not a perfect square")
        rows = cols = side
    elif rows is None:
        cols = _check_int("cols", cols, 3)
        rows = n // cols
    elif cols is None:
        rows = _check_int("rows", rows, 3)
        cols = n // rows
    if rows * cols != n:
        raise TopologyError(f"torus needs rows * cols == n, got {rows} * {cols} != {n}")
    return _check_int("rows", rows, 3), _check_int("cols", cols, 3)


def hypercube(n: int) -> nx.Graph:
    """Hypercube: ``i`` and ``j`` are connected when they differ in exactly one bit.

    Parameters
    ----------
    n : int
        Number of nodes, a power of two ``>= 2``.

    Examples
    --------
    >>> sorted(hypercube(8).neighbors(0))
    [1, 2, 4]
    """
    n = _check_n("hypercube", n, 2)
    if n & (n - 1):
        raise TopologyError(f"hypercube needs n to be a power of 2, got n={n}")
    g = nx.Graph()
    g.add_nodes_from(range(n))
    for b in range(n.bit_length() - 1):
        g.add_edges_from((i, i ^ (1 << b)) for i in range(n) if not i & (1 << b))
    return g


def _exponential_offsets(n: int, k: int = 2) -> list[int]:
    """The shifts ``k^0, k^1, ...`` below ``n`` used by the exponential graph (helper)."""
    offsets, step = [], 1
    while step < n:
        offsets.append(step)
        step *= k
    return offsets


def exponential(n: int, k: int = 2) -> nx.DiGraph:
    """Static base-``k`` exponential graph: directed edges ``i -> (i + k^j) mod n``.

    Every node has ``ceil(log_k n)`` out- and in-neighbours, so uniform weights
    (:func:`topologies.weights.uniform`) are doubly stochastic but not symmetric.

    Parameters
    ----------
    n : int
        Number of nodes, ``n >= 2``.
    k : int, default 2
        Base of the exponents, ``k >= 2``.

    Examples
    --------
    >>> sorted(exponential(8).successors(0))
    [1, 2, 4]
    """
    n = _check_n("exponential", n, 2)
    k = _check_int("k", k, 2)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for step in _exponential_offsets(n, k):
        g.add_edges_from((i, (i + step) % n) for i in range(n))
    return g


# ----------------------------------------------------------------------------- random


def erdos_renyi(n: int, p: float, seed=None, *, max_tries: int = 100) -> nx.Graph:
    """Erdos-Renyi ``G(n, p)`` graph, re-drawn until connected.

    Parameters
    ----------
    n : int
        Number of nodes, ``n >= 2``.
    p : float
        Edge probability in ``(0, 1]``.
    seed : int or None
        Seed of the draws; the same seed gives the same graph.
    max_tries : int, default 100
        Draws before giving up with a :class:`~topologies.TopologyError`.

    Examples
    --------
    >>> g = erdos_renyi(16, 0.5, seed=0)
    >>> g.number_of_nodes(), nx.is_connected(g)
    (16, True)
    """
    u, v = _erdos_renyi_edges(n, p, seed, max_tries=max_tries)
    g = nx.empty_graph(_check_n("erdos_renyi", n, 2))  # (as networkx builds it)
    g.add_edges_from(zip(u.tolist(), v.tolist()))
    return g


def _erdos_renyi_edges(
    n: int, p: float, seed=None, *, max_tries: int = 100
) -> tuple[np.ndarray, np.ndarray]:
    """The edges ``u < v`` of :func:`erdos_renyi`'s graph, in the order networkx lists them,
    without building the graph (a random schedule's weights need only its edges)."""
    n = _check_n("erdos_renyi", n, 2)
    p = _check_prob("p", p, allow_zero=False)
    max_tries = _check_int("max_tries", max_tries, 1)
    for s in _seeds(seed, max_tries):
        u, v = _gnp_edges(n, p, s)
        if _connected(n, u, v):
            return u, v
    hint = math.log(n) / n
    raise TopologyError(
        f"erdos_renyi(n={n}, p={p}) was disconnected in all {max_tries} tries; "
        f"use p well above ln(n)/n = {hint:.3g}"
    )


#: coins drawn at a time by :func:`_gnp_edges` (32 MiB of doubles)
_CHUNK = 2**22


def _gnp_edges(n: int, p: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The edges ``u < v`` of ``nx.gnp_random_graph(n, p, seed=seed)`` in its order, as arrays.

    networkx tosses one coin ``random.Random(seed).random() < p`` per pair, pairs in
    ``itertools.combinations`` order, and adds each edge to a graph in Python: 23 ms at
    n = 300, 0.3 s at n = 3,000, a round of a random schedule. NumPy's legacy generator is the
    same Mersenne Twister making its doubles the same way (two 32-bit words, 53 bits), so with
    the state of Python's generator it tosses the same coins as arrays. Python keeps
    ``random()``'s sequence for a seed and NumPy freezes ``RandomState``'s;
    tests/test_graphs.py checks the edges against networkx's."""
    if p >= 1:  # (networkx: the complete graph, no coins)
        u, v = np.triu_indices(n, 1)
        return u.astype(np.int64), v.astype(np.int64)
    words = random.Random(seed).getstate()[1]  # (624 words of state, then the position)
    coins = np.random.RandomState()
    coins.set_state(("MT19937", np.array(words[:-1], dtype=np.uint32), words[-1]))
    lengths = np.arange(n - 1, 0, -1, dtype=np.int64)  # row i: pairs (i, i+1..n-1)
    ends = np.cumsum(lengths)  # coins tossed by the end of row i
    us, vs, row = [], [], 0
    while row < n - 1:  # a block of rows at a time
        first = int(ends[row - 1]) if row else 0
        stop = max(row + 1, int(np.searchsorted(ends, first + _CHUNK, side="right")))
        hit = np.flatnonzero(coins.random_sample(int(ends[stop - 1]) - first) < p) + first
        i = np.searchsorted(ends, hit, side="right")
        us.append(i)
        vs.append(i + 1 + hit - (ends[i] - lengths[i]))
        row = stop
    return np.concatenate(us).astype(np.int64), np.concatenate(vs).astype(np.int64)


def random_regular(n: int, d: int, seed=None, *, max_tries: int = 100) -> nx.Graph:
    """Uniform random ``d``-regular graph, re-drawn until connected.

    Parameters
    ----------
    n : int
        Number of nodes, ``n >= 2``.
    d : int
        Degree, ``1 <= d < n`` with ``n * d`` even (``d >= 3`` is connected w.h.p.).
    seed : int or None
        Seed of the draws.
    max_tries : int, default 100
        Draws before giving up.

    Examples
    --------
    >>> g = random_regular(10, 3, seed=1)
    >>> {deg for _, deg in g.degree()}
    {3}
    """
    n = _check_n("random_regular", n, 2)
    d = _check_int("d", d, 1)
    if d >= n:
        raise TopologyError(f"random_regular needs d < n, got d={d}, n={n}")
    if (n * d) % 2:
        raise TopologyError(f"random_regular needs n * d even, got n={n}, d={d}")
    max_tries = _check_int("max_tries", max_tries, 1)
    for s in _seeds(seed, max_tries):
        g = nx.random_regular_graph(d, n, seed=s)
        if nx.is_connected(g):
            return g
    raise TopologyError(
        f"random_regular(n={n}, d={d}) was disconnected in all {max_tries} tries; use d >= 3"
    )


def small_world(n: int, k: int, p: float, seed=None, *, max_tries: int = 100) -> nx.Graph:
    """Connected Watts-Strogatz small-world graph.

    Parameters
    ----------
    n : int
        Number of nodes, ``n >= 3``.
    k : int
        Each node starts joined to its ``k`` nearest ring neighbours (``2 <= k < n``; odd ``k``
        acts as ``k - 1``).
    p : float
        Rewiring probability in ``[0, 1]``.
    seed : int or None
        Seed of the draws.
    max_tries : int, default 100
        Draws before giving up.

    Examples
    --------
    >>> g = small_world(20, 4, 0.1, seed=0)
    >>> g.number_of_edges()
    40
    """
    n = _check_n("small_world", n, 3)
    k = _check_int("k", k, 2)
    if k >= n:
        raise TopologyError(f"small_world needs k < n, got k={k}, n={n}")
    p = _check_prob("p", p, allow_zero=True)
    max_tries = _check_int("max_tries", max_tries, 1)
    s = next(_seeds(seed, 1))
    try:
        return nx.connected_watts_strogatz_graph(n, k, p, tries=max_tries, seed=s)
    except nx.NetworkXError:
        raise TopologyError(
            f"small_world(n={n}, k={k}, p={p}) was disconnected in all {max_tries} tries"
        ) from None


# ----------------------------------------------------------------------------- loaders


def from_adjacency(adjacency, *, directed: bool | None = None) -> nx.Graph:
    """Graph from an adjacency matrix; nonzero off-diagonal entries are edges.

    Parameters
    ----------
    adjacency : array_like
        Square, finite, non-negative matrix. Entry ``(i, j)`` is the edge ``i -> j``.
    directed : bool, optional
        Default: directed exactly when the pattern of nonzeros is not symmetric (the values are
        not read: a weight rule sets the weights). ``False`` requires a symmetric pattern.

    Examples
    --------
    >>> a = np.array([[0, 1, 1], [1, 0, 0], [1, 0, 0]])
    >>> sorted(from_adjacency(a).edges())
    [(0, 1), (0, 2)]
    """
    if _complex(adjacency):  # (float() dropped the imaginary part with a warning)
        raise TopologyError("adjacency matrix must be real, got complex numbers")
    try:
        a = np.asarray(adjacency, dtype=float)
    except (TypeError, ValueError) as e:  # strings, objects
        raise TopologyError(f"adjacency matrix must be numeric ({e})") from None
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise TopologyError(f"adjacency matrix must be square, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise TopologyError("adjacency matrix has non-finite entries")
    if (a < 0).any():
        i, j = np.argwhere(a < 0)[0]
        raise TopologyError(f"adjacency matrix has a negative entry at ({i}, {j}): {a[i, j]:g}")
    edge = a != 0
    symmetric = np.array_equal(edge, edge.T)
    if directed is False and not symmetric:
        i, j = np.argwhere(edge != edge.T)[0]
        raise TopologyError(f"adjacency matrix has edge ({i}, {j}) but not ({j}, {i})")
    g = nx.DiGraph() if (directed or (directed is None and not symmetric)) else nx.Graph()
    g.add_nodes_from(range(a.shape[0]))
    rows, cols = np.nonzero(a)
    g.add_edges_from((int(i), int(j)) for i, j in zip(rows, cols) if i != j)
    return _require_connected(g)


def from_networkx(graph: nx.Graph, *, order=None) -> nx.Graph:
    """A copy of any networkx graph with nodes relabelled ``0 .. n-1`` and self-loops dropped.

    Nodes keep their sorted order when they are sortable, else their insertion order; ``order``
    (a list of all the nodes) sets it explicitly. When the nodes were not already ``0 .. n-1``,
    the original labels are kept in ``graph.graph["labels"]`` (label of node i at index i; see
    :func:`node_labels`).

    Examples
    --------
    >>> g = from_networkx(nx.Graph([("b", "c"), ("a", "b")]))
    >>> sorted(g.edges()), node_labels(g)
    ([(0, 1), (1, 2)], ['a', 'b', 'c'])
    >>> node_labels(from_networkx(nx.karate_club_graph())) is None  # already 0 .. 33
    True
    """
    if not isinstance(graph, nx.Graph):
        raise TopologyError(f"expected a networkx graph, got {type(graph).__name__}")
    if graph.is_multigraph():
        graph = nx.DiGraph(graph) if graph.is_directed() else nx.Graph(graph)
    if order is None:
        try:
            order = sorted(graph.nodes())
        except TypeError:  # mixed node types: keep insertion order
            order = list(graph.nodes())
    else:
        order = list(order)
        if len(order) != graph.number_of_nodes() or set(order) != set(graph.nodes()):
            raise TopologyError("order must list every node of the graph once")
    index = {v: i for i, v in enumerate(order)}
    out = nx.DiGraph() if graph.is_directed() else nx.Graph()
    out.add_nodes_from(range(len(order)))
    out.add_edges_from((index[u], index[v]) for u, v in graph.edges() if u != v)
    if [str(x) for x in order] != [str(i) for i in range(len(order))]:  # not 0 .. n-1
        out.graph["labels"] = order
    return _require_connected(out)


def node_labels(graph: nx.Graph) -> list | None:
    """The original node labels of a graph built by :func:`from_networkx` or
    :func:`load_graph` (label of node i at index i), or None when the nodes were ``0 .. n-1``.

    Examples
    --------
    >>> node_labels(ring(4)) is None
    True
    """
    labels = graph.graph.get("labels")
    return None if labels is None else list(labels)


#: file suffixes read by networkx's readers (everything else but .npy / .npz is an edge list)
GRAPH_FILE_READERS = {".graphml": "read_graphml", ".gml": "read_gml"}


def load_graph(path: str | Path) -> nx.Graph:
    """Load a graph from an edge list text file, a ``.npy`` adjacency matrix, or a GraphML
    (``.graphml``) or GML (``.gml``) file.

    The edge list has one undirected edge ``u v`` per line (extra columns such as weights are
    ignored); ``#`` starts a comment. Nodes are integers ``0 .. n-1``, or names (any
    whitespace-free words, e.g. ``Myriel Napoleon``), numbered ``0 .. n-1`` in the order they
    first appear; integers that are not ``0 .. n-1`` are numbered in sorted order. GraphML and GML
    nodes are numbered in file order. Names are kept: see :func:`node_labels`.

    Examples
    --------
    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "g.txt")
    >>> _ = open(f, "w").write("# triangle\\n0 1\\n1 2\\n2 0\\n")
    >>> load_graph(f).number_of_edges()
    3
    >>> _ = open(f, "w").write("Myriel Napoleon\\nMyriel Baptistine\\nNapoleon Baptistine\\n")
    >>> node_labels(load_graph(f))
    ['Myriel', 'Napoleon', 'Baptistine']
    """
    p = Path(path)
    if p.is_dir():
        raise TopologyError(f"graph file {p} is a folder, not a file")
    if not p.is_file():
        raise TopologyError(f"graph file not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".npy":
        try:
            a = np.load(p, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:  # EOFError: an empty file
            raise TopologyError(f"{p}: not a readable .npy array ({_npy_why(e)})") from None
        return _prefixed(p, from_adjacency, a)
    if suffix in GRAPH_FILE_READERS:
        reader = getattr(nx, GRAPH_FILE_READERS[suffix])
        try:
            g = reader(p)
        except Exception as e:  # noqa: BLE001 - parsers raise many kinds; one line names the file
            what = suffix[1:].upper().replace("GRAPHML", "GraphML")
            msg = " ".join(str(e).split()) or type(e).__name__
            raise TopologyError(f"{p}: not a readable {what} file ({msg})") from None
        return _prefixed(p, from_networkx, g, order=list(g.nodes()))
    if suffix == ".npz":  # mixing matrices, not a graph: a spec's graph key reads them
        raise TopologyError(f"{p}: an .npz holds mixing matrices W, not a graph; name it as a "
                            "schedule's graph (load_schedule / schedule_from_spec)")  # fmt: skip
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise TopologyError(f"{p}: not a text (UTF-8) edge list") from None
    return _prefixed(p, _from_edge_lines, text.splitlines(), p)


def _prefixed(p: Path, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except TopologyError as e:
        raise TopologyError(f"{p}: {e}") from None


def _as_id(token: str) -> int | None:
    # digits only: int() also takes "1_0" (10), "１" and " 1", which merged distinct nodes
    body = token[1:] if token[:1] in "+-" else token
    return int(token) if body.isascii() and body.isdigit() else None


def _from_edge_lines(lines: list[str], p: Path) -> nx.Graph:
    edges = []
    names = None  # decided by the first edge: integer ids, or names
    for lineno, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) < 2:
            raise TopologyError(f"line {lineno}: expected 'u v', got {line.strip()!r}")
        u, v = fields[0], fields[1]
        if names is None:
            names = _as_id(u) is None or _as_id(v) is None
        if names:
            edges.append((u, v))
            continue
        iu, iv = _as_id(u), _as_id(v)
        if iu is None or iv is None:
            raise TopologyError(
                f"line {lineno}: expected 'u v' with integer ids like the lines before, got "
                f"{line.strip()!r} (a file of names must start with a name)"
            )
        if iu < 0 or iv < 0:
            raise TopologyError(f"line {lineno}: node ids must be >= 0, got {line.strip()!r}")
        edges.append((iu, iv))
    if not edges:
        raise TopologyError("no edges")
    g = nx.Graph()
    if names:
        g.add_edges_from(edges)  # nodes in the order they first appear
        return from_networkx(g, order=list(g.nodes()))
    ids = sorted({x for e in edges for x in e})
    if ids[-1] + 1 == len(ids):  # already 0 .. n-1
        g.add_nodes_from(range(len(ids)))
        g.add_edges_from((u, v) for u, v in edges if u != v)
        return _require_connected(g)
    g.add_edges_from(edges)
    return from_networkx(g, order=ids)


#: graph family name -> generator (static families; the spec adds the time-varying ones)
GRAPH_FAMILIES = {
    "complete": complete,
    "ring": ring,
    "path": path,
    "star": star,
    "torus": torus,
    "hypercube": hypercube,
    "exponential": exponential,
    "erdos_renyi": erdos_renyi,
    "random_regular": random_regular,
    "small_world": small_world,
}

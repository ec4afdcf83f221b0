"""Mixing schedules: static, periodic, random, link failures, one-peer exponential, Base-(k+1)
graphs and a server (star) schedule.

Every schedule is random access: round ``t`` is a pure function of ``(seed, t)``; random draws
come from ``np.random.default_rng([seed, t])`` or a counter-based hash, never from earlier
rounds. Each schedule carries ``name`` (readable, for logs), ``is_random``, ``period`` and the
claims ``doubly_stochastic`` / ``symmetric`` that :func:`topologies.validation.validate_schedule`
checks. Sparse schedules answer ``neighbors(t, i)`` without building an ``n x n`` matrix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache

import networkx as nx
import numpy as np

from topologies import graphs as _graphs
from topologies import weights as _weights
from topologies._base import MixingSchedule, Phase, TopologyError, _is_int, _sum_duplicates
from topologies.validation import check_square
from topologies.weights import weight_rule

__all__ = [
    "StaticSchedule",
    "PeriodicSchedule",
    "RandomSchedule",
    "MatchingSchedule",
    "LinkFailureSchedule",
    "OnePeerExponentialSchedule",
    "BaseGraphSchedule",
    "ServerSchedule",
    "graph_schedule",
    "RANDOM_FAMILIES",
]

#: graph families with a ``seed`` argument (usable by :class:`RandomSchedule`)
RANDOM_FAMILIES = ("erdos_renyi", "random_regular", "small_world")


# ----------------------------------------------------------------------------- helpers


def _check_seed(seed) -> int:
    if seed is None:
        return 0
    if not _is_int(seed) or seed < 0:
        raise TopologyError(f"seed must be an int >= 0, got {seed!r}")
    return int(seed)


def _check_n(n, minimum: int = 1) -> int:
    if not _is_int(n):
        raise TopologyError(f"n must be an int, got {n!r}")
    if n < minimum:
        raise TopologyError(f"n must be >= {minimum}, got {n}")
    return int(n)


def _round_seed(seed: int, t: int) -> int:
    """An integer seed for round ``t`` (for networkx generators), derived from ``(seed, t)``."""
    return int(np.random.default_rng([seed, t]).integers(0, 2**63 - 1))


class _Rows:
    """A sparse matrix stored by rows (CSR from a Phase's COO triplets; duplicates summed)."""

    def __init__(self, phase: Phase):
        n = phase.size
        key = np.asarray(phase.rows, np.int64) * n + np.asarray(phase.cols, np.int64)
        key, self.vals = _sum_duplicates(key, phase.weights)
        self.n, self.rows, self.cols = n, key // n, key % n
        self.indptr = np.searchsorted(self.rows, np.arange(n + 1))

    def phase(self) -> Phase:
        return Phase(self.n, self.rows, self.cols, self.vals)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        lo, hi = self.indptr[i], self.indptr[i + 1]
        cols, vals = self.cols[lo:hi], self.vals[lo:hi]
        own = cols == i
        # a row with no entries keeps its value (implicit self weight 1, as in Phase.dense)
        self_w = float(vals[own].sum()) if hi > lo else 1.0
        return cols[~own], vals[~own], self_w


class _RowSchedule(MixingSchedule):
    """A one-phase schedule whose round ``t`` is a :class:`_Rows` built by ``_build(t)``."""

    doubly_stochastic = True
    symmetric = True
    name = "schedule"

    def _build(self, t: int) -> _Rows:
        raise NotImplementedError

    def _rows(self, t: int) -> _Rows:
        # one-round cache: neighbors(t, i) for all i costs one build, and purity is preserved
        cached = getattr(self, "_cache", None)
        if cached is None or cached[0] != t:
            cached = (t, self._build(t))
            self._cache = cached
        return cached[1]

    def phases(self, t: int) -> list[Phase]:
        self._check_access(t)
        return [self._rows(t).phase()]

    def neighbors(self, t: int, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        self._check_access(t, i)
        return self._rows(t).row(i)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


# ----------------------------------------------------------------------------- static


class StaticSchedule(_RowSchedule):
    """The same ``W`` every round, from a dense matrix or a sparse :class:`~topologies.Phase`.

    Parameters
    ----------
    w : array_like or Phase
        Square row-stochastic matrix (checked). A ``Phase`` keeps everything sparse.
    name : str, optional
        Readable name for logs.

    Examples
    --------
    >>> s = StaticSchedule(np.full((3, 3), 1 / 3))
    >>> s.neighbors(5, 0)
    (array([1, 2]), array([0.333..., 0.333...]), 0.333...)
    """

    def __init__(self, w: np.ndarray | Phase, *, name: str | None = None):
        phase = w if isinstance(w, Phase) else _dense_phase(w)
        self._static = _Rows(phase)
        self.n = phase.size
        if not np.isfinite(self._static.vals).all():  # (a NaN passes the sums' check)
            k = int(np.flatnonzero(~np.isfinite(self._static.vals))[0])
            i, j = self._static.rows[k], self._static.cols[k]
            raise TopologyError(f"entry ({i}, {j}) is not finite: {self._static.vals[k]}")
        sums = np.bincount(self._static.rows, weights=self._static.vals, minlength=self.n)
        bad = np.flatnonzero(np.abs(sums - 1.0) > 1e-8)
        if len(bad):
            raise TopologyError(f"row {bad[0]} sums to {sums[bad[0]]:.6g} (expected 1)")
        col_sums = np.bincount(self._static.cols, weights=self._static.vals, minlength=self.n)
        self.doubly_stochastic = bool(np.all(np.abs(col_sums - 1.0) <= 1e-8))
        self.symmetric = _is_symmetric(self._static)
        self.name = name or f"static(n={self.n})"

    @classmethod
    def from_graph(
        cls, graph: nx.Graph, weights: str = "metropolis", *, name: str | None = None
    ) -> StaticSchedule:
        """The schedule of a graph under a weight rule, built sparsely (fine at ``n = 10^5``).

        Examples
        --------
        >>> from topologies.graphs import ring
        >>> StaticSchedule.from_graph(ring(100_000), "max_degree").neighbors(0, 0)[0]
        array([    1, 99999])
        """
        phase = weight_rule(weights)(graph, sparse=True)
        label = f"{graph.number_of_nodes()}-node graph / {weights}"
        return cls(phase, name=name or label)

    def _build(self, t: int) -> _Rows:
        return self._static

    def _rows(self, t: int) -> _Rows:
        return self._static


def _dense_phase(w) -> Phase:
    return Phase.from_dense(check_square(w))  # (strings, ragged lists: numpy's ValueError)


def _is_symmetric(r: _Rows, tol: float = 1e-12) -> bool:
    # entries are sorted by (row, col); the transpose sorted the same way must match them
    order = np.lexsort((r.rows, r.cols))
    return bool(
        np.array_equal(r.rows, r.cols[order])
        and np.array_equal(r.cols, r.rows[order])
        and np.allclose(r.vals, r.vals[order], atol=tol, rtol=0)
    )


def graph_schedule(
    n: int,
    family: str,
    graph_args: dict | None = None,
    weights: str | None = None,
    seed: int = 0,
) -> StaticSchedule:
    """Static schedule of a named graph family under a weight rule; a random family's graph
    is drawn from ``seed`` (the same graph every time, as a spec's).

    ``weights`` defaults to ``uniform`` for the directed ``exponential`` family and
    ``metropolis`` otherwise. ``exponential`` with uniform weights is built directly from its
    shifts (no networkx graph), so ``n = 100,000`` is instant.

    Examples
    --------
    >>> s = graph_schedule(100_000, "exponential")
    >>> s.neighbors(0, 0)[0][:3]
    array([34464, 67232, 83616])
    >>> s.name
    'exponential(n=100000) / uniform'
    """
    if not isinstance(graph_args, (Mapping, type(None))):
        raise TopologyError(f"graph_args must be a mapping, got {graph_args!r:.40}")
    graph_args, seed = dict(graph_args or {}), _check_seed(seed)
    directed = family == "exponential"
    weights = weights or ("uniform" if directed else "metropolis")
    label = _family_label(family, n, graph_args) + f" / {weights}"
    if family == "exponential" and weights == "uniform":
        return StaticSchedule(_call_family(family, _exponential_uniform, n, graph_args), name=label)
    graph = _make_graph(family, n, graph_args, seed)
    schedule = StaticSchedule.from_graph(graph, weights, name=label)
    schedule.seed = seed
    return schedule


def _family_label(family: str, n: int, args: dict) -> str:
    inner = ", ".join([f"n={n}"] + [f"{k}={v}" for k, v in args.items()])
    return f"{family}({inner})"


def _make_graph(family: str, n: int, args: dict, seed) -> nx.Graph:
    if family not in _graphs.GRAPH_FAMILIES:
        known = ", ".join(_graphs.GRAPH_FAMILIES)
        raise TopologyError(f"unknown graph family {family!r}; known: {known}")
    fn = _graphs.GRAPH_FAMILIES[family]
    kwargs = dict(args)
    if "seed" in kwargs:  # it was overwritten by the seed argument, silently
        raise TopologyError(f"{family}: the graph's seed is the schedule's seed, not a graph_args")
    if family in RANDOM_FAMILIES:
        kwargs["seed"] = seed
    return _call_family(family, fn, n, kwargs)


def _call_family(family: str, fn, n: int, kwargs: dict):
    """``fn(n, **kwargs)``, an unknown or missing argument named as the family's."""
    try:
        return fn(n, **kwargs)
    except TypeError as e:  # (drop the Python function's name: the user wrote the family's)
        raise TopologyError(f"{family}: {str(e).split('() ', 1)[-1]}") from None


def _exponential_uniform(n: int, k: int = 2) -> Phase:
    """``uniform(exponential(n, k))`` without networkx: row ``i`` hears ``i - k^j mod n``."""
    n = _graphs._check_n("exponential", n, 2)
    k = _graphs._check_int("k", k, 2)
    offsets = np.array(_graphs._exponential_offsets(n, k), dtype=np.int64)
    i = np.arange(n, dtype=np.int64)
    rows = np.concatenate([i, np.repeat(i, len(offsets))])
    cols = np.concatenate([i, ((i[:, None] - offsets[None, :]) % n).ravel()])
    return Phase(n, rows, cols, np.full(len(rows), 1.0 / (1 + len(offsets))))


# ----------------------------------------------------------------------------- periodic


class PeriodicSchedule(MixingSchedule):
    """Cycle through a list of schedules or matrices: round ``t`` is item ``t mod L``.

    Item ``s`` of a cycle is asked for its own round ``t // L``, so random items draw afresh in
    every cycle. ``period`` is ``L`` times the least common multiple of the items' periods
    (``None`` if any item is aperiodic).

    Parameters
    ----------
    items : list of MixingSchedule or array_like
        Schedules or ``n x n`` matrices, all over the same ``n``.
    name : str, optional

    Examples
    --------
    >>> p = PeriodicSchedule([np.eye(2), np.full((2, 2), 0.5)])
    >>> p.period, p.matrix(3)[0]
    (2, array([0.5, 0.5]))
    """

    def __init__(self, items, *, name: str | None = None):
        if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
            raise TopologyError(f"periodic items must be a list, got {type(items).__name__}")
        items = [s if isinstance(s, MixingSchedule) else StaticSchedule(s) for s in items]
        if not items:
            raise TopologyError("periodic schedule needs at least one item")
        sizes = {s.n for s in items}
        if len(sizes) > 1:
            raise TopologyError(f"periodic items have different n: {sorted(sizes)}")
        self.items, self.n, self.seed = items, items[0].n, items[0].seed
        periods = [s.period for s in items]
        self.period = None if None in periods else len(items) * math.lcm(*periods)
        self.is_random = any(s.is_random for s in items)
        self.doubly_stochastic = all(getattr(s, "doubly_stochastic", True) for s in items)
        self.symmetric = all(getattr(s, "symmetric", False) for s in items)
        self.name = name or "periodic[" + ", ".join(getattr(s, "name", "?") for s in items) + "]"

    def _item(self, t: int) -> tuple[MixingSchedule, int]:
        length = len(self.items)
        return self.items[t % length], t // length

    def phases(self, t: int) -> list[Phase]:
        self._check_access(t)
        item, local = self._item(t)
        return item.phases(local)

    def matrix(self, t: int) -> np.ndarray:
        self._check_access(t)
        item, local = self._item(t)
        return item.matrix(local)

    def neighbors(self, t: int, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        self._check_access(t, i)
        item, local = self._item(t)
        return item.neighbors(local, i)

    def messages(self, t: int) -> int:
        self._check_access(t)
        item, local = self._item(t)
        return item.messages(local)


# ----------------------------------------------------------------------------- random graphs


class RandomSchedule(_RowSchedule):
    """A fresh random graph every round, weighted by a rule.

    Round ``t`` draws ``family(n, **family_args, seed=s_t)`` with ``s_t`` derived from
    ``(seed, t)``.

    Parameters
    ----------
    n : int
    family : str
        A random family: ``erdos_renyi``, ``random_regular`` or ``small_world``.
    family_args : dict, optional
        E.g. ``{"p": 0.3}``.
    weights : str, default "metropolis"
    seed : int, default 0

    Examples
    --------
    >>> s = RandomSchedule(10, "erdos_renyi", {"p": 0.5}, seed=1)
    >>> s.is_random, s.period, bool(np.allclose(s.matrix(3), s.matrix(3).T))
    (True, None, True)
    """

    is_random = True
    period = None

    def __init__(
        self,
        n: int,
        family: str = "erdos_renyi",
        family_args: dict | None = None,
        weights: str = "metropolis",
        seed: int | None = 0,
    ):
        if family not in RANDOM_FAMILIES:
            raise TopologyError(
                f"random schedule needs a random family ({', '.join(RANDOM_FAMILIES)}), "
                f"got {family!r}"
            )
        self.n, self.seed = _check_n(n, 2), _check_seed(seed)
        self.family, self.family_args = family, dict(family_args or {})
        self.weights = weight_rule(weights).__name__
        _make_graph(family, self.n, self.family_args, 0)  # fail now, not in round 17
        self.name = f"random {_family_label(family, self.n, self.family_args)} / {weights}"

    def graph(self, t: int) -> nx.Graph:
        """The graph of round ``t``."""
        return _make_graph(self.family, self.n, self.family_args, _round_seed(self.seed, t))

    def _build(self, t: int) -> _Rows:
        if self.family == "erdos_renyi" and self.weights in _weights.EDGE_RULES:
            # the same graph's edges, and the same weights, without networkx's graph: 31 ms
            # -> 3 ms a round at n = 300, p = 0.5 (docs/speed-notes.md)
            seed = _round_seed(self.seed, t)
            u, v = _graphs._erdos_renyi_edges(self.n, **self.family_args, seed=seed)
            return _Rows(_weights.edge_rule_phase(self.weights, self.n, u, v))
        return _Rows(weight_rule(self.weights)(self.graph(t), sparse=True))


class MatchingSchedule(_RowSchedule):
    """A random matching every round; matched peers average (weight 1/2 each).

    Without a graph, a uniformly random perfect matching of all peers (odd ``n``: one peer
    idles). With a graph, a random maximal matching of its edges (edges visited in random
    order, taken greedily).

    Parameters
    ----------
    n : int
    graph : networkx.Graph, optional
        Undirected graph on ``0 .. n-1`` whose edges may be matched.
    seed : int, default 0

    Examples
    --------
    >>> s = MatchingSchedule(5, seed=0)
    >>> sorted(float(s.neighbors(0, i)[2]) for i in range(5))
    [0.5, 0.5, 0.5, 0.5, 1.0]
    """

    is_random = True
    period = None

    def __init__(self, n: int, graph: nx.Graph | None = None, seed: int | None = 0):
        self.n, self.seed = _check_n(n, 2), _check_seed(seed)
        self._edges = None
        if graph is not None:
            if graph.is_directed() or graph.number_of_nodes() != self.n:
                raise TopologyError(f"matching needs an undirected graph on n={self.n} nodes")
            _weights._check_nodes(graph, "matching")
            edges = [e for e in graph.edges() if e[0] != e[1]]
            self._edges = np.array(edges, dtype=np.int64).reshape(-1, 2)  # (no edges: (0, 2))
        self.name = f"matching(n={self.n})" + ("" if graph is None else " on graph")

    def partners(self, t: int) -> np.ndarray:
        """``partner[i]`` in round ``t``, or ``-1`` when ``i`` idles."""
        rng = np.random.default_rng([self.seed, t])
        partner = np.full(self.n, -1, dtype=np.int64)
        if self._edges is None:
            perm = rng.permutation(self.n)
            a, b = perm[0 : self.n - 1 : 2], perm[1::2]
            partner[a], partner[b] = b, a
            return partner
        return _greedy_matching(self._edges[rng.permutation(len(self._edges))], partner)

    def _build(self, t: int) -> _Rows:
        partner = self.partners(t)
        i = np.arange(self.n, dtype=np.int64)
        matched = partner >= 0
        rows = np.concatenate([i, i[matched]])
        cols = np.concatenate([i, partner[matched]])
        vals = np.concatenate([np.where(matched, 0.5, 1.0), np.full(matched.sum(), 0.5)])
        return _Rows(Phase(self.n, rows, cols, vals))


def _greedy_matching(edges: np.ndarray, partner: np.ndarray) -> np.ndarray:
    """The matching that taking ``edges`` (E, 2) in their order makes, skipping an edge with a
    matched end, into ``partner`` (all -1): each pass takes every edge that comes first among
    the unmatched edges at both its ends (the edge taken in turn would be the same: nothing
    before it touches its ends), then drops the edges at the ends taken. A few passes, not a
    Python step an edge (14 -> 1.4 ms a round over G(300, 0.5))."""
    n, order = len(partner), np.arange(len(edges))
    u, v = edges[:, 0], edges[:, 1]
    while len(u):
        first = np.full(n, len(edges))
        np.minimum.at(first, u, order)
        np.minimum.at(first, v, order)
        take = (first[u] == order) & (first[v] == order)
        partner[u[take]], partner[v[take]] = v[take], u[take]
        left = (partner[u] < 0) & (partner[v] < 0)
        u, v, order = u[left], v[left], order[left]
    return partner


# ----------------------------------------------------------------------------- link failures

_U64 = np.uint64
_GOLDEN, _MIX1, _MIX2 = _U64(0x9E3779B97F4A7C15), _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, vectorised over uint64 (wrap-around arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _U64(30))) * _MIX1
        z = (z ^ (z >> _U64(27))) * _MIX2
        return z ^ (z >> _U64(31))


def _edge_uniform(seed: int, t: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) per undirected edge, a pure function of ``(seed, t, min, max)``."""
    lo, hi = np.minimum(u, v).astype(_U64), np.maximum(u, v).astype(_U64)
    h = _splitmix64(np.full(lo.shape, seed, dtype=_U64))
    h = _splitmix64(h ^ _U64(t))
    h = _splitmix64(_splitmix64(h ^ lo) ^ hi)
    return (h >> _U64(11)).astype(np.float64) * 2.0**-53


class LinkFailureSchedule(MixingSchedule):
    """A static weighted graph whose edges each fail with probability ``q`` in every round.

    A failed edge's weight moves onto both endpoints' self weights, so ``W_t`` stays symmetric
    and doubly stochastic. Failures come from a counter-based hash of
    ``(seed, t, min(u, v), max(u, v))``, so ``neighbors(t, i)`` costs O(degree) and agrees
    exactly with ``matrix(t)`` and ``phases(t)``.

    Parameters
    ----------
    graph : networkx.Graph
        Undirected base graph on ``0 .. n-1``.
    weights : str, default "metropolis"
        A symmetric weight rule.
    q : float
        Failure probability in ``[0, 1]``.
    seed : int, default 0

    Examples
    --------
    >>> from topologies.graphs import ring
    >>> s = LinkFailureSchedule(ring(6), "max_degree", q=0.5, seed=3)
    >>> bool(np.allclose(s.matrix(2).sum(axis=0), 1)) and bool(np.allclose(s.matrix(2).T,
    ...     s.matrix(2)))
    True
    """

    is_random = True
    period = None
    doubly_stochastic = True
    symmetric = True

    def __init__(self, graph: nx.Graph, weights: str = "metropolis", q: float = 0.1, seed=0):
        if not isinstance(graph, nx.Graph) or graph.is_directed():
            raise TopologyError("link_failure needs an undirected graph")
        self.q = _graphs._check_prob("q", q, allow_zero=True)
        self.seed = _check_seed(seed)
        if self.seed >= 2**64:  # the failures hash it as 64 bits
            raise TopologyError(f"link_failure's seed must be < 2**64, got {self.seed}")
        base = _Rows(weight_rule(weights)(graph, sparse=True))
        self.n = base.n
        own = base.rows == base.cols
        self._diag = np.zeros(self.n)
        self._diag[base.rows[own]] = base.vals[own]
        self._rows_, self._cols, self._vals = base.rows[~own], base.cols[~own], base.vals[~own]
        self._indptr = np.searchsorted(self._rows_, np.arange(self.n + 1))
        self.name = f"link_failure(q={self.q}) over {self.n}-node graph / {weights}"

    def _failed_self(self, vals: np.ndarray, fail: np.ndarray, starts: np.ndarray) -> np.ndarray:
        # One summation routine for rows and single rows alike, so both agree bit for bit.
        moved = np.where(fail, vals, 0.0)
        if len(moved) == 0:
            return np.zeros(len(starts))
        return np.add.reduceat(moved, starts)

    def phases(self, t: int) -> list[Phase]:
        self._check_access(t)
        fail = _edge_uniform(self.seed, t, self._rows_, self._cols) < self.q
        diag = self._diag.copy()
        nonempty = self._indptr[:-1] < self._indptr[1:]
        starts = self._indptr[:-1][nonempty]
        diag[nonempty] += self._failed_self(self._vals, fail, starts)
        keep = ~fail
        i = np.arange(self.n, dtype=np.int64)
        return [
            Phase(
                self.n,
                np.concatenate([self._rows_[keep], i]),
                np.concatenate([self._cols[keep], i]),
                np.concatenate([self._vals[keep], diag]),
            )
        ]

    def neighbors(self, t: int, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        self._check_access(t, i)
        lo, hi = self._indptr[i], self._indptr[i + 1]
        cols, vals = self._cols[lo:hi], self._vals[lo:hi]
        fail = _edge_uniform(self.seed, t, np.full(len(cols), i), cols) < self.q
        self_w = self._diag[i]
        if hi > lo:
            self_w = self_w + self._failed_self(vals, fail, np.zeros(1, dtype=np.int64))[0]
        return cols[~fail], vals[~fail], float(self_w)

    def __repr__(self) -> str:
        return f"<LinkFailureSchedule {self.name}>"


# ----------------------------------------------------------------------------- one-peer exp.


class OnePeerExponentialSchedule(MixingSchedule):
    """One-peer exponential graph (Ying et al. 2021): ``W_t = (I + P_t) / 2``.

    In round ``t`` peer ``i`` sends to ``i + 2^j mod n`` with ``j = t mod ceil(log2 n)``, so
    every peer receives from exactly one peer (``i - 2^j``) and averages with weight 1/2.
    ``P_t`` is a permutation, so ``W_t`` is doubly stochastic for every ``n`` but not
    symmetric (unless ``2^j = n/2``). For ``n`` a power of two the product over one period is
    exactly ``11^T/n``; for other ``n`` it is not.

    Parameters
    ----------
    n : int
        Number of peers, ``n >= 1``.

    Examples
    --------
    >>> s = OnePeerExponentialSchedule(8)
    >>> s.period, s.neighbors(2, 0)
    (3, (array([4]), array([0.5]), 0.5))
    """

    doubly_stochastic = True
    symmetric = False

    def __init__(self, n: int):
        self.n = _check_n(n, 1)
        self.period = max(1, (self.n - 1).bit_length())  # ceil(log2 n)
        self.name = f"one_peer_exponential(n={self.n})"

    def shift(self, t: int) -> int:
        """The shift ``2^(t mod period)`` of round ``t`` (0 when ``n = 1``)."""
        return 0 if self.n == 1 else 2 ** (t % self.period)

    def phases(self, t: int) -> list[Phase]:
        self._check_access(t)
        i = np.arange(self.n, dtype=np.int64)
        if self.n == 1:
            return [Phase(1, i, i, np.ones(1))]
        src = (i - self.shift(t)) % self.n
        return [
            Phase(
                self.n, np.concatenate([i, i]), np.concatenate([i, src]), np.full(2 * self.n, 0.5)
            )
        ]

    def neighbors(self, t: int, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        self._check_access(t, i)
        if self.n == 1:
            return np.zeros(0, dtype=np.int64), np.zeros(0), 1.0
        return np.array([(i - self.shift(t)) % self.n]), np.array([0.5]), 0.5

    def messages(self, t: int) -> int:
        self._check_access(t)
        return 0 if self.n == 1 else self.n

    def __repr__(self) -> str:
        return f"<OnePeerExponentialSchedule {self.name}>"


# ----------------------------------------------------------------------------- Base-(k+1)

# A round is a list of operations on disjoint node sets, applied by _round_phase:
#   ("cliques", groups)            groups: (g, f) int array, each row averages (weights 1/f)
#   ("entries", rows, cols, vals)  explicit weights, diagonal included


@cache
def _smooth_factors(m: int, k: int) -> tuple[int, ...] | None:
    """Shortest factorisation of ``m`` into factors ``2 .. k+1`` (None if there is none)."""
    if m == 1:
        return ()
    best = None
    for d in range(min(k + 1, m), 1, -1):
        if m % d == 0:
            rest = _smooth_factors(m // d, k)
            if rest is not None and (best is None or len(rest) + 1 < len(best)):
                best = (d, *rest)
    return best


def _hyper_hypercube(nodes: np.ndarray, k: int) -> list[list]:
    """Exact averaging of ``nodes`` in ``len(factors)`` rounds of cliques of size <= k+1.

    With ``m = f_1 * ... * f_R``, round ``r`` averages the nodes whose mixed-radix local
    indices differ only in digit ``r``; after all rounds every digit is averaged out.
    """
    factors = _smooth_factors(len(nodes), k)
    rounds, stride = [], 1
    for f in factors:
        blocks = nodes.reshape(-1, f, stride)  # axis 1 is digit r
        rounds.append([("cliques", blocks.transpose(0, 2, 1).reshape(-1, f))])
        stride *= f
    return rounds


def _parallel(sequences: list[list[list]]) -> list[list]:
    """Run sequences on disjoint nodes side by side (shorter ones idle at the end)."""
    length = max((len(s) for s in sequences), default=0)
    return [sum((s[r] for s in sequences if r < len(s)), []) for r in range(length)]


def _digits(m: int, k: int) -> list[tuple[int, int]]:
    """Base-(k+1) digits of ``m`` as ``(a_l, p_l)``, ``m = sum a_l (k+1)^p_l``, p decreasing."""
    out, p = [], 0
    while (k + 1) ** (p + 1) <= m:
        p += 1
    for q in range(p, -1, -1):
        a = (m // (k + 1) ** q) % (k + 1)
        if a:
            out.append((a, q))
    return out


def _simple_base(nodes: np.ndarray, k: int) -> list[list]:
    """Simple Base-(k+1) graph on ``nodes``: exact averaging with max degree ``k``.

    1. Split into groups ``V_l`` of sizes ``a_l (k+1)^p_l`` (base-(k+1) digits); each
       averages internally with a hyper-hypercube, in parallel.
    2. For ``l = 0 .. L-2`` (round ``l``): every node of the later groups ``V_{>l}`` pairs with
       one node in each of the ``a_l`` subgroups of ``V_l`` (size ``(k+1)^p_l``, larger than
       ``|V_{>l}|``) and moves to ``(1-c) x + c xbar_l`` with ``c = |V_l| / |V_{>=l}|``. Each
       subgroup's mean becomes the global mean; the later groups stay uniform with the global
       mean as their mean, so the recursion continues on ``V_{>l}``.
    3. Each subgroup of ``V_l`` re-averages (hypercube, ``p_l`` rounds) from round ``l + 1``.
    """
    m = len(nodes)
    if _smooth_factors(m, k) is not None:
        return _hyper_hypercube(nodes, k)
    digits = _digits(m, k)
    bounds = np.cumsum([0] + [a * (k + 1) ** p for a, p in digits])
    groups = [nodes[bounds[g] : bounds[g + 1]] for g in range(len(digits))]
    rounds = _parallel([_hyper_hypercube(g, k) for g in groups])
    tail = [[] for _ in range(digits[0][1] + 1)]  # p_0 + 1 >= L rounds
    for l, (a, p) in enumerate(digits[:-1]):
        subgroups = groups[l].reshape(a, (k + 1) ** p)
        tail[l].append(_pairing(subgroups, np.concatenate(groups[l + 1 :])))
        for r, ops in enumerate(_parallel([_hyper_hypercube(s, k) for s in subgroups])):
            tail[l + 1 + r] += ops
    return rounds + tail


def _pairing(subgroups: np.ndarray, later: np.ndarray) -> tuple:
    """Later node ``i`` <-> one node per subgroup, weight ``c/a`` each (symmetric)."""
    a, size = subgroups.shape
    c = subgroups.size / (subgroups.size + len(later))
    partners = subgroups[:, : len(later)]  # (a, |later|)
    rows = [later, partners.ravel(), np.repeat(later[None], a, 0).ravel(), partners.ravel()]
    cols = [later, partners.ravel(), partners.ravel(), np.repeat(later[None], a, 0).ravel()]
    vals = [
        np.full(len(later), 1 - c),
        np.full(partners.size, 1 - c / a),
        np.full(partners.size, c / a),
        np.full(partners.size, c / a),
    ]
    return ("entries", np.concatenate(rows), np.concatenate(cols), np.concatenate(vals))


def _base_sequence(n: int, k: int) -> list[list]:
    """The Base-(k+1) graph: the shorter of the simple Base-(k+1) graph on all nodes and
    "simple Base-(k+1) graph on ``q`` blocks of ``n/q`` nodes, then a hyper-hypercube across
    the blocks", where ``q`` is the largest divisor of ``n`` with prime factors ``<= k+1``."""
    nodes = np.arange(n, dtype=np.int64)
    direct = _simple_base(nodes, k)
    q = math.prod(p**e for p, e in _prime_powers(n) if p <= k + 1)
    if q in (1, n):
        return direct
    blocks = nodes.reshape(q, n // q)
    within = _parallel([_simple_base(b, k) for b in blocks])
    across = _parallel([_hyper_hypercube(col, k) for col in blocks.T])
    combined = within + across
    return combined if len(combined) < len(direct) else direct


def _prime_powers(n: int) -> list[tuple[int, int]]:
    out, p = [], 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n, e = n // p, e + 1
        if e:
            out.append((p, e))
        p += 1
    return out + ([(n, 1)] if n > 1 else [])


def _round_phase(n: int, ops: list) -> Phase:
    rows, cols, vals = [], [], []
    for op in ops:
        if op[0] == "cliques":
            g = op[1]
            f = g.shape[1]
            rows.append(np.repeat(g, f, axis=1).ravel())
            cols.append(np.tile(g, (1, f)).ravel())
            vals.append(np.full(g.size * f, 1.0 / f))
        else:
            rows.append(op[1]), cols.append(op[2]), vals.append(op[3])
    touched = np.zeros(n, dtype=bool)
    for r in rows:
        touched[r] = True
    idle = np.flatnonzero(~touched)  # idle peers keep their value explicitly
    rows.append(idle), cols.append(idle), vals.append(np.ones(len(idle)))
    return Phase(n, np.concatenate(rows), np.concatenate(cols), np.concatenate(vals))


class BaseGraphSchedule(_RowSchedule):
    """Base-(k+1) graph (Takezawa et al., NeurIPS 2023): exact averaging for any ``n`` with
    at most ``k`` neighbours per peer per round.

    A finite sequence ``W_0 .. W_{T-1}`` (cycled, ``period = T``) of symmetric doubly
    stochastic matrices with ``W_{T-1} ... W_0 = 11^T/n``:

    * ``n`` whose prime factors are all ``<= k+1``: a k-peer hyper-hypercube, one round per
      factor of the shortest factorisation of ``n`` into factors ``2 .. k+1``; each round
      averages cliques of ``<= k+1`` peers along one mixed-radix digit.
    * otherwise the simple Base-(k+1) graph: split ``n`` by its base-(k+1) digits
      ``n = sum a_l (k+1)^p_l`` into groups, average each group, then fold the smaller groups
      into the larger ones' ``(k+1)^p_l``-sized subgroups with size-proportional weights and
      re-average the subgroups (see ``_simple_base``). When ``n = q r`` with ``q`` the largest
      divisor of ``n`` made of primes ``<= k+1``, running it on ``q`` blocks of ``r`` peers
      followed by a hyper-hypercube across blocks is used instead when shorter.

    Parameters
    ----------
    n : int
        Number of peers, ``n >= 1``.
    k : int, default 1
        Maximum degree per round, ``k >= 1``.

    Examples
    --------
    >>> s = BaseGraphSchedule(12, k=1)
    >>> w = np.eye(12)
    >>> for t in range(s.period):
    ...     w = s.matrix(t) @ w
    >>> bool(np.allclose(w, 1 / 12))
    True
    """

    def __init__(self, n: int, k: int = 1):
        self.n = _check_n(n, 1)
        self.k = _graphs._check_int("k", k, 1)
        self._rounds = [_Rows(_round_phase(self.n, ops)) for ops in _base_sequence(self.n, self.k)]
        if not self._rounds:  # n == 1
            self._rounds = [
                _Rows(Phase(1, np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1)))
            ]
        self.period = len(self._rounds)
        self.name = f"base(n={self.n}, k={self.k})"

    def _rows(self, t: int) -> _Rows:
        return self._rounds[t % self.period]


# ----------------------------------------------------------------------------- server


class ServerSchedule(MixingSchedule):
    """Federated averaging through a hub, as two phases per round.

    Phase 1 (peers -> hub): the hub's row is ``p`` restricted to this round's participants
    ``S_t`` and renormalised, ``p_i = n_i / sum_j n_j`` (uniform without sizes); other rows are
    the identity. Phase 2 (hub -> peers): the participants' rows become ``e_hub``; the others
    keep their model. With ``hub="aggregator"`` the hub is an extra node ``n`` (phases over
    ``n + 1`` nodes); with ``hub="peer"`` it is peer 0, which then always participates.

    The effective ``matrix(t)`` has rows ``p_S`` for participants and ``e_i`` for the others;
    with full participation it is ``1 p^T`` (row-stochastic; doubly stochastic and symmetric
    only for uniform ``p``).

    Weight choice: the aggregate is renormalised over the sampled peers,
    ``sum_{i in S} n_i x_i / sum_{i in S} n_i``. The released FedEM code instead averages over
    all clients, with the unsampled ones contributing the previous global model; the two agree
    in expectation under uniform sampling but not round by round.

    Parameters
    ----------
    n : int
        Number of peers, ``n >= 1``.
    participation : float, default 1.0
        Fraction in ``(0, 1]``; each round samples ``max(1, round(participation * n))`` peers
        without replacement from ``default_rng([seed, t])``.
    weights : sequence of float, optional
        Dataset sizes ``n_i > 0``; default uniform.
    hub : {"aggregator", "peer"}, default "aggregator"
    seed : int, default 0

    Examples
    --------
    >>> s = ServerSchedule(4, weights=[1, 1, 1, 2])
    >>> s.matrix(0)[0]
    array([0.2, 0.2, 0.2, 0.4])
    >>> len(s.phases(0)), s.phases(0)[0].size
    (2, 5)
    """

    def __init__(
        self,
        n: int,
        participation: float = 1.0,
        weights=None,
        hub: str = "aggregator",
        seed: int | None = 0,
    ):
        self.n, self.seed = _check_n(n, 1), _check_seed(seed)
        self.participation = _graphs._check_prob("participation", participation, allow_zero=False)
        if hub not in ("aggregator", "peer"):
            raise TopologyError(f"hub must be 'aggregator' or 'peer', got {hub!r}")
        self.hub = hub
        self.p = _sizes(weights, self.n)
        self.m = max(1, round(self.participation * self.n))
        self.is_random = self.m < self.n
        self.period = None if self.is_random else 1
        uniform_p = bool(np.allclose(self.p, self.p[0]))
        self.doubly_stochastic = self.symmetric = uniform_p
        self.name = f"server(n={self.n}, participation={self.participation}, hub={hub})"

    def participants(self, t: int) -> np.ndarray:
        """Sorted participants of round ``t``."""
        if self.m == self.n:
            return np.arange(self.n, dtype=np.int64)
        rng = np.random.default_rng([self.seed, t])
        if self.hub == "peer":
            others = 1 + rng.choice(self.n - 1, size=self.m - 1, replace=False)
            return np.sort(np.concatenate([[0], others])).astype(np.int64)
        return np.sort(rng.choice(self.n, size=self.m, replace=False)).astype(np.int64)

    def _p_s(self, s: np.ndarray) -> np.ndarray:
        return self.p[s] / self.p[s].sum()

    def phases(self, t: int) -> list[Phase]:
        self._check_access(t)
        s = self.participants(t)
        hub = self.n if self.hub == "aggregator" else 0
        size = self.n + 1 if self.hub == "aggregator" else self.n
        up = Phase(size, np.full(len(s), hub, dtype=np.int64), s, self._p_s(s))
        receivers = s[s != hub]
        down = Phase(
            size, receivers, np.full(len(receivers), hub, dtype=np.int64), np.ones(len(receivers))
        )
        return [up, down]

    def matrix(self, t: int) -> np.ndarray:
        self._check_access(t)
        s = self.participants(t)
        w = np.eye(self.n)
        w[np.ix_(s, np.arange(self.n))] = 0.0
        w[np.ix_(s, s)] = self._p_s(s)[None, :]
        return w

    def neighbors(self, t: int, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        self._check_access(t, i)
        s = self.participants(t)
        pos = np.searchsorted(s, i)
        if pos == len(s) or s[pos] != i:
            return np.zeros(0, dtype=np.int64), np.zeros(0), 1.0
        p = self._p_s(s)
        others = s != i
        return s[others], p[others], float(p[pos])

    def __repr__(self) -> str:
        return f"<ServerSchedule {self.name}>"


def _sizes(weights, n: int) -> np.ndarray:
    if weights is None:
        return np.full(n, 1.0 / n)
    try:
        p = np.asarray(weights, dtype=float)
    except (TypeError, ValueError):
        raise TopologyError(f"server sizes must be {n} numbers, got {weights!r}") from None
    if p.shape != (n,):
        raise TopologyError(f"server sizes must have n={n} entries, got shape {p.shape}")
    if not np.isfinite(p).all() or (p <= 0).any():
        i = int(np.flatnonzero(~(np.isfinite(p) & (p > 0)))[0])
        raise TopologyError(f"server sizes must be > 0; entry {i} is {p[i]}")
    with np.errstate(over="ignore"):
        if not np.isfinite(p.sum()):  # sizes of 1e308 overflow their sum
            p = p / p.max()
    return p / p.sum()

"""Weight rules: a graph in (connected, for the optimal :func:`best_constant` and
:func:`fmmc`), a mixing matrix ``W`` with zeros off the edges out.

The rules for undirected graphs return symmetric, doubly stochastic, non-negative matrices with
the self weights on the diagonal. :func:`uniform` is the rule for regular directed graphs such as
:func:`topologies.graphs.exponential` (doubly stochastic, not symmetric).

Every rule takes ``sparse=True`` to return a :class:`~topologies.Phase` (COO triplets with the
diagonal) instead of a dense array; :func:`metropolis`, :func:`max_degree` and :func:`uniform`
then never build an ``n x n`` array, so they work for ``n = 100,000``.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import uuid
import warnings
from pathlib import Path

import networkx as nx
import numpy as np

from topologies._base import Phase, TopologyError

__all__ = [
    "WEIGHT_RULES",
    "SYMMETRIC_RULES",
    "metropolis",
    "max_degree",
    "best_constant",
    "fmmc",
    "uniform",
    "weight_rule",
]

#: rules that need an undirected graph (all but ``uniform``)
SYMMETRIC_RULES = ("metropolis", "max_degree", "best_constant", "fmmc")


# ----------------------------------------------------------------------------- helpers


def _undirected_edges(g: nx.Graph, rule: str) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """``n``, edge endpoints ``u``, ``v`` (no self-loops) and degrees, for an undirected graph."""
    if not isinstance(g, nx.Graph):
        raise TopologyError(f"{rule} needs a networkx graph, got {type(g).__name__}")
    if g.is_directed():
        raise TopologyError(f"{rule} needs an undirected graph; use weights 'uniform' for directed")
    n = _check_nodes(g, rule)
    if g.is_multigraph():  # a repeated edge would count twice in the degrees
        raise TopologyError(f"{rule} needs a simple graph, got a multigraph; use nx.Graph(g)")
    e = np.array([(u, v) for u, v in g.edges() if u != v], dtype=np.int64).reshape(-1, 2)
    deg = np.bincount(e.ravel(), minlength=n)
    return n, e[:, 0], e[:, 1], deg


def _check_nodes(g: nx.Graph, rule: str) -> int:
    """``n`` of a graph on nodes 0..n-1, n >= 1."""
    n = g.number_of_nodes()
    if n == 0:
        raise TopologyError(f"{rule} needs a graph with nodes, got an empty graph")
    if set(g.nodes()) != set(range(n)):
        raise TopologyError(f"{rule} needs nodes 0..n-1; relabel with graphs.from_networkx")
    return n


def _check_connected(g: nx.Graph, rule: str) -> None:
    """The optimal rules assume one component (their spectral gap is 0 otherwise)."""
    if not nx.is_connected(g):
        k = nx.number_connected_components(g)
        raise TopologyError(f"{rule} needs a connected graph, got {k} components")


def _symmetric(n: int, u, v, w, sparse: bool):
    """``W`` with weight ``w[e]`` on both ``(u, v)`` and ``(v, u)``, diagonal = 1 - row sum."""
    off = np.bincount(u, weights=w, minlength=n) + np.bincount(v, weights=w, minlength=n)
    diag = np.arange(n, dtype=np.int64)
    rows = np.concatenate([u, v, diag])
    cols = np.concatenate([v, u, diag])
    vals = np.concatenate([w, w, 1.0 - off])
    phase = Phase(n, rows, cols, vals.astype(float))
    return phase if sparse else phase.dense()


# ----------------------------------------------------------------------------- rules


def metropolis(graph: nx.Graph, *, sparse: bool = False) -> np.ndarray | Phase:
    """Metropolis-Hastings weights ``w_ij = 1 / (1 + max(d_i, d_j))`` on edges.

    Parameters
    ----------
    graph : networkx.Graph
        Undirected graph on ``0 .. n-1``.
    sparse : bool, default False
        Return a :class:`~topologies.Phase` instead of a dense array.

    Examples
    --------
    >>> from topologies.graphs import star
    >>> metropolis(star(3))
    array([[0.333..., 0.333..., 0.333...],
           [0.333..., 0.666..., 0.        ],
           [0.333..., 0.        , 0.666...]])
    """
    n, u, v, deg = _undirected_edges(graph, "metropolis")
    return _symmetric(n, u, v, _metropolis(u, v, deg), sparse)


def _metropolis(u: np.ndarray, v: np.ndarray, deg: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.maximum(deg[u], deg[v]))


def max_degree(graph: nx.Graph, *, sparse: bool = False) -> np.ndarray | Phase:
    """Constant edge weight ``1 / (1 + d_max)``; on a ring every weight is ``1/3``.

    Parameters
    ----------
    graph : networkx.Graph
        Undirected graph on ``0 .. n-1``.
    sparse : bool, default False
        Return a :class:`~topologies.Phase` instead of a dense array.

    Examples
    --------
    >>> from topologies.graphs import ring
    >>> max_degree(ring(4))[0]
    array([0.333..., 0.333..., 0.        , 0.333...])
    """
    n, u, v, deg = _undirected_edges(graph, "max_degree")
    return _symmetric(n, u, v, _max_degree(u, v, deg), sparse)


def _max_degree(u: np.ndarray, v: np.ndarray, deg: np.ndarray) -> np.ndarray:
    return np.full(u.shape, 1.0 / (1.0 + deg.max(initial=0)))


#: the rules whose edge weights need only the edges and degrees: :func:`edge_rule_phase`
EDGE_RULES = {"metropolis": _metropolis, "max_degree": _max_degree}


def edge_rule_phase(name: str, n: int, u: np.ndarray, v: np.ndarray) -> Phase:
    """``weight_rule(name)(graph, sparse=True)`` of the simple undirected graph on ``0..n-1``
    whose edges are ``(u[e], v[e])`` (no self-loops), given in the order ``graph.edges()``
    lists them (the same bits then), without the graph: for the rules in
    :data:`EDGE_RULES`."""
    deg = np.bincount(np.concatenate([u, v]), minlength=n)
    return _symmetric(n, u, v, EDGE_RULES[name](u, v, deg), True)


def best_constant(
    graph: nx.Graph, *, sparse: bool = False, nonnegative: bool = True
) -> np.ndarray | Phase:
    """Best constant edge weight (Xiao & Boyd 2004): ``W = I - alpha L``.

    ``alpha = 2 / (lambda_1(L) + lambda_{n-1}(L))`` (largest and second smallest Laplacian
    eigenvalues) minimises ``||W - 11^T/n||_2`` over constant edge weights. On irregular graphs
    that ``alpha`` can make a diagonal entry negative; with ``nonnegative=True`` (default)
    ``alpha`` is capped at ``1 / d_max``, the best constant weight that keeps ``W >= 0`` (the
    spectral norm is convex in ``alpha``, so the cap is the constrained optimum).

    Parameters
    ----------
    graph : networkx.Graph
        Undirected graph on ``0 .. n-1`` (dense eigen-decomposition: moderate ``n``).
    sparse : bool, default False
        Return a :class:`~topologies.Phase` instead of a dense array.
    nonnegative : bool, default True
        Cap ``alpha`` so that ``W`` has no negative entry.

    Examples
    --------
    >>> from topologies.graphs import ring
    >>> float(best_constant(ring(4))[0, 1])  # lambda = 0, 2, 2, 4 -> alpha = 2 / (4 + 2)
    0.333...
    """
    n, u, v, deg = _undirected_edges(graph, "best_constant")
    _check_connected(graph, "best_constant")
    if n == 1:
        return _symmetric(n, u, v, np.zeros(0), sparse)
    lap = np.diag(deg.astype(float))
    lap[u, v] = lap[v, u] = -1.0
    eig = np.linalg.eigvalsh(lap)
    alpha = 2.0 / (eig[-1] + eig[1])
    if nonnegative:
        alpha = min(alpha, 1.0 / deg.max())
    return _symmetric(n, u, v, np.full(u.shape, alpha), sparse)


def fmmc(
    graph: nx.Graph,
    *,
    sparse: bool = False,
    solver: str | None = None,
    solver_options: dict | None = None,
    cache: bool = True,
) -> np.ndarray | Phase:
    """Fastest Mixing Markov Chain weights (Boyd, Diaconis & Xiao 2004), solved as an SDP.

    Minimises ``s`` subject to ``-sI <= W - 11^T/n <= sI`` over symmetric, stochastic,
    non-negative ``W`` supported on the edges. ``W`` is parametrised by one weight per edge
    (``W = I - sum_e w_e (e_u - e_v)(e_u - e_v)^T``), so symmetry, ``W1 = 1`` and the zeros
    off the edges hold by construction and the SDP stays small. Above ``n = 32`` the
    first-order solver SCS is used (the interior-point solver's dense PSD blocks grow like
    ``n^4``); it solves ``n = 100`` Erdos-Renyi graphs to 1e-6 in 0.3 s (p = 0.5) to 3 s
    (p = 0.1). Very sparse graphs converge slowly (highly repeated eigenvalues at the optimum),
    so SCS stops after 2,000 iterations by default, an iteration budget rather than a time
    budget so that the same graph gets the same weights on every run and machine: a 4-regular
    ``n = 100`` graph (``random_regular(100, 4, seed=1)``) then gets rho 0.8093 (5,000
    iterations: 0.8085; Metropolis: 0.8785) and
    Zachary's karate club 0.95366 (5,000 iterations: 0.95356). Raise
    ``solver_options["max_iters"]`` for more accuracy. The result is always cleaned up to be
    exactly feasible.
    Needs ``cvxpy`` (``pip install 'gossip-pfl[fmmc]'``).

    The solver's edge weights are kept on disk (``$GOSSIP_PFL_CACHE/fmmc``, default
    ``~/.cache/gossip-pfl/fmmc``), keyed by the edges, the solver, its options and the cvxpy
    and solver versions: the paper's 300-node graph takes 5 to 9 s to solve and milliseconds
    to read, and a run of the same config gets the same weights.

    Parameters
    ----------
    graph : networkx.Graph
        Undirected graph on ``0 .. n-1``.
    sparse : bool, default False
        Return a :class:`~topologies.Phase` instead of a dense array.
    solver : str, optional
        cvxpy solver name; default Clarabel (interior point) for ``n <= 32``, else SCS.
    solver_options : dict, optional
        Extra keyword arguments for the solver (SCS defaults: ``eps_abs = eps_rel = 1e-6``,
        ``max_iters = 2000``, no time limit).
    cache : bool, default True
        Read and write the solved weights in the cache folder (False: always solve).

    Examples
    --------
    >>> from topologies.graphs import path
    >>> np.round(fmmc(path(2)), 6)  # the two-node chain mixes in one step
    array([[0.5, 0.5],
           [0.5, 0.5]])
    """
    n, u, v, deg = _undirected_edges(graph, "fmmc")
    _check_connected(graph, "fmmc")
    if n == 1 or len(u) == 0:
        return _symmetric(n, u, v, np.zeros(len(u)), sparse)
    chosen, options = _fmmc_solver(n, solver, solver_options)
    path = _fmmc_path(n, u, v, chosen, options) if cache else None
    w = _cached_fmmc(path, n, u, v) if path else None
    if w is None:
        w = _solve_fmmc(n, u, v, chosen, options)
        if path:
            _store_fmmc(path, w)
    # Solver noise: clip tiny negatives and, if a node's weights sum past 1, shrink all weights
    # uniformly so that every self weight stays >= 0 (keeps W symmetric and stochastic).
    w = np.clip(w, 0.0, None)
    load = _load(n, u, v, w)
    if load.max() > 1.0:
        w = w / load.max()
    return _symmetric(n, u, v, w, sparse)


#: SCS stops at 1e-6 or after 2,000 iterations, whichever comes first. Not a time cap: a time
#: cap made the weights depend on how busy the machine was (runs no longer repeated).
_SCS_DEFAULTS = {"eps_abs": 1e-6, "eps_rel": 1e-6, "max_iters": 2000, "time_limit_secs": 0}


def _fmmc_solver(n: int, solver: str | None, solver_options: dict | None) -> tuple[str, dict]:
    """The cvxpy solver and its options for a graph of ``n`` nodes."""
    # Clarabel (interior point) is exact but its dense PSD blocks grow like n^4; SCS (first
    # order) solves n = 100 in well under 5 s to ~1e-6.
    chosen = solver or ("CLARABEL" if n <= 32 else "SCS")
    options = dict(_SCS_DEFAULTS) if chosen == "SCS" else {}
    options.update(solver_options or {})
    return chosen, options


def fmmc_cache_dir() -> Path:
    """Where :func:`fmmc` keeps solved weights: ``$GOSSIP_PFL_CACHE/fmmc``, else
    ``~/.cache/gossip-pfl/fmmc``."""
    root = os.environ.get("GOSSIP_PFL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "gossip-pfl") / "fmmc"


def _fmmc_path(n: int, u: np.ndarray, v: np.ndarray, chosen: str, options: dict) -> Path:
    """The cache file of this problem: a hash of the edges, the solver, its options and the
    versions that could change its answer."""
    from importlib import metadata

    versions = []
    for package in ("cvxpy", chosen.lower()):
        try:
            versions.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            versions.append("-")
    h = hashlib.sha256(f"{n}|{chosen}|{sorted(options.items())}|{versions}".encode())
    h.update(np.ascontiguousarray(u, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(v, dtype=np.int64).tobytes())
    return fmmc_cache_dir() / f"n{n}-{h.hexdigest()[:24]}.npy"


#: how far cached weights may stray from feasibility (w >= 0, each node's weights summing to
#: at most 1) and still be the solver's raw output, which the cache holds and the clean-up
#: after the read makes feasible: SCS stopped at its iteration cap left a ring of 64 at 1.0027
#: and a Watts-Strogatz graph of 100 at 1.0038 (1e-3 solved those again on every read)
_CACHE_SLACK = 1e-2


def _cached_fmmc(path: Path, n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray | None:
    """The cached edge weights, or None (not there, unreadable, not this graph's shape, or
    not weights: it is only a cache, so the problem is solved again; a NaN in it was blamed
    on the spec's graph, weights of 0.5 gave another rho unsaid)."""
    try:
        w = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):  # EOFError: an empty file
        return None
    if w.shape != (len(u),) or w.dtype != np.float64 or not np.isfinite(w).all():
        return None
    return w if w.min() >= -_CACHE_SLACK and _load(n, u, v, w).max() <= 1 + _CACHE_SLACK else None


def _load(n: int, u: np.ndarray, v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each node's total edge weight (n,): at most 1 leaves its self weight >= 0."""
    return np.bincount(u, weights=w, minlength=n) + np.bincount(v, weights=w, minlength=n)


def _store_fmmc(path: Path, w: np.ndarray) -> None:
    """Write atomically (temp file + rename); a cache that cannot be written is skipped. The
    temp name is unique to this writer (processes on other hosts sharing the cache may have
    our pid), and made with the umask's permissions, so others sharing the cache can read."""
    tmp = path.with_suffix(f".{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            np.save(f, np.asarray(w, dtype=np.float64))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _solve_fmmc(n: int, u: np.ndarray, v: np.ndarray, chosen: str, options: dict) -> np.ndarray:
    try:
        import cvxpy as cp
        import scipy.sparse as sp
    except ImportError:
        raise TopologyError("fmmc needs cvxpy: pip install 'gossip-pfl[fmmc]'") from None
    m = len(u)
    # Column e of `lap_map` is vec((e_u - e_v)(e_u - e_v)^T): four entries per edge.
    ru = np.concatenate([u * n + u, v * n + v, u * n + v, v * n + u])
    vals = np.concatenate([np.ones(2 * m), -np.ones(2 * m)])
    lap_map = sp.csc_matrix((vals, (ru, np.tile(np.arange(m), 4))), shape=(n * n, m))
    w = cp.Variable(m)
    lap = cp.reshape(lap_map @ w, (n, n), order="F")  # symmetric, so the order is moot
    dev = np.eye(n) - np.full((n, n), 1.0 / n) - lap
    deg_map = sp.csr_matrix((np.ones(2 * m), (np.concatenate([u, v]), np.tile(np.arange(m), 2))))
    s = cp.Variable()
    eye = np.eye(n)
    constraints = [w >= 0, deg_map @ w <= 1, dev << s * eye, dev >> -s * eye]
    problem = cp.Problem(cp.Minimize(s), constraints)
    try:
        with warnings.catch_warnings():  # "solution may be inaccurate": cleaned up below
            warnings.simplefilter("ignore", UserWarning)
            problem.solve(solver=chosen, **options)
    except (cp.error.SolverError, ValueError) as e:
        raise TopologyError(f"fmmc: solver {chosen} failed ({e})") from None
    if w.value is None:
        raise TopologyError(f"fmmc: solver {chosen} returned no solution ({problem.status})")
    return np.asarray(w.value, dtype=float)


def uniform(graph: nx.Graph, *, sparse: bool = False) -> np.ndarray | Phase:
    """Uniform weights ``1 / (1 + d)`` for a ``d``-regular graph (directed or not).

    Peer ``i`` averages itself and its ``d`` in-neighbours with equal weights. For the directed
    exponential graph ``d = ceil(log_k n)``; the result is doubly stochastic, not symmetric.

    Parameters
    ----------
    graph : networkx.Graph or networkx.DiGraph
        Graph on ``0 .. n-1`` in which every node has the same in- and out-degree ``d``.
    sparse : bool, default False
        Return a :class:`~topologies.Phase` instead of a dense array.

    Examples
    --------
    >>> from topologies.graphs import exponential
    >>> uniform(exponential(4))[0]  # peer 0 hears from 3 (= 0 - 1) and 2 (= 0 - 2)
    array([0.333..., 0.        , 0.333..., 0.333...])
    """
    if not isinstance(graph, nx.Graph):
        raise TopologyError(f"uniform needs a networkx graph, got {type(graph).__name__}")
    n = _check_nodes(graph, "uniform")
    e = np.array([(a, b) for a, b in graph.edges() if a != b], dtype=np.int64).reshape(-1, 2)
    if not graph.is_directed():
        e = np.concatenate([e, e[:, ::-1]])
    senders, receivers = e[:, 0], e[:, 1]
    ind = np.bincount(receivers, minlength=n)
    outd = np.bincount(senders, minlength=n)
    bad = np.flatnonzero((ind != ind[0]) | (outd != ind[0]))
    if len(bad):
        i = int(bad[0])
        hint = (  # the other rules need an undirected graph
            "give its mixing matrices as a schedule file (.npz) instead"
            if graph.is_directed()
            else "use metropolis"
        )
        raise TopologyError(
            f"uniform needs a regular graph; node {i} has in-degree {ind[i]}, out-degree "
            f"{outd[i]} vs {ind[0]} at node 0 ({hint})"
        )
    w = 1.0 / (1.0 + ind[0])
    diag = np.arange(n, dtype=np.int64)
    phase = Phase(
        n,
        np.concatenate([receivers, diag]),
        np.concatenate([senders, diag]),
        np.full(len(e) + n, w),
    )
    return phase if sparse else phase.dense()


#: rule name -> function(graph, *, sparse=False)
WEIGHT_RULES = {
    "metropolis": metropolis,
    "max_degree": max_degree,
    "best_constant": best_constant,
    "fmmc": fmmc,
    "uniform": uniform,
}


def weight_rule(name: str):
    """The weight rule called ``name``; unknown names list the known ones.

    Examples
    --------
    >>> weight_rule("metropolis").__name__
    'metropolis'
    """
    if name in WEIGHT_RULES:
        return WEIGHT_RULES[name]
    close = difflib.get_close_matches(str(name), WEIGHT_RULES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TopologyError(f"unknown weight rule {name!r}{hint}; known: {', '.join(WEIGHT_RULES)}")

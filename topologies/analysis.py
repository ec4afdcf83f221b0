"""Consensus analysis of mixing schedules: spectral quantities, connectivity, contraction, runs.

Conventions follow :mod:`topologies._base`: values are rows and ``x_{t+1} = W_t @ x_t``, so the
product over a window of rounds is left-multiplied by the later rounds,
``W_{l,tau} = W_{(l+1)tau-1} ... W_{l tau}``. ``J = 11^T/n`` is the exact-averaging matrix.

Everything here is numpy only; large schedules are handled through their sparse phases rather
than dense ``n x n`` products per round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topologies._base import (
    MixingSchedule,
    Phase,
    TopologyError,
    _connected,
    _is_int,
    _merge,
    _sum_duplicates,
)
from topologies.validation import _check_tol, check_row_stochastic, check_square

__all__ = [
    "ExplicitSchedule",
    "ConsensusResult",
    "rho",
    "spectral_gap",
    "connectivity_tau",
    "window_contraction",
    "estimate_p",
    "round_properties",
    "consensus_run",
    "schedule_rho",
    "describe",
]

_TOL = 1e-9


class ExplicitSchedule(MixingSchedule):
    """A deterministic schedule cycling through explicit dense matrices: ``W_t = Ws[t % len(Ws)]``.

    Handy to analyse matrices produced elsewhere and in tests.

    Parameters
    ----------
    matrices : sequence of (n, n) array_like
        The mixing matrices of one period: row-stochastic (checked, as a ``StaticSchedule``'s;
        the analyses' rates assume it). Entries may be negative (Xiao and Boyd's best constant
        weights without their cap): ``round_properties`` says so.
    seed : int, optional
        Stored for interface compatibility; nothing is random.

    Examples
    --------
    >>> s = ExplicitSchedule([np.eye(2), np.full((2, 2), 0.5)])
    >>> s.n, s.period, float(s.matrix(3)[0, 1])
    (2, 2, 0.5)
    """

    def __init__(self, matrices: Any, seed: int = 0) -> None:
        mats = []
        for t, m in enumerate(matrices):  # (a sum-2 matrix got a rate and a "consensus")
            try:
                m = check_square(m)
                check_row_stochastic(m)
            except TopologyError as err:
                raise TopologyError(f"ExplicitSchedule matrix {t}: {err}") from None
            mats.append(m)
        if not mats:
            raise TopologyError("ExplicitSchedule needs at least one matrix")
        n = mats[0].shape[0]
        if any(m.shape != (n, n) for m in mats):
            raise TopologyError(f"ExplicitSchedule matrices must all be square of size {n}")
        self.n = n
        self.seed = seed
        self.is_random = False
        self.period = len(mats)
        self._phases = [Phase.from_dense(m) for m in mats]
        self._mats = mats

    def phases(self, t: int) -> list[Phase]:
        self._check_access(t)
        return [self._phases[t % self.period]]

    def matrix(self, t: int) -> np.ndarray:
        self._check_access(t)
        return self._mats[t % self.period].copy()


# --------------------------------------------------------------------------- spectral


def rho(W: np.ndarray) -> float:
    """Consensus rate ``||W - 11^T/n||_2`` (spectral norm) of one mixing matrix.

    For a doubly stochastic ``W``, ``||W x - xbar|| <= rho ||x - xbar||`` for every ``x``;
    for a symmetric doubly stochastic ``W`` it equals ``max(|lambda_2|, |lambda_n|)``.

    Parameters
    ----------
    W : (n, n) array_like
        Mixing matrix.

    Returns
    -------
    float

    Examples
    --------
    >>> round(rho(np.full((4, 4), 0.25)), 12)
    0.0
    >>> rho(np.eye(3))
    1.0
    """
    W = check_square(W)  # a (2, 3) "matrix" got a rho too
    n = W.shape[0]
    D = W - 1.0 / n
    if np.array_equal(D, D.T):
        # symmetric: eigenvalues are cheaper and more accurate than an SVD
        return float(np.abs(np.linalg.eigvalsh(D)).max())
    # sigma_max^2 = lambda_max(D^T D): a product and a symmetric eigensolve are several times
    # faster than an SVD at n ~ 1000, and the largest eigenvalue keeps full relative accuracy
    return float(np.sqrt(max(np.linalg.eigvalsh(D.T @ D)[-1], 0.0)))


def spectral_gap(W: np.ndarray) -> float:
    """Spectral gap ``1 - rho(W)``; for symmetric doubly stochastic ``W`` it is
    ``1 - max(|lambda_2|, |lambda_n|)`` (``1 - |lambda_2|`` with eigenvalues sorted by modulus).

    Parameters
    ----------
    W : (n, n) array_like
        Mixing matrix.

    Returns
    -------
    float
        0 for a matrix that never mixes (disconnected graph), 1 for exact averaging.

    Examples
    --------
    >>> ring = (np.eye(4) + np.roll(np.eye(4), 1, 1) + np.roll(np.eye(4), -1, 1)) / 3
    >>> round(spectral_gap(ring), 6)
    0.666667
    """
    return 1.0 - rho(W)


# --------------------------------------------------------------------------- sparse helpers


#: a phase denser than this is applied as a dense product: BLAS takes its n^2 d multiply-adds
#: faster than NumPy gathers nnz d (a complete graph's window at n = 1,000 took 75 s and 16 GB)
_DENSE_FROM = 1 / 32
#: ... and this, applied to at least n / 4 columns (a window's product): BLAS's matrix product
#: then runs near its peak (0.025 ns a multiply-add on 2 cores), the gathers at 6 to 15 ns an
#: entry: at density 0.002 dense was 1.2x to 1.4x faster for n = 1,000 and 3,000, at 0.02
#: 7x (n = 1,000: 164 -> 23 ms); at 0.001 (a ring of 3,000) the gathers still win
_DENSE_WIDE_FROM = 1 / 512
#: the sparse product's gathered block, ``nnz x columns``, at most this many entries (128 MB)
_BLOCK = 2**24


def _apply_phase(phase: Phase, z: np.ndarray, inplace: bool = False) -> np.ndarray:
    """``phase.dense() @ z``, in O(nnz * d) for a sparse phase: rows that receive nothing keep
    their value; ``inplace``: a sparse phase writes its rows into ``z`` (each block of columns
    is gathered before it is written)."""
    wide = z.ndim == 2 and 4 * z.shape[1] >= phase.size
    density = _DENSE_WIDE_FROM if wide else _DENSE_FROM
    if phase.rows.size > density * phase.size**2 and phase.size == z.shape[0]:
        return phase.dense() @ z
    out = z if inplace else z.copy()
    if phase.rows.size == 0:
        return out
    order = np.argsort(phase.rows, kind="stable")
    rows, cols, w = phase.rows[order], phase.cols[order], phase.weights[order]
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    step = max(1, _BLOCK // rows.size)  # columns at a time
    for j in range(0, z.shape[1], step):
        part = z[cols, j : j + step] * w[:, None]
        out[rows[starts], j : j + step] = np.add.reduceat(part, starts, axis=0)
    return out


def _apply_round(schedule: MixingSchedule, t: int, x: np.ndarray, own: bool = False) -> np.ndarray:
    """``W_t @ x`` through the phases of round ``t``; auxiliary nodes start at 0 as in
    ``matrix(t)``, which keeps only the peer columns of the phase product. ``own``: ``x`` may
    be overwritten; otherwise it is copied once, not once a phase (a hub round of 10% of
    1,000 peers copied three n x n matrices to change a tenth of their rows)."""
    n = schedule.n
    z = x
    for phase in schedule.phases(t):
        if phase.size > z.shape[0]:
            z, own = np.vstack([z, np.zeros((phase.size - z.shape[0], x.shape[1]))]), True
        elif not own:
            z, own = z.copy(), True
        z = _apply_phase(phase, z, inplace=True)
    return z[:n]


def _window_product(schedule: MixingSchedule, start: int, length: int) -> np.ndarray:
    """``W_{start+length-1} ... W_{start}`` (dense ``n x n``), via sparse phase applications;
    a window of many periods of a periodic schedule as ``R P^q`` (one period's product ``P``
    raised by squaring, ``R`` the rounds left over), where that is cheaper: ``tau = 10^9``
    applied 10^9 rounds."""
    n, period = schedule.n, _repeats(schedule)
    if period is not None and length >= 2 * period:
        q, r = divmod(length, period)
        squarings = 2 * q.bit_length() * n**3  # multiply-adds, against a round's n^2 at most
        if squarings < (length - period - r) * n * n:
            whole = np.linalg.matrix_power(_window_product(schedule, start, period), q)
            return _window_product(schedule, start, r) @ whole if r else whole
    P = np.eye(n)
    for t in range(start, start + length):
        P = _apply_round(schedule, t, P, own=True)
    return P


def _effective_coo(schedule: MixingSchedule, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nonzero entries ``(rows, cols, weights)`` of the effective ``W_t``, duplicates merged."""
    n = schedule.n
    phases = schedule.phases(t)
    if len(phases) == 1 and phases[0].size == n:
        p = phases[0]
        silent = np.ones(n, dtype=bool)
        silent[p.rows] = False  # rows that receive nothing keep their value: weight 1 on self
        idle = np.flatnonzero(silent)
        keys = np.concatenate([p.rows * n + p.cols, idle * (n + 1)])
        vals = np.concatenate([p.weights, np.ones(idle.size)])
        uniq, w = _sum_duplicates(keys, vals)
        keep = w != 0
        return uniq[keep] // n, uniq[keep] % n, w[keep]
    W = _apply_round(schedule, t, np.eye(n))  # multi-phase (hub) rounds: small effective product
    r, c = np.nonzero(W)
    return r, c, W[r, c]


def _check_horizon(horizon: int) -> None:
    if not _is_int(horizon) or horizon < 1:
        raise TopologyError(f"horizon must be a positive number of rounds, got {horizon}")


def _repeats(schedule: MixingSchedule) -> int | None:
    """The period after which a deterministic schedule's rounds repeat (None: random or
    aperiodic): its analyses read one period of rounds."""
    return None if schedule.is_random else schedule.period


def _check_counts(least: int = 1, **counts) -> None:
    """Each keyword is an int >= ``least`` (a float or None was NumPy's or Python's own
    error, a negative seed numpy's)."""
    for name, value in counts.items():
        if not _is_int(value) or value < least:
            raise TopologyError(f"{name} must be an int >= {least}, got {value!r}")


# --------------------------------------------------------------------------- connectivity


def _round_edges(
    schedule: MixingSchedule, t: int, offset: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Off-diagonal nonzero edges of round ``t``'s phases; auxiliary node ``k >= n`` becomes
    ``k + offset`` so that a hub of one round is a different node from the hub of another
    (its value does not carry over between rounds)."""
    n = schedule.n
    us, vs, extra = [], [], 0
    for p in schedule.phases(t):
        mask = (p.rows != p.cols) & (p.weights != 0)
        u, v = p.rows[mask], p.cols[mask]
        us.append(np.where(u >= n, u + offset, u))
        vs.append(np.where(v >= n, v + offset, v))
        extra = max(extra, p.size - n)
    return np.concatenate(us), np.concatenate(vs), extra


def _window_lengths(
    schedule: MixingSchedule, rounds: int, starts: int, each_round: Callable | None = None
) -> np.ndarray:
    """``L[t]``, ``t < starts``: length of the shortest window starting at ``t`` whose union graph
    is connected (``inf`` when none ends before round ``rounds``). ``each_round(t)`` is called
    as round ``t`` is read (in order, each once), while the schedule still holds it.

    The end ``t + L[t] - 1`` never decreases with ``t`` (a window containing a connected one
    is connected), so each start resumes from the previous end: a two-pointer sweep.
    """
    n = schedule.n
    edges, offset = [], n
    for t in range(rounds):
        u, v, extra = _round_edges(schedule, t, offset - n)
        edges.append((u, v))
        offset += extra
        if each_round is not None:
            each_round(t)
    lengths = np.full(starts, np.inf)
    end = 0  # exclusive end of the previous start's shortest window
    for t in range(starts):
        parent = np.arange(offset)
        stop = max(end, t + 1)
        _merge(parent, *_concat(edges[t:stop]))
        while not np.all(parent[:n] == parent[0]) and stop < rounds:
            _merge(parent, *edges[stop])
            stop += 1
        if not np.all(parent[:n] == parent[0]):
            break  # later windows are sub-windows of this one: none is connected either
        lengths[t] = stop - t
        end = stop
    return lengths


def _concat(edges: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([e[0] for e in edges]), np.concatenate([e[1] for e in edges])


def connectivity_tau(
    schedule: MixingSchedule, horizon: int = 100, *, each_round: Callable | None = None
) -> int | None:
    """Smallest ``tau`` such that every window of ``tau`` consecutive rounds within the horizon
    has a connected union graph.

    The union graph of rounds ``t .. t+tau-1`` has an edge ``{i, j}`` when some ``W_s`` in the
    window has ``W_s[i, j] != 0`` or ``W_s[j, i] != 0`` (``i != j``), i.e. directions are ignored
    and *weak* connectivity is tested. For doubly stochastic rounds this is the same as strong
    connectivity: a doubly stochastic matrix is a direct sum of irreducible blocks, so each
    weak component of a round is strongly connected, and so is a union of them. For merely
    row-stochastic schedules (a server with non-uniform weights) it is only weak connectivity.
    Rounds with several phases are read through their phases, with a fresh auxiliary node
    (hub) per round.

    Which windows: for a deterministic periodic schedule, the ``period`` distinct ones (starts
    ``0 .. period-1``, reading rounds up to ``period + horizon - 2``), so ``tau`` is exact for the
    whole infinite schedule, and ``horizon`` only caps it. Otherwise (random or aperiodic
    schedules) every window inside the horizon: starts ``t`` in ``[0, horizon - tau]``.

    Parameters
    ----------
    schedule : MixingSchedule
    horizon : int, optional
        Largest ``tau`` considered; rounds ``0 .. horizon-1`` for random/aperiodic schedules.
    each_round : callable, optional
        Called with each round read, in order, while the schedule holds it (another pass over
        the same rounds then draws no random graph again).

    Returns
    -------
    int or None
        ``None`` when no ``tau <= horizon`` works.

    Examples
    --------
    >>> n = 4
    >>> A = np.eye(n); A[[0, 1, 2, 3], [1, 0, 3, 2]] = 1; A /= A.sum(1, keepdims=True)
    >>> B = np.eye(n); B[[1, 2], [2, 1]] = 1; B /= B.sum(1, keepdims=True)
    >>> connectivity_tau(ExplicitSchedule([A, B]), horizon=10)
    2
    >>> connectivity_tau(ExplicitSchedule([A]), horizon=10) is None
    True
    """
    _check_horizon(horizon)
    if schedule.n == 1:
        return 1
    period = _repeats(schedule)
    if period is not None:
        # a window of a whole period holds every round's links: longer ones add none, so no
        # round past 2 period - 1 is read (a horizon of 10^9 on a ring read them all)
        rounds = period - 1 + min(horizon, period)
        worst = _window_lengths(schedule, rounds, period, each_round).max()
        return int(worst) if worst <= horizon else None
    lengths = _window_lengths(schedule, horizon, horizon, each_round)
    worst = np.maximum.accumulate(lengths)  # worst[k] = max L over starts 0..k
    for tau in range(1, horizon + 1):
        if worst[horizon - tau] <= tau:
            return tau
    return None


# --------------------------------------------------------------------------- contraction


def _distinct_windows(schedule: MixingSchedule, tau: int, limit: int) -> int:
    """Number of windows needed to see every distinct one (capped at ``limit`` if aperiodic)."""
    if (period := _repeats(schedule)) is not None:
        return period // math.gcd(period, tau)
    return max(1, limit)


def window_contraction(schedule: MixingSchedule, tau: int, windows: int = 1) -> float:
    """Worst contraction ``max_l ||W_{l,tau} - 11^T/n||_2`` over windows ``l = 0..windows-1``,
    where ``W_{l,tau} = W_{(l+1)tau-1} ... W_{l tau}``.

    Parameters
    ----------
    schedule : MixingSchedule
    tau : int
        Window length (e.g. from :func:`connectivity_tau`).
    windows : int, optional
        Number of consecutive windows examined.

    Returns
    -------
    float
        Below 1 when every window mixes; 0 when each window averages exactly.

    Examples
    --------
    >>> I = np.eye(2); A = np.full((2, 2), 0.5)
    >>> window_contraction(ExplicitSchedule([I, A]), tau=2, windows=1)
    0.0
    >>> window_contraction(ExplicitSchedule([I, A]), tau=1, windows=2)
    1.0
    """
    _check_counts(tau=tau, windows=windows)
    return max(rho(_window_product(schedule, l * tau, tau)) for l in range(windows))


#: the window positions a random schedule's ``p`` is sampled from (distinct ones)
_POSITIONS = 2**20


def _check_trials(schedule: MixingSchedule, trials: int) -> None:
    if schedule.is_random and trials > _POSITIONS:  # (numpy: "a larger sample than population")
        raise TopologyError(f"trials must be at most {_POSITIONS:,} for a random schedule (its "
                            f"windows' distinct positions), got {trials:,}")  # fmt: skip


def estimate_p(schedule: MixingSchedule, tau: int, trials: int = 20, seed: int = 0) -> float:
    """Mixing parameter ``p`` of ``E||W_{l,tau} X - Xbar||_F^2 <= (1 - p) ||X - Xbar||_F^2``.

    With ``J = 11^T/n`` and a row-stochastic window product ``W``, ``W X - J X = (W - J)(X - J X)``,
    so the worst direction gives ``p = 1 - lambda_max(M)`` with ``M = E[(W - J)^T (W - J)]``
    (``M 1 = 0``, so this is the maximum on the complement of ``1``).

    * Random schedules: ``M`` is averaged over ``trials`` windows at random positions drawn
      with ``seed``; this assumes the window distribution does not depend on its position
      (rounds drawn i.i.d. or stationary). A Monte-Carlo estimate.
    * Deterministic schedules: the bound must hold for every window, so
      ``p = 1 - max_l ||W_{l,tau} - J||_2^2 = 1 - window_contraction(...)**2`` over the distinct
      windows of one period (``trials`` windows when aperiodic). Exact.

    Parameters
    ----------
    schedule : MixingSchedule
    tau : int
        Window length.
    trials : int, optional
        Sampled windows (random schedules) or windows examined (aperiodic deterministic ones).
    seed : int, optional
        Seed of the window positions.

    Returns
    -------
    float
        In ``[0, 1]`` for doubly stochastic schedules; 1 means exact averaging.

    Examples
    --------
    >>> ring = (np.eye(4) + np.roll(np.eye(4), 1, 1) + np.roll(np.eye(4), -1, 1)) / 3
    >>> round(estimate_p(ExplicitSchedule([ring]), tau=1), 6)  # 1 - (1/3)**2
    0.888889
    """
    _check_counts(tau=tau, trials=trials)
    _check_counts(0, seed=seed)
    if not schedule.is_random:
        c = window_contraction(schedule, tau, _distinct_windows(schedule, tau, trials))
        return 1.0 - c**2
    n = schedule.n
    _check_trials(schedule, trials)
    rng = np.random.default_rng(seed)
    starts = rng.choice(_POSITIONS, size=trials, replace=False)
    M = np.zeros((n, n))
    for l in starts:
        D = _window_product(schedule, int(l) * tau, tau) - 1.0 / n
        M += D.T @ D
    M /= trials
    return float(1.0 - np.linalg.eigvalsh((M + M.T) / 2)[-1])


# --------------------------------------------------------------------------- properties


def round_properties(schedule: MixingSchedule, horizon: int = 100, tol: float = _TOL) -> dict:
    """Whether every effective ``W_t``, ``t < horizon``, is doubly stochastic, symmetric and
    nonnegative, checked on sparse entries (no dense ``n x n`` matrix for one-phase rounds).

    Parameters
    ----------
    schedule : MixingSchedule
    horizon : int, optional
        Rounds checked, ``0 .. horizon-1``.
    tol : float, optional
        Absolute tolerance on row/column sums, symmetry and negativity.

    Returns
    -------
    dict
        ``{"doubly_stochastic": bool, "symmetric": bool, "nonnegative": bool}``.

    Examples
    --------
    >>> round_properties(ExplicitSchedule([[[0.5, 0.5], [0.5, 0.5]]]), horizon=3)
    {'doubly_stochastic': True, 'symmetric': True, 'nonnegative': True}
    >>> round_properties(ExplicitSchedule([[[1.0, 0.0], [0.5, 0.5]]]))["doubly_stochastic"]
    False
    """
    _check_horizon(horizon)
    props, _ = _scan(schedule, horizon, _check_tol(tol))
    return props


def _mean_messages(schedule: MixingSchedule, horizon: int) -> float:
    """Messages a round over rounds ``0 .. horizon-1``; a periodic schedule's from one period
    (the same mean, without reading 10^9 rounds for a huge horizon)."""
    period = _repeats(schedule)
    if period is None or horizon <= period:
        return float(np.mean([schedule.messages(t) for t in range(horizon)]))
    counts = np.array([schedule.messages(t) for t in range(period)], dtype=float)
    whole, part = divmod(horizon, period)
    return float((counts.sum() * whole + counts[:part].sum()) / horizon)


class _Scan:
    """The three properties and the max in-degree of the rounds :meth:`add`-ed."""

    def __init__(self, schedule: MixingSchedule, tol: float) -> None:
        self.schedule, self.tol, self.read = schedule, tol, 0
        self.ds = self.sym = self.nonneg = True
        self.degree = 0

    def add(self, t: int) -> None:
        n, tol = self.schedule.n, self.tol
        r, c, w = _effective_coo(self.schedule, t)
        self.degree = max(self.degree, int(np.bincount(r[r != c], minlength=n).max(initial=0)))
        self.nonneg = self.nonneg and bool(w.min(initial=0.0) >= -tol)
        self.ds = self.ds and _doubly_stochastic(n, r, c, w, tol)
        self.sym = self.sym and _coo_symmetric(n, r, c, w, tol)
        self.read += 1

    def result(self) -> tuple[dict, int]:
        props = {"doubly_stochastic": self.ds, "symmetric": self.sym, "nonnegative": self.nonneg}
        return props, self.degree


def _rounds_scanned(schedule: MixingSchedule, horizon: int) -> int:
    """Rounds whose properties are those of every round: one period of a periodic schedule."""
    period = _repeats(schedule)
    return horizon if period is None else min(horizon, period)


def _scan(schedule: MixingSchedule, horizon: int, tol: float) -> tuple[dict, int]:
    """One pass over the rounds: the three properties and the max in-degree."""
    scan = _Scan(schedule, tol)
    for t in range(_rounds_scanned(schedule, horizon)):
        scan.add(t)
    return scan.result()


def _scan_and_tau(schedule: MixingSchedule, horizon: int) -> tuple[_Scan, int | None]:
    """The rounds' properties and :func:`connectivity_tau` in one pass: each round is read
    once (a random schedule's graphs were drawn once a pass: a run's check of 1,000 peers
    over Erdos-Renyi graphs took 17 of its 19.5 s)."""
    h, scan = _rounds_scanned(schedule, horizon), _Scan(schedule, _TOL)

    def each(t: int) -> None:
        if t == scan.read < h:
            scan.add(t)

    tau = connectivity_tau(schedule, horizon, each_round=each)
    for t in range(scan.read, h):  # (what connectivity did not read: n = 1)
        scan.add(t)
    return scan, tau


def _doubly_stochastic(n: int, r: np.ndarray, c: np.ndarray, w: np.ndarray, tol: float) -> bool:
    """Whether the COO matrix's rows and columns all sum to 1 within ``tol``."""
    return all(
        np.abs(np.bincount(a, weights=w, minlength=n) - 1).max(initial=0.0) <= tol for a in (r, c)
    )


def _coo_symmetric(n: int, r: np.ndarray, c: np.ndarray, w: np.ndarray, tol: float) -> bool:
    big = np.abs(w) > tol
    r, c, w = r[big], c[big], w[big]
    a, b = np.argsort(r * n + c, kind="stable"), np.argsort(c * n + r, kind="stable")
    if not np.array_equal((r * n + c)[a], (c * n + r)[b]):
        return False
    return bool(np.abs(w[a] - w[b]).max(initial=0.0) <= tol)


# --------------------------------------------------------------------------- consensus runs


@dataclass
class ConsensusResult:
    """Outcome of :func:`consensus_run`.

    Attributes
    ----------
    errors : ndarray, shape (rounds + 1,)
        Relative consensus distance ``||x_t - 1 mean(x_t)||_F / ||x_0 - 1 mean(x_0)||_F``.
    messages : ndarray, shape (rounds,)
        Directed messages (vectors sent) in each round.
    """

    errors: np.ndarray
    messages: np.ndarray = field(repr=False)

    @property
    def rounds(self) -> int:
        return len(self.messages)

    @property
    def final_error(self) -> float:
        return float(self.errors[-1])

    @property
    def cumulative_messages(self) -> np.ndarray:
        """Messages sent before round ``t`` for ``t = 0..rounds`` (aligned with ``errors``)."""
        return np.concatenate([[0], np.cumsum(self.messages)])

    def rounds_to(self, tol: float) -> int | None:
        """First round ``t`` with ``errors[t] <= tol``, None if never within the run.

        Examples
        --------
        >>> ConsensusResult(np.array([1.0, 0.1, 0.01]), np.array([2, 2])).rounds_to(0.05)
        2
        """
        hit = np.flatnonzero(self.errors <= tol)
        return int(hit[0]) if hit.size else None


def consensus_run(
    schedule: MixingSchedule,
    rounds: int,
    dim: int = 8,
    seed: int = 0,
    x0: np.ndarray | None = None,
) -> ConsensusResult:
    """Iterate ``x_{t+1} = W_t x_t`` from random ``x_0`` and record the consensus distance.

    The error is the *consensus distance* ``||x_t - 1 mean(x_t)||_F / ||x_0 - 1 mean(x_0)||_F``
    rather than the distance to the initial average: schedules that are only row-stochastic
    (e.g. a server aggregating with non-uniform weights) converge to a weighted average, and
    the consensus distance still goes to 0 for them. For doubly stochastic schedules the mean
    is preserved, so both coincide. Rounds are applied through the sparse phases
    (``O(nnz * dim)`` per round).

    Parameters
    ----------
    schedule : MixingSchedule
    rounds : int
        Number of rounds ``R``; errors are recorded for ``t = 0..R``.
    dim : int, optional
        Columns of ``x`` (ignored when ``x0`` is given).
    seed : int, optional
        Seed of the standard normal ``x_0``.
    x0 : (n,) or (n, dim) array_like, optional
        Explicit initial values.

    Returns
    -------
    ConsensusResult

    Examples
    --------
    >>> res = consensus_run(ExplicitSchedule([np.full((4, 4), 0.25)]), rounds=2)
    >>> res.errors.round(12).tolist(), res.rounds_to(1e-6), res.messages.tolist()
    ([1.0, 0.0, 0.0], 1, [12, 12])
    """
    _check_counts(0, rounds=rounds, seed=seed)
    _check_counts(dim=dim)
    n = schedule.n
    if x0 is None:
        x = np.random.default_rng(seed).standard_normal((n, dim))
    else:
        try:
            x = np.asarray(x0, dtype=float)
        except (TypeError, ValueError):
            raise TopologyError(f"x0 must be numbers, shape (n,) or (n, dim), got {x0!r}") from None
        if x.ndim not in (1, 2) or x.shape[0] != n:  # a reshape took (dim, n) or (2n,) too
            raise TopologyError(f"x0 must have shape (n,) or (n, dim) with n = {n}, got {x.shape}")
        if not np.isfinite(x).all():  # (its errors were NaN from the first round on)
            raise TopologyError("x0 must be finite numbers (it holds NaN or inf)")
        x = x.reshape(n, -1)
    start = _spread(x)
    if start == 0:
        raise TopologyError("initial values are already in consensus; nothing to measure")
    errors = np.empty(rounds + 1)
    messages = np.empty(rounds, dtype=np.int64)
    errors[0] = 1.0
    for t in range(rounds):
        messages[t] = sum(p.messages for p in schedule.phases(t))
        x = _apply_round(schedule, t, x, own=t > 0)  # (not the caller's x0)
        errors[t + 1] = _spread(x) / start
    return ConsensusResult(errors, messages)


def _spread(x: np.ndarray) -> float:
    return float(np.linalg.norm(x - x.mean(axis=0)))


# --------------------------------------------------------------------------- summary


def describe(schedule: MixingSchedule, horizon: int = 100, trials: int = 20, seed: int = 0) -> dict:
    """Summary of a schedule over rounds ``0 .. horizon-1``.

    Parameters
    ----------
    schedule : MixingSchedule
    horizon : int, optional
        Rounds examined.
    trials : int, optional
        Monte-Carlo windows for ``p`` and rounds averaged for ``rho`` (random schedules).
    seed : int, optional
        Seed of the Monte-Carlo window positions.

    Returns
    -------
    dict
        Exactly these keys:

        * ``n``: peers.
        * ``edges_per_round``: mean directed messages per round (summed over phases, so a
          server round counts uploads and downloads).
        * ``max_degree``: max in-degree of the effective ``W_t`` over the horizon.
        * ``doubly_stochastic``, ``symmetric``, ``nonnegative``: true for every round.
        * ``rho``: :func:`schedule_rho` (``rho(W_0)`` when static, max over one period when
          periodic, mean over ``trials`` rounds when random). Single rounds of time-varying
          schedules are often disconnected (``rho = 1``): then ``tau``/``contraction`` matter.
        * ``tau``: :func:`connectivity_tau`, None if not connected within the horizon.
        * ``contraction``: :func:`window_contraction` with that ``tau`` over the distinct
          windows of one period (``min(horizon // tau, trials)`` windows when aperiodic, the
          worst one seen for random schedules); None without ``tau``.
        * ``is_random``, ``period``: as on the schedule.
        * ``p``: :func:`estimate_p` with that ``tau`` (Monte Carlo over ``trials`` windows for
          random schedules, exactly ``1 - contraction**2`` for deterministic ones); None
          without ``tau``.

    Examples
    --------
    >>> d = describe(ExplicitSchedule([np.full((3, 3), 1 / 3)]), horizon=5)
    >>> d["n"], d["tau"], d["edges_per_round"], d["max_degree"], round(d["rho"], 12)
    (3, 1, 6.0, 2, 0.0)
    """
    _check_horizon(horizon)
    _check_counts(trials=trials)
    _check_counts(0, seed=seed)
    _check_trials(schedule, trials)  # before the scan, not after it
    scan, tau = _scan_and_tau(schedule, horizon)
    props, max_degree = scan.result()
    rate = schedule_rho(schedule, horizon, trials)
    contraction = p = None
    if tau == 1 and _repeats(schedule) is not None and schedule.period <= horizon:
        contraction = rate  # the same max of rho(W_t) over one period (an n^3 solve each)
    elif tau is not None:
        windows = _distinct_windows(schedule, tau, min(horizon // tau, trials))
        contraction = window_contraction(schedule, tau, windows)
    if tau is not None:
        p = estimate_p(schedule, tau, trials, seed) if schedule.is_random else 1 - contraction**2
    return {
        "n": schedule.n,
        "edges_per_round": _mean_messages(schedule, horizon),
        "max_degree": max_degree,
        **props,
        "rho": rate,
        "tau": tau,
        "contraction": contraction,
        "is_random": bool(schedule.is_random),
        "period": schedule.period,
        "p": p,
    }


def schedule_rho(schedule: MixingSchedule, horizon: int = 100, trials: int = 20) -> float:
    """Per-round ``rho`` of a schedule: ``rho(W_0)`` when static, the max over one period (at
    most ``horizon`` rounds) when periodic or deterministic, the mean over the first
    ``min(horizon, trials)`` rounds when random.

    Parameters
    ----------
    schedule : MixingSchedule
    horizon : int, optional
    trials : int, optional

    Returns
    -------
    float

    Examples
    --------
    >>> schedule_rho(ExplicitSchedule([np.eye(2), np.full((2, 2), 0.5)]))
    1.0
    """
    _check_horizon(horizon)
    if schedule.is_random:
        return float(np.mean([_round_rho(schedule, t) for t in range(min(horizon, trials))]))
    return max(_round_rho(schedule, t) for t in range(_rounds_scanned(schedule, horizon)))


def _round_rho(schedule: MixingSchedule, t: int) -> float:
    """``rho(W_t)``; exactly 1 without a dense solve where ``W_t`` is doubly stochastic, non-
    negative (so ``||W_t - J|| <= 1``) and its links leave the peers in several groups (each
    group's indicator, less the mean, is kept as it is: ``>= 1``). A ring of 3,000 peers with
    failing links solved 20 such rounds, 28 of a consensus study's 37 s."""
    n = schedule.n
    r, c, w = _effective_coo(schedule, t)
    if n > 1 and w.min(initial=0.0) >= 0 and _doubly_stochastic(n, r, c, w, _TOL):
        link = (r != c) & (w != 0)
        if not _connected(n, r[link], c[link]):
            return 1.0
    return rho(_window_product(schedule, t, 1))


def union_components(schedule: MixingSchedule, horizon: int = 100) -> list[set]:
    """Connected components of the union of the links of rounds ``0 .. horizon-1`` (one
    period of a periodic schedule), smallest first: what never mixes with what.

    Examples
    --------
    >>> union_components(ExplicitSchedule([np.eye(3)]))
    [{0}, {1}, {2}]
    """
    import networkx as nx

    _check_horizon(horizon)
    union = nx.Graph()
    union.add_nodes_from(range(schedule.n))
    for t in range(min(horizon, schedule.period or horizon)):
        r, c, _ = _effective_coo(schedule, t)
        union.add_edges_from(zip(r[r != c].tolist(), c[r != c].tolist()))
    return sorted(nx.connected_components(union), key=len)


def check_mixing(schedule: MixingSchedule, horizon: int = 100) -> None:
    """Raise unless the schedule can mix, with the figures that show why not: its W_t over the
    first ``horizon`` rounds never connect all peers (gossip would then be training alone), or
    they are not doubly stochastic (the peers' average drifts).

    Examples
    --------
    >>> check_mixing(ExplicitSchedule([np.eye(3)]))
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: schedule ... never connects all 3 peers within 100 rounds ...
    """
    _check_horizon(horizon)
    n, h = schedule.n, _rounds_scanned(schedule, horizon)
    scan, tau = _scan_and_tau(schedule, horizon)
    if tau is None:
        parts = union_components(schedule, horizon)
        raise TopologyError(
            f"schedule {schedule!r} never connects all {n} peers within {horizon} rounds (their "
            f"union has {len(parts)} components; the smallest holds peers "
            f"{sorted(parts[0])[:5]}): the peers would not mix"
        )
    if not scan.ds:
        for t in range(h):
            r, c, w = _effective_coo(schedule, t)
            for axis, what in ((r, "row"), (c, "column")):
                sums = np.bincount(axis, weights=w, minlength=n)
                j = int(np.abs(sums - 1).argmax())
                if abs(sums[j] - 1) > 1e-8:
                    raise TopologyError(
                        f"schedule {schedule!r} is not doubly stochastic: W_{t} {what} {j} "
                        f"sums to {sums[j]:.6g}, so the peers' average drifts"
                    )

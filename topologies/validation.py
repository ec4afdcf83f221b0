"""Checks on mixing matrices. ``check_*`` raise :class:`~topologies.TopologyError` naming the
offending row or column; ``is_*`` return a bool instead."""

from __future__ import annotations

import numpy as np

from topologies._base import MixingSchedule, TopologyError, _complex, _is_int

__all__ = [
    "check_square",
    "check_nonnegative",
    "check_symmetric",
    "check_row_stochastic",
    "check_doubly_stochastic",
    "is_square",
    "is_nonnegative",
    "is_symmetric",
    "is_row_stochastic",
    "is_doubly_stochastic",
    "validate_schedule",
]


def check_square(w) -> np.ndarray:
    """Raise unless ``w`` is a finite square 2-D matrix; return it as a float array.

    Examples
    --------
    >>> check_square(np.ones((2, 3)))
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: matrix must be square, got shape (2, 3)
    """
    if _complex(w):  # (float() dropped the imaginary part with a warning)
        raise TopologyError("matrix must be real, got complex numbers")
    try:
        a = np.asarray(w, dtype=float)
    except (TypeError, ValueError):  # strings, ragged lists, mappings
        raise TopologyError(f"matrix must be numbers, got {type(w).__name__} {w!r:.40}") from None
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.size == 0:
        raise TopologyError(f"matrix must be square, got shape {a.shape}")
    if not np.isfinite(a).all():
        i, j = np.argwhere(~np.isfinite(a))[0]
        raise TopologyError(f"entry ({i}, {j}) is not finite: {a[i, j]}")
    return a


def check_nonnegative(w, tol: float = 1e-8) -> None:
    """Raise if an entry is below ``-tol``.

    Examples
    --------
    >>> check_nonnegative([[1.0, 0.0], [-0.5, 1.5]])
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: entry (1, 0) is -0.5 (expected >= 0 within 1e-08)
    """
    a, tol = check_square(w), _check_tol(tol)
    bad = np.argwhere(a < -tol)
    if len(bad):
        i, j = bad[0]
        raise TopologyError(f"entry ({i}, {j}) is {a[i, j]:.6g} (expected >= 0 within {tol:g})")


def check_symmetric(w, tol: float = 1e-8) -> None:
    """Raise if ``|W_ij - W_ji| > tol`` somewhere.

    Examples
    --------
    >>> check_symmetric([[0.5, 0.5], [0.2, 0.8]])
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: not symmetric: W[0, 1] = 0.5 but W[1, 0] = 0.2
    """
    a, tol = check_square(w), _check_tol(tol)
    bad = np.argwhere(np.abs(a - a.T) > tol)
    if len(bad):
        i, j = bad[0]
        raise TopologyError(
            f"not symmetric: W[{i}, {j}] = {a[i, j]:.6g} but W[{j}, {i}] = {a[j, i]:.6g}"
        )


def _check_tol(tol) -> float:
    """A tolerance is a finite number >= 0 (a NaN one passed every check)."""
    ok = isinstance(tol, (int, float, np.floating)) and not isinstance(tol, bool)
    if not ok or not np.isfinite(tol) or tol < 0:
        raise TopologyError(f"tol must be a finite number >= 0, got {tol!r}")
    return float(tol)


def _check_sums(a: np.ndarray, axis: int, what: str, tol: float) -> None:
    tol = _check_tol(tol)
    sums = a.sum(axis=axis)
    bad = np.flatnonzero(np.abs(sums - 1.0) > tol)
    if len(bad):
        i = bad[0]
        raise TopologyError(f"{what} {i} sums to {sums[i]:.6g} (expected 1 within {tol:g})")


def check_row_stochastic(w, tol: float = 1e-8) -> None:
    """Raise if a row does not sum to 1 (entries may be negative; see :func:`check_nonnegative`).

    Examples
    --------
    >>> check_row_stochastic([[0.5, 0.5], [0.3, 0.6]])
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: row 1 sums to 0.9 (expected 1 within 1e-08)
    """
    _check_sums(check_square(w), 1, "row", tol)


def check_doubly_stochastic(w, tol: float = 1e-8) -> None:
    """Raise unless every row and column sums to 1 and no entry is negative.

    Examples
    --------
    >>> check_doubly_stochastic([[0.5, 0.5], [1.0, 0.0]])
    Traceback (most recent call last):
    ...
    topologies._base.TopologyError: column 0 sums to 1.5 (expected 1 within 1e-08)
    """
    a = check_square(w)
    _check_sums(a, 1, "row", tol)
    _check_sums(a, 0, "column", tol)
    check_nonnegative(a, tol)


def _as_bool(check, *args) -> bool:
    """Whether ``check(*args)`` passes (callers check ``tol`` first: a bad one is an error)."""
    try:
        check(*args)
    except TopologyError:
        return False
    return True


def is_square(w) -> bool:
    """True when ``w`` is a finite square matrix.

    Examples
    --------
    >>> is_square(np.eye(3))
    True
    """
    return _as_bool(check_square, w)


def is_nonnegative(w, tol: float = 1e-8) -> bool:
    """True when no entry is below ``-tol``.

    Examples
    --------
    >>> is_nonnegative([[1.0, -1.0], [0.0, 1.0]])
    False
    """
    return _as_bool(check_nonnegative, w, _check_tol(tol))


def is_symmetric(w, tol: float = 1e-8) -> bool:
    """True when ``W`` equals its transpose within ``tol``.

    Examples
    --------
    >>> is_symmetric(np.full((3, 3), 1 / 3))
    True
    """
    return _as_bool(check_symmetric, w, _check_tol(tol))


def is_row_stochastic(w, tol: float = 1e-8) -> bool:
    """True when every row sums to 1 within ``tol``.

    Examples
    --------
    >>> is_row_stochastic([[1.0, 0.0], [0.5, 0.5]])
    True
    """
    return _as_bool(check_row_stochastic, w, _check_tol(tol))


def is_doubly_stochastic(w, tol: float = 1e-8) -> bool:
    """True when rows and columns sum to 1 and no entry is negative (within ``tol``).

    Examples
    --------
    >>> is_doubly_stochastic([[1.0, 0.0], [0.5, 0.5]])
    False
    """
    return _as_bool(check_doubly_stochastic, w, _check_tol(tol))


def validate_schedule(
    schedule: MixingSchedule,
    rounds: int | None = None,
    *,
    doubly_stochastic: bool | None = None,
    symmetric: bool | None = None,
    tol: float = 1e-8,
) -> None:
    """Check ``W_0 .. W_{rounds-1}`` of a schedule (dense: meant for moderate ``n``).

    Every ``W_t`` must be square ``n x n``, non-negative and row-stochastic; also doubly
    stochastic / symmetric when asked, by default when the schedule says so through its
    ``doubly_stochastic`` / ``symmetric`` attributes. Errors start with ``round t:``.

    Parameters
    ----------
    schedule : MixingSchedule
    rounds : int, optional
        Rounds to check; default one period (10 rounds for aperiodic schedules).
    doubly_stochastic, symmetric : bool, optional
        Override the schedule's own claims.
    tol : float, default 1e-8

    Examples
    --------
    >>> from topologies.schedules import StaticSchedule
    >>> validate_schedule(StaticSchedule(np.full((4, 4), 0.25)))
    """
    if rounds is None:
        rounds = schedule.period or 10
    if not _is_int(rounds) or rounds < 1:
        raise TopologyError(f"rounds must be an int >= 1, got {rounds!r}")
    if doubly_stochastic is None:
        doubly_stochastic = getattr(schedule, "doubly_stochastic", True)
    if symmetric is None:
        symmetric = getattr(schedule, "symmetric", False)
    for t in range(rounds):
        try:
            w = check_square(schedule.matrix(t))
            if w.shape[0] != schedule.n:
                raise TopologyError(
                    f"matrix is {w.shape[0]} x {w.shape[0]}, expected n = {schedule.n}"
                )
            check_nonnegative(w, tol)
            check_row_stochastic(w, tol)
            if doubly_stochastic:
                check_doubly_stochastic(w, tol)
            if symmetric:
                check_symmetric(w, tol)
        except TopologyError as e:
            raise TopologyError(f"round {t}: {e}") from None

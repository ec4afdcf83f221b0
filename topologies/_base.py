"""The two types every schedule shares: a sparse mixing step and the schedule interface.

Conventions (the whole project relies on them):

* Peers are numbered ``0 .. n-1``. Values are rows: ``x_{t+1} = W_t @ x_t`` with ``x_t`` of shape
  ``(n, d)``, so row ``i`` of ``W_t`` holds the weights peer ``i`` gives to what it *receives*
  (its in-neighbours). Every ``W_t`` is row-stochastic; the decentralized schedules are also
  column-stochastic (doubly stochastic) and usually symmetric.
* A round may consist of several *phases* applied one after the other (the server schedule: peers
  to hub, then hub to peers). A phase may involve extra nodes beyond the peers (a hub that only
  aggregates is node ``n``). ``matrix(t)`` is the effective ``n x n`` product over the peers.
* Everything a schedule returns for round ``t`` is a pure function of ``(seed, t)``: every process
  computes the same ``W_t`` with no communication and without computing earlier rounds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

__all__ = ["TopologyError", "Phase", "MixingSchedule"]


class TopologyError(ValueError):
    """Bad topology input. The message is one line that names the problem."""


def _complex(x) -> bool:
    """Whether ``x`` holds complex numbers (False where numpy cannot read it: the cast that
    follows names that)."""
    try:
        return bool(np.iscomplexobj(x))
    except (TypeError, ValueError, AttributeError):  # ragged lists, mappings
        return False


def _npy_why(err: BaseException) -> str:
    """Why numpy could not read a .npy or .npz file, for a user: an empty file says "No data
    left in file", and a file of other bytes names numpy's pickle option, which the loaders
    keep off on purpose (a file's pickle would run code)."""
    text = str(err) or type(err).__name__
    if "allow_pickle" in text:
        return "not an array of numbers written by numpy's save or savez"
    return "the file is empty" if isinstance(err, EOFError) else text


@dataclass(frozen=True)
class Phase:
    """One sparse mixing step ``x_new[i] = sum_j weights[k] * x_old[j]`` over ``(rows, cols)``.

    ``rows``/``cols``/``weights`` are COO triplets (int64, int64, float64) that include the
    diagonal (self weights). Nodes ``>= n_peers`` are auxiliary (e.g. an aggregating hub).
    A node that appears in no row keeps its value (implicit self weight 1).
    """

    size: int
    rows: np.ndarray
    cols: np.ndarray
    weights: np.ndarray

    def dense(self) -> np.ndarray:
        """The ``size x size`` matrix of this phase, identity on rows that receive nothing."""
        w = np.zeros((self.size, self.size))
        np.add.at(w, (self.rows, self.cols), self.weights)
        untouched = np.ones(self.size, dtype=bool)
        untouched[self.rows] = False
        w[untouched, untouched] = 1.0
        return w

    @property
    def messages(self) -> int:
        """Number of (sender, receiver) pairs with ``sender != receiver`` and nonzero weight
        (a pair given twice is one message, of the entries' summed weight)."""
        off = self.rows != self.cols
        keys = np.asarray(self.rows[off], np.int64) * self.size + self.cols[off]
        if np.all(keys[1:] > keys[:-1]):  # sorted and distinct (a schedule's rows): no sort
            return int(np.count_nonzero(self.weights[off]))
        return int(np.count_nonzero(_sum_duplicates(keys, self.weights[off])[1]))

    @staticmethod
    def from_dense(w: np.ndarray) -> Phase:
        """The phase holding the nonzero entries of a dense square matrix."""
        rows, cols = np.nonzero(w)
        return Phase(w.shape[0], rows.astype(np.int64), cols.astype(np.int64), w[rows, cols])


def _sum_duplicates(keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct ``keys`` and each one's sum of ``vals`` (float64), a key's values
    added in their given order: ``np.unique(keys, return_inverse=True)`` and ``np.bincount``
    over the inverse, to the bit, from one stable sort (6x faster: 0.5 against 3.4 ms for a
    random schedule's round at n = 300, p = 0.5)."""
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], np.asarray(vals, np.float64)[order]
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    if first.all():
        return keys, vals + 0.0  # (bincount's 0.0 + v: a -0.0 becomes +0.0 there too)
    return keys[first], np.bincount(np.cumsum(first) - 1, weights=vals)


def _compress(parent: np.ndarray) -> None:
    """Pointer jumping until every node points at its root."""
    while True:
        grand = parent[parent]
        if np.array_equal(grand, parent):
            return
        parent[:] = grand


def _merge(parent: np.ndarray, u: np.ndarray, v: np.ndarray) -> None:
    """Vectorized union of edges ``(u, v)`` into a star forest ``parent`` (roots hook to the
    smallest neighbouring root, so pointers only decrease and no cycle can form)."""
    while True:
        ru, rv = parent[u], parent[v]
        differ = ru != rv
        if not differ.any():
            return
        lo = np.minimum(ru[differ], rv[differ])
        hi = np.maximum(ru[differ], rv[differ])
        np.minimum.at(parent, hi, lo)
        _compress(parent)


def _connected(n: int, u: np.ndarray, v: np.ndarray) -> bool:
    """Whether the undirected edges ``(u, v)`` connect nodes ``0..n-1`` (:func:`_merge`: 0.2
    ms for G(300, 0.5)'s 45,000 edges)."""
    parent = np.arange(n)
    _merge(parent, u, v)
    return bool(np.all(parent == parent[0]))


#: rounds are below this (the seeds' and draws' 64-bit integers stay in range)
MAX_ROUND = 2**48


class MixingSchedule(ABC):
    """A sequence of mixing matrices ``W_0, W_1, ...`` over ``n`` peers with random access.

    Subclasses implement :meth:`phases`; the rest has generic (dense) defaults that large-n
    schedules override with sparse versions.
    """

    #: number of peers
    n: int
    #: seed every random draw derives from
    seed: int = 0
    #: True when W_t is drawn at random each round (analysis then estimates p by Monte Carlo)
    is_random: bool = False
    #: W_{t+period} == W_t for all t; None when aperiodic (random schedules)
    period: int | None = 1

    @abstractmethod
    def phases(self, t: int) -> list[Phase]:
        """The phases of round ``t``, applied in order."""

    def matrix(self, t: int) -> np.ndarray:
        """The effective ``n x n`` mixing matrix of round ``t`` (product of its phases)."""
        self._check_access(t)
        w = None
        for phase in self.phases(t):
            d = phase.dense()
            w = d if w is None else d @ w
        return w[: self.n, : self.n]

    def neighbors(self, t: int, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        """Peer ``i``'s in-neighbours ``j != i`` in round ``t``, their weights ``W_t[i, j]`` and
        the self weight ``W_t[i, i]``. Sparse schedules answer in O(degree)."""
        self._check_access(t, i)
        row = self.matrix(t)[i]
        idx = np.flatnonzero(row)
        idx = idx[idx != i]
        return idx, row[idx], float(row[i])

    def _check_access(self, t, *i) -> None:
        """A round ``t`` is an int >= 0 and a peer ``i`` (when given) one of 0..n-1 (a negative
        i read another peer's row through NumPy's indexing; one past n, a made-up peer)."""
        if not _is_int(t) or not 0 <= t < MAX_ROUND:  # (past it the draws' ints overflow)
            raise TopologyError(f"round t must be an int in [0, 2**48), got {t!r}")
        if i and not (_is_int(i[0]) and 0 <= i[0] < self.n):
            raise TopologyError(f"peer i must be in 0..{self.n - 1}, got {i[0]!r}")

    def messages(self, t: int) -> int:
        """Vectors sent in round ``t`` (summed over phases)."""
        return sum(p.messages for p in self.phases(t))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, seed={self.seed})"


def _is_int(v) -> bool:
    """An integer, Python's or NumPy's, and not a bool (True is an int to Python)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

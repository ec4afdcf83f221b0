"""Who takes part in a round, and the mixing phases that follow from it.

The sampler is a pure function of (seed, round): every rank draws the same participants, so one
process and k ranks train the same clients. A client that sits out does no local work and keeps
its state; on a gossip schedule its links' weights go to the diagonals of both ends.
"""

from __future__ import annotations

import numpy as np

from gossip_pfl.errors import GossipError
from topologies import Phase

SAMPLER_STREAM = 11  #: keeps the participant draws apart from the schedule's own draws


def participant_count(participation: float | int, n: int) -> int:
    """Clients per round: an int is a count, a float in (0, 1] a fraction of ``n``.

    >>> participant_count(10, 100), participant_count(0.25, 10), participant_count(1.0, 7)
    (10, 2, 7)
    """
    if isinstance(participation, bool):
        raise GossipError(
            f"config key 'participation' must be a count or a fraction, got {participation!r}"
        )
    if isinstance(participation, int):
        if not 1 <= participation <= n:
            raise GossipError(
                f"config key 'participation' must be a count in 1..{n} (the training clients) "
                f"or a fraction in (0, 1], got {participation}"
            )
        return participation
    if not (isinstance(participation, float) and 0 < participation <= 1):
        raise GossipError(
            f"config key 'participation' must be a count in 1..{n} or a fraction in (0, 1], "
            f"got {participation!r}"
        )
    return max(1, round(participation * n))


def sample_participants(seed: int, t: int, n: int, count: int) -> np.ndarray:
    """Boolean mask (n,) of round ``t``'s participants: ``count`` of ``n`` without replacement.

    >>> m = sample_participants(1234, 5, 10, 3)
    >>> int(m.sum()), bool((m == sample_participants(1234, 5, 10, 3)).all())
    (3, True)
    """
    mask = np.zeros(n, dtype=bool)
    if count >= n:
        mask[:] = True
        return mask
    rng = np.random.default_rng([seed, t, SAMPLER_STREAM])
    mask[rng.choice(n, size=count, replace=False)] = True
    return mask


def sit_out(phase: Phase, active: np.ndarray) -> Phase:
    """The phase with every link that touches an inactive peer removed, its weight moved to
    the diagonal of the receiving row (the sending end's row moves its weight the same way, so
    a symmetric doubly stochastic W stays doubly stochastic). Inactive rows become e_i.

    >>> w = np.full((3, 3), 1 / 3)
    >>> sit_out(Phase.from_dense(w), np.array([True, True, False])).dense().round(3).tolist()
    [[0.667, 0.333, 0.0], [0.333, 0.667, 0.0], [0.0, 0.0, 1.0]]
    """
    if active.all():
        return phase
    on = np.ones(phase.size, dtype=bool)
    on[: len(active)] = active  # auxiliary nodes (a hub) always take part
    cut = ~(on[phase.rows] & on[phase.cols]) & (phase.rows != phase.cols)
    moved = np.bincount(phase.rows[cut], weights=phase.weights[cut], minlength=phase.size)
    keep = ~cut
    rows, cols, w = phase.rows[keep], phase.cols[keep], phase.weights[keep].copy()
    diag = rows == cols
    w[diag] += moved[rows[diag]]
    # a row that had no diagonal entry but lost links gets one
    has_diag = np.zeros(phase.size, dtype=bool)
    has_diag[rows[diag]] = True
    need = np.flatnonzero((moved > 0) & ~has_diag)
    return Phase(
        phase.size,
        np.concatenate([rows, need]),
        np.concatenate([cols, need]),
        np.concatenate([w, moved[need]]),
    )


def star_phases(active: np.ndarray, weights: np.ndarray) -> list[Phase]:
    """The server schedule over an aggregating hub (node n): up, the hub's row is the
    participants' average with ``weights`` renormalised over them; down, every peer copies
    the hub (so a client sampled later starts from the current global model)."""
    n = len(active)
    s = np.flatnonzero(active)
    w = np.asarray(weights, dtype=float)
    w = w / w.sum()  # as ServerSchedule normalises: the same bits on full participation
    p = w[s] / w[s].sum()
    up = Phase(n + 1, np.full(len(s), n, dtype=np.int64), s.astype(np.int64), p)
    peers = np.arange(n, dtype=np.int64)
    down = Phase(n + 1, peers, np.full(n, n, dtype=np.int64), np.ones(n))
    return [up, down]

"""Counter-based random draws: every number is a function of (seed, stream, round, client,
index) alone, so one process and any number of ranks draw the same values for a client, and a
resumed run draws what the uninterrupted one would have (the round counter is the RNG state).

A splitmix64 hash (Steele, Lea, Flood 2014) of the counter, vectorised in numpy: all clients of
a rank in one call, no generator object per client.
"""

from __future__ import annotations

import numpy as np

#: streams keep the kinds of draws apart
BATCH, QUANT, PARTICIPATION = 1, 2, 3

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    k = np.zeros(1, dtype=np.uint64)
    for p in parts:  # chained, so (1, 2) and (2, 1) give different keys
        k = _mix(k ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF))
    return k[0]


def uniforms(seed: int, stream: int, t: int, clients, shape: tuple[int, ...]) -> np.ndarray:
    """Uniforms in [0, 1) of shape ``(len(clients), *shape)``: row k depends only on
    (seed, stream, t, clients[k]).

    >>> a = uniforms(1, 2, 3, [0, 5], (4,))
    >>> bool((a[1] == uniforms(1, 2, 3, [5], (4,))[0]).all()), a.shape
    (True, (2, 4))
    """
    clients = np.asarray(clients, dtype=np.uint64)
    size = int(np.prod(shape, dtype=np.int64))
    with np.errstate(over="ignore"):
        key = _key(seed, stream, t)
        base = _mix(key ^ _mix(clients + np.uint64(1)))  # (C,)
        idx = np.arange(size, dtype=np.uint64)
        z = _mix(base[:, None] ^ (idx[None, :] * _GOLDEN))
    # the top 53 bits: a double in [0, 1)
    return ((z >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(len(clients), *shape)


def bernoulli(seed: int, t: int, n: int, p: float) -> np.ndarray:
    """Round t's participants (n,) bool, each with probability p (all for p = 1)."""
    if p >= 1:
        return np.ones(n, dtype=bool)
    return uniforms(seed, PARTICIPATION, t, [0], (n,))[0] < p

"""A rank's peers' data as padded tensors, and the seeded minibatch plan of a round.

Peers hold different numbers of samples. Each peer's data is padded to the rank's largest peer,
and each step draws a (L, B) index batch with a (L, B) weight mask: padded slots get weight 0,
so one batched step trains every peer on its own minibatch. Minibatch order depends only on
(seed, peer, round), never on the placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass
class PaddedSplit:
    """(L, N_max, *in) inputs, (L, N_max) labels and the true count of every peer."""

    x: torch.Tensor
    y: torch.Tensor
    counts: torch.Tensor  # (L,) int64

    @staticmethod
    def build(xs: list[np.ndarray], ys: list[np.ndarray], device: torch.device) -> PaddedSplit:
        counts = np.array([len(y) for y in ys], dtype=np.int64)
        n_max = max(1, int(counts.max(initial=0)))
        shape = xs[0].shape[1:]
        # float32 inputs, or int64 token ids (text) kept as integers for an embedding
        dtype = np.int64 if np.issubdtype(xs[0].dtype, np.integer) else np.float32
        x = np.zeros((len(xs), n_max, *shape), dtype=dtype)
        y = np.zeros((len(ys), n_max), dtype=np.int64)
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            x[i, : len(yi)] = xi
            y[i, : len(yi)] = yi
        return PaddedSplit(
            torch.from_numpy(x).to(device),
            torch.from_numpy(y).to(device),
            torch.from_numpy(counts).to(device),
        )

    @staticmethod
    def of(clients: list, split: str, device: torch.device) -> PaddedSplit:
        """Split ``split`` ("train", "test", ...) of a list of ClientData."""
        pairs = [c.split(split) for c in clients]
        return PaddedSplit.build([x for x, _ in pairs], [y for _, y in pairs], device)

    @cached_property
    def mask(self) -> torch.Tensor:
        """(L, N_max) 1.0 on real samples, 0.0 on padding (built once: every round asks)."""
        ar = torch.arange(self.y.shape[1], device=self.y.device)
        return (ar[None, :] < self.counts[:, None]).to(torch.float32)

    def take(self, rows: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``idx`` (A, B) of peers ``rows`` (A,): inputs (A, B, *in), labels (A, B).
        One index_select over the flattened (peer, sample) axis: several times faster than
        advanced indexing with two index tensors."""
        n = self.y.shape[1]
        flat = (rows[:, None] * n + idx).reshape(-1)
        x = self.x.flatten(0, 1).index_select(0, flat).view(*idx.shape, *self.x.shape[2:])
        return x, self.y.flatten().index_select(0, flat).view(idx.shape)

    def chunks(self, budget: int):
        """Yield (rows, sample slice, x, y, mask) pieces that cover every real sample once,
        each holding at most about ``budget`` samples over all its peers (memory stays flat).
        Peers with no sample in a piece's positions are left out: client sizes are skewed,
        and forwarding padding would cost several times the real work."""
        n_max = self.y.shape[1]
        # Wide enough that a call is not all overhead (32 samples per peer when the budget
        # allows), narrow enough that all the rank's peers share a call when it allows.
        width = min(n_max, max(1, budget // max(1, len(self.counts)), min(budget, 32)))
        mask = self.mask
        for start in range(0, n_max, width):
            active = (self.counts > start).nonzero()[:, 0]
            sl = slice(start, start + width)
            for rows in active.split(max(1, budget // width)):
                yield rows, sl, self.x[rows, sl], self.y[rows, sl], mask[rows, sl]


def round_batches(
    counts: np.ndarray,
    peers: np.ndarray,
    seed: int,
    round_: int,
    batch_size: int,
    epochs: int = 1,
    steps: int | None = None,
    stream: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Minibatch plan of one round for a rank's peers.

    Returns ``idx`` (S, L, B) sample indices and ``weight`` (S, L, B) in {0, 1}. Peer i takes
    ``epochs * ceil(n_i / B)`` steps, one permutation per epoch with a short last batch (or
    exactly ``steps`` full batches cut from a running stream of permutations); steps past a
    peer's end are all-zero weight, and the solver skips them. Each peer draws from its own
    generator seeded by (seed, peer, round, stream), so the plan of a peer does not depend on
    which other peers share its rank.
    """
    counts = np.asarray(counts, dtype=np.int64)
    per_epoch = -(-counts // batch_size)  # ceil(n_i / B)
    n_steps = steps if steps is not None else epochs * int(per_epoch.max(initial=0))
    # (L, S*B): each peer's plan is one contiguous row, filled with a few array operations
    # (a loop over batches costs more than the draws); returned as an (S, L, B) view.
    L, width = len(peers), n_steps * batch_size
    idx = np.zeros((L, width), dtype=np.int64)
    weight = np.zeros((L, width), dtype=np.float32)
    arange = np.arange(int(counts.max(initial=0)))
    generators = _KeyedGenerators(seed, round_, stream, peers)
    for l, (i, n_i) in enumerate(zip(peers, counts)):
        if n_i == 0:
            continue
        rng = generators.of(int(i))
        if steps is None:  # epochs: each epoch a permutation, the last batch may be short
            block = per_epoch[l] * batch_size
            for e in range(epochs):
                seg = idx[l, e * block : e * block + n_i]
                seg[:] = arange[:n_i]
                rng.shuffle(seg)  # in place: the same draws as rng.permutation(n_i)
                weight[l, e * block : e * block + n_i] = 1.0
        else:  # fixed steps: full batches of min(B, n_i) from a stream of permutations
            b = min(batch_size, int(n_i))
            perms = max(1, -(-steps * b // n_i))  # the generator is this call's alone
            order = np.concatenate([rng.permutation(n_i) for _ in range(perms)])
            idx[l].reshape(steps, batch_size)[:, :b] = order[: steps * b].reshape(steps, b)
            weight[l].reshape(steps, batch_size)[:, :b] = 1.0
    shape = (L, n_steps, batch_size)
    return idx.reshape(shape).transpose(1, 0, 2), weight.reshape(shape).transpose(1, 0, 2)


class _KeyedGenerators:
    """``default_rng([seed, peer, round_, stream])`` for many peers, built for less than half
    its cost: the key as a uint32 array (the words SeedSequence makes of the list when every
    part is below 2**32) skips the per-integer coercion, and Generator(PCG64(...)) skips
    default_rng's dispatch. The plan draws one generator per peer per round, so this is most
    of its time."""

    def __init__(self, seed: int, round_: int, stream: int, peers: np.ndarray):
        self.key = [seed, 0, round_, stream]
        peers = np.asarray(peers)
        low = min(seed, round_, stream, int(peers.min(initial=0)))
        high = max(seed, round_, stream, int(peers.max(initial=0)))
        fits = 0 <= low and high < 2**32
        self.words = np.array(self.key, dtype=np.uint32) if fits else None

    def of(self, peer: int) -> np.random.Generator:
        if self.words is None:
            self.key[1] = peer
            return np.random.default_rng(self.key)
        self.words[1] = peer
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.words)))

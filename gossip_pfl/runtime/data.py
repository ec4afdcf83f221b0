"""A rank's peers' data as padded tensors, and the seeded minibatch plan of a round.

Peers hold different numbers of samples. Each peer's data is padded to the rank's largest peer,
and each step draws a (L, B) index batch with a (L, B) weight mask: padded slots get weight 0,
so one batched step trains every peer on its own minibatch. Minibatch order depends only on
(seed, peer, round), never on the placement.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def mask(self) -> torch.Tensor:
        """(L, N_max) 1.0 on real samples, 0.0 on padding."""
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
    ``epochs * ceil(n_i / B)`` steps (or exactly ``steps`` steps, cycling through fresh
    permutations); steps past a peer's end are all-zero weight, and the solver skips them.
    """
    per_peer = []
    for i, n_i in zip(peers, counts):
        rng = np.random.default_rng([seed, int(i), round_, stream])
        n_i = int(n_i)
        n_steps = steps if steps is not None else epochs * -(-n_i // batch_size)
        order, batches = np.empty(0, dtype=np.int64), []
        for _ in range(n_steps):
            if steps is None:  # epochs: each epoch a permutation, last batch may be short
                if len(order) == 0:
                    order = rng.permutation(n_i)
                batches.append(order[:batch_size])
                order = order[batch_size:]
            else:  # fixed steps: full batches drawn from a running stream of permutations
                while len(order) < min(batch_size, n_i):
                    order = np.concatenate([order, rng.permutation(n_i)])
                batches.append(order[: min(batch_size, n_i)])
                order = order[min(batch_size, n_i) :]
        per_peer.append(batches)
    n_steps = max((len(b) for b in per_peer), default=0)
    idx = np.zeros((n_steps, len(peers), batch_size), dtype=np.int64)
    weight = np.zeros((n_steps, len(peers), batch_size), dtype=np.float32)
    for l, batches in enumerate(per_peer):
        for s, b in enumerate(batches):
            idx[s, l, : len(b)] = b
            weight[s, l, : len(b)] = 1.0
    return idx, weight

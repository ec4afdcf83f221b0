"""Which rank holds which peer. Peers are split into contiguous blocks, one block per rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gossip_pfl.errors import GossipError


@dataclass(frozen=True)
class Placement:
    """``n_peers`` peers over ``world_size`` ranks in contiguous blocks (the first
    ``n_peers % world_size`` ranks hold one peer more). Auxiliary nodes ``>= n_peers`` (a hub
    that only aggregates) live on rank 0.

    >>> p = Placement(8, 4, rank=1)
    >>> p.peers.tolist(), p.owner([0, 5, 7, 8]).tolist()
    ([2, 3], [0, 2, 3, 0])
    """

    n_peers: int
    world_size: int
    rank: int = 0

    def __post_init__(self):
        if self.n_peers < 1:
            raise GossipError(f"a run needs at least one peer (got n_peers={self.n_peers})")
        if not 1 <= self.world_size <= self.n_peers:
            raise GossipError(
                f"world size {self.world_size} does not fit {self.n_peers} peers: "
                f"need 1 <= WORLD_SIZE <= n_peers (one or more peers per rank)"
            )
        if not 0 <= self.rank < self.world_size:
            raise GossipError(f"rank {self.rank} outside world size {self.world_size}")

    @property
    def starts(self) -> np.ndarray:
        """First peer of each rank, plus ``n_peers`` at the end (length ``world_size + 1``)."""
        base, extra = divmod(self.n_peers, self.world_size)
        counts = np.full(self.world_size, base) + (np.arange(self.world_size) < extra)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def peers(self) -> np.ndarray:
        """The peers this rank holds, in order."""
        s = self.starts
        return np.arange(s[self.rank], s[self.rank + 1], dtype=np.int64)

    def owner(self, nodes) -> np.ndarray:
        """The rank holding each node (auxiliary nodes belong to rank 0)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if self.world_size == 1:  # (a time-varying W_t's entries are placed every round)
            return np.zeros(nodes.shape, dtype=np.int64)
        ranks = np.searchsorted(self.starts, nodes, side="right") - 1
        return np.where(nodes >= self.n_peers, 0, ranks)

    def nodes(self, n_nodes: int) -> np.ndarray:
        """This rank's nodes for a phase over ``n_nodes`` nodes: its peers, then (rank 0 only)
        the auxiliary nodes."""
        aux = np.arange(self.n_peers, n_nodes, dtype=np.int64) if self.rank == 0 else []
        return np.concatenate([self.peers, aux]).astype(np.int64)

    def describe(self) -> str:
        sizes = np.diff(self.starts)
        span = f"{sizes.min()}-{sizes.max()}"
        return f"{self.n_peers} peers on {self.world_size} rank(s), {span} per rank"

"""Clustered FL (Sattler et al. 2020) as a server rule with state on the hub.

The server keeps a partition of the peers into clusters and averages models within each cluster
(weights n_i). After a round, a cluster whose mean update is small (the federation is near a
stationary point, ||mean dW|| < tol1) while some peer's update is still large
(max ||dW_i|| > tol2) is split in two by the cosine similarity of its peers' updates
(complete-linkage agglomeration down to two groups). Every rank holds the same state: the rule
is a pure function of all peers' updates, which the runtime gathers: its route replaces the
schedule (see ``train.Trainer.communicate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gossip_pfl.algorithms.rules import Rule
from topologies import Phase


def bipartition(similarity: np.ndarray) -> np.ndarray:
    """Split items into two groups by complete-linkage agglomeration on ``similarity``.

    Returns a boolean mask of one group. Starts from singletons and merges the two clusters
    whose least similar pair is most similar, until two clusters remain.

    >>> s = np.array([[1, .9, -.8], [.9, 1, -.7], [-.8, -.7, 1]])
    >>> bipartition(s).tolist()
    [True, True, False]
    """
    n = len(similarity)
    label = np.arange(n)
    link = similarity.astype(float).copy()  # cluster-to-cluster complete-linkage similarity
    np.fill_diagonal(link, -np.inf)
    alive = np.ones(n, dtype=bool)
    for _ in range(n - 2):
        masked = np.where(alive[:, None] & alive[None, :], link, -np.inf)
        a, b = np.unravel_index(np.argmax(masked), masked.shape)
        label[label == b] = a
        link[a] = np.minimum(link[a], link[b])  # complete linkage: the least similar pair
        link[:, a] = link[a]
        link[a, a] = -np.inf
        alive[b] = False
    return label == label[0]


@dataclass(frozen=True)
class ClusteredRule(Rule):
    """The server's cluster state and its within-cluster averaging, as a rule whose state is
    every peer's cluster label (replicated on every rank) and whose route is its own phase."""

    n: int
    tol1: float = 0.4
    tol2: float = 1.6
    name = "clustered"  # needs_theta: updates are measured from the round-start models

    def init(self, theta=None) -> dict[str, torch.Tensor]:
        return {"labels": torch.zeros(self.n, dtype=torch.int64)}

    def split(self, state: dict, updates: np.ndarray) -> dict:
        """Split clusters after a round, given every peer's update (n, P)."""
        labels = state["labels"].cpu().numpy().copy()
        norms = np.linalg.norm(updates, axis=1)
        for c in np.unique(labels):
            members = np.flatnonzero(labels == c)
            mean_norm = np.linalg.norm(updates[members].mean(0))
            if len(members) > 2 and mean_norm < self.tol1 and norms[members].max() > self.tol2:
                u = updates[members] / np.maximum(norms[members, None], 1e-12)
                side = bipartition(u @ u.T)
                labels[members[~side]] = labels.max() + 1
        return {"labels": torch.as_tensor(labels)}

    def phase(self, state: dict, sizes: np.ndarray) -> Phase:
        """x_i <- sum_{j in cluster(i)} n_j / n_c x_j for every peer i."""
        labels = state["labels"].cpu().numpy()
        rows, cols, vals = [], [], []
        for c in np.unique(labels):
            members = np.flatnonzero(labels == c)
            w = sizes[members] / sizes[members].sum()
            rows.append(np.repeat(members, len(members)))
            cols.append(np.tile(members, len(members)))
            vals.append(np.tile(w, len(members)))
        return Phase(self.n, np.concatenate(rows), np.concatenate(cols), np.concatenate(vals))

"""The data contract between the dataset builders and the runtime.

A ``FederatedDataset`` is a list of ``ClientData``, one per peer, in peer order: the index of a
client in ``clients`` is its peer id. Every array is numpy: inputs float32 of shape
``(n, *input_shape)``, labels int64 of shape ``(n,)``. Splits may be empty (for instance ``val``
when no validation fraction was asked for) but keep their trailing shape.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from gossip_pfl.errors import GossipError

SPLITS = ("train", "val", "test")
TASKS = ("binary", "multiclass")


@dataclass
class ClientData:
    """One peer's private data."""

    x_train: np.ndarray  # float32 (n_train, *input_shape)
    y_train: np.ndarray  # int64 (n_train,)
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def split(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(x, y)`` of split ``name`` ("train", "val" or "test")."""
        if name not in SPLITS:
            raise GossipError(f"unknown split {name!r}; known splits: {', '.join(SPLITS)}")
        return getattr(self, f"x_{name}"), getattr(self, f"y_{name}")

    def size(self, name: str) -> int:
        """Number of samples in split ``name``."""
        return len(self.split(name)[1])


@dataclass
class FederatedDataset:
    """All peers' data plus what is known about how it was made."""

    name: str
    clients: list[ClientData]  # index = peer id
    input_shape: tuple[int, ...]
    num_classes: int  # 2 for binary tasks
    task: str  # "binary" (one logit, BCE) or "multiclass"
    meta: dict = field(default_factory=dict)  # generator truth, partition info, ...
    unseen: list[int] = field(default_factory=list)  # clients held out of training

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise GossipError(f"dataset {self.name}: task {self.task!r} is not one of {TASKS}")
        bad = [u for u in self.unseen if not 0 <= u < len(self.clients)]
        if bad:
            raise GossipError(
                f"dataset {self.name}: unseen client ids {bad} are outside "
                f"0..{len(self.clients) - 1}"
            )

    @property
    def n_clients(self) -> int:
        return len(self.clients)

    @property
    def seen(self) -> list[int]:
        """Ids of the clients that take part in training."""
        unseen = set(self.unseen)
        return [i for i in range(self.n_clients) if i not in unseen]

    def sizes(self, split: str = "train") -> np.ndarray:
        """Number of samples of ``split`` per client, int64 of shape (n_clients,)."""
        return np.array([c.size(split) for c in self.clients], dtype=np.int64)

    def digest(self) -> str:
        """16 hex digits that change with the data a run trains on: the task, shapes, unseen
        clients, every split's size, its labels (every one up to 2^16 samples in all, a
        systematic sample beyond) and its first and last samples. Not every pixel: a
        checkpoint check, cheap at 10,000 clients. The name is left out, so a dataset renamed
        is the same data."""
        parts = [c.split(s) for c in self.clients for s in SPLITS]
        sizes = np.array([len(y) for _, y in parts], dtype=np.int64)
        every = max(1, int(sizes.sum()) >> 16)
        labels = np.concatenate([y[::every] for _, y in parts], dtype=np.int64)
        ends = [x[i : i + 1] for x, _ in parts if len(x) for i in (0, len(x) - 1)]
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((self.task, self.num_classes, tuple(self.input_shape), sorted(self.unseen),
                       self.n_clients)).encode())  # fmt: skip
        for a in (sizes, labels, np.concatenate(ends, dtype=np.float32) if ends else sizes[:0]):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def summary(self) -> str:
        """One line: name, task, clients, and the size of each split."""
        parts = []
        for split in SPLITS:
            s = self.sizes(split)
            if s.size and s.sum():
                parts.append(f"{split} {s.sum()} (median {int(np.median(s))}, {s.min()}-{s.max()})")
        shape = "x".join(str(d) for d in self.input_shape)
        return (
            f"{self.name}: {self.n_clients} clients ({len(self.unseen)} unseen), {self.task} "
            f"{self.num_classes} classes, input {shape}; " + "; ".join(parts)
        )


def make_client(
    x: np.ndarray, y: np.ndarray, train: np.ndarray, val: np.ndarray, test: np.ndarray
) -> ClientData:
    """Build a ``ClientData`` from a pooled ``(x, y)`` and three index arrays."""
    return ClientData(
        x_train=x[train],
        y_train=y[train],
        x_val=x[val],
        y_val=y[val],
        x_test=x[test],
        y_test=y[test],
    )


def as_inputs(x: np.ndarray) -> np.ndarray:
    """Inputs as float32 (no copy when they already are)."""
    return np.asarray(x, dtype=np.float32)


def as_labels(y: np.ndarray) -> np.ndarray:
    """Labels as int64 (no copy when they already are)."""
    return np.asarray(y, dtype=np.int64)


def pick_unseen(n_clients: int, fraction: float, seed: int) -> list[int]:
    """A seeded, sorted choice of ``round(fraction * n_clients)`` client ids.

    The choice uses its own random stream, so it does not move when other options change.
    """
    check_fraction("unseen_fraction", fraction)
    k = int(round(fraction * n_clients))
    if k >= n_clients:
        raise GossipError(
            f"unseen_fraction {fraction} leaves no client for training out of {n_clients}"
        )
    if fraction > 0 and n_clients < 2:  # (the hint below named a fraction that then failed)
        raise GossipError(f"unseen_fraction {fraction} of 1 client: holding it out leaves none "
                          "for training (set unseen_fraction: 0)")  # fmt: skip
    if k == 0 and fraction > 0:  # the unseen clients' figures were missing, unsaid
        least = 0.5 / n_clients
        raise GossipError(f"unseen_fraction {fraction} of {n_clients} clients holds out none "
                          f"(it rounds to 0; more than {least:.3g} holds out one)")  # fmt: skip
    rng = np.random.default_rng([seed, 0x5EE4])
    return sorted(int(i) for i in rng.choice(n_clients, size=k, replace=False))


def check_fraction(name: str, value: float) -> None:
    """Fractions of clients or samples must lie in [0, 1)."""
    if not 0.0 <= float(value) < 1.0:
        raise GossipError(f"{name} must be in [0, 1), got {value}")

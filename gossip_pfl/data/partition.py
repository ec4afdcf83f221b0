"""Seeded partitions of a centralized labelled dataset into clients, and the per-client split.

Each partition function returns one sorted int64 index array per client; every sample index
appears in at most one client. A partition that leaves a client empty raises a ``GossipError``
naming the client. :func:`build_federated` then splits each client's samples into
train / validation / test (60/20/20 by default, as in the FedEM paper) and returns a
:class:`FederatedDataset`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gossip_pfl.data.base import (
    FederatedDataset,
    as_inputs,
    as_labels,
    make_client,
    pick_unseen,
)
from gossip_pfl.errors import GossipError

DEFAULT_SPLIT = (0.6, 0.2, 0.2)
MAX_DRAWS = 1000  #: Dirichlet draws tried before ``min_size`` is declared out of reach


def dirichlet(
    labels: np.ndarray, n_clients: int, alpha: float, seed: int = 0, min_size: int = 0
) -> list[np.ndarray]:
    """Split each class over clients with proportions drawn from Dirichlet(alpha * 1).

    The label-skew partition of Hsu et al. (2019), used by FedEM for CIFAR-10 and EMNIST
    with alpha = 0.4. Small alpha: each client sees few classes. ``min_size > 0`` re-draws
    the proportions (same seeded stream, at most :data:`MAX_DRAWS` draws) until every client
    holds at least ``min_size`` samples; the first draw that qualifies is kept, so a draw
    that already satisfies ``min_size`` is the same as with ``min_size = 0``.

    >>> parts = dirichlet(np.repeat(np.arange(4), 25), n_clients=5, alpha=1.0, seed=0)
    >>> len(parts), sum(len(p) for p in parts)
    (5, 100)
    """
    labels = _check_labels(labels, n_clients)
    _check_positive("dirichlet: alpha", alpha)
    groups = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    rng = np.random.default_rng(seed)
    parts = _spread_groups(groups, n_clients, alpha, rng, min_size, "dirichlet")
    return _checked(parts, "dirichlet", "use fewer clients or a larger alpha")


def fedem_mixture(
    labels: np.ndarray,
    n_clients: int,
    n_components: int = 3,
    alpha: float = 0.4,
    seed: int = 0,
    min_size: int = 0,
) -> list[np.ndarray]:
    """FedEM's mixture split: classes are dealt at random into ``n_components`` groups, and
    each group's samples are spread over all clients with Dirichlet(alpha * 1) proportions.

    Every client is then a mixture of ``n_components`` label distributions, which is the
    assumption FedEM's model makes. With one group per class this is :func:`dirichlet`.
    ``min_size`` re-draws the proportions (not the class groups) as in :func:`dirichlet`.
    """
    labels = _check_labels(labels, n_clients)
    _check_positive("fedem_mixture: alpha", alpha)
    classes = np.unique(labels)
    if not 1 <= n_components <= len(classes):
        raise GossipError(
            f"fedem_mixture: n_components must be in 1..{len(classes)} (the number of classes), "
            f"got {n_components}"
        )
    rng = np.random.default_rng(seed)
    class_groups = np.array_split(rng.permutation(classes), n_components)
    groups = [np.flatnonzero(np.isin(labels, g)) for g in class_groups]
    parts = _spread_groups(groups, n_clients, alpha, rng, min_size, "fedem_mixture")
    return _checked(parts, "fedem_mixture", "use fewer clients or a larger alpha")


def pathological(
    labels: np.ndarray, n_clients: int, classes_per_client: int, seed: int = 0
) -> list[np.ndarray]:
    """Each client gets exactly ``classes_per_client`` distinct classes (McMahan et al.).

    Classes are dealt round-robin from a seeded permutation, so each class goes to about
    ``n_clients * classes_per_client / n_classes`` clients, which share its samples equally.
    """
    labels = _check_labels(labels, n_clients)
    classes = np.unique(labels)
    if not 1 <= classes_per_client <= len(classes):
        raise GossipError(
            f"pathological: classes_per_client must be in 1..{len(classes)}, "
            f"got {classes_per_client}"
        )
    slots = n_clients * classes_per_client
    if slots < len(classes):  # (a class nobody holds was dropped, its samples with it)
        raise GossipError(
            f"pathological: {n_clients} clients x classes_per_client {classes_per_client} = "
            f"{slots} class slots for {len(classes)} classes: a class would be held by no "
            f"client; use at least {-(-len(classes) // classes_per_client)} clients or more "
            "classes_per_client"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(classes)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for t in range(n_clients):
        for j in range(classes_per_client):
            holders[int(order[(t * classes_per_client + j) % len(classes)])].append(t)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c, clients in holders.items():
        samples = rng.permutation(np.flatnonzero(labels == c))
        for t, chunk in zip(clients, np.array_split(samples, len(clients))):
            parts[t].append(chunk)
    merged = [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]
    return _checked(merged, "pathological", "use fewer clients or more classes_per_client")


def by_writer(writers: np.ndarray, n_writers: int | None = None) -> list[np.ndarray]:
    """Natural partition: client ``k`` holds the samples whose writer id is ``k``.

    ``writers`` are ints in ``0..n_writers-1`` (default: ``max + 1``). A writer with no
    sample is an error, since it would be an empty client.

    >>> [p.tolist() for p in by_writer(np.array([1, 0, 1, 2]))]
    [[1], [0, 2], [3]]
    """
    writers = np.asarray(writers)
    if writers.ndim != 1 or (writers.size and writers.min() < 0):
        raise GossipError("by_writer: writer ids must be a 1-D array of non-negative ints")
    n = int(writers.max()) + 1 if n_writers is None else int(n_writers)
    order = np.argsort(writers, kind="stable")
    bounds = np.searchsorted(writers[order], np.arange(n + 1))
    parts = [order[bounds[k] : bounds[k + 1]].astype(np.int64) for k in range(n)]
    return _checked(parts, "by_writer", "drop writers without samples")


def build_federated(
    x: np.ndarray,
    y: np.ndarray,
    client_indices: Sequence[np.ndarray],
    split: Sequence[float] = DEFAULT_SPLIT,
    seed: int = 0,
    unseen_fraction: float = 0.0,
    name: str = "dataset",
    task: str = "multiclass",
    num_classes: int | None = None,
    test_from: tuple[np.ndarray, np.ndarray, Sequence[np.ndarray]] | None = None,
    meta: dict | None = None,
) -> FederatedDataset:
    """Split each client's samples into train / val / test and assemble the dataset.

    ``split`` gives the (train, val, test) fractions of each client's samples; a fraction
    that is positive gets at least one sample. With ``test_from = (x_test, y_test,
    test_indices)`` client ``t``'s test set is ``x_test[test_indices[t]]`` instead (an
    official test set, e.g. LEAF's), and the test fraction of ``split`` must be 0.
    ``meta`` gets the split and the original indices of every client's samples.
    """
    fractions = _check_split(split, test_from is not None)
    y = as_labels(y)
    if len(x) != len(y):
        raise GossipError(f"{name}: {len(x)} inputs but {len(y)} labels")
    if test_from is not None and len(test_from[2]) != len(client_indices):
        raise GossipError(
            f"{name}: test_from has {len(test_from[2])} clients, "
            f"the partition {len(client_indices)}"
        )
    rng = np.random.default_rng([seed, 0xB17D])  # own stream: independent of the partition
    clients, indices = [], {"train": [], "val": [], "test": []}
    for t, idx in enumerate(client_indices):
        train, val, test = _split_client(name, t, np.asarray(idx, dtype=np.int64), fractions, rng)
        client = make_client(x, y, train, val, test)
        if test_from is not None:
            test = np.asarray(test_from[2][t], dtype=np.int64)
            if test.size == 0:
                raise GossipError(f"{name}: client {t} has no sample in the official test set")
            client.x_test, client.y_test = test_from[0][test], as_labels(test_from[1][test])
        for key, value in (("train", train), ("val", val), ("test", test)):
            indices[key].append(value)
        clients.append(client)
    for c in clients:
        c.x_train, c.x_val, c.x_test = as_inputs_or_tokens(c.x_train, c.x_val, c.x_test)
    classes = int(y.max()) + 1 if num_classes is None else int(num_classes)
    info = {"split": fractions, "seed": seed, "indices": indices, **(meta or {})}
    return FederatedDataset(
        name=name,
        clients=clients,
        input_shape=tuple(x.shape[1:]),
        num_classes=classes,
        task=task,
        meta=info,
        unseen=pick_unseen(len(clients), unseen_fraction, seed),
    )


def as_inputs_or_tokens(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Float inputs become float32; integer inputs (token ids) stay int64."""
    if np.issubdtype(arrays[0].dtype, np.integer):
        return tuple(as_labels(a) for a in arrays)
    return tuple(as_inputs(a) for a in arrays)


# ----------------------------------------------------------------------------- helpers


def _spread_groups(
    groups: list[np.ndarray],
    n_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 0,
    kind: str = "partition",
) -> list[np.ndarray]:
    """Spread each group's (shuffled) samples over clients with Dirichlet proportions;
    re-draw (up to ``MAX_DRAWS`` times, same ``rng``) until every client has ``min_size``."""
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise GossipError(f"{kind}: min_size must be an int >= 0, got {min_size!r}")
    total = sum(len(g) for g in groups)
    if min_size * n_clients > total:
        raise GossipError(
            f"{kind}: min_size {min_size} x {n_clients} clients exceeds the {total} samples; "
            f"use min_size <= {total // n_clients} or fewer clients"
        )
    smallest = (-1, -1)  # (client, size) of the best failed draw
    for _ in range(MAX_DRAWS if min_size > 0 else 1):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for group in groups:
            shares = rng.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(group)).astype(np.int64)
            for t, chunk in enumerate(np.split(rng.permutation(group), cuts)):
                parts[t].append(chunk)
        sizes = np.array([sum(len(c) for c in p) for p in parts])
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if sizes.min() > smallest[1]:
            smallest = (int(sizes.argmin()), int(sizes.min()))
    raise GossipError(
        f"{kind}: no Dirichlet draw in {MAX_DRAWS} gives every client >= {min_size} samples "
        f"(best draw: client {smallest[0]} of {n_clients} has {smallest[1]}); use a smaller "
        "min_size, fewer clients, a larger alpha or a larger data fraction"
    )


def _split_client(name, t, idx, fractions, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle one client's indices and cut them into train / val / test."""
    n = len(idx)
    n_val, n_test = (max(1, round(f * n)) if f > 0 else 0 for f in fractions[1:])
    if n - n_val - n_test < 1:
        raise GossipError(
            f"{name}: client {t} has {n} samples, too few for the split {fractions}; "
            "use fewer clients, a larger alpha, or a split without val/test"
        )
    idx = rng.permutation(idx)
    return idx[n_val + n_test :], idx[:n_val], idx[n_val : n_val + n_test]


def _check_split(split: Sequence[float], official_test: bool) -> tuple[float, float, float]:
    def fraction(f) -> bool:  # (a NaN passed every comparison; None was a TypeError)
        return isinstance(f, int | float) and not isinstance(f, bool) and 0 <= f <= 1

    ok = isinstance(split, list | tuple) and len(split) == 3 and all(map(fraction, split))
    if not ok or abs(sum(split) - 1) > 1e-6:
        raise GossipError(
            "split must be three non-negative fractions (train, val, test) summing to 1, "
            f"got {split}"
        )
    if split[0] <= 0:
        raise GossipError(f"split: the train fraction must be positive, got {split}")
    if official_test and split[2] != 0:
        raise GossipError(
            f"split: with an official test set the test fraction must be 0, got {split}"
        )
    return tuple(float(f) for f in split)


def _check_labels(labels: np.ndarray, n_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise GossipError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if n_clients < 1:
        raise GossipError(f"n_clients must be >= 1, got {n_clients}")
    if n_clients > len(labels):
        raise GossipError(f"n_clients {n_clients} exceeds the number of samples {len(labels)}")
    return labels


def _check_positive(name: str, value: float) -> None:
    if not 0 < value < float("inf"):  # (inf: numpy's cast warning, then a wrong hint)
        raise GossipError(f"{name} must be a finite number > 0, got {value}")


def _checked(parts: list[np.ndarray], kind: str, hint: str) -> list[np.ndarray]:
    """No client may be left without samples."""
    for t, p in enumerate(parts):
        if len(p) == 0:
            raise GossipError(
                f"{kind} partition leaves client {t} of {len(parts)} with no samples; {hint}"
            )
    return parts

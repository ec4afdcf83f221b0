"""Run metrics that are pure functions of gathered arrays (no runtime state)."""

from __future__ import annotations

from itertools import permutations

import numpy as np


def score_entries(train: tuple, test: tuple) -> dict:
    """A metrics row's losses and accuracies from per-peer (loss, accuracy, count) arrays of
    the training and test splits: training figures weighted by samples, test ones a mean
    over peers (and weighted, and the 10th percentile)."""
    (tr_loss, tr_acc, tr_n), (te_loss, te_acc, te_n) = train, test
    has = te_n > 0  # a peer without test samples has no accuracy (it is not 0)
    has = has if has.any() else np.ones_like(has)
    return {
        "train_loss": _weighted(tr_loss, tr_n),
        "train_accuracy": _weighted(tr_acc, tr_n),
        "test_loss": float(np.mean(te_loss[has])),
        "test_accuracy": float(np.mean(te_acc[has])),
        "test_accuracy_weighted": _weighted(te_acc, te_n),
        "test_accuracy_p10": float(np.percentile(te_acc[has], 10)),
    }


def unseen_entries(acc: np.ndarray, counts: np.ndarray) -> dict:
    """The unseen clients' mean and 10th-percentile test accuracy, over those with test
    samples (one without has no accuracy; it is not 0); empty if none has any.

    >>> unseen_entries(np.array([0.5, 0.0, 1.0]), np.array([4, 0, 2]))
    {'unseen_test_accuracy': 0.75, 'unseen_test_accuracy_p10': 0.55}
    """
    has = counts > 0
    if not has.any():
        return {}
    return {"unseen_test_accuracy": float(np.mean(acc[has])),
            "unseen_test_accuracy_p10": float(np.percentile(acc[has], 10))}  # fmt: skip


def client_accuracies(acc: np.ndarray, counts: np.ndarray) -> list[float | None]:
    """Each client's test accuracy, rounded, None for a client without test samples (its
    0.0 was drawn in the histogram beside a mean that left it out).

    >>> client_accuracies(np.array([0.5, 0.0, 0.123456]), np.array([4, 0, 2]))
    [0.5, None, 0.12346]
    """
    return [round(float(a), 5) if n > 0 else None for a, n in zip(acc, counts, strict=True)]


def mixture_entries(pi: np.ndarray) -> dict:
    """Each component's mean mixture weight over the peers of ``pi`` (n, M), and how many put
    their largest weight on it: a component dying out or taking over every client shows.

    >>> mixture_entries(np.array([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]]))
    {'mixture_weights': [0.56667, 0.43333], 'mixture_leaders': [2, 1]}
    """
    return {
        "mixture_weights": [round(float(w), 5) for w in pi.mean(0)],
        "mixture_leaders": np.bincount(pi.argmax(1), minlength=pi.shape[1]).tolist(),
    }


def _weighted(values: np.ndarray, counts: np.ndarray) -> float:
    return float((values * counts).sum() / max(counts.sum(), 1))


def component_recovery(true_pi, pi: np.ndarray | None, train_ids: np.ndarray) -> float | None:
    """Share of peers whose arg-max pi matches their true group, under the best matching of
    components to groups. Only for data made of groups: the synthetic generator's true pi
    (meta['pi']) one-hot for every client; None otherwise or without mixture weights.

    >>> truth = np.eye(2)[[0, 0, 1, 1]]
    >>> component_recovery(truth, np.eye(2)[[1, 1, 0, 1]], np.arange(4))
    0.75
    """
    if true_pi is None or pi is None:
        return None
    true_pi = np.asarray(true_pi)
    if not np.all(true_pi.max(1) == 1.0):
        return None
    truth = true_pi.argmax(1)[train_ids]
    guess = pi.argmax(1)
    k = max(pi.shape[1], int(truth.max()) + 1)
    agree = np.zeros((k, k), dtype=np.int64)
    np.add.at(agree, (guess, truth), 1)
    best = max(sum(agree[m, c] for m, c in zip(range(k), perm)) for perm in permutations(range(k)))
    return float(best) / len(truth)


def recovery_entry(true_pi, pi: np.ndarray | None, train_ids: np.ndarray) -> dict:
    """The summary's ``cluster_recovery`` entry (empty where it does not apply)."""
    value = component_recovery(true_pi, pi, train_ids)
    return {} if value is None else {"cluster_recovery": value}

"""Partitions: disjointness, determinism, skew, empty-client errors, and build_federated."""

from __future__ import annotations

import numpy as np
import pytest

from gossip_pfl.data import partition
from gossip_pfl.errors import GossipError

LABELS = np.repeat(np.arange(10), 200)  # 2,000 samples, 10 balanced classes


def _dirichlet(seed=0, alpha=0.4):
    return partition.dirichlet(LABELS, 20, alpha, seed)


PARTITIONS = {
    "dirichlet": _dirichlet,
    "fedem_mixture": lambda seed=0: partition.fedem_mixture(LABELS, 20, 3, 0.4, seed),
    "pathological": lambda seed=0: partition.pathological(LABELS, 20, 2, seed),
}


@pytest.mark.parametrize("kind", PARTITIONS)
def test_disjoint_nonempty_deterministic(kind):
    parts = PARTITIONS[kind]()
    flat = np.concatenate(parts)
    assert len(parts) == 20 and all(len(p) > 0 for p in parts)
    assert len(np.unique(flat)) == len(flat)  # each index used at most once
    assert flat.min() >= 0 and flat.max() < len(LABELS)
    again = PARTITIONS[kind]()
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = PARTITIONS[kind](seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("kind", ["dirichlet", "fedem_mixture"])
def test_dirichlet_kinds_use_every_sample(kind):
    assert len(np.concatenate(PARTITIONS[kind]())) == len(LABELS)


def _mean_classes_seen(parts, share=0.05):
    """Classes holding more than ``share`` of a client's samples, averaged over clients."""
    counts = [np.bincount(LABELS[p], minlength=10) / len(p) for p in parts]
    return np.mean([(c > share).sum() for c in counts])


def test_dirichlet_skew_grows_as_alpha_shrinks():
    skewed = _mean_classes_seen(partition.dirichlet(LABELS, 10, 0.1, seed=0))
    mild = _mean_classes_seen(partition.dirichlet(LABELS, 10, 100.0, seed=0))
    assert skewed < 5 < 9 < mild


def test_fedem_mixture_clients_see_class_groups():
    parts = partition.fedem_mixture(LABELS, 20, n_components=2, alpha=0.4, seed=0)
    # shares[c, t]: fraction of class c held by client t. Classes of one group are spread
    # with the same Dirichlet draw, so their share vectors are nearly equal.
    shares = np.array([[np.sum(LABELS[p] == c) for p in parts] for c in range(10)]) / 200
    same = np.corrcoef(shares) > 0.8
    profiles = {tuple(row) for row in same}
    assert len(profiles) == 2 and sorted(sum(p) for p in profiles) == [5, 5]


def test_pathological_class_count():
    parts = partition.pathological(LABELS, 20, 3, seed=0)
    assert all(len(np.unique(LABELS[p])) == 3 for p in parts)
    # every sample dealt once; fewer class slots than classes dropped classes silently
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))
    with pytest.raises(
        GossipError,
        match=r"4 clients x classes_per_client 2 = 8 class slots "
        r"for 10 classes.*at least 5 clients",
    ):
        partition.pathological(LABELS, 4, 2)
    assert len(partition.pathological(LABELS, 5, 2)) == 5


def test_by_writer():
    writers = np.array([2, 0, 2, 1, 0])
    assert [p.tolist() for p in partition.by_writer(writers)] == [[1, 4], [3], [0, 2]]
    with pytest.raises(GossipError, match="client 3"):
        partition.by_writer(writers, n_writers=4)


def test_empty_client_error_names_client_and_fix():
    with pytest.raises(GossipError, match=r"client \d+ of 500 .*larger alpha") as err:
        partition.dirichlet(LABELS, 500, 0.01, seed=0)
    assert "\n" not in str(err.value)


def test_more_clients_than_samples():
    with pytest.raises(GossipError, match="exceeds the number of samples"):
        partition.dirichlet(LABELS[:5], 6, 1.0)


def test_bad_parameters():
    with pytest.raises(GossipError, match="alpha"):
        partition.dirichlet(LABELS, 5, 0.0)
    with pytest.raises(GossipError, match="n_components"):
        partition.fedem_mixture(LABELS, 5, n_components=11)
    with pytest.raises(GossipError, match="classes_per_client"):
        partition.pathological(LABELS, 5, 0)
    with pytest.raises(GossipError, match="1-D integer"):
        partition.dirichlet(LABELS.astype(float), 5, 1.0)


def _x():
    return np.arange(len(LABELS), dtype=np.float64)[:, None]  # x encodes the sample index


def test_build_federated_split_and_contract():
    parts = _dirichlet()
    ds = partition.build_federated(_x(), LABELS, parts, seed=3, unseen_fraction=0.2, name="toy")
    assert ds.n_clients == 20 and len(ds.unseen) == 4 and ds.num_classes == 10
    assert ds.input_shape == (1,) and ds.task == "multiclass"
    for t, c in enumerate(ds.clients):
        assert c.x_train.dtype == np.float32 and c.y_train.dtype == np.int64
        used = np.concatenate([c.x_train, c.x_val, c.x_test])[:, 0].astype(int)
        assert sorted(used) == sorted(parts[t])  # the client's samples, each once
        np.testing.assert_array_equal(LABELS[c.x_test[:, 0].astype(int)], c.y_test)
        n = len(parts[t])
        assert abs(len(c.y_test) - 0.2 * n) <= 1 and abs(len(c.y_val) - 0.2 * n) <= 1
    again = partition.build_federated(_x(), LABELS, parts, seed=3, unseen_fraction=0.2)
    np.testing.assert_array_equal(again.clients[5].x_train, ds.clients[5].x_train)
    assert "toy: 20 clients (4 unseen)" in ds.summary()


def test_build_federated_errors():
    with pytest.raises(GossipError, match="client 1 has 2 samples"):
        partition.build_federated(_x(), LABELS, [np.arange(10), np.arange(10, 12)])
    with pytest.raises(GossipError, match="unseen_fraction"):
        partition.build_federated(_x(), LABELS, _dirichlet(), unseen_fraction=1.0)
    with pytest.raises(GossipError, match="summing to 1"):
        partition.build_federated(_x(), LABELS, _dirichlet(), split=(0.5, 0.2, 0.2))


def test_build_federated_official_test():
    x_test, y_test = _x()[:30], LABELS[:30]
    parts = [np.arange(0, 10), np.arange(10, 20)]
    tests = [np.arange(0, 15), np.arange(15, 30)]
    ds = partition.build_federated(
        _x(), LABELS, parts, split=(0.8, 0.2, 0.0), test_from=(x_test, y_test, tests)
    )
    assert ds.sizes("test").tolist() == [15, 15] and ds.sizes("train").tolist() == [8, 8]
    with pytest.raises(GossipError, match="test fraction must be 0"):
        partition.build_federated(_x(), LABELS, parts, test_from=(x_test, y_test, tests))


# ----------------------------------------------------------------------------- min_size

# (n_clients, alpha) at which seed 0's first draw leaves a client below 10 samples of LABELS
TIGHT = {"dirichlet": (20, 0.2), "fedem_mixture": (40, 0.4)}


@pytest.mark.parametrize("kind", TIGHT)
def test_min_size_respected_and_deterministic(kind):
    fn, (n, alpha) = getattr(partition, kind), TIGHT[kind]
    assert min(len(p) for p in fn(LABELS, n, alpha=alpha, seed=0)) < 10  # something to do
    parts = fn(LABELS, n, alpha=alpha, seed=0, min_size=10)
    assert len(parts) == n and min(len(p) for p in parts) >= 10
    flat = np.concatenate(parts)
    assert len(flat) == len(LABELS) and len(np.unique(flat)) == len(flat)
    again = fn(LABELS, n, alpha=alpha, seed=0, min_size=10)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = fn(LABELS, n, alpha=alpha, seed=1, min_size=10)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("kind", TIGHT)
def test_min_size_keeps_a_first_draw_that_already_qualifies(kind):
    fn = getattr(partition, kind)
    plain = fn(LABELS, 20, alpha=0.4, seed=0)
    small = min(len(p) for p in plain)
    kept = fn(LABELS, 20, alpha=0.4, seed=0, min_size=small)
    assert all(np.array_equal(a, b) for a, b in zip(plain, kept))


def test_min_size_out_of_reach_is_a_one_line_error():
    with pytest.raises(GossipError, match=r"client \d+ of 200 has \d+.*smaller min_size") as err:
        partition.fedem_mixture(LABELS, 200, 3, alpha=0.05, seed=0, min_size=9)
    assert "\n" not in str(err.value) and "1000" in str(err.value)
    with pytest.raises(GossipError, match="exceeds the 2000 samples"):
        partition.dirichlet(LABELS, 20, 0.4, min_size=101)
    with pytest.raises(GossipError, match="min_size must be an int >= 0"):
        partition.dirichlet(LABELS, 20, 0.4, min_size=-1)


def test_loader_passes_min_size():
    from gossip_pfl.data import _partition_spec

    kind, params = _partition_spec("toy", {"kind": "fedem_mixture", "min_size": 10})
    assert kind == "fedem_mixture" and params == {"n_components": 3, "alpha": 0.4, "min_size": 10}
    assert _partition_spec("toy", {"kind": "dirichlet"})[1] == {"alpha": 0.4, "min_size": 0}

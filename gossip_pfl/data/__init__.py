"""Datasets for gossip-pfl: one registry, ``load_dataset(name, **options)``.

>>> ds = load_dataset("synthetic", n_clients=3, dim=4, n_test=5, cache_dir=None, cache=False)
>>> ds.n_clients, ds.task
(3, 'binary')

Image datasets take ``partition={"kind": ..., ...}`` with kind ``dirichlet`` (``alpha``,
``min_size``), ``fedem_mixture`` (``n_components``, ``alpha``, ``min_size``) or
``pathological`` (``classes_per_client``);
LEAF datasets are partitioned by writer (``natural``). See docs/data.md for every option.
"""

from __future__ import annotations

import inspect
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from gossip_pfl.data import images, leaf, partition
from gossip_pfl.data.base import ClientData, FederatedDataset, check_fraction
from gossip_pfl.data.synthetic import make_synthetic
from gossip_pfl.errors import GossipError

__all__ = [
    "ClientData",
    "FederatedDataset",
    "DATASETS",
    "load_dataset",
    "make_synthetic",
]

# Options shared by the centralized image datasets, with their defaults.
_IMAGE_DEFAULTS: dict[str, Any] = {
    "root": None,
    "n_clients": 100,
    "seed": 0,
    "partition": {"kind": "dirichlet", "alpha": 0.4},
    "split": partition.DEFAULT_SPLIT,
    "unseen_fraction": 0.0,
    "fraction": 1.0,  # share of the pooled samples kept before partitioning (EMNIST: 0.1)
}
_LEAF_DEFAULTS: dict[str, Any] = {
    "root": None,
    "n_clients": None,  # None: every writer left after the filters; else a seeded choice
    "seed": 0,
    "partition": {"kind": "natural"},
    "split": partition.DEFAULT_SPLIT,
    "unseen_fraction": 0.0,
    "writer_fraction": 1.0,  # FedEM used 15% of FEMNIST's writers
    "min_samples": 1,  # writers with fewer samples are dropped (FedEM: 2 for Shakespeare); so
    # are those too small for the split (3 for 60/20/20), with a warning
    "leaf_split": False,  # True: keep LEAF's train/test files as train(+val)/test; writers in both
}
_PARTITION_KEYS = {
    "dirichlet": {"alpha": 0.4, "min_size": 0},  # min_size 0: only non-empty clients
    "fedem_mixture": {"n_components": 3, "alpha": 0.4, "min_size": 0},
    "pathological": {"classes_per_client": 2},
}


def load_dataset(name: str, **options: Any) -> FederatedDataset:
    """Build the federated dataset ``name``; unknown names and options are errors."""
    if name not in DATASETS:
        raise GossipError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name](**options)


def _options(dataset: str, defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Defaults overridden by ``given``; a key not in ``defaults`` is an error naming it."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise GossipError(
            f"{dataset}: unknown option {unknown[0]!r}; known: {', '.join(sorted(defaults))}"
        )
    for key, value in given.items():  # the default's type (a loader's int() or bool() would
        want = _kind(defaults[key])  # take 8.5 as 8 and "false" as True)
        if want and not _is_kind(value, want):
            raise GossipError(f"{dataset}: option {key!r} must be {want} (got {value!r})")
        if key in _PATHS and not (value is None or isinstance(value, str | os.PathLike)):
            raise GossipError(f"{dataset}: option {key!r} must be a folder (got {value!r})")
        if key == "seed" and not 0 <= value < 2**63:  # (numpy's seeds are non-negative)
            raise GossipError(f"{dataset}: option 'seed' must be in [0, 2**63) (got {value})")
    return {**defaults, **given}


#: options that name a folder (default None: the dataset's own place)
_PATHS = ("root", "cache_dir")


#: an option's type, from its default's (bool before int: True is an int to Python)
_KINDS = [("true or false", bool), ("an integer", int), ("a number", (int, float)),
          ("a string", str), ("a mapping", dict), ("a list", (list, tuple))]  # fmt: skip


def _kind(default: Any) -> str | None:
    """The type an option must have, from its default (None: not checked here)."""
    return next((kind for kind, types in _KINDS if isinstance(default, types)), None)


def _is_kind(value: Any, kind: str) -> bool:
    if isinstance(value, bool) != (kind == "true or false"):  # YAML's true is no integer
        return False
    return isinstance(value, dict(_KINDS)[kind])


def _partition_spec(dataset: str, spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``{"kind": K, ...}`` -> (K, its parameters with defaults), checking every key."""
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if kind not in _PARTITION_KEYS:
        raise GossipError(
            f"{dataset}: partition.kind must be one of {', '.join(_PARTITION_KEYS)}, got {kind!r}"
        )
    return kind, _options(f"{dataset}: partition ({kind})", _PARTITION_KEYS[kind], spec)


def _synthetic(**given: Any) -> FederatedDataset:
    params = inspect.signature(make_synthetic).parameters
    _options("synthetic", {k: p.default for k, p in params.items()}, given)
    return make_synthetic(**given)


def _image_dataset(dataset: str, reader, **given: Any) -> FederatedDataset:
    """Pool the official train and test sets, keep ``fraction``, partition, split per client."""
    opts = _options(dataset, _IMAGE_DEFAULTS, given)
    kind, params = _partition_spec(dataset, opts["partition"])
    check_fraction(f"{dataset}: unseen_fraction", opts["unseen_fraction"])
    central = reader(opts["root"])
    x = np.concatenate([central.x_train, central.x_test])
    y = np.concatenate([central.y_train, central.y_test])
    x, y = _subsample(dataset, x, y, opts["fraction"], opts["seed"])
    if opts["n_clients"] > len(y):
        raise GossipError(
            f"{dataset}: n_clients {opts['n_clients']} is more than the {len(y):,} samples "
            f"that fraction {opts['fraction']} keeps"
        )
    parts = getattr(partition, kind)(y, opts["n_clients"], seed=opts["seed"], **params)
    return partition.build_federated(
        x,
        y,
        parts,
        split=opts["split"],
        seed=opts["seed"],
        unseen_fraction=opts["unseen_fraction"],
        name=central.name,
        num_classes=central.num_classes,
        meta={"partition": {"kind": kind, **params}, "fraction": opts["fraction"]},
    )


def _subsample(dataset: str, x, y, fraction: float, seed: int):
    if not 0 < fraction <= 1:
        raise GossipError(f"{dataset}: fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return x, y
    kept = round(fraction * len(y))
    if kept == 0:  # (said as "n_clients 4 exceeds the number of samples 0")
        raise GossipError(f"{dataset}: fraction {fraction} of {len(y):,} samples keeps none")
    keep = np.random.default_rng([seed, 0xF4AC]).permutation(len(y))[:kept]
    keep.sort()
    return x[keep], y[keep]


def _emnist(split: str = "byclass", **given: Any) -> FederatedDataset:
    given.setdefault("fraction", 0.1)
    return _image_dataset("emnist", lambda root: images.load_emnist(root, split), **given)


def _leaf_dataset(kind: str, **given: Any) -> FederatedDataset:
    """One client per writer; pooled and re-split 60/20/20 unless ``leaf_split``."""
    defaults = {**_LEAF_DEFAULTS, "min_samples": 2 if kind == "shakespeare" else 1}
    opts = _options(kind, defaults, given)
    if dict(opts["partition"]) != {"kind": "natural"}:
        raise GossipError(f"{kind}: only partition.kind 'natural' (by writer) is supported")
    if opts["leaf_split"] and "split" not in given:
        opts["split"] = (0.8, 0.2, 0.0)
    split = partition._check_split(opts["split"], opts["leaf_split"])
    data = leaf.load_leaf(opts["root"], kind)
    writers, left_out = _choose_writers(kind, data, opts, split)
    renumber = np.full(len(data.users), -1, dtype=np.int64)
    renumber[writers] = np.arange(len(writers))
    meta = {
        **data.meta,
        "partition": {"kind": "natural"},
        "users": [data.users[w] for w in writers],
        "writers_left_out": left_out,
    }
    common = {
        "seed": opts["seed"],
        "unseen_fraction": opts["unseen_fraction"],
        "name": kind,
        "num_classes": data.num_classes,
        "meta": meta,
        "split": split,
    }
    if opts["leaf_split"]:
        train_x, train_y, train_w = _select(data.train, renumber)
        test_x, test_y, test_w = _select(data.test, renumber)
        test_from = (test_x, test_y, partition.by_writer(test_w, len(writers)))
        parts = partition.by_writer(train_w, len(writers))
        return partition.build_federated(train_x, train_y, parts, test_from=test_from, **common)
    x = np.concatenate([data.train.x, data.test.x])
    y = np.concatenate([data.train.y, data.test.y])
    w = renumber[np.concatenate([data.train.writer, data.test.writer])]
    keep = np.flatnonzero(w >= 0)
    parts = partition.by_writer(w[keep], len(writers))
    return partition.build_federated(x[keep], y[keep], parts, **common)


def _choose_writers(
    kind: str, data: leaf.LeafData, opts: dict[str, Any], split: tuple[float, float, float]
) -> tuple[np.ndarray, dict[str, int]]:
    """Writers that can be clients (:func:`_writers_kept`), then a seeded subset: (sorted ids,
    number left out per reason)."""
    low, kept, left_out, said = _writers_kept(kind, data, opts, split)
    # the seeded choice draws from the writers with min_samples, as before the others were
    # left out (a run refused then), and keeps the first that are kept: a config that ran
    # then picks the same writers now
    writers = np.flatnonzero(~low)
    rng = np.random.default_rng([opts["seed"], 0x1EAF])
    if opts["writer_fraction"] != 1.0:
        if not 0 < opts["writer_fraction"] <= 1:
            raise GossipError(
                f"{kind}: writer_fraction must be in (0, 1], got {opts['writer_fraction']}"
            )
        drawn = rng.permutation(writers)
        k = max(1, round(opts["writer_fraction"] * len(writers)))
        # (with n_clients, the draw below keeps the first that are kept, as the old one ran)
        writers = drawn[:k] if opts["n_clients"] is not None else drawn[kept[drawn]][:k]
    if opts["n_clients"] is not None:
        available = int(kept[writers].sum())
        if not 1 <= opts["n_clients"] <= available:
            raise GossipError(
                f"{kind}: n_clients must be in 1..{available} (writers available), "
                f"got {opts['n_clients']}" + (f"; left out: {said}" if said else "")
            )
        drawn = rng.permutation(writers)
        writers = drawn[kept[drawn]][: opts["n_clients"]]
    return np.sort(writers[kept[writers]]), left_out


def _writers_kept(
    kind: str, data: leaf.LeafData, opts: dict[str, Any], split: tuple[float, float, float]
) -> tuple[np.ndarray, np.ndarray, dict[str, int], str]:
    """(writers under ``min_samples``, writers kept, number left out per reason, the reasons
    in words), by writer id.

    Left out, besides writers under ``min_samples``: with ``leaf_split``, those with no sample
    in LEAF's train or test files; those whose samples ``split`` cannot fill (60/20/20 takes
    3, one each; with ``leaf_split`` their train samples and 80/20/0, 2). These are said in
    a warning; the ones under ``min_samples`` are not, as before."""
    n_users = len(data.users)
    train = np.bincount(data.train.writer, minlength=n_users)
    test = np.bincount(data.test.writer, minlength=n_users)
    counts = train + test
    low = counts < opts["min_samples"]
    if low.all():  # (else: "unseen_fraction 0.0 leaves no client ... out of 0")
        raise GossipError(f"{kind}: no writer has min_samples = {opts['min_samples']} samples "
                          f"(the most any has: {counts.max(initial=0)})")  # fmt: skip
    fits = _fit_split(kind, train if opts["leaf_split"] else counts, split)
    kept = ~low
    out = {}  # (writers left out, min_samples aside, by why: one reason each)
    if opts["leaf_split"]:  # (LEAF's '-t user' split puts each writer in train or test alone)
        out["no_train_samples"] = kept & (train == 0)
        out["no_test_samples"] = kept & (train > 0) & (test == 0)
        kept &= (train > 0) & (test > 0)
    out["too_few_for_split"] = kept & ~fits
    kept &= fits
    need = _split_takes(kind, split, counts.max())
    what = "train samples" if opts["leaf_split"] else "samples"
    root = Path(opts["root"])
    phrases = {
        "no_train_samples": f"no sample in LEAF's train split ({root / 'train'})",
        "no_test_samples": f"no sample in LEAF's test split ({root / 'test'})",
        "too_few_for_split": f"too few {what} for the split {split}, which takes at least {need}",
    }
    said = "; ".join(f"{int(m.sum())} with {phrases[k]}" for k, m in out.items() if m.any())
    left_out = {"min_samples": int(low.sum()), **{k: int(m.sum()) for k, m in out.items()}}
    writers = np.flatnonzero(kept)
    if not len(writers):
        if low.any():
            said += f"; {int(low.sum())} with fewer than min_samples = {opts['min_samples']}"
        if opts["leaf_split"] and (out["no_train_samples"] | out["no_test_samples"]).any():
            said += ("; data.leaf_split needs writers with samples in both splits (LEAF's "
                     "'-t sample'; '-t user' puts each writer in one alone): set it to "
                     "false")  # fmt: skip
        raise GossipError(f"{kind}: all {n_users} writers are left out: {said}")
    if said:
        hint = ""
        # (min_samples counts train and test samples; with leaf_split the split cuts train's)
        if out["too_few_for_split"].any() and opts["min_samples"] < need and not opts["leaf_split"]:
            hint = f"; data.min_samples: {need} leaves such writers out without this warning"
        warnings.warn(f"{kind}: {n_users - len(writers) - int(low.sum())} of {n_users} writers "
                      f"left out: {said}{hint}", stacklevel=6)  # fmt: skip
    return low, kept, left_out, said


def _fit_split(kind: str, counts: np.ndarray, split: tuple[float, float, float]) -> np.ndarray:
    """Which of ``counts`` samples ``build_federated`` can cut into ``split`` (its own rule,
    asked once per distinct count)."""
    fits = {int(n): _split_fits(kind, int(n), split) for n in np.unique(counts)}
    return np.array([fits[int(n)] for n in counts], dtype=bool)


def _split_fits(kind: str, n: int, split: tuple[float, float, float]) -> bool:
    try:
        partition._split_client(kind, 0, np.arange(n), split, np.random.default_rng(0))
    except GossipError:
        return False
    return True


def _split_takes(kind: str, split: tuple[float, float, float], most: int) -> int:
    """The fewest samples ``split`` can cut (looked for up to ``most``, then ``most + 1``)."""
    return next((n for n in range(1, most + 1) if _split_fits(kind, n, split)), most + 1)


def _select(split: leaf.LeafSplit, renumber: np.ndarray):
    """Samples of the chosen writers, with writers renumbered 0..k-1."""
    w = renumber[split.writer]
    keep = np.flatnonzero(w >= 0)
    return split.x[keep], split.y[keep], w[keep]


DATASETS = {
    "synthetic": _synthetic,
    "fashion_mnist": lambda **o: _image_dataset("fashion_mnist", images.load_fashion_mnist, **o),
    "emnist": _emnist,
    "cifar10": lambda **o: _image_dataset("cifar10", images.load_cifar10, **{"n_clients": 80, **o}),
    "cifar100": lambda **o: _image_dataset("cifar100", images.load_cifar100, **o),
    "femnist": lambda **o: _leaf_dataset("femnist", **o),
    "shakespeare": lambda **o: _leaf_dataset("shakespeare", **o),
}

"""The FedEM paper's synthetic mixture benchmark (App. I.1.5), with Bernoulli labels.

Each client ``t`` mixes ``M`` shared logistic models with private weights ``pi_t``:

1. ``pi_t ~ Dirichlet(alpha)`` (clustered variant: one-hot on a random component);
2. ``theta_m ~ U([-1, 1]^d)``, no bias (the paper's procedure has none; the model has one);
3. ``m_t ~ LogNormal(4, 2)``, ``n_t = min(50 + floor(m_t), 1000)`` training samples;
4. ``x ~ U([-1, 1]^d)``, ``z ~ Categorical(pi_t)``, ``eps ~ N(0, noise_std^2)``;
5. ``y ~ Bernoulli(sigmoid(<x, theta_z> + eps))``.

The released FedEM generator thresholds ``sigmoid`` instead of sampling and overwrites the rows
of earlier components; neither is reproduced here. Test samples (``n_test`` per client) come from
the same client distribution. Validation samples, when ``val_fraction > 0``, are the last
``round(val_fraction * n_t)`` of the ``n_t`` samples, so ``train + val = n_t``.

Random streams are keyed by purpose and client id (``default_rng([seed, purpose, t])``), so
changing ``n_test`` or ``clustered`` leaves the training samples and ``theta`` unchanged.

Memory: the test inputs are ``n_clients * n_test * dim * 4`` bytes, 900 MB for the defaults
(300 x 5000 x 150); they are generated in float32 into one preallocated array, and the cache
has the same size. A cached dataset is mapped from its files (copy-on-write), not read: it
loads at once, and runs side by side share the pages.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np

from gossip_pfl.data.base import (
    ClientData,
    FederatedDataset,
    check_fraction,
    pick_unseen,
)
from gossip_pfl.errors import GossipError

# Bump when the generator's output for given arguments or the cache's layout changes, so old
# caches are ignored. 2: a folder of .npy files, mapped (1: one .npz, read and CRC-checked).
FORMAT_VERSION = 2
#: the arrays of a cached dataset, one .npy file each
ARRAYS = ("theta", "pi", "n_total", "n_val", "x_fit", "y_fit", "z_fit", "x_test", "y_test",
          "z_test", "unseen")  # fmt: skip
MIN_SIZE, MAX_SIZE = 50, 1000
LOGNORMAL_MEAN, LOGNORMAL_SIGMA = 4.0, 2.0

# Purposes of the random streams; see the module docstring.
_THETA, _SIZES, _PI, _TRAIN, _TEST = 1, 2, 3, 10, 11


def default_cache_dir() -> Path:
    """``$GOSSIP_PFL_CACHE`` if set, else ``~/.cache/gossip-pfl``."""
    env = os.environ.get("GOSSIP_PFL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gossip-pfl"


def make_synthetic(
    n_clients: int = 300,
    dim: int = 150,
    n_components: int = 3,
    alpha: float = 0.4,
    n_test: int = 5000,
    noise_std: float = 0.1,
    seed: int = 12345,
    clustered: bool = False,
    val_fraction: float = 0.0,
    unseen_fraction: float = 0.0,
    cache_dir: str | os.PathLike | None = None,
    *,
    cache: bool = True,
) -> FederatedDataset:
    """Generate (or load from the cache) the synthetic mixture dataset.

    ``meta`` holds the truth: ``pi`` (T, M), ``theta`` (M, d), ``cluster`` (argmax of pi),
    ``z_train`` / ``z_val`` / ``z_test`` (the component of every sample, one array per client)
    and ``n_total`` (the drawn ``n_t``). With ``cache`` the arrays are stored as ``.npy``
    files in a folder under ``cache_dir`` (default: :func:`default_cache_dir`) keyed by a
    hash of the arguments, and mapped copy-on-write when loaded.

    >>> ds = make_synthetic(n_clients=4, dim=5, n_test=10, seed=0, cache=False)
    >>> ds.n_clients, ds.input_shape, ds.task, ds.meta["pi"].shape
    (4, (5,), 'binary', (4, 3))
    """
    args = {
        "n_clients": int(n_clients),
        "dim": int(dim),
        "n_components": int(n_components),
        "alpha": float(alpha),
        "n_test": int(n_test),
        "noise_std": float(noise_std),
        "seed": int(seed),
        "clustered": bool(clustered),
        "val_fraction": float(val_fraction),
        "unseen_fraction": float(unseen_fraction),
    }
    _validate(args)
    path = _cache_path(args, cache_dir) if cache else None
    cached = path is not None and path.exists()
    arrays = _load(path, args) if cached else None
    if arrays is None:
        _check_memory(args)
        arrays = _generate(**args)
        if path is not None:
            _save(path, arrays, damaged=cached, old=_cache_path(args, cache_dir, version=1))
    return _assemble(args, arrays)


def _check_memory(a: dict) -> None:
    """Refuse samples that cannot fit, before numpy tries (dim = 10^9 was killed for memory
    with no message): every client has at least 50 training samples and n_test test ones."""
    from gossip_pfl.runtime.threads import beyond_memory

    least = a["n_clients"] * (MIN_SIZE + a["n_test"]) * a["dim"] * 4
    if beyond := beyond_memory(least, "samples"):
        raise GossipError(
            f"synthetic: at least n_clients x ({MIN_SIZE} + n_test) x dim x 4 bytes = "
            f"{a['n_clients']:,} x {MIN_SIZE + a['n_test']:,} x {a['dim']:,} x 4 = "
            f"{beyond}"
        )


def bayes_probability(x: np.ndarray, pi_t: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """P(y = 1 | x) under the true mixture, ignoring the small logit noise: (n,)."""
    logits = np.asarray(x, dtype=np.float64) @ theta.T.astype(np.float64)  # (n, M)
    return (1.0 / (1.0 + np.exp(-logits))) @ pi_t


def _validate(a: dict) -> None:
    for key in ("n_clients", "dim", "n_components"):
        if a[key] < 1:
            raise GossipError(f"synthetic: {key} must be >= 1, got {a[key]}")
    if a["n_test"] < 0:
        raise GossipError(f"synthetic: n_test must be >= 0, got {a['n_test']}")
    if not 0 <= a["seed"] < 2**63:  # NumPy's seeds are non-negative
        raise GossipError(f"synthetic: seed must be in [0, 2**63), got {a['seed']}")
    # (NaN fails both ways; the Dirichlet draw sums n_components of them: 1e308 overflowed)
    if not 0 < a["alpha"] * a["n_components"] < math.inf:
        raise GossipError(f"synthetic: alpha must be a number > 0 (times n_components "
                          f"finite), got {a['alpha']}")  # fmt: skip
    if not 0 <= a["noise_std"] < math.inf:
        raise GossipError(f"synthetic: noise_std must be a number >= 0, got {a['noise_std']}")
    check_fraction("synthetic: val_fraction", a["val_fraction"])
    check_fraction("synthetic: unseen_fraction", a["unseen_fraction"])


def _draw_sizes(n_clients: int, seed: int) -> np.ndarray:
    """``n_t = min(50 + floor(m_t), 1000)`` with ``m_t ~ LogNormal(4, 2)``."""
    rng = np.random.default_rng([seed, _SIZES])
    m = rng.lognormal(LOGNORMAL_MEAN, LOGNORMAL_SIGMA, size=n_clients)
    return np.minimum(MIN_SIZE + np.floor(m), MAX_SIZE).astype(np.int64)


def _draw_pi(n_clients: int, n_components: int, alpha: float, clustered: bool, seed: int):
    rng = np.random.default_rng([seed, _PI])
    if clustered:
        return np.eye(n_components)[rng.integers(n_components, size=n_clients)]
    return rng.dirichlet(np.full(n_components, alpha), size=n_clients)


def _fill_samples(
    rng: np.random.Generator,
    x: np.ndarray,
    pi_t: np.ndarray,
    theta: np.ndarray,
    noise_std: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Fill ``x`` (n, d) in place with U([-1, 1]) inputs; return labels and components."""
    n = len(x)
    rng.random(out=x, dtype=np.float32)
    x *= 2
    x -= 1
    z = rng.choice(len(pi_t), size=n, p=pi_t)
    # float32 BLAS matmul over all M components is cheaper than gathering theta[z] per row.
    logits = (x @ theta.T)[np.arange(n), z].astype(np.float64)
    logits += noise_std * rng.standard_normal(n)
    y = rng.random(n) < 1.0 / (1.0 + np.exp(-logits))
    return y.astype(np.int64), z.astype(np.int8)


def _generate(
    n_clients: int,
    dim: int,
    n_components: int,
    alpha: float,
    n_test: int,
    noise_std: float,
    seed: int,
    clustered: bool,
    val_fraction: float,
    unseen_fraction: float,
) -> dict[str, np.ndarray]:
    """Draw everything; returns flat arrays (clients concatenated) plus per-client counts."""
    theta = np.random.default_rng([seed, _THETA]).uniform(-1, 1, size=(n_components, dim))
    theta = theta.astype(np.float32)
    n_total = _draw_sizes(n_clients, seed)
    pi = _draw_pi(n_clients, n_components, alpha, clustered, seed)
    n_val = np.round(val_fraction * n_total).astype(np.int64)

    # One preallocated block per kind: the test inputs are the bulk (see module docstring).
    x_fit = np.empty((n_total.sum(), dim), dtype=np.float32)
    x_test = np.empty((n_clients * n_test, dim), dtype=np.float32)
    y_fit, z_fit, y_test, z_test = [], [], [], []
    fit_ends = np.cumsum(n_total)
    for t in range(n_clients):
        block = x_fit[fit_ends[t] - n_total[t] : fit_ends[t]]
        rng = np.random.default_rng([seed, _TRAIN, t])
        y, z = _fill_samples(rng, block, pi[t], theta, noise_std)
        y_fit.append(y)
        z_fit.append(z)
        block = x_test[t * n_test : (t + 1) * n_test]
        rng = np.random.default_rng([seed, _TEST, t])
        y, z = _fill_samples(rng, block, pi[t], theta, noise_std)
        y_test.append(y)
        z_test.append(z)
    return {
        "theta": theta,
        "pi": pi,
        "n_total": n_total,
        "n_val": n_val,
        "x_fit": x_fit,
        "y_fit": np.concatenate(y_fit),
        "z_fit": np.concatenate(z_fit),
        "x_test": x_test,
        "y_test": np.concatenate(y_test),
        "z_test": np.concatenate(z_test),
        "unseen": np.array(pick_unseen(n_clients, unseen_fraction, seed), dtype=np.int64),
    }


def _assemble(args: dict, a: dict[str, np.ndarray]) -> FederatedDataset:
    """Cut the flat arrays into clients (views, no copies)."""
    n_clients, n_test = args["n_clients"], args["n_test"]
    n_total, n_val = a["n_total"], a["n_val"]
    starts = np.concatenate([[0], np.cumsum(n_total)[:-1]])
    clients, z_train, z_val, z_test = [], [], [], []
    for t in range(n_clients):
        s, v, e = starts[t], starts[t] + n_total[t] - n_val[t], starts[t] + n_total[t]
        ts, te = t * n_test, (t + 1) * n_test
        clients.append(
            ClientData(
                x_train=a["x_fit"][s:v],
                y_train=a["y_fit"][s:v],
                x_val=a["x_fit"][v:e],
                y_val=a["y_fit"][v:e],
                x_test=a["x_test"][ts:te],
                y_test=a["y_test"][ts:te],
            )
        )
        z_train.append(a["z_fit"][s:v])
        z_val.append(a["z_fit"][v:e])
        z_test.append(a["z_test"][ts:te])
    meta = {
        **args,
        "pi": a["pi"],
        "theta": a["theta"],
        "cluster": np.argmax(a["pi"], axis=1),
        "n_total": n_total,
        "z_train": z_train,
        "z_val": z_val,
        "z_test": z_test,
    }
    return FederatedDataset(
        name="synthetic_clustered" if args["clustered"] else "synthetic",
        clients=clients,
        input_shape=(args["dim"],),
        num_classes=2,
        task="binary",
        meta=meta,
        unseen=[int(u) for u in a["unseen"]],
    )


def _cache_path(
    args: dict, cache_dir: str | os.PathLike | None, version: int = FORMAT_VERSION
) -> Path:
    keyed = json.dumps({"format": version, **args}, sort_keys=True)
    digest = hashlib.sha256(keyed.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / (f"synthetic-{digest}" + (".npz" if version == 1 else ""))


def _save(
    path: Path, arrays: dict[str, np.ndarray], damaged: bool = False, old: Path | None = None
) -> None:
    """Write a folder of .npy files atomically (a temp folder, then a rename) so an
    interrupted run leaves no torn cache, in place of a ``damaged`` one (a run that mapped
    its files keeps them); then remove ``old`` (the same data in the previous format, which
    would only take disk space)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name no other run picks (two hosts sharing the cache can share a pid); mkdir, not
        # mkdtemp, so the folder gets the umask's permissions like the rest of the cache
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
        tmp.mkdir()
        for name in ARRAYS:
            np.save(tmp / f"{name}.npy", arrays[name])
        if damaged:
            shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)  # fails if another run stored it meanwhile: theirs is kept
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not path.is_dir():  # else another run stored the same data first
            # only a cache: the run goes on with the data it generated
            warnings.warn(f"synthetic: cannot write cache {path} ({e.strerror}); the data "
                          "is generated again next time", stacklevel=3)  # fmt: skip
    if old is not None:
        with contextlib.suppress(OSError):  # only disk space is at stake
            old.unlink(missing_ok=True)


def _load(path: Path, args: dict) -> dict[str, np.ndarray] | None:
    """The cached arrays, mapped copy-on-write (pages are read when first used, shared with
    other runs and never written back); None when the cache is damaged (a file cut short by
    a full disk or a killed copy, missing, or of shapes or types that are not these
    arguments' data): it is only a cache, so the data is generated again and the cache
    rewritten."""
    try:
        arrays = {k: np.load(path / f"{k}.npy", mmap_mode="c") for k in ARRAYS}
        _check_shapes(arrays, args)
        return arrays
    except (OSError, ValueError, EOFError) as e:
        warnings.warn(f"synthetic: cache {path} is damaged ({e}); regenerating", stacklevel=3)
        return None


def _check_shapes(a: dict[str, np.ndarray], args: dict) -> None:
    """The arrays' shapes and kinds are those :func:`_generate` makes for ``args`` (another
    run's test file, or sizes that do not add up, cut the clients wrongly and silently)."""
    T, d, M, n_test = args["n_clients"], args["dim"], args["n_components"], args["n_test"]
    fit = int(a["n_total"].sum()) if a["n_total"].shape == (T,) else -1
    want = {"theta": (M, d), "pi": (T, M), "n_total": (T,), "n_val": (T,), "x_fit": (fit, d),
            "y_fit": (fit,), "z_fit": (fit,), "x_test": (T * n_test, d), "y_test": (T * n_test,),
            "z_test": (T * n_test,)}  # fmt: skip
    for key, shape in want.items():
        if a[key].shape != shape:
            raise ValueError(f"{key}.npy has shape {a[key].shape}, expected {shape}")
    for key in ("n_total", "n_val", "y_fit", "y_test", "unseen"):
        if a[key].dtype.kind not in "iu":
            raise ValueError(f"{key}.npy holds {a[key].dtype}, not integers")
    for key in ("x_fit", "x_test"):
        if a[key].dtype != np.float32:
            raise ValueError(f"{key}.npy holds {a[key].dtype}, not float32")
    # the held-out clients are a pure function of the arguments: another run's file is seen
    unseen = pick_unseen(T, args["unseen_fraction"], args["seed"])
    if not np.array_equal(a["unseen"], unseen):
        raise ValueError(f"unseen.npy holds clients {a['unseen'].tolist()[:4]}..., not these "
                         "arguments' held-out clients")  # fmt: skip

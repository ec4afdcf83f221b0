"""Readers for centralized image datasets: Fashion-MNIST, EMNIST, CIFAR-10, CIFAR-100.

Numpy only, and nothing is ever downloaded: the files must already be on disk. Each reader
returns a :class:`CentralData` with images as float32 of shape (N, C, H, W) scaled to [0, 1];
CIFAR images are then normalized per channel with the training set's mean and std.

Expected layouts (``.gz`` or not, for the IDX files):

- Fashion-MNIST: ``ROOT/{train,t10k}-{images-idx3,labels-idx1}-ubyte``; the default ROOT is
  where Debian's ``dataset-fashion-mnist`` package puts them
  (``/usr/share/datasets/fashion-mnist``).
- EMNIST (torchvision layout): ``ROOT/EMNIST/raw/emnist-SPLIT-{train,test}-{images-idx3,
  labels-idx1}-ubyte``.
- CIFAR-10: ``ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch}`` (the python pickles).
- CIFAR-100: ``ROOT/cifar-100-python/{train,test}`` (the python pickles, ``fine_labels``).

The CIFAR files are Python pickles; unpickling runs code, so point ``root`` only at copies of
the official archives.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gossip_pfl.errors import GossipError

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")

# IDX type byte -> numpy dtype (big-endian, as the format stores it).
_IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

# EMNIST split -> number of classes (labels of "letters" start at 1 and are shifted to 0).
EMNIST_SPLITS = {
    "byclass": 62,
    "bymerge": 47,
    "balanced": 47,
    "letters": 26,
    "digits": 10,
    "mnist": 10,
}


@dataclass
class CentralData:
    """A centralized labelled dataset as shipped: the official train and test sets."""

    name: str
    x_train: np.ndarray  # float32 (N, C, H, W)
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- IDX


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (gzipped or not) into an array of the stored dtype and shape.

    Raises a one-line ``GossipError`` naming the file when it is truncated, has a bad magic
    number, or its size disagrees with its header.
    """
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise GossipError(f"IDX file {path}: truncated, only {len(raw)} bytes (no header)")
    if raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise GossipError(f"IDX file {path}: bad magic number 0x{raw[:4].hex()}, not an IDX file")
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise GossipError(f"IDX file {path}: truncated header ({len(raw)} of {header} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise GossipError(
            f"IDX file {path}: size mismatch, header {dims} needs {expected} data bytes "
            f"but the file has {len(raw) - header}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (for tests and for exporting subsets)."""
    codes = {dt.newbyteorder("=").str: code for code, dt in _IDX_TYPES.items()}
    array = np.asarray(array)
    code = codes.get(array.dtype.newbyteorder("=").str)
    if code is None:
        raise GossipError(f"IDX file {path}: dtype {array.dtype} cannot be stored in IDX")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    body = array.astype(_IDX_TYPES[code]).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + body)


def _read_bytes(path: Path) -> bytes:
    """File contents, gunzipped when the file starts with the gzip magic."""
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            return gzip.decompress(raw)
        return raw
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise GossipError(f"IDX file {path}: corrupt or truncated gzip data ({e})") from e
    except OSError as e:
        raise GossipError(f"cannot read {path}: {e.strerror}") from e


def _find_files(dataset: str, folders: list[Path], names: list[str], hint: str) -> list[Path]:
    """Locate each of ``names`` (or ``name.gz``) in the first folder that holds all of them."""
    for folder in folders:
        found = [_with_gz(folder / n) for n in names]
        if all(p is not None for p in found):
            return found
    where = folders[0]
    missing = [n for n in names if _with_gz(where / n) is None]
    raise GossipError(f"{dataset}: missing {', '.join(missing)} (or .gz) in {where}; {hint}")


def _with_gz(path: Path) -> Path | None:
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def _idx_pair(dataset: str, images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images scaled to float32 [0, 1] with a channel axis, and int64 labels; sizes checked."""
    x = read_idx(images)
    y = read_idx(labels)
    if x.ndim != 3 or y.ndim != 1:
        raise GossipError(
            f"{dataset}: {images.name} has shape {x.shape} and {labels.name} {y.shape}; "
            "expected (N, H, W) images and (N,) labels"
        )
    if len(x) != len(y):
        raise GossipError(
            f"{dataset}: {images.name} holds {len(x)} images but {labels.name} {len(y)} labels"
        )
    for path, a in ((images, x), (labels, y)):  # (float pixels were divided by 255 too, and
        if a.dtype != np.uint8:  # float labels truncated: a run of wrong data, unsaid)
            raise GossipError(f"{dataset}: {path} holds {a.dtype} values; IDX image and label "
                              "files hold unsigned bytes (type 0x08)")  # fmt: skip
    x = x.astype(np.float32)[:, None] / np.float32(255.0)
    return x, y.astype(np.int64)


# ----------------------------------------------------------------------------- readers


def load_fashion_mnist(root: str | os.PathLike | None = None) -> CentralData:
    """Fashion-MNIST: 60,000 + 10,000 images of shape (1, 28, 28), 10 classes."""
    folder = Path(root) if root is not None else FASHION_MNIST_ROOT
    names = [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ]
    hint = "run `apt-get install -y dataset-fashion-mnist` or pass root=FOLDER holding them"
    files = _find_files("fashion_mnist", [folder], names, hint)
    x_train, y_train = _idx_pair("fashion_mnist", files[0], files[1])
    x_test, y_test = _idx_pair("fashion_mnist", files[2], files[3])
    if x_train.shape[1:] != x_test.shape[1:]:  # (a traceback where the splits were joined)
        raise GossipError(f"fashion_mnist: {files[0]} holds images of {x_train.shape[2:]} but "
                          f"{files[2]} of {x_test.shape[2:]}")  # fmt: skip
    return _checked(CentralData("fashion_mnist", x_train, y_train, x_test, y_test, 10))


def load_emnist(root: str | os.PathLike, split: str = "byclass") -> CentralData:
    """EMNIST ``split`` from the torchvision layout ``ROOT/EMNIST/raw``.

    The IDX files store each image transposed; images are returned upright.
    ``letters`` labels (1..26 in the files) are shifted to 0..25.
    """
    if split not in EMNIST_SPLITS:
        raise GossipError(f"emnist: unknown split {split!r}; known: {', '.join(EMNIST_SPLITS)}")
    root = _need_root("emnist", root, "ROOT/EMNIST/raw/emnist-*-ubyte files")
    names = [
        f"emnist-{split}-train-images-idx3-ubyte",
        f"emnist-{split}-train-labels-idx1-ubyte",
        f"emnist-{split}-test-images-idx3-ubyte",
        f"emnist-{split}-test-labels-idx1-ubyte",
    ]
    # Also accept root pointing at the raw folder itself.
    folders = [root / "EMNIST" / "raw", root / "raw", root]
    hint = "put the files of the EMNIST 'gzip.zip' archive there (torchvision layout)"
    files = _find_files("emnist", folders, names, hint)
    x_train, y_train = _idx_pair("emnist", files[0], files[1])
    x_test, y_test = _idx_pair("emnist", files[2], files[3])
    x_train, x_test = x_train.transpose(0, 1, 3, 2), x_test.transpose(0, 1, 3, 2)
    if split == "letters":
        y_train, y_test = y_train - 1, y_test - 1
    data = CentralData(
        f"emnist_{split}",
        np.ascontiguousarray(x_train),
        y_train,
        np.ascontiguousarray(x_test),
        y_test,
        EMNIST_SPLITS[split],
    )
    return _checked(data)


def load_cifar10(root: str | os.PathLike) -> CentralData:
    """CIFAR-10 from ``ROOT/cifar-10-batches-py``: 50,000 + 10,000 images (3, 32, 32)."""
    root = _need_root("cifar10", root, "ROOT/cifar-10-batches-py/")
    train = [f"data_batch_{i}" for i in range(1, 6)]
    files = _find_pickles("cifar10", root, "cifar-10-batches-py", [*train, "test_batch"])
    parts = [_unpickle_cifar("cifar10", f, b"labels") for f in files]
    x_train = np.concatenate([p[0] for p in parts[:5]])
    y_train = np.concatenate([p[1] for p in parts[:5]])
    return _normalized("cifar10", x_train, y_train, *parts[5], num_classes=10)


def load_cifar100(root: str | os.PathLike) -> CentralData:
    """CIFAR-100 (fine labels) from ``ROOT/cifar-100-python``: 50,000 + 10,000 images.

    The coarse labels are kept in ``meta["coarse_train"]`` and ``meta["coarse_test"]``.
    """
    root = _need_root("cifar100", root, "ROOT/cifar-100-python/")
    files = _find_pickles("cifar100", root, "cifar-100-python", ["train", "test"])
    x_train, y_train = _unpickle_cifar("cifar100", files[0], b"fine_labels")
    x_test, y_test = _unpickle_cifar("cifar100", files[1], b"fine_labels")
    data = _normalized("cifar100", x_train, y_train, x_test, y_test, num_classes=100)
    data.meta["coarse_train"] = _unpickle_cifar("cifar100", files[0], b"coarse_labels")[1]
    data.meta["coarse_test"] = _unpickle_cifar("cifar100", files[1], b"coarse_labels")[1]
    return data


def _need_root(dataset: str, root: str | os.PathLike | None, layout: str) -> Path:
    if root is None:
        raise GossipError(f"{dataset}: no root given; pass root=FOLDER holding {layout}")
    return Path(root)


def _find_pickles(dataset: str, root: Path, sub: str, names: list[str]) -> list[Path]:
    """The pickles under ``root/sub`` (or directly under ``root``)."""
    for folder in (root / sub, root):
        if all((folder / n).is_file() for n in names):
            return [folder / n for n in names]
    missing = [n for n in names if not (root / sub / n).is_file()]
    raise GossipError(
        f"{dataset}: missing {', '.join(missing)} in {root / sub}; "
        f"extract the official python archive ({sub}) under {root}"
    )


def _unpickle_cifar(dataset: str, path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (N, 3, 32, 32), int64 labels) from one CIFAR pickle."""
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    # a damaged pickle raises what its bytes make: OverflowError, MemoryError, ImportError
    # (a module name), LookupError, ...; the file is named, whatever broke
    except Exception as e:  # noqa: BLE001
        raise GossipError(f"{dataset}: cannot unpickle {path} ({type(e).__name__}: {e})") from e
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise GossipError(
            f"{dataset}: {path} lacks the keys 'data' and {label_key.decode()!r}; "
            "is it the python version of the archive?"
        )
    x, y = np.asarray(batch[b"data"]), np.asarray(batch[label_key])
    if x.dtype != np.uint8 or y.dtype.kind not in "iu":  # (a cast wraps 1000 to 232)
        raise GossipError(
            f"{dataset}: {path} has data of {x.dtype} and labels of {y.dtype}; expected uint8 "
            "pixels and integer labels"
        )
    y = y.astype(np.int64)
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or len(x) != len(y):
        raise GossipError(
            f"{dataset}: {path} has data {x.shape} and {len(y)} labels; expected (N, 3072) and N"
        )
    return x.reshape(-1, 3, 32, 32), y


def _normalized(dataset, x_train, y_train, x_test, y_test, num_classes) -> CentralData:
    """Scale to [0, 1], then subtract the training set's per-channel mean and divide by std."""
    x_train = x_train.astype(np.float32) / np.float32(255.0)
    x_test = x_test.astype(np.float32) / np.float32(255.0)
    mean = x_train.mean(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    std = x_train.std(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    for x in (x_train, x_test):
        x -= mean[None, :, None, None]
        x /= std[None, :, None, None]
    meta = {"channel_mean": mean, "channel_std": std}
    return _checked(CentralData(dataset, x_train, y_train, x_test, y_test, num_classes, meta))


def _checked(data: CentralData) -> CentralData:
    """Labels must lie in 0..num_classes-1; a wrong file or split shows up here."""
    for split, y in (("train", data.y_train), ("test", data.y_test)):
        if len(y) and (y.min() < 0 or y.max() >= data.num_classes):
            raise GossipError(
                f"{data.name}: {split} labels span {y.min()}..{y.max()}, "
                f"expected 0..{data.num_classes - 1}"
            )
    return data

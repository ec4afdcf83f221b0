"""IDX parser, image readers (on tiny hand-written files) and their error messages."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest

from gossip_pfl.data import images, load_dataset
from gossip_pfl.errors import GossipError

FASHION = Path("/usr/share/datasets/fashion-mnist")


def test_idx_hand_written(tmp_path):
    # magic 0x00000803: unsigned bytes, 3 dims (2, 2, 3); then 12 data bytes.
    raw = bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3]) + bytes(range(12))
    (tmp_path / "a.idx").write_bytes(raw)
    (tmp_path / "a.idx.gz").write_bytes(gzip.compress(raw))
    for name in ("a.idx", "a.idx.gz"):
        x = images.read_idx(tmp_path / name)
        assert x.shape == (2, 2, 3) and x.dtype == np.uint8
        np.testing.assert_array_equal(x.ravel(), np.arange(12))


def test_idx_round_trip_wider_types(tmp_path):
    for arr in (np.arange(6, dtype=np.int32).reshape(2, 3) - 3, np.linspace(0, 1, 5)):
        images.write_idx(tmp_path / "b.idx", arr)
        np.testing.assert_array_equal(images.read_idx(tmp_path / "b.idx"), arr)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x00\x00", "truncated"),
        (bytes([1, 2, 8, 1, 0, 0, 0, 1, 5]), "bad magic"),
        (bytes([0, 0, 8, 2, 0, 0, 0, 2]), "truncated header"),
        (bytes([0, 0, 8, 1, 0, 0, 0, 4, 1, 2]), "size mismatch"),
    ],
)
def test_idx_corrupt(tmp_path, raw, message):
    path = tmp_path / "bad.idx"
    path.write_bytes(raw)
    with pytest.raises(GossipError, match=message) as err:
        images.read_idx(path)
    assert "bad.idx" in str(err.value) and "\n" not in str(err.value)


def test_idx_truncated_gzip(tmp_path):
    raw = gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 100]) + bytes(100))
    path = tmp_path / "cut.gz"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(GossipError, match="cut.gz.*gzip"):
        images.read_idx(path)


def test_fashion_mnist_missing_names_files_and_apt(tmp_path):
    with pytest.raises(GossipError) as err:
        images.load_fashion_mnist(tmp_path)
    msg = str(err.value)
    assert "train-images-idx3-ubyte" in msg and "t10k-labels-idx1-ubyte" in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg and str(tmp_path) in msg


@pytest.mark.skipif(not FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist():
    data = images.load_fashion_mnist()
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_train.dtype == np.float32
    assert data.y_train.shape == (60000,) and data.x_test.shape == (10000, 1, 28, 28)
    assert data.y_test.shape == (10000,) and data.num_classes == 10
    assert 0 <= data.x_train.min() and data.x_train.max() <= 1
    assert np.bincount(data.y_train).tolist() == [6000] * 10


def _write_emnist(raw: Path, split: str, n: int, labels: np.ndarray) -> None:
    raw.mkdir(parents=True)
    for part in ("train", "test"):
        img = np.arange(n * 28 * 28, dtype=np.uint8).reshape(n, 28, 28)
        images.write_idx(raw / f"emnist-{split}-{part}-images-idx3-ubyte.gz", img)
        images.write_idx(raw / f"emnist-{split}-{part}-labels-idx1-ubyte", labels)


def test_emnist_layout_transpose_and_letters(tmp_path):
    _write_emnist(tmp_path / "EMNIST" / "raw", "letters", 3, np.array([1, 26, 5], np.uint8))
    data = images.load_emnist(tmp_path, "letters")
    assert data.x_train.shape == (3, 1, 28, 28) and data.num_classes == 26
    assert data.y_train.tolist() == [0, 25, 4]
    stored = np.arange(3 * 28 * 28, dtype=np.uint8).reshape(3, 28, 28)[:, None] / 255
    np.testing.assert_allclose(data.x_train, stored.transpose(0, 1, 3, 2), rtol=1e-6)


def test_emnist_missing_names_files(tmp_path):
    with pytest.raises(GossipError) as err:
        images.load_emnist(tmp_path, "digits")
    msg = str(err.value)
    assert "emnist-digits-train-images-idx3-ubyte" in msg and "EMNIST/raw" in msg
    with pytest.raises(GossipError, match="unknown split"):
        images.load_emnist(tmp_path, "kanji")


def _write_cifar(folder: Path, names: list[str], label_key: str, n: int = 4) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in names:
        batch = {
            b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            label_key.encode(): list(rng.integers(0, 10, size=n)),
            b"coarse_labels": list(rng.integers(0, 10, size=n)),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)


def test_cifar10_reads_and_normalizes(tmp_path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    _write_cifar(tmp_path / "cifar-10-batches-py", names, "labels")
    data = images.load_cifar10(tmp_path)
    assert data.x_train.shape == (20, 3, 32, 32) and data.x_test.shape == (4, 3, 32, 32)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    np.testing.assert_allclose(data.x_train.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(data.x_train.std(axis=(0, 2, 3)), 1, atol=1e-3)


def test_cifar100_fine_labels(tmp_path):
    _write_cifar(tmp_path / "cifar-100-python", ["train", "test"], "fine_labels")
    data = images.load_cifar100(tmp_path)
    assert data.num_classes == 100 and data.x_test.shape == (4, 3, 32, 32)
    assert data.meta["coarse_train"].shape == (4,)


def test_cifar_missing_and_corrupt(tmp_path):
    with pytest.raises(GossipError, match="data_batch_1.*test_batch.*cifar-10-batches-py"):
        images.load_cifar10(tmp_path)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(b"not a pickle")
    (folder / "test").write_bytes(b"not a pickle")
    with pytest.raises(GossipError, match="cannot unpickle .*train"):
        images.load_cifar100(tmp_path)


def test_registry_image_partition_on_fake_cifar(tmp_path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    _write_cifar(tmp_path / "cifar-10-batches-py", names, "labels", n=40)
    ds = load_dataset(
        "cifar10", root=tmp_path, n_clients=4, partition={"kind": "dirichlet", "alpha": 10.0}
    )
    assert ds.n_clients == 4 and ds.num_classes == 10 and ds.input_shape == (3, 32, 32)
    assert ds.sizes("train").sum() + ds.sizes("val").sum() + ds.sizes("test").sum() == 240


@pytest.mark.parametrize(
    ("data", "labels", "message"),
    [
        # (values over 255 wrapped to uint8; strings were a ValueError traceback)
        (np.full((2, 3072), 1000.0), [1, 2], "data of float64"),
        (np.array([["x"] * 3072] * 2), [1, 2], "data of <U1"),
        (np.zeros((2, 3072), np.uint8), ["a", "b"], "labels of <U1"),
    ],
)
def test_cifar_batches_of_other_types_are_refused(tmp_path, data, labels, message):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test"):
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"fine_labels": labels, b"coarse_labels": labels}, f)
    with pytest.raises(GossipError, match=message):
        images.load_cifar100(tmp_path)


def test_cifar_bytes_that_break_the_unpickler_are_one_line(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test"):  # a pickle header, then a huge BINBYTES length
        (folder / name).write_bytes(b"\x80\x04\x8e" + b"\xff" * 8)
    with pytest.raises(GossipError, match="cannot unpickle .*train"):
        images.load_cifar100(tmp_path)


def test_a_fraction_that_keeps_fewer_samples_than_clients_names_it(tmp_path, monkeypatch):
    central = images.CentralData("fashion_mnist", np.zeros((7, 1, 4, 4), np.float32),
                                 np.arange(7) % 2, np.zeros((3, 1, 4, 4), np.float32),
                                 np.arange(3) % 2, 2)  # fmt: skip
    monkeypatch.setattr(images, "load_fashion_mnist", lambda root: central)
    with pytest.raises(GossipError, match="n_clients 4 is more than the 2 samples that fraction"):
        load_dataset("fashion_mnist", n_clients=4, fraction=0.2)
    with pytest.raises(GossipError, match="fraction 0.01 of 10 samples keeps none"):
        load_dataset("fashion_mnist", n_clients=4, fraction=0.01)


def test_a_pickle_naming_a_module_that_is_not_there_is_one_line(tmp_path):
    """A one-byte change in numpy's module name raised ModuleNotFoundError."""
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test"):
        (folder / name).write_bytes(b"\x80\x02cnumpy.core.multiarruy\n_reconstruct\nq\x00.")
    with pytest.raises(GossipError, match="cannot unpickle .*ModuleNotFoundError"):
        images.load_cifar100(tmp_path)


@pytest.mark.parametrize("bad", ["float_images", "int16_images", "float_labels", "test_32x32"])
def test_fashion_mnist_files_of_other_types_or_shapes_are_refused(tmp_path, bad):
    """IDX files of floats or wider integers were divided by 255 or truncated (pixels of
    0..0.004, labels 0.7 -> 0) and run, unsaid; test images of another size than the
    training ones were a traceback where the splits were joined."""
    img = np.arange(4 * 28 * 28, dtype=np.uint8).reshape(4, 28, 28)
    lab = np.arange(4, dtype=np.uint8)
    files = {"train-images-idx3-ubyte": img, "train-labels-idx1-ubyte": lab,
             "t10k-images-idx3-ubyte": img, "t10k-labels-idx1-ubyte": lab}  # fmt: skip
    changed, says = {
        "float_images": ("train-images-idx3-ubyte", "holds float32 values"),
        "int16_images": ("t10k-images-idx3-ubyte", "holds int16 values"),
        "float_labels": ("train-labels-idx1-ubyte", "holds float64 values"),
        "test_32x32": ("t10k-images-idx3-ubyte", r"of \(28, 28\) but .* of \(32, 32\)"),
    }[bad]
    files[changed] = {
        "float_images": (img / 255).astype(np.float32), "int16_images": img.astype(">i2"),
        "float_labels": lab + 0.7, "test_32x32": np.zeros((4, 32, 32), np.uint8),
    }[bad]  # fmt: skip
    for name, a in files.items():
        images.write_idx(tmp_path / name, a)
    with pytest.raises(GossipError, match=says):
        images.load_fashion_mnist(tmp_path)

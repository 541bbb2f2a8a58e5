"""Dataset loaders, each fed small files in the real on-disk format."""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rayfl.data import datasets
from rayfl.data.datasets import ArrayDataset, load_dataset, read_idx
from rayfl.errors import ConfigError, UserError

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")


# --------------------------------------------------------------------------- writers


def write_idx(path: Path, array: np.ndarray, *, compress: bool = True) -> Path:
    """Write `array` (uint8) in the IDX format: 0, 0, 0x08, ndim, then big-endian dims."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)
    return path


def write_idx_dataset(
    directory: Path, n_train: int = 12, n_test: int = 5, *, compress: bool = True
):
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test)[::-1] % 10).astype(np.uint8),
    }
    for stem, array in arrays.items():
        write_idx(directory / stem, array, compress=compress)
    return arrays


def write_cifar_batch(path: Path, data: np.ndarray, labels: list[int], label_key: bytes) -> None:
    # Same structure as the official files: a dict with bytes keys, data as (N, 3072) uint8.
    batch = {
        b"batch_label": b"testing batch",
        label_key: labels,
        b"data": data.reshape(len(data), -1),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(data))],
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


def no_debian(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(datasets.DEBIAN_DIRS, "fmnist", tmp_path / "absent")
    monkeypatch.setitem(datasets.DEBIAN_DIRS, "mnist", tmp_path / "absent")


def fail_download(torchvision_class: str, root: Path) -> None:
    raise OSError("network is unreachable")


# --------------------------------------------------------------------------- IDX: fmnist / mnist


@pytest.mark.parametrize("compress", [True, False])
def test_fmnist_reads_idx_files_from_root(tmp_path, monkeypatch, compress):
    no_debian(monkeypatch, tmp_path)
    monkeypatch.setattr(datasets, "_download", fail_download)
    arrays = write_idx_dataset(tmp_path, compress=compress)
    ds = load_dataset("fmnist", root=str(tmp_path))
    assert ds.name == "fmnist" and ds.num_classes == 10 and ds.scale == 255.0
    assert ds.x_train.shape == (12, 1, 28, 28) and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (5, 1, 28, 28)
    assert ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    np.testing.assert_array_equal(ds.x_train[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.y_test, [4, 3, 2, 1, 0])
    assert ds.in_shape == (1, 28, 28)


def test_fmnist_reads_torchvision_raw_layout(tmp_path, monkeypatch):
    no_debian(monkeypatch, tmp_path)
    monkeypatch.setattr(datasets, "_download", fail_download)
    arrays = write_idx_dataset(tmp_path / "FashionMNIST" / "raw", compress=False)
    ds = load_dataset("fmnist", root=str(tmp_path))
    np.testing.assert_array_equal(ds.x_test[:, 0], arrays["t10k-images-idx3-ubyte"])


def test_mnist_downloads_when_missing(tmp_path, monkeypatch):
    no_debian(monkeypatch, tmp_path)
    calls = []

    def fake_download(torchvision_class: str, root: Path) -> None:
        calls.append(torchvision_class)
        write_idx_dataset(root / "MNIST" / "raw", n_train=7)

    monkeypatch.setattr(datasets, "_download", fake_download)
    ds = load_dataset("mnist", root=str(tmp_path))
    assert calls == ["MNIST"]
    assert ds.x_train.shape == (7, 1, 28, 28) and ds.mean == (0.1307,)


def test_missing_idx_files_offline_is_a_user_error(tmp_path, monkeypatch):
    no_debian(monkeypatch, tmp_path)
    monkeypatch.setattr(datasets, "_download", fail_download)
    with pytest.raises(UserError, match="apt-get install dataset-fashion-mnist") as info:
        load_dataset("fmnist", root=str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_read_idx_rejects_wrong_magic_and_truncation(tmp_path):
    path = write_idx(tmp_path / "labels", np.arange(5, dtype=np.uint8))  # magic 2049
    assert read_idx(path, 2049).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(UserError, match="magic 2049"):
        read_idx(path, 2051)
    bad = tmp_path / "truncated"
    bad.write_bytes(bytes([0, 0, 8, 1]) + (10).to_bytes(4, "big") + b"abc")
    with pytest.raises(UserError, match="truncated"):
        read_idx(bad)


@pytest.mark.skipif(not DEBIAN_FMNIST.is_dir(), reason="Debian dataset-fashion-mnist not installed")
def test_debian_fmnist_loads_with_right_shapes(tmp_path):
    ds = load_dataset("fmnist", root=str(tmp_path))
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (10000, 1, 28, 28)
    # Fashion-MNIST is balanced: 6,000 train and 1,000 test images per class.
    assert np.bincount(ds.y_train).tolist() == [6000] * 10
    assert np.bincount(ds.y_test).tolist() == [1000] * 10
    assert ds.y_train[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert abs(ds.x_train[:1000].mean() / 255.0 - ds.mean[0]) < 0.02
    batch = ds.as_tensor(ds.x_train[:2000])
    assert abs(float(batch.mean())) < 0.1 and abs(float(batch.std()) - 1.0) < 0.1


# --------------------------------------------------------------------------- CIFAR


def test_cifar10_reads_python_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_download", fail_download)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for b in range(1, 6):
        # Image i of batch b: red plane = b, green = i, blue = 200.
        data = np.zeros((3, 3, 32, 32), dtype=np.uint8)
        data[:, 0] = b
        data[:, 1] = np.arange(3)[:, None, None]
        data[:, 2] = 200
        write_cifar_batch(folder / f"data_batch_{b}", data, [b, b + 1, b + 2], b"labels")
    write_cifar_batch(
        folder / "test_batch", np.full((2, 3, 32, 32), 7, np.uint8), [9, 0], b"labels"
    )

    ds = load_dataset("cifar10", root=str(tmp_path))
    assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (2, 3, 32, 32) and ds.num_classes == 10
    assert ds.y_train.tolist() == [1, 2, 3, 2, 3, 4, 3, 4, 5, 4, 5, 6, 5, 6, 7]
    assert ds.y_test.tolist() == [9, 0] and ds.y_train.dtype == np.int64
    # The channel-plane layout survives: batch order, then red/green/blue planes.
    assert (
        ds.x_train[4, 0].max() == 2
        and ds.x_train[4, 1].min() == 1
        and ds.x_train[4, 2].min() == 200
    )
    assert len(ds.mean) == 3


def test_cifar100_uses_fine_labels(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_download", fail_download)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, fine in (("train", [99, 5, 42]), ("test", [0, 63])):
        data = np.arange(len(fine) * 3072, dtype=np.int64).astype(np.uint8).reshape(len(fine), 3072)
        batch = {b"data": data, b"fine_labels": fine, b"coarse_labels": [1] * len(fine)}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    ds = load_dataset("cifar100", root=str(tmp_path))
    assert ds.num_classes == 100 and ds.y_train.tolist() == [99, 5, 42]
    assert ds.x_test.shape == (2, 3, 32, 32)
    # Row-major reshape: pixel (c, h, w) of image 0 is byte c*1024 + h*32 + w.
    assert ds.x_train[0, 1, 0, 5] == (1024 + 5) % 256


def test_cifar_missing_offline_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_download", fail_download)
    with pytest.raises(UserError, match="cifar-10-batches-py"):
        load_dataset("cifar10", root=str(tmp_path))


# --------------------------------------------------------------------------- Tiny ImageNet


def make_tinyimagenet(root: Path) -> Path:
    folder = root / "tiny-imagenet-200"
    # wnids.txt out of order: labels follow sorted wnids (n01 -> 0, n02 -> 1).
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("n02\nn01\n")
    colors = {"n01": (255, 0, 0), "n02": (0, 0, 255)}
    for wnid, color in colors.items():
        images = folder / "train" / wnid / "images"
        images.mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (64, 64), color).save(images / f"{wnid}_{i}.JPEG", quality=95)
    Image.new("L", (64, 64), 128).save(folder / "val" / "images" / "val_0.JPEG")  # greyscale
    Image.new("RGB", (64, 64), colors["n02"]).save(folder / "val" / "images" / "val_1.JPEG")
    Image.new("RGB", (32, 32), colors["n01"]).save(folder / "val" / "images" / "val_2.JPEG")
    (folder / "val" / "val_annotations.txt").write_text(
        "val_0.JPEG\tn01\t0\t0\t63\t63\nval_1.JPEG\tn02\t0\t0\t63\t63\nval_2.JPEG\tn01\t1\t1\t9\t9\n"
    )
    return folder


def test_tinyimagenet_reads_folder_and_caches(tmp_path):
    folder = make_tinyimagenet(tmp_path)
    ds = load_dataset("tinyimagenet", root=str(tmp_path))
    assert ds.x_train.shape == (4, 3, 64, 64) and ds.x_train.dtype == np.uint8
    assert ds.y_train.tolist() == [0, 0, 1, 1] and ds.y_test.tolist() == [0, 1, 0]
    assert ds.x_test.shape == (3, 3, 64, 64) and ds.num_classes == 2
    red = ds.x_train[0].reshape(3, -1).mean(axis=1)
    np.testing.assert_allclose(red, [255, 0, 0], atol=3)
    np.testing.assert_allclose(ds.x_test[0].reshape(3, -1).mean(axis=1), [128] * 3, atol=3)
    np.testing.assert_allclose(ds.x_test[2].reshape(3, -1).mean(axis=1), [255, 0, 0], atol=3)

    cache = tmp_path / "tiny-imagenet-200.npz"
    assert cache.is_file()
    # The second load comes from the cache alone: it works with the JPEG folder gone.
    for path in sorted(folder.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    folder.rmdir()
    again = load_dataset("tinyimagenet", root=str(tmp_path))
    np.testing.assert_array_equal(again.x_train, ds.x_train)
    np.testing.assert_array_equal(again.y_test, ds.y_test)


def test_tinyimagenet_missing_names_url_and_place(tmp_path):
    with pytest.raises(UserError, match="tiny-imagenet-200.zip") as info:
        load_dataset("tinyimagenet", root=str(tmp_path))
    assert str(tmp_path) in str(info.value)


# --------------------------------------------------------------------------- synthetic, digits


def test_synthetic_is_seeded_and_learnable():
    ds = load_dataset("synthetic", num_samples=600, num_test=200, num_classes=4, shape=[2, 3, 3])
    assert ds.x_train.shape == (600, 2, 3, 3) and ds.x_train.dtype == np.float32
    assert ds.y_train.dtype == np.int64 and set(ds.y_train.tolist()) == {0, 1, 2, 3}
    assert ds.mean == (0.0, 0.0) and ds.std == (1.0, 1.0) and ds.scale == 1.0
    same = load_dataset("synthetic", num_samples=600, num_test=200, num_classes=4, shape=(2, 3, 3))
    np.testing.assert_array_equal(same.x_train, ds.x_train)
    other = load_dataset(
        "synthetic", num_samples=600, num_test=200, num_classes=4, shape=(2, 3, 3), seed=1
    )
    assert not np.array_equal(other.x_train, ds.x_train)
    # Nearest class mean, fitted on train, classifies the test set well: the data is learnable.
    flat_train, flat_test = ds.x_train.reshape(600, -1), ds.x_test.reshape(200, -1)
    centroids = np.stack([flat_train[ds.y_train == c].mean(0) for c in range(4)])
    pred = ((flat_test[:, None] - centroids[None]) ** 2).sum(-1).argmin(1)
    assert (pred == ds.y_test).mean() > 0.9


def test_synthetic_rejects_bad_options():
    with pytest.raises(ConfigError, match="no option 'num_sample'.*did you mean 'num_samples'"):
        load_dataset("synthetic", num_sample=10)
    with pytest.raises(ConfigError, match="num_classes"):
        load_dataset("synthetic", num_classes=1)


def test_digits_loads_sklearn_data():
    ds = load_dataset("digits")
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert len(ds.x_test) == round(0.2 * 1797)
    assert ds.in_shape == (1, 8, 8) and ds.scale == 16.0 and ds.x_train.max() == 16.0
    x = ds.as_tensor(ds.x_train)
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1.0) < 1e-3


def test_unknown_dataset_suggests_a_name():
    with pytest.raises(ConfigError, match="did you mean 'fmnist'"):
        load_dataset("fmnsit")


def test_default_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYFL_DATA", str(tmp_path))
    assert datasets.default_root() == tmp_path
    monkeypatch.delenv("RAYFL_DATA")
    assert datasets.default_root() == Path.home() / ".cache" / "rayfl" / "data"


# --------------------------------------------------------------------------- as_tensor


def make_rgb() -> ArrayDataset:
    x = np.zeros((2, 3, 2, 2), dtype=np.uint8)
    x[0] = 255
    return ArrayDataset(
        "rgb",
        x,
        np.array([0, 1]),
        x.copy(),
        np.array([0, 1]),
        2,
        (0.5, 0.0, 1.0),
        (0.25, 0.5, 2.0),
        255.0,
    )


def test_as_tensor_golden_numbers_per_channel():
    ds = make_rgb()
    out = ds.as_tensor(ds.x_train)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 2, 2)
    # (x/255 - mean)/std per channel, for x = 255 and x = 0.
    assert out[0, :, 0, 0].tolist() == pytest.approx([2.0, 2.0, 0.0])
    assert out[1, :, 1, 1].tolist() == pytest.approx([-2.0, 0.0, -0.5])
    single = ds.as_tensor(ds.x_train[0])
    assert single.shape == (3, 2, 2) and torch.equal(single, out[0])


def test_as_tensor_leaves_read_only_input_untouched():
    ds = make_rgb()
    x = ds.x_train.copy()
    x.setflags(write=False)  # like an array fetched zero-copy from Ray's object store
    before = x.copy()
    out = ds.as_tensor(x[1:])
    out += 1.0
    np.testing.assert_array_equal(x, before)
    with pytest.raises(ValueError, match="expected a sample"):
        ds.as_tensor(np.zeros((2, 1, 2, 2), dtype=np.uint8))


@pytest.mark.slow
def test_importing_rayfl_data_does_not_import_ray_or_mlflow():
    code = "import sys, rayfl.data; print(sorted(m for m in ('ray', 'mlflow') if m in sys.modules))"
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert out.stdout.strip() == "[]"


class _RunsCode:
    """Unpickling this with a plain unpickler would run a shell command (creates `marker`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["system", "eval", "object_array"])
def test_a_cifar_batch_that_needs_more_than_arrays_is_refused_and_runs_nothing(
    tmp_path, monkeypatch, payload
):
    monkeypatch.setattr(datasets, "_download", fail_download)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    evil = {
        "system": _RunsCode(marker),
        "eval": {b"data": eval, b"labels": [0]},
        "object_array": {b"data": np.array([_RunsCode], dtype=object), b"labels": [0]},
    }[payload]
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (folder / name).write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(UserError, match="not an official CIFAR batch") as info:
        load_dataset("cifar10", root=str(tmp_path))
    assert "\n" not in str(info.value)
    assert not marker.exists()

"""Datasets as plain numpy arrays: Fashion-MNIST, MNIST, CIFAR-10/100, Tiny ImageNet, synthetic, digits.

Every loader returns an `ArrayDataset`: uint8 images (N, C, H, W) plus int64 labels, kept in
their compact on-disk dtype. Normalisation happens per batch in `ArrayDataset.as_tensor`, so the
whole dataset is never copied to float32 (a worker can read it zero-copy from Ray's object store).

Loaders read the real on-disk formats themselves (IDX here; CIFAR's python batches, never with
a plain unpickler, the `tiny-imagenet-200` folder and folder trees in `rayfl.data.images`) and
fall back to a torchvision download only when the files are missing. They are registered by name in `DATASETS` and called through
`load_dataset(name, root, **options)`.
"""

from __future__ import annotations

import functools
import gzip
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from rayfl.errors import ConfigError, UserError, suggest
from rayfl.registry import Registry

# Dataset name -> loader; the built-ins are registered here and in `rayfl.data.images`.
DATASETS: Registry[Any] = Registry("dataset", group="rayfl.datasets")

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Debian's `dataset-fashion-mnist` package installs the IDX files here; module-level so tests can
# point it elsewhere.
DEBIAN_DIRS: dict[str, Path] = {
    "fmnist": Path("/usr/share/datasets/fashion-mnist"),
    "mnist": Path("/usr/share/datasets/mnist"),
}


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A dataset held as numpy arrays (inputs (N, C, H, W), uint8 images or float32, int64
    labels; the test set is the dataset's official one), normalised lazily per batch: `(x /
    scale - mean) / std` per channel. `eq=False`: arrays compare by identity."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float

    def __post_init__(self) -> None:
        # Cheap consistency checks that catch a broken loader at load time, not mid-training.
        if self.x_train.ndim < 2 or self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise ValueError(
                f"{self.name}: x_train {self.x_train.shape} and x_test {self.x_test.shape} "
                "must share a per-sample shape"
            )
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError(f"{self.name}: inputs and labels differ in length")
        channels = self.x_train.shape[1]
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(f"{self.name}: mean/std need {channels} entries (one per channel)")

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x_train.shape[1:])

    def as_tensor(self, x: np.ndarray) -> torch.Tensor:
        """A new float32 tensor `(x / scale - mean) / std` per channel, for one sample or a batch.

        `x` is never modified; it may be a read-only, zero-copy view from Ray's object store.
        """
        x = np.asarray(x)
        if x.shape[-len(self.in_shape) :] != self.in_shape or x.ndim > len(self.in_shape) + 1:
            raise ValueError(
                f"{self.name}: expected a sample {self.in_shape} or a batch of them, got {x.shape}"
            )
        # astype always copies, so the in-place ops below never touch the caller's array.
        out = torch.from_numpy(x.astype(np.float32))
        mean = np.asarray(self.mean, dtype=np.float64)
        std = np.asarray(self.std, dtype=np.float64)
        if self.scale == 1.0 and not mean.any() and (std == 1.0).all():
            return out
        # One fused affine map (x * a - b) per channel instead of three passes over the batch.
        view = (-1,) + (1,) * (len(self.in_shape) - 1)
        a = torch.from_numpy((1.0 / (self.scale * std)).astype(np.float32)).view(view)
        b = torch.from_numpy((mean / std).astype(np.float32)).view(view)
        return out.mul_(a).sub_(b)


def default_root() -> Path:
    """The default data directory: `$RAYFL_DATA`, else `~/.cache/rayfl/data`."""
    env = os.environ.get("RAYFL_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rayfl" / "data"


def load_dataset(
    name: str, root: str | os.PathLike[str] | None = None, **options: Any
) -> ArrayDataset:
    """Load the registered dataset `name` from `root` (None: `default_root()`) with its
    loader-specific `options`; a ConfigError for an unknown name or option, a UserError when the
    data cannot be found or downloaded."""
    loader = DATASETS.get(name, key="data.dataset")
    return loader(root=None if root is None else str(root), **options)


# --------------------------------------------------------------------------- helpers


def _root(root: str | None) -> Path:
    return Path(root).expanduser() if root is not None else default_root()


def _check_options(dataset: str, options: dict[str, Any], allowed: Sequence[str] = ()) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        choices = ", ".join(allowed) if allowed else "none"
        raise ConfigError(
            f"data.options: dataset {dataset!r} has no option {unknown[0]!r}"
            f"{suggest(unknown[0], allowed)}; "
            f"its options are: {choices}"
        )


def read_idx(path: str | os.PathLike[str], expected_magic: int | None = None) -> np.ndarray:
    """A writable uint8 array from an IDX file (MNIST's format; `.gz` is decompressed).

    The header is big-endian: two zero bytes, a type code (0x08 = uint8), the number of
    dimensions, then one uint32 per dimension. Images have magic 2051, labels 2049.
    """
    path = Path(path)
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        payload = f.read()
    if len(payload) < 4:
        raise UserError(f"{path} is not an IDX file (too short); re-download it")
    magic = int.from_bytes(payload[:4], "big")
    type_code, ndim = payload[2], payload[3]
    if (
        payload[:2] != b"\x00\x00"
        or type_code != 0x08
        or (expected_magic and magic != expected_magic)
    ):
        raise UserError(
            f"{path} has IDX magic {magic}, expected {expected_magic or 'a uint8 IDX file'}; "
            "the file is corrupt or not an IDX file, re-download it"
        )
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(payload[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(payload) - header != int(np.prod(shape)):
        raise UserError(f"{path} is truncated ({len(payload) - header} bytes for shape {shape})")
    return np.frombuffer(payload, dtype=np.uint8, offset=header).reshape(shape).copy()


_IDX_FILES = {
    "x_train": ("train-images-idx3-ubyte", 2051),
    "y_train": ("train-labels-idx1-ubyte", 2049),
    "x_test": ("t10k-images-idx3-ubyte", 2051),
    "y_test": ("t10k-labels-idx1-ubyte", 2049),
}


def _download(torchvision_class: str, root: Path) -> None:
    """Download a dataset with torchvision into `root` (its own layout under root)."""
    import torchvision  # lazy: only needed when the files are missing

    root.mkdir(parents=True, exist_ok=True)
    getattr(torchvision.datasets, torchvision_class)(str(root), train=True, download=True)


def find_or_download(
    name: str, base: Path, find: Callable[[], T | None], torchvision_class: str, hint: str
) -> T:
    """What `find()` finds of dataset `name`, after a torchvision download into `base` when it
    finds nothing; a UserError ending in `hint` (how to put the files there) otherwise."""
    found = find()
    if found is None:
        logger.info("%s: files not found under %s; downloading with torchvision", name, base)
        try:
            _download(torchvision_class, base)
        except Exception as exc:  # any failure (offline, DNS, checksum) has the same fix
            raise UserError(
                f"{name}: data not found and download failed ({type(exc).__name__}: {exc}); {hint}"
            ) from exc
        found = find()
        if found is None:
            raise UserError(f"{name}: torchvision downloaded no files under {base}; {hint}")
    return found


# Fashion-MNIST (Xiao et al. 2017, 10 clothing classes) and MNIST (digits): 60k/10k 28x28 grey
# images. The IDX files are looked for in Debian's folder, then in `root` (or torchvision's
# layout under it), then downloaded with torchvision.
_IDX_DATASETS = {
    # name: folders under root, torchvision class, Debian package, mean, std
    "fmnist": (("FashionMNIST/raw", "fashion-mnist"), "FashionMNIST", "dataset-fashion-mnist", 0.2860, 0.3530),
    "mnist": (("MNIST/raw", "mnist"), "MNIST", "dataset-mnist", 0.1307, 0.3081),
}  # fmt: skip


def _load_idx_dataset(name: str, root: str | None = None, **options: Any) -> ArrayDataset:
    _check_options(name, options)
    folders, torchvision_class, apt_package, mean, std = _IDX_DATASETS[name]
    base = _root(root)
    candidates = [DEBIAN_DIRS[name], base, *(base / f for f in folders)]

    def find() -> dict[str, Path] | None:
        """The four IDX files (each gz or plain) of the first folder holding them all."""
        for d in candidates:
            plain = {key: d / stem for key, (stem, _) in _IDX_FILES.items()}
            files = {k: p if p.is_file() else p.with_name(f"{p.name}.gz") for k, p in plain.items()}
            if all(p.is_file() for p in files.values()):
                return files
        return None

    hint = (
        f"run `apt-get install {apt_package}` or put the four IDX files (train/t10k-images-idx3-"
        f"ubyte[.gz], train/t10k-labels-idx1-ubyte[.gz]) under {base}"
    )
    files = find_or_download(name, base, find, torchvision_class, hint)
    logger.info("%s: loading IDX files from %s", name, files["x_train"].parent)
    arrays = {key: read_idx(path, _IDX_FILES[key][1]) for key, path in files.items()}
    return ArrayDataset(
        name=name,
        x_train=arrays["x_train"][:, None],  # (N, 28, 28) -> (N, 1, 28, 28), a view
        y_train=arrays["y_train"].astype(np.int64),
        x_test=arrays["x_test"][:, None],
        y_test=arrays["y_test"].astype(np.int64),
        num_classes=10,
        mean=(mean,),
        std=(std,),
        scale=255.0,
    )


for _name in _IDX_DATASETS:
    DATASETS.add(_name, functools.partial(_load_idx_dataset, _name))


# --------------------------------------------------------------------------- small test data


@DATASETS.register("synthetic")
def load_synthetic(
    root: str | None = None,
    *,
    num_samples: int = 2000,
    num_test: int = 500,
    num_classes: int = 10,
    shape: Sequence[int] = (1, 8, 8),
    seed: int = 0,
    **options: Any,
) -> ArrayDataset:
    """Seeded Gaussian blobs: fast, learnable data for tests and smoke runs.

    Each class has its own mean vector (drawn once from `N(0, 1)`); samples are that mean plus
    unit Gaussian noise, so a linear model separates the classes well. Float32, already
    normalised. `root` is ignored; `shape` is one sample's, channels first.
    """
    _check_options(
        "synthetic", options, ("num_samples", "num_test", "num_classes", "shape", "seed")
    )
    shape = tuple(int(d) for d in shape)
    if num_samples < 1 or num_test < 1:
        raise ConfigError("data.options: synthetic num_samples and num_test must be >= 1")
    if num_classes < 2:
        raise ConfigError("data.options.num_classes: synthetic needs at least 2 classes")
    if not shape or min(shape) < 1:
        raise ConfigError(
            f"data.options.shape: {shape} must be a non-empty tuple of positive sizes"
        )
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(num_classes, *shape)).astype(np.float32)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, num_classes, size=n).astype(np.int64)
        x = rng.normal(size=(n, *shape)).astype(np.float32)
        x += means[y]
        return x, y

    x_train, y_train = draw(num_samples)
    x_test, y_test = draw(num_test)
    zeros, ones = (0.0,) * shape[0], (1.0,) * shape[0]
    return ArrayDataset(
        "synthetic", x_train, y_train, x_test, y_test, num_classes, zeros, ones, 1.0
    )


@DATASETS.register("digits")
def load_digits(
    root: str | None = None, *, test_fraction: float = 0.2, seed: int = 0, **options: Any
) -> ArrayDataset:
    """scikit-learn's bundled 8x8 digits (1,797 images, values 0..16): tiny real data for tests.

    There is no official test split, so a seeded `test_fraction` of the images becomes the test
    set. `root` is ignored.
    """
    _check_options("digits", options, ("test_fraction", "seed"))
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"data.options.test_fraction: {test_fraction} must be in (0, 1)")
    from sklearn.datasets import load_digits as sk_load_digits  # lazy: sklearn is heavy

    bunch = sk_load_digits()
    x = bunch.images.astype(np.float32)[:, None]  # (1797, 1, 8, 8), values 0..16
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = round(test_fraction * len(y))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    # Statistics of the training split itself (about 0.30 / 0.38 after scaling by 16).
    scaled = x[train] / 16.0
    mean, std = (float(scaled.mean()),), (float(scaled.std()),)
    return ArrayDataset("digits", x[train], y[train], x[test], y[test], 10, mean, std, 16.0)

"""Image datasets read from the files users download: CIFAR-10/100's python batches, Tiny
ImageNet's `tiny-imagenet-200` folder, and multi-domain folder trees (`folder`).

CIFAR's batches are pickles and a data folder can be untrusted (docs/security.md), so they are
read without a plain unpickler: only the types the official files hold are admitted
(`_BatchUnpickler`). Tiny ImageNet's JPEGs are decoded once and cached next to the folder.

The `folder` dataset reads `data.root/<domain>/<class>/*.png|jpg`, the layout of PACS,
Office-31, Office-Home and DomainNet (docs/data.md), and keeps each sample's domain for
`rayfl.data.domains`. Its classes are the sorted union of the class folders over the domains (a
domain may lack a class); a seeded `test_fraction` of each domain's images is the server test
set; mean and std are the training split's, per channel.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from rayfl.data.datasets import DATASETS, ArrayDataset, _check_options, _root, find_or_download
from rayfl.errors import ConfigError, UserError

logger = logging.getLogger(__name__)


def _read_image(path: Path, height: int, width: int, channels: int) -> np.ndarray:
    """One image file as uint8 (C, H, W), grey (`channels` 1) or RGB (a grey image becomes
    three-channel), resized bilinearly; a UserError for a file PIL cannot read."""
    try:
        with Image.open(path) as opened:
            im = opened.convert("RGB" if channels == 3 else "L")
            arr = np.asarray(im.resize((width, height), Image.Resampling.BILINEAR), np.uint8)
    except (OSError, UnidentifiedImageError) as exc:
        raise UserError(f"{path}: not a readable image ({exc}); remove it") from None
    return arr[None] if channels == 1 else arr.transpose(2, 0, 1)


# --------------------------------------------------------------------------- CIFAR-10/100


class _BatchUnpickler(pickle.Unpickler):
    """Admits only what the official batches hold: dicts, lists, bytes, str and ints (the
    pickle opcodes for those need no import; bytes written by Python 3 come as latin1 text)
    and numpy arrays, rebuilt by the three numpy callables below. Any other global (``os.system``, ``builtins.eval``...) is refused, so a
    crafted file cannot run code (the "Restricting Globals" recipe of the pickle docs)."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):
            return _latin1  # how Python 3 writes bytes at protocol 2 (the tests' batches)
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError("only latin1 bytes are allowed")
    return text.encode("latin1")


def _unpickle(path: Path) -> dict[Any, Any]:
    """One batch file, through the restricted unpickler; a file that needs anything else, or
    is not a dict, is a one-line UserError."""
    try:
        with open(path, "rb") as f:
            # The official batches were pickled by Python 2; "bytes" keeps their keys as b"data".
            batch = _BatchUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise UserError(
            f"{path}: not an official CIFAR batch ({exc}); rayfl loads no Python objects from "
            "data files: re-download the python version of the dataset"
        ) from None
    if not isinstance(batch, dict):
        raise UserError(f"{path}: not an official CIFAR batch; re-download it")
    return batch


def _field(batch: dict[Any, Any], key: str) -> Any:
    if key.encode() in batch:
        return batch[key.encode()]
    if key in batch:
        return batch[key]
    raise UserError(f"CIFAR batch has no {key!r} entry; the file is corrupt, re-download it")


def _read_cifar_batches(paths: Sequence[Path], label_key: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for path in paths:
        batch = _unpickle(path)
        # Rows are 3072 bytes: the red plane, then green, then blue, each 32x32 row-major.
        xs.append(np.asarray(_field(batch, "data"), dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(_field(batch, label_key), dtype=np.int64))
    x = xs[0] if len(xs) == 1 else np.concatenate(xs)
    return np.ascontiguousarray(x, dtype=np.uint8), np.concatenate(ys)


_CIFAR = {
    # name: folder, train files, test files, label key, torchvision class, classes, mean, std
    "cifar10": ("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",),
                "labels", "CIFAR10", 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("cifar-100-python", ("train",), ("test",),
                 "fine_labels", "CIFAR100", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}  # fmt: skip


def _load_cifar(name: str, root: str | None = None, **options: Any) -> ArrayDataset:
    """CIFAR-10 or CIFAR-100 (fine labels): 50k/10k 32x32 RGB images from `root/<folder>`."""
    _check_options(name, options)
    folder, train_files, test_files, label_key, tv_class, classes, mean, std = _CIFAR[name]
    base = _root(root)

    def find() -> Path | None:
        for d in (base / folder, base):
            if all((d / f).is_file() for f in (*train_files, *test_files)):
                return d
        return None

    hint = f"put the extracted python version ({folder}/ with {', '.join(train_files + test_files)}) under {base}"
    directory = find_or_download(name, base, find, tv_class, hint)
    logger.info("%s: loading %s", name, directory)
    x_train, y_train = _read_cifar_batches([directory / f for f in train_files], label_key)
    x_test, y_test = _read_cifar_batches([directory / f for f in test_files], label_key)
    return ArrayDataset(name, x_train, y_train, x_test, y_test, classes, mean, std, 255.0)


for _name in _CIFAR:
    DATASETS.add(_name, functools.partial(_load_cifar, _name))


# --------------------------------------------------------------------------- Tiny ImageNet

TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"

# Bump when the layout of the Tiny ImageNet cache changes, so stale caches are rebuilt.
_TINY_CACHE_VERSION = 1


def _decode_tinyimagenet(folder: Path, size: int = 64) -> dict[str, np.ndarray]:
    wnids = sorted(
        line.strip() for line in (folder / "wnids.txt").read_text().splitlines() if line.strip()
    )
    label_of = {wnid: i for i, wnid in enumerate(wnids)}
    train: list[tuple[Path, int]] = []
    for wnid in wnids:
        images = sorted((folder / "train" / wnid / "images").glob("*.JPEG"))
        if not images:
            raise UserError(
                f"tinyimagenet: no images in {folder / 'train' / wnid / 'images'}; re-extract it"
            )
        train.extend((p, label_of[wnid]) for p in images)
    val: list[tuple[Path, int]] = []
    for line in (folder / "val" / "val_annotations.txt").read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            val.append((folder / "val" / "images" / parts[0], label_of[parts[1]]))

    def decode(items: list[tuple[Path, int]]) -> tuple[np.ndarray, np.ndarray]:
        # Decode straight into the final uint8 array: no per-image list, no float copies.
        x = np.empty((len(items), 3, size, size), dtype=np.uint8)
        for i, (path, _) in enumerate(items):
            x[i] = _read_image(path, size, size, 3)
        return x, np.array([label for _, label in items], dtype=np.int64)

    logger.info(
        "tinyimagenet: decoding %d train and %d val JPEGs (cached afterwards)", len(train), len(val)
    )
    x_train, y_train = decode(train)
    x_test, y_test = decode(val)
    return {
        "x_train": x_train,
        "y_train": y_train,
        "x_test": x_test,
        "y_test": y_test,
        "wnids": np.array(wnids),
        "version": np.array(_TINY_CACHE_VERSION),
    }


@DATASETS.register("tinyimagenet")
def load_tinyimagenet(root: str | None = None, **options: Any) -> ArrayDataset:
    """Tiny ImageNet: 100k train / 10k val 64x64 RGB images of 200 classes.

    Reads the standard `tiny-imagenet-200` folder under `root` (the labelled `val` split is the
    test set; `test` has no labels). Classes are numbered in sorted wnid order. The decoded
    arrays are cached as `root/tiny-imagenet-200.npz`, so only the first load decodes JPEGs.
    """
    _check_options("tinyimagenet", options)
    base = _root(root)
    folder = base if base.name == "tiny-imagenet-200" else base / "tiny-imagenet-200"
    cache = folder.with_suffix(".npz")
    arrays: dict[str, np.ndarray] | None = None
    if cache.is_file():
        with np.load(cache) as npz:
            if int(npz["version"]) == _TINY_CACHE_VERSION:
                arrays = {k: npz[k] for k in npz.files}
                logger.info("tinyimagenet: loaded cache %s", cache)
    if arrays is None:
        if not (folder / "wnids.txt").is_file():
            raise UserError(
                f"tinyimagenet: {folder} not found; download {TINYIMAGENET_URL} and unzip it "
                f"into {folder.parent} (set data.root or $RAYFL_DATA to use another directory)"
            )
        arrays = _decode_tinyimagenet(folder)
        try:
            # Write to a temporary name and rename, so a concurrent reader never sees half a file.
            tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npz")
            named: dict[str, Any] = dict(arrays)  # savez's stubs mistype **kwds
            np.savez(tmp, **named)
            os.replace(tmp, cache)
        except OSError as exc:
            logger.warning(
                "tinyimagenet: could not write cache %s (%s); decoding again next time", cache, exc
            )
    return ArrayDataset(
        name="tinyimagenet",
        x_train=arrays["x_train"],
        y_train=arrays["y_train"].astype(np.int64),
        x_test=arrays["x_test"],
        y_test=arrays["y_test"].astype(np.int64),
        num_classes=len(arrays["wnids"]),
        mean=(0.4802, 0.4481, 0.3975),
        std=(0.2770, 0.2691, 0.2821),
        scale=255.0,
    )


# --------------------------------------------------------------------------- folder trees

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


@dataclass(frozen=True, eq=False)
class MultiDomainDataset(ArrayDataset):
    """An `ArrayDataset` with each sample's domain: an int64 index into `domain_names`."""

    domain_names: tuple[str, ...]
    domain_train: np.ndarray
    domain_test: np.ndarray

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.domain_train) != len(self.y_train) or len(self.domain_test) != len(self.y_test):
            raise ValueError(f"{self.name}: one domain index per sample is needed")


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def read_tree(
    root: Path, size: tuple[int, int], channels: int, domains: Sequence[str] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...], tuple[str, ...]]:
    """(images (N, C, H, W) uint8, labels, domain indices, domain names, class names) of a tree;
    a UserError for no domain folder, no image, or an image PIL cannot read."""
    if not root.is_dir():
        raise UserError(f"data.root: {root} is not a folder; point it at root/<domain>/<class>/")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    names = tuple(domains) if domains else tuple(found)
    missing = [d for d in names if d not in found]
    if missing:
        raise ConfigError(
            f"data.options.domains: {missing[0]!r} is not a folder of {root}; "
            f"its domains are: {', '.join(found) or 'none'}"
        )
    if not names:
        raise UserError(f"data.root: {root} has no domain folders (root/<domain>/<class>/*.png)")
    classes = tuple(sorted({c.name for d in names for c in (root / d).iterdir() if c.is_dir()}))
    xs, ys, ds = [], [], []
    for d, name in enumerate(names):
        for label, cls in enumerate(classes):
            folder = root / name / cls
            for path in _images(folder) if folder.is_dir() else []:
                xs.append(_read_image(path, size[0], size[1], channels))
                ys.append(label)
                ds.append(d)
    if not xs:
        raise UserError(f"data.root: {root} holds no images under <domain>/<class>/")
    return (
        np.stack(xs),
        np.asarray(ys, dtype=np.int64),
        np.asarray(ds, dtype=np.int64),
        names,
        classes,
    )


@DATASETS.register("folder")
def load_folder(
    root: str | None = None,
    *,
    size: Sequence[int] = (32, 32),
    channels: int = 3,
    test_fraction: float = 0.2,
    seed: int = 0,
    domains: Sequence[str] | None = None,
    **options: Any,
) -> MultiDomainDataset:
    """Images in `data.root/<domain>/<class>/`, resized to `size` (height, width), RGB or grey
    (`channels` 3 or 1); a seeded `test_fraction` of each domain's images is the server test
    set (the seed defines the data, like `digits`' split). `domains`: the folders to read."""
    _check_options("folder", options, ("size", "channels", "test_fraction", "seed", "domains"))
    if root is None:
        raise ConfigError(
            "data.root: the folder dataset needs data.root=<folder with one folder per domain>"
        )
    shape = tuple(int(s) for s in size)
    if len(shape) != 2 or min(shape) < 1:
        raise ConfigError(f"data.options.size: {list(size)} must be [height, width], both >= 1")
    if channels not in (1, 3):
        raise ConfigError(f"data.options.channels: {channels} must be 1 or 3")
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"data.options.test_fraction: {test_fraction} must be in (0, 1)")
    base = Path(root).expanduser()
    x, y, dom, names, classes = read_tree(base, (shape[0], shape[1]), channels, domains)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for d in range(len(names)):
        members = rng.permutation(np.flatnonzero(dom == d))
        test[members[: round(test_fraction * len(members))]] = True
    train = ~test
    if not train.any() or not test.any():
        raise UserError(f"{base}: too few images for a train and a test split")
    scaled = x[train].astype(np.float64) / 255.0
    mean = tuple(float(m) for m in scaled.mean(axis=(0, 2, 3)))
    std = tuple(max(float(s), 1e-6) for s in scaled.std(axis=(0, 2, 3)))
    logger.info("folder %s: %d images, %d classes, domains %s", base, len(y), len(classes), names)
    return MultiDomainDataset(
        name="folder",
        x_train=x[train],
        y_train=y[train],
        x_test=x[test],
        y_test=y[test],
        num_classes=len(classes),
        mean=mean,
        std=std,
        scale=255.0,
        domain_names=names,
        domain_train=dom[train],
        domain_test=dom[test],
    )

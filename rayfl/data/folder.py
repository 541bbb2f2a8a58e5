"""Multi-domain image folders: `root/<domain>/<class>/*.png|jpg`, the layout users download.

PACS, Office-31, Office-Caltech-10, Office-Home and DomainNet's extracted archives all unpack
to one folder per domain holding one folder per class. The `folder` dataset reads such a tree
(`data.root` is the folder holding the domains), resizes every image to `size` with PIL, and
keeps each sample's domain, so `data.domains` puts each client in one of the dataset's own
domains and partitions that domain's samples among its clients (`rayfl.data.domains`).

The classes are the sorted union of the class folders over the domains (a domain may lack a
class). These datasets have no official test split: a seeded `test_fraction` of each domain's
images is the server test set. Mean and std are the training split's, per channel.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayfl.data.datasets import DATASETS, ArrayDataset, _check_options
from rayfl.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

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
    from PIL import Image, UnidentifiedImageError

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
    mode = "RGB" if channels == 3 else "L"
    xs, ys, ds = [], [], []
    for d, name in enumerate(names):
        for label, cls in enumerate(classes):
            folder = root / name / cls
            for path in _images(folder) if folder.is_dir() else []:
                try:
                    with Image.open(path) as opened:
                        im = opened.convert(mode).resize(
                            (size[1], size[0]), Image.Resampling.BILINEAR
                        )
                        arr = np.asarray(im, dtype=np.uint8)
                except (OSError, UnidentifiedImageError) as exc:
                    raise UserError(f"{path}: not a readable image ({exc}); remove it") from None
                xs.append(arr[None] if channels == 1 else arr.transpose(2, 0, 1))
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

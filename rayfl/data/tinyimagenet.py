"""Tiny ImageNet from the standard `tiny-imagenet-200` folder, decoded once and cached."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from rayfl.data import datasets
from rayfl.data.datasets import DATASETS, ArrayDataset
from rayfl.errors import UserError

logger = logging.getLogger(__name__)

TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"

# Bump when the layout of the Tiny ImageNet cache changes, so stale caches are rebuilt.
_TINY_CACHE_VERSION = 1


def _read_jpeg(path: Path, size: int) -> np.ndarray:
    from PIL import Image  # lazy: Pillow comes with torchvision

    with Image.open(path) as img:
        # About 2% of Tiny ImageNet is greyscale; every image becomes 3-channel RGB.
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


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
            x[i] = _read_jpeg(path, size)
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
    datasets._check_options("tinyimagenet", options)
    base = datasets._root(root)
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

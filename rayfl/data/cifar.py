"""CIFAR-10 and CIFAR-100 from the official python batches (`cifar-10-batches-py`,
`cifar-100-python`), read without a plain unpickler: the batches are pickles, and a data
folder can be untrusted (docs/security.md), so only the types the official files hold are
admitted (`_BatchUnpickler`)."""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rayfl.data import datasets
from rayfl.data.datasets import DATASETS, ArrayDataset
from rayfl.errors import UserError

logger = logging.getLogger(__name__)


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
    datasets._check_options(name, options)
    folder, train_files, test_files, label_key, tv_class, classes, mean, std = _CIFAR[name]
    base = datasets._root(root)

    def find() -> Path | None:
        for d in (base / folder, base):
            if all((d / f).is_file() for f in (*train_files, *test_files)):
                return d
        return None

    hint = f"put the extracted python version ({folder}/ with {', '.join(train_files + test_files)}) under {base}"
    directory = datasets.find_or_download(name, base, find, tv_class, hint)
    logger.info("%s: loading %s", name, directory)
    x_train, y_train = _read_cifar_batches([directory / f for f in train_files], label_key)
    x_test, y_test = _read_cifar_batches([directory / f for f in test_files], label_key)
    return ArrayDataset(name, x_train, y_train, x_test, y_test, classes, mean, std, 255.0)


for _name in _CIFAR:
    DATASETS.add(_name, functools.partial(_load_cifar, _name))

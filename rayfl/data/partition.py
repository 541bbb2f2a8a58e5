"""Partitioners: pure functions from labels to one index array per client.

Every partitioner has the signature
`fn(labels, num_clients, seed, **options) -> list[np.ndarray]` and returns sorted int64 index
arrays into `labels`, pairwise disjoint. `iid`, `dirichlet` and `quantity` cover every index;
`pathological` covers the classes it assigns. The same seed gives the same partition.
They are registered in `PARTITIONERS`, and named in configs as
`data.partition.name`, with options under `data.partition.<option>`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from rayfl.errors import ConfigError, UserError
from rayfl.registry import Registry

# Partitioner name -> function splitting the labels into client index sets.
PARTITIONERS: Registry[Any] = Registry("partitioner")

logger = logging.getLogger(__name__)

# Resampling budget for `dirichlet`: enough for hard-but-feasible settings (alpha 0.1, 100
# clients on Fashion-MNIST needs about 20 draws); beyond it the options are effectively impossible.
MAX_DIRICHLET_TRIES = 1000


def _check_common(labels: np.ndarray, num_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ConfigError(f"data.num_clients: {num_clients} must be a positive integer")
    if num_clients > len(labels):
        raise UserError(
            f"data.num_clients: {num_clients} clients but only {len(labels)} samples; "
            "use fewer clients or more data (data.train_samples)"
        )
    return labels


def _check_alpha(alpha: float, min_samples: int, num_clients: int, n: int) -> float:
    """The Dirichlet options of `dirichlet` and `quantity`, checked; `alpha` as a float."""
    if not np.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"data.partition.alpha: {alpha} must be a positive number (e.g. 0.5)")
    if int(min_samples) != min_samples or min_samples < 0:
        raise ConfigError(f"data.partition.min_samples: {min_samples} must be an integer >= 0")
    if num_clients * min_samples > n:
        raise UserError(
            f"data.partition.min_samples: {num_clients} clients x {min_samples} samples exceeds the "
            f"{n} samples; lower min_samples or use fewer clients"
        )
    return float(alpha)


def _sorted(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


@PARTITIONERS.register("iid")
def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle the indices and deal them out in equal parts (sizes differ by at most one).

    >>> import numpy as np
    >>> parts = iid(np.zeros(10, dtype=np.int64), num_clients=3, seed=0)
    >>> [len(p) for p in parts]
    [4, 3, 3]
    >>> sorted(np.concatenate(parts).tolist()) == list(range(10))
    True
    """
    labels = _check_common(labels, num_clients)
    order = np.random.default_rng(seed).permutation(len(labels))
    return _sorted(np.array_split(order, num_clients))


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray, num_clients: int, seed: int, *, alpha: float, min_samples: int = 10
) -> list[np.ndarray]:
    """Label skew: each class is split over clients by proportions drawn from `Dir(alpha)`.

    The method of Hsu et al. 2019 ("Measuring the effects of non-identical data distribution"),
    as used by NIID-Bench and Flower Datasets' `DirichletPartitioner`. Small `alpha` (0.1) gives
    clients a few dominant classes; large `alpha` (100) approaches iid. The whole draw is
    repeated (at most `MAX_DIRICHLET_TRIES` times) until every client has `min_samples`.

        >>> import numpy as np
        >>> labels = np.repeat(np.arange(4), 50)
        >>> parts = dirichlet(labels, num_clients=4, seed=0, alpha=0.5, min_samples=5)
        >>> len(parts), sum(len(p) for p in parts)
        (4, 200)
        >>> min(len(p) for p in parts) >= 5
        True
    """
    labels = _check_common(labels, num_clients)
    alpha = _check_alpha(alpha, min_samples, num_clients, len(labels))
    rng = np.random.default_rng(seed)
    # Stable sort groups indices by class once; each class is then a contiguous block.
    classes, counts = np.unique(labels, return_counts=True)
    by_class = np.split(np.argsort(labels, kind="stable"), np.cumsum(counts)[:-1])
    cuts: list[np.ndarray] | None = None
    for attempt in range(1, MAX_DIRICHLET_TRIES + 1):
        # Only the per-class cut points are drawn per attempt: cheap, so rejection is affordable.
        draw = []
        sizes = np.zeros(num_clients, dtype=np.int64)
        for count in counts:
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            edges = (np.cumsum(proportions)[:-1] * count).astype(np.int64)
            draw.append(edges)
            sizes += np.diff(edges, prepend=0, append=count)
        if sizes.min() >= min_samples:
            cuts = draw
            logger.debug("dirichlet partition accepted after %d draw(s)", attempt)
            break
    if cuts is None:
        raise UserError(
            f"data.partition: dirichlet(alpha={alpha}) gave some client fewer than {min_samples} "
            f"samples in {MAX_DIRICHLET_TRIES} draws; raise data.partition.alpha, lower "
            "data.partition.min_samples or use fewer clients"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for members, edges in zip(by_class, cuts):
        for client, chunk in enumerate(np.split(rng.permutation(members), edges)):
            parts[client].append(chunk)
    return _sorted([np.concatenate(p) for p in parts])


def _assign_classes(
    num_clients: int, classes: np.ndarray, k: int, rng: np.random.Generator
) -> np.ndarray:
    """A (num_clients, k) table of distinct classes per client, each class used equally often."""
    num_classes = len(classes)
    slots = num_clients * k
    # Each class fills floor(slots / C) slots; a random subset of classes fills one more.
    order = rng.permutation(num_classes)
    pool = np.concatenate([np.tile(order, slots // num_classes), order[: slots % num_classes]])
    # A random deal gives varied class combinations; it is retried until no client holds a class
    # twice. When that is unlikely (k close to C), the cyclic deal below is always valid.
    for _ in range(100):
        table = rng.permutation(pool).reshape(num_clients, k)
        if all(len(set(row.tolist())) == k for row in table):
            return classes[table]
    cyclic = order[(np.arange(num_clients)[:, None] * k + np.arange(k)) % num_classes]
    return classes[cyclic]


@PARTITIONERS.register("pathological")
def pathological(
    labels: np.ndarray, num_clients: int, seed: int, *, classes_per_client: int = 2
) -> list[np.ndarray]:
    """Pathological label skew: every client holds exactly `classes_per_client` classes.

    The shard method of McMahan et al. 2017 (FedAvg): sort by label, cut each class into
    shards, give each client the shards of k distinct classes. Classes are dealt so each one goes
    to the same number of clients (+-1), and a class's samples are shuffled and split equally
    among its clients. With 10 clients, k=2 and 10 classes, every class goes to 2 clients. If
    `num_clients * k` is smaller than the number of classes, some classes are left unused.

        >>> import numpy as np
        >>> labels = np.repeat(np.arange(10), 20)
        >>> parts = pathological(labels, num_clients=10, seed=0, classes_per_client=2)
        >>> [len(np.unique(labels[p])) for p in parts]
        [2, 2, 2, 2, 2, 2, 2, 2, 2, 2]
        >>> sorted(np.concatenate(parts).tolist()) == list(range(200))
        True
    """
    labels = _check_common(labels, num_clients)
    classes = np.unique(labels)
    k = classes_per_client
    if int(k) != k or not 1 <= k <= len(classes):
        raise ConfigError(
            f"data.partition.classes_per_client: {k} must be between 1 and the number of "
            f"classes present ({len(classes)})"
        )
    rng = np.random.default_rng(seed)
    table = _assign_classes(num_clients, classes, int(k), rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls in classes:
        holders = np.flatnonzero((table == cls).any(axis=1))
        if len(holders) == 0:
            continue
        members = rng.permutation(np.flatnonzero(labels == cls))
        if len(members) < len(holders):
            raise UserError(
                f"data.partition: class {cls} has {len(members)} samples for {len(holders)} clients; "
                "lower data.partition.classes_per_client or use fewer clients"
            )
        for client, shard in zip(holders, np.array_split(members, len(holders))):
            parts[client].append(shard)
    return _sorted([np.concatenate(p) for p in parts])


@PARTITIONERS.register("quantity")
def quantity(
    labels: np.ndarray, num_clients: int, seed: int, *, alpha: float = 1.0, min_samples: int = 1
) -> list[np.ndarray]:
    """Quantity skew: client sizes follow `Dir(alpha)` proportions, labels stay iid.

    Each client first gets `min_samples`; the rest is dealt by proportions drawn from
    `Dir(alpha)` (NIID-Bench's quantity-based label-iid split). Small `alpha` gives a few large
    clients and many small ones.

        >>> import numpy as np
        >>> parts = quantity(np.zeros(100, dtype=np.int64), num_clients=4, seed=0, alpha=0.5)
        >>> sum(len(p) for p in parts), min(len(p) for p in parts) >= 1
        (100, True)
    """
    labels = _check_common(labels, num_clients)
    n = len(labels)
    alpha = _check_alpha(alpha, min_samples, num_clients, n)
    rng = np.random.default_rng(seed)
    rest = n - num_clients * min_samples
    edges = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha)))[:-1] * rest).astype(np.int64)
    sizes = np.diff(edges, prepend=0, append=rest) + min_samples
    order = rng.permutation(n)
    return _sorted(np.split(order, np.cumsum(sizes)[:-1]))

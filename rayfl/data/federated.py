"""A federation: which training samples each client holds, its local test split, the public split.

`build_federation` turns a dataset and a partitioner name into index arrays (never copies of
the data), deterministically in the seed. `save_partition` writes them as Parquet so a run's
split can be inspected and reproduced (`rayfl.tracking.plots.plot_class_counts` draws it).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayfl.data.datasets import ArrayDataset, load_dataset
from rayfl.data.domains import plan_for
from rayfl.data.partition import PARTITIONERS
from rayfl.errors import ConfigError, suggest
from rayfl.gate import write_with
from rayfl.seeding import Purpose, rng_of, words

if TYPE_CHECKING:
    from rayfl.schema import DomainsConfig, RunConfig

logger = logging.getLogger(__name__)

PARTITION_FILE = "partition.parquet"
CLASS_COUNTS_FILE = "class_counts.parquet"
# Rows of the public split carry this client id in partition.parquet / class_counts.parquet.
PUBLIC_CLIENT = -1
# A client's splits, in the order partition.parquet lists them ("val" only when some client has one).
SPLITS = ("train", "test", "val")


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """One client's data, as sorted int64 indices into `dataset.x_train`: `test` and `val`
    (`data.val_fraction`, carved from the training samples; rounds and hyperparameters are
    chosen on it, never on `test`) have the label distribution of `train`."""

    train: np.ndarray
    test: np.ndarray
    val: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @property
    def num_samples(self) -> int:
        """Training samples (the usual aggregation weight)."""
        return len(self.train)


@dataclass(frozen=True, eq=False)
class Federation:
    """A dataset split over clients (in client-id order), plus a `public` split no client holds
    (distillation, FedMD); each client's domain name (`data.domains`) or None, and the clients
    of a held-out domain (`eval_only`: evaluated, never sampled for training)."""

    dataset: ArrayDataset
    clients: tuple[ClientSplit, ...]
    public: np.ndarray
    client_domain: tuple[str, ...] | None = None
    eval_only: tuple[int, ...] = ()

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def has_val(self) -> bool:
        return any(len(c.val) for c in self.clients)

    def class_counts(self, split: str = "train") -> np.ndarray:
        """(num_clients, num_classes) int64 label histogram of one split of every client."""
        if split not in SPLITS:
            raise ValueError(f"split must be 'train', 'test' or 'val', not {split!r}")
        labels = self.dataset.y_train
        c = self.dataset.num_classes
        rows = [np.bincount(labels[getattr(s, split)], minlength=c) for s in self.clients]
        return np.stack(rows).astype(np.int64) if rows else np.zeros((0, c), dtype=np.int64)


def _check_partition_options(name: str, fn: Any, options: dict[str, Any]) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for key in options:
        if key not in accepted:
            raise ConfigError(
                f"data.partition.{key}: partitioner {name!r} has no option {key!r}"
                f"{suggest(key, accepted)}; its options are: {', '.join(accepted) or 'none'}"
            )


def _stratified_test_count(counts: np.ndarray, test_fraction: float) -> np.ndarray:
    """Per-class test counts summing to round(test_fraction * total), by largest remainder."""
    total = int(counts.sum())
    # At least one training sample must remain, so the client can train at all.
    n_test = min(round(test_fraction * total), total - 1)
    quota = counts * test_fraction
    base = np.minimum(np.floor(quota).astype(np.int64), counts)
    short = n_test - int(base.sum())
    if short > 0:
        # Largest fractional parts first; ties to the lower class id (stable sort) for determinism.
        frac = np.where(base < counts, quota - base, -1.0)
        base[np.argsort(-frac, kind="stable")[:short]] += 1
    elif short < 0:
        # Only when rounding down to keep a training sample: take from the largest test counts.
        for cls in np.argsort(-base, kind="stable")[:-short]:
            base[cls] -= 1
    return base


def _split_client(
    indices: np.ndarray, labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> ClientSplit:
    client_labels = labels[indices]
    classes, inverse, counts = np.unique(client_labels, return_inverse=True, return_counts=True)
    n_test = _stratified_test_count(counts, test_fraction)
    train, test = [], []
    for i in range(len(classes)):
        members = rng.permutation(indices[inverse == i])
        test.append(members[: n_test[i]])
        train.append(members[n_test[i] :])
    empty = np.empty(0, dtype=np.int64)
    return ClientSplit(
        train=np.sort(np.concatenate(train or [empty])).astype(np.int64),
        test=np.sort(np.concatenate(test or [empty])).astype(np.int64),
    )


def _carve_val(
    split: ClientSplit, labels: np.ndarray, fraction: float, seed: int, cid: int
) -> ClientSplit:
    """`split` with a stratified `fraction` of its training samples moved to `val` (at least one
    training sample stays), drawn from the client's own validation stream, so the train/test
    split is the one `val_fraction=0` gives and other clients' draws do not matter."""
    rng = rng_of(words(Purpose.DATA_VAL, seed, client=cid))
    carved = _split_client(split.train, labels, fraction, rng)
    return replace(split, train=carved.train, val=carved.test)


def build_federation(
    dataset: ArrayDataset,
    *,
    num_clients: int,
    partitioner: str,
    partition_options: dict[str, Any],
    seed: int,
    test_fraction: float = 0.2,
    public_fraction: float = 0.0,
    train_samples: int | None = None,
    domains: DomainsConfig | None = None,
    val_fraction: float = 0.0,
) -> Federation:
    """Split `dataset.x_train` over clients, deterministically in `seed` (index arrays only), in
    the numbered steps below. Each step draws its own stream (`rayfl.seeding`), so
    `val_fraction=0` leaves the splits as they were, and the split is the same for every
    algorithm."""
    n = len(dataset.y_train)
    for key, value in [("test", test_fraction), ("public", public_fraction), ("val", val_fraction)]:
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"data.{key}_fraction: {value} must be in [0, 1)")
    fn = PARTITIONERS.get(partitioner, key="data.partition.name")
    options = dict(partition_options or {})
    _check_partition_options(partitioner, fn, options)

    # (1) the training subset
    if train_samples is None:
        pool = np.arange(n, dtype=np.int64)
    else:
        if int(train_samples) != train_samples or not 1 <= train_samples <= n:
            raise ConfigError(
                f"data.train_samples: {train_samples} must be an integer between 1 and the "
                f"{n} training samples of {dataset.name}"
            )
        pool = np.sort(
            rng_of(words(Purpose.DATA_SUBSET, seed)).choice(n, int(train_samples), replace=False)
        )

    # (2) the public split
    order = rng_of(words(Purpose.DATA_PUBLIC, seed)).permutation(pool)
    n_public = round(public_fraction * len(pool))
    public = np.sort(order[:n_public]).astype(np.int64)
    private = np.sort(order[n_public:]).astype(np.int64)

    # (3) the partition (per domain for a dataset with its own), over positions in `private`,
    # mapped back to dataset indices
    plan = plan_for(domains, dataset, num_clients)
    if plan is None:
        parts = fn(dataset.y_train[private], num_clients, seed, **options)
    else:
        own = getattr(dataset, "domain_train", None)
        domain_of = None if own is None else own[private]
        parts = plan.partition(fn, dataset.y_train[private], domain_of, seed, options)

    # (4) per-client train/test split stratified by class (>= 1 train sample stays); each client
    # has its own stream so one client's split does not depend on the others'.
    clients = tuple(
        _split_client(
            private[part],
            dataset.y_train,
            test_fraction,
            rng_of(words(Purpose.DATA_SPLIT, seed, client=cid)),
        )
        for cid, part in enumerate(parts)
    )
    # (5) the validation splits, out of the training splits
    if val_fraction > 0:
        clients = tuple(
            _carve_val(c, dataset.y_train, val_fraction, seed, cid) for cid, c in enumerate(clients)
        )
    fed = Federation(dataset=dataset, clients=clients, public=public)
    if plan is not None:  # the inputs' feature shift, once, on copies of the arrays
        samples = [np.concatenate([c.train, c.test]) for c in clients]
        shifted, client_domain, eval_only = plan.apply(dataset, samples, seed)
        fed = replace(fed, dataset=shifted, client_domain=client_domain, eval_only=eval_only)
    sizes = [c.num_samples for c in clients]
    logger.info("%s: %d clients (%s), train sizes %d..%d, %d public", dataset.name, len(clients),
                partitioner, min(sizes), max(sizes), len(public))  # fmt: skip
    return fed


def prepare_federation(cfg: RunConfig) -> Federation:
    """The dataset split into clients, with the partition settings its partitioner accepts."""
    p = cfg.data.partition
    accepted = inspect.signature(PARTITIONERS.get(p.name, key="data.partition.name")).parameters
    options = {k: getattr(p, k) for k in ("alpha", "min_samples", "classes_per_client")}
    dataset = load_dataset(cfg.data.dataset, cfg.data.root, **cfg.data.options)
    return build_federation(
        dataset,
        num_clients=cfg.data.num_clients,
        partitioner=p.name,
        partition_options={k: v for k, v in options.items() if k in accepted},
        seed=cfg.seed,
        test_fraction=cfg.data.test_fraction,
        public_fraction=cfg.data.public_fraction,
        train_samples=cfg.data.train_samples,
        domains=cfg.data.domains,
        val_fraction=cfg.data.val_fraction,
    )


def save_partition(fed: Federation, run_dir: str | Path) -> list[Path]:
    """Write the split as Parquet into `run_dir` (created if missing); returns both paths.

    `partition.parquet`: `client` (int32, -1 for public), `split` (train, test, val, public;
    val only when a client has one), `index` (int64 into `x_train`). `class_counts.parquet`:
    `client`, `split`, `class` (int32), `count` (int64), one row per client, split and class.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    names = SPLITS if fed.has_val else SPLITS[:2]
    groups = [(cid, name, getattr(s, name)) for cid, s in enumerate(fed.clients) for name in names]
    groups.append((PUBLIC_CLIENT, "public", fed.public))

    def column(values: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(values).astype(dtype) if values else np.empty(0, dtype=dtype)

    partition = pa.table(
        {
            "client": column([np.full(len(idx), cid) for cid, _, idx in groups], np.int32),
            "split": pa.array(
                [name for _, name, idx in groups for _ in range(len(idx))], pa.string()
            ),
            "index": column([idx for _, _, idx in groups], np.int64),
        }
    )
    c = fed.dataset.num_classes
    labels = fed.dataset.y_train
    counts = pa.table(
        {
            "client": np.repeat([cid for cid, _, _ in groups], c).astype(np.int32),
            "split": pa.array([name for _, name, _ in groups for _ in range(c)], pa.string()),
            "class": np.tile(np.arange(c), len(groups)).astype(np.int32),
            "count": column(
                [np.bincount(labels[idx], minlength=c) for _, _, idx in groups], np.int64
            ),
        }
    )
    paths = [run_dir / PARTITION_FILE, run_dir / CLASS_COUNTS_FILE]
    # replaced atomically, never written through a link planted in the run directory
    write_with(paths[0], lambda f: pq.write_table(partition, f))
    write_with(paths[1], lambda f: pq.write_table(counts, f))
    return paths


def load_partition(path: str | Path) -> dict[str, Any]:
    """`{"clients": {client_id: ClientSplit}, "public": indices}` from a `partition.parquet`
    written by `save_partition` (`path`: the file or the run directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / PARTITION_FILE
    table = pq.read_table(path)
    client = table.column("client").to_numpy()
    split = np.asarray(table.column("split").to_pylist(), dtype=object)
    index = table.column("index").to_numpy().astype(np.int64)

    def pick(cid: int, name: str) -> np.ndarray:
        return np.sort(index[(client == cid) & (split == name)])

    ids = sorted(int(c) for c in np.unique(client) if c != PUBLIC_CLIENT)
    return {
        "clients": {
            cid: ClientSplit(train=pick(cid, "train"), test=pick(cid, "test"), val=pick(cid, "val"))
            for cid in ids
        },
        "public": pick(PUBLIC_CLIENT, "public"),
    }

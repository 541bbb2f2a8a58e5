"""build_federation: fractions, disjointness, determinism; Parquet round-trip; the plot."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from rayfl.data import ClientSplit, Federation, build_federation, load_dataset
from rayfl.data.federated import load_partition, save_partition
from rayfl.data.partition import iid
from rayfl.errors import ConfigError, UserError
from rayfl.tracking.plots import plot_class_counts


@pytest.fixture(scope="module")
def dataset():
    return load_dataset("synthetic", num_samples=1200, num_test=100, num_classes=5, shape=(1, 4, 4))


def build(dataset, **overrides) -> Federation:
    kwargs = {
        "num_clients": 8,
        "partitioner": "dirichlet",
        "partition_options": {"alpha": 0.5, "min_samples": 10},
        "seed": 0,
        "test_fraction": 0.25,
        "public_fraction": 0.1,
    }
    kwargs.update(overrides)
    return build_federation(dataset, **kwargs)


def all_indices(fed: Federation) -> list[np.ndarray]:
    return [a for c in fed.clients for a in (c.train, c.test)] + [fed.public]


@pytest.mark.parametrize("train_samples", [None, 500])
@pytest.mark.parametrize("public_fraction", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("test_fraction", [0.0, 0.2, 0.5])
def test_fractions_and_disjointness(dataset, train_samples, public_fraction, test_fraction):
    fed = build(
        dataset,
        train_samples=train_samples,
        public_fraction=public_fraction,
        test_fraction=test_fraction,
    )
    pool = len(dataset.y_train) if train_samples is None else train_samples
    assert fed.num_clients == 8
    assert len(fed.public) == round(public_fraction * pool)
    union = np.concatenate(all_indices(fed))
    # Every (subset) sample sits in exactly one place: a client's train, its test, or public.
    assert len(union) == pool and len(np.unique(union)) == pool
    assert union.min() >= 0 and union.max() < len(dataset.y_train)
    labels = dataset.y_train
    for split in fed.clients:
        assert split.train.dtype == np.int64 and np.all(np.diff(split.train) > 0)
        n = len(split.train) + len(split.test)
        assert len(split.test) == round(test_fraction * n) and len(split.train) >= 1
        # Stratified: each class's test count is its quota rounded up or down.
        all_counts = np.bincount(labels[np.concatenate([split.train, split.test])], minlength=5)
        test_counts = np.bincount(labels[split.test], minlength=5)
        assert np.all(np.abs(test_counts - test_fraction * all_counts) < 1)


def test_train_samples_subset_is_seeded(dataset):
    a = build(dataset, train_samples=400)
    b = build(dataset, train_samples=400, public_fraction=0.0)
    # The subset is drawn before the public split, so it does not depend on public_fraction.
    np.testing.assert_array_equal(
        np.sort(np.concatenate(all_indices(a))), np.sort(np.concatenate(all_indices(b)))
    )
    with pytest.raises(ConfigError, match="data.train_samples"):
        build(dataset, train_samples=1201)


def test_deterministic_in_seed(dataset):
    a, b, c = build(dataset), build(dataset), build(dataset, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(all_indices(a), all_indices(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(all_indices(a), all_indices(c)))


def test_partition_is_the_partitioners_when_nothing_held_out(dataset):
    fed = build(dataset, partitioner="iid", partition_options={}, public_fraction=0.0, seed=4)
    expected = iid(dataset.y_train, 8, 4)
    for split, part in zip(fed.clients, expected):
        np.testing.assert_array_equal(np.sort(np.concatenate([split.train, split.test])), part)


def test_tiny_clients_keep_a_training_sample(dataset):
    fed = build(
        dataset,
        num_clients=40,
        partitioner="quantity",
        partition_options={"alpha": 0.05, "min_samples": 1},
        test_fraction=0.9,
    )
    sizes = [len(c.train) + len(c.test) for c in fed.clients]
    assert min(sizes) <= 2  # the setting really produces tiny clients
    assert all(len(c.train) >= 1 for c in fed.clients)


def test_class_counts(dataset):
    fed = build(dataset, partitioner="pathological", partition_options={"classes_per_client": 2})
    train, test = fed.class_counts(), fed.class_counts("test")
    assert train.shape == (8, 5) and train.dtype == np.int64
    assert ((train > 0).sum(axis=1) == 2).all()
    assert train.sum() + test.sum() + len(fed.public) == 1200
    np.testing.assert_array_equal(
        train[3], np.bincount(dataset.y_train[fed.clients[3].train], minlength=5)
    )
    with pytest.raises(ValueError):
        fed.class_counts("public")


def test_bad_options_are_config_errors(dataset):
    with pytest.raises(ConfigError, match=r"data.partition.alpa.*did you mean 'alpha'"):
        build(dataset, partition_options={"alpa": 0.5})
    with pytest.raises(ConfigError, match="data.partition.name: unknown partitioner"):
        build(dataset, partitioner="dirichlett")
    with pytest.raises(ConfigError, match="data.test_fraction"):
        build(dataset, test_fraction=1.0)
    with pytest.raises(ConfigError, match="data.public_fraction"):
        build(dataset, public_fraction=-0.1)
    with pytest.raises(UserError):
        build(dataset, num_clients=2000, partitioner="iid", partition_options={})


def test_parquet_round_trip(dataset, tmp_path):
    fed = build(dataset)
    paths = save_partition(fed, tmp_path / "run")
    assert [p.name for p in paths] == ["partition.parquet", "class_counts.parquet"]
    table = pq.read_table(paths[0])
    assert str(table.schema.field("client").type) == "int32"
    assert str(table.schema.field("index").type) == "int64"
    assert set(table.column("split").to_pylist()) == {"train", "test", "public"}
    assert table.num_rows == 1200

    loaded = load_partition(tmp_path / "run")  # the run directory works as well as the file
    assert sorted(loaded["clients"]) == list(range(8))
    for cid, split in enumerate(fed.clients):
        got = loaded["clients"][cid]
        assert isinstance(got, ClientSplit)
        np.testing.assert_array_equal(got.train, split.train)
        np.testing.assert_array_equal(got.test, split.test)
    np.testing.assert_array_equal(loaded["public"], fed.public)

    counts = pq.read_table(paths[1]).to_pydict()
    rows = {
        (c, s, k): n
        for c, s, k, n in zip(counts["client"], counts["split"], counts["class"], counts["count"])
    }
    assert len(rows) == (8 * 2 + 1) * 5
    assert rows[(2, "train", 1)] == fed.class_counts()[2, 1]
    assert sum(n for (c, s, _), n in rows.items() if s == "public") == len(fed.public)


def test_plot_label_distribution_writes_png(dataset, tmp_path):
    fed = build(dataset)
    path = plot_labels(fed, tmp_path / "plots" / "labels.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_label_distribution_of_many_clients_is_an_image(dataset, tmp_path, monkeypatch):
    # Above MAX_BAR_CLIENTS clients the plot is one image row per client, not a bar per class.
    from matplotlib.axes import Axes

    import rayfl.tracking.plots as plots

    def no_bars(*args, **kwargs):
        raise AssertionError("drew bars")

    monkeypatch.setattr(plots, "MAX_BAR_CLIENTS", 4)
    monkeypatch.setattr(Axes, "barh", no_bars)
    fed = build(dataset)
    path = plot_labels(fed, tmp_path / "labels.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_val_split_is_carved_stratified_from_train_and_leaves_the_rest(dataset, tmp_path):
    plain = build(dataset)
    fed = build(dataset, val_fraction=0.25)
    y = dataset.y_train
    assert fed.has_val and not plain.has_val
    for before, after in zip(plain.clients, fed.clients):
        # the test split is the one without validation; train + val is the old train split
        assert np.array_equal(after.test, before.test)
        assert np.array_equal(np.sort(np.concatenate([after.train, after.val])), before.train)
        assert not np.intersect1d(after.train, after.val).size
        # stratified: per class, a quarter of the old training samples (largest remainder)
        old = np.bincount(y[before.train], minlength=5)
        val = np.bincount(y[after.val], minlength=5)
        assert np.all(np.abs(val - old * 0.25) < 1) and len(after.val) == round(
            0.25 * len(before.train)
        )
    again = build(dataset, val_fraction=0.25)
    assert all(np.array_equal(a.val, b.val) for a, b in zip(fed.clients, again.clients))
    assert fed.class_counts("val").sum() == sum(len(c.val) for c in fed.clients)
    save_partition(fed, tmp_path)
    loaded = load_partition(tmp_path)
    assert all(np.array_equal(loaded["clients"][i].val, c.val) for i, c in enumerate(fed.clients))
    with pytest.raises(ConfigError, match="data.val_fraction"):
        build(dataset, val_fraction=1.0)


def plot_labels(fed, path):
    return plot_class_counts(fed.class_counts("train"), fed.dataset.name, path)

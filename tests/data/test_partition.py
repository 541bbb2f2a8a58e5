"""Partitioner invariants: disjoint, covering, reproducible, and each one's own promise."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from rayfl.data import PARTITIONERS, partition
from rayfl.errors import ConfigError, UserError

# 1,000 labels over 10 classes, deliberately unbalanced (class c has roughly c+1 shares).
LABELS = np.random.default_rng(123).choice(10, size=1000, p=np.arange(1, 11) / 55)

COVERING = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.1, "min_samples": 5}),
    ("dirichlet", {"alpha": 1.0}),
    ("dirichlet", {"alpha": 100.0}),
    ("quantity", {"alpha": 0.5}),
    ("quantity", {"alpha": 10.0, "min_samples": 20}),
]


def check_disjoint_sorted(parts: list[np.ndarray], num_clients: int) -> np.ndarray:
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64 and p.ndim == 1
        assert np.all(np.diff(p) > 0)  # sorted and without duplicates
    union = np.concatenate(parts)
    assert len(np.unique(union)) == len(union)  # no index in two clients
    return union


@pytest.mark.parametrize("num_clients", [1, 7, 20])
@pytest.mark.parametrize(("name", "options"), COVERING)
def test_covering_partitioners_are_disjoint_covering_reproducible(name, options, num_clients):
    fn = PARTITIONERS.get(name)
    parts = fn(LABELS, num_clients, 0, **options)
    union = check_disjoint_sorted(parts, num_clients)
    np.testing.assert_array_equal(np.sort(union), np.arange(len(LABELS)))
    again = fn(LABELS, num_clients, 0, **options)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    if num_clients > 1:
        other = fn(LABELS, num_clients, 1, **options)
        assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("num_clients", [5, 30])
@pytest.mark.parametrize("alpha", [0.1, 0.5, 5.0])
@pytest.mark.parametrize("min_samples", [1, 5])
def test_dirichlet_honours_min_samples(num_clients, alpha, min_samples):
    parts = partition.dirichlet(LABELS, num_clients, 3, alpha=alpha, min_samples=min_samples)
    assert min(len(p) for p in parts) >= min_samples


def classes_for_90_percent(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean number of classes needed to cover 90% of a client's samples."""
    needed = []
    for p in parts:
        counts = np.sort(np.bincount(labels[p], minlength=10))[::-1]
        needed.append(int(np.searchsorted(np.cumsum(counts), 0.9 * len(p)) + 1))
    return float(np.mean(needed))


def test_dirichlet_skew_grows_as_alpha_shrinks():
    skewed = classes_for_90_percent(LABELS, partition.dirichlet(LABELS, 10, 0, alpha=0.1))
    mild = classes_for_90_percent(LABELS, partition.dirichlet(LABELS, 10, 0, alpha=100.0))
    assert skewed < 4.0 < 7.0 < mild


def test_dirichlet_impossible_min_samples_is_a_user_error():
    with pytest.raises(UserError, match="exceeds"):
        partition.dirichlet(LABELS[:50], 10, 0, alpha=1.0, min_samples=10)
    # Feasible in principle but hopeless at this alpha: the bounded retry gives up clearly.
    with pytest.raises(UserError, match="draws"):
        partition.dirichlet(LABELS, 90, 0, alpha=0.001, min_samples=10)


@pytest.mark.parametrize("fn", [partition.dirichlet, partition.quantity])
@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan")])
def test_bad_alpha_is_a_config_error(fn, alpha):
    with pytest.raises(ConfigError, match="data.partition.alpha"):
        fn(LABELS, 4, 0, alpha=alpha)


@pytest.mark.parametrize("name", ["iid", "pathological", "quantity"])
def test_bad_num_clients(name):
    with pytest.raises(ConfigError, match="num_clients"):
        PARTITIONERS.get(name)(LABELS, 0, 0)
    with pytest.raises(UserError, match="only 5 samples"):
        PARTITIONERS.get(name)(LABELS[:5], 6, 0)


def test_iid_sizes_are_equal_within_one():
    parts = partition.iid(LABELS, 7, 0)
    assert [len(p) for p in parts] == [143, 143, 143, 143, 143, 143, 142]


@pytest.mark.parametrize(("num_clients", "k"), [(10, 2), (20, 2), (7, 3), (5, 1), (10, 10), (3, 2)])
def test_pathological_gives_k_classes_each(num_clients, k):
    parts = partition.pathological(LABELS, num_clients, 0, classes_per_client=k)
    union = check_disjoint_sorted(parts, num_clients)
    held = [set(np.unique(LABELS[p]).tolist()) for p in parts]
    assert all(len(h) == k for h in held)
    # Every class a client holds is complete across its holders: all of that class's samples.
    assigned = set().union(*held)
    expected = np.flatnonzero(np.isin(LABELS, list(assigned)))
    np.testing.assert_array_equal(np.sort(union), expected)
    # Classes are dealt evenly: each one goes to floor or ceil(num_clients * k / 10) clients.
    per_class = np.array([sum(c in h for h in held) for c in range(10)])
    assert per_class.max() - per_class.min() <= 1 and per_class.sum() == num_clients * k
    again = partition.pathological(LABELS, num_clients, 0, classes_per_client=k)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_pathological_ten_clients_two_classes_each_class_twice():
    parts = partition.pathological(LABELS, 10, 5, classes_per_client=2)
    holders = [sum(c in set(LABELS[p].tolist()) for p in parts) for c in range(10)]
    assert holders == [2] * 10
    # A class is shared equally by its two holders (sizes differ by at most one).
    for c in range(10):
        sizes = [int((LABELS[p] == c).sum()) for p in parts if (LABELS[p] == c).any()]
        assert abs(sizes[0] - sizes[1]) <= 1
    other = partition.pathological(LABELS, 10, 6, classes_per_client=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("k", [0, 11, 2.5])
def test_pathological_bad_k_is_a_config_error(k):
    with pytest.raises(ConfigError, match="data.partition.classes_per_client"):
        partition.pathological(LABELS, 10, 0, classes_per_client=k)


def test_pathological_too_few_samples_per_class():
    labels = np.array([0, 0, 0, 1])  # class 1 cannot be shared by two clients
    with pytest.raises(UserError, match="class 1 has 1 samples for 2 clients"):
        partition.pathological(labels, 4, 0, classes_per_client=1)


def test_quantity_skews_sizes_not_labels():
    parts = partition.quantity(LABELS, 10, 0, alpha=0.3, min_samples=5)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 5 and sizes.max() > 3 * sizes.min()
    # Labels stay iid: the biggest client's class shares track the global ones.
    big = parts[int(sizes.argmax())]
    local = np.bincount(LABELS[big], minlength=10) / len(big)
    overall = np.bincount(LABELS, minlength=10) / len(LABELS)
    assert np.abs(local - overall).max() < 0.08


def test_docstring_examples_run():
    result = doctest.testmod(partition)
    assert result.attempted >= 8 and result.failed == 0


def test_all_partitioners_registered():
    assert {"iid", "dirichlet", "pathological", "quantity"} <= set(PARTITIONERS.names())

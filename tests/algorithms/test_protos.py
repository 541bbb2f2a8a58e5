"""Golden numbers for the per-class statistics helpers (prototypes, class logits)."""

import numpy as np
import pytest
import torch

from rayfl.algorithms import protos


def test_class_means_golden():
    # Two batches; class 0: rows [1, 2] and [3, 4]; class 2: row [10, 0]; class 1 unseen.
    batches = [
        (torch.tensor([[1.0, 2.0], [10.0, 0.0]]), torch.tensor([0, 2])),
        (torch.tensor([[3.0, 4.0]]), torch.tensor([0])),
    ]
    stats = protos.class_means(lambda x: 2 * x, batches, num_classes=3)
    np.testing.assert_allclose(stats["means"], [[4.0, 6.0], [0.0, 0.0], [20.0, 0.0]])
    np.testing.assert_array_equal(stats["counts"], [2.0, 0.0, 1.0])
    assert stats["means"].dtype == np.float32


def test_aggregate_class_means_weights_by_counts():
    a = {
        "means": np.array([[1.0, 0.0], [5.0, 5.0]], np.float32),
        "counts": np.array([1.0, 2.0], np.float32),
    }
    b = {
        "means": np.array([[3.0, 2.0], [0.0, 0.0]], np.float32),
        "counts": np.array([3.0, 0.0], np.float32),
    }
    out = protos.aggregate_class_means([a, b])
    # class 0: (1 * [1, 0] + 3 * [3, 2]) / 4 = [2.5, 1.5]; class 1: only a has it.
    np.testing.assert_allclose(out["means"], [[2.5, 1.5], [5.0, 5.0]])
    np.testing.assert_array_equal(out["counts"], [4.0, 2.0])
    none = protos.aggregate_class_means([protos.empty_class_stats(2, 3)])
    assert not none["means"].any() and not none["counts"].any()


def test_masked_class_mse_golden():
    values = torch.tensor([[1.0, 1.0], [2.0, 0.0], [9.0, 9.0]])
    labels = torch.tensor([0, 1, 2])
    table = torch.tensor([[0.0, 1.0], [0.0, 0.0], [5.0, 5.0]])
    counts = torch.tensor([1.0, 3.0, 0.0])  # class 2 unknown: its row contributes zero
    # squared errors: row 0 -> 1 + 0, row 1 -> 4 + 0, row 2 -> 0; mean over 6 entries.
    assert protos.masked_class_mse(values, labels, table, counts).item() == pytest.approx(5.0 / 6.0)


def test_masked_class_mse_gradient_pulls_towards_the_prototype():
    values = torch.tensor([[1.0, 1.0]], requires_grad=True)
    protos.masked_class_mse(values, torch.tensor([0]), torch.zeros(1, 2), torch.ones(1)).backward()
    # d/dv mean((v - 0)^2) = 2 v / 2
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, 1.0]]))


def test_prototype_pairs_keep_only_seen_classes_in_client_order():
    a = {
        "means": np.array([[1.0], [2.0], [3.0]], np.float32),
        "counts": np.array([1.0, 0.0, 4.0], np.float32),
    }
    b = {
        "means": np.array([[7.0], [8.0], [9.0]], np.float32),
        "counts": np.array([0.0, 2.0, 0.0], np.float32),
    }
    feats, labels = protos.prototype_pairs([a, b])
    np.testing.assert_array_equal(feats, [[1.0], [3.0], [8.0]])
    np.testing.assert_array_equal(labels, [0, 2, 1])

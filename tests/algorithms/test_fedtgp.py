"""FedTGP: the adaptive margin and the ACL loss by hand; the server learns separable prototypes."""

import math

import numpy as np
import pytest
import torch

from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fedtgp import (
    FedTGPClient,
    FedTGPParams,
    FedTGPServer,
    acl_loss,
    adaptive_margin,
)
from rayfl.algorithms.protos import NearestPrototype
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)
SHAPE = (1, 8, 8)
CPU = torch.device("cpu")


def test_adaptive_margin_golden():
    # class centers (1, 0) [mean of two clients], (1, 3), (5, 0): pairwise distances 3, 4, 5;
    # each class's gap to its nearest other class: 3, 3, 4 -> margin min(4, threshold)
    protos = np.array([[0, 0], [2, 0], [1, 3], [5, 0]], np.float32)
    labels = np.array([0, 0, 1, 2])
    margin, gaps = adaptive_margin(protos, labels, threshold=100.0)
    assert margin == pytest.approx(4.0)
    np.testing.assert_allclose(gaps, [3.0, 3.0, 4.0])
    assert adaptive_margin(protos, labels, threshold=3.5)[0] == pytest.approx(3.5)
    assert adaptive_margin(protos[:2], labels[:2], threshold=7.0)[0] == 7.0  # one class


def test_acl_loss_golden():
    # distances 0 (own class, plus margin 1) and 5: CE = log(1 + exp((0 + 1) - 5))
    loss = acl_loss(
        torch.zeros(1, 2), torch.tensor([0]), torch.tensor([[0.0, 0.0], [3.0, 4.0]]), margin=1.0
    )
    assert loss.item() == pytest.approx(math.log1p(math.exp(-4.0)), rel=1e-5)


def server(**kw):
    ctx = ServerContext(
        ("tiny_a",), {"tiny_a": 2}, SHAPE, 3, CPU, TrainConfig(batch_size=4, lr=0.05), 0, 2
    )
    return FedTGPServer(ctx, FedTGPParams(**kw))


def reply(cid, means, counts):
    return Reply(
        cid,
        "tiny_a",
        10,
        {"means": np.asarray(means, np.float32), "counts": np.asarray(counts, np.float32)},
    )


def test_server_trains_one_separable_prototype_per_class():
    torch.manual_seed(0)
    s = server(server_epochs=60)
    first = s.broadcast("tiny_a", RND)
    assert (first["counts"] == 0).all()  # nothing known before the first update
    rng = np.random.default_rng(0)
    centers = np.eye(3, 16, dtype=np.float32) * 3.0
    r0 = reply(0, centers + 0.1 * rng.standard_normal((3, 16)), [5, 5, 0])
    r1 = reply(1, centers + 0.1 * rng.standard_normal((3, 16)), [0, 4, 6])
    metrics = s.aggregate([r0, r1], RND)
    assert metrics["fedtgp/margin"] > 0
    out = s.update(None, RND)  # type: ignore[arg-type]  (the server uses no data)
    assert np.isfinite(out["fedtgp/server_loss"])
    table = s.broadcast("tiny_a", RND)
    assert table["means"].shape == (3, 16) and (table["counts"] == 1).all()
    # every uploaded prototype's nearest global prototype is its own class
    for c in range(3):
        d = ((table["means"] - centers[c]) ** 2).sum(1)
        assert int(d.argmin()) == c
    restored = server()
    restored.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(restored.broadcast("tiny_a", RND)["means"], table["means"])


def test_client_predicts_by_nearest_prototype_and_params_are_checked():
    c = FedTGPClient(ClientContext("tiny_a", SHAPE, 3, CPU, TrainConfig()), FedTGPParams())
    assert isinstance(c.eval_model(), NearestPrototype)
    for kw, key in [({"lam": -1}, "lam"), ({"margin_threshold": -1}, "margin_threshold")]:
        with pytest.raises(ConfigError, match=f"algorithm.{key}"):
            FedTGPParams(**kw)


def test_defaults_are_the_official_codes_and_prototypes_are_collected_after_training():
    from rayfl.algorithms.protos import class_means
    from rayfl.data.datasets import load_dataset
    from rayfl.engine.training import LocalTrainer

    p = FedTGPParams()
    # TsingZ0/FedTGP system/run_me.sh: -lam 10 -se 100 -mart 100
    assert (p.lam, p.server_epochs, p.margin_threshold, p.collect) == (10.0, 100, 100.0, "after")
    ds = load_dataset("synthetic", num_samples=60, num_test=10, shape=SHAPE, num_classes=3)
    settings = TrainConfig(batch_size=16, lr=0.5, local_epochs=1)
    trainer = LocalTrainer(
        ds, np.arange(50), np.arange(50, 60), settings, CPU, torch.Generator().manual_seed(0)
    )
    c = FedTGPClient(ClientContext("tiny_a", SHAPE, 3, CPU, TrainConfig()), p)
    c.fit(trainer)
    up = c.upload()
    expected = class_means(
        c.model.features, trainer.batches("train"), 3
    )  # eval mode, trained model
    np.testing.assert_allclose(up["means"], expected["means"], atol=1e-6)
    np.testing.assert_array_equal(up["counts"], expected["counts"])  # class counts, not presence
    assert up["counts"].sum() == 50

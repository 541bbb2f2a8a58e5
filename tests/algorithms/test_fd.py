"""FD: per-class mean logits up, class averages down, CE + gamma * distance (HtFLlib's losses)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fd import FDClient, FDParams, FDServer
from rayfl.config import build_config
from rayfl.engine.loop import Simulation

RND = RoundContext(1, 2)  # round 1 of 2

SHAPE = (1, 8, 8)
CPU = torch.device("cpu")


def test_server_averages_class_logits_by_count_golden():
    sctx = ServerContext(("tiny_a",), {"tiny_a": 2}, SHAPE, 2, CPU, TrainConfig(), 0, 2)
    server = FDServer(sctx, FDParams(average="samples"))
    assert not server.broadcast("tiny_a", RND)["counts"].any()  # nothing known before round one
    a = {
        "means": np.array([[1.0, 0.0], [0.0, 0.0]], np.float32),
        "counts": np.array([1.0, 0.0], np.float32),
    }
    b = {
        "means": np.array([[3.0, 2.0], [0.0, 6.0]], np.float32),
        "counts": np.array([3.0, 2.0], np.float32),
    }
    metrics = server.aggregate([Reply(0, "tiny_a", 5, a), Reply(1, "tiny_a", 5, b)], RND)
    down = server.broadcast("tiny_a", RND)
    np.testing.assert_allclose(down["means"], [[2.5, 1.5], [0.0, 6.0]])
    np.testing.assert_array_equal(down["counts"], [4.0, 2.0])
    assert metrics["fd/classes_known"] == 2.0


def make_client(**kw):
    torch.manual_seed(0)
    client = FDClient(ClientContext("tiny_a", SHAPE, 2, CPU, TrainConfig()), FDParams(**kw))
    table = np.array([[1.0, -1.0], [0.0, 0.0]], np.float32)
    client.receive(
        {"means": table, "counts": np.array([3.0, 0.0], np.float32)}, RND
    )  # class 1 unknown
    return client


def test_client_loss_mse_golden():
    client = make_client(gamma=0.5, loss="mse")
    x, y = torch.randn(2, *SHAPE), torch.tensor([0, 1])
    logits = client.model(x)
    # only the class-0 sample has a target: sum of its squared errors over 2 samples x 2 logits
    dist = ((logits[0] - torch.tensor([1.0, -1.0])) ** 2).sum() / 4
    expected = F.cross_entropy(logits, y) + 0.5 * dist
    assert client.training_step(x, y).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("loss", ["ce", "ce_softmax"])
def test_client_loss_is_htfllibs_cross_entropy(loss):
    # HtFLlib clientfd.py: the target row is the label's global logits (its softmax at
    # commits bf60d9a-17f851e), or the sample's own detached logits for an unknown label
    client = make_client(gamma=0.5, loss=loss)
    x, y = torch.randn(2, *SHAPE), torch.tensor([0, 1])
    logits = client.model(x)
    t0, t1 = torch.tensor([1.0, -1.0]), logits[1].detach()
    if loss == "ce_softmax":
        t0, t1 = t0.softmax(0), t1.softmax(0)
    log_p = torch.log_softmax(logits, 1)
    soft_ce = -((t0 * log_p[0]).sum() + (t1 * log_p[1]).sum()) / 2
    expected = F.cross_entropy(logits, y) + 0.5 * soft_ce
    assert client.training_step(x, y).item() == pytest.approx(expected.item(), rel=1e-6)


def test_no_distillation_before_any_class_is_known():
    torch.manual_seed(0)
    client = FDClient(ClientContext("tiny_a", SHAPE, 2, CPU, TrainConfig()), FDParams())
    x, y = torch.randn(2, *SHAPE), torch.tensor([0, 1])
    expected = F.cross_entropy(client.model(x), y)
    assert client.training_step(x, y).item() == pytest.approx(expected.item(), rel=1e-6)


def test_runs_without_a_common_feature_size(synthetic_raw, tmp_path):
    assert not ALGORITHMS.get("fd").needs_common_feature_dim
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fd", "gamma": 1.0}
    raw["model"] = {"architectures": ["tiny_a", "mlp"]}  # feature sizes 16 and 128
    result = Simulation(build_config(raw), tmp_path).run()
    final = result.final
    assert np.isfinite(final["personal/acc"]) and final["fd/classes_known"] == 10.0
    # every client uploads C x C means + C counts as float32
    assert final["comm/bytes_up"] == 6 * (10 * 10 + 10) * 4


def test_uploads_htfllibs_training_step_logits_as_presence():
    # HtFLlib clientfd.py:54-56: the class logits are those of the training forward passes (one
    # batch holding every sample: the model before its only update); serverfd.py averages them
    # over clients, which the 0/1 presence counts give the server's count-weighted mean.
    from rayfl.algorithms.protos import class_means
    from rayfl.data.datasets import load_dataset
    from rayfl.engine.training import LocalTrainer

    ds = load_dataset("synthetic", num_samples=120, num_test=20, shape=SHAPE, num_classes=2)
    settings = TrainConfig(batch_size=100, lr=0.5, momentum=0.0, local_epochs=1)
    trainer = LocalTrainer(
        ds, np.arange(100), np.arange(100, 120), settings, CPU, torch.Generator().manual_seed(0)
    )
    torch.manual_seed(0)
    client = FDClient(ClientContext("tiny_a", SHAPE, 2, CPU, TrainConfig()), FDParams())
    client.model.train()
    before = class_means(client.model, trainer.batches("train"), 2)
    client.fit(trainer)
    up = client.upload()
    np.testing.assert_allclose(up["means"], before["means"], atol=1e-6)
    np.testing.assert_array_equal(up["counts"], np.ones(2, np.float32))
    after = FDClient(
        ClientContext("tiny_a", SHAPE, 2, CPU, TrainConfig()),
        FDParams(collect="after", average="samples"),
    )
    after.model.load_state_dict(client.model.state_dict())
    trained = class_means(after.model.eval(), trainer.batches("train"), 2)
    assert np.abs(up["means"] - trained["means"]).max() > 1e-3
    with pytest.raises(Exception, match="algorithm.loss"):
        FDParams(loss="kl")

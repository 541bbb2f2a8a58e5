"""FedProto: class prototypes of the features up, count-weighted prototypes down, CE + lambda * MSE."""

import numpy as np
import pytest
import torch

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fedproto import FedProtoClient, FedProtoParams, FedProtoServer
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)  # round 1 of 2

SHAPE = (1, 8, 8)
CPU = torch.device("cpu")


def test_loss_golden_with_hand_set_features():
    client = FedProtoClient(
        ClientContext("tiny_a", SHAPE, 2, CPU, TrainConfig()), FedProtoParams(lam=2.0)
    )
    with torch.no_grad():  # features = relu(x_flat[:16]), head = zero map
        client.model.encoder[1].weight.copy_(torch.eye(16, 64))
        client.model.encoder[1].bias.zero_()
        client.model.head.weight.zero_()
        client.model.head.bias.zero_()
    protos = np.zeros((2, 16), np.float32)
    protos[0, 0] = 1.0
    client.receive({"means": protos, "counts": np.array([1.0, 1.0], np.float32)}, RND)
    x = torch.zeros(2, *SHAPE)
    x[0, 0, 0, 0] = 3.0  # sample 0 (class 0): feature [3, 0, ...] vs prototype [1, 0, ...]
    y = torch.tensor([0, 1])  # sample 1 (class 1): all-zero feature, all-zero prototype
    # CE of zero logits = ln 2; MSE = (3 - 1)^2 / (2 * 16)
    expected = np.log(2) + 2.0 * 4.0 / 32.0
    assert client.training_step(x, y).item() == pytest.approx(expected, rel=1e-6)


def test_server_prototypes_are_count_weighted():
    sctx = ServerContext(("tiny_a",), {"tiny_a": 2}, SHAPE, 2, CPU, TrainConfig(), 0, 2)
    server = FedProtoServer(sctx, FedProtoParams())
    assert server.broadcast("tiny_a", RND)["means"].shape == (2, 16)
    a = {"means": np.full((2, 16), 1.0, np.float32), "counts": np.array([1.0, 1.0], np.float32)}
    b = {"means": np.full((2, 16), 4.0, np.float32), "counts": np.array([2.0, 0.0], np.float32)}
    server.aggregate([Reply(0, "tiny_a", 2, a), Reply(1, "tiny_a", 2, b)], RND)
    down = server.broadcast("tiny_a", RND)
    np.testing.assert_allclose(down["means"][0], 3.0)  # (1 * 1 + 2 * 4) / 3
    np.testing.assert_allclose(down["means"][1], 1.0)


def test_uploads_are_prototypes_of_the_trained_model(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedproto", "lam": 1.0}
    result = Simulation(build_config(raw), tmp_path).run()
    assert result.final["fedproto/classes_known"] == 10.0
    assert result.final["comm/bytes_up"] == 6 * (10 * 16 + 10) * 4
    assert np.isfinite(result.final["personal/acc"])


def test_refuses_models_without_a_common_feature_size(synthetic_raw, tmp_path):
    assert ALGORITHMS.get("fedproto").needs_common_feature_dim
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedproto"}
    raw["model"] = {"architectures": ["tiny_a", "mlp"]}
    with pytest.raises(ConfigError, match="feature size"):
        Simulation(build_config(raw), tmp_path)


def test_prototype_prediction_picks_the_nearest_known_prototype():
    from rayfl.algorithms.protos import NearestPrototype

    client = FedProtoClient(
        ClientContext("tiny_a", SHAPE, 3, CPU, TrainConfig()),
        FedProtoParams(predict="prototype"),
    )
    with torch.no_grad():  # features = relu(x_flat[:16])
        client.model.encoder[1].weight.copy_(torch.eye(16, 64))
        client.model.encoder[1].bias.zero_()
    protos = np.zeros((3, 16), np.float32)
    protos[0, 0], protos[1, 1], protos[2, 0] = 1.0, 1.0, 0.9
    # class 2 has no prototype (count 0): never predicted although it would be the nearest
    client.receive({"means": protos, "counts": np.array([1.0, 1.0, 0.0], np.float32)}, RND)
    model = client.eval_model()
    assert isinstance(model, NearestPrototype)
    x = torch.zeros(3, *SHAPE)
    x.view(3, -1)[0, 0] = 0.9  # nearest: class 0 (class 2 is unknown)
    x.view(3, -1)[1, 1] = 2.0  # class 1
    x.view(3, -1)[2, :2] = torch.tensor(
        [0.2, 0.6]
    )  # squared distances 1.0 (class 0), 0.2 (class 1)
    logits = model(x)
    assert logits.argmax(1).tolist() == [0, 1, 1]
    assert logits[0, 0].item() == pytest.approx(-0.01, abs=1e-6)  # minus squared distance
    assert logits[0, 2].item() == float("-inf")
    head = FedProtoClient(
        ClientContext("tiny_a", SHAPE, 3, CPU, TrainConfig()), FedProtoParams(predict="head")
    )
    assert head.eval_model() is head.model
    assert FedProtoParams().predict == "prototype"  # the paper's and HtFLlib's inference


def _trainer(lr, batch_size=100):
    from rayfl.data.datasets import load_dataset
    from rayfl.engine.training import LocalTrainer

    ds = load_dataset("synthetic", num_samples=120, num_test=20, shape=SHAPE, num_classes=2)
    settings = TrainConfig(batch_size=batch_size, lr=lr, momentum=0.0, local_epochs=1)
    gen = torch.Generator().manual_seed(0)
    return LocalTrainer(ds, np.arange(100), np.arange(100, 120), settings, CPU, gen)


def _fitted_upload(lr, **kw):
    torch.manual_seed(0)
    client = FedProtoClient(
        ClientContext("tiny_a", SHAPE, 2, CPU, TrainConfig()), FedProtoParams(**kw)
    )
    initial = {k: v.clone() for k, v in client.model.state_dict().items()}
    trainer = _trainer(lr)
    client.fit(trainer)
    return client, initial, trainer


def test_collect_train_uploads_the_representations_seen_during_training():
    from rayfl.algorithms.protos import class_means

    # One batch holding every sample: the training step sees the model before its only update,
    # so `collect: train` (official) uploads the initial model's prototypes, `after` the trained one's.
    client, initial, trainer = _fitted_upload(0.5, collect="train", average="samples")
    up = client.upload()
    trained = class_means(client.model.features, trainer.batches("train"), 2)
    client.model.load_state_dict(initial)
    before = class_means(client.model.features, trainer.batches("train"), 2)
    np.testing.assert_allclose(up["means"], before["means"], atol=1e-6)
    np.testing.assert_array_equal(up["counts"], before["counts"])
    assert np.abs(up["means"] - trained["means"]).max() > 1e-3

    after, _, trainer = _fitted_upload(0.5, collect="after", average="samples")
    np.testing.assert_allclose(after.upload()["means"], trained["means"], atol=1e-6)


def test_average_clients_uploads_presence_so_the_server_mean_is_unweighted():
    client, _, _ = _fitted_upload(0.0, collect="train")  # official defaults: train, clients
    assert FedProtoParams().collect == "train" and FedProtoParams().average == "clients"
    up = client.upload()
    np.testing.assert_array_equal(up["counts"], np.ones(2, np.float32))
    sctx = ServerContext(("tiny_a",), {"tiny_a": 2}, SHAPE, 2, CPU, TrainConfig(), 0, 2)
    server = FedProtoServer(sctx, FedProtoParams())
    a = {"means": np.full((2, 16), 1.0, np.float32), "counts": np.array([1.0, 1.0], np.float32)}
    b = {"means": np.full((2, 16), 4.0, np.float32), "counts": np.array([1.0, 0.0], np.float32)}
    server.aggregate([Reply(0, "tiny_a", 2, a), Reply(1, "tiny_a", 9, b)], RND)
    np.testing.assert_allclose(server.broadcast("tiny_a", RND)["means"][0], 2.5)  # (1 + 4) / 2


@pytest.mark.parametrize(
    ("kw", "key"), [({"collect": "x"}, "collect"), ({"average": "x"}, "average")]
)
def test_collect_and_average_are_checked(kw, key):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        FedProtoParams(**kw)

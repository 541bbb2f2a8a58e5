"""FedGH: the server trains the global header on uploaded prototypes; clients use it as their head."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fedgh import FedGHClient, FedGHParams, FedGHServer, train_header
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from tests.algorithms.fakes import FakeServerData

RND = RoundContext(1, 2)  # round 1 of 2

SHAPE = (1, 8, 8)
CPU = torch.device("cpu")


def test_train_header_one_sgd_step_golden():
    header = nn.Linear(2, 2)
    nn.init.zeros_(header.weight)
    nn.init.zeros_(header.bias)
    # one pair (x = [1, 0], class 0): p = (1/2, 1/2), grad W = (p - e0) x^T, grad b = p - e0
    loss = train_header(
        header,
        FakeServerData(),
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([0]),
        epochs=1,
        lr=1.0,
        batch_size=8,
    )
    assert loss == pytest.approx(math.log(2))
    torch.testing.assert_close(header.weight, torch.tensor([[0.5, 0.0], [-0.5, 0.0]]))
    torch.testing.assert_close(header.bias, torch.tensor([0.5, -0.5]))


def test_server_trains_on_the_round_prototypes_and_broadcasts_the_header():
    sctx = ServerContext(("tiny_a",), {"tiny_a": 2}, SHAPE, 2, CPU, TrainConfig(batch_size=4), 0, 2)
    server = FedGHServer(sctx, FedGHParams(server_epochs=50, server_lr=0.5))
    means = np.zeros((2, 16), np.float32)
    means[0, 0], means[1, 1] = 1.0, 1.0
    a = {"means": means, "counts": np.array([3.0, 0.0], np.float32)}
    b = {"means": means, "counts": np.array([1.0, 2.0], np.float32)}
    metrics = server.aggregate([Reply(0, "tiny_a", 3, a), Reply(1, "tiny_a", 3, b)], RND)
    assert metrics == {"fedgh/prototypes": 3.0}  # class 0 twice, class 1 once
    before = server.broadcast("tiny_a", RND)
    out = server.update(FakeServerData(), RND)  # trains on the uploaded prototypes only
    after = server.broadcast("tiny_a", RND)
    assert out["fedgh/header_loss"] < math.log(2)
    assert not np.allclose(before["weight"], after["weight"])
    header = nn.Linear(16, 2)
    header.load_state_dict({k: torch.from_numpy(v) for k, v in after.items()})
    assert header(torch.from_numpy(means)).argmax(1).tolist() == [0, 1]
    assert server.update(FakeServerData(), RoundContext(2, 2)) == {}  # nothing new to train on


def test_frozen_header_client_keeps_the_global_header(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedgh", "freeze_header": True, "server_epochs": 5}
    result = Simulation(build_config(raw), tmp_path).run()
    assert np.isfinite(result.final["personal/acc"]) and "fedgh/header_loss" in result.final
    client = FedGHClient(
        ClientContext("tiny_a", SHAPE, 10, CPU, TrainConfig()), FedGHParams(freeze_header=True)
    )
    head = {"weight": np.full((10, 16), 0.1, np.float32), "bias": np.arange(10, dtype=np.float32)}
    client.receive(head, RND)

    class OneBatch:
        num_samples = 8
        device = CPU

        def run(self, step, modules, epochs=None, params=None, lr=None):
            if params is None:  # as the engine's trainer: every parameter that takes a gradient
                params = [p for m in modules for p in m.parameters() if p.requires_grad]
            opt = torch.optim.SGD(list(params), lr=0.5)
            x, y = torch.randn(8, *SHAPE), torch.arange(8) % 10
            opt.zero_grad()
            step(x, y).backward()
            opt.step()
            return {"loss": 0.0}

        def batches(self, split="train", shuffle=False):
            yield torch.randn(8, *SHAPE), torch.arange(8) % 10

    encoder_before = client.model.encoder[1].weight.detach().clone()
    client.fit(OneBatch())
    np.testing.assert_array_equal(client.model.head.bias.detach().numpy(), head["bias"])
    assert client.model.head.weight.grad is None  # the frozen header took no gradient
    assert not torch.equal(client.model.encoder[1].weight, encoder_before)  # the extractor trained
    assert client.upload()["means"].shape == (10, 16)

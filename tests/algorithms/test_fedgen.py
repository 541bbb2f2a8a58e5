"""FedGen: the heads' ensemble, the server's generator training and head averaging, the client's
loss on generated features."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fedgen import (
    FedGenClient,
    FedGenParams,
    FedGenServer,
    ensemble_logits,
    sample_labels,
)

RND = RoundContext(1, 2)
CPU = torch.device("cpu")
SHAPE = (1, 8, 8)


def test_ensemble_logits_by_hand():
    head = nn.Linear(2, 2)
    states = [
        {"weight": torch.eye(2), "bias": torch.zeros(2)},
        {"weight": 2 * torch.eye(2), "bias": torch.tensor([1.0, 0.0])},
    ]
    z = torch.tensor([[1.0, 2.0]])
    # 0.25 (1, 2) + 0.75 ((2, 4) + (1, 0)) = (2.5, 3.5)
    out = ensemble_logits(head, states, np.array([0.25, 0.75]), z)
    torch.testing.assert_close(out, torch.tensor([[2.5, 3.5]]))


def test_labels_follow_the_counts():
    torch.manual_seed(0)
    labels = sample_labels(torch.tensor([0.0, 1.0, 3.0]), 4000)
    assert set(labels.tolist()) == {1, 2}
    assert (labels == 2).float().mean().item() == pytest.approx(0.75, abs=0.03)


def head_state(scale: float) -> dict[str, np.ndarray]:
    return {
        "head.weight": np.full((3, 16), scale, np.float32),
        "head.bias": np.array([scale, 0, 0], np.float32),
    }


def test_server_trains_the_generator_then_averages_the_heads():
    ctx = ServerContext(("tiny_a",), {"tiny_a": 3}, SHAPE, 3, CPU, TrainConfig(batch_size=16), 0, 3)
    server = FedGenServer(ctx, FedGenParams(server_epochs=30, hidden_dim=8, noise_dim=4))
    first = server.broadcast("tiny_a", RND)
    assert first["label_counts"].tolist() == [0, 0, 0]  # nothing known before the first upload
    a = {**head_state(1.0), "label_counts": np.array([4, 0, 0], np.float32)}
    b = {**head_state(3.0), "label_counts": np.array([0, 6, 0], np.float32)}
    server.aggregate([Reply(0, "tiny_a", 10, a), Reply(2, "tiny_a", 30, b)], RND)
    torch.manual_seed(0)
    metrics = server.update(None, RND)  # needs no server data
    assert 0 < metrics["fedgen/generator_loss"] < math.log(3) + 1
    after = server.broadcast("tiny_a", RND)
    np.testing.assert_allclose(
        after["head.weight"], np.full((3, 16), 2.5)
    )  # (1 * 10 + 3 * 30) / 40
    np.testing.assert_allclose(after["head.bias"], [2.5, 0, 0])
    assert after["label_counts"].tolist() == [4, 6, 0]
    assert not np.allclose(after["gen.out.weight"], first["gen.out.weight"])
    # a client's later upload replaces its own counts, the others' stay
    c = {**head_state(0.0), "label_counts": np.array([0, 0, 1], np.float32)}
    server.aggregate([Reply(2, "tiny_a", 30, c)], RoundContext(2, 2))
    assert server.broadcast("tiny_a", RND)["label_counts"].tolist() == [4, 0, 1]


def test_client_adds_the_generated_samples_loss_once_counts_are_known():
    ctx = ClientContext("tiny_a", SHAPE, 3, CPU, TrainConfig(batch_size=8))
    client = FedGenClient(ctx, FedGenParams(hidden_dim=8, noise_dim=4))
    server = FedGenServer(
        ServerContext(("tiny_a",), {"tiny_a": 1}, SHAPE, 3, CPU, TrainConfig(), 0, 1),
        FedGenParams(hidden_dim=8, noise_dim=4),
    )
    payload = server.broadcast("tiny_a", RND)
    zero = {k: np.zeros_like(v) if k.startswith("head.") else v for k, v in payload.items()}
    client.receive(zero, RND)  # a zero head: every CE is log 3
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    assert client.training_step(x, y).item() == pytest.approx(math.log(3))
    client.receive({**zero, "label_counts": np.array([1, 0, 0], np.float32)}, RND)
    assert client.training_step(x, y).item() == pytest.approx(2 * math.log(3))

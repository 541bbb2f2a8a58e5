"""LG-FedAvg: only the head travels; the server averages heads by sample count."""

import numpy as np
import torch

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import (
    ClientContext,
    NoParams,
    Reply,
    RoundContext,
    ServerContext,
    TrainConfig,
)
from rayfl.algorithms.lg_fedavg import LGFedAvgClient, LGFedAvgServer

RND = RoundContext(1, 2)  # round 1 of 2

SHAPE = (1, 8, 8)
CPU = torch.device("cpu")


def make_server() -> LGFedAvgServer:
    ctx = ServerContext(
        ("tiny_a", "tiny_b"), {"tiny_a": 1, "tiny_b": 1}, SHAPE, 3, CPU, TrainConfig(), 0, 2
    )
    return LGFedAvgServer(ctx, NoParams())


def test_server_averages_heads_by_samples_golden():
    server = make_server()
    head = {"weight": np.ones((3, 16), np.float32), "bias": np.zeros(3, np.float32)}
    other = {"weight": 3 * np.ones((3, 16), np.float32), "bias": np.full(3, 4.0, np.float32)}
    server.aggregate([Reply(0, "tiny_a", 10, head), Reply(1, "tiny_b", 30, other)], RND)
    out = server.broadcast("tiny_a", RND)
    # (10 * 1 + 30 * 3) / 40 = 2.5 and (10 * 0 + 30 * 4) / 40 = 3
    np.testing.assert_allclose(out["weight"], 2.5)
    np.testing.assert_allclose(out["bias"], 3.0)


def test_client_receives_and_uploads_only_the_head():
    torch.manual_seed(0)
    ctx = ClientContext("tiny_b", SHAPE, 3, CPU, TrainConfig())
    client = LGFedAvgClient(ctx, NoParams())
    encoder_before = {k: v.clone() for k, v in client.model.encoder.state_dict().items()}
    payload = {
        "weight": np.full((3, 16), 0.5, np.float32),
        "bias": np.array([1.0, 2.0, 3.0], np.float32),
    }
    client.receive(payload, RND)
    torch.testing.assert_close(client.model.head.bias, torch.tensor([1.0, 2.0, 3.0]))
    for k, v in client.model.encoder.state_dict().items():
        torch.testing.assert_close(v, encoder_before[k])
    assert set(client.upload()) == {"weight", "bias"}
    assert ALGORITHMS.get("lg_fedavg").needs_common_feature_dim

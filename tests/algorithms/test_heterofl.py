"""HeteroFL: width slices go down, every entry is averaged over the clients that hold it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import rayfl.algorithms.heterofl  # noqa: F401  (registration)
from rayfl.algorithms.base import Reply, RoundContext, ServerContext, TrainConfig, to_numpy
from rayfl.algorithms.heterofl import (
    HeteroFLParams,
    HeteroFLServer,
    build_width_model,
    check_width_family,
)
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)  # round 1 of 2

ARCHS = ("resnet18_w1", "resnet18_w2", "resnet18_w3")
IN_SHAPE = (1, 8, 8)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Small ops on an oversubscribed 2-core machine are ~100x slower with 2 spinning threads; the
    # engine's runners use one thread per worker too.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def server_ctx(archs: tuple[str, ...] = ARCHS) -> ServerContext:
    return ServerContext(
        architectures=archs,
        arch_counts={a: 1 for a in archs},
        in_shape=IN_SHAPE,
        num_classes=10,
        device=torch.device("cpu"),
        train=TrainConfig(),
        seed=0,
        num_clients=len(archs),
    )


def make_server(weighting: str = "uniform") -> HeteroFLServer:
    torch.manual_seed(0)
    return HeteroFLServer(
        server_ctx(), HeteroFLParams(global_arch="resnet18_w3", weighting=weighting)
    )


def test_broadcast_is_the_leading_slice_and_loads_into_the_client_model():
    server = make_server()
    g = server.model.state_dict()
    payload = server.broadcast("resnet18_w1", RND)
    client = build_width_model("resnet18_w1", IN_SHAPE, 10, HeteroFLParams())
    client.load_state_dict({k: torch.from_numpy(v) for k, v in payload.items()}, strict=True)
    c = client.encoder.conv1.out_channels
    assert c == 6  # round(64 * 0.1)
    assert torch.equal(client.encoder.conv1.weight, g["encoder.conv1.weight"][:c])
    assert torch.equal(client.head.weight, g["head.weight"][:, : client.feature_dim])
    # static BN: no running statistics travel
    assert not any("running" in k or "num_batches" in k for k in payload)


def test_aggregating_unchanged_slices_returns_the_global_model_bit_for_bit():
    server = make_server()
    before = to_numpy(server.model.state_dict())
    replies = [
        Reply(i, arch, 10 * (i + 1), server.broadcast(arch, RND))
        for i, arch in enumerate(ARCHS * 2)
    ]
    server.aggregate(replies, RND)
    after = to_numpy(server.model.state_dict())
    assert set(before) == set(after)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


@pytest.mark.parametrize(("weighting", "shared"), [("uniform", 2.0), ("samples", 2.5)])
def test_every_entry_is_averaged_over_its_holders(weighting, shared):
    server = make_server(weighting)
    before = server.model.state_dict()
    ones = {k: np.ones_like(v) for k, v in server.broadcast("resnet18_w1", RND).items()}
    threes = {k: np.full_like(v, 3.0) for k, v in server.broadcast("resnet18_w2", RND).items()}
    server.aggregate([Reply(0, "resnet18_w1", 1, ones), Reply(1, "resnet18_w2", 3, threes)], RND)
    w = server.model.state_dict()["encoder.conv1.weight"]  # 19 output channels at width 0.3
    c1, c2 = ones["encoder.conv1.weight"].shape[0], threes["encoder.conv1.weight"].shape[0]
    assert (c1, c2, w.shape[0]) == (6, 13, 19)
    assert torch.all(w[:c1] == shared)  # held by both clients
    assert torch.all(w[c1:c2] == 3.0)  # held by the wider client only
    assert torch.equal(w[c2:], before["encoder.conv1.weight"][c2:])  # held by nobody: unchanged
    head = server.model.state_dict()["head.weight"]  # (10, 154): classes are full in every slice
    f1 = ones["head.weight"].shape[1]
    assert torch.all(head[:, :f1] == shared)


def test_width_family_checks():
    with pytest.raises(ConfigError, match="width-scaled"):
        check_width_family(["resnet18_w1", "tiny_a"], HeteroFLParams())
    with pytest.raises(ConfigError, match="wider than algorithm.global_arch"):
        check_width_family(["resnet18_w5"], HeteroFLParams(global_arch="resnet18_w4"))
    with pytest.raises(ConfigError, match="algorithm.global_arch"):
        HeteroFLParams(global_arch="cnn_small")
    with pytest.raises(ConfigError, match="wider"):
        HeteroFLServer(server_ctx(("resnet18_w3",)), HeteroFLParams(global_arch="resnet18_w2"))
    check_width_family(list(ARCHS), HeteroFLParams(global_arch="resnet18_w3"))  # fits: no error


def test_scaler_divides_by_the_width_only_in_training():
    model = build_width_model("resnet18_w2", IN_SHAPE, 10, HeteroFLParams())
    scaler = model.encoder.scaler1
    x = torch.ones(2, 3)
    assert torch.allclose(scaler.train()(x), x / 0.2)
    assert torch.equal(scaler.eval()(x), x)


@pytest.mark.slow
def test_two_rounds_on_synthetic_data(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "heterofl", "global_arch": "resnet18_w2"}
    raw["model"] = {"architectures": ["resnet18_w1", "resnet18_w2"]}
    raw["data"]["num_clients"] = 4
    result = Simulation(build_config(raw), tmp_path).run()
    assert result.status == "FINISHED" and len(result.history) == 2
    for row in result.history:
        assert all(math.isfinite(v) for v in row.values()), row
    final = result.final
    assert 0.0 <= final["global/acc"] <= 1.0
    assert {"personal/acc/arch=resnet18_w1", "personal/acc/arch=resnet18_w2"} <= set(final)
    # all 4 clients train each round; bytes up equal bytes down (the same slices travel)
    assert final["comm/bytes_up"] == final["comm/bytes_down"] > 0

"""FedMRL: the shared model pooled to `sub_feature_dim`, the Matryoshka loss and model."""

import math

import pytest
import torch
from torch import nn

from rayfl.algorithms.base import ClientContext, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fedmrl import FedMRLClient, FedMRLParams, FedMRLServer, shared_model
from rayfl.errors import ConfigError
from rayfl.models import build_model

CPU = torch.device("cpu")
SHAPE = (1, 8, 8)
RND = RoundContext(1, 2)


def test_shared_model_pools_its_features_to_sub_feature_dim():
    torch.manual_seed(0)
    own = shared_model(FedMRLParams(extractor="tiny_a"), ["tiny_b"], SHAPE, 10)
    assert own.feature_dim == 16 and isinstance(own.head, nn.Linear)
    pooled = shared_model(
        FedMRLParams(extractor="tiny_a", sub_feature_dim=8), ["tiny_b"], SHAPE, 10
    )
    assert pooled.feature_dim == 8 and pooled.head.in_features == 8
    x = torch.randn(3, *SHAPE)
    full = pooled.encoder[0](x)  # tiny_a's 16 features: pooled pairwise into 8
    torch.testing.assert_close(pooled.features(x), (full[:, 0::2] + full[:, 1::2]) / 2)
    with pytest.raises(ConfigError, match="sub_feature_dim"):
        shared_model(FedMRLParams(extractor="tiny_a", sub_feature_dim=17), ["tiny_a"], SHAPE, 10)


def test_default_shared_model_is_the_family_smallest():
    model = shared_model(FedMRLParams(), ["tiny_b", "tiny_a"], SHAPE, 10)
    reference = build_model("tiny_a", SHAPE, 10)
    assert [p.shape for p in model.parameters()] == [p.shape for p in reference.parameters()]


def test_loss_sums_both_headers_and_the_model_uses_the_local_one():
    ctx = ClientContext("tiny_b", SHAPE, 10, CPU, TrainConfig(), ("tiny_a", "tiny_b"))
    client = FedMRLClient(ctx, FedMRLParams(sub_feature_dim=4))
    assert client.projector.in_features == 4 + 16 and client.projector.out_features == 16
    x, y = torch.randn(5, *SHAPE), torch.arange(5)
    for head in (client.model.head, client.shared.head):
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    assert client.training_step(x, y).item() == pytest.approx(2 * math.log(10))
    nn.init.normal_(client.model.head.weight)
    r = client.projector(torch.cat([client.shared.features(x), client.model.features(x)], 1))
    torch.testing.assert_close(client.eval_model()(x), client.model.head(r))
    # the received shared model replaces the client's copy; the projector stays
    server = FedMRLServer(
        ServerContext(
            ("tiny_a", "tiny_b"), {"tiny_a": 1, "tiny_b": 1}, SHAPE, 10, CPU, TrainConfig(), 0, 2
        ),
        FedMRLParams(sub_feature_dim=4),
    )
    projector = client.projector.weight.detach().clone()
    client.receive(server.broadcast("tiny_b", RND), RND)
    torch.testing.assert_close(client.shared.head.weight, server.shared.head.weight)
    assert torch.equal(client.projector.weight, projector)
    assert set(client.upload()) == set(server.broadcast("tiny_b", RND))


def test_shared_representation_must_nest_in_every_client_representation():
    ctx = ServerContext(
        ("cnn1", "mlp"), {"cnn1": 1, "mlp": 1}, (1, 28, 28), 10, CPU, TrainConfig(), 0, 2
    )
    with pytest.raises(ConfigError, match="mlp's feature size 128"):
        FedMRLServer(ctx, FedMRLParams(extractor="cnn1"))  # cnn1 has 500 features
    assert (
        FedMRLServer(ctx, FedMRLParams(extractor="cnn1", sub_feature_dim=100)).shared.feature_dim
        == 100
    )

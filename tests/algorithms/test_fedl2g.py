"""FedL2G: the meta-gradient of the guide through one look-ahead step, and the guide's update."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from rayfl.algorithms.base import Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fedl2g import (
    FedL2GParams,
    FedL2GServer,
    meta_gradient,
    split_study_quiz,
)
from rayfl.errors import ConfigError
from rayfl.models.base import SplitModel

RND = RoundContext(1, 2)
CPU = torch.device("cpu")


def scalar_model() -> SplitModel:
    """features = a * x (a = 1), logits = w * features (w = (0, 0))."""
    encoder, head = nn.Linear(1, 1, bias=False), nn.Linear(1, 2, bias=False)
    nn.init.ones_(encoder.weight)
    nn.init.zeros_(head.weight)
    return SplitModel(encoder, head, 1)


@pytest.mark.parametrize("g0", [0.0, 2.0])
def test_meta_gradient_by_hand(g0):
    # study (x=1, y=0): pseudo = CE([0, 0], 0) + (a - g0)^2, so with lr 1/2 the look-ahead has
    # a' = 1 - (1/2) 2 (1 - g0) = g0 and w' = -(1/2)(p - e0) = (1/4, -1/4). The quiz (x=1, y=0)
    # then scores logits (g0/4, -g0/4): L = log(1 + exp(-g0/2)), dL/dg0 = -sigmoid(-g0/2)/2;
    # class 1 is not studied, so its row gets no gradient.
    model = scalar_model()
    guide = torch.tensor([[g0], [5.0]])
    batch = (torch.tensor([[1.0]]), torch.tensor([0]))
    grad, loss = meta_gradient(model, guide, [batch], [batch], lr=0.5, kind="feature")
    sigmoid = 1 / (1 + math.exp(g0 / 2))
    assert loss == pytest.approx(math.log(1 + math.exp(-g0 / 2)))
    torch.testing.assert_close(grad, torch.tensor([[-sigmoid / 2], [0.0]]))
    assert torch.equal(model.encoder.weight, torch.ones(1, 1))  # the model itself never moved
    assert model.head.weight.grad is None


def test_without_a_step_the_quiz_does_not_depend_on_the_guide():
    model = scalar_model()
    batch = (torch.tensor([[1.0], [2.0]]), torch.tensor([0, 1]))
    grad, _ = meta_gradient(model, torch.ones(2, 2), [batch], [batch], lr=0.0, kind="logit")
    assert torch.equal(grad, torch.zeros(2, 2))


def test_the_last_samples_are_the_held_out_quiz_set():
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    torch.manual_seed(0)
    n_train, study, quiz = split_study_quiz(x, y, study=1, quiz=1, batch_size=4)
    assert n_train == 6 and [b[1].tolist() for b in quiz] == [[6, 7, 8, 9]]
    assert len(study) == 1 and len(study[0][1]) == 4 and max(study[0][1].tolist()) < 6
    torch.testing.assert_close(study[0][0].squeeze(1), study[0][1].float())  # pairs kept
    n_train, study, quiz = split_study_quiz(x[:3], y[:3], study=1, quiz=2, batch_size=4)
    assert n_train == 2 and [b[1].tolist() for b in quiz] == [[2]]  # at most half is held out
    assert sorted(study[0][1].tolist()) == [0, 1]


def server(**params) -> FedL2GServer:
    ctx = ServerContext(("tiny_a",), {"tiny_a": 2}, (1, 8, 8), 2, CPU, TrainConfig(), 0, 2)
    s = FedL2GServer(ctx, FedL2GParams(guide="logit", **params))
    s.guide = np.zeros((2, 2), np.float32)
    return s


def test_server_averages_each_class_over_the_clients_that_cover_it_then_clips_and_steps():
    a = {"means": np.array([[1, 0], [0, 0]], np.float32), "counts": np.array([1, 0], np.float32)}
    b = {"means": np.array([[3, 0], [2, 0]], np.float32), "counts": np.array([1, 1], np.float32)}
    replies = [Reply(0, "tiny_a", 5, a), Reply(1, "tiny_a", 50, b)]
    s = server(server_lr=0.5)
    metrics = s.aggregate(replies, RND)  # mean gradient [[2, 0], [2, 0]], whatever the samples
    assert metrics == {"fedl2g/classes_guided": 2.0, "fedl2g/grad_norm": pytest.approx(8**0.5)}
    np.testing.assert_allclose(s.broadcast("tiny_a", RND)["means"], [[-1, 0], [-1, 0]])
    s = server(server_lr=0.5, clip=1.0)  # the gradient scaled to norm 1
    s.aggregate(replies, RND)
    np.testing.assert_allclose(s.guide, -0.5 * np.array([[1, 0], [1, 0]]) / 2**0.5, rtol=1e-6)


def test_feature_guidance_needs_one_feature_size():
    ctx = ServerContext(
        ("cnn1", "mlp"), {"cnn1": 1, "mlp": 1}, (1, 28, 28), 10, CPU, TrainConfig(), 0, 2
    )
    with pytest.raises(ConfigError, match="guide=logit"):
        FedL2GServer(ctx, FedL2GParams())
    assert FedL2GServer(ctx, FedL2GParams(guide="logit")).guide.shape == (10, 10)

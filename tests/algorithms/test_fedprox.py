"""FedProx: the proximal term's golden numbers and its pull towards the global model."""

import pytest
import torch
from torch import nn

from rayfl.algorithms.base import ClientContext, TrainSettings
from rayfl.algorithms.fedavg import FedAvgServer
from rayfl.algorithms.fedprox import FedProxClient, FedProxParams, proximal_term
from rayfl.errors import ConfigError
from rayfl.registry import ALGORITHMS

SHAPE = (1, 8, 8)


def test_proximal_term_golden():
    w = nn.Parameter(torch.tensor([3.0, -1.0]))
    b = nn.Parameter(torch.tensor([2.0]))
    anchors = [torch.tensor([1.0, 1.0]), torch.tensor([2.0])]
    # mu/2 * ((3-1)^2 + (-1-1)^2 + 0) = 0.25 * 8 = 2
    term = proximal_term([w, b], anchors, mu=0.5)
    assert term.item() == pytest.approx(2.0)
    term.backward()
    # gradient mu * (w - anchor)
    torch.testing.assert_close(w.grad, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(b.grad, torch.tensor([0.0]))


def test_client_step_is_ce_plus_the_proximal_term():
    torch.manual_seed(0)
    ctx = ClientContext("tiny_a", SHAPE, 3, torch.device("cpu"), TrainSettings())
    client = FedProxClient(ctx, FedProxParams(mu=2.0))
    client.receive({k: v.numpy().copy() for k, v in client.model.state_dict().items()})
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    ce = nn.functional.cross_entropy(client.model(x), y).item()
    # at the anchor the term is zero
    assert client.training_step(x, y).item() == pytest.approx(ce)
    with torch.no_grad():
        client.model.head.bias += 0.5  # 3 entries moved by 0.5: mu/2 * 3 * 0.25 = 0.75
    ce_moved = nn.functional.cross_entropy(client.model(x), y).item()
    assert client.training_step(x, y).item() == pytest.approx(ce_moved + 0.75, rel=1e-6)


def test_registered_as_homogeneous_with_fedavg_server():
    algo = ALGORITHMS.get("fedprox")
    assert algo.needs_homogeneous and algo.server is FedAvgServer and algo.params is FedProxParams
    with pytest.raises(ConfigError, match="algorithm.mu"):
        FedProxParams(mu=-1.0)

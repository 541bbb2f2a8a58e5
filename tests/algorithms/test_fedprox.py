"""FedProx: the proximal term's golden numbers and its pull towards the global model."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import ClientContext, RoundContext, TrainConfig
from rayfl.algorithms.fedavg import FedAvgServer
from rayfl.algorithms.fedprox import FedProxClient, FedProxParams, proximal_term
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)  # round 1 of 2

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
    ctx = ClientContext("tiny_a", SHAPE, 3, torch.device("cpu"), TrainConfig())
    client = FedProxClient(ctx, FedProxParams(mu=2.0))
    client.receive({k: v.numpy().copy() for k, v in client.model.state_dict().items()}, RND)
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


class DecayingProxClient(FedProxClient):
    """A schedule written against the round context alone: mu falls linearly to 0 at the last round."""

    def receive(self, payload, rnd: RoundContext) -> None:
        super().receive(payload, rnd)
        self.params = replace(self.params, mu=2.0 * (1 - rnd.fraction))


def test_a_decaying_mu_schedule_can_be_written_with_the_round_context():
    torch.manual_seed(0)
    ctx = ClientContext("tiny_a", SHAPE, 3, torch.device("cpu"), TrainConfig())
    client = DecayingProxClient(ctx, FedProxParams(mu=2.0))
    start = {k: v.numpy().copy() for k, v in client.model.state_dict().items()}
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    terms = []
    for index in (1, 2, 4):
        client.receive(start, RoundContext(index, 4))
        with torch.no_grad():
            client.model.head.bias += 0.5  # 3 entries moved by 0.5: mu/2 * 0.75
        ce = nn.functional.cross_entropy(client.model(x), y).item()
        terms.append(client.training_step(x, y).item() - ce)
    # mu = 2 * (1 - index/4) = 1.5, 1.0, 0.0 -> term = mu * 0.375
    assert terms == pytest.approx([0.5625, 0.375, 0.0], abs=1e-5)


def test_the_engine_hands_both_halves_the_round_and_the_total(synthetic_raw, monkeypatch, tmp_path):
    seen: dict[str, list[tuple[int, int]]] = {"receive": [], "broadcast": [], "aggregate": []}

    def spy(cls, hook):
        original = getattr(cls, hook)

        def wrapped(self, first, rnd):
            seen[hook].append((rnd.index, rnd.total))
            return original(self, first, rnd)

        monkeypatch.setattr(cls, hook, wrapped)

    spy(FedProxClient, "receive")
    for hook in ("broadcast", "aggregate"):
        spy(FedAvgServer, hook)
    overrides = ["algorithm.name=fedprox", "model.architectures=[tiny_a]", "engine.rounds=3"]
    cfg = build_config(synthetic_raw, overrides + ["data.num_clients=3"])
    Simulation(cfg, tmp_path).run()
    assert sorted(set(seen["receive"])) == [(1, 3), (2, 3), (3, 3)]
    # three clients a round, each receiving twice: to train, and after the server step to
    # score the model it would deploy (eval.protocol=deployed)
    assert len(seen["receive"]) == 18
    # one architecture: the round's broadcast, then the one the deployed evaluation scores
    assert seen["broadcast"] == [(1, 3), (1, 3), (2, 3), (2, 3), (3, 3), (3, 3)]
    assert seen["aggregate"] == [(1, 3), (2, 3), (3, 3)]

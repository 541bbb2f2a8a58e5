"""pFedES `variant: stats`: golden distillation loss, statistics upload, and the contract."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayfl.algorithms.base import ClientContext, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.pfedes import PFedESClient, PFedESParams, PFedESServer
from rayfl.algorithms.pfedes_stats import PFedESStatsClient, PFedESStatsServer, class_kd_loss
from tests.algorithms import test_contract

CPU = torch.device("cpu")


def test_class_kd_loss_golden():
    # Student uniform over 2 classes; class 0's table row is (0.75, 0.25), class 1 is unknown.
    logits = torch.zeros(2, 2)
    labels = torch.tensor([0, 1])
    table = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    counts = torch.tensor([3.0, 0.0])
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # 0.1308121...
    got = class_kd_loss(logits, labels, table, counts, temperature=1.0)
    assert float(got) == pytest.approx(kl / 2, abs=1e-6)  # the unknown sample counts as zero
    # T = 2: the uniform student stays uniform, the loss is scaled by T^2
    got2 = class_kd_loss(logits, labels, table, counts, temperature=2.0)
    assert float(got2) == pytest.approx(4 * kl / 2, abs=1e-6)


def test_variant_stats_builds_its_own_halves():
    params = PFedESParams(variant="stats", T=2.0)
    train = TrainConfig()
    ctx = ClientContext("tiny_a", (1, 8, 8), 3, CPU, train)
    client = PFedESClient(ctx, params)
    assert isinstance(client, PFedESStatsClient)
    sctx = ServerContext(("tiny_a",), {"tiny_a": 2}, (1, 8, 8), 3, CPU, train, 0, 2)
    server = PFedESServer(sctx, params)
    assert isinstance(server, PFedESStatsServer)
    down = server.broadcast("tiny_a", RoundContext(1, 2))
    assert down["means"].shape == (3, 3) and not down["counts"].any()


def test_uploaded_statistics_are_class_mean_soft_predictions():
    params = PFedESParams(variant="stats", T=2.0)
    ctx = ClientContext("tiny_a", (1, 8, 8), 3, CPU, TrainConfig())
    client = PFedESClient(ctx, params)
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 0, 1, 1, 1, 2])

    class OneBatch:
        def run(self, step, modules, **_):
            return {"loss": 0.0}

        def batches(self, split="train", shuffle=False):
            return iter([(x, y)])

    client.fit(OneBatch())
    up = client.upload()
    with torch.no_grad():
        probs = torch.softmax(client.model(x) / 2.0, 1).numpy()
    np.testing.assert_allclose(up["counts"], [2, 3, 1])
    np.testing.assert_allclose(up["means"][1], probs[2:5].mean(0), rtol=1e-5)
    np.testing.assert_allclose(up["means"].sum(1), 1.0, rtol=1e-5)  # rows are distributions


def test_contract_variant_stats(tmp_path, monkeypatch):
    monkeypatch.setitem(test_contract.CONTRACT_PARAMS, "pfedes", {"variant": "stats"})
    test_contract.test_contract("pfedes", tmp_path)

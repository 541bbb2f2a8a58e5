"""FedMD: consensus of public-set scores, digest then revisit."""

import numpy as np
import pytest
import torch

from rayfl.algorithms.base import RoundContext
from rayfl.algorithms.fedmd import FedMDParams, consensus, digest_loss
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)  # round 1 of 2


def test_consensus_is_the_plain_average():
    a = np.array([[1.0, 2.0], [0.0, 0.0]], np.float32)
    b = np.array([[3.0, 0.0], [6.0, -3.0]], np.float32)
    np.testing.assert_allclose(consensus([a, b]), [[2.0, 1.0], [3.0, -1.5]])


def test_digest_losses_golden():
    logits = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    target = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    assert digest_loss(logits, target, "l1").item() == pytest.approx((1 + 2 + 0 + 2) / 4)
    assert digest_loss(logits, target, "mse").item() == pytest.approx((1 + 4 + 0 + 4) / 4)


def test_rounds_communicate_then_digest(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedmd", "public_samples": 50, "digest_loss": "mse"}
    raw["data"]["public_fraction"] = 0.2
    raw["engine"]["rounds"] = 3
    history = Simulation(build_config(raw), tmp_path).run().history
    # every round, 6 clients upload 50 x 10 logits on the public set they all hold
    assert [r["comm/bytes_up"] for r in history] == [6 * 50 * 10 * 4] * 3
    # round 1: no consensus yet (nothing goes down, nothing to digest)
    assert history[0]["comm/bytes_down"] == 0.0
    assert "train/fedmd/digest_loss" not in history[0]
    # rounds 2 and 3: only the 50 x 10 consensus goes down, and clients digest it first
    assert history[1]["comm/bytes_down"] == 6 * 50 * 10 * 4
    assert np.isfinite(history[1]["train/fedmd/digest_loss"])
    assert np.isfinite(history[2]["personal/acc"])


def test_digest_moves_the_public_scores_to_the_consensus():
    from rayfl.algorithms.base import ClientContext, TrainConfig
    from rayfl.algorithms.fedmd import FedMDClient
    from rayfl.data.datasets import load_dataset
    from rayfl.engine.training import ArrayBatches, LocalTrainer

    torch.manual_seed(0)
    ds = load_dataset("synthetic", num_samples=200, num_test=20, shape=(1, 8, 8), num_classes=3)
    settings = TrainConfig(local_epochs=0, batch_size=10, lr=0.05)
    client = FedMDClient(
        ClientContext("tiny_a", (1, 8, 8), 3, torch.device("cpu"), settings),
        FedMDParams(public_samples=20, digest_epochs=30, digest_loss="mse"),
    )
    public = ArrayBatches(ds, np.arange(100, 140), torch.device("cpu"))
    trainer = LocalTrainer(
        ds,
        np.arange(50),
        np.arange(50, 60),
        settings,
        torch.device("cpu"),
        torch.Generator().manual_seed(0),
        public=lambda: public,
    )
    target = np.tile(np.array([[3.0, -1.0, 0.5]], dtype=np.float32), (20, 1))
    before = float(((client._public_scores(trainer) - target) ** 2).mean())
    client.receive({"consensus": target}, RND)
    metrics = client.fit(trainer)
    after = float(((client.upload()["scores"] - target) ** 2).mean())
    assert client.upload()["scores"].shape == (20, 3)
    assert after < 0.1 * before
    assert metrics["fedmd/digest_loss"] > 0


def test_refuses_a_run_without_public_data(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedmd"}
    with pytest.raises(ConfigError, match="public"):
        Simulation(build_config(raw), tmp_path)
    with pytest.raises(ConfigError, match="algorithm.public_samples"):
        FedMDParams(public_samples=0)

"""FedMD: consensus of public-set scores, digest then revisit."""

import numpy as np
import pytest
import torch

from rayfl.algorithms.fedmd import FedMDParams, consensus, digest_loss
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError


def test_consensus_is_the_plain_average():
    a = np.array([[1.0, 2.0], [0.0, 0.0]], np.float32)
    b = np.array([[3.0, 0.0], [6.0, -3.0]], np.float32)
    np.testing.assert_allclose(consensus([a, b]), [[2.0, 1.0], [3.0, -1.5]])


def test_digest_losses_golden():
    logits = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    target = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    assert digest_loss(logits, target, "l1").item() == pytest.approx((1 + 2 + 0 + 2) / 4)
    assert digest_loss(logits, target, "mse").item() == pytest.approx((1 + 4 + 0 + 4) / 4)


def test_rounds_revisit_then_communicate_then_digest(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedmd", "public_samples": 50, "digest_loss": "mse"}
    raw["data"]["public_fraction"] = 0.2
    raw["engine"]["rounds"] = 3
    history = Simulation(build_config(raw), tmp_path).run().history
    # round 1: the server has not seen the public split yet: no scores travel
    assert history[0]["comm/bytes_up"] == 0.0
    # round 2: 6 clients upload 50 x 10 logits; the public inputs went down
    assert history[1]["comm/bytes_up"] == 6 * 50 * 10 * 4
    assert history[1]["comm/bytes_down"] == 6 * 50 * 64 * 4
    assert "train/fedmd/digest_loss" not in history[1]
    # round 3: clients digest the consensus before revisiting
    assert np.isfinite(history[2]["train/fedmd/digest_loss"])
    assert np.isfinite(history[2]["personal/acc"])


def test_refuses_a_run_without_public_data(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedmd"}
    with pytest.raises(ConfigError, match="public"):
        Simulation(build_config(raw), tmp_path)
    with pytest.raises(ConfigError, match="algorithm.public_samples"):
        FedMDParams(public_samples=0)

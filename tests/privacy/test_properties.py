"""Each protection's effect, pinned so that a broken protection fails a test: SecAgg's simulated
dropout happens, DP noise reaches class statistics too, its std is z * clip, clipping bounds the
update (not the payload), and the statistics-only client learns from the table it gets back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayfl.algorithms.base import ClientContext, Reply, RoundContext, TrainConfig
from rayfl.algorithms.pfedes import PFedESClient, PFedESParams
from rayfl.algorithms.pfedes_stats import class_kd_loss
from rayfl.config import DPConfig, PrivacyConfig, SecAggConfig
from rayfl.privacy.hook import PrivacyHook


def _dp(z: float, clip: float, **kw) -> PrivacyConfig:
    return PrivacyConfig(
        dp=DPConfig(enabled=True, noise_multiplier=z, clip=clip, noise_seed=3, **kw)
    )


def _combine(h, uploads, sent, round_idx=1, weights=None):
    weights = weights or [1] * len(uploads)
    replies = [
        Reply(c, "a", w, h.protect(u, sent, round_idx, c, w))
        for c, (u, w) in enumerate(zip(uploads, weights))
    ]
    (combined,), metrics = h.combine(replies, round_idx, {"a": sent})
    return combined, metrics, replies


def test_secagg_dropout_loses_about_the_configured_share_and_averages_the_survivors():
    cfg = PrivacyConfig(secagg=SecAggConfig(enabled=True, dropout=0.3, threshold=0.2))
    h = PrivacyHook(cfg, "weighted_mean", seed=0, num_clients=8, per_round=8)
    sent = {"w": np.zeros(3, np.float32)}
    rng = np.random.default_rng(1)
    dropped = 0
    for rnd in range(1, 26):
        ups = [{"w": rng.normal(size=3).astype(np.float32)} for _ in range(8)]
        combined, metrics, replies = _combine(h, ups, sent, rnd, weights=list(range(1, 9)))
        lost = [r.client_id for r in replies if not r.payload]
        assert metrics["privacy/dropped"] == len(lost)
        kept = [c for c in range(8) if c not in lost]
        expected = sum((c + 1) * ups[c]["w"].astype(np.float64) for c in kept)
        expected /= sum(c + 1 for c in kept)
        np.testing.assert_allclose(combined.payload["w"], expected, atol=1e-6)
        dropped += len(lost)
    assert dropped / 200 == pytest.approx(0.3, abs=0.08)  # 25 rounds x 8 clients


def test_dp_noise_reaches_class_statistics():
    # 4 clients, 2 classes of 400-d zero means, all present: after the joint clip (clip 1) each
    # presence entry is 1/sqrt(2); the means are the noise sums over the presence sums
    z, clip, d = 0.05, 1.0, 400
    h = PrivacyHook(_dp(z, clip), "class_means", seed=0, num_clients=4, per_round=4)
    sent = {"means": np.zeros((2, d), np.float32), "counts": np.zeros(2, np.float32)}
    ups = [{"means": np.zeros((2, d), np.float32), "counts": np.ones(2, np.float32)}] * 4
    combined, metrics, _ = _combine(h, ups, sent)
    presence = 4 / np.sqrt(2)
    spread = float(np.std(combined.payload["means"]))
    assert spread == pytest.approx(z * clip / presence, rel=0.1)
    assert 0 < metrics["privacy/epsilon"] < float("inf")


def test_dp_noise_std_is_the_multiplier_times_the_clip():
    z, clip = 2.0, 0.25
    h = PrivacyHook(_dp(z, clip), "weighted_mean", seed=0, num_clients=4, per_round=4)
    assert float(np.std(h.noise(40000, 1))) == pytest.approx(z * clip, rel=0.03)
    sent = {"w": np.zeros(40000, np.float32)}
    combined, _, _ = _combine(h, [{"w": np.zeros(40000, np.float32)}] * 4, sent)
    # the mean update is the noisy sum over the fixed denominator 4
    assert float(np.std(combined.payload["w"])) == pytest.approx(z * clip / 4, rel=0.03)


def test_dp_clips_the_update_not_the_payload():
    h = PrivacyHook(_dp(0.0, 1.0), "weighted_mean", seed=0, num_clients=1, per_round=1)
    sent = {"w": np.array([10.0, 0.0], np.float32)}
    # a large payload whose update (0.3, 0.4) is inside the ball: kept exactly
    combined, _, _ = _combine(h, [{"w": np.array([10.3, 0.4], np.float32)}], sent)
    np.testing.assert_allclose(combined.payload["w"], [10.3, 0.4], atol=1e-6)
    # an update (3, 4) of norm 5: scaled to (0.6, 0.8) and added to the broadcast
    combined, _, _ = _combine(h, [{"w": np.array([13.0, 4.0], np.float32)}], sent)
    np.testing.assert_allclose(combined.payload["w"], [10.6, 0.8], atol=1e-6)


def test_the_stats_client_distils_from_the_table_it_receives():
    params = PFedESParams(variant="stats", T=2.0, alpha=1.0)
    ctx = ClientContext("tiny_a", (1, 8, 8), 3, torch.device("cpu"), TrainConfig())
    client = PFedESClient(ctx, params)
    table = np.array([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]], np.float32)
    counts = np.array([5.0, 0.0, 2.0], np.float32)
    client.receive({"means": table, "counts": counts}, RoundContext(2, 2))
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    with torch.no_grad():
        loss = float(client.training_step(x, y))
        logits = client.model(x)
        ce = float(F.cross_entropy(logits, y))
        kd = float(class_kd_loss(logits, y, torch.tensor(table), torch.tensor(counts), 2.0))
    assert kd > 1e-3
    assert loss == pytest.approx(ce + kd, rel=1e-5)  # the received table, not the empty one


def test_dp_divides_by_the_fixed_denominator_not_by_the_arrivals():
    # 4 expected participants, one upload lost after masking: the noisy sum of the 3 that arrived
    # is divided by q * N = 4 (the fixed-denominator estimator), not by 3
    cfg = PrivacyConfig(
        dp=DPConfig(enabled=True, noise_multiplier=0.0, clip=10.0),
        secagg=SecAggConfig(enabled=True),
    )
    h = PrivacyHook(cfg, "weighted_mean", seed=0, num_clients=4, per_round=4)
    sent = {"w": np.zeros(2, np.float32)}
    replies = [
        Reply(c, "a", 1, {} if c == 2 else h.protect({"w": np.ones(2, np.float32)}, sent, 1, c, 1))
        for c in range(4)
    ]
    (combined,), metrics = h.combine(replies, 1, {"a": sent})
    assert metrics["privacy/dropped"] == 1.0
    np.testing.assert_allclose(combined.payload["w"], [0.75, 0.75], atol=1e-6)

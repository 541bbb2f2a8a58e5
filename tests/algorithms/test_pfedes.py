import numpy as np
import pytest
import torch

from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.pfedes import PFedESClient, PFedESParams, PFedESServer
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)  # round 1 of 2
SHAPE = (1, 8, 8)


def client(**kw):
    ctx = ClientContext("tiny_a", SHAPE, 3, torch.device("cpu"), TrainConfig())
    return PFedESClient(ctx, PFedESParams(**kw))


def server(**kw):
    ctx = ServerContext(
        ("tiny_a",), {"tiny_a": 2}, SHAPE, 3, torch.device("cpu"), TrainConfig(), 0, 2
    )
    return PFedESServer(ctx, PFedESParams(**kw))


def test_kd_step_trains_local_by_ce_and_proxy_by_kd_only():
    torch.manual_seed(0)
    c = client(alpha=0.5, T=2.0)
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    loss = c.training_step(x, y)
    loss.backward()
    local_logits = c.model(x)
    proxy_logits, _ = c.proxy(x)
    ce = torch.nn.functional.cross_entropy(local_logits, y)
    p_t = torch.softmax(local_logits / 2, 1)
    kd = (
        4
        * (p_t * (torch.log_softmax(local_logits / 2, 1) - torch.log_softmax(proxy_logits / 2, 1)))
        .sum(1)
        .mean()
    )
    assert loss.item() == pytest.approx((ce + 0.5 * kd).item(), rel=1e-5)
    # the local model's gradient is the CE gradient alone (the KD target is detached)
    g_local = [p.grad.clone() for p in c.model.parameters()]
    c.model.zero_grad()
    torch.nn.functional.cross_entropy(c.model(x), y).backward()
    for g, p in zip(g_local, c.model.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in c.proxy.parameters())


def test_beta_adds_a_frozen_teacher():
    torch.manual_seed(0)
    c = client(beta=1.0)
    s = server()
    c.receive(s.broadcast("tiny_a", RND), RND)
    assert c.teacher is not None and not any(p.requires_grad for p in c.teacher.parameters())
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    without = client(beta=0.0)
    without.model.load_state_dict(c.model.state_dict())
    without.proxy.load_state_dict(c.proxy.state_dict())
    assert c.training_step(x, y).item() > without.training_step(x, y).item()


def test_server_average_cap_clip_and_ema_golden():
    s = server(weight_cap=None, ema=0.5)
    g = {k: v.copy() for k, v in s.broadcast("a", RND).items()}
    r1 = {k: v + 1.0 for k, v in g.items()}
    r2 = {k: v + 3.0 for k, v in g.items()}
    s.aggregate([Reply(0, "tiny_a", 1, r1), Reply(1, "tiny_a", 3, r2)], RND)
    new = s.broadcast("a", RND)
    # weighted update (1*1 + 3*3)/4 = 2.5, then EMA 0.5 -> +1.25
    for k in g:
        np.testing.assert_allclose(new[k], g[k] + 1.25, rtol=1e-5, atol=1e-5)


def test_server_clip_bounds_each_update():
    s = server(clip_update=1e-3)
    g = {k: v.copy() for k, v in s.broadcast("a", RND).items()}
    big = {k: v + 100.0 for k, v in g.items()}
    s.aggregate([Reply(0, "tiny_a", 1, big)], RND)
    new = s.broadcast("a", RND)
    norm = np.sqrt(sum(float(((new[k] - g[k]) ** 2).sum()) for k in g))
    assert norm == pytest.approx(1e-3, rel=1e-3)


def test_input_variant_trains_two_stages():
    from rayfl.data.datasets import load_dataset
    from rayfl.engine.training import LocalTrainer

    ds = load_dataset("synthetic", num_samples=120, num_test=20, shape=(1, 8, 8), num_classes=3)
    c = client(variant="input", proxy_epochs=1)
    before = {k: v.clone() for k, v in c.proxy.state_dict().items()}
    trainer = LocalTrainer(
        ds,
        np.arange(100),
        np.arange(100, 120),
        TrainConfig(batch_size=20),
        torch.device("cpu"),
        torch.Generator().manual_seed(0),
    )
    out = c.fit(trainer)
    assert np.isfinite(out["loss"]) and np.isfinite(out["pfedes/proxy_loss"])
    assert any(not torch.equal(before[k], v) for k, v in c.proxy.state_dict().items())
    assert sum(p.numel() for p in c.proxy.parameters()) == 8 * 9 + 8 + 8 * 9 + 1


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"alpha": -1}, "algorithm.alpha"),
        ({"T": 0}, "algorithm.T"),
        ({"ema": 1.0}, "algorithm.ema"),
        ({"weight_cap": 0}, "algorithm.weight_cap"),
    ],
)
def test_params_validation(kw, key):
    with pytest.raises(ConfigError, match=key):
        PFedESParams(**kw)

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from rayfl.algorithms import functional
from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.pfedes import (
    VARIANTS,
    PFedESClient,
    PFedESKDClient,
    PFedESParams,
    PFedESServer,
)
from rayfl.algorithms.pfedes_input import PFedESInputClient
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


def synthetic_trainer(batch_size=20):
    from rayfl.data.datasets import load_dataset
    from rayfl.engine.training import LocalTrainer

    ds = load_dataset("synthetic", num_samples=120, num_test=20, shape=(1, 8, 8), num_classes=3)
    return LocalTrainer(
        ds,
        np.arange(100),
        np.arange(100, 120),
        TrainConfig(batch_size=batch_size),
        torch.device("cpu"),
        torch.Generator().manual_seed(0),
    )


def test_variants_are_classes_chosen_from_the_table():
    assert isinstance(client(variant="kd"), PFedESKDClient)
    assert isinstance(client(variant="input"), PFedESInputClient)
    assert set(VARIANTS) >= {"kd", "input"}
    with pytest.raises(ConfigError, match="algorithm.variant"):
        PFedESParams(variant="nope")


def test_kl_local_proxy_compares_with_the_received_global_proxy():
    # Defect: the KL was taken against the proxy after this client's own distillation.
    torch.manual_seed(0)
    c = client(alpha=1.0)
    c.receive(server().broadcast("tiny_a", RND), RND)
    received = {k: v.clone() for k, v in c.proxy.state_dict().items()}
    c.fit(synthetic_trainer())
    assert any(not torch.equal(received[k], v) for k, v in c.proxy.state_dict().items())
    x, y = torch.randn(8, *SHAPE), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    for m in c.modules():
        m.eval()
    with torch.no_grad():
        got = c.eval_metrics(x, y)
    frozen = copy.deepcopy(c.proxy)
    frozen.load_state_dict(received)
    frozen.eval()
    with torch.no_grad():
        g_logits, _ = frozen(x)
        expected = functional.logit_kl(c.model(x), g_logits)
        acc = (g_logits.argmax(1) == y).float().mean()
    assert got["pfedes/kl_local_proxy"] == pytest.approx(float(expected), rel=1e-6)
    assert got["pfedes/proxy_acc"] == pytest.approx(float(acc))


def test_proxy_lr_sets_the_proxy_step_and_alpha_only_weights_the_loss():
    torch.manual_seed(0)
    c = client(alpha=0.1, T=2.0, proxy_lr=0.5)
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    loss = c.training_step(x, y)
    loss.backward()
    local_logits = c.model(x)
    proxy_logits, _ = c.proxy(x)
    ce = torch.nn.functional.cross_entropy(local_logits, y)
    kd = functional.kd_loss(proxy_logits, local_logits.detach(), 2.0)
    assert loss.item() == pytest.approx((ce + 0.1 * kd).item(), rel=1e-5)
    g_proxy = [p.grad.clone() for p in c.proxy.parameters()]
    c.proxy.zero_grad()
    kd.backward()  # the unweighted KD gradient: alpha does not shrink the proxy's step
    for g, p in zip(g_proxy, c.proxy.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_input_variant_reports_the_received_proxy_through_the_local_model():
    torch.manual_seed(0)
    c = client(variant="input", proxy_epochs=1)
    c.receive(server(variant="input").broadcast("tiny_a", RND), RND)
    x, y = torch.randn(8, *SHAPE), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    c.fit(synthetic_trainer())
    for m in c.modules():
        m.eval()
    with torch.no_grad():
        got = c.eval_metrics(x, y)
        expected = (c.model(c.received(x)).argmax(1) == y).float().mean()
    assert got == {"pfedes/proxy_acc": pytest.approx(float(expected))}


def test_paper_suite_trains_the_input_proxy_for_the_official_epochs():
    from rayfl.compare import load_suite

    root = Path(__file__).resolve().parents[2]
    suite = load_suite(root / "experiments" / "suites" / "pfedes_paper_fmnist.yaml")
    inputs = [r for r in suite.runs if r.label == "pfedes_input"]
    assert inputs and all(r.config.algorithm.params.proxy_epochs is None for r in inputs)


def _input_client_fit(received):
    torch.manual_seed(0)
    settings = TrainConfig(momentum=0.9)
    ctx = ClientContext("tiny_a", SHAPE, 3, torch.device("cpu"), settings)
    c = PFedESClient(ctx, PFedESParams(variant="input", proxy_epochs=1, shared_optimizer=True))
    c.receive(received, RND)
    c.fit(synthetic_trainer(batch_size=100))  # one batch: stage 2 takes exactly one step
    return c.upload()


def test_shared_optimizer_continues_from_the_received_momentum():
    torch.manual_seed(1)
    g = server(variant="input", shared_optimizer=True).broadcast("tiny_a", RND)
    assert not any(k.startswith("momentum.") for k in g)  # round 1: no momentum yet
    fresh = _input_client_fit(g)
    buffers = {k: np.full_like(v, 0.5) for k, v in g.items()}
    carried = _input_client_fit({**g, **{f"momentum.{k}": b for k, b in buffers.items()}})
    for k in g:
        # torch SGD: a new buffer is the gradient; a carried one is 0.9 * buffer + gradient
        np.testing.assert_allclose(
            carried[f"momentum.{k}"] - fresh[f"momentum.{k}"], 0.9 * buffers[k], atol=1e-5
        )
    s = server(variant="input", shared_optimizer=True)
    s.aggregate([Reply(0, "tiny_a", 1, fresh), Reply(1, "tiny_a", 3, carried)], RND)
    down = s.broadcast("tiny_a", RND)
    for k in g:
        expected = 0.25 * fresh[f"momentum.{k}"] + 0.75 * carried[f"momentum.{k}"]
        np.testing.assert_allclose(down[f"momentum.{k}"], expected, rtol=1e-6)
    restored = server(variant="input", shared_optimizer=True)
    restored.load_state_dict(s.state_dict())
    assert restored.broadcast("tiny_a", RND).keys() == down.keys()


def test_official_weights_count_all_of_a_clients_samples():
    from rayfl.algorithms import ALGORITHMS
    from rayfl.privacy import sum_form

    torch.manual_seed(0)
    c = client(variant="input", proxy_epochs=0, weights="all")
    c.fit(synthetic_trainer())
    up = c.upload()
    assert float(up["weight"]) == 120.0  # 100 train + 20 test samples
    s = server(variant="input", weights="all")
    g = s.broadcast("tiny_a", RND)
    a = {k: v + 1.0 for k, v in g.items()}
    b = {k: v + 4.0 for k, v in g.items()}
    s.aggregate(
        [
            Reply(0, "tiny_a", 100, {**a, "weight": np.array(30.0, np.float32)}),
            Reply(1, "tiny_a", 1, {**b, "weight": np.array(10.0, np.float32)}),
        ],
        RND,
    )
    new = s.broadcast("tiny_a", RND)
    for k in g:  # weights 30 : 10, not the training counts 100 : 1
        np.testing.assert_allclose(new[k], g[k] + 0.75 * 1.0 + 0.25 * 4.0, rtol=1e-6)
    algo = ALGORITHMS.get("pfedes")
    assert sum_form(algo, PFedESParams(variant="input", weights="all")) is None
    assert sum_form(algo, PFedESParams(variant="input")) == "weighted_mean"


@pytest.mark.parametrize("kw", [{"shared_optimizer": True}, {"weights": "all"}, {"weights": "x"}])
def test_official_code_options_are_checked(kw):
    with pytest.raises(ConfigError, match="algorithm."):
        PFedESParams(**kw)  # variant kd
    ctx = ClientContext("tiny_a", SHAPE, 3, torch.device("cpu"), TrainConfig(optimizer="adam"))
    with pytest.raises(ConfigError, match="algorithm.shared_optimizer"):
        PFedESClient(ctx, PFedESParams(variant="input", shared_optimizer=True))

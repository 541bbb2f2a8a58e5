"""FedKD: adaptive mutual distillation golden numbers; SVD compression of updates."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayfl.algorithms.base import (
    ClientContext,
    Reply,
    RoundContext,
    ServerContext,
    TrainConfig,
)
from rayfl.algorithms.fedkd import (
    FedKDClient,
    FedKDParams,
    FedKDServer,
    adaptive_losses,
)
from rayfl.algorithms.functional import energy_rank, payload_nbytes, svd_compress, svd_decompress
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)  # round 1 of 2

SHAPE = (1, 8, 8)
CPU = torch.device("cpu")


def test_adaptive_losses_golden():
    # mentor p = (1/2, 1/2), mentee q = (3/4, 1/4), label 0
    mentor = torch.tensor([[0.0, 0.0]], requires_grad=True)
    mentee = torch.tensor([[math.log(3.0), 0.0]], requires_grad=True)
    ce_t, ce_s = math.log(2), -math.log(0.75)
    kl_q_p = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    kl_p_q = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2.0)
    p = FedKDParams(kl_reduction="batchmean", detach=True)
    lt, ls = adaptive_losses(mentor, mentee, torch.tensor([0]), p)
    assert lt.item() == pytest.approx(ce_t + kl_q_p / (ce_t + ce_s), rel=1e-6)  # 0.826516
    assert ls.item() == pytest.approx(ce_s + kl_p_q / (ce_t + ce_s), rel=1e-6)  # 0.434335
    assert lt.item() == pytest.approx(0.826516, abs=1e-5)
    lt.backward()
    assert mentee.grad is None  # detached: the mentor's loss does not move the mentee
    # the default, HtFLlib's nn.KLDivLoss() 'mean': the KL also divided by the 2 classes
    lt, ls = adaptive_losses(mentor, mentee, torch.tensor([0]), FedKDParams())
    assert lt.item() == pytest.approx(ce_t + kl_q_p / 2 / (ce_t + ce_s), rel=1e-6)
    assert ls.item() == pytest.approx(ce_s + kl_p_q / 2 / (ce_t + ce_s), rel=1e-6)


def htfllib_kd_grads(rep, rep_g, head, head_g, w_h, y):
    """The gradients of HtFLlib's FedKD step (clientkd.py:55-74): nn.KLDivLoss() ('mean') on
    undetached targets, the undetached 1/(CE + CE_g) and the hidden loss in both losses."""
    kl, mse, ce = (
        torch.nn.KLDivLoss(reduction="sum"),
        torch.nn.MSELoss(),
        torch.nn.CrossEntropyLoss(),
    )
    out, out_g = head(rep), head_g(rep_g)
    n = out.numel()  # 'mean' = sum over every entry / their number
    ce_l, ce_g = ce(out, y), ce(out_g, y)
    l_d = kl(F.log_softmax(out, 1), F.softmax(out_g, 1)) / n / (ce_l + ce_g)
    l_d_g = kl(F.log_softmax(out_g, 1), F.softmax(out, 1)) / n / (ce_l + ce_g)
    l_h = mse(rep, w_h(rep_g)) / (ce_l + ce_g)
    l_h_g = mse(rep, w_h(rep_g)) / (ce_l + ce_g)
    (ce_l + l_d + l_h).backward(retain_graph=True)
    (ce_g + l_d_g + l_h_g).backward()


def test_gradients_equal_htfllibs_step():
    torch.manual_seed(0)
    heads = [torch.nn.Linear(4, 3), torch.nn.Linear(6, 3), torch.nn.Linear(6, 4, bias=False)]
    rep0, rep_g0, y = torch.randn(5, 4), torch.randn(5, 6), torch.tensor([0, 2, 1, 1, 0])
    grads = []
    for reference in (True, False):
        for m in heads:
            m.zero_grad()
        rep, rep_g = rep0.clone().requires_grad_(), rep_g0.clone().requires_grad_()
        head, head_g, w_h = heads
        if reference:
            htfllib_kd_grads(rep, rep_g, head, head_g, w_h, y)
        else:
            hidden = F.mse_loss(rep, w_h(rep_g))
            lt, ls = adaptive_losses(head(rep), head_g(rep_g), y, FedKDParams(), hidden)
            (lt + ls).backward()
        grads.append(
            [rep.grad, rep_g.grad] + [p.grad.clone() for m in heads for p in m.parameters()]
        )
    for ours, ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_client_trains_a_local_hidden_map():
    ctx = ClientContext("tiny_b", SHAPE, 3, CPU, TrainConfig())
    client = FedKDClient(ctx, FedKDParams(mentee="tiny_a"))
    assert set(client.persistent) == {"model", "hidden_map"}  # W stays on the client
    w = client.hidden_map.weight
    assert w.shape == (client.model.feature_dim, client.mentee.feature_dim)
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    client.training_step(x, y).backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    no_hidden = FedKDClient(ctx, FedKDParams(mentee="tiny_a", hidden=False))
    assert set(no_hidden.persistent) == {"model"}


def test_energy_rank_golden():
    s = np.array([4.0, 3.0, 0.0, 0.0])  # squared energies 16/25 = 0.64, then 1.0
    assert energy_rank(s, 0.5) == 1
    assert energy_rank(s, 0.64) == 1
    assert energy_rank(s, 0.9) == 2
    assert energy_rank(s, 1.0) == 2
    assert energy_rank(np.zeros(3), 0.9) == 1


def test_svd_compress_golden_and_dense_fallbacks():
    w = np.diag([4.0, 3.0, 0.0, 0.0]).astype(np.float32)
    update = {"w": w, "b": np.ones(4, np.float32), "small": np.eye(2, dtype=np.float32)}
    low = svd_compress(update, 0.6)
    assert set(low) == {"w::u", "w::s", "w::vh", "b", "small"}  # 1-D and tiny entries stay dense
    assert low["w::s"].tolist() == [4.0]
    back = svd_decompress(low)
    np.testing.assert_allclose(back["w"], np.diag([4.0, 0.0, 0.0, 0.0]), atol=1e-6)
    np.testing.assert_array_equal(back["b"], update["b"])
    assert payload_nbytes(low) < payload_nbytes(update)
    exact = svd_decompress(svd_compress(update, 0.9))
    np.testing.assert_allclose(exact["w"], w, atol=1e-6)


def test_svd_round_trip_of_a_conv_shaped_low_rank_update():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(8, 1)), rng.normal(size=(1, 4 * 3 * 3))
    conv = (a @ b).reshape(8, 4, 3, 3).astype(np.float32)  # rank one
    packed = svd_compress({"conv": conv}, 0.99)
    assert packed["conv::u"].shape == (8, 1) and packed["conv::vh"].shape == (1, 4, 3, 3)
    np.testing.assert_allclose(svd_decompress(packed)["conv"], conv, atol=1e-5)


@pytest.mark.parametrize("weighting, shift", [("uniform", 2.0), ("samples", 2.5)])
def test_server_adds_the_averaged_updates(weighting, shift):
    params = FedKDParams(mentee="tiny_a", svd_energy=0.99, weighting=weighting)
    sctx = ServerContext(("tiny_b",), {"tiny_b": 2}, SHAPE, 3, CPU, TrainConfig(), 0, 2)
    server = FedKDServer(sctx, params)
    start = server.broadcast("tiny_b", RND)
    ones = {k: np.ones_like(v) for k, v in start.items()}
    threes = {k: 3 * np.ones_like(v) for k, v in start.items()}
    server.aggregate(
        [Reply(0, "tiny_b", 1, svd_compress(ones, 0.99)), Reply(1, "tiny_b", 3, threes)], RND
    )
    # uniform (HtFLlib's serverkd.py): (1 + 3) / 2; samples: (1 * 1 + 3 * 3) / 4
    after = server.broadcast("tiny_b", RND)
    for k in start:
        np.testing.assert_allclose(after[k], start[k] + shift, rtol=1e-5, atol=1e-5)


def test_client_uploads_its_mentee_update():
    torch.manual_seed(0)
    params = FedKDParams(mentee="tiny_a")
    client = FedKDClient(ClientContext("tiny_b", SHAPE, 3, CPU, TrainConfig()), params)
    sctx = ServerContext(("tiny_b",), {"tiny_b": 1}, SHAPE, 3, CPU, TrainConfig(), 0, 1)
    client.receive(FedKDServer(sctx, params).broadcast("tiny_b", RND), RND)
    assert all(not v.any() for v in client.upload().values())  # nothing trained yet: zero update
    with torch.no_grad():
        client.mentee.head.bias += 1.0
    np.testing.assert_allclose(client.upload()["head.bias"], 1.0)
    with pytest.raises(ConfigError, match="algorithm.svd_energy"):
        FedKDParams(svd_energy=1.5)


def test_mentee_defaults_to_the_familys_smallest_architecture():
    # Defect: the mentee defaulted to `mlp` even in the CNN family suites.
    from rayfl.models import build_model

    shape = (1, 28, 28)
    family = tuple(f"cnn{k}" for k in range(1, 6))
    ctx = ClientContext("cnn2", shape, 10, CPU, TrainConfig(), family_archs=family)
    client = FedKDClient(ctx, FedKDParams())
    expected = build_model("cnn5", shape, 10)
    assert client.mentee.state_dict().keys() == expected.state_dict().keys()
    assert [p.shape for p in client.mentee.parameters()] == [p.shape for p in expected.parameters()]

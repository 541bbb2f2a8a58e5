"""FML: golden numbers of the mutual-learning losses; each loss moves only its own model."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayfl.algorithms.base import ClientContext, Reply, RoundContext, ServerContext, TrainConfig
from rayfl.algorithms.fml import FMLClient, FMLParams, FMLServer, mutual_losses, shared_arch
from rayfl.errors import ConfigError
from rayfl.models import build_model

RND = RoundContext(1, 2)  # round 1 of 2

SHAPE = (1, 8, 8)
CPU = torch.device("cpu")


def test_mutual_losses_golden():
    # private p = (1/2, 1/2); meme q = (3/4, 1/4); label 0.
    private = torch.tensor([[0.0, 0.0]])
    meme = torch.tensor([[math.log(3.0), 0.0]])
    y = torch.tensor([0])
    ce_p, ce_m = math.log(2), -math.log(0.75)
    kl_q_p = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)  # KL(meme || private) = 0.130812
    kl_p_q = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2.0)  # KL(private || meme) = 0.143841
    p = FMLParams(alpha=0.5, beta=0.25, kl_reduction="batchmean")
    lp, lm = mutual_losses(private, meme, y, p)
    assert lp.item() == pytest.approx(0.5 * ce_p + 0.5 * kl_q_p, rel=1e-6)
    assert lm.item() == pytest.approx(0.25 * ce_m + 0.75 * kl_p_q, rel=1e-6)
    assert lp.item() == pytest.approx(0.411980, abs=1e-6)
    # the default, HtFLlib's nn.KLDivLoss() 'mean': the KL also divided by the 2 classes
    lp, lm = mutual_losses(private, meme, y, FMLParams(alpha=0.5, beta=0.25))
    assert lp.item() == pytest.approx(0.5 * ce_p + 0.5 * kl_q_p / 2, rel=1e-6)
    assert lm.item() == pytest.approx(0.25 * ce_m + 0.75 * kl_p_q / 2, rel=1e-6)


def htfllib_fml_grads(private, meme, y, alpha, beta):
    """The gradients of HtFLlib's FML step (clientfml.py:47-53): two losses with
    nn.KLDivLoss() (reduction 'mean') on undetached softmax targets, backpropagated in turn."""
    kl, ce = torch.nn.KLDivLoss(reduction="sum"), torch.nn.CrossEntropyLoss()
    n = private.numel()  # 'mean' = sum over every entry / their number
    loss = ce(private, y) * alpha + kl(F.log_softmax(private, 1), F.softmax(meme, 1)) / n * (
        1 - alpha
    )
    loss_g = ce(meme, y) * beta + kl(F.log_softmax(meme, 1), F.softmax(private, 1)) / n * (1 - beta)
    loss.backward(retain_graph=True)
    loss_g.backward()
    return private.grad.clone(), meme.grad.clone()


def test_gradients_equal_htfllibs_step():
    torch.manual_seed(0)
    x_p, x_m = torch.randn(4, 5), torch.randn(4, 5)
    y = torch.tensor([0, 4, 2, 2])
    ref = htfllib_fml_grads(x_p.clone().requires_grad_(), x_m.clone().requires_grad_(), y, 0.5, 0.3)
    private, meme = x_p.clone().requires_grad_(), x_m.clone().requires_grad_()
    lp, lm = mutual_losses(private, meme, y, FMLParams(alpha=0.5, beta=0.3))
    (lp + lm).backward()
    torch.testing.assert_close(private.grad, ref[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(meme.grad, ref[1], rtol=1e-5, atol=1e-7)


def test_each_loss_trains_only_its_own_model_when_detached():
    private = torch.tensor([[0.3, -0.2]], requires_grad=True)
    meme = torch.tensor([[1.0, 0.5]], requires_grad=True)
    lp, _ = mutual_losses(private, meme, torch.tensor([1]), FMLParams(detach=True))
    lp.backward()
    assert private.grad is not None and private.grad.abs().sum() > 0
    assert meme.grad is None
    # HtFLlib's default: the private loss's KL also trains the meme
    private = torch.tensor([[0.3, -0.2]], requires_grad=True)
    meme = torch.tensor([[1.0, 0.0]], requires_grad=True)
    lp, _ = mutual_losses(private, meme, torch.tensor([1]), FMLParams())
    lp.backward()
    assert meme.grad is not None and meme.grad.abs().sum() > 0


def test_client_shares_the_meme_and_server_averages_it():
    torch.manual_seed(0)
    ctx = ClientContext("tiny_b", SHAPE, 3, CPU, TrainConfig())
    params = FMLParams(meme="tiny_a")
    client = FMLClient(ctx, params)
    assert set(client.persistent) == {"model"}
    sctx = ServerContext(("tiny_b",), {"tiny_b": 2}, SHAPE, 3, CPU, TrainConfig(), 0, 2)
    server = FMLServer(sctx, FMLParams(meme="tiny_a", weighting="samples"))
    down = server.broadcast("tiny_b", RND)
    client.receive(down, RND)
    up = client.upload()
    assert set(up) == set(down)
    doubled = {k: 2 * v for k, v in up.items()}
    server.aggregate([Reply(0, "tiny_b", 1, up), Reply(1, "tiny_b", 3, doubled)], RND)
    # (1 * w + 3 * 2w) / 4 = 1.75 w
    np.testing.assert_allclose(
        server.broadcast("tiny_b", RND)["head.weight"], 1.75 * up["head.weight"], rtol=1e-6
    )
    assert "meme" in server.eval_models()
    # the default, HtFLlib's serverfml.py: the plain mean over the uploads, (w + 2w) / 2
    server = FMLServer(sctx, params)
    server.aggregate([Reply(0, "tiny_b", 1, up), Reply(1, "tiny_b", 3, doubled)], RND)
    np.testing.assert_allclose(
        server.broadcast("tiny_b", RND)["head.weight"], 1.5 * up["head.weight"], rtol=1e-6
    )


def test_meme_must_be_a_classifier():
    with pytest.raises(ConfigError, match="algorithm.meme"):
        FMLParams(meme="proxy_input")
    with pytest.raises(ConfigError, match="algorithm.alpha"):
        FMLParams(alpha=1.5)


def test_meme_defaults_to_the_familys_smallest_cnn_not_mlp():
    # Defect: the meme defaulted to `mlp` even in the CNN family suites.
    shape = (1, 28, 28)
    family = tuple(f"cnn{k}" for k in range(1, 6))
    ctx = ClientContext("cnn1", shape, 10, CPU, TrainConfig(), family_archs=family)
    client = FMLClient(ctx, FMLParams())
    server = FMLServer(
        ServerContext(family, dict.fromkeys(family, 1), shape, 10, CPU, TrainConfig(), 0, 5),
        FMLParams(),
    )
    # cnn5 has the fewest parameters of CNN-1..5 (fc1 800 -> 500)
    assert type(client.meme).__name__ == type(server.shared).__name__
    assert client.meme.state_dict().keys() == server.shared.state_dict().keys()
    n = sum(p.numel() for p in client.meme.parameters())
    assert n == sum(p.numel() for p in build_model("cnn5", shape, 10).parameters())
    assert shared_arch(None, family, shape, 10) == "cnn5"
    assert shared_arch("mlp", family, shape, 10) == "mlp"

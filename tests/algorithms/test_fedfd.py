"""FedFD / FedDF: the feature-KL loss, orthogonal projections, group targets, 2-round runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import rayfl.algorithms.fedfd  # noqa: F401  (registration)
from rayfl.algorithms.base import Reply, RoundContext, ServerContext, TrainConfig, load_numpy
from rayfl.algorithms.feddf import FedDFParams
from rayfl.algorithms.fedfd import (
    FedFDParams,
    FedFDServer,
    LinearProjection,
    OrthogonalProjection,
    build_projection,
    check_fedfd_family,
    feature_distill_loss,
    orthogonality_error,
)
from rayfl.algorithms.heterofl import build_width_model
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError
from tests.algorithms.fakes import FakeServerData

RND = RoundContext(1, 2)  # round 1 of 2

IN_SHAPE = (1, 8, 8)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Small ops on an oversubscribed 2-core machine are ~100x slower with 2 spinning threads; the
    # engine's runners use one thread per worker too.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


LN3 = math.log(3.0)
# KL([1/4, 3/4] || [1/2, 1/2]) = 1/4 ln(1/2) + 3/4 ln(3/2)
KL_QUARTER = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)


def server_ctx(archs: tuple[str, ...]) -> ServerContext:
    return ServerContext(
        architectures=archs,
        arch_counts={a: 1 for a in archs},
        in_shape=IN_SHAPE,
        num_classes=10,
        device=torch.device("cpu"),
        train=TrainConfig(batch_size=8),
        seed=0,
        num_clients=len(archs),
    )


# ------------------------------------------------------------------------------------------- loss


def test_feature_kl_loss_golden():
    # Global features z = (0, 0): any projection's softmax is uniform. Group a's mean features
    # (0, 2 ln 3) at T=2 give softmax (1/4, 3/4); group b's (2 ln 3, 0) give (3/4, 1/4).
    z = torch.zeros(1, 2)
    projections = {"a": nn.Identity(), "b": OrthogonalProjection(2, 2)}
    targets = {"a": torch.tensor([[0.0, 2 * LN3]]), "b": torch.tensor([[2 * LN3, 0.0]])}
    loss = feature_distill_loss(z, projections, targets, temperature=2.0)
    # T^2 * KL for each group, then the mean over the two groups
    assert loss.item() == pytest.approx(4 * KL_QUARTER, rel=1e-6)
    # Matching targets cost nothing; the loss is a batch mean (a duplicated row changes nothing).
    assert feature_distill_loss(
        z, {"a": nn.Identity()}, {"a": torch.zeros(1, 2)}, 1.0
    ).item() == pytest.approx(0.0)
    z2, t2 = torch.zeros(2, 2), {"a": torch.tensor([[0.0, LN3], [0.0, LN3]])}
    assert feature_distill_loss(z2, {"a": nn.Identity()}, t2, 1.0).item() == pytest.approx(
        KL_QUARTER, rel=1e-6
    )


def test_orthogonal_projection_golden_rotation_and_semi_orthogonal_rows():
    proj = OrthogonalProjection(2, 2)
    with torch.no_grad():
        proj.weight[0, 1] = (
            math.pi / 2
        )  # exp([[0, t], [-t, 0]]) = [[cos t, sin t], [-sin t, cos t]]
        proj.weight[1, 0] = 123.0  # below the diagonal: ignored by construction
    torch.testing.assert_close(
        proj.matrix(), torch.tensor([[0.0, 1.0], [-1.0, 0.0]]), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        proj(torch.tensor([[1.0, 2.0]])), torch.tensor([[2.0, -1.0]]), atol=1e-6, rtol=0
    )
    # Unequal sizes: the leading rows (or columns) of the orthogonal matrix; A = 0 is the identity block.
    assert torch.equal(OrthogonalProjection(5, 3).matrix(), torch.eye(3, 5))
    assert torch.equal(OrthogonalProjection(3, 5).matrix(), torch.eye(5, 3))
    assert torch.equal(LinearProjection(5, 3).matrix(), torch.eye(3, 5))


@pytest.mark.parametrize(("in_dim", "out_dim"), [(24, 10), (10, 24)])
def test_orthogonality_survives_200_adam_steps(in_dim, out_dim):
    torch.manual_seed(0)
    z = torch.randn(32, in_dim)
    target = torch.randn(32, out_dim) * 3
    ortho, linear = OrthogonalProjection(in_dim, out_dim), LinearProjection(in_dim, out_dim)
    start = ortho.matrix().detach().clone()
    first = last = 0.0
    for proj in (ortho, linear):
        opt = torch.optim.Adam(proj.parameters(), lr=0.05)
        for step in range(200):
            loss = feature_distill_loss(z, {"g": proj}, {"g": target}, 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if proj is ortho:
                first = loss.item() if step == 0 else first
                last = loss.item()
    assert last < 0.9 * first  # it did learn...
    assert (ortho.matrix().detach() - start).abs().max() > 0.1  # ...by really rotating
    assert orthogonality_error(ortho) < 1e-5  # and stayed semi-orthogonal
    assert orthogonality_error(linear) > 1e-2  # the unconstrained ablation does not
    assert orthogonality_error(nn.Identity()) == 0.0


def test_identity_projection_needs_equal_sizes():
    assert isinstance(build_projection("identity", 16, 16), nn.Identity)
    with pytest.raises(ConfigError, match="projection=identity"):
        build_projection("identity", 102, 51, "resnet18_w1")
    with pytest.raises(ConfigError, match="projection=identity"):
        FedFDServer(server_ctx(("resnet18_w1", "resnet18_w2")), FedFDParams(projection="identity"))
    # equal sizes (client width = global width) are fine
    server = FedFDServer(
        server_ctx(("resnet18_w2",)),
        FedFDParams(global_arch="resnet18_w2", projection="identity", self_group=True),
    )
    assert isinstance(server.projections["resnet18_w2"], nn.Identity)
    # the same refusal without building anything (for config validation)
    with pytest.raises(ConfigError, match="projection=identity"):
        check_fedfd_family(["resnet18_w1", "resnet18"], FedFDParams(projection="identity"))
    check_fedfd_family(["resnet18_w1"], FedFDParams(projection="identity", distill="logit"))
    with pytest.raises(ConfigError, match="width-scaled"):
        check_fedfd_family(["cnn_small"], FedFDParams())


def test_params_checks():
    assert FedDFParams().distill == "logit" and FedFDParams().distill == "feature"
    with pytest.raises(ConfigError, match="algorithm.T"):
        FedFDParams(T=0.0)
    with pytest.raises(ConfigError, match="algorithm.steps"):
        FedFDParams(steps=-1)
    with pytest.raises(ConfigError, match="algorithm.batch_size"):
        FedFDParams(batch_size=1)


# ---------------------------------------------------------------------------------- server targets


def client_payload(arch: str, seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    model = build_width_model(arch, IN_SHAPE, 10, FedFDParams())
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


@torch.no_grad()
def reference_outputs(arch: str, payload: dict[str, np.ndarray], batches: list[torch.Tensor]):
    model = build_width_model(arch, IN_SHAPE, 10, FedFDParams())
    load_numpy(model, payload)
    model.eval()
    f = torch.cat([model.features(x) for x in batches])
    return f, model.head(f)


@pytest.mark.parametrize("self_group", [False, True])
def test_group_targets_average_features_per_group_and_logits_over_clients(self_group):
    archs = ("resnet18_w1", "resnet18_w2")
    params = FedFDParams(global_arch="resnet18_w2", distill="both", self_group=self_group)
    server = FedFDServer(server_ctx(archs), params)
    batches = list(torch.randn(12, *IN_SHAPE).split(4))
    payloads = [("resnet18_w1", client_payload("resnet18_w1", s)) for s in (1, 2)] + [
        ("resnet18_w2", client_payload("resnet18_w2", 3))
    ]
    replies = [Reply(i, arch, 5, p) for i, (arch, p) in enumerate(payloads)]
    feats, logits = server._targets(batches, replies)
    ref = [reference_outputs(arch, p, batches) for arch, p in payloads]
    # the paper's loss runs over groups 2..m: the global model's own width is no group
    groups = list(archs) if self_group else ["resnet18_w1"]
    assert sorted(feats) == groups and sorted(server.projections) == groups
    assert feats["resnet18_w1"].shape == (12, 51)
    torch.testing.assert_close(feats["resnet18_w1"], (ref[0][0] + ref[1][0]) / 2)
    if self_group:
        assert feats["resnet18_w2"].shape == (12, 102)
        torch.testing.assert_close(feats["resnet18_w2"], ref[2][0])
    assert logits is not None  # the logit teacher is every client's
    torch.testing.assert_close(logits, (ref[0][1] + ref[1][1] + ref[2][1]) / 3)


def test_only_full_width_clients_leave_nothing_to_distil_by_features():
    server = FedFDServer(server_ctx(("resnet18_w2",)), FedFDParams(global_arch="resnet18_w2"))
    assert not len(server.projections)
    server.aggregate([Reply(0, "resnet18_w2", 5, client_payload("resnet18_w2", 1))], RND)
    assert server.update(FakeServerData(torch.randn(20, *IN_SHAPE)), RND) == {}


@pytest.mark.parametrize("projection", ["orthogonal", "linear"])
def test_update_distils_into_the_global_model_and_projections(projection):
    archs = ("resnet18_w1", "resnet18_w2")
    params = FedFDParams(
        global_arch="resnet18_w2", distill="both", projection=projection, steps=4, lr=0.05
    )
    torch.manual_seed(0)
    server = FedFDServer(server_ctx(archs), params)
    replies = [Reply(i, a, 5, client_payload(a, 10 + i)) for i, a in enumerate(archs)]
    server.aggregate(replies, RND)
    g_before = {k: v.detach().clone() for k, v in server.model.state_dict().items()}
    p_before = {k: v.detach().clone() for k, v in server.projections.state_dict().items()}
    metrics = server.update(FakeServerData(torch.randn(20, *IN_SHAPE)), RND)
    assert set(metrics) == {
        "fedfd/distill_loss",
        "fedfd/feature_loss",
        "fedfd/logit_loss",
        "fedfd/groups",
        "fedfd/orth_error",
    }
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["fedfd/distill_loss"] == pytest.approx(
        metrics["fedfd/feature_loss"] + metrics["fedfd/logit_loss"]
    )
    assert metrics["fedfd/groups"] == 2.0
    if projection == "orthogonal":
        assert metrics["fedfd/orth_error"] < 1e-5
    moved = [k for k, v in server.model.state_dict().items() if not torch.equal(v, g_before[k])]
    assert "encoder.conv1.weight" in moved and "head.weight" in moved
    assert any(not torch.equal(v, p_before[k]) for k, v in server.projections.state_dict().items())
    # the replies are consumed: a second update without aggregation does nothing
    assert server.update(FakeServerData(torch.randn(20, *IN_SHAPE)), RoundContext(2, 2)) == {}


# ------------------------------------------------------------------------------------ 2-round runs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "prefix"), [("fedfd", "fedfd"), ("feddf", "feddf")])
def test_two_rounds_on_synthetic_data(name, prefix, synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": name, "global_arch": "resnet18_w2", "steps": 3}
    raw["model"] = {"architectures": ["resnet18_w1", "resnet18_w2"]}
    raw["data"]["num_clients"] = 4
    raw["data"]["public_fraction"] = 0.1
    result = Simulation(build_config(raw), tmp_path).run()
    assert result.status == "FINISHED" and len(result.history) == 2
    for row in result.history:
        assert all(math.isfinite(v) for v in row.values()), row
    final = result.final
    assert 0.0 <= final["global/acc"] <= 1.0
    # both width groups took part in every round's distillation, and it had something to learn
    assert [row[f"{prefix}/groups"] for row in result.history] == [2.0, 2.0]
    assert all(row[f"{prefix}/distill_loss"] > 0.0 for row in result.history)
    if name == "fedfd":
        assert final["fedfd/orth_error"] < 1e-5
    else:
        assert "feddf/orth_error" not in final  # logit distillation has no projections


def test_refuses_a_run_without_public_data(synthetic_raw, tmp_path):
    raw = synthetic_raw
    raw["algorithm"] = {"name": "fedfd"}
    raw["model"] = {"architectures": ["resnet18_w1"]}
    with pytest.raises(ConfigError, match="public"):
        Simulation(build_config(raw), tmp_path)


def test_feddf_cosine_rate_and_early_stopping_keep_the_best_model(monkeypatch):
    from rayfl.algorithms.feddf import FedDFServer, cosine_lr

    assert cosine_lr(1e-3, 0, 100) == pytest.approx(1e-3)
    assert cosine_lr(1e-3, 50, 100) == pytest.approx(5e-4)
    archs = ("resnet18_w1", "resnet18_w2")
    params = FedDFParams(
        global_arch="resnet18_w2", steps=8, lr=0.05, patience=4, eval_every=2, schedule="cosine"
    )
    torch.manual_seed(0)
    server = FedDFServer(server_ctx(archs), params)
    server.aggregate([Reply(i, a, 5, client_payload(a, 10 + i)) for i, a in enumerate(archs)], RND)
    scores = iter([0.5, 0.7, 0.6, 0.6, 0.9])  # after 2, 4, 6, 8 steps: best at 4, stop at 8
    rates, states = [], []
    run = FakeServerData.run

    def spy(self, step, modules, **kw):
        rates.append(kw["settings"].lr)
        out = run(self, step, modules, **kw)
        states.append({k: v.clone() for k, v in server.model.state_dict().items()})
        return out

    monkeypatch.setattr(FakeServerData, "run", spy)
    monkeypatch.setattr(FedDFServer, "public_accuracy", lambda self, data: next(scores))
    metrics = server.update(FakeServerData(torch.randn(20, *IN_SHAPE)), RND)
    assert metrics["feddf/steps"] == 8.0 and metrics["feddf/best_step"] == 4.0
    assert rates == pytest.approx([cosine_lr(0.05, d, 8) for d in (0, 2, 4, 6)])
    for k, v in server.model.state_dict().items():  # the model after 4 steps is kept
        torch.testing.assert_close(v, states[1][k])

"""The personalization staples (FedPer, FedRep, FedBABU, FedRoD, FedBN, Ditto, APFL, FedALA):
their per-architecture grouping, their loss and mixing helpers by hand, and each method's
division of what is trained, shared and kept."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rayfl.algorithms.apfl import APFLClient, APFLParams, mixture
from rayfl.algorithms.base import ClientContext, NoParams, Reply, RoundContext, ServerContext
from rayfl.algorithms.ditto import DittoClient, DittoParams
from rayfl.algorithms.fedala import FedALAClient, FedALAParams
from rayfl.algorithms.fedbabu import FedBABUClient, FedBABUParams, FedBABUServer
from rayfl.algorithms.fedper import FedPerServer
from rayfl.algorithms.fedrep import FedRepClient, FedRepParams
from rayfl.algorithms.fedrod import FedRoDClient, balanced_softmax_loss
from rayfl.algorithms.functional import grouped_average
from rayfl.algorithms.groups import extractor, frozen, without_batchnorm
from rayfl.config import TrainConfig
from rayfl.data.datasets import load_dataset
from rayfl.engine.training import LocalTrainer, shuffled_batches
from rayfl.errors import ConfigError
from rayfl.models import build_model

RND = RoundContext(1, 2)
SHAPE = (1, 8, 8)
CPU = torch.device("cpu")
STAPLES = ["fedper", "fedrep", "fedbabu", "fedrod", "fedbn", "ditto", "apfl", "fedala"]


def trainer(seed: int = 0) -> LocalTrainer:
    ds = load_dataset("synthetic", num_samples=60, num_test=10, shape=SHAPE, num_classes=3)
    settings = TrainConfig(batch_size=16, lr=0.5, local_epochs=1)
    gen = torch.Generator().manual_seed(seed)
    return LocalTrainer(ds, np.arange(50), np.arange(50, 60), settings, CPU, gen)


def context(arch: str = "tiny_a") -> ClientContext:
    return ClientContext(arch, SHAPE, 3, CPU, TrainConfig(batch_size=16, lr=0.5))


def server_context(*archs: str) -> ServerContext:
    counts = {a: 1 for a in archs}
    return ServerContext(tuple(archs), counts, SHAPE, 3, CPU, TrainConfig(), 0, len(archs))


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_grouped_average_never_mixes_groups_golden():
    states = [{"w": np.array([1.0])}, {"w": np.array([3.0])}, {"w": np.array([10.0])}]
    out = grouped_average(states, [1, 3, 2], ["a", "a", "b"])
    assert list(out) == ["a", "b"]
    np.testing.assert_allclose(out["a"]["w"], [2.5])  # (1 * 1 + 3 * 3) / 4
    np.testing.assert_allclose(out["b"]["w"], [10.0])  # alone in its group
    with pytest.raises(ValueError):
        grouped_average(states, [1, 3], ["a", "a", "b"])


def test_server_averages_each_architecture_on_its_own():
    server = FedPerServer(server_context("tiny_a", "tiny_b"), NoParams())
    down = {a: server.broadcast(a, RND) for a in ("tiny_a", "tiny_b")}
    assert all(k.startswith("encoder.") for p in down.values() for k in p)  # extractors only
    ones = {k: np.ones_like(v) for k, v in down["tiny_a"].items()}
    threes = {k: 3 * np.ones_like(v) for k, v in down["tiny_a"].items()}
    server.aggregate([Reply(0, "tiny_a", 1, ones), Reply(1, "tiny_a", 3, threes)], RND)
    after = {a: server.broadcast(a, RND) for a in ("tiny_a", "tiny_b")}
    for k in ones:
        np.testing.assert_allclose(after["tiny_a"][k], 2.5)  # (1 + 9) / 4
    for k, v in down["tiny_b"].items():
        np.testing.assert_array_equal(after["tiny_b"][k], v)  # no tiny_b client: untouched


def test_parts_select_the_extractor_and_everything_but_batchnorm():
    model = build_model("resnet_small", (1, 28, 28), 10)
    state = model.state_dict()
    assert set(extractor(model)) == {k for k in state if k.startswith("encoder.")}
    local = set(state) - set(without_batchnorm(model))
    bn = {
        f"{name}.{key}"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.BatchNorm2d)
        for key in m.state_dict()
    }
    assert local == bn and "encoder.1.running_mean" in local and "head.weight" not in local


def test_balanced_softmax_golden():
    # logits 0, counts (1, 3): shifted logits (0, log 3), p(class 0) = 1 / 4
    loss = balanced_softmax_loss(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([1.0, 3.0]))
    assert loss.item() == pytest.approx(math.log(4.0))
    assert balanced_softmax_loss(
        torch.zeros(1, 2), torch.tensor([1]), torch.tensor([1.0, 3.0])
    ).item() == pytest.approx(math.log(4.0 / 3.0))


def test_apfl_mixture_and_its_alpha_gradient_golden():
    local, glob = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        local.weight.fill_(1.0)
        glob.weight.fill_(3.0)
    alpha = torch.tensor(0.25, requires_grad=True)
    mixed = mixture(local, glob, alpha)
    assert mixed["weight"].item() == pytest.approx(2.5)  # 0.25 * 1 + 0.75 * 3
    out = torch.func.functional_call(local, mixed, (torch.tensor([[2.0]]),)).sum()  # 2 * theta
    out.backward()
    assert alpha.grad is not None and local.weight.grad is not None
    assert alpha.grad.item() == pytest.approx(2.0 * (1.0 - 3.0))  # <v - w, dL/dtheta>
    assert local.weight.grad.item() == pytest.approx(0.25 * 2.0)  # alpha * dL/dtheta
    assert glob.weight.grad is None  # the global model learns from its own loss only


def test_apfl_learns_alpha_in_unit_interval_and_keeps_it_as_state():
    c = APFLClient(context(), APFLParams(alpha=0.5))
    c.receive({k: v.numpy() for k, v in snapshot(c.model).items()}, RND)
    c.fit(trainer())
    a = float(c.alpha.alpha.detach())
    assert 0.0 <= a <= 1.0 and a != 0.5
    assert "alpha.alpha" in c.state_dict()
    fixed = APFLClient(context(), APFLParams(alpha=0.3, adaptive=False))
    fixed.fit(trainer())
    assert float(fixed.alpha.alpha) == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="algorithm.alpha"):
        APFLParams(alpha=1.5)


def test_fedrep_trains_head_then_extractor():
    c = FedRepClient(context(), FedRepParams(head_epochs=1))
    before = snapshot(c.model)
    with frozen(c.model.encoder):  # what the head phase trains under
        assert all(not p.requires_grad for p in c.model.encoder.parameters())
    assert all(p.requires_grad for p in c.model.parameters())  # flags restored
    metrics = c.fit(trainer())
    after = snapshot(c.model)
    assert {"loss", "head_loss"} <= set(metrics)
    assert all(not torch.equal(before[k], after[k]) for k in before)  # both parts trained
    assert set(c.upload()) == set(extractor(c.model))


def test_fedbabu_head_never_trains_and_the_personal_model_is_fine_tuned():
    server = FedBABUServer(server_context("tiny_a"), FedBABUParams())
    payload = server.broadcast("tiny_a", RND)
    assert set(payload) == set(server.models["tiny_a"].state_dict())  # the fixed head goes down
    c = FedBABUClient(context(), FedBABUParams(finetune_epochs=1))
    c.receive(payload, RND)
    c.fit(trainer())
    g = c.global_model.state_dict()
    for k in ("head.weight", "head.bias"):
        np.testing.assert_array_equal(g[k].numpy(), payload[k])  # frozen at its initialization
        assert not np.array_equal(c.model.state_dict()[k].numpy(), payload[k])  # fine-tuned
    up = c.upload()
    assert set(up) == set(extractor(c.global_model))
    assert not np.array_equal(up["encoder.1.weight"], payload["encoder.1.weight"])


def test_fedala_keeps_global_lower_layers_and_mixes_the_top_within_bounds():
    c = FedALAClient(context(), FedALAParams(layers=2, max_init_epochs=3))
    t = trainer()
    c.receive({k: v.numpy() for k, v in snapshot(c.model).items()}, RND)
    c.fit(t)  # first round: starts from the global model, no ALA
    assert c.trained.is_set() and int(c.ala.started) == 0
    local = snapshot(c.model)
    glob = {k: v + 1.0 for k, v in local.items()}  # a global model one away everywhere
    c.receive({k: v.numpy() for k, v in glob.items()}, RND)
    c.params = FedALAParams(layers=2, max_init_epochs=3)
    epochs = c.adaptive_local_aggregation(t)
    assert 1 <= epochs <= 3 and int(c.ala.started) == 1
    state = snapshot(c.model)
    torch.testing.assert_close(state["encoder.1.weight"], glob["encoder.1.weight"])  # lower: global
    for k, w in zip(c.ala.names, c.ala.weights()):
        assert k.startswith("head.")  # the top two parameter tensors are the head's
        assert float(w.min()) >= 0.0 and float(w.max()) <= 1.0
        torch.testing.assert_close(state[k], local[k] + w)  # theta_l + (theta_g - theta_l) W
    # the second ALA runs one epoch only
    assert c.adaptive_local_aggregation(t) == 1


def test_staples_are_registered_and_check_their_params():
    from rayfl.algorithms import ALGORITHMS

    for name in STAPLES:
        algo = ALGORITHMS.get(name)
        assert not algo.needs_homogeneous  # several architectures: shared within groups
    with pytest.raises(ConfigError, match="algorithm.lam"):
        DittoParams(lam=-1)
    with pytest.raises(ConfigError, match="algorithm.rand_percent"):
        FedALAParams(rand_percent=0)


@pytest.mark.ray
@pytest.mark.parametrize("name", STAPLES)
def test_ray_gives_the_serial_numbers_with_two_architectures(name, ray_local, tmp_path):
    from rayfl.config import build_config
    from rayfl.engine.loop import Simulation
    from tests.algorithms.test_contract import contract_raw

    def history(overrides: list[str]) -> list[dict[str, float]]:
        sim = Simulation(build_config(contract_raw(name), overrides), tmp_path / overrides[0])
        rows = sim.run().history
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    serial = history(["engine.executor=serial"])
    ray_two = history(["engine.executor=ray", "engine.num_workers=2", "engine.clients_per_call=1"])
    assert "personal/acc/arch=tiny_b" in serial[-1]  # two architectures, two groups
    assert serial == ray_two


def test_ditto_and_apfl_personal_models_start_as_the_first_global_model():
    ds = load_dataset("synthetic", num_samples=60, num_test=10, shape=SHAPE, num_classes=3)
    still = TrainConfig(batch_size=16, lr=1e-12, local_epochs=1)  # training moves nothing

    def frozen_trainer() -> LocalTrainer:
        gen = torch.Generator().manual_seed(0)
        return LocalTrainer(ds, np.arange(50), np.arange(50, 60), still, CPU, gen)

    for client in (DittoClient(context(), DittoParams()), APFLClient(context(), APFLParams())):
        torch.manual_seed(7)
        glob = build_model("tiny_a", SHAPE, 3).state_dict()
        payload = {k: v.numpy() for k, v in glob.items()}
        client.receive(payload, RND)
        assert not torch.equal(client.model.state_dict()["head.weight"], glob["head.weight"])
        client.fit(frozen_trainer())  # first fit: the personal model becomes the global one
        torch.testing.assert_close(client.model.state_dict(), glob, rtol=0, atol=1e-6)
        mine = snapshot(client.model)
        client.receive({k: v + 1 for k, v in payload.items()}, RND)
        client.fit(frozen_trainer())  # later fits keep it
        torch.testing.assert_close(snapshot(client.model), mine, rtol=0, atol=1e-6)


def test_fedrod_personal_head_starts_as_the_first_generic_head():
    client = FedRoDClient(context(), NoParams())
    torch.manual_seed(7)
    glob = build_model("tiny_a", SHAPE, 3).state_dict()
    payload = {k: v.numpy() for k, v in glob.items()}
    assert not torch.equal(client.personal_head.weight, glob["head.weight"])  # own draw
    client.receive(payload, RND)  # as PFLlib's copy of the initial generic head
    torch.testing.assert_close(client.personal_head.weight, glob["head.weight"], rtol=0, atol=0)
    client.fit(trainer())
    trained = snapshot(client.personal_head)
    client.receive({k: v + 1 for k, v in payload.items()}, RND)  # later broadcasts keep it
    torch.testing.assert_close(snapshot(client.personal_head), trained, rtol=0, atol=0)


def test_fedrod_fit_equals_pfllibs_two_optimizer_loop():
    # PFLlib clientrod.py:42-59 per batch: an SGD step of extractor + generic head on the
    # balanced softmax loss, then one of the personal head on CE(out_g.detach() + out_p), both
    # from the batch's one forward pass; rayfl takes one step on the sum of the two losses
    client = FedRoDClient(context(), NoParams())
    torch.manual_seed(3)
    glob = build_model("tiny_a", SHAPE, 3).state_dict()
    client.receive({k: v.numpy() for k, v in glob.items()}, RND)
    ref = build_model("tiny_a", SHAPE, 3)
    ref.load_state_dict(glob)
    head = build_model("tiny_a", SHAPE, 3).head
    head.load_state_dict(client.personal_head.state_dict())
    ds = load_dataset("synthetic", num_samples=60, num_test=10, shape=SHAPE, num_classes=3)
    plain = TrainConfig(batch_size=16, lr=0.5, momentum=0.0, local_epochs=1)  # PFLlib's SGD
    t = LocalTrainer(
        ds, np.arange(50), np.arange(50, 60), plain, CPU, torch.Generator().manual_seed(5)
    )
    data = t.data("train")
    counts = torch.bincount(data.y, minlength=3).float()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.5)
    order = torch.Generator().manual_seed(5)  # the trainer's generator: the same batches
    for x, y in shuffled_batches(data.x, data.y, 16, order):
        rep = ref.features(x)
        out_g = ref.head(rep)
        opt.zero_grad()
        F.cross_entropy(out_g + counts.log(), y).backward()
        opt.step()
        opt_head.zero_grad()
        F.cross_entropy(out_g.detach() + head(rep.detach()), y).backward()
        opt_head.step()
    client.fit(t)
    torch.testing.assert_close(snapshot(client.model), snapshot(ref), rtol=0, atol=1e-6)
    torch.testing.assert_close(snapshot(client.personal_head), snapshot(head), rtol=0, atol=1e-6)

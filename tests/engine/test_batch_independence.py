"""No model's eval-mode score for an image may depend on the other images of its batch.

Every registered model, and every registered algorithm's client model as the engine scores it
(HeteroFL's and FedFD's width-sliced ResNets keep no running batch-norm statistics: without
`rayfl.models.sbn` they normalize a test batch with its own statistics), scores the same images
in one batch, in batches of 1 and 5, reversed and sorted by label: the logits must agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from rayfl.algorithms import ALGORITHMS
from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.engine.spec import torch_threads
from rayfl.engine.training import logits_of
from rayfl.engine.worker import ClientRunner
from rayfl.errors import ConfigError
from rayfl.models import MODELS
from rayfl.models.sbn import batch_independent, batch_stat_norms
from rayfl.seeding import Purpose
from tests.algorithms.test_contract import FALLBACK_ARCHS, contract_raw

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared machine a second one mostly waits for a core."""
    with torch_threads(1):
        yield


def logits_by_batching(
    model: nn.Module, stats: Callable[[], Iterable[torch.Tensor]], x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    """The logits of every image of `x` (in `x`'s order), batched five ways, through the
    engine's scoring context."""
    orders = {
        "as is": torch.arange(len(x)),
        "reversed": torch.arange(len(x) - 1, -1, -1),
        "by label": torch.argsort(y, stable=True),
    }
    out = []
    with batch_independent(model, stats), torch.inference_mode():
        for name, order in orders.items():
            for size in (len(x), 5, 1) if name == "as is" else (5,):
                parts = [logits_of(model(x[order[i : i + size]])) for i in range(0, len(x), size)]
                logits = torch.empty_like(torch.cat(parts))
                logits[order] = torch.cat(parts)
                out.append(logits)
    return out


def assert_batch_independent(logits: list[torch.Tensor], what: str) -> None:
    for other in logits[1:]:
        assert torch.allclose(logits[0], other, rtol=1e-4, atol=1e-5), (
            f"{what}: eval-mode logits depend on the batch "
            f"(max diff {float((logits[0] - other).abs().max()):.3g})"
        )


@pytest.mark.parametrize("name", MODELS.names())
def test_every_registered_model_scores_each_image_alone(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS.get(name)((3, 8, 8), 4)
    x = torch.randn(12, 3, 8, 8)
    y = torch.arange(12) % 4
    model.train()
    with torch.no_grad():  # running statistics that are not the initial (0, 1)
        model(torch.randn(8, 3, 8, 8) * 2 + 1)
    assert_batch_independent(logits_by_batching(model, lambda: [x], x, y), name)


def _client_model(name: str) -> tuple[nn.Module, ClientRunner, int]:
    for archs in (None, FALLBACK_ARCHS):
        try:
            sim = Simulation(build_config(contract_raw(name, archs, 300, 100)), "/nonexistent")
            break
        except ConfigError:
            if archs is not None:
                raise
    runner = ClientRunner(sim.spec, sim.federation, CPU)
    client = runner.client_for(0, None)
    with torch.no_grad():
        return client.eval_model(), runner, 0


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithms_client_model_scores_each_image_alone(name: str) -> None:
    model, runner, cid = _client_model(name)
    trainer = runner._trainer(1, cid, purpose=Purpose.EVAL)
    test = trainer.data("test")
    logits = logits_by_batching(model, trainer.stat_batches, test.x, test.y)
    assert_batch_independent(logits, name)
    # scoring leaves the model as it was: static batch norm keeps no statistics afterwards
    if name in ("heterofl", "fedfd", "feddf"):
        assert batch_stat_norms(model), f"{name}: expected HeteroFL's static batch norm"
        assert all(m.running_mean is None for m in batch_stat_norms(model))
        assert not any("running" in k for k in model.state_dict())


def test_static_bn_statistics_are_those_of_the_training_pass() -> None:
    """One static batch-norm layer over two training batches: the cumulative average of the
    batches' means and unbiased variances (HeteroFL's sBN), hand-computed."""
    bn = nn.BatchNorm1d(1, affine=False, track_running_stats=False)
    a, b = torch.tensor([[0.0], [2.0]]), torch.tensor([[4.0], [4.0], [10.0]])
    with batch_independent(bn, lambda: [a, b]):
        # means 1 and 6 -> 3.5; unbiased variances 2 and 12 -> 7
        assert torch.allclose(bn.running_mean, torch.tensor([3.5]))
        assert torch.allclose(bn.running_var, torch.tensor([7.0]))
        out = bn(torch.tensor([[3.5 + 7.0**0.5]]))
        assert torch.allclose(out, torch.tensor([[1.0]]), atol=1e-4)
    assert bn.running_mean is None and not bn.track_running_stats


def test_running_stats_kept_normalizes_by_batch_and_leaves_the_running_statistics():
    from rayfl.models.sbn import running_stats_kept

    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).train()
    x = torch.randn(16, 3) * 2 + 5
    bn(x)  # one ordinary step: running mean 0.9 * 0 + 0.1 * mean(x)
    mean, var, tracked = (
        bn.running_mean.clone(),
        bn.running_var.clone(),
        int(bn.num_batches_tracked),
    )
    gx = torch.randn(16, 3) - 7
    with running_stats_kept(bn):
        out = bn(gx)
    # training-mode output: normalized with gx's own batch statistics
    expected = (gx - gx.mean(0)) / torch.sqrt(gx.var(0, unbiased=False) + bn.eps)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bn.running_mean, mean)
    torch.testing.assert_close(bn.running_var, var)
    assert int(bn.num_batches_tracked) == tracked and bn.momentum == 0.1
    torch.testing.assert_close(mean, 0.1 * x.mean(0))


def test_pfedes_input_scores_a_batch_norm_model_with_the_statistics_of_x():
    """Stage 1 of pFedES `input` feeds F both x and G(x); F's running statistics must follow x
    alone, what F is scored on (with G(x)'s mixed in, a batch-norm model scored on x
    collapses)."""
    from rayfl.algorithms.pfedes_input import PFedESInputClient

    torch.manual_seed(0)
    client = PFedESInputClient.__new__(PFedESInputClient)
    client.model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 3)).train()
    client.proxy = nn.Linear(4, 4)
    with torch.no_grad():
        client.proxy.weight.copy_(torch.eye(4) * 10)
        client.proxy.bias.fill_(50.0)
    client.params = type("P", (), {"mu": 0.5})()
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    client._stage1_step(x, y)
    torch.testing.assert_close(client.model[0].running_mean, 0.1 * x.mean(0))

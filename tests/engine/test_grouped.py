"""Grouped training (`engine.grouped`) gives the loop's numbers, for every algorithm."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rayfl.algorithms.base import Algorithm, ModelClient, NoParams, Server
from rayfl.config import build_config
from rayfl.engine import grouped
from rayfl.engine.callbacks import Callback
from rayfl.engine.grouped import StackedOptimizer, clip_
from rayfl.engine.loop import Simulation, make_spec, prepare_federation
from rayfl.engine.training import make_optimizer
from rayfl.engine.worker import ClientRunner
from rayfl.errors import ConfigError
from tests.algorithms.test_contract import FALLBACK_ARCHS, NAMES, contract_raw

TOL = 1e-5


def close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL


class GrabStates(Callback):
    def on_run_end(self, sim, status):
        self.states = dict(sim.executor.client_states(range(sim.cfg.data.num_clients)))


def run(name: str, grouped_on: bool, extra: list[str]):
    grouped.COUNTS.clear()
    for archs in (None, FALLBACK_ARCHS):
        raw = contract_raw(name, archs)
        raw["data"]["num_clients"] = 4  # two clients per architecture in the call
        try:
            cfg = build_config(raw, [f"engine.grouped={str(grouped_on).lower()}", *extra])
            sim = Simulation(cfg, "/tmp/unused")
        except ConfigError:
            if archs is not None:
                raise
            continue
        grab = GrabStates()
        sim.callbacks.append(grab)
        return sim.run().history, grab.states, dict(grouped.COUNTS)
    raise AssertionError("unreachable")


BATCHNORM = ("heterofl", "fedfd", "feddf")  # their width-sliced ResNets have BatchNorm


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in BATCHNORM else n for n in NAMES]
)
def test_grouped_gives_the_loops_numbers(name):
    extra = ["engine.rounds=2", "train.weight_decay=0.001"]
    loop, loop_states, _ = run(name, False, extra)
    group, group_states, counts = run(name, True, extra)
    for a, b in zip(loop, group, strict=True):
        assert set(a) == set(b)
        for k in a:
            if not k.startswith("time/"):
                assert close(a[k], b[k]), (k, a[k], b[k])
    for cid, state in loop_states.items():
        for k, v in state.items():
            np.testing.assert_allclose(group_states[cid][k], v, atol=TOL, rtol=0)
    # not vacuous: models without BatchNorm really train grouped, the others really fall back
    assert counts["requests"] > 0
    if name in BATCHNORM:
        assert counts.get("grouped", 0) == 0
    else:
        assert counts["grouped"] == counts["requests"]


@pytest.mark.parametrize(
    "name,optimizer",
    [("fedprox", "adam"), ("fml", "sgd")],  # fml clips its two models' gradients separately
)
def test_grouped_adam_and_clipping_match_the_loop(name, optimizer):
    extra = [f"train.optimizer={optimizer}", "train.grad_clip=0.1", "train.local_epochs=2"]
    loop, _, _ = run(name, False, extra)
    group, _, counts = run(name, True, extra)
    assert counts["grouped"] == counts["requests"] > 0
    assert all(close(a[k], b[k]) for a, b in zip(loop, group) for k in a if "time/" not in k)


# ----------------------------------------------------------------------------- the optimizer


@pytest.mark.parametrize(
    "opt,momentum,wd,clip",
    [("sgd", 0.0, 0.0, None), ("sgd", 0.9, 0.01, None), ("adam", 0.0, 0.01, 1.0)],
)
def test_stacked_optimizer_follows_torch_optim(opt, momentum, wd, clip):
    from rayfl.algorithms.base import TrainSettings

    settings = TrainSettings(optimizer=opt, momentum=momentum, weight_decay=wd, grad_clip=clip)
    gen = torch.Generator().manual_seed(0)
    k, steps = 3, 4
    init = torch.randn(k, 5, generator=gen)
    grads = torch.randn(steps, k, 5, generator=gen) * 3
    # client 2 stops after 2 steps (masked), clients 0-1 go on as a subset
    stacked = {"w": init.clone()}
    sopt = StackedOptimizer(stacked, settings, lr=0.1)
    for t in range(steps):
        members = [0, 1, 2] if t < 2 else [0, 1]
        idx = None if len(members) == k else torch.tensor(members)
        sopt.step({"w": grads[t, members].clone()}, idx, t)
    for i in range(k):
        p = nn.Parameter(init[i].clone())
        ref = make_optimizer([p], settings, lr=0.1)
        for t in range(steps if i < 2 else 2):
            p.grad = grads[t, i].clone()
            if clip is not None:
                nn.utils.clip_grad_norm_([p], clip)
            ref.step()
        torch.testing.assert_close(stacked["w"][i], p.detach(), atol=1e-6, rtol=1e-6)


def test_clip_golden():
    g = {"a": torch.tensor([[3.0, 0.0], [0.3, 0.0]]), "b": torch.tensor([[4.0], [0.4]])}
    clip_(g, 1.0)  # client 0: norm 5 -> scaled by 1/5; client 1: norm 0.5 -> unchanged
    torch.testing.assert_close(g["a"], torch.tensor([[0.6, 0.0], [0.3, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(g["b"], torch.tensor([[0.8], [0.4]]), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- what a step may not do


class BranchyClient(ModelClient):
    def training_step(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        if loss.item() > 100:  # data-dependent Python control flow: vmap refuses it
            loss = loss * 0
        return loss


class DropoutClient(ModelClient):
    def training_step(self, x, y):
        return F.cross_entropy(F.dropout(self.model(x), 0.5, training=True), y)


class PrivateTensorClient(ModelClient):
    """Keeps a per-client tensor outside its modules: grouping would read client 0's."""

    def receive(self, payload, rnd):
        self.scale = torch.rand(())

    def training_step(self, x, y):
        return F.cross_entropy(self.model(x), y) * (1 + self.scale)


class ClosureClient(ModelClient):
    def fit(self, trainer):
        return trainer.run(lambda x, y: F.cross_entropy(self.model(x), y), [self.model])


@pytest.mark.parametrize(
    "cls,reason",
    [
        (BranchyClient, "cannot run under vmap"),
        (DropoutClient, "cannot run under vmap"),
        (PrivateTensorClient, "different tensors outside their modules"),
        (ClosureClient, "not a method of the client"),
    ],
)
def test_steps_that_cannot_be_grouped_fall_back_with_the_loops_numbers(
    synthetic_raw, caplog, cls, reason
):
    cfg = build_config(synthetic_raw, ["model.architectures=[tiny_a]"])
    fed = prepare_federation(cfg)
    spec = make_spec(cfg, ["tiny_a"] * cfg.data.num_clients, fed)
    algo = Algorithm("test", NoParams, cls, Server)
    out = []
    for on in (False, True):
        runner = ClientRunner(
            dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, grouped=on)),
            fed,
            torch.device("cpu"),
        )
        runner._algo = algo
        grouped._warned.clear()
        grouped.COUNTS.clear()
        with caplog.at_level(logging.WARNING, logger="rayfl.engine.grouped"):
            metrics, _, states = runner.fit(1, [0, 1, 2], {}, [None] * 3, evaluate=True)
        out.append((metrics, states))
    assert grouped.COUNTS.get("grouped", 0) == 0
    assert reason in caplog.text
    (m0, s0), (m1, s1) = out
    assert [r["train/loss"] for r in m0] == [r["train/loss"] for r in m1]
    assert [r["acc"] for r in m0] == [r["acc"] for r in m1]
    for a, b in zip(s0, s1):
        assert all(np.array_equal(a[k], b[k]) for k in a)

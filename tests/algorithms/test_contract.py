"""The contract every registered algorithm keeps (new algorithms are covered by registering them).

For each name in `ALGORITHMS.names()`: 2 rounds, 3 clients, serial executor, synthetic 8x8 data,
two tiny heterogeneous models (`tiny2`; `[tiny_a]` for homogeneous algorithms; a public split
for those that need one; width-scaled ResNet-18s for algorithms that refuse `tiny2`). Checks:
finite metrics, personalized accuracy present, client state and server state round-trip into
fresh instances, and the family checks raise a clear ConfigError.
"""

from __future__ import annotations

import importlib
import io
import math
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rayfl.algorithms import ALGORITHMS
from rayfl.algorithms.base import RoundContext
from rayfl.config import build_config
from rayfl.engine.callbacks import Callback
from rayfl.engine.checkpoint import load_state, state_bytes
from rayfl.engine.loop import Simulation
from rayfl.engine.training import logits_of
from rayfl.errors import ConfigError

RND = RoundContext(1, 2)  # round 1 of 2


def import_every_algorithm_module() -> None:
    """Import every module of `rayfl.algorithms`, so one dropped in is covered before it is wired."""
    import rayfl.algorithms

    for info in pkgutil.iter_modules(rayfl.algorithms.__path__):
        importlib.import_module(f"rayfl.algorithms.{info.name}")


import_every_algorithm_module()

NAMES = ALGORITHMS.names()
CPU = torch.device("cpu")
FALLBACK_ARCHS = ["resnet18_w1", "resnet18_w2"]  # for algorithms that need width-sliced families
# Light settings for algorithms whose defaults are too heavy for a 2-round CPU check (the
# contract is about interfaces, not accuracy). A new heavy algorithm adds its entry here.
CONTRACT_PARAMS: dict[str, dict[str, Any]] = {
    "heterofl": {"global_arch": "resnet18_w2"},
    "fedfd": {"global_arch": "resnet18_w2", "steps": 2},
    "feddf": {"global_arch": "resnet18_w2", "steps": 2},
    "fedl2g": {"warm_up_rounds": 1},  # round 2 trains (the default warms up for 50 rounds)
}


def contract_raw(
    name: str, architectures: list[str] | None = None, num_samples: int = 600, num_test: int = 200
) -> dict[str, Any]:
    algo = ALGORITHMS.get(name)
    if architectures is not None:
        model: dict[str, Any] = {"architectures": architectures}
    elif algo.needs_homogeneous:
        model = {"architectures": ["tiny_a"]}
    else:
        model = {"family": "tiny2"}
    return {
        "name": "contract",
        "seed": 0,
        "algorithm": {"name": name, **CONTRACT_PARAMS.get(name, {})},
        "data": {
            "dataset": "synthetic",
            "num_clients": 3,
            "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 10},
            "public_fraction": 0.2 if algo.needs_public else 0.0,
            "options": {"num_samples": num_samples, "num_test": num_test, "shape": [1, 8, 8]},
        },
        "model": model,
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "engine": {"rounds": 2, "executor": "serial", "checkpoint_every": 0},
        "tracking": {"backend": "none"},
    }


def run_contract(name: str, run_dir: Path, **sizes: int) -> tuple[Simulation, Capture, Any]:
    """Run the contract config (`sizes`: `contract_raw`'s data sizes); width-sliced algorithms
    (HeteroFL, FedFD, ...) that refuse `tiny2` with a ConfigError get the fallback family."""
    for archs in (None, FALLBACK_ARCHS):
        capture = Capture()
        try:
            sim = Simulation(
                build_config(contract_raw(name, archs, **sizes)), run_dir / str(archs is not None)
            )
            sim.callbacks.append(capture)
            return sim, capture, sim.run()
        except ConfigError:
            if archs is not None:
                raise
    raise AssertionError("unreachable")


class Capture(Callback):
    """Grabs client states, the server state and the broadcasts before the executor closes."""

    def on_run_end(self, sim: Simulation, status: str) -> None:
        ex = sim.executor
        assert ex is not None
        # through the checkpoint's file format (no pickle): every state must survive it
        self.client_states = {
            c: through_checkpoint(s) for c, s in ex.client_states(range(sim.cfg.data.num_clients))
        }
        self.server_state = through_checkpoint(ex.server_state())
        archs = sorted(set(sim.archs))
        _, payloads = ex.broadcast(1, archs)
        self.payloads = {a: payloads[a] for a in archs}


def through_checkpoint(state: Any) -> Any:
    return load_state(io.BytesIO(state_bytes(state)))


def fresh_client(sim: Simulation, arch: str, seed: int) -> Any:
    torch.manual_seed(seed)  # a different init each time: only the loaded state may make them agree
    client = sim.algo.client(sim.spec.client_context(arch, CPU), sim.spec.params)
    for m in client.modules():
        m.to(CPU)
    return client


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"{where}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, np.ndarray | torch.Tensor):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def perturbed(payload: Mapping[str, Any]) -> dict[str, Any]:
    """`payload` with every array moved by one: another broadcast of the same shape."""
    return {k: np.asarray(v) + np.ones_like(np.asarray(v)) for k, v in payload.items()}


@torch.no_grad()
def outputs(client: Any, x: torch.Tensor) -> torch.Tensor:
    for m in client.modules():
        m.eval()
    return logits_of(client.eval_model()(x))


@pytest.mark.parametrize("name", NAMES)
def test_contract(name, tmp_path):
    sim, capture, result = run_contract(name, tmp_path)

    # -- metrics: two rounds, all finite, personalized accuracy in [0, 1]
    assert result.status == "FINISHED" and len(result.history) == 2
    for row in result.history:
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, f"{name}: non-finite metrics {bad}"
    assert 0.0 <= result.final["personal/acc"] <= 1.0

    # -- client state: load into two differently initialized instances -> identical outputs
    assert set(capture.client_states) == {0, 1, 2}
    x = torch.randn(5, *sim.spec.in_shape, generator=torch.Generator().manual_seed(1))
    for cid, state in capture.client_states.items():
        arch = sim.archs[cid]
        a, b = fresh_client(sim, arch, 101), fresh_client(sim, arch, 202)
        for c in (a, b):
            c.load_state_dict(state)
            assert_same(state, c.state_dict(), f"{name} client {cid} state")
            c.receive(capture.payloads[arch], RND)
        torch.testing.assert_close(outputs(a, x), outputs(b, x), rtol=0, atol=0)

    # -- a client that declares its deployed model independent of the payload (the deployed
    # evaluation then keeps its score across broadcasts) deploys the same model whatever it gets
    if not sim.algo.client.deploys_payload(sim.spec.params):
        for cid, state in capture.client_states.items():
            arch = sim.archs[cid]
            deployed = []
            for payload in (capture.payloads[arch], perturbed(capture.payloads[arch])):
                client = fresh_client(sim, arch, 505)
                client.load_state_dict(state)
                model = client.deployed_model(payload, RND).eval()
                with torch.no_grad():
                    deployed.append(logits_of(model(x)))
            torch.testing.assert_close(deployed[0], deployed[1], rtol=0, atol=0)

    # -- server state: a fresh server loaded with it broadcasts and scores the same
    torch.manual_seed(303)
    server = sim.algo.server(sim.spec.server_context(CPU), sim.spec.params)
    server.load_state_dict(capture.server_state)
    assert_same(capture.server_state, server.state_dict(), f"{name} server state")
    for arch, payload in capture.payloads.items():
        assert_same(payload, server.broadcast(arch, RND), f"{name} broadcast to {arch}")
    torch.manual_seed(404)
    twin = sim.algo.server(sim.spec.server_context(CPU), sim.spec.params)
    twin.load_state_dict(capture.server_state)
    for key, model in server.eval_models().items():
        model.eval()
        other = twin.eval_models()[key].eval()
        with torch.no_grad():
            torch.testing.assert_close(logits_of(model(x)), logits_of(other(x)), rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in NAMES if ALGORITHMS.get(n).needs_common_feature_dim])
def test_common_feature_size_is_required(name, tmp_path):
    raw = contract_raw(name, ["cnn1", "mlp"])  # feature sizes 500 and 128
    with pytest.raises(ConfigError, match="feature size"):
        Simulation(build_config(raw), tmp_path)


@pytest.mark.parametrize("name", [n for n in NAMES if ALGORITHMS.get(n).needs_homogeneous])
def test_homogeneous_algorithms_refuse_two_architectures(name, tmp_path):
    raw = contract_raw(name, ["tiny_a", "tiny_b"])
    with pytest.raises(ConfigError, match="one architecture"):
        Simulation(build_config(raw), tmp_path)


def test_every_algorithm_documents_what_it_shares():
    for name in NAMES:
        module = importlib.import_module(ALGORITHMS.get(name).client.__module__)
        doc = module.__doc__ or ""
        for line in ("Shares:", "Keeps local:", "Server:"):
            assert line in doc, f"{module.__name__} docstring lacks {line!r}"

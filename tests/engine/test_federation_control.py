"""eval.federation_control: every algorithm's own client, cut off from the federation (it receives
the server's first broadcast every round), trained in the same run on the same partition and
seeds; the federated gain over it is what the federation brought."""

from __future__ import annotations

import numpy as np
import pytest

from rayfl.config import build_config
from rayfl.engine.loop import Simulation
from rayfl.errors import ConfigError
from tests.algorithms.test_contract import FALLBACK_ARCHS, NAMES, contract_raw

CONTROL = "eval.federation_control=true"


def final(raw, overrides, tmp_path):
    return Simulation(build_config(raw, overrides), tmp_path).run().final


def contract_history(name, overrides, tmp_path):
    """The contract config's per-round rows without timings (width-sliced algorithms get the
    contract's fallback family)."""
    try:
        sim = Simulation(build_config(contract_raw(name), overrides), tmp_path)
    except ConfigError:
        raw = contract_raw(name, FALLBACK_ARCHS)
        sim = Simulation(build_config(raw, overrides), tmp_path / "fallback")
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in sim.run().history]


def test_the_control_leaves_the_run_alone_and_credits_beta_to_itself(synthetic_raw, tmp_path):
    over = ["engine.rounds=2", "algorithm.beta=0.5"]
    with_control = final(
        synthetic_raw, [*over, CONTROL, "eval.local_baseline=true"], tmp_path / "a"
    )
    plain = final(synthetic_raw, over, tmp_path / "b")
    assert with_control["personal/acc"] == plain["personal/acc"]
    assert with_control["proxy/acc"] == plain["proxy/acc"]
    # the control keeps beta's pull toward the untrained proxy, so it is not local training
    assert with_control["baseline/control_acc"] != with_control["baseline/local_acc"]


def test_with_nothing_received_the_control_is_the_algorithm(synthetic_raw, tmp_path):
    # beta 0: pFedES's local model never reads the proxy, so the control equals the run itself
    out = final(synthetic_raw, ["engine.rounds=2", "algorithm.beta=0", CONTROL], tmp_path)
    assert out["baseline/control_acc"] == out["personal/acc"]
    assert out["baseline/federated_gain_points"] == 0.0


def test_the_control_survives_resume(synthetic_raw, tmp_path):
    from rayfl.engine.checkpoint import Checkpoint

    over = ["engine.rounds=3", CONTROL, "algorithm.beta=0.5"]
    full = final(synthetic_raw, over, tmp_path / "full")
    first = build_config(synthetic_raw, [*over[1:], "engine.rounds=2"])
    Simulation(first, tmp_path / "r", [Checkpoint(tmp_path / "r", 1)]).run()
    again = build_config(synthetic_raw, over)
    sim = Simulation(again, tmp_path / "r", [Checkpoint(tmp_path / "r", 1, resume=True)])
    resumed = sim.run().final
    assert resumed["baseline/control_acc"] == full["baseline/control_acc"]
    assert resumed["personal/acc"] == full["personal/acc"]


@pytest.mark.ray
@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_reports_its_control_and_ray_gives_the_serial_one(
    name, ray_local, tmp_path
):
    # every round's numbers, the control's included (it leaves the run's own alone: above)
    serial = contract_history(name, [CONTROL], tmp_path / "s")
    last = serial[-1]
    control, gain = last["baseline/control_acc"], last["baseline/federated_gain_points"]
    assert 0.0 <= control <= 1.0 and np.isfinite(gain)
    assert gain == pytest.approx(100 * (last["personal/acc"] - control))
    ray = contract_history(
        name,
        [CONTROL, "engine.executor=ray", "engine.num_workers=2", "engine.clients_per_call=1"],
        tmp_path / "r",
    )
    assert ray == serial


def test_skipping_what_only_the_upload_needs_leaves_the_control_unchanged(
    synthetic_raw, tmp_path, monkeypatch
):
    # pFedES input's stage 2 trains only the proxy it uploads: the control skips it
    from rayfl.algorithms.pfedes_input import PFedESInputClient

    over = ["engine.rounds=3", "algorithm.variant=input", "algorithm.proxy_epochs=2", CONTROL]
    skipped = Simulation(build_config(synthetic_raw, over), tmp_path / "a").run()
    monkeypatch.setattr(PFedESInputClient, "fit_cut_off", PFedESInputClient.fit)
    full = Simulation(build_config(synthetic_raw, over), tmp_path / "b").run()
    assert skipped.final["baseline/control_acc"] == full.final["baseline/control_acc"]
    assert skipped.final["personal/acc"] == full.final["personal/acc"]
    assert [r.get("baseline/control_acc") for r in skipped.history] == [
        r.get("baseline/control_acc") for r in full.history
    ]

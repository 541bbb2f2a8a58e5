"""eval.local_baseline: a local-only shadow of each client, trained in the same run, equals a
separate `algorithm.name=local` run on the same partition and seed."""

import pytest

from rayfl.config import build_config
from rayfl.engine.loop import Simulation


def run(raw, overrides, tmp_path):
    return Simulation(build_config(raw, overrides), tmp_path).run()


def test_shadow_equals_a_separate_local_run(synthetic_raw, tmp_path):
    common = ["engine.rounds=2", "engine.fraction=0.5"]
    beta = ["algorithm.beta=0.5"]
    fed = run(synthetic_raw, [*common, *beta, "eval.local_baseline=true"], tmp_path / "a").final
    local = run(synthetic_raw, [*common, "algorithm.name=local"], tmp_path / "b").final
    plain = run(synthetic_raw, [*common, *beta], tmp_path / "c").final
    # bit for bit: same initial weights, seeds and batches as the separate local run
    assert fed["baseline/local_acc"] == local["personal/acc"]
    for arch in ("tiny_a", "tiny_b"):
        assert fed[f"baseline/local_acc/arch={arch}"] == pytest.approx(
            local[f"personal/acc/arch={arch}"]
        )
    assert fed["baseline/gain_points"] == pytest.approx(
        100 * (fed["personal/acc"] - local["personal/acc"])
    )
    # the shadow does not touch the federated run's own numbers
    assert fed["personal/acc"] == plain["personal/acc"]
    assert fed["proxy/acc"] == plain["proxy/acc"]
    assert "baseline/local_acc" not in plain


def test_beta_zero_is_local_training(synthetic_raw, tmp_path):
    fed = run(synthetic_raw, ["algorithm.beta=0", "eval.local_baseline=true"], tmp_path).final
    assert fed["baseline/local_acc"] == fed["personal/acc"]
    assert fed["baseline/gain_points"] == 0.0


def test_shadow_survives_resume(synthetic_raw, tmp_path):
    from rayfl.engine.checkpoint import Checkpoint

    over = ["engine.rounds=3", "eval.local_baseline=true", "algorithm.beta=0.5"]
    full = run(synthetic_raw, over, tmp_path / "full").final
    cfg2 = build_config(synthetic_raw, [*over[1:], "engine.rounds=2"])
    sim = Simulation(cfg2, tmp_path / "r", [Checkpoint(tmp_path / "r", 1)])
    sim.run()
    cfg3 = build_config(synthetic_raw, over)
    sim = Simulation(cfg3, tmp_path / "r", [Checkpoint(tmp_path / "r", 1, resume=True)])
    resumed = sim.run().final
    assert resumed["baseline/local_acc"] == full["baseline/local_acc"]

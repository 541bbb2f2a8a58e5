"""The DP noise's secret (`privacy.dp.noise_seed`): fresh per run unless pinned, kept in the
checkpoint so that a resume draws the noise the uninterrupted run drew, never in the config."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from rayfl.config import DPConfig, PrivacyConfig, build_config
from rayfl.engine.checkpoint import Checkpoint, load_state
from rayfl.engine.loop import Simulation
from rayfl.engine.server import PRIVACY_STATE
from rayfl.errors import UserError
from rayfl.privacy.hook import PrivacyHook

DP = [
    "privacy.dp.enabled=true",
    "privacy.dp.noise_multiplier=1.0",
    "privacy.dp.clip=1.0",
    "algorithm.name=fedavg",
    "model.architectures=[tiny_a]",
    "eval.protocol=after_fit",
]


def _noise(noise_seed):
    cfg = PrivacyConfig(dp=DPConfig(enabled=True, noise_seed=noise_seed))
    return PrivacyHook(cfg, "weighted_mean", seed=0, num_clients=4, per_round=4).noise(1000, 3)


def test_unset_noise_seed_draws_independent_noise_per_run():
    a, b = _noise(None), _noise(None)
    assert abs(float(np.corrcoef(a, b)[0, 1])) < 0.2  # independent, not the same vector
    assert np.std(a) == pytest.approx(1.0, rel=0.15)


def test_a_set_noise_seed_reproduces_the_noise_and_depends_on_the_round():
    np.testing.assert_array_equal(_noise(11), _noise(11))
    assert not np.array_equal(_noise(11), _noise(12))
    cfg = PrivacyConfig(dp=DPConfig(enabled=True, noise_seed=11))
    h = PrivacyHook(cfg, "weighted_mean", seed=0, num_clients=4, per_round=4)
    assert not np.array_equal(h.noise(1000, 3), h.noise(1000, 4))


def _run(raw, out, rounds, overrides=(), resume=False):
    cfg = build_config(raw, [*DP, f"engine.rounds={rounds}", *overrides])
    return Simulation(cfg, out, [Checkpoint(out, 1, resume=resume)]).run().history


def _numbers(history):
    return [[row["train/loss"], row["personal/acc"]] for row in history]


def test_two_runs_without_noise_seed_differ_and_with_it_agree(synthetic_raw, tmp_path):
    a = _run(synthetic_raw, tmp_path / "a", 3)
    b = _run(synthetic_raw, tmp_path / "b", 3)
    assert _numbers(a)[0] == _numbers(b)[0]  # round 1 trains from the same start
    assert _numbers(a)[1:] != _numbers(b)[1:]  # then each run's own noise
    c = _run(synthetic_raw, tmp_path / "c", 3, ["privacy.dp.noise_seed=5"])
    d = _run(synthetic_raw, tmp_path / "d", 3, ["privacy.dp.noise_seed=5"])
    assert _numbers(c) == _numbers(d)


def _secret(run_dir):
    state = load_state(run_dir / "checkpoint" / "server.npz")
    return int(state[PRIVACY_STATE]["noise_key"], 16)


def test_a_resumed_run_draws_the_uninterrupted_runs_noise(synthetic_raw, tmp_path):
    _run(synthetic_raw, tmp_path / "r", 2)  # a run stopped after round 2 (its checkpoint)
    shutil.copytree(tmp_path / "r", tmp_path / "copy", symlinks=True)
    secret = _secret(tmp_path / "r")
    resumed = _numbers(_run(synthetic_raw, tmp_path / "r", 4, resume=True))
    again = _numbers(_run(synthetic_raw, tmp_path / "copy", 4, resume=True))
    assert resumed == again  # the secret came back from the checkpoint, not from new entropy
    # the uninterrupted run with that secret: every round the same
    straight = _numbers(_run(synthetic_raw, tmp_path / "s", 4, [f"privacy.dp.noise_seed={secret}"]))
    assert resumed == straight


def test_the_secret_is_only_in_the_checkpoint(synthetic_raw, tmp_path):
    _run(synthetic_raw, tmp_path / "r", 1)
    secret = f"{_secret(tmp_path / 'r'):x}"
    logged = [p for p in (tmp_path / "r").rglob("*") if p.is_file() and "checkpoint" not in str(p)]
    assert all(secret not in p.read_bytes().decode("latin-1") for p in logged)
    assert build_config(synthetic_raw, DP).privacy.dp.noise_seed is None


def test_dp_refuses_batchnorm_running_statistics_in_one_line(synthetic_raw, tmp_path):
    raw = dict(synthetic_raw)
    raw["data"] = {
        **raw["data"],
        "options": {"num_samples": 200, "num_test": 60, "shape": [1, 8, 8]},
    }
    cfg = build_config(raw, [*DP, "model.architectures=[resnet_small]", "engine.rounds=1"])
    with pytest.raises(UserError) as info:
        Simulation(cfg, tmp_path).run()
    assert "\n" not in str(info.value) and "running_" in str(info.value)

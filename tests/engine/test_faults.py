"""Fault paths of a round, with fake replies and a fake clock, no processes (Flower-style):
non-finite or empty replies are rejected and counted, too few replies fail the round, and the
round deadline drops the clients it did not reach."""

import numpy as np
import pytest
import torch

from rayfl.algorithms.base import Reply
from rayfl.config import build_config
from rayfl.engine.executor import SerialExecutor
from rayfl.engine.loop import Simulation, make_spec, prepare_federation
from rayfl.engine.server import RoundFailed, ServerRunner
from rayfl.models.families import family_from_config

HOMOGENEOUS = ["algorithm.name=fedavg", "model.architectures=[tiny_a]", "data.num_clients=4"]


def server_runner(raw, overrides=()):
    cfg = build_config(raw, HOMOGENEOUS + list(overrides))
    fed = prepare_federation(cfg)
    archs = family_from_config(cfg.model.family, cfg.model.architectures).assign(4)
    return ServerRunner(make_spec(cfg, archs, fed), fed, torch.device("cpu"))


def constant_payload(runner, value):
    """A FedAvg upload whose every float entry is `value`."""
    _, (down,) = runner.broadcast(1, ["tiny_a"])
    return {k: np.full_like(v, value) for k, v in down.items()}


def global_weights(runner):
    return {k: v.numpy().copy() for k, v in runner.server.shared.state_dict().items()}


def test_a_non_finite_reply_is_rejected_counted_and_never_averaged(synthetic_raw):
    runner = server_runner(synthetic_raw)
    bad = constant_payload(runner, 1.0)
    first = next(k for k, v in bad.items() if np.issubdtype(v.dtype, np.floating))
    bad[first] = bad[first].copy()
    bad[first].flat[0] = np.nan
    replies = [
        Reply(0, "tiny_a", 10, constant_payload(runner, 2.0)),
        Reply(1, "tiny_a", 30, bad),
        Reply(2, "tiny_a", 30, constant_payload(runner, np.inf)),
        Reply(3, "tiny_a", 0, constant_payload(runner, 5.0)),  # no samples: rejected too
    ]
    metrics = runner.step(1, [replies[:2], replies[2:]], evaluate=False)
    assert metrics["server/rejected"] == 3.0
    # the average of the one valid reply is that reply: 2 everywhere, no NaN, no inf, no 5
    for v in global_weights(runner).values():
        if np.issubdtype(v.dtype, np.floating):
            np.testing.assert_array_equal(v, np.full_like(v, 2.0))


def test_valid_replies_are_averaged_by_samples_golden(synthetic_raw):
    runner = server_runner(synthetic_raw)
    replies = [
        Reply(1, "tiny_a", 30, constant_payload(runner, 4.0)),
        Reply(0, "tiny_a", 10, constant_payload(runner, 0.0)),
    ]
    metrics = runner.step(1, [replies], evaluate=False)
    assert metrics["server/rejected"] == 0.0
    w = global_weights(runner)["head.weight"]
    np.testing.assert_allclose(w, np.full_like(w, 3.0))  # (10 * 0 + 30 * 4) / 40


def test_too_few_valid_replies_fail_the_round(synthetic_raw):
    runner = server_runner(synthetic_raw, ["engine.min_replies=2"])
    before = global_weights(runner)
    replies = [
        Reply(0, "tiny_a", 10, constant_payload(runner, 1.0)),
        Reply(1, "tiny_a", 10, constant_payload(runner, np.nan)),
    ]
    with pytest.raises(RoundFailed, match=r"only 1 valid replies, engine.min_replies=2"):
        runner.step(3, [replies], evaluate=False)
    # nothing was aggregated
    for k, v in global_weights(runner).items():
        np.testing.assert_array_equal(v, before[k])
    with pytest.raises(RoundFailed, match="only 0 valid replies"):
        runner.step(3, [], evaluate=False)


class FakeClock:
    """Advances one second every time the executor looks at it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_round_deadline_drops_the_clients_it_did_not_reach(
    synthetic_raw, monkeypatch, tmp_path
):
    # deadline = 1 + 2.5; clients are started at 2 and 3, the third look (4) is past it
    monkeypatch.setattr(SerialExecutor, "clock", FakeClock())
    cfg = build_config(
        synthetic_raw, [*HOMOGENEOUS, "engine.rounds=1", "engine.round_timeout_s=2.5"]
    )
    row = Simulation(cfg, tmp_path).run().history[0]
    assert row["clients"] == 2.0


def test_a_deadline_that_leaves_too_few_replies_fails_the_round(
    synthetic_raw, monkeypatch, tmp_path
):
    monkeypatch.setattr(SerialExecutor, "clock", FakeClock())
    cfg = build_config(
        synthetic_raw,
        [*HOMOGENEOUS, "engine.rounds=1", "engine.round_timeout_s=2.5", "engine.min_replies=3"],
    )
    with pytest.raises(RoundFailed, match="only 2 valid replies"):
        Simulation(cfg, tmp_path).run()


def test_a_deadline_keeps_the_numbers_of_the_clients_it_reached(synthetic_raw, tmp_path):
    # a generous deadline trains client by client: the same numbers as one call for all
    base = [*HOMOGENEOUS, "engine.rounds=2"]
    plain = Simulation(build_config(synthetic_raw, base), tmp_path).run().history
    timed = build_config(synthetic_raw, [*base, "engine.round_timeout_s=3600"])
    with_deadline = Simulation(timed, tmp_path).run().history
    strip = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in plain]
    assert strip == [
        {k: v for k, v in r.items() if not k.startswith("time/")} for r in with_deadline
    ]

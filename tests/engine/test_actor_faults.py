"""Fault paths of the Ray executor: a dead server actor, user errors raised inside actors, start-up
time-outs. Each ends in identical numbers or in one line naming the fix."""

import pytest
import ray

from rayfl.config import build_config
from rayfl.engine import executor as executor_mod
from rayfl.engine import startup
from rayfl.engine.callbacks import Callback
from rayfl.engine.loop import Simulation
from rayfl.engine.server import RoundFailed
from rayfl.errors import UserError

pytestmark = pytest.mark.ray


def comparable(history):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in history]


class KillServer(Callback):
    """Kills the server actor after the given rounds (a test may reach into the simulation)."""

    def __init__(self, rounds):
        self.rounds = set(rounds)
        self.killed = 0

    def on_round_end(self, sim, round_idx, metrics):
        if round_idx in self.rounds:
            ray.kill(sim.executor.server, no_restart=True)
            self.killed += 1


def test_a_dead_server_actor_restarts_from_the_last_round_with_identical_numbers(
    ray_local, synthetic_raw
):
    overrides = ["engine.rounds=2", "engine.num_workers=1"]
    serial = Simulation(build_config(synthetic_raw, overrides), "/tmp/unused").run().history
    killer = KillServer({1})
    cfg = build_config(synthetic_raw, [*overrides, "engine.executor=ray", "engine.server_in=actor"])
    disturbed = Simulation(cfg, "/tmp/unused", [killer]).run().history
    assert killer.killed == 1
    assert comparable(disturbed) == comparable(serial)


@pytest.mark.parametrize("server_in", ["actor", "driver"])
def test_a_user_error_inside_the_server_actor_reaches_the_user_as_its_one_line(
    ray_local, synthetic_raw, server_in
):
    overrides = ["engine.executor=ray", "engine.min_replies=7", f"engine.server_in={server_in}"]
    cfg = build_config(synthetic_raw, overrides)
    with pytest.raises(RoundFailed) as err:
        Simulation(cfg, "/tmp/unused").run()
    assert type(err.value) is RoundFailed  # not Ray's RayTaskError(RoundFailed) wrapper
    assert "\n" not in str(err.value) and "engine.min_replies=7" in str(err.value)


def test_workers_that_do_not_start_in_time_are_one_line(ray_local, synthetic_raw):
    cfg = build_config(synthetic_raw, ["engine.executor=ray", "engine.startup_timeout_s=0.001"])
    with pytest.raises(UserError, match=r"engine\.startup_timeout_s=0\.001") as err:
        Simulation(cfg, "/tmp/unused").run()
    assert "\n" not in str(err.value)


def test_a_ray_start_up_failure_is_one_line_with_the_fix(monkeypatch):
    def timeout(**kwargs):
        raise RuntimeError("Timed out after 60 seconds waiting for the GCS to start.\nmore")

    monkeypatch.setattr(executor_mod.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(executor_mod.ray, "init", timeout)
    with pytest.raises(UserError, match="could not start a local Ray") as err:
        startup.init_ray(None, 2)
    assert "\n" not in str(err.value) and "engine.executor=serial" in str(err.value)

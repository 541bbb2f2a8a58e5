"""Fault paths of the Ray executor: a dead server actor, user errors raised inside actors, start-up
time-outs. Each ends in identical numbers or in one line naming the fix."""

import dataclasses
import gc
import time

import pytest
import ray

from rayfl.config import build_config
from rayfl.engine import ray_executor, startup
from rayfl.engine.callbacks import Callback
from rayfl.engine.loop import Simulation
from rayfl.engine.ray_executor import ray_get_first
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
    ray_local, synthetic_raw, tmp_path
):
    overrides = ["engine.rounds=2", "engine.num_workers=1"]
    serial = Simulation(build_config(synthetic_raw, overrides), tmp_path).run().history
    killer = KillServer({1})
    cfg = build_config(synthetic_raw, [*overrides, "engine.executor=ray", "engine.server_in=actor"])
    disturbed = Simulation(cfg, tmp_path, [killer]).run().history
    assert killer.killed == 1
    assert comparable(disturbed) == comparable(serial)


@pytest.mark.parametrize("server_in", ["actor", "driver"])
def test_a_user_error_inside_the_server_actor_reaches_the_user_as_its_one_line(
    ray_local, synthetic_raw, server_in, tmp_path
):
    overrides = ["engine.executor=ray", f"engine.server_in={server_in}"]
    cfg = build_config(synthetic_raw, overrides)
    # past the config's own check (it refuses 7 of 6 up front): the server must refuse the round
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, min_replies=7))
    with pytest.raises(RoundFailed) as err:
        Simulation(cfg, tmp_path).run()
    assert type(err.value) is RoundFailed  # not Ray's RayTaskError(RoundFailed) wrapper
    assert "\n" not in str(err.value) and "engine.min_replies=7" in str(err.value)


def test_a_failed_server_step_leaves_no_unhandled_ray_error_behind(
    ray_local, synthetic_raw, tmp_path, capsys
):
    # the step's other returns hold the same error: Ray prints each one it frees unread
    cfg = build_config(synthetic_raw, ["engine.executor=ray", "engine.server_in=actor"])
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, min_replies=7))
    with pytest.raises(RoundFailed):
        Simulation(cfg, tmp_path).run()
    gc.collect()
    time.sleep(2.0)  # Ray reports a freed unread error from a thread of its own
    assert "Unhandled error" not in capsys.readouterr().err


@ray.remote
def _fail_after(seconds):
    time.sleep(seconds)
    raise ValueError("late")


def test_a_failed_calls_later_returns_are_read_not_left_to_ray(ray_local, capsys, monkeypatch):
    # a return stored after the first raised: read once it lands, not freed unread
    first, later = _fail_after.remote(0.0), _fail_after.remote(1.0)
    ray.wait([first])
    with pytest.raises(ray.exceptions.RayTaskError):
        ray_get_first([first, later])
    del first, later
    gc.collect()
    time.sleep(2.0)
    assert "Unhandled error" not in capsys.readouterr().err

    # an interrupt does not wait for the rest
    def interrupted(ref):
        raise KeyboardInterrupt

    timeouts = []
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: timeouts.append(timeout))
    monkeypatch.setattr(ray_executor, "ray_get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ray_get_first([object(), object(), object()])
    assert timeouts == [0.0, 0.0]


def test_workers_that_do_not_start_in_time_are_one_line(ray_local, synthetic_raw, tmp_path):
    cfg = build_config(synthetic_raw, ["engine.executor=ray", "engine.startup_timeout_s=0.001"])
    with pytest.raises(UserError, match=r"engine\.startup_timeout_s=0\.001") as err:
        Simulation(cfg, tmp_path).run()
    assert "\n" not in str(err.value)


# What Ray 2.60 raises when its local start fails: a bare Exception for the node's start-up
# timeout, RuntimeError for a GCS that did not come up or a raylet that died, ConnectionError
# for a raylet socket that never answered.
START_FAILURES = [
    Exception(
        "The current node timed out during startup. This could happen because some of the "
        "Ray processes failed to startup.\nmore"
    ),
    RuntimeError("Timed out after 60 seconds waiting for the GCS to start.\nmore"),
    RuntimeError("Failed to start the raylet. The raylet process exited with code -6.\nmore"),
    ConnectionError("Could not connect to socket /tmp/ray/session_x/sockets/raylet\nmore"),
]


@pytest.mark.parametrize("failure", START_FAILURES, ids=lambda e: type(e).__name__)
def test_a_ray_start_up_failure_is_one_line_with_the_fix(monkeypatch, failure):
    def fail(**kwargs):
        raise failure

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fail)
    with pytest.raises(UserError, match="could not start a local Ray") as err:
        startup.init_ray(None, 2)
    message = str(err.value)
    assert "\n" not in message and "engine.executor=serial" in message
    assert str(failure).splitlines()[0][:40] in message  # Ray's own reason, first line


def test_rayfl_run_reports_a_failed_ray_start_in_one_line(
    monkeypatch, tmp_path, synthetic_raw, capsys
):
    # `rayfl run` starts Ray in a thread before it checks the config: the failure travels to the
    # main thread and ends as the CLI's one line, exit code 2, no traceback.
    import yaml

    from rayfl.cli import main

    def fail(**kwargs):
        raise START_FAILURES[0]

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fail)
    synthetic_raw["engine"].update(executor="ray", rounds=1)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(synthetic_raw))
    code = main(["run", str(config), "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("rayfl: error: could not start a local Ray")
    assert "timed out during startup" in err[0]


def test_a_symlinked_spill_folder_in_the_run_directory_is_refused(tmp_path, synthetic_raw):
    # A run directory is untrusted (a resumed one may come from elsewhere): Ray must not spill
    # objects through a link to another place. Refused before Ray starts.
    from rayfl.config import build_config as build

    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ray-spill").symlink_to(elsewhere)
    engine = build(synthetic_raw, ["engine.executor=ray"]).engine
    with pytest.raises(UserError, match="ray-spill is a symlink") as err:
        startup.init_ray_for_run(engine, startup.spill_dir(tmp_path / "run"))
    assert "\n" not in str(err.value)
    assert list(elsewhere.iterdir()) == []

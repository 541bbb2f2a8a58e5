"""Start-up phases: measured, recorded in the first row, and Ray started beside the data load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml

from rayfl.config import build_config
from rayfl.engine.loop import Simulation

ROOT = Path(__file__).resolve().parents[2]


def test_serial_run_records_its_start_up_in_the_first_row(synthetic_raw, tmp_path):
    history = Simulation(build_config(synthetic_raw), tmp_path).run().history
    first = history[0]
    for phase in ("imports", "data_load", "executor", "first_round_at"):
        assert first[f"time/startup/{phase}_s"] >= 0.0
    assert first["time/startup/first_round_at_s"] >= first["time/startup/imports_s"]
    assert not any(k.startswith("time/startup/") for k in history[1])


@pytest.mark.ray
def test_ray_run_records_the_actor_phases(ray_local, synthetic_raw, tmp_path):
    first = Simulation(build_config(synthetic_raw, ["engine.executor=ray"]), tmp_path)
    first = first.run().history[0]
    for phase in ("ray_start", "actors_launch", "data_load", "dataset_put", "actors_ready"):
        assert f"time/startup/{phase}_s" in first


@pytest.mark.ray
def test_rayfl_run_starts_its_own_ray_in_a_thread_and_finishes(tmp_path, synthetic_raw):
    # The thread that starts Ray must outlive it (Ray's daemons die with their parent thread):
    # a run longer than a moment would otherwise end with exit 1 and no traceback.
    synthetic_raw["engine"].update(executor="ray", ray_num_cpus=2, rounds=2)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(synthetic_raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "rayfl.cli", "-v", "run", str(config), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "start-up: imports" in proc.stderr
    final = json.loads((tmp_path / "r" / "summary.json").read_text())["final"]
    assert final["time/startup/ray_start_s"] > 0


@pytest.mark.ray
def test_simulate_inside_a_running_ray_does_not_wait_for_itself(ray_local, synthetic_raw, tmp_path):
    # Suites on Ray run `simulate` inside Ray tasks and tests inside the session's Ray: Ray is
    # already up, so nothing starts in a thread, and the launch must not wait for the imports
    # that only the (absent) thread waits on. It did: CI hung here.
    from rayfl.launch import simulate

    cfg = build_config(synthetic_raw, ["engine.executor=ray", "engine.rounds=1"])
    done: list[object] = []
    runner = threading.Thread(target=lambda: done.append(simulate(cfg, tmp_path, progress=False)))
    runner.daemon = True
    runner.start()
    runner.join(timeout=300)
    assert done and done[0].status == "FINISHED"


def test_a_config_error_found_while_ray_starts_launches_no_actors(monkeypatch, synthetic_raw):
    # `rayfl run` starts Ray before the checks that need torch; when one fails, `cancel` must
    # not start the actors' processes only to stop them.
    import ray

    import rayfl.engine.early as early_mod
    import rayfl.engine.ray_executor as executor
    from rayfl.engine import startup

    launched: list[bool] = []
    # as in `rayfl run`, where a thread starts Ray
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    # joined: nothing to stop
    monkeypatch.setattr(early_mod, "init_ray_for_run", lambda *a, **k: False)
    monkeypatch.setattr(executor.RayExecutor, "launch", lambda *a, **k: launched.append(True))
    engine = build_config(synthetic_raw, ["engine.executor=ray"]).engine
    early = early_mod.EarlyRay(engine, 2, startup.StartupClock(), imported=False)
    early.cancel()
    assert launched == [] and early.executor is None and early.error is None


_FORK_HOOK_PROBE = """
import json, os, threading
late = []
register = os.register_at_fork
def recording(**hooks):
    starter = [t for t in threading.enumerate() if t.name == "rayfl-ray-start"]
    if starter and threading.current_thread() is not starter[0] and "after_in_parent" in hooks:
        late.append(repr(hooks["after_in_parent"]))
    return register(**hooks)
os.register_at_fork = recording
from rayfl.cli import main
code = main(["run", "experiments/pfedes_fmnist.yaml", "model.architectures=[cnn_small, cnn9]"])
print(json.dumps({"code": code, "late": late}))
"""


@pytest.mark.ray
def test_no_fork_hook_pair_is_registered_beside_the_thread_that_starts_ray():
    # While Ray's start forks in its thread, the config check imports torch in this one; a
    # before/after pair of fork hooks registered then has its "after" hook run alone: torch's
    # `concurrent.futures.thread` printed "release unlocked lock" above a config error (CI).
    ray_tmp = tempfile.mkdtemp(prefix="rf", dir="/tmp")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _FORK_HOOK_PROBE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "RAY_TMPDIR": ray_tmp},
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"code": 2, "late": []}
    assert "Traceback" not in proc.stderr


def _probe(script: str, *args: str, cwd: Path) -> dict:
    """Run `script` in a fresh Python with a private Ray of its own; its last line, as JSON."""
    ray_tmp = tempfile.mkdtemp(prefix="rf", dir="/tmp")  # short: Ray's socket paths live there
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=cwd,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_SHUTDOWN_PROBE = """
import json, os, sys, psutil, ray
from rayfl.engine.startup import init_ray

spill = os.path.join(sys.argv[1], "run", "ray-spill")
assert init_ray(None, 1, object_store_mb=80, spill_dir=spill)
@ray.remote
def one():
    return 1
assert ray.get(one.remote()) == 1
# more than the 80 MB store holds at once: Ray spills the rest to `spill`
refs = [ray.put(b"x" * 30 * 2**20) for _ in range(5)]
spilled = sum(len(f) for _, _, f in os.walk(spill))
assert all(len(ray.get(r)) == 30 * 2**20 for r in refs)
del refs
ray.shutdown()
left = [p.pid for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]
print(json.dumps({"spilled_files": spilled, "left": left}))
"""


@pytest.mark.ray
def test_a_private_ray_spills_under_the_given_folder_and_stops_with_ray_shutdown(tmp_path):
    # Only `ray.init`'s own options and `ray.shutdown()`: objects beyond the store go to the
    # run's folder (not a path that other runs share), and nothing Ray started is left behind.
    out = _probe(_SHUTDOWN_PROBE, str(tmp_path), cwd=tmp_path)
    assert out["spilled_files"] > 0
    assert out["left"] == []


def test_the_engine_uses_no_private_ray_api_and_kills_no_process():
    # Ray's private modules and process hunting by command line broke silently on upgrades.
    # (rayfl.bench lists a run's processes to sum their memory: it reads, never signals.)
    engine = ROOT / "rayfl" / "engine"
    for path in [*engine.glob("*.py"), ROOT / "rayfl" / "bench.py", ROOT / "rayfl" / "launch.py"]:
        text = path.read_text()
        for needle in ("_private", "_system_config", ".kill()", "cmdline", "setattr("):
            assert needle not in text, f"{path.name} uses {needle}"


_EARLY_WORKERS_PROBE = """
import json, sys, time, psutil
from rayfl.config import ray_preview, read_yaml
from rayfl.engine.early import EarlyRay
from rayfl.engine.startup import StartupClock

engine, per_round = ray_preview(read_yaml(sys.argv[1]), [])  # as `rayfl run`: before torch
early = EarlyRay(engine, per_round, StartupClock(), imported=False)
names, deadline = [], time.monotonic() + 120
while time.monotonic() < deadline and not any("ClientWorker" in n for n in names):
    time.sleep(0.05)
    names = [p.name() for p in psutil.Process().children(recursive=True) if p.is_running()]
torch_before = "torch" in sys.modules
early.cancel()
left = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps({"names": names, "torch": torch_before, "left": left}))
"""


@pytest.mark.ray
def test_a_private_ray_starts_the_workers_actors_before_the_driver_imports_torch(
    tmp_path, synthetic_raw
):
    # `rayfl run`'s EarlyRay: the actors' processes import torch beside the driver, not after
    # it. Cancelled, nothing stays behind.
    synthetic_raw["engine"].update(
        executor="ray", ray_num_cpus=2, num_workers=2, worker_resources={"num_cpus": 1}
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(synthetic_raw))
    out = _probe(_EARLY_WORKERS_PROBE, str(config), cwd=tmp_path)
    workers = [n for n in out["names"] if n.startswith("ray::")]
    assert any("ClientWorker" in n for n in workers), out["names"]
    assert out["torch"] is False
    assert out["left"] == []

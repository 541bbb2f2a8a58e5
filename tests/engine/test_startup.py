"""Start-up phases: measured and recorded in the first row; Ray started and stopped through its
public API."""

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
def test_rayfl_run_starts_its_own_ray_and_finishes(tmp_path, synthetic_raw):
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
def test_simulate_in_a_thread_inside_a_running_ray_finishes(ray_local, synthetic_raw, tmp_path):
    # Suites on Ray run `simulate` inside Ray tasks and tests inside the session's Ray: Ray is
    # already up, and the run joins it.
    from rayfl.launch import simulate

    cfg = build_config(synthetic_raw, ["engine.executor=ray", "engine.rounds=1"])
    done: list[object] = []
    runner = threading.Thread(target=lambda: done.append(simulate(cfg, tmp_path, progress=False)))
    runner.daemon = True
    runner.start()
    runner.join(timeout=300)
    assert done and done[0].status == "FINISHED"


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
    # An exit through `os._exit` skipped the interpreter's own teardown.
    engine = ROOT / "rayfl" / "engine"
    for path in [*engine.glob("*.py"), ROOT / "rayfl" / "launch.py", ROOT / "rayfl" / "cli.py"]:
        text = path.read_text()
        for needle in ("_private", "_system_config", ".kill()", "cmdline", "setattr(", "_exit("):
            assert needle not in text, f"{path.name} uses {needle}"

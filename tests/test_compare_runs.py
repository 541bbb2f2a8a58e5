"""Suite execution: a failed run is recorded and the suite goes on, rerunning resumes (finished
runs skipped, unfinished ones from their checkpoints), checkpoints go unless kept, one-seed
tables have no ±, and `parallel` runs go as a Ray Tune grid with the same numbers."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

import rayfl.launch
from rayfl import gate
from rayfl.compare import run_suite
from tests.test_compare import write_suite

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray


def rows_of(out):
    return {r["label"]: r for r in pq.read_table(out / "runs.parquet").to_pylist()}


def test_failed_run_is_recorded_and_a_rerun_resumes(tmp_path, monkeypatch):
    path = write_suite(tmp_path, seeds=[0])
    out = tmp_path / "out"
    over = ["engine.checkpoint_every=1"]
    real = rayfl.launch.simulate
    calls = []

    def flaky(cfg, run_dir, **kw):
        calls.append(cfg.tracking.run_name)
        if cfg.algorithm.name == "fedproto" and len(calls) < 3:
            raise RuntimeError("worker ran out of memory")
        return real(cfg, run_dir, **kw)

    monkeypatch.setattr(rayfl.launch, "simulate", flaky)
    table = run_suite(path, over, out=out, progress=False)
    rows = rows_of(out)
    assert rows["local"]["status"] == "FINISHED" and rows["proto"]["status"] == "FAILED"
    assert "RuntimeError: worker ran out of memory" in rows["proto"]["error"]
    assert "1 run(s) FAILED" in table and "out of memory" in table
    assert "±" not in table  # one seed: plain values
    assert not list((out / "local" / "seed0").glob("checkpoint*"))  # removed once finished

    table = run_suite(path, over, out=out, progress=False, keep_checkpoints=True)
    assert calls == ["local-s0", "proto-s0", "proto-s0"]  # the finished run was skipped
    rows = rows_of(out)
    assert rows["proto"]["status"] == "FINISHED" and rows["local"]["status"] == "FINISHED"
    assert (out / "proto" / "seed0" / "checkpoint").exists()  # --keep-checkpoints
    assert "FAILED" not in table


def test_unfinished_run_resumes_from_its_checkpoint(tmp_path):
    path = write_suite(tmp_path, seeds=[0], algorithms=[{"name": "fedproto"}])
    straight = tmp_path / "straight"
    run_suite(path, ["engine.rounds=2"], out=straight, progress=False)
    out = tmp_path / "out"
    run_suite(path, ["engine.rounds=1"], out=out, progress=False, keep_checkpoints=True)
    summary = out / "fedproto" / "seed0" / "summary.json"
    data = json.loads(summary.read_text())
    data["status"] = "KILLED"  # as if interrupted after round 1
    gate.write(summary, json.dumps(data).encode())  # as rayfl writes it
    run_suite(path, ["engine.rounds=2"], out=out, progress=False)
    a, b = rows_of(straight)["fedproto"], rows_of(out)["fedproto"]
    assert b["rounds"] == 2 and b["personal/acc"] == a["personal/acc"]


@pytest.mark.ray
def test_parallel_runs_on_ray_give_the_serial_numbers(tmp_path, ray_local):
    path = write_suite(tmp_path, seeds=[0])
    serial = tmp_path / "serial"
    run_suite(path, [], out=serial, progress=False)
    out = tmp_path / "par"
    over = ["parallel=2", "engine.executor=ray", "engine.worker_resources.num_cpus=0.5"]
    table = run_suite(path, over, out=out, progress=False)
    a, b = rows_of(serial), rows_of(out)
    assert {r["status"] for r in b.values()} == {"FINISHED"}, table
    for label in ("local", "proto"):
        assert b[label]["personal/acc"] == a[label]["personal/acc"]

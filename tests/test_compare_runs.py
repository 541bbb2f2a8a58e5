"""Suite execution: a failed run is recorded and the suite goes on, rerunning resumes (finished
runs skipped, unfinished ones from their checkpoints), checkpoints go unless kept, one-seed
tables have no ±, and `parallel` runs go as a Ray Tune grid with the same numbers."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rayfl import gate
from rayfl.compare import run_suite
from tests.test_compare import compare_cli, write_suite

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray


def rows_of(out):
    return {r["label"]: r for r in pq.read_table(out / "runs.parquet").to_pylist()}


def test_failed_run_is_recorded_and_a_rerun_resumes(tmp_path):
    path = write_suite(tmp_path, seeds=[0])
    out = tmp_path / "out"
    over = ["engine.checkpoint_every=1"]
    calls = tmp_path / "calls.txt"
    got = compare_cli(path, out, *over, SUITE_FAULTS_FAIL="proto-s0", SUITE_FAULTS_CALLS=str(calls))
    assert got.returncode == 0, got.stderr[-2000:]
    table = got.stdout
    rows = rows_of(out)
    assert rows["local"]["status"] == "FINISHED" and rows["proto"]["status"] == "FAILED"
    assert "RuntimeError: worker ran out of memory" in rows["proto"]["error"]
    assert "1 run(s) FAILED" in table and "out of memory" in table
    assert "±" not in table  # one seed: plain values
    assert not list((out / "local" / "seed0").glob("checkpoint*"))  # removed once finished

    got = compare_cli(path, out, *over, "--keep-checkpoints", SUITE_FAULTS_CALLS=str(calls))
    assert got.returncode == 0, got.stderr[-2000:]
    # the finished run was skipped
    assert calls.read_text().split() == ["local-s0", "proto-s0", "proto-s0"]
    again = rows_of(out)
    assert again["proto"]["status"] == "FINISHED" and again["local"]["status"] == "FINISHED"
    assert (out / "proto" / "seed0" / "checkpoint").exists()  # --keep-checkpoints
    assert "FAILED" not in got.stdout


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


class _Unimportable:
    """Unpickled on a Ray worker, it fails as a worker that cannot import rayfl does."""

    def __reduce__(self):
        import importlib

        return importlib.import_module, ("rayfl_not_importable_here",)


def _never_runs(cfg, index, gone):
    raise AssertionError("its parameters cannot be unpickled")


@pytest.mark.ray
def test_a_trial_that_dies_before_it_reports_is_named_with_its_error(synthetic_raw, ray_local):
    from rayfl.config import build_config
    from rayfl.tune.trial import run_grid

    cfg = build_config(synthetic_raw, [])
    got = run_grid("dies", {0: cfg}, 1, _never_runs, gone=_Unimportable())
    assert isinstance(got[0], RuntimeError)
    message = (
        "its Ray Tune trial died: ModuleNotFoundError: No module named 'rayfl_not_importable_here'"
    )
    assert str(got[0]) == message

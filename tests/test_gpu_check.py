"""experiments/benchmarks/gpu_check.py: stops clearly without a GPU; runs (tiny) on one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_with_a_clear_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.gpu
def test_on_a_gpu_it_reports_placement_memory_and_throughput(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    workers = report["shared_gpu_workers"]
    assert len(workers) == 4 and all(w["device"].startswith("cuda") for w in workers)
    assert all(w["cuda_max_memory_mb"] > 0 for w in workers)
    assert set(report["clients_per_s"]) == {"serial", "ray4"}
    assert report["ray4_over_serial"] > 0
    shares = {w["resources"]["GPU"] for w in report["per_arch_shares"]["workers"]}
    assert shares == {0.5, 0.25, 0.125}


@pytest.mark.ray
@pytest.mark.experiment
def test_the_cpu_smoke_run_gives_the_full_report_on_logical_gpus(tmp_path):
    # What a lent GPU machine gets, in one run: 4 workers placed on one (here logical) GPU with
    # their details read before the run closed them (they were read after, from dead actors:
    # ActorDiedError and `shared_gpu_workers: []`), a finished run, and the throughput table.
    ray_tmp = tempfile.mkdtemp(prefix="rf", dir="/tmp")
    try:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--cpu-smoke"],
            capture_output=True,
            text=True,
            timeout=1200,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp},
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ActorDiedError" not in proc.stderr and "Traceback" not in proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    workers = report["shared_gpu_workers"]
    assert len(workers) == 4 and len({w["pid"] for w in workers}) == 4
    assert all(w["gpu_ids"] == ["0"] and w["cuda_visible_devices"] == "0" for w in workers)
    assert all(w["device"] == "cpu" for w in workers)  # --cpu-smoke: never CUDA
    assert report["shared_gpu_run"]["rounds"] == 2
    assert set(report["clients_per_s"]) == {"serial", "ray4"}
    assert all(v > 0 for v in report["clients_per_s"].values())
    per_arch = report["per_arch_shares"]
    assert {w["resources"].get("GPU") for w in per_arch["workers"]} == {0.5, 0.25}
    assert per_arch["clients_placed"] == 8

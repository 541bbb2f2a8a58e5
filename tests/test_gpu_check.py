"""experiments/benchmarks/gpu_check.py: stops clearly without a GPU; runs (tiny) on one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    assert set(report["clients_per_s"]) == {
        "serial_loop",
        "serial_grouped",
        "ray4_loop",
        "ray4_grouped",
    }

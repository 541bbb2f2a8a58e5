"""No code from the working directory: `cd DIR && rayfl run --resume .` imports no `json.py` or
`rayfl.py` planted in DIR, in the driver, its child processes or its Ray workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

PLANTED = """import os
with open({marker!r}, "a") as f:
    f.write(f"{{__name__}} imported by pid {{os.getpid()}}\\n")
"""

RUN = {
    "name": "cwd",
    "seed": 0,
    "data": {
        "dataset": "digits",
        "num_clients": 4,
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 20},
    },
    "model": {"architectures": ["cnn_small"]},
    "algorithm": {"name": "fedavg"},
    "train": {"local_epochs": 1, "batch_size": 64, "lr": 0.05},
    "engine": {"rounds": 1, "executor": "serial", "checkpoint_every": 1, "num_workers": 2},
    "tracking": {"backend": "none"},
}


def rayfl(args: list[str], cwd: Path, launcher: Path) -> subprocess.CompletedProcess[str]:
    """The `rayfl` command as installed: a script outside `cwd` that calls `rayfl.cli.entry`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    return subprocess.run(
        [sys.executable, str(launcher), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.ray
def test_resume_from_inside_a_planted_run_directory_imports_nothing_from_it(tmp_path):
    launcher = tmp_path / "bin" / "rayfl"
    launcher.parent.mkdir()
    launcher.write_text("from rayfl.cli import entry\n\nentry()\n")
    run_dir, marker = tmp_path / "run", tmp_path / "imported.txt"
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(yaml.safe_dump(RUN))
    first = rayfl(["run", str(cfg), "--out", str(run_dir), "--no-progress"], tmp_path, launcher)
    assert first.returncode == 0, first.stderr
    for name in ("json.py", "rayfl.py"):
        (run_dir / name).write_text(PLANTED.format(marker=str(marker)))
    args = ["run", "--resume", ".", "engine.rounds=2", "engine.executor=ray", "--no-progress"]
    resumed = rayfl([*args, "engine.ray_num_cpus=2"], run_dir, launcher)
    assert not marker.exists(), marker.read_text()
    assert resumed.returncode == 0, resumed.stderr
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["rounds"] == 2

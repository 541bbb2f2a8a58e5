"""Plugins: a user's module registering an algorithm works through `--plugin`, the `plugins:` key
and entry points, in `rayfl run` (serial and Ray), `rayfl compare` (Ray, parallel), `rayfl tune`,
`rayfl validate` and `rayfl ls`; mistakes end in one line.

Each command runs in its own interpreter, as a user's would: plugins are imported once per
process (the registry keeps them), and a Ray run must start its own Ray to pass them to its
workers (the session's shared Ray was started without them).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import SYNTHETIC

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray

ROOT = Path(__file__).resolve().parents[1]

# A user's algorithm in one module: its own Params dataclass (which must unpickle on a Ray
# worker) and client half. Importing it leaves one file per importing process in $MARKER_DIR.
PLUGIN = """
import os
from dataclasses import dataclass
from pathlib import Path

import torch.nn.functional as F

from rayfl.algorithms.base import Algorithm, ModelClient, Server
from rayfl.algorithms import ALGORITHMS

if os.environ.get("MARKER_DIR"):
    (Path(os.environ["MARKER_DIR"]) / str(os.getpid())).touch()


@dataclass(frozen=True)
class MyParams:
    smoothing: float = 0.0


class MyClient(ModelClient[MyParams]):
    def training_step(self, x, y):
        return F.cross_entropy(self.model(x), y, label_smoothing=self.params.smoothing)


ALGORITHMS.add("my_local", Algorithm("my_local", MyParams, MyClient, Server, summary="mine"))
"""


def write_plugin(folder: Path, name: str = "my_algos") -> Path:
    """The module in `folder`/lib: not on a Ray worker's path (which holds the driver's cwd)."""
    (folder / "lib").mkdir(exist_ok=True)
    path = folder / "lib" / f"{name}.py"
    path.write_text(PLUGIN)
    return path


def write_experiment(folder: Path, **extra: object) -> Path:
    raw = copy.deepcopy(SYNTHETIC)
    raw["algorithm"] = {"name": "my_local", "smoothing": 0.1}
    raw.update(extra)
    path = folder / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def rayfl(
    args: list[str], cwd: Path, marker: Path | None = None, site: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`rayfl ARGS` in a fresh interpreter in `cwd`; `site`: a folder of installed packages."""
    path = [str(ROOT), *([str(site)] if site else []), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}",
        "RAY_DEDUP_LOGS": "0",
    }
    if marker is not None:
        marker.mkdir(exist_ok=True)
        env["MARKER_DIR"] = str(marker)
    return subprocess.run(
        [sys.executable, "-m", "rayfl.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def summary_of(run_dir: Path) -> dict[str, object]:
    return json.loads((run_dir / "summary.json").read_text())


def final_acc(run_dir: Path) -> float:
    rows = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    return float(rows[-1]["personal/acc"])


def test_plugin_algorithm_runs_serial_and_on_ray_workers(tmp_path):
    plugin = write_plugin(tmp_path)
    exp = write_experiment(tmp_path)
    # an unknown name says where user algorithms come from
    proc = rayfl(["validate", str(exp)], tmp_path)
    assert proc.returncode == 2 and "unknown algorithm 'my_local'" in proc.stderr
    assert "--plugin" in proc.stderr and "Traceback" not in proc.stderr

    args = ["run", str(exp), "--plugin", "lib/my_algos.py", "--out", "serial", "--no-progress"]
    proc = rayfl(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "my_local on synthetic" in proc.stdout

    marker = tmp_path / "imported_by"
    ray_args = [
        "engine.executor=ray",
        "engine.num_workers=1",
        "engine.ray_num_cpus=2",
    ]
    proc = rayfl(
        ["run", str(exp), *ray_args, "--plugin", str(plugin), "--out", "ray", "--no-progress"],
        tmp_path,
        marker,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary_of(tmp_path / "ray")["status"] == "FINISHED"
    # the driver and at least the worker actor imported the plugin
    assert len(list(marker.iterdir())) >= 2
    # same config and seed, same numbers on either executor
    assert final_acc(tmp_path / "ray") == final_acc(tmp_path / "serial")


def test_plugins_key_is_relative_to_the_config_file(tmp_path):
    sub = tmp_path / "exp"
    sub.mkdir()
    plugin = write_plugin(sub, "my_algos_key")
    exp = write_experiment(sub, plugins=["lib/my_algos_key.py"])
    proc = rayfl(["validate", str(exp)], tmp_path)  # run from another folder
    assert proc.returncode == 0, proc.stderr
    assert "my_local on synthetic" in proc.stdout
    proc = rayfl(["ls", "my_local", "--plugin", str(plugin)], tmp_path)
    assert proc.returncode == 0 and "algorithm.smoothing" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (None, "plugin nothere.py: file"),
        ("x = 1\nraise ValueError('broken on purpose')\n", "bad.py:2: raise ValueError"),
        ("def f(:\n", "SyntaxError"),
        (
            "from rayfl.algorithms import ALGORITHMS\n"
            "from rayfl.algorithms.base import Algorithm, NoParams, ModelClient, Server\n"
            "ALGORITHMS.add('fedavg', Algorithm('fedavg', NoParams, ModelClient, Server))\n",
            "algorithm 'fedavg' is already registered (built-in)",
        ),
    ],
    ids=["missing", "raises", "syntax", "clash"],
)
def test_plugin_mistakes_end_in_one_line(tmp_path, source, needle):
    name = "nothere.py"
    if source is not None:
        name = "bad.py"
        (tmp_path / name).write_text(source)
    exp = write_experiment(tmp_path)
    proc = rayfl(["validate", str(exp), "--plugin", name], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rayfl: error: plugin "), proc.stderr
    assert needle in lines[0]


def test_entry_points_register_algorithms(tmp_path):
    # an installed package: its module on the path and its dist-info naming the entry points
    site = tmp_path / "site"
    site.mkdir()
    (site / "my_algos_pkg.py").write_text(PLUGIN)
    (site / "extra_algo.py").write_text(
        "from rayfl.algorithms.base import Algorithm, NoParams, ModelClient, Server\n"
        "EXTRA = Algorithm('extra', NoParams, ModelClient, Server, summary='from an object')\n"
    )
    info = site / "my_algos_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-algos-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[rayfl.algorithms]\nmine = my_algos_pkg\nextra = extra_algo:EXTRA\n"
    )
    proc = rayfl(["ls"], tmp_path, site=site)
    valid = rayfl(["validate", str(write_experiment(tmp_path))], tmp_path, site=site)
    assert proc.returncode == 0, proc.stderr
    assert "my_local" in proc.stdout and "from an object" in proc.stdout
    assert valid.returncode == 0, valid.stderr


def test_compare_runs_a_plugin_algorithm_in_parallel_on_ray(tmp_path):
    write_plugin(tmp_path)
    base = {k: v for k, v in copy.deepcopy(SYNTHETIC).items() if k not in ("algorithm", "name")}
    suite = {
        "suite": "mine",
        "base": base,
        "algorithms": [{"name": "my_local"}, {"name": "local"}],
        "seeds": [0],
        "parallel": 2,
    }
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    args = ["engine.executor=ray", "engine.worker_resources.num_cpus=0.5", "engine.ray_num_cpus=2"]
    proc = rayfl(
        ["compare", "suite.yaml", *args, "--plugin", "lib/my_algos.py", "--out", "out"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["label"]: r for r in pq.read_table(tmp_path / "out" / "runs.parquet").to_pylist()}
    assert {r["status"] for r in rows.values()} == {"FINISHED"}, rows
    assert 0.0 < rows["my_local"]["personal/acc"] <= 1.0


def test_tune_sweeps_a_plugin_algorithm(tmp_path):
    write_plugin(tmp_path)
    write_experiment(tmp_path, plugins=["lib/my_algos.py"])  # through the base's plugins key
    sweep = {
        "sweep": "mine",
        "base": "exp.yaml",
        "space": {"algorithm.smoothing": {"grid": [0.0, 0.2]}},
        "tune": {"metric": "personal/acc", "max_concurrent": 2, "verbose": 0},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    proc = rayfl(
        ["tune", "sweep.yaml", "engine.rounds=1", "--out", "out"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert sorted(r["algorithm.smoothing"] for r in rows) == [0.0, 0.2]
    assert all(r["status"] == "done" and r["rounds"] == 1 for r in rows), rows


def test_resume_takes_plugins_from_the_command_line_only(tmp_path):
    write_plugin(tmp_path)
    exp = write_experiment(tmp_path)
    first = ["run", str(exp), "engine.rounds=1", "engine.checkpoint_every=1", "--out", "r"]
    proc = rayfl([*first, "--plugin", "lib/my_algos.py", "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]

    proc = rayfl(["run", "--resume", "r", "engine.rounds=2", "--no-progress"], tmp_path)
    assert proc.returncode == 2 and "unknown algorithm 'my_local'" in proc.stderr

    resume = ["run", "--resume", "r", "engine.rounds=2", "--plugin", "lib/my_algos.py"]
    proc = rayfl([*resume, "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert pq.read_table(tmp_path / "r" / "metrics.parquet").num_rows == 2

    # a run directory is untrusted: a plugins key written into its config.yaml is never imported
    # (the gate refuses the changed config.yaml before anything reads it)
    marker = tmp_path / "imported_by"
    config = tmp_path / "r" / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "plugins": [str(tmp_path / "lib" / "my_algos.py")]}))
    proc = rayfl(["run", "--resume", "r", "engine.rounds=3", "--no-progress"], tmp_path, marker)
    assert proc.returncode == 2 and "not written by your rayfl" in proc.stderr
    assert list(marker.iterdir()) == []

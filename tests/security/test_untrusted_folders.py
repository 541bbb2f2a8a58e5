"""The other folders rayfl reads back go through the gate too (docs/security.md): the privacy
report's trial run directories (`summary.json`), the benchmark's folder (`bench.json`,
`share<k>.json`, `bench_config.yaml`) and a sweep's folder (`sweep.json`). A symlink, a FIFO,
an oversized file or one rayfl did not write there is refused in one line, never followed or
waited on, and nothing outside the folder changes.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from rayfl import bench, bench_floors, cli, gate
from rayfl.errors import UserError
from rayfl.gate import JSON_LIMIT
from rayfl.privacy import report as privacy_report

VICTIM = b'{"precious": "data that no rayfl command may read or change"}\n'


def _symlink(path: Path, victim: Path) -> None:
    path.symlink_to(victim)


def _fifo(path: Path, victim: Path) -> None:
    os.mkfifo(path)


def _oversized(path: Path, victim: Path) -> None:
    with path.open("wb") as f:  # sparse: costs no disk
        f.truncate(JSON_LIMIT + 1)


def _planted(path: Path, victim: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)  # nested deep, and not written by rayfl


PLANTS: dict[str, Callable[[Path, Path], None]] = {
    "symlink": _symlink,
    "fifo": _fifo,
    "oversized": _oversized,
    "planted": _planted,
}
PROBLEM = {
    "symlink": "symbolic link",
    "fifo": "FIFO",
    "oversized": "over the limit",
    "planted": "not written by your rayfl",
}


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.json"
    path.write_bytes(VICTIM)
    return path


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


# ----------------------------------------------------------------------------- privacy report


@pytest.mark.parametrize("kind", PLANTS)
def test_privacy_report_refuses_an_unsafe_summary_in_one_line(kind, tmp_path, victim, capsys):
    trial = tmp_path / "trials" / "t1"
    trial.mkdir(parents=True)
    PLANTS[kind](trial / "summary.json", victim)
    plot = tmp_path / "plot.png"
    code = privacy_report.main([str(tmp_path / "trials"), "--out", str(plot)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2
    assert "summary.json" in line and PROBLEM[kind] in line
    assert victim.read_bytes() == VICTIM and not plot.exists()


def test_privacy_report_refuses_a_trial_folder_that_is_a_symlink(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "summary.json").write_text(json.dumps({"rounds": 1}))
    (tmp_path / "trials").mkdir()
    (tmp_path / "trials" / "t1").symlink_to(elsewhere)
    plot = tmp_path / "plot.png"
    code = privacy_report.main([str(tmp_path / "trials"), "--out", str(plot)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "t1" in line and "symbolic link" in line
    assert not plot.exists()


def test_privacy_report_refuses_a_summary_without_its_fields_in_one_line(tmp_path, capsys):
    trial = tmp_path / "trials" / "t1"
    trial.mkdir(parents=True)
    gate.write(
        trial / "summary.json", json.dumps({"rounds": 3, "config": {}, "final": {}}).encode()
    )
    code = privacy_report.main([str(tmp_path / "trials"), "--out", str(tmp_path / "p.png")])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "not a summary rayfl wrote" in line


# ----------------------------------------------------------------------------- benchmark


class _FinishedChild:
    """A child process that already exited 0 (the benchmark's children are not the point)."""

    def __init__(self, *args, **kwargs) -> None:
        self.pid = os.getpid()
        self.returncode = 0

    def communicate(self) -> tuple[str, None]:
        return "", None


@pytest.fixture
def no_children(monkeypatch):
    fake = types.SimpleNamespace(Popen=_FinishedChild, PIPE=-1, STDOUT=-2)
    monkeypatch.setattr(bench_floors, "subprocess", fake)  # every child `rayfl bench` starts


FLOOR_REPORTS = {  # a floor's runner, and the report its children write
    "floor": (bench_floors.run_floor, "share0.json"),
    "rayfloor": (bench_floors.run_ray_floor, "rayfloor.json"),
}


@pytest.mark.parametrize("floor", FLOOR_REPORTS)
@pytest.mark.parametrize("kind", PLANTS)
def test_bench_refuses_an_unsafe_floor_report_in_one_line(
    kind, floor, tmp_path, victim, synthetic_raw, no_children
):
    run, name = FLOOR_REPORTS[floor]
    out = tmp_path / floor
    out.mkdir()
    PLANTS[kind](out / name, victim)
    with pytest.raises(UserError) as info:
        run(synthetic_raw, (), 1, out)
    line = _one_line(str(info.value))
    assert name in line and PROBLEM[kind] in line
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("kind", PLANTS)
def test_bench_refuses_an_unsafe_variant_report_in_one_line(
    kind, tmp_path, victim, synthetic_raw, no_children
):
    out = tmp_path / "variant"
    (out / "run").mkdir(parents=True)
    PLANTS[kind](out / "run" / "bench.json", victim)
    with pytest.raises(UserError) as info:
        bench.run_variant(synthetic_raw, [], out)
    line = _one_line(str(info.value))
    assert "bench.json" in line and PROBLEM[kind] in line
    assert victim.read_bytes() == VICTIM


def test_bench_says_in_one_line_when_a_variant_wrote_no_report(
    tmp_path, synthetic_raw, no_children
):
    out = tmp_path / "variant"
    (out / "run").mkdir(parents=True)  # the child exited 0 but wrote no bench.json
    with pytest.raises(UserError) as info:
        bench.run_variant(synthetic_raw, [], out)
    line = _one_line(str(info.value))
    assert "bench.json" in line and "without writing its report" in line


def test_bench_replaces_a_symlinked_config_instead_of_writing_through_it(
    tmp_path, victim, synthetic_raw, no_children
):
    out = tmp_path / "variant"
    (out / "run").mkdir(parents=True)
    (out / "bench_config.yaml").symlink_to(victim)
    report = {"rounds": [], "store_peak_mb": 0.0, "spilled_mb": 0.0, "status": "FINISHED"}
    gate.write(out / "run" / "bench.json", json.dumps(report).encode())  # as its child writes it
    report = bench.run_variant(synthetic_raw, [], out)
    assert report["clients"] == synthetic_raw["data"]["num_clients"]
    assert victim.read_bytes() == VICTIM
    assert not (out / "bench_config.yaml").is_symlink()
    assert yaml.safe_load((out / "bench_config.yaml").read_text())["seed"] == synthetic_raw["seed"]


# ----------------------------------------------------------------------------- sweep folder


@pytest.mark.parametrize("kind", PLANTS)
def test_tune_refuses_an_unsafe_sweep_state_before_ray_starts(
    kind, tmp_path, victim, synthetic_raw, monkeypatch, capsys
):
    from rayfl.engine import startup

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the sweep folder was checked")

    monkeypatch.setattr(startup, "init_ray", no_ray)
    base = {**synthetic_raw, "data": {**synthetic_raw["data"], "val_fraction": 0.2}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))  # trials rank on validation
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {"sweep": "tiny", "base": "base.yaml", "space": {"algorithm.T": {"grid": [2.0]}}}
        )
    )
    out = tmp_path / "out"
    out.mkdir()
    PLANTS[kind](out / "sweep.json", victim)
    code = cli.main(["tune", str(sweep), "--out", str(out)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2
    assert "sweep.json" in line and PROBLEM[kind] in line
    assert victim.read_bytes() == VICTIM

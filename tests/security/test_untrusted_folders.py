"""The other folders rayfl reads back go through the gate too (docs/security.md): the privacy
report's trial run directories (`summary.json`) and a sweep's folder (`sweep.json`); the
benchmark's folder: tests/test_bench.py. A symlink, a FIFO, an oversized file or one rayfl did
not write there is refused in one line, never followed or waited on, and nothing outside the
folder changes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from rayfl import cli, gate
from tests.security.plants import PLANTS, PROBLEM, VICTIM, one_line

# the privacy report is a script of experiments/privacy/, run as a file there
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "privacy"))
import privacy_report  # noqa: E402

# ----------------------------------------------------------------------------- privacy report


@pytest.mark.parametrize("kind", PLANTS)
def test_privacy_report_refuses_an_unsafe_summary_in_one_line(kind, tmp_path, victim, capsys):
    trial = tmp_path / "trials" / "t1"
    trial.mkdir(parents=True)
    PLANTS[kind](trial / "summary.json", victim)
    plot = tmp_path / "plot.png"
    code = privacy_report.main([str(tmp_path / "trials"), "--out", str(plot)])
    line = one_line(capsys.readouterr().err)
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
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "t1" in line and "symbolic link" in line
    assert not plot.exists()


def test_privacy_report_refuses_a_summary_without_its_fields_in_one_line(tmp_path, capsys):
    trial = tmp_path / "trials" / "t1"
    trial.mkdir(parents=True)
    gate.write(
        trial / "summary.json", json.dumps({"rounds": 3, "config": {}, "final": {}}).encode()
    )
    code = privacy_report.main([str(tmp_path / "trials"), "--out", str(tmp_path / "p.png")])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "not a summary rayfl wrote" in line


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
    line = one_line(capsys.readouterr().err)
    assert code == 2
    assert "sweep.json" in line and PROBLEM[kind] in line
    assert victim.read_bytes() == VICTIM

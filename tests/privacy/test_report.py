"""The privacy-utility report reads run directories and writes a plot and a Markdown table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rayfl import gate

# the report is a script of experiments/privacy/, run as a file there
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "privacy"))
import privacy_report as report  # noqa: E402


def fake_run(path, noise, alpha, acc, eps, variant="kd", secagg=False):
    path.mkdir(parents=True)
    dp = {"enabled": noise is not None, "noise_multiplier": noise or 1.0, "clip": 1.0}
    summary = {
        "status": "FINISHED",
        "rounds": 4,
        "final": {"personal/acc": acc, "privacy/epsilon": eps},
        "config": {
            "algorithm": {"name": "pfedes", "variant": variant, "alpha": alpha},
            "privacy": {"dp": dp, "secagg": {"enabled": secagg}},
        },
    }
    gate.write(path / "summary.json", json.dumps(summary).encode())  # as rayfl writes it


def test_report_table_and_plot(tmp_path, capsys):
    trials = tmp_path / "trials"
    fake_run(trials / "t1", 0.5, 0.1, 0.61, 40.0)
    fake_run(trials / "t2", 2.0, 0.1, 0.55, 3.5)
    fake_run(tmp_path / "plain", None, 0.1, 0.63, None)  # null epsilon: no DP
    fake_run(tmp_path / "sa", None, 0.1, 0.63, None, secagg=True)
    out = tmp_path / "plot.png"
    assert (
        report.main(
            [
                str(trials),
                "--ref",
                f"plain={tmp_path / 'plain'}",
                "--ref",
                f"sa={tmp_path / 'sa'}",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out.splitlines()
    assert out.stat().st_size > 0
    assert table[2] == "| plain | none | 0.1 | - | inf | 0.6300 |"
    assert table[3] == "| sa | SecAgg | 0.1 | - | inf | 0.6300 |"
    assert table[4] == "| t1 | DP (clip 1.0) | 0.1 | 0.5 | 40.0000 | 0.6100 |"
    assert len(table) == 6

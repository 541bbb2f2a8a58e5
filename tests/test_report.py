"""`rayfl report DIR`: one self-contained HTML page for a run and a suite, checked in a real
headless browser (Debian's chromium) when it is installed."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from rayfl.cli import main
from rayfl.compare import run_suite
from rayfl.config import build_config
from rayfl.errors import UserError
from rayfl.launch import simulate
from rayfl.report import write_report
from tests.conftest import SYNTHETIC
from tests.test_compare import write_suite

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    raw = copy.deepcopy(SYNTHETIC)
    raw["eval"] = {"local_baseline": True}
    out = tmp_path_factory.mktemp("report") / "run"
    simulate(build_config(raw, ["algorithm.beta=0.5", "engine.rounds=3"]), out, progress=False)
    return out


def final_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["final"]


@pytest.mark.slow
def test_run_report_is_self_contained(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    final = final_of(run_dir)
    assert f"{final['personal/acc']:.4f}" in page
    assert f"{final['baseline/local_acc']:.4f}" in page
    assert f"{final['baseline/gain_points']:+.2f}" in page
    # curves, accuracy against communication and time, per-architecture bars, labels
    assert page.count("data:image/png;base64,") == 4
    assert "<link" not in page and 'src="http' not in page and "<script" not in page
    assert "tiny_a" in page and "Label distribution" in page


@pytest.mark.slow
def test_suite_report_shows_the_table_and_failed_runs(tmp_path):
    out = tmp_path / "suite"
    run_suite(write_suite(tmp_path, seeds=[0]), ["engine.rounds=1"], out=out, progress=False)
    rows = (out / "runs.parquet").read_bytes()
    assert rows
    page = write_report(out).read_text()
    assert "Comparison" in page and "proto" in page and "local" in page
    assert "±" not in page  # one seed
    assert "Runs" in page and "FINISHED" in page


def test_report_refuses_a_folder_it_cannot_read(tmp_path):
    with pytest.raises(UserError, match="not a run directory"):
        write_report(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (setup.sh installs it where apt is usable)",
)
def test_report_renders_in_a_headless_browser(run_dir, tmp_path):
    page = write_report(run_dir, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1200,1800", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    image = mpimg.imread(shot)
    assert image.shape[:2] == (1800, 1200)
    ink = (image[..., :3].mean(axis=2) < 0.9).mean()  # share of non-white pixels
    assert ink > 0.05, f"the page looks blank ({ink:.3f} of the pixels have ink)"
    dom = subprocess.run(
        [*common, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    final = final_of(run_dir)
    assert "<table>" in dom and f"{final['personal/acc']:.4f}" in dom
    assert f"{final['baseline/gain_points']:+.2f}" in dom


def test_sweep_report_lists_trials(tmp_path):
    from rayfl import gate
    from rayfl.tables import write_table

    gate.write(tmp_path / "sweep.yaml", Path("experiments/sweeps/pfedes_T_alpha.yaml").read_bytes())
    rows = [
        {"trial": f"t{i}", "algorithm.T": t, "algorithm.alpha": a, "algorithm.embed_dim": 64}
        | {"personal/val_acc": val, "personal/acc": acc, "rounds": 3, "status": "done", "error": ""}
        for i, (t, a, val, acc) in enumerate([(2.0, 0.1, 0.6, 0.7), (4.0, 0.3, 0.6432, 0.5)])
    ]
    write_table(rows, tmp_path / "results.parquet")
    page = write_report(tmp_path).read_text()
    assert "2 trials" in page and "0.6432" in page and "algorithm.alpha" in page
    # ranked on validation: t1 wins though t0's test accuracy is higher; its test score is shown
    assert "<p>trial t1 (max personal/val_acc, chosen on validation data)</p>" in page
    assert "personal/acc (test)" in page
    assert page.count("data:image/png;base64,") == 1

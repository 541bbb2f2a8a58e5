"""What the suite and sweep pages show beyond their tables: links to every run's directory
(relative to the page) and MLflow run, the seed spread, a partial suite, and a sweep's per-trial
curves with log axes for log-sampled parameters and its best config folded away."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rayfl import gate
from rayfl.report import run_links, write_report
from rayfl.tables import write_table


def test_run_links_are_relative_paths_inside_the_folder(tmp_path):
    suite = tmp_path / "suite"
    (suite / "local" / "seed0").mkdir(parents=True)
    folder, mlflow = run_links(suite, ["local", "seed0"], "abcdef0123456789", "local/seed0")
    assert folder == '<a href="./local/seed0">local/seed0</a>'
    assert "<a" not in mlflow and "abcdef0123456789" in mlflow  # an id, never a link
    (suite / "local" / "seed0" / "report.html").write_text("<html></html>")  # its own page
    assert 'href="./local/seed0/report.html"' in run_links(suite, ["local", "seed0"], "")[0]
    (suite / "other").symlink_to(suite / "local")  # not a real folder inside: no link
    assert "<a" not in run_links(suite, ["other", "seed0"], "")[0]


def fake_sweep(folder: Path) -> None:
    space = {"train.lr": {"loguniform": [0.001, 0.3]}, "algorithm.lam": {"grid": [0.1, 1.0]}}
    sweep = {"name": "s", "space": space, "tune": {"metric": "personal/acc"}}
    gate.write(folder / "sweep.yaml", yaml.safe_dump(sweep).encode())  # as rayfl writes them
    gate.write(folder / "best_config.yaml", b"name: s\ntrain: {lr: 0.05}\n")
    rows = []
    for i, (lr, lam) in enumerate([(0.002, 0.1), (0.05, 1.0), (0.2, 0.1)]):
        trial = f"trial_{i}"
        history = [{"round": r, "personal/acc": 0.3 + 0.1 * r * lr} for r in (1, 2, 3)]
        (folder / "trials" / trial).mkdir(parents=True)
        write_table(history, folder / "trials" / trial / "metrics")
        rows.append(
            {"trial": trial, "train.lr": lr, "algorithm.lam": lam}
            | {"personal/acc": history[-1]["personal/acc"], "rounds": 3, "status": "done"}
        )
    write_table(rows, folder / "results")


def test_sweep_page_has_per_trial_curves_log_axes_and_little_yaml(tmp_path):
    fake_sweep(tmp_path)
    page = write_report(tmp_path).read_text()
    assert "one line per trial" in page
    assert "log axes: train.lr (sampled log-uniformly)" in page
    assert page.count("data:image/png;base64,") == 2  # curves, metric against parameters
    # the best trial as a table; its YAML folded into <details>, the only <pre> on the page
    assert "<h2>Best trial</h2><p>trial trial_2" in page
    assert page.count("<pre>") == 1 and re.search(r"<details><summary>[^<]*</summary><pre>", page)
    assert 'href="./trials/trial_0"' in page  # each trial's run directory

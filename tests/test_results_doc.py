"""docs/results.md is exactly what experiments/make_results.py makes of the files in docs/results/."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def make_results():
    spec = importlib.util.spec_from_file_location(
        "make_results", ROOT / "experiments" / "make_results.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_matches_its_files(make_results):
    # Fails when a result file changed without `python3 experiments/make_results.py`, or when
    # docs/results.md was edited by hand.
    assert (ROOT / "docs" / "results.md").read_text() == make_results.page()


def test_paired_differences_to_the_best_baseline_golden(make_results):
    runs = {"a": {0: 0.80, 1: 0.90}, "b": {0: 0.70, 1: 0.86}, "m": {0: 0.85, 1: 0.89}}
    best, rows = make_results.paired_rows(runs, ["a", "b"])
    assert best == "a"  # mean 0.85 against b's 0.78
    by = {r[0]: r for r in rows}
    # m - a per seed: +5.0, -1.0 points; mean +2.0, sample std 4.2
    assert by["m"][1:] == ["+2.0 ± 4.2 (2)", "+5.0, -1.0"]
    assert by["b"][1] == "-7.0 ± 4.2 (2)"


def test_privacy_fragment_is_included_verbatim_after_the_introduction(make_results, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "docs" / "results", results)
    (results / "privacy").mkdir(exist_ok=True)
    fragment = "## Privacy\n\nA fragment | with a table |\n"
    (results / "privacy" / "section.md").write_text(fragment)
    original = make_results.RESULTS
    make_results.RESULTS = results
    try:
        text = make_results.page()
    finally:
        make_results.RESULTS = original
    assert text.startswith(make_results.INTRO.rstrip("\n") + "\n\n" + fragment)


def test_partial_suites_name_their_resume_command_and_progress(make_results):
    for path in sorted((ROOT / "docs" / "results" / "full").glob("*.json")):
        data = json.loads(path.read_text())
        lines = make_results.full_section(data)
        text = "\n".join(lines)
        assert data["command"] in text
        done = sum(r["rounds_done"] for r in data["runs"])
        total = sum(r["rounds"] for r in data["runs"])
        assert f"{done} of {total} rounds done" in text
        if any(r["status"] != "FINISHED" for r in data["runs"]):
            assert lines[0].endswith("— PARTIAL")

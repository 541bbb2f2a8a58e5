"""The suite commands from the command line: `rayfl run` on a suite file names `rayfl compare`,
an interrupted suite prints the command that resumes it, `rayfl report` renders a suite that
did not finish, `rayfl ls-runs` finds a suite's runs in their nested folders."""

from __future__ import annotations

import json

import pytest

import rayfl.compare
from rayfl.cli import main
from rayfl.compare import SuiteInterrupted
from tests.test_compare import compare_cli, write_suite

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray


def test_run_on_a_suite_file_says_so_and_names_rayfl_compare(tmp_path, capsys):
    path = write_suite(tmp_path)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is a comparison suite" in err and f"rayfl compare {path}" in err
    assert "algorithm.name" not in err


def test_interrupted_compare_prints_the_suite_command_that_resumes_it(
    tmp_path, monkeypatch, capsys
):
    def interrupted(path, overrides, out=None, **kw):
        raise SuiteInterrupted(tmp_path / "runs" / "suite-x")

    monkeypatch.setattr(rayfl.compare, "run_suite", interrupted)
    code = main(["compare", "s.yaml", "engine.rounds=2", "--keep-checkpoints"])
    err = capsys.readouterr().err
    assert code == 130
    assert (
        f"resume with: rayfl compare s.yaml engine.rounds=2 --out {tmp_path}/runs/suite-x "
        "--keep-checkpoints" in err
    )
    assert "--resume" not in err


@pytest.fixture(scope="module")
def partial_suite(tmp_path_factory):
    """A suite interrupted in its third run: two runs FINISHED, no results.parquet yet."""
    tmp = tmp_path_factory.mktemp("partial")
    path = write_suite(tmp, settings=[{"name": "a05", "overrides": {}}])
    out = tmp / "out"
    # Ctrl-C at the end of the third run's first round
    got = compare_cli(path, out, "engine.rounds=2", SUITE_FAULTS_SIGINT="a05-proto-s0:1")
    assert got.returncode == 130, got.stderr[-2000:]
    return out


def test_report_renders_a_partly_finished_suite(partial_suite, capsys):
    assert not (partial_suite / "results.parquet").exists()
    assert main(["report", str(partial_suite)]) == 0
    page = (partial_suite / "report.html").read_text()
    assert "not finished" in page and "2 runs done so far" in page
    assert ">local<" in page and "a05" in page
    assert 'href="./a05/local/seed0"' in page and 'href="./a05/local/seed1"' in page
    assert "mean ± std over seeds (band)" in page  # two seeds of local finished


def test_suite_page_figures_fit_the_page_column_unscaled(partial_suite):
    import base64
    import io
    import re

    import matplotlib.image as mpimg

    from rayfl.report import write_report

    page = write_report(partial_suite).read_text()
    figures = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(figures) == 3  # accuracy per architecture, curves, accuracy against cost
    for data in figures:
        width = mpimg.imread(io.BytesIO(base64.b64decode(data))).shape[1]
        assert width <= 1080  # the CSS column is 1100 px: shown 1:1 in a 1400 px window


def test_ls_runs_lists_the_runs_inside_a_suite_folder(partial_suite, capsys):
    assert main(["ls-runs", str(partial_suite.parent)]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert f"{partial_suite}/a05/local/seed0" in listed
    assert f"{partial_suite}/a05/local/seed1" in listed
    summary = json.loads((partial_suite / "a05/local/seed1/summary.json").read_text())
    assert summary["status"] == "FINISHED"

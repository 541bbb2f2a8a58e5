"""The command line: options and key=value overrides in any order, and a command line argparse
cannot parse refused in one line with exit code 2."""

from __future__ import annotations

import json

import pytest
import yaml

from rayfl.cli import main, parse
from tests.conftest import SYNTHETIC


@pytest.mark.parametrize("verb", ["run", "compare", "tune"])
def test_overrides_after_an_option_are_kept_in_order(verb):
    before = parse([verb, "x.yaml", "seed=1", "--out", "d", "engine.rounds=2", "train.lr=0.1"])
    after = parse([verb, "x.yaml", "seed=1", "engine.rounds=2", "train.lr=0.1", "--out", "d"])
    assert before.overrides == after.overrides == ["seed=1", "engine.rounds=2", "train.lr=0.1"]
    assert before.out == after.out == "d"


def test_validate_takes_files_and_overrides_around_its_options(tmp_path, capsys):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(yaml.safe_dump(SYNTHETIC))
    args = parse(["validate", str(cfg), "--set", "seed=2", "engine.rounds=3"])
    assert args.configs == [str(cfg), "engine.rounds=3"] and args.overrides == ["seed=2"]
    assert main(["validate", str(cfg), "--plugin", "json", "engine.rounds=oops"]) == 2
    assert "engine.rounds" in capsys.readouterr().err


def test_resume_keeps_its_overrides_around_options():
    args = parse(["run", "--resume", "d", "engine.rounds=8", "--no-progress", "seed=3"])
    assert args.resume == "d" and args.no_progress
    assert [args.config, *args.overrides] == ["engine.rounds=8", "seed=3"]


@pytest.mark.slow
def test_run_with_an_option_before_an_override_runs(tmp_path, capsys):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(yaml.safe_dump(SYNTHETIC))
    out = tmp_path / "run"
    argv = ["run", str(cfg), "--out", str(out), "engine.rounds=1", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "required: command"),
        (["nope"], "invalid choice"),
        (["run", "x.yaml", "--bogus"], "unrecognized arguments: --bogus"),
        (["report"], "required: dir"),
        (["report", "d", "seed=1"], "unrecognized arguments: seed=1"),
        (["ls-runs", "a", "b"], "unrecognized arguments: b"),
        (["bench", "x.yaml"], "invalid choice"),
        (["run", "--out"], "expected one argument"),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("rayfl: error: ") and words in line and "--help" in line


@pytest.mark.slow
def test_a_reader_that_closes_the_pipe_early_ends_rayfl_quietly():
    # `rayfl ls | head -1`: the output is flushed into a pipe nobody reads any more
    import subprocess
    import sys

    code = "import sys; sys.argv = ['rayfl', 'ls']; from rayfl.cli import entry; entry()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "BrokenPipeError" not in err and "Traceback" not in err, err

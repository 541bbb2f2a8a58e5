"""What a user sees on the command line: positional overrides everywhere, `ls NAME`, examples in
`--help`, and a plain line-per-round progress when stderr is not a terminal."""

import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from rayfl.cli import build_parser, main, split_overrides
from rayfl.engine.callbacks import ProgressBar


def test_validate_takes_positional_overrides(capsys):
    assert main(["validate", "experiments/pfedes_fmnist.yaml", "engine.rounds=0"]) == 2
    assert "engine.rounds: must be" in capsys.readouterr().err
    # --set stays an alias
    assert main(["validate", "experiments/pfedes_fmnist.yaml", "--set", "engine.rounds=0"]) == 2
    assert main(["validate", "experiments/pfedes_fmnist.yaml", "data.num_clients=7"]) == 0
    assert "7 clients" in capsys.readouterr().out


def test_split_overrides_keeps_files_with_equals(tmp_path):
    odd = tmp_path / "a=b.yaml"
    odd.write_text("x: 1")
    assert split_overrides([str(odd), "seed=1", "f.yaml"]) == ([str(odd), "f.yaml"], ["seed=1"])


@pytest.mark.parametrize("command", ["run", "validate", "compare", "tune"])
def test_every_command_takes_positional_overrides(command):
    args = build_parser().parse_args([command, "some.yaml", "engine.rounds=5", "seed=2"])
    overrides = args.overrides if command != "validate" else split_overrides(args.configs)[1]
    assert overrides == ["engine.rounds=5", "seed=2"]


def test_ls_algorithm_prints_parameters_with_defaults_and_help(capsys):
    assert main(["ls", "pfedes"]) == 0
    out = capsys.readouterr().out
    line = next(li for li in out.splitlines() if li.strip().startswith("algorithm.T "))
    assert "4.0" in line and "distillation temperature" in line
    assert "algorithm.beta" in out and "arXiv" in out
    assert main(["ls", "eval"]) == 0
    assert re.search(r"eval\.local_baseline +false", capsys.readouterr().out)
    assert main(["ls", "pfedex"]) == 2
    assert "pfedes" in capsys.readouterr().err  # the suggestion


@pytest.mark.parametrize(
    ("kind", "member"),
    [
        ("datasets", "fmnist"),
        ("models", "cnn_small"),
        ("families", "seed3"),
        ("algorithms", "fedavg"),
    ],
)
def test_ls_lists_one_kind_of_entry(capsys, kind, member):
    assert main(["ls", kind]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{kind}:") and member in out and "unknown" not in out


def test_help_has_examples(capsys):
    for argv in (["--help"], ["run", "--help"], ["validate", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "examples:" in out and "rayfl " in out.split("examples:")[1]


def _sim(rounds=3):
    cfg = SimpleNamespace(
        engine=SimpleNamespace(rounds=rounds),
        algorithm=SimpleNamespace(name="x"),
        eval=SimpleNamespace(proxy_health_rounds=3),
    )
    return SimpleNamespace(cfg=cfg, start_round=1, result=SimpleNamespace(history=[]))


def test_progress_is_plain_lines_when_not_a_terminal():
    stream = io.StringIO()  # not a tty, like a CI log
    bar = ProgressBar(stream=stream)
    sim = _sim()
    bar.on_run_start(sim)
    for r in (1, 2):
        bar.on_round_end(
            sim, r, {"personal/acc": 0.5 + r / 10, "baseline/local_acc": 0.5, "time/round_s": 1.0}
        )
    bar.on_run_end(sim, "FINISHED")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("x round 2/3  acc 0.7000  local 0.5000  s/round 1.0")


class Tty(io.StringIO):
    def isatty(self):
        return True

    def fileno(self):
        return 2


def test_zero_column_terminal_is_plain(monkeypatch):
    import os

    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    assert ProgressBar.wants_plain(Tty())
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((80, 24)))
    assert not ProgressBar.wants_plain(Tty())
    assert ProgressBar.wants_plain(io.StringIO())


@pytest.mark.slow
def test_the_main_job_prints_its_gain_over_local(tmp_path, capsys):
    import yaml

    from rayfl.config import load_config
    from tests.conftest import SYNTHETIC

    readme = Path("README.md").read_text()
    assert "rayfl run experiments/pfedes_fmnist.yaml\n" in readme.split("```")[1]
    main_job = load_config("experiments/pfedes_fmnist.yaml")
    assert main_job.eval.local_baseline and not main_job.algorithm.params.notes()
    assert main_job.eval.federation_control
    # the same settings on synthetic data, through the CLI
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(SYNTHETIC))
    argv = ["run", str(exp), "eval.local_baseline=true", "algorithm.beta=0.5"]
    argv.append("eval.federation_control=true")
    assert main([*argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    line = next(li for li in out.splitlines() if "gain over local (points)" in li)
    assert line.split()[-1].startswith(("+", "-"))
    assert "local-only acc, same partition" in out
    line = next(li for li in out.splitlines() if "federated gain over control (points)" in li)
    assert line.split()[-1].startswith(("+", "-"))
    assert "no-federation control acc" in out and "(chance 0.1000)" in out

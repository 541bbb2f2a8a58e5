"""The bad-input sweep: over a hundred wrong, hostile or broken inputs to every command (run,
validate, resume, report, ls-runs, ls, compare, tune) and to the Python API (`rayfl.run`,
`rayfl.suite`, `rayfl.sweep`). Each ends in one line on stderr and exit code 2 (`UserError` from
the API), never a traceback, within seconds. The commands run in this process through
`rayfl.cli.main`; nothing starts Ray or trains: every input is refused before that.
"""

from __future__ import annotations

import copy
import errno
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import rayfl
from rayfl import plugins
from rayfl.cli import main
from tests.conftest import SYNTHETIC

LIMIT_S = 20  # "within seconds", with room for a loaded machine
DEEP = 20_000
GARBAGE = bytes(range(256)) * 4 + b"\x00\xff\xfe: [\n"

Build = Callable[[Path], list[str]]

# Some inputs are refused only once a run has started (its data or models load).
pytestmark = pytest.mark.slow


def put(path: Path, content: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def config(t: Path, raw: Any = None) -> str:
    return put(t / "exp.yaml", yaml.safe_dump(SYNTHETIC if raw is None else raw))


def suite_doc(**changes: Any) -> dict[str, Any]:
    base = {k: copy.deepcopy(v) for k, v in SYNTHETIC.items() if k != "algorithm"}
    base["engine"]["rounds"] = 1
    doc = {"suite": "s", "base": base, "algorithms": [{"name": "fedavg"}], "seeds": [0]}
    doc.update(changes)
    return doc


def suite(t: Path, **changes: Any) -> str:
    return put(t / "suite.yaml", yaml.safe_dump(suite_doc(**changes)))


def sweep(t: Path, **changes: Any) -> str:
    doc = {
        "sweep": "w",
        "base": "exp.yaml",
        "space": {"train.lr": {"grid": [0.1, 0.2]}},
        "tune": {"metric": "personal/acc", "mode": "max"},
    }
    doc.update(changes)
    config(t)
    return put(t / "sweep.yaml", yaml.safe_dump(doc))


def run_dir(t: Path, **files: str | bytes) -> str:
    """A run directory as `rayfl run` leaves it after round 1, with `files` replaced."""
    d = t / "run"
    put(d / "config.yaml", yaml.safe_dump(SYNTHETIC))
    put(d / "summary.json", '{"status": "RUNNING", "rounds": 1, "final": {}}')
    for name, content in files.items():
        put(d / name.replace("__", "/").replace("_dot_", "."), content)
    return str(d)


def suite_dir(t: Path, **files: str | bytes) -> str:
    d = t / "out"
    d.mkdir()
    for name, content in files.items():
        put(d / name.replace("__", "/").replace("_dot_", "."), content)
    return str(d)


def table(rows: dict[str, list[Any]]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(rows), sink)
    return sink.getvalue().to_pybytes()


def deep_yaml() -> str:
    return "[" * DEEP + "]" * DEEP


def deep_map() -> str:
    return "a: {" * DEEP + "}" * DEEP


def laughs() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


def fifo(t: Path, name: str) -> str:
    os.mkfifo(t / name)
    return str(t / name)


MATH = r"$\frac{a}{b}$"
BAD_YAML: dict[str, Callable[[Path], str]] = {
    "deep-list": lambda t: put(t / "x.yaml", deep_yaml()),
    "deep-map": lambda t: put(t / "x.yaml", deep_map()),
    "empty": lambda t: put(t / "x.yaml", ""),
    "garbage": lambda t: put(t / "x.yaml", GARBAGE),
    "not-utf8": lambda t: put(t / "x.yaml", b"name: \xff\xfe\n"),
    "scalar": lambda t: put(t / "x.yaml", "42\n"),
    "list": lambda t: put(t / "x.yaml", "- a\n- b\n"),
    "laughs": lambda t: put(t / "x.yaml", laughs()),
    "recursive-alias": lambda t: put(t / "x.yaml", "a: &a [*a]\n"),
    "tabs": lambda t: put(t / "x.yaml", "data:\n\tdataset: x\n"),
    "missing": lambda t: str(t / "nope.yaml"),
    "directory": lambda t: str(t),
    "fifo": lambda t: fifo(t, "x.yaml"),
}

OVERRIDES = [
    "engine.rounds=1e300",
    "engine.rounds=-1",
    "engine.rounds=0",
    "engine.rounds=.nan",
    "engine.rounds=.inf",
    "engine.rounds=abc",
    "engine.rounds=[1]",
    "engine.rounds={a: 1}",
    "engine.rounds=true",
    "seed=-1",
    "seed=1e30",
    "seed=.nan",
    "train.lr=.nan",
    "train.lr=-1",
    "train.lr=.inf",
    "train.batch_size=0",
    "train.batch_size=-5",
    "train.local_epochs=1e300",
    "data.num_clients=0",
    "data.num_clients=-3",
    "data.num_clients=1e9",
    "data.partition.alpha=-1",
    "data.partition.alpha=.nan",
    "data.partition.name=nope",
    "data.dataset=nope",
    "data.dataset=folder",
    "model.family=nope",
    "model.architectures=[nope]",
    f"model.architectures=['{MATH}']",
    "name=../../x",
    f"name='{MATH}'",
    "name=''",
    "name=a/b",
    "algorithm.name=nope",
    "algorithm.T=.nan",
    "algorithm.bogus=1",
    "bogus.key=1",
    "engine.bogus=1",
    "engine.executor=nope",
    "engine.num_workers=0",
    "engine.num_workers=-1",
    "engine.num_gpus=64",
    "engine.ray_num_cpus=-1",
    "engine.object_store_mb=-5",
    "engine.checkpoint_every=-1",
    "engine=5",
    "engine.rounds.x=1",
    "=5",
    "noequals",
    "a..b=1",
    "tracking.backend=nope",
    "data.options.num_samples=-1",
]
OVERRIDES_RAY = [  # refused before Ray starts
    ["engine.executor=ray", "engine.worker_resources.num_gpus=8"],
    ["engine.executor=ray", "engine.server_resources.num_cpus=4096"],
    ["engine.executor=ray", "engine.num_workers=5000", "engine.ray_num_cpus=2"],
]

CLI: dict[str, Build] = {}
for key, make in BAD_YAML.items():
    for verb in ("run", "validate", "compare", "tune"):
        CLI[f"{verb}-{key}"] = lambda t, verb=verb, make=make: [verb, make(t)]
    CLI[f"validate-cluster-{key}"] = lambda t, make=make: [
        "validate",
        config(t),
        "--cluster",
        make(t),
    ]
for text in OVERRIDES:
    CLI[f"run-{text}"] = lambda t, text=text: ["run", config(t), text, "--out", str(t / "r")]
for texts in OVERRIDES_RAY:
    CLI[f"run-{texts[-1]}"] = lambda t, texts=texts: [
        "run",
        config(t),
        *texts,
        "--out",
        str(t / "r"),
    ]
CLI["run-missing-folder-dataset"] = lambda t: [
    "run",
    config(t),
    "data.dataset=folder",
    "data.options={}",
    f"data.root={t / 'nope'}",
]
for text in OVERRIDES[::3]:
    CLI[f"validate-{text}"] = lambda t, text=text: ["validate", config(t), text]

CLI.update(
    {
        "resume-missing": lambda t: ["run", "--resume", str(t / "nope")],
        "resume-a-file": lambda t: ["run", "--resume", config(t)],
        "resume-empty-dir": lambda t: ["run", "--resume", str(t)],
        "resume-deep-config": lambda t: [
            "run",
            "--resume",
            run_dir(t, config_dot_yaml=deep_yaml()),
        ],
        "resume-garbage-config": lambda t: ["run", "--resume", run_dir(t, config_dot_yaml=GARBAGE)],
        "resume-garbage-summary": lambda t: [
            "run",
            "--resume",
            run_dir(t, summary_dot_json=GARBAGE),
        ],
        "resume-deep-summary": lambda t: [
            "run",
            "--resume",
            run_dir(t, summary_dot_json="[" * DEEP + "]" * DEEP),
        ],
        "resume-lock-is-a-dir": lambda t: ["run", "--resume", run_dir(t, _dot_lock__x="")],
        "resume-rounds-1e300": lambda t: ["run", "--resume", run_dir(t), "engine.rounds=1e300"],
        "resume-name-escape": lambda t: ["run", "--resume", run_dir(t), "name=../../x"],
        "resume-not-an-override": lambda t: ["run", "--resume", run_dir(t), "other.yaml"],
        "report-missing": lambda t: ["report", str(t / "nope")],
        "report-a-file": lambda t: ["report", config(t)],
        "report-empty-dir": lambda t: ["report", str(t)],
        "report-garbage-metrics": lambda t: ["report", run_dir(t, metrics_dot_parquet=GARBAGE)],
        "report-metrics-wrong-columns": lambda t: [
            "report",
            run_dir(t, metrics_dot_parquet=table({"x": ["a"]})),
        ],
        "report-summary-wrong-types": lambda t: [
            "report",
            run_dir(t, summary_dot_json='{"rounds": "x", "final": []}'),
        ],
        "report-out-is-a-dir": lambda t: ["report", run_dir(t), "--out", str(t)],
        "report-out-in-a-file": lambda t: ["report", run_dir(t), "--out", config(t) + "/r.html"],
        "report-garbage-runs-parquet": lambda t: [
            "report",
            suite_dir(t, runs_dot_parquet=GARBAGE, results_dot_parquet=GARBAGE),
        ],
        "report-runs-parquet-wrong-columns": lambda t: [
            "report",
            suite_dir(t, runs_dot_parquet=table({"x": [1]}), results_dot_parquet=table({"y": [1]})),
        ],
        "report-garbage-results-parquet": lambda t: [
            "report",
            suite_dir(t, runs_dot_parquet=table({"x": [1]}), results_dot_parquet=GARBAGE),
        ],
        "report-garbage-sweep-json": lambda t: ["report", suite_dir(t, sweep_dot_json=GARBAGE)],
        "ls-runs-missing": lambda t: ["ls-runs", str(t / "nope")],
        "ls-runs-a-file": lambda t: ["ls-runs", config(t)],
        "ls-runs-fifo": lambda t: ["ls-runs", fifo(t, "f")],
        "validate-mathtext-model-plugin": lambda t: [
            "validate",
            config(t),
            "--plugin",
            put(
                t / "evil.py", f"from rayfl.registry import MODELS\nMODELS.add({MATH!r}, object)\n"
            ),
        ],
        "ls-unknown": lambda t: ["ls", "nope"],
        "ls-mathtext": lambda t: ["ls", MATH],
        "ls-path": lambda t: ["ls", "../../etc/passwd"],
        "ls-empty": lambda t: ["ls", ""],
        "compare-out-is-a-file": lambda t: ["compare", suite(t), "--out", config(t)],
        "compare-lock-is-a-dir": lambda t: [
            "compare",
            suite(t),
            "--out",
            suite_dir(t, _dot_lock__x=b""),
        ],
        "compare-garbage-runs-parquet": lambda t: [
            "compare",
            suite(t),
            "--out",
            suite_dir(t, runs_dot_parquet=GARBAGE),
        ],
        "compare-runs-parquet-wrong-columns": lambda t: [
            "compare",
            suite(t),
            "--out",
            suite_dir(t, runs_dot_parquet=table({"x": [1]})),
        ],
        "compare-unknown-key": lambda t: ["compare", suite(t, bogus=1)],
        "compare-name-escape": lambda t: ["compare", suite(t, suite="../../x")],
        "compare-mathtext-label": lambda t: [
            "compare",
            suite(t, algorithms=[{"name": "fedavg", "label": MATH}]),
        ],
        "compare-no-seeds": lambda t: ["compare", suite(t, seeds=[])],
        "compare-seeds-wrong-type": lambda t: ["compare", suite(t, seeds="zero")],
        "compare-rounds-1e300": lambda t: ["compare", suite(t), "engine.rounds=1e300"],
        "compare-missing-dataset": lambda t: ["compare", suite(t), "data.dataset=nope"],
        "tune-unknown-key": lambda t: ["tune", sweep(t, bogus=1)],
        "tune-missing-base": lambda t: ["tune", sweep(t, base="nope.yaml")],
        "tune-empty-space": lambda t: ["tune", sweep(t, space={})],
        "tune-bad-grid": lambda t: ["tune", sweep(t, space={"train.lr": {"grid": 3}})],
        "tune-unknown-space-key": lambda t: ["tune", sweep(t, space={"train.x": {"grid": [1]}})],
        "tune-negative-samples": lambda t: ["tune", sweep(t, tune={"num_samples": -1})],
        "tune-nan-mode": lambda t: ["tune", sweep(t, tune={"metric": "x", "mode": "nan"})],
        "tune-out-is-a-file": lambda t: ["tune", sweep(t), "--out", config(t)],
        "tune-garbage-sweep-json": lambda t: [
            "tune",
            sweep(t),
            "--out",
            suite_dir(t, sweep_dot_json=GARBAGE),
        ],
        "tune-rounds-1e300": lambda t: ["tune", sweep(t), "engine.rounds=1e300"],
    }
)

API: dict[str, Callable[[Path], Callable[[], Any]]] = {
    "run-missing": lambda t: lambda: rayfl.run(t / "nope.yaml", out=t / "r"),
    "run-deep": lambda t: lambda: rayfl.run(BAD_YAML["deep-list"](t), out=t / "r"),
    "run-garbage": lambda t: lambda: rayfl.run(BAD_YAML["garbage"](t), out=t / "r"),
    "run-wrong-type": lambda t: lambda: rayfl.run(42, out=t / "r"),  # type: ignore[arg-type]
    "run-unknown-section": lambda t: lambda: rayfl.run({**SYNTHETIC, "bogus": 1}, out=t / "r"),
    "run-rounds-1e300": lambda t: lambda: rayfl.run(SYNTHETIC, out=t / "r", engine__rounds=1e300),
    "run-name-escape": lambda t: lambda: rayfl.run(SYNTHETIC, name="../../x"),
    "run-mathtext-arch": lambda t: (
        lambda: rayfl.run(SYNTHETIC, out=t / "r", model__architectures=[MATH])
    ),
    "run-resume-missing": lambda t: lambda: rayfl.run(SYNTHETIC, out=t / "nope", resume=True),
    "run-resume-garbage": lambda t: (
        lambda: rayfl.run(SYNTHETIC, out=run_dir(t, config_dot_yaml=GARBAGE), resume=True)
    ),
    "suite-missing": lambda t: lambda: rayfl.suite(t / "nope.yaml", out=t / "o"),
    "suite-deep": lambda t: lambda: rayfl.suite(BAD_YAML["deep-map"](t), out=t / "o"),
    "suite-out-is-a-file": lambda t: lambda: rayfl.suite(suite(t), out=config(t)),
    "suite-garbage-runs-parquet": lambda t: (
        lambda: rayfl.suite(suite(t), out=suite_dir(t, runs_dot_parquet=GARBAGE))
    ),
    "sweep-missing": lambda t: lambda: rayfl.sweep(t / "nope.yaml", out=t / "o"),
    "sweep-garbage": lambda t: lambda: rayfl.sweep(BAD_YAML["garbage"](t), out=t / "o"),
    "sweep-empty-space": lambda t: lambda: rayfl.sweep(sweep(t, space={}), out=t / "o"),
}


@pytest.fixture(autouse=True)
def within_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each case in LIMIT_S seconds, from its own folder, with nothing tracked."""

    def too_slow(signum: int, frame: Any) -> None:
        raise TimeoutError(f"not refused within {LIMIT_S} s")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plugins, "_plugins", {})  # a case's --plugin stays in its case
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_sweep_has_over_a_hundred_inputs():
    assert len(CLI) + len(API) >= 100


@pytest.mark.parametrize("build", list(CLI.values()), ids=list(CLI))
def test_a_bad_input_is_one_line_and_exit_2(build: Build, tmp_path, capsys):
    argv = build(tmp_path)
    if argv[0] == "run":
        argv.append("--no-progress")
        if argv[1] != "--resume":  # serial (unless the case says): an empty file names no executor
            argv.insert(2, "engine.executor=serial")
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("rayfl: error: ") and "Traceback" not in line


@pytest.mark.parametrize("build", list(API.values()), ids=list(API))
def test_a_bad_input_to_the_api_is_a_user_error(build, tmp_path):
    with pytest.raises(rayfl.UserError) as info:
        build(tmp_path)()
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("writes", [0, 3])
def test_a_full_disk_during_a_run_is_one_line(writes, tmp_path, monkeypatch, capsys):
    """ENOSPC from every file write after the first `writes` (0: at the start, 3: in a round):
    one line naming the resume, not the chained tracebacks of the run and its callbacks."""
    real, calls = os.fsync, []

    def full(fd: int) -> None:
        calls.append(fd)
        if len(calls) > writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "r"
    code = main(["run", config(tmp_path), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert "No space left on device" in line and str(out) in line

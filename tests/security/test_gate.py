"""The gate (rayfl.gate, docs/security.md) against a colleague with write access to the shared
folders: every attack below ends in one line with exit code 2 (a UserError from the API),
leaves the victim file beside the folder unchanged, runs nothing and starts no Ray.

One real run (serial, synthetic data, 2 rounds, a checkpoint each round) is copied per case;
suite and sweep folders are built the way rayfl writes them, through the gate.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import rayfl
from rayfl import cli, gate
from rayfl.config import build_config
from rayfl.errors import UserError
from tests.conftest import SYNTHETIC
from tests.security.plants import one_line

VICTIM = b"precious data that no rayfl command may change\n"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    from rayfl.launch import simulate

    raw = json.loads(json.dumps(SYNTHETIC))
    raw["engine"].update({"checkpoint_every": 1, "rounds": 2})
    run_dir = tmp_path_factory.mktemp("base") / "run"
    simulate(build_config(raw), run_dir, progress=False)
    return run_dir


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    from rayfl.engine import startup

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started before the folder was checked")

    monkeypatch.setattr(startup, "init_ray", refuse)


@pytest.fixture
def world(base_run, tmp_path, monkeypatch):
    """A copy of the run, a victim file beside it, a marker no code may create; cwd = tmp."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(base_run, run_dir, symlinks=True)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    return run_dir, victim, tmp_path / "code-ran"


def refused(argv: list[str], capsys) -> str:
    """Run the CLI in-process: exit 2, one line, within seconds; returns the line."""
    start = time.monotonic()
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("rayfl: error:") and "\n" not in err and "Traceback" not in err
    assert time.monotonic() - start < 20
    return err


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# ------------------------------------------------------------------------------ run folders


def test_a_file_changed_after_a_legit_run_is_refused_by_every_command(world, capsys):
    run_dir, victim, _ = world
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["status"] = "RUNNING"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    before = (run_dir / "summary.json").read_bytes()
    for argv in (["report", str(run_dir)], ["ls-runs", str(run_dir.parent)]):
        assert "not written by your rayfl" in refused(argv, capsys)
    assert "not written by your rayfl" in refused(["run", "--resume", str(run_dir)], capsys)
    assert (run_dir / "summary.json").read_bytes() == before  # ls-runs marked nothing
    assert not (run_dir / "report.html").exists()


@pytest.mark.parametrize(
    ("name", "commands"),
    [
        ("summary.json", ["report", "resume", "ls-runs"]),
        ("config.yaml", ["report", "resume"]),  # ls-runs never reads it
        ("metrics.parquet", ["report"]),  # a resume replaces it, never writing through it
    ],
)
def test_a_symlink_planted_in_a_run_is_never_followed(world, capsys, name, commands):
    run_dir, victim, _ = world
    (run_dir / name).unlink()
    (run_dir / name).symlink_to(victim)
    argv = {
        "report": ["report", str(run_dir)],
        "resume": ["run", "--resume", str(run_dir)],
        "ls-runs": ["ls-runs", str(run_dir.parent)],
    }
    for command in commands:
        assert "symbolic link" in refused(argv[command], capsys)
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("uri", [None, "sqlite:////tmp/elsewhere.db"])
def test_a_planted_mlflow_run_id_is_never_used(world, capsys, uri, monkeypatch):
    run_dir, _, _ = world
    store = run_dir.parent.parent / "mine.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    planted = {"run_id": "0123abcd"} | ({"tracking_uri": uri} if uri else {})
    (run_dir / "mlflow_run.json").write_text(json.dumps(planted))
    argv = ["run", "--resume", str(run_dir), "tracking.backend=mlflow"]
    assert "mlflow_run.json" in refused(argv, capsys)
    with pytest.raises(UserError, match="mlflow_run.json"):  # the API takes the same road
        rayfl.run(run_dir / "config.yaml", out=run_dir, resume=True, tracking__backend="mlflow")
    assert not store.exists() and not Path("mlflow.db").exists()


@pytest.mark.slow  # builds an MLflow store
def test_the_id_of_a_real_mlflow_run_planted_without_a_uri_is_never_logged_into(
    world, capsys, monkeypatch
):
    from mlflow.tracking import MlflowClient

    run_dir, _, _ = world
    uri = f"sqlite:///{run_dir.parent.parent / 'mine.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    victim = client.create_run(client.create_experiment("theirs")).info.run_id
    (run_dir / "mlflow_run.json").write_text(json.dumps({"run_id": victim}))
    capsys.readouterr()  # MLflow's own lines, creating the store
    code = cli.main(["run", "--resume", str(run_dir), "tracking.backend=mlflow"])
    run = client.get_run(victim)
    assert run.data.metrics == {} and run.info.status == "RUNNING"  # the victim run untouched
    assert code == 2 and "mlflow_run.json" in one_line(capsys.readouterr().err)


def test_ls_runs_changes_no_planted_running_run_and_creates_no_store(world, capsys):
    run_dir, _, _ = world
    planted = run_dir.parent / "planted"
    planted.mkdir()
    (planted / "config.yaml").write_text("{}")
    (planted / "summary.json").write_text(json.dumps({"status": "RUNNING", "rounds": 1}))
    (planted / "mlflow_run.json").write_text(json.dumps({"run_id": "0123abcd"}))
    before = (planted / "summary.json").read_bytes()
    refused(["ls-runs", str(run_dir.parent)], capsys)
    assert cli.main(["ls-runs", "--untrusted", str(run_dir.parent)]) == 0
    assert "planted" in capsys.readouterr().out
    assert (planted / "summary.json").read_bytes() == before
    assert not Path("mlflow.db").exists()


@pytest.mark.slow
def test_out_onto_a_finished_run_refuses_and_force_moves_it_aside(world, capsys):
    run_dir, _, _ = world
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    config = run_dir / "config.yaml"
    assert "holds a run already" in refused(["run", str(config), "--out", str(run_dir)], capsys)
    with pytest.raises(UserError, match="holds a run already"):
        rayfl.run(config, out=run_dir)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    rayfl.run(config, out=run_dir, force=True, progress=False, engine__rounds=1)
    (aside,) = run_dir.parent.glob("run.archived-*")
    assert json.loads((aside / "summary.json").read_text())["rounds"] == 2
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 1


def test_a_refused_run_leaves_nothing_behind(world, capsys):
    run_dir, _, _ = world
    new = run_dir.parent / "new"
    with pytest.raises(UserError, match="no checkpoint"):
        rayfl.run(run_dir / "config.yaml", out=new, resume=True)
    assert not new.exists()


def test_a_manifest_under_another_key_is_refused(world, capsys, tmp_path, monkeypatch):
    run_dir, _, _ = world
    monkeypatch.setenv(gate.KEY_ENV, str(tmp_path / "colleague" / "key"))
    assert "not authenticated by your key" in refused(["report", str(run_dir)], capsys)
    assert cli.main(["report", "--untrusted", str(run_dir)]) == 0  # read-only: allowed


def test_a_key_file_others_can_read_is_refused(world, tmp_path, monkeypatch, capsys):
    run_dir, _, _ = world
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    monkeypatch.setenv(gate.KEY_ENV, str(key))
    assert "mode 0600" in refused(["report", str(run_dir)], capsys)


# ------------------------------------------------------------------ report: bounded, escaped


def _planted_table(path: Path, table: pa.Table, **kwargs) -> None:
    pq.write_table(table, path, **kwargs)


def test_report_draws_a_bounded_part_of_3000_metric_columns(world, capsys):
    run_dir, _, _ = world
    cols = {"round": pa.array([1.0, 2.0])}
    cols |= {f"m{i}/acc": pa.array([0.1, 0.2]) for i in range(3000)}
    _planted_table(run_dir / "metrics.parquet", pa.table(cols))
    refused(["report", str(run_dir)], capsys)
    start = time.monotonic()
    assert cli.main(["report", "--untrusted", str(run_dir)]) == 0
    assert time.monotonic() - start < 60
    assert "more metrics not shown" in (run_dir / "report.html").read_text()


def test_report_refuses_a_30m_row_zstd_parquet_from_its_footer(world, capsys):
    run_dir, _, _ = world
    rows = pa.table({"round": pa.array(np.zeros(30_000_000, dtype=np.int8))})
    _planted_table(run_dir / "metrics.parquet", rows, compression="zstd")
    assert (run_dir / "metrics.parquet").stat().st_size < 2_000_000
    assert "over the limits" in refused(["report", "--untrusted", str(run_dir)], capsys)


def test_report_draws_a_bounded_part_of_20000_architectures(world, capsys):
    run_dir, _, _ = world
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["final"] = {f"personal/acc/arch=a{i}": 0.5 for i in range(20_000)}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    start = time.monotonic()
    assert cli.main(["report", "--untrusted", str(run_dir)]) == 0
    assert time.monotonic() - start < 60
    assert "more architectures not shown" in (run_dir / "report.html").read_text()


# ------------------------------------------------------------------------------ suite folders


def _suite_folder(root: Path, label: str = "local") -> Path:
    """A suite folder with one run, as rayfl compare writes it."""
    from rayfl.tables import write_table

    out = root / "suite"
    out.mkdir()
    row = {"setting": "", "label": label, "algorithm": "local", "seed": 0, "status": "FINISHED"}
    row |= {"rounds": 2, "run_dir": "x", "mlflow_run_id": "", "error": "", "personal/acc": 0.5}
    write_table([row], out / "runs")
    return out


def test_a_javascript_label_never_becomes_a_link(tmp_path):
    from rayfl.report import write_report

    label = "javascript:alert(document.domain)//"
    out = _suite_folder(tmp_path, label)
    (out / label / "seed0").mkdir(parents=True)  # a real run folder: it gets a link
    page = write_report(out).read_text()
    hrefs = [h.split('"')[0] for h in page.split('href="')[1:]]
    assert all(h.startswith("./") for h in hrefs)
    assert "<script" not in page and 'href="javascript' not in page


@pytest.mark.parametrize("where", ["label", "seed"])
def test_compare_refuses_a_run_folder_that_is_a_symlink(tmp_path, capsys, where, monkeypatch):
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim"
    (victim / "checkpoint.r00001-1-ab").mkdir(parents=True)
    base = {**SYNTHETIC, "engine": {**SYNTHETIC["engine"], "rounds": 1}}
    suite = {"suite": "s", "base": base, "algorithms": [{"name": "local"}], "seeds": [0]}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    if where == "label":
        out.mkdir()
        (out / "local").symlink_to(victim)
    else:
        (out / "local").mkdir(parents=True)
        (out / "local" / "seed0").symlink_to(victim)
    assert "symbolic link" in refused(["compare", "suite.yaml", "--out", str(out)], capsys)
    assert (victim / "checkpoint.r00001-1-ab").is_dir() and os.listdir(victim) == [
        "checkpoint.r00001-1-ab"
    ]


def test_a_planted_suite_mlflow_run_is_never_reopened(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = {**SYNTHETIC, "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp_path}/m.db"}}
    suite = {"suite": "s", "base": base, "algorithms": [{"name": "local"}], "seeds": [0]}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    out.mkdir()
    (out / "mlflow_run.json").write_text(json.dumps({"run_id": "victim", "tracking_uri": ""}))
    assert "mlflow_run.json" in refused(["compare", "suite.yaml", "--out", str(out)], capsys)
    assert not (tmp_path / "m.db").exists()


@pytest.mark.slow  # builds an MLflow store, and without the gate runs the suite
def test_a_real_mlflow_run_planted_as_the_suites_parent_is_never_reopened(
    tmp_path, capsys, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("theirs")
    victim = client.create_run(experiment).info.run_id
    child = client.create_run(experiment, tags={"mlflow.parentRunId": victim}).info.run_id
    base = {**SYNTHETIC, "tracking": {"backend": "mlflow", "uri": uri}}
    suite = {"suite": "s", "base": base, "algorithms": [{"name": "local"}], "seeds": [0]}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    out.mkdir()
    (out / "mlflow_run.json").write_text(json.dumps({"run_id": victim, "tracking_uri": uri}))
    capsys.readouterr()  # MLflow's own lines, creating the store
    code = cli.main(["compare", "suite.yaml", "--out", str(out)])
    assert client.get_run(child).info.status == "RUNNING"  # the victim's child not killed
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{victim}'")
    assert [r.info.run_id for r in children] == [child]  # and no run added under it
    assert client.get_run(victim).info.status == "RUNNING"
    assert code == 2 and "mlflow_run.json" in one_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------ sweep folders


def _sweep(tmp_path: Path, resume: bool) -> Path:
    base = {**SYNTHETIC, "data": {**SYNTHETIC["data"], "val_fraction": 0.2}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {"sweep": "tiny", "base": "base.yaml", "space": {"algorithm.T": {"grid": [2.0]}}}
    sweep["tune"] = {"resume": resume}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    return tmp_path / "sweep.yaml"


def test_a_planted_tuner_pkl_is_never_unpickled(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    out = tmp_path / "out"
    (out / "tune" / "tiny").mkdir(parents=True)
    (out / "tune" / "tiny" / "tuner.pkl").write_bytes(pickle.dumps(Evil(marker)))
    line = refused(["tune", str(_sweep(tmp_path, True)), "--out", str(out)], capsys)
    assert "never sealed" in line and not marker.exists()


def test_a_tuner_pkl_changed_after_the_seal_is_refused(tmp_path, capsys):
    from rayfl.tune.run import seal_tune_state

    marker = tmp_path / "code-ran"
    out = tmp_path / "out"
    (out / "tune" / "tiny").mkdir(parents=True)
    (out / "tune" / "tiny" / "tuner.pkl").write_bytes(pickle.dumps({"fine": 1}))
    seal_tune_state(out)
    (out / "tune" / "tiny" / "tuner.pkl").write_bytes(pickle.dumps(Evil(marker)))
    line = refused(["tune", str(_sweep(tmp_path, True)), "--out", str(out)], capsys)
    assert "differs from what your rayfl sealed" in line and not marker.exists()


@pytest.mark.parametrize("name", ["tune", "trials"])
def test_tune_refuses_a_symlinked_storage_or_trials_folder(tmp_path, capsys, name):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    line = refused(["tune", str(_sweep(tmp_path, False)), "--out", str(out)], capsys)
    assert "symbolic link" in line and os.listdir(victim) == []


def test_sweep_report_links_no_trial_outside_the_folder(tmp_path):
    from rayfl.report import write_report
    from rayfl.tables import write_table

    out = tmp_path / "sweep"
    (out / "trials").mkdir(parents=True)
    (out / "trials" / "t1").symlink_to(tmp_path)
    rows = [{"trial": "t1", "algorithm.T": 2.0, "personal/acc": 0.5, "status": "done"}]
    rows += [{"trial": "../..", "algorithm.T": 3.0, "personal/acc": 0.4, "status": "done"}]
    write_table(rows, out / "results")
    gate.write(
        out / "sweep.yaml",
        yaml.safe_dump({"space": {"algorithm.T": {}}, "tune": {"mode": "<b>max</b>"}}).encode(),
    )
    page = write_report(out).read_text()
    assert "href" not in page.split("<h2>Trials</h2>")[1].split("</table>")[0]
    assert "<b>max</b>" not in page


# ------------------------------------------------------------------------------ bench folders

BENCHMARKS = Path(__file__).resolve().parents[2] / "experiments" / "benchmarks"


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """The benchmark's driver (experiments/benchmarks/bench.py) on a one-variant benchmark, its
    children faked: a variant's child records its arguments and, as a run does first, writes
    summary.json into the run folder it was given; it writes no bench.json."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench
    import bench_floors

    started: list[list[str]] = []

    class Child:
        def __init__(self, args, **kwargs) -> None:
            started.append(list(args))
            run_dir = Path(args[-1])
            run_dir.mkdir(exist_ok=True)
            (run_dir / "summary.json").write_text('{"status": "RUNNING"}')
            self.pid, self.returncode = os.getpid(), 0

        def communicate(self):
            return "", None

    fake = types.SimpleNamespace(Popen=Child, PIPE=-1, STDOUT=-2)
    monkeypatch.setattr(bench_floors, "subprocess", fake)
    raw = {**SYNTHETIC, "bench": {"floor": False, "variants": {"serial": []}}}
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(raw))
    return types.SimpleNamespace(main=bench.main, started=started)


@pytest.mark.parametrize("link", ["serial", "serial/run"])
def test_bench_refuses_a_symlinked_variant_folder_before_anything_runs(
    tmp_path, capsys, bench, link
):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(VICTIM)
    out = tmp_path / "out"
    (out / link).parent.mkdir(parents=True, exist_ok=True)
    (out / link).symlink_to(victim)
    code = bench.main([str(tmp_path / "bench.yaml"), "--out", str(out)])
    assert os.listdir(victim) == ["keep"] and (victim / "keep").read_bytes() == VICTIM
    assert bench.started == []  # no variant ran
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "symbolic link" in line


def test_bench_never_reports_a_results_file_it_did_not_write(tmp_path, capsys, bench):
    out = tmp_path / "out"
    (out / "serial" / "run").mkdir(parents=True)
    rounds = [{"time/round_s": 0.001, "personal/acc": 0.987654}]
    planted = {"rounds": rounds, "store_peak_mb": 0.0, "spilled_mb": 0.0}
    (out / "serial" / "run" / "bench.json").write_text(json.dumps(planted))
    code = bench.main([str(tmp_path / "bench.yaml"), "--out", str(out)])
    captured = capsys.readouterr()
    assert "0.988" not in captured.out and not (out / "report.txt").exists()
    assert code == 2 and "not written by your rayfl" in one_line(captured.err)

"""MLflowTracker against a real SQLite store in a temporary directory, read back with MlflowClient."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.utils.validation import _validate_metric_name, _validate_param_name

from rayfl.errors import UserError
from rayfl.tracking import make_tracker
from rayfl.tracking import mlflow as tracking_mlflow
from rayfl.tracking.mlflow import MlflowTracker, mlflow_key, open_experiment


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One SQLite store for the module (creating one costs ~1.5-2.5 s), cwd moved away from the repo."""
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        uri = f"sqlite:///{root / 'store' / 'mlflow.db'}"
        open_experiment(uri, "warmup")  # creates the database once
        yield uri, root


@pytest.fixture
def client(store: tuple[str, Path]) -> MlflowClient:
    return MlflowClient(tracking_uri=store[0])


def _tracker(store: tuple[str, Path], **kwargs: object) -> MlflowTracker:
    return MlflowTracker(experiment="tests", tracking_uri=store[0], **kwargs)  # type: ignore[arg-type]


def test_params_are_flattened_cut_by_mlflow_and_config_yaml_is_complete(store, client) -> None:
    long = "x" * 7000
    config = {
        "seed": 3,
        "engine": {"rounds": 5, "executor": {"workers": 2}},
        "models": {"archs": ["cnn1", "cnn2"], "notes": long},
        "privacy": {},
    }
    tracker = _tracker(store, run_name="params")
    tracker.log_config(config)
    tracker.close()

    run = client.get_run(tracker.run_id)
    params = run.data.params
    assert params["seed"] == "3"
    assert params["engine.rounds"] == "5"
    assert params["engine.executor.workers"] == "2"
    assert params["models.archs"] == "['cnn1', 'cnn2']"
    assert params["privacy"] == "{}"
    assert params["models.notes"] == "x" * 6000  # MLflow cuts a value past its limit
    assert run.info.run_name == "params"

    local = client.download_artifacts(tracker.run_id, "config.yaml", str(store[1] / "dl1"))
    assert yaml.safe_load(Path(local).read_text()) == config  # full value, nested as given


def test_metrics_are_logged_per_step_with_sanitized_keys(store, client) -> None:
    tracker = _tracker(store)
    tracker.log_metrics({"personal/acc": 0.5, "personal/acc/arch=cnn1": 0.25}, step=1)
    tracker.log_metrics({"personal/acc": 0.75, "comm/bytes_up": 1024}, step=2)
    tracker.close()

    hist = client.get_metric_history(tracker.run_id, "personal/acc")
    assert sorted((m.step, m.value) for m in hist) == [(1, 0.5), (2, 0.75)]
    arch = client.get_metric_history(tracker.run_id, "personal/acc/arch_cnn1")
    assert [(m.step, m.value) for m in arch] == [(1, 0.25)]
    assert client.get_run(tracker.run_id).data.metrics["comm/bytes_up"] == 1024.0


def test_non_numeric_metric_is_skipped_not_fatal(store, client, caplog) -> None:
    tracker = _tracker(store)
    with caplog.at_level(logging.WARNING, logger="rayfl.tracking.mlflow"):
        tracker.log_metrics({"a": "not a number", "b": 2.0}, step=0)  # type: ignore[dict-item]
    tracker.close()
    assert client.get_run(tracker.run_id).data.metrics == {"b": 2.0}
    assert any("'a'" in r.getMessage() for r in caplog.records)


def test_artifacts_file_and_directory_stay_next_to_the_database(store, client) -> None:
    root = store[1]
    src = root / "src"
    (src / "plots").mkdir(parents=True)
    (src / "results.parquet").write_bytes(b"PAR1")
    (src / "plots" / "acc.png").write_bytes(b"png")
    tracker = _tracker(store)
    tracker.log_artifact(src / "results.parquet")
    tracker.log_artifact(src / "plots")
    with pytest.raises(FileNotFoundError):
        tracker.log_artifact(src / "missing.txt")
    tracker.close()

    top = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert top == {"results.parquet", "plots"}
    assert [a.path for a in client.list_artifacts(tracker.run_id, "plots")] == ["plots/acc.png"]
    # Artifacts live beside the store, not under the working directory.
    artifact_uri = client.get_run(tracker.run_id).info.artifact_uri
    assert str((root / "store" / "mlruns").resolve()) in artifact_uri
    assert not (root / "mlruns").exists()


def test_parent_and_child_runs_are_linked(store, client) -> None:
    parent = _tracker(store, run_name="sweep")
    children = [
        _tracker(store, run_name=f"trial{i}", parent_run_id=parent.run_id, tags={"trial": str(i)})
        for i in range(2)
    ]
    for i, child in enumerate(children):
        child.log_metrics({"personal/acc": 0.1 * (i + 1)}, step=1)
        child.close()
    parent.close()

    found = client.search_runs(
        [parent.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'"
    )
    assert sorted(r.info.run_id for r in found) == sorted(str(c.run_id) for c in children)
    assert sorted(r.data.tags["trial"] for r in found) == ["0", "1"]
    assert "mlflow.parentRunId" not in client.get_run(parent.run_id).data.tags


def test_close_sets_status_once_and_rejects_unknown_status(store, client) -> None:
    tracker = _tracker(store)
    with pytest.raises(ValueError, match="FINISHED"):
        tracker.close("DONE")
    tracker.close("FAILED")
    tracker.close("FINISHED")  # idempotent: the first status stays
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert run.info.end_time is not None


def test_context_manager_marks_failed_runs(store, client) -> None:
    with pytest.raises(RuntimeError), _tracker(store) as tracker:
        raise RuntimeError("boom")
    assert client.get_run(tracker.run_id).info.status == "FAILED"
    with _tracker(store) as ok:
        ok.set_tags({"algorithm": "pfedes"})
    run = client.get_run(ok.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["algorithm"] == "pfedes"


def test_an_outage_is_warned_once_and_then_nothing_more_is_sent(store, client, monkeypatch, caplog):
    tracker = _tracker(store)
    tracker.log_metrics({"personal/acc": 0.1}, step=1)
    calls = {"n": 0}

    def down(*args: object, **kwargs: object) -> None:
        calls["n"] += 1
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(tracker.client, "log_batch", down)
    monkeypatch.setattr(tracker.client, "log_artifact", down)
    with caplog.at_level(logging.WARNING, logger="rayfl.tracking.mlflow"):
        tracker.log_metrics({"personal/acc": 0.2}, step=2)  # fails: warned, not raised
        tracker.log_metrics({"personal/acc": 0.3}, step=3)  # not even tried
        tracker.log_config({"seed": 1})
        tracker.set_tags({"a": "b"})
    assert calls["n"] == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
    tracker.close()  # waits for step 1, sends nothing more
    hist = client.get_metric_history(tracker.run_id, "personal/acc")
    assert [(m.step, m.value) for m in hist] == [(1, 0.1)]


def test_every_http_call_is_bounded_unless_the_user_chose(store, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")
    tracking_mlflow.client_for(store[0])
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10"  # MLflow's own: 120 s
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"  # the user's


def test_a_down_server_stops_a_run_in_seconds(tmp_path, monkeypatch) -> None:
    # nothing listens on the port: MLflow's defaults retried for minutes
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(UserError, match="cannot start an MLflow run"):
        MlflowTracker(experiment="x", tracking_uri=f"http://127.0.0.1:{port}")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("personal/acc", "personal/acc"),
        ("personal/acc/arch=cnn1", "personal/acc/arch_cnn1"),
        ("comm/bytes_up", "comm/bytes_up"),
        ("time/round s", "time/round s"),
        ("a:b", "a_b"),
        ("/lead//double/", "lead/double"),
        ("x/../y", "x/_/y"),
        ("", "_"),
        ("acc(%)", "acc___"),
    ],
)
def test_mlflow_key_mapping(key: str, expected: str) -> None:
    assert mlflow_key(key) == expected
    # Whatever comes out is accepted by MLflow itself.
    _validate_metric_name(expected)
    _validate_param_name(expected)


def test_make_tracker_uses_env_uri_and_existing_experiment(store, monkeypatch) -> None:
    uri = store[0]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    exp_id = open_experiment(uri, "env-exp")[1]
    assert open_experiment(uri, "env-exp")[1] == exp_id  # second call finds it
    tracker = make_tracker("mlflow", experiment="env-exp", run_name="r")
    assert isinstance(tracker, MlflowTracker)
    assert tracker.tracking_uri == uri and tracker.experiment_id == exp_id
    tracker.close()


def test_unreachable_store_and_deleted_experiment_are_user_errors(store, client) -> None:
    blocker = store[1] / "a_file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot start an MLflow run"):
        MlflowTracker(experiment="x", tracking_uri=f"sqlite:///{blocker}/sub/mlflow.db")

    exp_id = open_experiment(store[0], "doomed")[1]
    client.delete_experiment(exp_id)
    with pytest.raises(UserError, match="restore"):
        MlflowTracker(experiment="doomed", tracking_uri=store[0])


def test_changed_param_is_refused_without_entering_outage_mode(store, client, caplog) -> None:
    tracker = _tracker(store)
    tracker.log_config({"engine": {"rounds": 5}})
    with caplog.at_level(logging.WARNING, logger="rayfl.tracking.mlflow"):
        tracker.log_config({"engine": {"rounds": 9}})  # MLflow params are write-once
    tracker.log_metrics({"personal/acc": 0.5}, step=1)  # still sent: no outage
    assert not tracker._down
    tracker.close()
    assert client.get_run(tracker.run_id).data.params["engine.rounds"] == "5"
    assert any("refused" in r.getMessage() for r in caplog.records)
    # The latest full config is still attached.
    local = client.download_artifacts(tracker.run_id, "config.yaml", str(store[1] / "dl2"))
    assert yaml.safe_load(Path(local).read_text()) == {"engine": {"rounds": 9}}

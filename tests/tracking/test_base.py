"""Tracker protocol, config flattening, the backend factory, and the stdout/null trackers."""

from __future__ import annotations

import dataclasses
import enum
import logging
from pathlib import Path

import pytest

from rayfl.errors import ConfigError
from rayfl.tracking import Tracker, default_tracking_uri, flatten_config, make_tracker
from rayfl.tracking.base import NullTracker, StdoutTracker, check_status, format_metrics, plain


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass(frozen=True)
class Engine:
    rounds: int = 5
    mode: Mode = Mode.FAST


@dataclasses.dataclass(frozen=True)
class Run:
    seed: int = 1
    engine: Engine = dataclasses.field(default_factory=Engine)
    out: Path = Path("runs/x")
    archs: tuple[str, ...] = ("cnn1", "cnn2")


def test_flatten_nested_mapping_keeps_order_lists_and_empty_sections() -> None:
    flat = flatten_config({"b": {"y": 1, "x": {"deep": None}}, "a": [1, 2], "empty": {}})
    assert flat == {"b.y": 1, "b.x.deep": None, "a": [1, 2], "empty": {}}
    assert list(flat) == ["b.y", "b.x.deep", "a", "empty"]


def test_flatten_dataclass_config_to_plain_values() -> None:
    assert flatten_config(Run()) == {
        "seed": 1,
        "engine.rounds": 5,
        "engine.mode": "fast",
        "out": "runs/x",
        "archs": ["cnn1", "cnn2"],
    }
    assert plain({"s": {3, 1, 2}, 1: object}) == {"s": [1, 2, 3], "1": str(object)}


def test_make_tracker_rejects_unknown_backend_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"tracking\.backend.*'mlflw'.*did you mean 'mlflow'"):
        make_tracker("mlflw", experiment="e")


def test_make_tracker_builds_stdout_and_null() -> None:
    assert isinstance(make_tracker("stdout", experiment="e", run_name="r"), StdoutTracker)
    assert isinstance(make_tracker("none", experiment="e"), NullTracker)


def test_default_tracking_uri_is_absolute_sqlite_in_cwd_unless_env(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = default_tracking_uri()
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert uri.startswith("sqlite:////")  # four slashes: an absolute path
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert default_tracking_uri() == "http://mlflow.internal:5000"


def test_trackers_satisfy_the_protocol() -> None:
    for tracker in (StdoutTracker(), NullTracker()):
        assert isinstance(tracker, Tracker)
        assert tracker.run_id is None


def test_check_status() -> None:
    assert check_status("failed") == "FAILED"
    with pytest.raises(ValueError, match="KILLED"):
        check_status("CRASHED")


def test_format_metrics_is_sorted_and_compact() -> None:
    line = format_metrics({"personal/acc": 0.812345, "comm/bytes_up": 12000, "n": 3.0}, step=7)
    assert line == "step 7: comm/bytes_up=12000 n=3.0 personal/acc=0.8123"


def test_stdout_tracker_logs_at_info_and_closes_once(caplog, tmp_path) -> None:
    with caplog.at_level(logging.INFO, logger="rayfl.tracking.stdout"):
        tracker = StdoutTracker(experiment="e", run_name="r1", tags={"algorithm": "fedavg"})
        tracker.log_config({"engine": {"rounds": 2}})
        tracker.log_metrics({"personal/acc/arch=cnn1": 0.5}, step=1)
        tracker.log_metrics({}, step=2)  # nothing to say: no line
        tracker.log_artifact(tmp_path / "plot.png")
        tracker.close("FAILED")
        tracker.close("FINISHED")
    messages = [r.getMessage() for r in caplog.records]
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert "tags: algorithm=fedavg" in messages
    assert "config:\nengine:\n  rounds: 2" in messages
    assert "step 1: personal/acc/arch=cnn1=0.5" in messages
    assert not any(m.startswith("step 2") for m in messages)
    assert f"artifact: {(tmp_path / 'plot.png').resolve()}" in messages
    assert [m for m in messages if "ended" in m] == ["run r1 ended: FAILED"]


def test_context_manager_status_on_interrupt(caplog) -> None:
    with (
        caplog.at_level(logging.INFO, logger="rayfl.tracking.stdout"),
        pytest.raises(KeyboardInterrupt),
        StdoutTracker(run_name="r2"),
    ):
        raise KeyboardInterrupt
    assert "run r2 ended: KILLED" in [r.getMessage() for r in caplog.records]


def test_null_tracker_accepts_everything_but_bad_status(tmp_path) -> None:
    tracker = NullTracker()
    tracker.log_config({"a": 1})
    tracker.log_metrics({"x": 1.0}, step=0)
    tracker.log_artifact(tmp_path / "missing")  # not even checked: nothing is kept
    tracker.set_tags({"k": "v"})
    tracker.close()
    with pytest.raises(ValueError):
        tracker.close("OOPS")

"""MLflow tracker: one MLflow run per simulation, through an explicit ``MlflowClient`` (the
fluent API keeps one global active run per process, which a sweep's parent and child runs, or
two tests, would share); every call names its run id.

Batching is MLflow's: ``log_batch(..., synchronous=False)`` queues metrics and sends them from
MLflow's own threads; ``close`` waits for them. ``log_batch`` also splits params and tags into
MLflow's batch limits. A failing tracking server never ends a simulation nor holds it for
minutes: every HTTP call is bounded (:data:`HTTP_DEFAULTS`), and after the first failed call the
tracker warns once and sends nothing more for this run (the run directory holds every number).
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml
from mlflow import MlflowClient
from mlflow.data.numpy_dataset import from_numpy
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from rayfl.errors import UserError
from rayfl.gate import locked
from rayfl.tracking.base import (
    Tracker,
    check_status,
    default_tracking_uri,
    flatten_config,
    plain,
)
from rayfl.tracking.provenance import provenance_tags, tracked_params

logger = logging.getLogger(__name__)

# MLflow's HTTP client retries a failed request 7 times with backoff, 120 s each (minutes per
# call); rayfl's default: 10 s per request, one retry. Set in the environment, so Ray workers and
# Tune trials get them too; a value the user set is kept.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
MAX_KEY = 250  # MLflow's longest metric or param key
_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")


def mlflow_key(key: str) -> str:
    """A key as MLflow allows it (alphanumerics, ``_ - . /``, spaces; a normalized path), changed
    as little as possible: ``personal/acc/arch=cnn1`` -> ``personal/acc/arch_cnn1``."""
    out = _BAD_KEY_CHARS.sub("_", str(key))
    segments = ["_" if s in (".", "..") else s for s in out.split("/") if s]
    return ("/".join(segments) or "_")[:MAX_KEY]


def client_for(uri: str) -> Any:
    """An ``MlflowClient`` for ``uri`` whose HTTP calls are bounded (:data:`HTTP_DEFAULTS`)."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return MlflowClient(tracking_uri=uri)


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, or None for other stores."""
    rest = unquote(uri.removeprefix("sqlite:///").split("?", 1)[0])
    return Path(rest) if uri.startswith("sqlite:///") and rest not in ("", ":memory:") else None


def open_experiment(uri: str, experiment: str) -> tuple[Any, str]:
    """A client for ``uri`` and the id of ``experiment`` (created if needed; a UserError if
    deleted). A SQLite store is opened under ``<db>.lock`` (two processes creating the schema of
    a fresh file at once fail); its artifacts are kept next to it (``mlruns/<name>``)."""
    db = _sqlite_path(uri)
    location = None
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^\w.-]", "_", experiment) or "experiment"
        location = (db.parent.resolve() / "mlruns" / slug).as_uri()
    with locked(db.with_name(db.name + ".lock")) if db is not None else nullcontext():
        client = client_for(uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                return client, str(client.create_experiment(experiment, location))
            except MlflowException as exc:  # another process created it meanwhile
                exp = client.get_experiment_by_name(experiment)
                if exc.error_code != "RESOURCE_ALREADY_EXISTS" or exp is None:
                    raise
    if exp.lifecycle_stage == "deleted":
        raise UserError(
            f"tracking: MLflow experiment {experiment!r} is deleted; restore it with "
            f"`mlflow experiments restore --experiment-id {exp.experiment_id}` or choose "
            "another tracking.experiment"
        )
    return client, str(exp.experiment_id)


class MlflowTracker(Tracker):
    """Tracker writing one MLflow run (params, stepped metrics, artifacts, tags), a child run of
    ``parent_run_id`` if given, or continuing ``run_id`` (a resumed simulation). A UserError when
    the store cannot be reached at the start."""

    def __init__(
        self,
        *,
        experiment: str,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.tracking_uri = uri = tracking_uri or default_tracking_uri()
        # user, command line, git commit and rayfl version; the caller's tags win
        run_tags = {str(k): str(v) for k, v in {**provenance_tags(), **(tags or {})}.items()}
        if parent_run_id:
            run_tags["mlflow.parentRunId"] = parent_run_id
        try:
            self.client, self.experiment_id = open_experiment(self.tracking_uri, experiment)
            run = self._continue_run(run_id) if run_id else None
            if run is None:
                run = self.client.create_run(self.experiment_id, tags=run_tags, run_name=run_name)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"tracking: cannot start an MLflow run at {self.tracking_uri}: {exc}; check "
                "tracking.uri / MLFLOW_TRACKING_URI or set tracking.backend=stdout"
            ) from exc
        self.run_id: str | None = run.info.run_id
        self._run: str = run.info.run_id
        self._sending: list[Any] = []  # MLflow's RunOperations of the metrics sent
        self._down = False  # a call failed: nothing more is sent for this run
        self._closed = False
        self._key_origin: dict[str, str] = {}
        self._key_clash: set[str] = set()
        logger.info(
            "MLflow run %s (%s) in %r at %s", run.info.run_id, run.info.run_name, experiment, uri
        )

    def _continue_run(self, run_id: str) -> Any:
        """Reopen the run a resumed simulation logged to; None (and a warning) when it is gone.

        A run still RUNNING was left so by a killed driver (the caller holds the run directory's
        lock): it is marked KILLED first, then continued; the tag ``rayfl.resumes`` counts resumes.
        """
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            logger.warning(
                "MLflow run %s of this run directory is not in %s (%s); starting a new run",
                run_id,
                self.tracking_uri,
                exc.error_code,
            )
            return None
        if run.info.lifecycle_stage == "deleted":
            logger.warning("MLflow run %s was deleted; starting a new run", run_id)
            return None
        if run.info.status == "RUNNING":
            logger.warning(
                "MLflow run %s was left RUNNING by a killed driver; marked KILLED, now continued",
                run_id,
            )
            self.client.set_terminated(run_id, status="KILLED")
        resumes = int(run.data.tags.get("rayfl.resumes", "0")) + 1
        self.client.update_run(run_id, status="RUNNING")
        self.client.set_tag(run_id, "rayfl.resumes", str(resumes))
        return self.client.get_run(run_id)

    def _send(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` unless the server is down; a failure is warned about once, and then
        nothing more is sent. A value MLflow refuses (``INVALID_PARAMETER_VALUE``, e.g. a
        changed param of a resumed run) is warned about and is no outage."""
        if self._down:
            return None
        try:
            return call()
        except MlflowException as exc:
            if exc.error_code == "INVALID_PARAMETER_VALUE":
                logger.warning("MLflow refused %s of run %s: %s", what, self.run_id, exc)
                return None
            self._failed(what, exc)
        except Exception as exc:
            self._failed(what, exc)
        return None

    def _failed(self, what: str, exc: BaseException) -> None:
        self._down = True
        logger.warning(
            "MLflow %s failed for run %s (%s: %s); the simulation continues, nothing more is "
            "sent to MLflow for this run, and the run directory holds every number",
            what,
            self.run_id,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )

    def _key(self, key: str) -> str:
        mapped = mlflow_key(key)
        first = self._key_origin.setdefault(mapped, key)
        if first != key and mapped not in self._key_clash:
            self._key_clash.add(mapped)
            logger.warning("metric keys %r and %r both map to MLflow key %r", first, key, mapped)
        return mapped

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the flattened config as params and the whole of it as ``config.yaml``."""
        flat = tracked_params(flatten_config(config))
        params = [Param(mlflow_key(k), "None" if v is None else str(v)) for k, v in flat.items()]
        self._send("log_config", lambda: self.client.log_batch(self._run, params=params))
        text = yaml.safe_dump(plain(config), sort_keys=False)
        self._send(
            "log_text(config.yaml)", lambda: self.client.log_text(self._run, text, "config.yaml")
        )

    def log_dataset(
        self, name: str, features: Any, targets: Any, context: str, source: str | None = None
    ) -> None:
        """Record numpy arrays as an MLflow dataset input of the run, with MLflow's content
        digest and the `mlflow.data.context` tag (train, test, ...); the data is not uploaded."""
        with warnings.catch_warnings():  # "source can be interpreted in multiple ways": a path
            warnings.simplefilter("ignore", UserWarning)
            data = from_numpy(features, source=source, targets=targets, name=name)  # type: ignore[arg-type]
        tag = InputTag(key="mlflow.data.context", value=context)
        inputs = [DatasetInput(dataset=data._to_mlflow_entity(), tags=[tag])]
        self._send(f"log_inputs({name})", lambda: self.client.log_inputs(self._run, inputs))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step`` through MLflow's asynchronous batching; non-numeric
        values are skipped with a warning."""
        if self._closed or self._down:
            return
        now_ms = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            try:
                items.append(Metric(self._key(key), float(value), now_ms, int(step)))
            except (TypeError, ValueError):
                logger.warning("metric %r=%r is not a number; not logged", key, value)
        ops = self._send(
            "log_metrics",
            lambda: self.client.log_batch(self._run, metrics=items, synchronous=False),
        )
        if ops is not None:
            self._sending.append(ops)

    def log_missing(self, rows: Sequence[tuple[int, Mapping[str, float]]]) -> int:
        """Log the ``(step, metrics)`` rows whose values this MLflow run does not hold yet, and
        return how many values that was. A resumed run calls it with the rounds its checkpoint
        restored: a driver killed after a checkpoint but before the tracker logged that round
        would otherwise leave holes in every curve."""
        if self._closed or self._down or not rows:
            return 0
        keys = sorted({k for _, metrics in rows for k in metrics})
        logged: dict[str, set[int]] = {}
        for key in keys:
            history = self._send("get_metric_history", partial(self._history, key))
            logged[key] = {m.step for m in history or []}
        sent = 0
        for step, metrics in rows:
            missing = {k: v for k, v in metrics.items() if step not in logged.get(k, set())}
            if missing:
                self.log_metrics(missing, step)
                sent += len(missing)
        if sent:
            logger.info("MLflow run %s: re-logged %d values of resumed rounds", self.run_id, sent)
        return sent

    def _history(self, key: str) -> Any:
        return self.client.get_metric_history(self._run, self._key(key))

    def log_artifact(self, path: str | Path) -> None:
        """Upload a file (or a directory's contents, under its name) to the run."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"artifact {path} does not exist")
        if path.is_dir():
            call = lambda: self.client.log_artifacts(self._run, str(path), artifact_path=path.name)  # noqa: E731
        else:
            call = lambda: self.client.log_artifact(self._run, str(path))  # noqa: E731
        self._send(f"log_artifact({path.name})", call)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags (MLflow cuts values past its length limit)."""
        items = [RunTag(str(k), str(v)) for k, v in tags.items()]
        if items:
            self._send("set_tags", lambda: self.client.log_batch(self._run, tags=items))

    def close(self, status: str = "FINISHED") -> None:
        """Wait for the metrics being sent and end the run with ``status`` (FINISHED, FAILED or
        KILLED, else ValueError); later calls do nothing."""
        status = check_status(status)
        if self._closed:
            return
        self._closed = True
        for ops in self._sending:  # queued before an outage, too: each call is bounded
            try:
                ops.wait()
            except Exception as exc:
                if not self._down:
                    self._failed("log_metrics", exc)
        self._sending = []
        self._send("close", lambda: self.client.set_terminated(self._run, status=status))


def _quietly(what: str, tracking_uri: str | None, call: Callable[[Any], Any]) -> Any:
    """``call(client)`` on the store at ``tracking_uri``; None (and a warning naming ``what``)
    when the store cannot be reached or the run is unknown: these are housekeeping."""
    uri = tracking_uri or default_tracking_uri()
    try:
        return call(client_for(uri))
    except Exception as exc:
        logger.warning("could not %s at %s: %s", what, uri, exc)
        return None


def mark_killed(run_id: str, tracking_uri: str | None = None) -> bool:
    """Set MLflow run ``run_id`` to KILLED if it is still RUNNING; True when it was. Used for
    run directories whose driver was killed (``rayfl ls-runs``)."""

    def kill(client: Any) -> bool:
        if client.get_run(run_id).info.status != "RUNNING":
            return False
        client.set_terminated(run_id, status="KILLED")
        return True

    return bool(_quietly(f"mark MLflow run {run_id} KILLED", tracking_uri, kill))


def end_child_runs(
    parent_run_id: str, tracking_uri: str | None = None, status: str = "KILLED"
) -> int:
    """End the child runs of `parent_run_id` still RUNNING with `status`; returns how many.
    A sweep's trials that Tune stopped early (ASHA) or lost never close their own run."""
    status = check_status(status)

    def end(client: Any) -> int:
        runs = client.search_runs(
            [client.get_run(parent_run_id).info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'",
        )
        for run in runs:
            client.set_terminated(run.info.run_id, status)
        return len(runs)

    return int(
        _quietly(f"end the child runs of MLflow run {parent_run_id}", tracking_uri, end) or 0
    )


def delete_run(run_id: str, tracking_uri: str | None = None) -> bool:
    """Soft-delete MLflow run ``run_id`` (a suite run restarting from round 1 replaces its
    partial run); True when deleted."""
    what = f"delete the partial MLflow run {run_id}"
    return _quietly(what, tracking_uri, lambda client: client.delete_run(run_id) or True) is True

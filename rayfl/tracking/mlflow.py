"""MLflow tracker: one MLflow run per simulation, through an explicit ``MlflowClient``.

The fluent API (``mlflow.start_run``) keeps one global active run per process; a sweep's parent
run and its trials' child runs, or two tests, would then share or leak state. Every call here
names its run id instead.

Metric and param keys: MLflow accepts only alphanumerics, ``_ - . /`` and spaces (colons too,
except on Windows). :func:`mlflow_key` replaces every other character with ``_`` and removes
empty, ``.`` and ``..`` path segments, so ``personal/acc/arch=cnn1`` is logged as
``personal/acc/arch_cnn1``; keys that are already valid are unchanged.

Outages: a failing tracking server never ends a simulation. Metrics that could not be sent are
buffered (up to ``max_pending`` values) and re-sent with the next call after ``retry_after_s``;
one warning is logged per outage.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from rayfl.errors import UserError
from rayfl.gate import locked
from rayfl.tracking.base import (
    TrackerBase,
    check_status,
    default_tracking_uri,
    flatten_config,
    plain,
)
from rayfl.tracking.provenance import provenance_tags, tracked_params

logger = logging.getLogger(__name__)

# MLflow's own limits (mlflow.utils.validation); kept here so that importing this module
# does not depend on MLflow internals.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")


def mlflow_key(key: str) -> str:
    """Map a metric/param key onto MLflow's allowed names, changing as little as possible.

    Example:
        >>> mlflow_key("personal/acc/arch=cnn1")
        'personal/acc/arch_cnn1'
        >>> mlflow_key("comm/bytes_up")
        'comm/bytes_up'
    """
    out = _BAD_KEY_CHARS.sub("_", str(key))
    # MLflow also rejects keys that are not normalized paths ("/a", "a//b", "a/../b").
    segments = ["_" if s in (".", "..") else s for s in out.split("/") if s]
    return ("/".join(segments) or "_")[:MAX_KEY]


def _sqlite_path(uri: str) -> Path | None:
    """Return the database file of a ``sqlite:///`` URI, or None for other stores."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    # "sqlite:////abs/mlflow.db" -> "/abs/mlflow.db"; "sqlite:///rel.db" -> "rel.db".
    rest = unquote(uri[len(prefix) :].split("?", 1)[0])
    if not rest or rest == ":memory:":
        return None
    return Path(rest)


def prepare_experiment(experiment: str, tracking_uri: str | None = None) -> str:
    """Create the store and the experiment if needed and return the experiment id.

    Call it once on the driver before starting Tune trials: several processes creating a fresh
    SQLite database at the same time fail in MLflow's schema migration.

    Raises:
        UserError: The store cannot be reached or the experiment was deleted.
    """
    uri = tracking_uri or default_tracking_uri()
    try:
        return _open_experiment(uri, experiment)[1]
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"tracking: cannot open MLflow experiment {experiment!r} at {uri}: {exc}; "
            "check tracking.uri / MLFLOW_TRACKING_URI or set tracking.backend=stdout"
        ) from exc


def _open_experiment(uri: str, experiment: str) -> tuple[Any, str]:
    """An ``MlflowClient`` for ``uri`` and the id of ``experiment`` (created if needed).

    A SQLite store is opened under an exclusive file lock next to the database
    (``<db>.lock``): MLflow creates and migrates the schema on first use, and two processes doing
    that on a fresh file at once fail (``duplicate column name``).
    """
    from mlflow import MlflowClient

    db = _sqlite_path(uri)
    if db is None:
        client = MlflowClient(tracking_uri=uri)
        return client, _get_or_create_experiment(client, experiment, uri)
    db.parent.mkdir(parents=True, exist_ok=True)
    with locked(db.with_name(db.name + ".lock")):
        client = MlflowClient(tracking_uri=uri)
        return client, _get_or_create_experiment(client, experiment, uri)


def _get_or_create_experiment(client: Any, name: str, uri: str) -> str:
    from mlflow.exceptions import MlflowException

    db = _sqlite_path(uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        location = None
        if db is not None:
            # Keep artifacts next to the database rather than under whatever the current
            # directory is (MLflow's default), so a store in tmp_path or a run directory stays
            # self-contained.
            slug = re.sub(r"[^\w.-]", "_", name) or "experiment"
            location = (db.parent.resolve() / "mlruns" / slug).as_uri()
        try:
            return str(client.create_experiment(name, artifact_location=location))
        except MlflowException as exc:
            # Another process created it between our lookup and create.
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise UserError(
            f"tracking: MLflow experiment {name!r} is deleted; restore it with "
            f"`mlflow experiments restore --experiment-id {exp.experiment_id}` or choose "
            "another tracking.experiment"
        )
    return str(exp.experiment_id)


def dataset_input(
    name: str, features: Any, targets: Any, context: str, source: str | None = None
) -> Any:
    """An `mlflow.entities.DatasetInput` for numpy arrays, with MLflow's content digest and the
    `mlflow.data.context` tag (train, test, ...)."""
    from mlflow.data.numpy_dataset import from_numpy
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():  # "source can be interpreted in multiple ways": a local path
        warnings.simplefilter("ignore", UserWarning)
        dataset = from_numpy(features, source=source, targets=targets, name=name)  # type: ignore[arg-type]
    return DatasetInput(
        dataset=dataset._to_mlflow_entity(),
        tags=[InputTag(key="mlflow.data.context", value=context)],
    )


class MlflowTracker(TrackerBase):
    """Tracker writing one MLflow run (params, stepped metrics, artifacts, tags).

    Args:
        experiment: Experiment name; created on first use.
        run_name: Display name of the run.
        tracking_uri: Store URI; defaults to :func:`~rayfl.tracking.base.default_tracking_uri`.
        parent_run_id: Make this a child run (sets the ``mlflow.parentRunId`` tag).
        tags: Tags set when the run is created.
        retry_after_s: After a failed call, buffer metrics for this long before retrying.
        max_pending: Most metric values buffered during an outage; older ones are dropped.

    Raises:
        UserError: The store cannot be reached when the run is created.
    """

    def __init__(
        self,
        *,
        experiment: str,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        retry_after_s: float = 30.0,
        max_pending: int = 100_000,
        run_id: str | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.experiment = experiment
        self.retry_after_s = retry_after_s
        self.max_pending = max_pending
        # user, command line, git commit and rayfl version; the caller's tags win
        tags = {**provenance_tags(), **(tags or {})}
        run_tags = {str(k): str(v)[:MAX_TAG_VALUE] for k, v in tags.items()}
        if parent_run_id:
            run_tags["mlflow.parentRunId"] = parent_run_id
        try:
            self.client, self.experiment_id = _open_experiment(self.tracking_uri, experiment)
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
        self._run: str = run.info.run_id
        self.run_id: str | None = self._run
        self.run_name: str = run.info.run_name
        self._pending: list[Any] = []  # mlflow.entities.Metric awaiting a successful send
        self._retry_at = 0.0
        self._failing = False
        self._closed = False
        self._key_origin: dict[str, str] = {}
        self._key_clash: set[str] = set()
        logger.info(
            "MLflow run %s (%s) in experiment %r at %s",
            self.run_id,
            self.run_name,
            experiment,
            self.tracking_uri,
        )

    def _continue_run(self, run_id: str) -> Any:
        """Reopen the run a resumed simulation logged to; None (and a warning) when it is gone.

        A run still RUNNING was left so by a killed driver (the caller holds the run directory's
        lock): it is marked KILLED first, then continued; the tag ``rayfl.resumes`` counts resumes.
        """
        from mlflow.exceptions import MlflowException

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

    # -- failures -----------------------------------------------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        """Report a failed call once per outage and schedule the next attempt."""
        self._retry_at = time.monotonic() + self.retry_after_s
        if not self._failing:
            logger.warning(
                "MLflow %s failed for run %s (%s: %s); the simulation continues and metrics "
                "are buffered and retried every %.0f s",
                what,
                self.run_id,
                type(exc).__name__,
                exc,
                self.retry_after_s,
            )
        else:
            logger.debug("MLflow %s failed again: %s", what, exc)
        self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            logger.warning("MLflow is reachable again for run %s", self.run_id)
        self._failing = False

    def _key(self, key: str) -> str:
        mapped = mlflow_key(key)
        first = self._key_origin.setdefault(mapped, key)
        if first != key and mapped not in self._key_clash:
            self._key_clash.add(mapped)
            logger.warning(
                "metric keys %r and %r both map to MLflow key %r; their values mix",
                first,
                key,
                mapped,
            )
        return mapped

    # -- Tracker API ----------------------------------------------------------------------------

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the flattened config as params (values cut to 6000 chars) and ``config.yaml``."""
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        flat = tracked_params(flatten_config(config))
        params: dict[str, str] = {}
        for key, value in flat.items():
            text = "None" if value is None else str(value)
            if len(text) > MAX_PARAM_VALUE:
                logger.debug(
                    "param %s cut to %d characters (full value in config.yaml)",
                    key,
                    MAX_PARAM_VALUE,
                )
                text = text[: MAX_PARAM_VALUE - 3] + "..."
            params[mlflow_key(key)] = text
        items = [Param(k, v) for k, v in params.items()]
        try:
            for i in range(0, len(items), PARAMS_PER_BATCH):
                self.client.log_batch(
                    self._run, params=items[i : i + PARAMS_PER_BATCH], synchronous=True
                )
        except MlflowException as exc:
            if exc.error_code != "INVALID_PARAMETER_VALUE":
                self._failed("log_config", exc)
                return
            # Params are write-once in MLflow: logging a changed value (e.g. a resumed run with
            # an override) is refused. Not an outage; config.yaml below still records it.
            logger.warning("MLflow refused some params of run %s: %s", self.run_id, exc)
        except Exception as exc:
            self._failed("log_config", exc)
            return
        try:
            with tempfile.TemporaryDirectory(prefix="rayfl-config-") as tmp:
                path = Path(tmp) / "config.yaml"
                path.write_text(yaml.safe_dump(plain(config), sort_keys=False))
                self.client.log_artifact(self._run, str(path))
        except Exception as exc:
            self._failed("log_artifact(config.yaml)", exc)

    def log_dataset(
        self,
        name: str,
        features: Any,
        targets: Any,
        context: str,
        source: str | None = None,
    ) -> None:
        """Record numpy arrays as an MLflow dataset input of the run (name, digest, schema,
        source; the data itself is not uploaded). See :func:`dataset_input`."""
        try:
            self.client.log_inputs(
                self._run, datasets=[dataset_input(name, features, targets, context, source)]
            )
        except Exception as exc:
            self._failed(f"log_inputs({name})", exc)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step``; non-numeric values are skipped with a warning."""
        from mlflow.entities import Metric

        if self._closed:
            return
        now_ms = int(time.time() * 1000)
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                logger.warning("metric %r=%r is not a number; not logged", key, value)
                continue
            self._pending.append(Metric(self._key(key), number, now_ms, int(step)))
        self._flush()

    def log_missing(self, rows: Sequence[tuple[int, Mapping[str, float]]]) -> int:
        """Log the ``(step, metrics)`` rows whose values this MLflow run does not hold yet, and
        return how many values that was. A resumed run calls it with the rounds its checkpoint
        restored: a driver killed after a checkpoint but before the tracker logged that round
        (or during an outage that buffered it) would otherwise leave holes in every curve."""
        if self._closed or not rows:
            return 0
        keys = sorted({k for _, metrics in rows for k in metrics})
        logged: dict[str, set[int]] = {}
        try:
            for key in keys:
                history = self.client.get_metric_history(self._run, self._key(key))
                logged[key] = {m.step for m in history}
        except Exception as exc:  # an outage: send every row (a step may then be twice)
            self._failed("get_metric_history", exc)
            logged = {}
        sent = 0
        for step, metrics in rows:
            missing = {k: v for k, v in metrics.items() if step not in logged.get(k, set())}
            if missing:
                self.log_metrics(missing, step)
                sent += len(missing)
        if sent:
            logger.info("MLflow run %s: re-logged %d values of resumed rounds", self.run_id, sent)
        return sent

    def _flush(self, force: bool = False) -> None:
        from mlflow.exceptions import MlflowException

        if not self._pending or (not force and time.monotonic() < self._retry_at):
            self._trim()
            return
        while self._pending:
            chunk = self._pending[:METRICS_PER_BATCH]
            try:
                self.client.log_batch(self._run, metrics=chunk, synchronous=True)
            except MlflowException as exc:
                if exc.error_code == "INVALID_PARAMETER_VALUE":
                    # The values themselves are rejected: resending cannot help.
                    logger.warning("MLflow rejected %d metric values: %s", len(chunk), exc)
                    del self._pending[: len(chunk)]
                    continue
                self._failed("log_metrics", exc)
                break
            except Exception as exc:
                self._failed("log_metrics", exc)
                break
            del self._pending[: len(chunk)]
            self._recovered()
        self._trim()

    def _trim(self) -> None:
        excess = len(self._pending) - self.max_pending
        if excess > 0:
            logger.warning(
                "MLflow unreachable: dropping the %d oldest buffered metric values", excess
            )
            del self._pending[:excess]

    def log_artifact(self, path: str | Path) -> None:
        """Upload a file (or a directory's contents, under its name) to the run.

        Raises:
            FileNotFoundError: ``path`` does not exist (a caller bug, not a sink failure).
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"artifact {path} does not exist")
        try:
            if path.is_dir():
                self.client.log_artifacts(self._run, str(path), artifact_path=path.name)
            else:
                self.client.log_artifact(self._run, str(path))
        except Exception as exc:
            self._failed(f"log_artifact({path.name})", exc)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags (values cut to MLflow's 8000-character limit)."""
        from mlflow.entities import RunTag

        if not tags:
            return
        items = [RunTag(str(k), str(v)[:MAX_TAG_VALUE]) for k, v in tags.items()]
        try:
            for i in range(0, len(items), PARAMS_PER_BATCH):
                self.client.log_batch(
                    self._run, tags=items[i : i + PARAMS_PER_BATCH], synchronous=True
                )
        except Exception as exc:
            self._failed("set_tags", exc)

    def close(self, status: str = "FINISHED") -> None:
        """Send buffered metrics and end the run with ``status``; later calls do nothing.

        Raises:
            ValueError: ``status`` is not FINISHED, FAILED or KILLED.
        """
        status = check_status(status)
        if self._closed:
            return
        self._closed = True
        self._flush(force=True)
        if self._pending:
            logger.warning(
                "MLflow run %s closed with %d metric values never sent",
                self.run_id,
                len(self._pending),
            )
        try:
            self.client.set_terminated(self._run, status=status)
        except Exception as exc:
            self._failed("close", exc)


def mark_killed(run_id: str, tracking_uri: str | None = None) -> bool:
    """Set MLflow run ``run_id`` to KILLED if it is still RUNNING; True when it was.

    Used for run directories whose driver was killed (``rayfl ls-runs``); an unreachable store or
    an unknown run is logged and ignored.
    """
    from mlflow import MlflowClient

    uri = tracking_uri or default_tracking_uri()
    try:
        client = MlflowClient(tracking_uri=uri)
        if client.get_run(run_id).info.status != "RUNNING":
            return False
        client.set_terminated(run_id, status="KILLED")
    except Exception as exc:
        logger.warning("could not mark MLflow run %s KILLED at %s: %s", run_id, uri, exc)
        return False
    return True


def end_child_runs(
    parent_run_id: str, tracking_uri: str | None = None, status: str = "KILLED"
) -> int:
    """End the child runs of `parent_run_id` still RUNNING with `status`; returns how many.

    A sweep's trials that Tune stopped early (ASHA) or lost never close their own run. An
    unreachable store is logged and ignored (the sweep's results are on disk too).
    """
    from mlflow import MlflowClient

    status = check_status(status)
    uri = tracking_uri or default_tracking_uri()
    try:
        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs(
            [client.get_run(parent_run_id).info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'",
        )
        for run in runs:
            client.set_terminated(run.info.run_id, status)
    except Exception as exc:
        logger.warning("could not end the child runs of MLflow run %s: %s", parent_run_id, exc)
        return 0
    return len(runs)


def delete_run(run_id: str, tracking_uri: str | None = None) -> bool:
    """Delete MLflow run ``run_id`` (MLflow's soft delete: ``mlflow gc`` purges it, the UI can
    restore it); True when it was deleted.

    A suite run that restarts from round 1 (no checkpoint) replaces the partial MLflow run its
    earlier attempt left, so that the suite's parent keeps one child per run. An unreachable
    store or an unknown run is logged and ignored.
    """
    from mlflow import MlflowClient

    uri = tracking_uri or default_tracking_uri()
    try:
        MlflowClient(tracking_uri=uri).delete_run(run_id)
    except Exception as exc:
        logger.warning("could not delete the partial MLflow run %s at %s: %s", run_id, uri, exc)
        return False
    return True

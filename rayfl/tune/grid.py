"""A fixed grid of runs on Ray Tune (a suite's runs `parallel` at a time): one trial per run, each
in a placement group sized like a sweep's trial (`trial_bundles`) within its share of the
cluster, so runs never hold half of what they need and a run's numbers do not depend on how
many run at once. Resuming is the runs' own (run folders and checkpoints), so Tune's state
lives in a temporary folder and is never restored."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rayfl.schema import RunConfig
from rayfl.tune.run import _absolute_uri
from rayfl.tune.trial import trial_bundles, trial_shapes

DRIVER_CPUS = 0.01  # a run's own process (with engine.executor=ray it waits on its workers)
Stopped = None  # what `run_grid` returns for a run Ctrl-C stopped before it ended


def pinned(cfg: RunConfig) -> RunConfig:
    """`cfg` made independent of the working directory (a Tune trial runs in its own): the data
    root and the MLflow store as absolute paths."""
    data = dataclasses.replace(
        cfg.data, root=cfg.data.root and str(Path(cfg.data.root).expanduser().absolute())
    )
    tracking = cfg.tracking
    if tracking.backend == "mlflow":
        tracking = dataclasses.replace(tracking, uri=_absolute_uri(tracking.uri))
    return dataclasses.replace(cfg, data=data, tracking=tracking)


def run_grid(
    name: str,
    configs: Mapping[int, RunConfig],
    parallel: int,
    fn: Callable[..., dict[str, Any]],
    on_result: Callable[[int, dict[str, Any]], None] | None = None,
    **params: Any,
) -> dict[int, dict[str, Any] | BaseException | None]:
    """Run `fn(cfg, index, **params)` for every `index -> cfg` of `configs`, `parallel` at a
    time, each as a Tune trial in the placement group of its run; `fn` returns a JSON-able
    dict, handed to `on_result(index, returned)` on this process as the trial ends. Returns per
    index what `fn` returned, the error of a trial that died, or `Stopped`."""
    import ray
    from ray import tune

    total = ray.cluster_resources()
    # a run's share of the cluster, less its own process's bundle (its workers fill the rest)
    room = {k: total.get(k, 0.0) / parallel for k in ("CPU", "GPU")}
    room["CPU"] -= DRIVER_CPUS
    jobs: dict[int, RunConfig] = {}
    bundles: dict[int, list[dict[str, float]]] = {}
    for index, cfg in configs.items():
        if cfg.engine.executor == "ray":  # as many workers as its bundles hold
            engine = dataclasses.replace(cfg.engine, num_workers=len(trial_shapes(cfg, room)))
            cfg = dataclasses.replace(cfg, engine=engine)
        jobs[index] = pinned(cfg)
        bundles[index] = trial_bundles(cfg, DRIVER_CPUS, room)
    storage = tempfile.mkdtemp(prefix="rayfl-grid-")
    # Tune's own notes (a Ctrl-C's "resume with Tuner.restore(...)") name this temporary
    # folder: the runs resume from their own folders instead
    tune_log = logging.getLogger("ray.tune")
    level = tune_log.level
    tune_log.setLevel(logging.ERROR)
    try:
        grid: Any = tune.Tuner(
            tune.with_resources(
                tune.with_parameters(_trial, jobs=jobs, fn=fn, params=params),
                resources=lambda config: tune.PlacementGroupFactory(bundles[config["run"]]),
            ),
            param_space={"run": tune.grid_search(list(jobs))},
            tune_config=tune.TuneConfig(
                max_concurrent_trials=parallel, trial_dirname_creator=_dirname
            ),
            run_config=tune.RunConfig(
                name=name, storage_path=storage, verbose=0, callbacks=[_handing(on_result)]
            ),
        ).fit()
    finally:
        tune_log.setLevel(level)
        shutil.rmtree(storage, ignore_errors=True)
    out: dict[int, dict[str, Any] | BaseException | None] = {}
    for result in grid:  # (a trial that died before it reported has no config: its folder)
        index = int(Path(result.path).name.removeprefix("run"))
        reported = (result.metrics or {}).get("returned")
        out[index] = json.loads(reported) if reported else trial_error(result.error)
    return out


def _dirname(trial: Any) -> str:
    return f"run{trial.config['run']}"


def trial_error(error: BaseException | None) -> BaseException | None:
    """A dead trial's error as one line: the last of Ray's traceback (the run's own error,
    e.g. `ModuleNotFoundError: No module named 'rayfl'` from a worker that cannot import it)."""
    if error is None:
        return None
    text = str(error).strip()
    return RuntimeError(
        f"its Ray Tune trial died: {text.splitlines()[-1] if text else repr(error)}"
    )


def _trial(
    config: dict[str, Any], jobs: dict[int, RunConfig], fn: Callable[..., Any], params: Any
) -> None:
    from ray import tune

    index = config["run"]
    tune.report({"returned": json.dumps(fn(jobs[index], index, **params))})


def _handing(on_result: Callable[[int, dict[str, Any]], None] | None) -> Any:
    """A Tune callback that hands each trial's returned dict to `on_result` as it ends (Tune
    keeps a copy of its callbacks in `tuner.pkl`: the copy does nothing)."""
    from ray.tune import Callback

    class Handing(Callback):  # type: ignore[misc]
        def __init__(self, on_result: Any) -> None:
            self.on_result = on_result

        def __reduce__(self) -> Any:
            return (Handing, (None,))

        def on_trial_result(
            self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any
        ) -> None:
            if self.on_result is not None and "returned" in result:
                self.on_result(int(trial.config["run"]), json.loads(result["returned"]))

    return Handing(on_result)

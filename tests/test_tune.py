"""Sweeps: loading and validation (no Ray), then one tiny sweep on the shared local Ray.

The sweep test checks what a user relies on: one Parquet row per trial, a best_config.yaml that
`rayfl run` loads, and an MLflow parent run with one child run per trial whose logged metric
equals the table's. Resuming continues the finished experiment without running a trial again.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from rayfl.config import load_config
from rayfl.errors import ConfigError, UserError
from rayfl.tune import load_sweep
from rayfl.tune.sweep import num_trials, search_space, split_overrides
from rayfl.tune.trial import TrialJob, TuneReport, trial_bundles, trial_config

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, base: dict[str, Any], sweep: dict[str, Any]) -> Path:
    """The sweep file and its base, which holds a validation split to rank trials on."""
    base = {**base, "data": {"val_fraction": 0.2, **base.get("data", {})}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"sweep": "tiny", "base": "base.yaml", **sweep}))
    return path


SPACE = {"algorithm.T": {"grid": [2.0, 4.0]}}


# ----------------------------------------------------------------------------- loading


def test_split_overrides_routes_tune_space_and_base() -> None:
    tune_ov, space_ov, base_ov = split_overrides(
        [
            "tune.num_samples=4",
            "space.algorithm.alpha={choice: [0.1, 0.5]}",
            "engine.rounds=3",
            "seed=1",
        ]
    )
    assert tune_ov == ["num_samples=4"]
    assert space_ov == {"algorithm.alpha": {"choice": [0.1, 0.5]}}
    assert base_ov == ["engine.rounds=3", "seed=1"]


def test_load_sweep_applies_file_then_command_line_overrides(tmp_path, synthetic_raw) -> None:
    path = _write(
        tmp_path, synthetic_raw, {"overrides": ["engine.rounds=5", "seed=3"], "space": SPACE}
    )
    sweep = load_sweep(
        path, ["engine.rounds=7", "tune.num_samples=3", "space.train.lr={loguniform: [0.001, 0.1]}"]
    )
    assert sweep.config.engine.rounds == 7  # the command line comes after the file's overrides
    assert sweep.config.seed == 3
    assert sweep.tune.num_samples == 3
    assert list(sweep.space) == ["algorithm.T", "train.lr"]
    assert num_trials(sweep) == 2 * 3
    assert sweep.base == (tmp_path / "base.yaml").resolve()


def test_unknown_space_key_is_a_config_error_naming_it(tmp_path, synthetic_raw) -> None:
    path = _write(tmp_path, synthetic_raw, {"space": {"algorithm.temperature": {"grid": [1.0]}}})
    with pytest.raises(
        ConfigError, match=r"space\.algorithm\.temperature: unknown key algorithm\.temperature"
    ):
        load_sweep(path)
    with pytest.raises(
        ConfigError,
        match=r"space\.engine\.round: unknown key engine\.round \(did you mean 'rounds'",
    ):
        load_sweep(_write(tmp_path, synthetic_raw, {"space": {"engine.round": {"grid": [1]}}}))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"algorithm.T": {"grid": [1.0, -1.0]}}, r"space\.algorithm\.T: algorithm\.T: .*> 0"),
        (
            {"algorithm.embed_dim": {"uniform": [8, 32]}},
            r"space\.algorithm\.embed_dim: .*expected an integer",
        ),
        (
            {"algorithm.T": {"gird": [1.0]}},
            r"space\.algorithm\.T: unknown distribution 'gird' \(did you mean 'grid'",
        ),
        ({"algorithm.T": {"loguniform": [0.0, 1.0]}}, r"loguniform needs low > 0"),
        ({"algorithm.T": {"uniform": [2.0, 1.0]}}, r"needs low < high"),
    ],
)
def test_bad_space_values_are_refused(tmp_path, synthetic_raw, entry, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_sweep(_write(tmp_path, synthetic_raw, {"space": entry}))


def test_bad_tune_settings_and_sweep_keys_are_refused(tmp_path, synthetic_raw) -> None:
    path = _write(tmp_path, synthetic_raw, {"space": SPACE})
    with pytest.raises(ConfigError, match=r"unknown key tune\.metrc \(did you mean 'metric'"):
        load_sweep(path, ["tune.metrc=x"])
    with pytest.raises(ConfigError, match=r"tune\.scheduler: 'hyperband' is not allowed"):
        load_sweep(path, ["tune.scheduler=hyperband"])
    with pytest.raises(ConfigError, match=r"tune\.num_samples: must be at least 1"):
        load_sweep(path, ["tune.num_samples=0"])
    with pytest.raises(ConfigError, match=r"unknown key spaces \(did you mean 'space'"):
        load_sweep(_write(tmp_path, synthetic_raw, {"spaces": SPACE}))
    with pytest.raises(ConfigError, match=r"base: nowhere\.yaml not found"):
        load_sweep(_write(tmp_path, synthetic_raw, {"space": SPACE, "base": "nowhere.yaml"}))


def test_config_for_sets_values_over_overrides_and_accepts_numpy_scalars(
    tmp_path, synthetic_raw
) -> None:
    path = _write(tmp_path, synthetic_raw, {"overrides": ["algorithm.T=9.0"], "space": SPACE})
    sweep = load_sweep(path)
    cfg = sweep.config_for({"algorithm.T": np.float64(3.5), "algorithm.embed_dim": np.int64(24)})
    assert cfg.algorithm.params.T == 3.5
    assert cfg.algorithm.params.embed_dim == 24 and type(cfg.algorithm.params.embed_dim) is int
    assert sweep.config.algorithm.params.T == 9.0  # the base keeps the override


@pytest.mark.parametrize("name", ["pfedes_T_alpha", "fedfd_projection"])
def test_shipped_sweeps_validate(name: str) -> None:
    import rayfl.algorithms.fedfd  # noqa: F401  (registers fedfd even before the package imports it)

    sweep = load_sweep(REPO / "experiments" / "sweeps" / f"{name}.yaml")
    assert sweep.name == name
    assert len(sweep.space) == 3
    assert sweep.config.engine.rounds == 3
    assert num_trials(sweep) == 8


def test_search_space_maps_every_distribution() -> None:
    space = search_space(
        {
            "a": {"grid": [1, 2]},
            "b": {"choice": ["x", "y"]},
            "c": {"uniform": [0.0, 1.0]},
            "d": {"loguniform": [0.001, 0.1]},
            "e": {"randint": [1, 3]},
        }
    )
    assert space["a"] == {"grid_search": [1, 2]}
    assert space["b"].categories == ["x", "y"]
    assert (space["c"].lower, space["c"].upper) == (0.0, 1.0)
    assert (space["d"].lower, space["d"].upper) == (0.001, 0.1)
    assert (space["e"].lower, space["e"].upper) == (
        1,
        4,
    )  # both ends included: Tune's upper is exclusive


# ----------------------------------------------------------------------------- trials


def test_trial_bundles_cover_the_trials_own_actors(synthetic_raw) -> None:
    from rayfl.config import build_config

    serial = build_config(synthetic_raw, ["engine.worker_resources.num_cpus=2"])
    assert trial_bundles(serial, 0.5) == [{"CPU": 2.0}]
    ray_cfg = build_config(
        synthetic_raw,
        [
            "engine.executor=ray",
            "engine.num_workers=3",
            "engine.worker_resources={num_cpus: 0.5, num_gpus: 0.25}",
            "engine.server_resources={num_cpus: 0, num_gpus: 0.5}",
        ],
    )
    assert trial_bundles(ray_cfg, 0.25) == [{"CPU": 0.25}] + [{"CPU": 0.5, "GPU": 0.25}] * 3 + [
        {"GPU": 0.5}
    ]
    # No worker count given: one worker, so a trial never asks for the whole cluster.
    one = build_config(synthetic_raw, ["engine.executor=ray"])
    assert trial_bundles(one, 1.0) == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_trial_config_pins_workers_tracking_and_data_root(tmp_path, synthetic_raw) -> None:
    raw = copy.deepcopy(synthetic_raw)
    raw["engine"]["executor"] = "ray"
    sweep = load_sweep(_write(tmp_path, raw, {"space": SPACE}))
    job = TrialJob(sweep, tmp_path, "sqlite:////x/mlflow.db", "parent123", "/abs/data")
    cfg = trial_config(job, {"algorithm.T": 4.0}, "trial_abc_00001")
    assert cfg.algorithm.params.T == 4.0
    assert cfg.engine.num_workers == 1
    assert (cfg.tracking.backend, cfg.tracking.uri, cfg.tracking.run_name) == (
        "mlflow",
        "sqlite:////x/mlflow.db",
        "trial_abc_00001",
    )
    assert cfg.data.root == "/abs/data"
    untracked = trial_config(TrialJob(sweep, tmp_path, None, None, None), {"algorithm.T": 4.0}, "t")
    assert untracked.tracking.backend == "none"


class _Sim:
    def __init__(self, rounds: int) -> None:
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(engine=SimpleNamespace(rounds=rounds))


def test_tune_report_sends_evaluated_rounds_and_refuses_a_missing_metric() -> None:
    sent: list[dict[str, Any]] = []
    report = TuneReport("personal/acc", report=sent.append)
    report.on_round_end(_Sim(3), 1, {"round": 1.0, "comm/bytes_up": 10.0})  # not evaluated: skipped
    report.on_round_end(_Sim(3), 2, {"round": 2.0, "personal/acc": 0.5, "comm/bytes_up": 10.0})
    assert sent == [{"round": 2.0, "personal/acc": 0.5, "comm/bytes_up": 10.0}]
    with pytest.raises(
        ConfigError, match=r"tune\.metric: 'personal/acc' is not a metric of this run"
    ):
        report.on_round_end(_Sim(3), 3, {"round": 3.0, "global/acc": 0.1})


# ----------------------------------------------------------------------------- a real sweep


@pytest.mark.ray
def test_tiny_sweep_writes_results_best_config_and_mlflow_runs(
    ray_local, tmp_path, synthetic_raw, mlflow_uri
) -> None:
    from mlflow import MlflowClient

    from rayfl.tune import sweep_and_report

    raw = copy.deepcopy(synthetic_raw)
    uri = mlflow_uri
    raw["tracking"] = {"backend": "mlflow", "experiment": "sweep_test", "uri": uri}
    raw["algorithm"]["beta"] = 0.5
    store = tmp_path / "store"  # tune.storage: where Tune keeps the experiment (s3://... on AWS)
    tune_settings = {"verbose": 0, "storage": str(store)}
    path = _write(
        tmp_path, raw, {"space": {"algorithm.alpha": {"grid": [0.1, 1.0]}}, "tune": tune_settings}
    )
    out = tmp_path / "out"

    result, text = sweep_and_report(path, ["engine.rounds=2"], out=out)
    assert (store / "tiny").is_dir() and not (out / "tune").exists()

    import pyarrow.parquet as pq

    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert len(rows) == 2
    assert sorted(r["algorithm.alpha"] for r in rows) == [0.1, 1.0]
    assert all(r["status"] == "done" and r["rounds"] == 2 for r in rows)
    assert all(0.0 <= r["personal/acc"] <= 1.0 for r in rows)
    assert all(0.0 <= r["personal/val_acc"] <= 1.0 for r in rows)
    assert len({r["trial"] for r in rows}) == 2
    # ranked on validation; the chosen trial's test accuracy is reported beside it
    assert result.sweep.tune.metric == "personal/val_acc"
    best = max(rows, key=lambda r: r["personal/val_acc"])
    assert result.best is not None and result.best["trial"] == best["trial"]
    for row in rows:
        assert row["trial"] in text

    best_cfg = load_config(out / "best_config.yaml")
    assert best_cfg.algorithm.params.alpha == best["algorithm.alpha"]
    assert best_cfg.engine.rounds == 2 and best_cfg.data.dataset == "synthetic"
    assert best_cfg.tracking.uri == uri  # the base's tracking, not a trial's
    assert (out / "metric_vs_params.png").stat().st_size > 0

    client = MlflowClient(tracking_uri=uri)
    assert result.parent_run_id is not None
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == "tiny"
    assert parent.data.metrics["best/personal/val_acc"] == pytest.approx(best["personal/val_acc"])
    assert parent.data.metrics["best/personal/acc"] == pytest.approx(best["personal/acc"])
    assert "chosen on validation" in text
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.parquet", "best_config.yaml", "metric_vs_params.png"} <= artifacts
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
    )
    assert sorted(c.info.run_name for c in children) == sorted(r["trial"] for r in rows)
    by_trial = {r["trial"]: r for r in rows}
    for child in children:
        assert child.info.status == "FINISHED"
        row = by_trial[child.info.run_name]
        assert float(child.data.params["algorithm.alpha"]) == row["algorithm.alpha"]
        history = client.get_metric_history(child.info.run_id, "personal/acc")
        assert [m.step for m in history] == [1, 2]
        assert history[-1].value == row["personal/acc"]

    # The same output directory again: refused unless resumed; resuming runs no trial again.
    with pytest.raises(UserError, match=r"tune\.resume=true"):
        sweep_and_report(path, ["engine.rounds=2"], out=out)
    again, _ = sweep_and_report(path, ["engine.rounds=2", "tune.resume=true"], out=out)
    assert again.rows == result.rows
    assert again.parent_run_id == result.parent_run_id
    assert len(client.search_runs([parent.info.experiment_id])) == 3  # no new child run


def test_a_folder_held_by_a_sweep_or_suite_is_refused_to_a_second(tmp_path) -> None:
    from rayfl.tune.run import held

    busy = r"in use by another rayfl compare or tune \(pid \d+\)"
    with held(tmp_path / "out"), pytest.raises(UserError, match=busy), held(tmp_path / "out"):
        pass
    with held(tmp_path / "out"):  # released when the first ended
        pass

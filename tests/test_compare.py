"""Comparison suites: loading, identical partitions across algorithms, tables, files, MLflow runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

import rayfl.algorithms.fedproto  # noqa: F401  (registration)
from rayfl.compare import load_suite, run_suite
from rayfl.compare.results import aggregate, curves_and_spread, run_row
from rayfl.errors import ConfigError, UserError

ROOT = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).with_name("suite_faults.py")  # the fault-injecting test plugin

BASE = {
    "data": {
        "dataset": "synthetic",
        "num_clients": 3,
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 10},
        "options": {"num_samples": 300, "num_test": 100, "shape": [1, 8, 8]},
    },
    "model": {"family": "tiny2"},
    "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
    "engine": {"rounds": 2, "executor": "serial", "checkpoint_every": 0},
    "tracking": {"backend": "none", "experiment": "suite_test"},
}


def write_suite(tmp_path: Path, **extra) -> Path:
    suite = {
        "suite": "tiny",
        "base": BASE,
        "algorithms": [
            {"name": "local"},
            {"name": "fedproto", "label": "proto", "overrides": {"algorithm.lam": 0.5}},
        ],
        "seeds": [0, 1],
        **extra,
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def compare_cli(path: Path, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`rayfl compare path args --out out` in a subprocess with the fault plugin
    (`tests/suite_faults.py`) driven by `env`: its Ray and trials inherit the faults."""
    from tests.test_cli import rayfl

    command = ["compare", str(path), *args, "--out", str(out), "--plugin", str(FAULTS)]
    return rayfl(*command, env=dict(os.environ, PYTHONPATH=str(ROOT), **env), timeout=600)


def test_load_suite_builds_every_run(tmp_path):
    settings = [
        {"name": "a05", "overrides": {"data.partition.alpha": 0.5}},
        {"name": "a01", "overrides": ["data.partition.alpha=0.1"]},
    ]
    suite = load_suite(write_suite(tmp_path, settings=settings), ["engine.rounds=1"])
    assert len(suite.runs) == 2 * 2 * 2 and suite.labels == ["local", "proto"]
    run = suite.runs[-1]
    assert (run.setting, run.label, run.seed) == ("a01", "proto", 1)
    cfg = run.config
    assert cfg.seed == 1 and cfg.engine.rounds == 1 and cfg.algorithm.params.lam == 0.5
    assert cfg.data.partition.alpha == 0.1 and cfg.tracking.run_name == "a01-proto-s1"
    picked = load_suite(
        write_suite(tmp_path, settings=settings),
        ["seeds=[1]", "algorithms=[proto]", "settings=[a05]"],
    )
    assert [(r.setting, r.label, r.seed) for r in picked.runs] == [("a05", "proto", 1)]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"algorithms": [{"name": "local", "overrides": {"data.partition.alpha": 0.1}}]},
            "different partition",
        ),
        ({"algorithms": [{"name": "local"}, {"name": "local"}]}, "unique label"),
        ({"algorithms": [{"name": "fedavg"}]}, "one architecture"),
        ({"algorithms": [{"name": "lcoal"}]}, "did you mean 'local'"),
        ({"seeds": "0"}, "seeds must be"),
        ({"sedes": [0]}, "unknown suite key"),
    ],
)
def test_bad_suites_name_the_problem(tmp_path, change, needle):
    with pytest.raises(UserError, match=needle):
        load_suite(write_suite(tmp_path, **change))


def test_cli_seed_override_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="seeds="):
        load_suite(write_suite(tmp_path), ["seed=3"])


def test_a_finished_runs_non_finite_metric_is_a_nan_in_its_row(tmp_path):
    # summary.json stores NaN as null; a suite rerun over that finished run builds its row from it
    run = load_suite(write_suite(tmp_path), ["engine.rounds=1"]).runs[0]
    final = {"round": 1, "personal/acc": 0.5, "personal/loss": None}
    row = run_row(run, tmp_path, 1.0, "FINISHED", final, 1)
    assert row["personal/acc"] == 0.5 and np.isnan(row["personal/loss"]) and "round" not in row


def test_aggregate_golden():
    rows = [
        {"setting": "", "label": "a", "algorithm": "local", "seed": 0, "personal/acc": 0.5},
        {"setting": "", "label": "a", "algorithm": "local", "seed": 1, "personal/acc": 0.7},
        {"setting": "", "label": "b", "algorithm": "fd", "seed": 0, "personal/acc": 0.9},
    ]
    out = {r["label"]: r for r in aggregate(rows)}
    assert out["a"]["personal/acc [mean]"] == pytest.approx(0.6)
    assert out["a"]["personal/acc [std]"] == pytest.approx(np.std([0.5, 0.7], ddof=1))
    assert out["b"]["personal/acc [std]"] is None and out["b"]["seeds"] == 1
    curves, spread = curves_and_spread(
        {"a": [[{"round": 1, "x": 0.2}, {"round": 2, "x": 0.4}], [{"round": 1, "x": 0.4}]]}, "x"
    )
    assert curves == {"a": [(1, pytest.approx(0.3)), (2, pytest.approx(0.4))]}
    assert spread == {"a": [(1, pytest.approx(np.std([0.2, 0.4], ddof=1)))]}


@pytest.mark.slow
def test_run_suite_writes_tables_and_mlflow_parent_and_children(tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    uri = mlflow_uri
    path = write_suite(tmp_path)
    out = tmp_path / "out"
    table = run_suite(
        path, ["tracking.backend=mlflow", f"tracking.uri={uri}"], out=out, progress=False
    )
    assert "suite tiny: 4 runs" in table and "proto" in table and "±" in table
    assert "evaluation protocol: deployed (every client, after the server step" in table
    assert "personalized accuracy per architecture group" in table

    results = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["label"] for r in results] == ["local", "proto"]
    runs = pq.read_table(out / "runs.parquet").to_pylist()
    for r in results:
        # each aggregate is the mean / sample std (ddof=1) of that label's two seeds' runs
        mine = [run for run in runs if run["label"] == r["label"]]
        acc = np.array([run["personal/acc"] for run in mine])
        mb = np.array([run["comm/mb_per_round"] for run in mine])
        assert r["seeds"] == 2 == len(mine)
        assert r["personal/acc [mean]"] == pytest.approx(acc.mean())
        assert r["personal/acc [std]"] == pytest.approx(acc.std(ddof=1))
        assert r["comm/mb_per_round [mean]"] == pytest.approx(mb.mean())
    assert results[0]["comm/mb_per_round [mean]"] == 0.0  # local shares nothing
    assert results[1]["comm/mb_per_round [mean]"] > 0.0
    header = (out / "results.csv").read_text().splitlines()[0]
    assert '"personal/acc [mean]"' in header and '"personal/acc [std]"' in header
    assert "_mean_mean" not in header and "_mean_std" not in header
    assert sorted((r["label"], r["seed"]) for r in runs) == [
        ("local", 0),
        ("local", 1),
        ("proto", 0),
        ("proto", 1),
    ]
    assert (out / "curves_personal_acc.png").stat().st_size > 0

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("suite_test")
    found = client.search_runs([experiment.experiment_id])
    parents = [r for r in found if r.info.run_name == "suite-tiny"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == [
        "local-s0",
        "local-s1",
        "proto-s0",
        "proto-s1",
    ]
    assert all(r.info.status == "FINISHED" for r in [parent, *children])
    assert {r["mlflow_run_id"] for r in runs} == {r.info.run_id for r in children}
    assert "proto/personal/acc" in parent.data.metrics

    # the same command again reuses every finished run; a changed setting that moves numbers is
    # refused, naming it, instead of reusing runs made with the old value
    tracking = ["tracking.backend=mlflow", f"tracking.uri={uri}"]
    again = run_suite(path, tracking, out=out, progress=False)
    assert "suite tiny: 4 runs" in again
    reused = pq.read_table(out / "runs.parquet").to_pylist()
    assert [(r["label"], r["seed"], r["personal/acc"]) for r in reused] == [
        (r["label"], r["seed"], r["personal/acc"]) for r in runs
    ]
    with pytest.raises(
        UserError, match=r"finished with train\.lr=0\.05, but the suite now gives 0\.5"
    ):
        run_suite(path, [*tracking, "train.lr=0.5"], out=out, progress=False)


@pytest.mark.slow
def test_algorithms_of_a_suite_share_the_partition(tmp_path):
    out = tmp_path / "out"
    run_suite(write_suite(tmp_path, seeds=[3]), ["engine.rounds=1"], out=out, progress=False)
    a = pq.read_table(out / "local" / "seed3" / "partition.parquet")
    b = pq.read_table(out / "proto" / "seed3" / "partition.parquet")
    assert a.num_rows > 0 and a.equals(b)


@pytest.mark.parametrize(
    ("name", "runs"),
    [
        ("suites/pfedes_paper_fmnist.yaml", 27),
        ("suites/seed3_fmnist.yaml", None),
        ("suites/pfedes_vs_baselines_fmnist.yaml", 78),
        ("suites/fedfd_fmnist.yaml", 9),
        ("suites/fedfd_cpu_fmnist.yaml", 18),
        ("suites/feature_shift_fmnist.yaml", 21),
        ("suites/devices_fmnist.yaml", 18),
        ("suites/personalization_fmnist.yaml", 60),
        ("paper/pfedes_cifar10.yaml", None),
        ("paper/pfedes_cifar100.yaml", None),
    ],
)
def test_shipped_suites_load(name, runs):
    import rayfl.algorithms.fd
    import rayfl.algorithms.fedfd
    import rayfl.algorithms.fedgh
    import rayfl.algorithms.fedkd
    import rayfl.algorithms.fedmd
    import rayfl.algorithms.fedtgp
    import rayfl.algorithms.fml
    import rayfl.algorithms.heterofl
    import rayfl.algorithms.lg_fedavg  # noqa: F401

    suite = load_suite(ROOT / "experiments" / name)
    assert suite.runs
    if runs is not None:
        assert len(suite.runs) == runs
    # the same partition for every algorithm of a setting and seed
    data = {}
    for run in suite.runs:
        data.setdefault((run.setting, run.seed), set()).add(repr(run.config.data))
    assert all(len(v) == 1 for v in data.values())


def test_the_table_names_the_evaluation_protocol(tmp_path):
    from rayfl.compare.results import format_results

    path = write_suite(tmp_path)
    suite = load_suite(path, ["eval.protocol=after_fit"])
    table = format_results(suite, [], 1.0)
    assert "evaluation protocol: after_fit (the round's participants" in table

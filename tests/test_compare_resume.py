"""An interrupted suite resumes under the same MLflow parent run: every child ends FINISHED, a
resumed child continues its own MLflow run, and a run restarted from round 1 replaces its partial
run, so the parent holds exactly one child per run."""

from __future__ import annotations

import pytest

from tests.test_compare import compare_cli, write_suite

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray

NAMES = ["local-s0", "local-s1", "proto-s0", "proto-s1"]


def suite_runs(uri):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("suite_test")
    found = client.search_runs([experiment.experiment_id])
    parents = [r for r in found if r.info.run_name == "suite-tiny"]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    return parents, children


@pytest.mark.parametrize("checkpoint_every", [1, 0])
def test_interrupted_suite_resumes_into_one_parent_with_every_child_finished(
    tmp_path, checkpoint_every, mlflow_uri
):
    uri = mlflow_uri
    path = write_suite(tmp_path)
    over = [
        "tracking.backend=mlflow",
        f"tracking.uri={uri}",
        f"engine.checkpoint_every={checkpoint_every}",
    ]
    out = tmp_path / "out"
    got = compare_cli(path, out, *over, SUITE_FAULTS_SIGINT="proto-s0:1")  # Ctrl-C in round 1
    assert got.returncode == 130, got.stderr[-2000:]
    assert f"resume with: rayfl compare {path}" in got.stderr and f"--out {out}" in got.stderr
    parents, children = suite_runs(uri)
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    first = {r.info.run_name: r for r in children}
    assert sorted(first) == ["local-s0", "local-s1", "proto-s0"]  # proto-s1 never started
    assert first["proto-s0"].info.status == "KILLED"
    assert {first[n].info.status for n in ("local-s0", "local-s1")} == {"FINISHED"}

    got = compare_cli(path, out, *over)
    assert got.returncode == 0, got.stderr[-2000:]
    parents, children = suite_runs(uri)
    assert (
        len(parents) == 1
        and parents[0].info.run_id == first["local-s0"].data.tags["mlflow.parentRunId"]
    )
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert sorted(r.info.run_name for r in children) == NAMES  # one child per run
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {r.info.status for r in children} == {"FINISHED"}
    again = {r.info.run_name: r for r in children}
    resumed = again["proto-s0"]
    if checkpoint_every:  # resumed from its checkpoint: the same MLflow run, continued
        assert resumed.info.run_id == first["proto-s0"].info.run_id
        assert resumed.data.tags["rayfl.resumes"] == "1"
    else:  # no checkpoint: started again, its partial run replaced
        assert resumed.info.run_id != first["proto-s0"].info.run_id
    for name in ("local-s0", "local-s1"):  # finished runs were skipped, not rerun
        assert again[name].info.run_id == first[name].info.run_id

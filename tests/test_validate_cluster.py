"""`rayfl validate` makes every resource check that needs no Ray, so that `rayfl run` never stops
on one after Ray started: against a cluster launcher file at its maximum size
(`--cluster`), against `engine.ray_num_cpus`, and, for a local run, against this machine (a GPU
asked of a machine without one: a warning from validate, a refusal from run before Ray starts).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from rayfl import resources
from rayfl.cli import main

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"
# the shipped experiments that ask for GPUs (suites included)
GPU_EXPERIMENTS = sorted(
    str(p.relative_to(ROOT))
    for p in (ROOT / "experiments").rglob("*.yaml")
    if "num_gpus: 0." in p.read_text() or "num_gpus: 1" in p.read_text()
)


@pytest.fixture
def no_ray(monkeypatch) -> list[str]:
    """Fail a test that starts Ray (the session's shared Ray may be up already)."""
    from rayfl.engine import startup

    starts: list[str] = []

    def refuse(*args: object, **kwargs: object) -> Any:
        starts.append("ray")
        raise AssertionError("Ray was started")

    monkeypatch.setattr(startup, "init_ray", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `rayfl` process
    return starts


@pytest.fixture
def no_gpu(monkeypatch) -> None:
    """This machine as a GPU-less one, whatever the test machine has."""
    monkeypatch.setattr(resources, "local_gpus", lambda: 0)


def _config(tmp_path: Path, synthetic_raw: dict[str, Any], **engine: Any) -> str:
    raw = copy.deepcopy(synthetic_raw)
    raw["engine"].update({"executor": "ray", **engine})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _cluster(tmp_path: Path, head: dict[str, int], worker: dict[str, int], n: int = 4) -> str:
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    nodes = config["available_node_types"]
    nodes["ray.head.cpu"]["resources"] = head
    nodes["ray.worker.gpu"].update(resources=worker, max_workers=n)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


LOCAL_NOTE = "personal accuracy equals algorithm.name=local"  # an algorithm's note, not placement


def _placement_lines(text: str) -> list[str]:
    """validate's output lines without the algorithms' own notes (`Params.notes`)."""
    return [line for line in text.strip().splitlines() if LOCAL_NOTE not in line]


def _refused(capsys, argv: list[str]) -> str:
    code = main(argv)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, out
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    assert lines[0].startswith("rayfl: error: ")
    return lines[0]


# ----------------------------------------------------------------------------- --cluster


def test_a_gpu_worker_is_refused_on_a_cpu_only_cluster(tmp_path, synthetic_raw, capsys, no_ray):
    cfg = _config(tmp_path, synthetic_raw, worker_resources={"num_cpus": 1, "num_gpus": 1})
    cluster = _cluster(tmp_path, {"CPU": 8, "GPU": 0}, {"CPU": 4, "GPU": 0})
    line = _refused(capsys, ["validate", cfg, "--cluster", cluster])
    assert "engine.worker_resources asks for 1 CPU / 1 GPU per worker" in line
    assert "no node type of" in line and "can never be placed" in line
    assert "4 x ray.worker.gpu (4 CPU, 0 GPU)" in line
    assert not no_ray


def test_a_worker_larger_than_every_node_is_refused(tmp_path, synthetic_raw, capsys, no_ray):
    cfg = _config(tmp_path, synthetic_raw, worker_resources={"num_cpus": 8, "num_gpus": 0})
    cluster = _cluster(tmp_path, {"CPU": 4, "GPU": 0}, {"CPU": 4, "GPU": 1})
    line = _refused(capsys, ["validate", cfg, "--cluster", cluster])
    assert "asks for 8 CPU / 0 GPU per worker" in line and "can never be placed" in line
    assert not no_ray


def test_a_server_no_node_can_hold_is_refused(tmp_path, synthetic_raw, capsys, no_ray):
    cfg = _config(tmp_path, synthetic_raw, server_resources={"num_cpus": 1, "num_gpus": 2})
    line = _refused(capsys, ["validate", cfg, "--cluster", str(CLUSTER_YAML)])
    assert "engine.server_resources asks for 1 CPU / 2 GPU per server" in line
    assert not no_ray


def test_pinned_workers_beyond_the_cluster_at_its_maximum_size_are_refused(
    tmp_path, synthetic_raw, capsys, no_ray
):
    # shipped cluster at its maximum: head 8 CPU + 8 GPU nodes of 4 CPU / 1 GPU = 40 CPU / 8 GPU;
    # a quarter GPU each: 32 workers fit, 33 do not
    worker = {"num_cpus": 1, "num_gpus": 0.25}
    fits = _config(tmp_path, synthetic_raw, worker_resources=worker, num_workers=32)
    assert main(["validate", fits, "--cluster", str(CLUSTER_YAML)]) == 0
    capsys.readouterr()
    cfg = _config(tmp_path, synthetic_raw, worker_resources=worker, num_workers=33)
    line = _refused(capsys, ["validate", cfg, "--cluster", str(CLUSTER_YAML)])
    assert "engine.num_workers=33 workers need more than" in line
    assert "40 CPU / 8 GPU (room for 32)" in line
    assert not no_ray


def test_a_fractional_gpu_config_fits_a_gpu_cluster(tmp_path, synthetic_raw, capsys, no_ray):
    cfg = _config(tmp_path, synthetic_raw, worker_resources={"num_cpus": 1, "num_gpus": 0.25})
    assert main(["validate", cfg, "--cluster", str(CLUSTER_YAML)]) == 0
    out = capsys.readouterr()
    assert f"fits {CLUSTER_YAML} at its maximum size" in out.out
    assert "warning" not in "\n".join(_placement_lines(out.out)) and not out.err
    assert not no_ray


def test_the_shipped_gpu_experiments_fit_the_shipped_cluster(capsys, no_ray, no_gpu):
    assert GPU_EXPERIMENTS  # the paper's suites and configs take GPU shares
    assert main(["validate", *GPU_EXPERIMENTS, "--cluster", str(CLUSTER_YAML)]) == 0
    out = _placement_lines(capsys.readouterr().out)
    assert len(out) == len(GPU_EXPERIMENTS)
    assert all(": ok (" in line and "at its maximum size" in line for line in out)
    assert not no_ray


def test_the_cluster_size_caps_worker_nodes_at_the_files_max_workers():
    from rayfl.clusterconfig import cluster_size

    config = yaml.safe_load(CLUSTER_YAML.read_text())
    config["max_workers"] = 3
    config["available_node_types"]["ray.worker.big"] = {
        "min_workers": 0,
        "max_workers": 2,
        "resources": {"CPU": 16},
        "node_config": {},
    }
    size = cluster_size(config, "c.yaml")
    # CPUs: the 2 big nodes first, then 1 GPU node; GPUs: 3 GPU nodes
    assert size.total() == {"CPU": 8 + 2 * 16 + 4, "GPU": 3.0}
    assert "GPU of ray.head.cpu" in size.describe() and "GPU of ray.worker.big" in size.describe()


def test_the_shipped_cluster_size():
    from rayfl.clusterconfig import cluster_size, validate_cluster_config

    size = cluster_size(validate_cluster_config(CLUSTER_YAML), CLUSTER_YAML)
    assert size.total() == {"CPU": 40.0, "GPU": 8.0}
    assert [(n.name, n.count) for n in size.nodes] == [("ray.head.cpu", 1), ("ray.worker.gpu", 8)]


# ----------------------------------------------------------------------------- no cluster


def test_the_shipped_gpu_experiments_validate_here_with_a_warning(capsys, no_ray, no_gpu):
    assert main(["validate", *GPU_EXPERIMENTS]) == 0
    lines = _placement_lines(capsys.readouterr().out)
    warnings = [line for line in lines if ": warning: " in line]
    assert len(warnings) == len(GPU_EXPERIMENTS)  # one per file, not one per run of a suite
    assert all("this machine has no GPU" in w and "--cluster" in w for w in warnings)
    assert not no_ray


def test_ray_num_cpus_below_one_worker_is_refused(tmp_path, synthetic_raw, capsys, no_ray):
    cfg = _config(tmp_path, synthetic_raw, ray_num_cpus=2, worker_resources={"num_cpus": 3})
    line = _refused(capsys, ["validate", cfg])
    assert "engine.worker_resources asks for 3.0 CPU" in line
    assert "engine.ray_num_cpus=2 (the private Ray's CPUs) has 2 CPU" in line
    assert "raise engine.ray_num_cpus" in line
    assert not no_ray


def test_ray_num_cpus_without_room_for_a_worker_beside_the_server_is_refused(
    tmp_path, synthetic_raw, capsys, no_ray
):
    cfg = _config(
        tmp_path,
        synthetic_raw,
        ray_num_cpus=2,
        worker_resources={"num_cpus": 1},
        server_resources={"num_cpus": 2},
    )
    line = _refused(capsys, ["validate", cfg])
    assert "per worker but engine.ray_num_cpus=2" in line and "server takes 2 / 0" in line
    assert not no_ray


def test_run_refuses_a_local_gpu_ask_without_a_gpu_before_ray_starts(
    tmp_path, synthetic_raw, capsys, no_ray, no_gpu
):
    cfg = _config(tmp_path, synthetic_raw, worker_resources={"num_cpus": 1, "num_gpus": 1})
    line = _refused(capsys, ["run", cfg, "--out", str(tmp_path / "run"), "--no-progress"])
    assert "this machine has no GPU" in line and "--cluster" in line
    assert not no_ray and not (tmp_path / "run").exists()


def test_a_joined_cluster_is_not_judged_by_this_machine(tmp_path, synthetic_raw, capsys, no_gpu):
    cfg = _config(
        tmp_path,
        synthetic_raw,
        address="ray://head:10001",
        worker_resources={"num_cpus": 1, "num_gpus": 1},
    )
    assert main(["validate", cfg]) == 0
    assert "warning" not in "\n".join(_placement_lines(capsys.readouterr().out))


@pytest.mark.slow
def test_a_resume_refuses_a_local_gpu_ask_without_a_gpu_before_ray_starts(
    tmp_path, synthetic_raw, capsys, no_gpu
):
    from rayfl.config import build_config
    from rayfl.engine import startup
    from rayfl.launch import simulate

    raw = copy.deepcopy(synthetic_raw)
    raw["engine"].update({"checkpoint_every": 1, "rounds": 2})
    run_dir = tmp_path / "run"
    simulate(build_config(raw), run_dir, progress=False)
    # placement only, from the command line: the checkpoint still matches
    placement = ["engine.executor=ray", "engine.worker_resources.num_gpus=0.5"]
    starts: list[str] = []

    def refuse(*args: object, **kwargs: object) -> Any:
        starts.append("ray")
        raise AssertionError("Ray was started")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(startup, "init_ray", refuse)
        patch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `rayfl` process
        line = _refused(capsys, ["run", "--resume", str(run_dir), *placement, "--no-progress"])
    assert "this machine has no GPU" in line and not starts


def test_the_python_api_refuses_a_local_gpu_ask_without_a_gpu_before_ray_starts(
    tmp_path, synthetic_raw, monkeypatch, no_ray, no_gpu
):
    import ray

    import rayfl

    # a process without a Ray of its own (the test session's may be up): the run would start one
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    cfg = _config(tmp_path, synthetic_raw, worker_resources={"num_cpus": 1, "num_gpus": 1})
    with pytest.raises(rayfl.UserError, match="this machine has no GPU"):
        rayfl.run(cfg, out=str(tmp_path / "run"))
    assert not no_ray


def test_a_per_architecture_gpu_pool_is_refused_on_a_cpu_only_cluster(
    tmp_path, synthetic_raw, capsys, no_ray
):
    cfg = _config(tmp_path, synthetic_raw, resources_by_arch={"tiny_a": {"num_gpus": 0.5}})
    cluster = _cluster(tmp_path, {"CPU": 8, "GPU": 0}, {"CPU": 4, "GPU": 0})
    line = _refused(capsys, ["validate", cfg, "--cluster", cluster])
    assert "engine.resources_by_arch.tiny_a asks for 1 CPU / 0.5 GPU per worker" in line
    assert "can never be placed" in line
    gpus = _cluster(tmp_path, {"CPU": 8, "GPU": 0}, {"CPU": 4, "GPU": 1})
    assert main(["validate", cfg, "--cluster", gpus]) == 0
    assert not no_ray


def test_a_trial_reserves_a_bundle_per_pool():
    from rayfl.config import build_config
    from rayfl.tune.trial import trial_bundles

    raw = {
        "algorithm": {"name": "local"},
        "model": {"family": "tiny2"},
        "data": {"dataset": "synthetic", "num_clients": 6},
        "engine": {"resources_by_arch": {"tiny_a": {"num_cpus": 0.5, "num_gpus": 0.5}}},
    }
    assert trial_bundles(build_config(raw), 0.5) == [
        {"CPU": 0.5},
        {"CPU": 0.5, "GPU": 0.5},
        {"CPU": 1.0},
    ]

"""experiments/paper/fedfd_cifar10_a1_gpu.yaml, the FedFD paper comparison packed on one GPU: on
the CPU with the test session's one logical GPU and tiny synthetic data, its three runs start
side by side as fractional-GPU placement groups, finish, and report the server model. It checks
the packing and the plumbing; it measures nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a suite of Ray-executor runs

SUITE = Path(__file__).resolve().parents[1] / "experiments" / "paper" / "fedfd_cifar10_a1_gpu.yaml"


def tiny_copy(tmp_path: Path) -> Path:
    """The shipped suite over a tiny version of its base: the same algorithms, setting,
    resources and parallelism; synthetic CIFAR-shaped data, one short round, on the CPU."""
    suite = yaml.safe_load(SUITE.read_text())
    base = yaml.safe_load((SUITE.parent / suite["base_file"]).read_text())
    base["data"].update(
        dataset="synthetic",
        options={"num_samples": 240, "num_test": 40, "shape": [3, 16, 16]},
        num_clients=5,
        public_fraction=0.2,
    )
    base["algorithm"]["steps"] = 2
    base["train"]["local_epochs"] = 1
    base["engine"].update(rounds=1, device="cpu", eval_every=1, checkpoint_every=0)
    base["tracking"] = {"backend": "none"}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    # the test session's cluster has 2 CPUs where a GPU machine has many: CPUs shrink, GPUs stay
    for key, cpus in (("engine.worker_resources", 0.2), ("engine.server_resources", 0.1)):
        suite["settings"][0]["overrides"][key]["num_cpus"] = cpus
    suite.update(base_file="base.yaml", seeds=[0])
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def test_the_paper_suite_packs_three_fractional_gpu_runs(ray_local, tmp_path):
    import ray

    import rayfl

    assert ray.cluster_resources().get("GPU") == 1  # the session's logical GPU
    shipped = yaml.safe_load(SUITE.read_text())
    assert shipped["parallel"] == 3
    result = rayfl.suite(tiny_copy(tmp_path), out=tmp_path / "out", progress=False)
    rows = {r["label"]: r for r in result.runs}
    assert set(rows) == {"fedfd", "fedgd_logit", "heterofl"}
    for label, row in rows.items():
        assert row["status"] == "FINISHED", (label, row)
        assert 0.0 <= row["global/acc"] <= 1.0
        cfg = yaml.safe_load(
            (tmp_path / "out" / "a1" / label / "seed0" / "config.yaml").read_text()
        )
        # each run holds at most a third of the GPU: its server's 0.1 and 0.05 per worker
        e = cfg["engine"]
        assert e["server_resources"]["num_gpus"] == 0.1
        assert e["worker_resources"]["num_gpus"] == 0.05
        assert 0.1 + 0.05 * e["num_workers"] <= 1 / 3

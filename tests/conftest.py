"""Shared fixtures: one local Ray per test session (with one logical GPU for placement tests)."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("MLFLOW_TRACKING_URI", "")  # tests pass their own URIs
# a key of the session's own (rayfl.gate): children and Ray workers inherit it
os.environ.setdefault("RAYFL_KEY_FILE", os.path.join(tempfile.mkdtemp(prefix="rayfl-key-"), "key"))


@pytest.fixture(scope="session")
def ray_local():
    """A private local Ray: 2 CPUs and one *logical* GPU (never touched through CUDA)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=1,
            include_dashboard=False,
            configure_logging=False,
        )
    yield ray
    if ray.is_initialized():
        ray.shutdown()


def pytest_collection_modifyitems(config, items):
    # Tests that start their own multi-node cluster must not overlap the session's Ray: run them last.
    items.sort(key=lambda item: "multinode" in item.nodeid)


SYNTHETIC = {
    "name": "test",
    "seed": 0,
    "data": {
        "dataset": "synthetic",
        "num_clients": 6,
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 10},
        "options": {"num_samples": 600, "num_test": 200, "shape": [1, 8, 8]},
    },
    "model": {"family": "tiny2"},
    "algorithm": {"name": "pfedes", "T": 2.0, "alpha": 0.5},
    "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
    "engine": {"rounds": 2, "executor": "serial", "checkpoint_every": 0},
    "tracking": {"backend": "none"},
}


@pytest.fixture
def synthetic_raw():
    """A small, fast run config (dict) on synthetic 8x8 data with two tiny architectures."""
    import copy

    return copy.deepcopy(SYNTHETIC)

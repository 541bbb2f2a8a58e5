"""Shared fixtures (one local Ray per test process, with one logical GPU for placement tests;
under pytest-xdist each worker has its own) and the test markers' rules.

Markers (help in pyproject.toml): `slow` marks every test that starts Ray, a subprocess or an
end-to-end run, so `python3 -m pytest -q -m "not slow"` is the developer's fast loop while
the README's `python3 -m pytest -q -n 2 --dist loadfile` (CI) runs everything but the long
`experiment` and the `gpu` tests. A test that uses the `ray_local` fixture or is marked `ray`
or `experiment` is marked `slow` here; a test not marked `slow` that starts a Python
subprocess, Ray or a whole run fails, naming the marker.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from rayfl.seeding import PORTABLE_CPU_ENV

# Golden and exact-equality tests need the same float arithmetic on every CI machine; set before
# any tensor operation, inherited by Ray workers and subprocesses.
for _key, _value in PORTABLE_CPU_ENV.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("MLFLOW_TRACKING_URI", "")  # tests pass their own URIs
# a key of the session's own (rayfl.gate): children and Ray workers inherit it; the process that
# made its folder (xdist's controller, or a plain run) removes it at the end
_KEY_DIR = None
if "RAYFL_KEY_FILE" not in os.environ:
    _KEY_DIR = tempfile.mkdtemp(prefix="rayfl-key-")
    os.environ["RAYFL_KEY_FILE"] = os.path.join(_KEY_DIR, "key")


@pytest.fixture
def ray_local():
    """A private local Ray: 2 CPUs and one *logical* GPU (never touched through CUDA), started by
    the first test that asks for it and kept for the session (a test that joined a cluster of
    its own and disconnected gets a new one); stopped when the session ends."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=1,
            include_dashboard=False,
            configure_logging=False,
        )
    return ray


def pytest_sessionfinish(session, exitstatus):
    ray = sys.modules.get("ray")  # only if a test imported it
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if _KEY_DIR is not None:
        shutil.rmtree(_KEY_DIR, ignore_errors=True)


SLOW_FIXTURES = {"ray_local"}


def pytest_itemcollected(item):
    if (
        item.get_closest_marker("ray")
        or item.get_closest_marker("experiment")
        or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
    ):
        item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config, items):
    # `experiment` and `gpu` run only when asked for by name (-m experiment, -m gpu), and `gpu`
    # only where CUDA is. Decided here: a command line's own -m would replace addopts' -m.
    for marker in ("experiment", "gpu"):
        if marker not in (config.option.markexpr or ""):
            drop = [item for item in items if item.get_closest_marker(marker)]
            if drop:
                config.hook.pytest_deselected(items=drop)
                items[:] = [item for item in items if not item.get_closest_marker(marker)]
    if any(item.get_closest_marker("gpu") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device")
            for item in items:
                if item.get_closest_marker("gpu"):
                    item.add_marker(skip)
    # Files go to pytest-xdist's workers in this order (--dist loadfile): the longest first, so
    # that the quick ones fill the end: files with slow tests, the end-to-end ones at the top of
    # tests/ before the packages'; last the multi-node files, whose tests leave the process's
    # Ray for a cluster of their own.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    top = os.path.dirname(__file__)
    items.sort(
        key=lambda item: (
            "multinode" in item.nodeid,
            item.path not in slow_files,
            str(item.path.parent) != top,
        )
    )


# What makes a test slow: another Python interpreter (a CLI run, a script) or Ray's daemons.
# Quick system tools that libraries call on import (ldconfig, uname, git) do not count.
SLOW_PROGRAMS = ("python", "rayfl", "ray", "gcs_server", "raylet")
# ... or a whole run (what `rayfl run`, compare, tune and `rayfl.run` do), seen as a run
# directory starting to be written; a run refused before it starts does not count.
RUN_START = ("rayfl.engine.callbacks", "RunDirectory", "on_run_start")


def _program(args) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    first = os.fsdecode(first)
    return os.path.basename(first.split()[0] if isinstance(args, str) and first else first)


@pytest.fixture(autouse=True)
def _processes_only_in_slow_tests(request, monkeypatch):
    """Keep the fast loop fast: a test not marked `slow` that starts Python, Ray or a whole run
    fails."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    started = []
    real_init = subprocess.Popen.__init__

    def recording_init(self, args, *a, **kw):
        if _program(args).startswith(SLOW_PROGRAMS):
            started.append(args)
        real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_init)
    module, cls_name, method = RUN_START
    cls = getattr(importlib.import_module(module), cls_name, None)
    real_start = getattr(cls, method, None)
    if real_start is not None:

        def recording_start(self, *a, **kw):
            started.append("a whole run")
            return real_start(self, *a, **kw)

        monkeypatch.setattr(cls, method, recording_start)
    yield
    if started:
        pytest.fail(
            f"starts {started[0]!r:.100}: mark it @pytest.mark.slow (or use the ray_local "
            "fixture) so that `pytest -m 'not slow'` stays fast",
            pytrace=False,
        )


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


@pytest.fixture(scope="session")
def _empty_mlflow_store(tmp_path_factory):
    """An MLflow SQLite store with MLflow's schema and nothing else, made once per process:
    a fresh file runs MLflow's schema migrations, several seconds each time."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow_store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_uri(tmp_path, _empty_mlflow_store):
    """`sqlite:///<tmp_path>/mlflow.db`: a new, empty MLflow store of this test."""
    import shutil

    db = tmp_path / "mlflow.db"
    shutil.copyfile(_empty_mlflow_store, db)
    return f"sqlite:///{db}"


@pytest.fixture
def victim(tmp_path):
    """A file beside the folder a test plants into; no rayfl command may read or change it."""
    from tests.security.plants import VICTIM

    path = tmp_path / "victim.json"
    path.write_bytes(VICTIM)
    return path

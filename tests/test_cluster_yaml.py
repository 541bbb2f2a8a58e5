"""The shipped cluster.yaml validates offline; broken copies fail with the problem's JSON path."""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from rayfl import clusterconfig
from rayfl.clusterconfig import (
    cluster_size,
    json_path,
    ray_schema_path,
    validate_cluster_config,
)
from rayfl.errors import ConfigError

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"
HEAD, WORKER = "ray.head.cpu", "ray.worker.gpu"


@pytest.fixture(scope="module")
def shipped() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_shipped_cluster_yaml_validates(shipped) -> None:
    validated = validate_cluster_config(CLUSTER_YAML)
    assert validated == shipped
    assert validated["head_node_type"] == HEAD


def test_cluster_validation_uses_no_private_ray_module() -> None:
    tree = ast.parse(Path(clusterconfig.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert imported and not [m for m in imported if m and "_private" in m]


def test_shipped_cluster_yaml_contents(shipped) -> None:
    # What would break a launch silently, not a restatement of the file:
    # the container's Ray must equal the Ray that launches and submits to it ...
    assert shipped["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-")
    # ... the package is installed where the file mounts put it ...
    mount = next(k for k, v in shipped["file_mounts"].items() if v == ".")
    assert any("pip install" in c and f"-e {mount}" in c for c in shipped["setup_commands"])
    # ... the head's Ray autoscales from the bootstrap config Ray writes, workers restart clean ...
    head_start = " ".join(shipped["head_start_ray_commands"])
    assert "ray start --head" in head_start
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert shipped["worker_start_ray_commands"][0] == "ray stop"
    # ... Ray's resource counts are integers it accepts ...
    for node in shipped["available_node_types"].values():
        assert all(type(v) is int and v >= 0 for v in node["resources"].values())
    # ... and the rayfl/data package is still synced while ./data (a cache) is not.
    assert "/data/" in shipped["rsync_exclude"] and "data/" not in shipped["rsync_exclude"]
    text = CLUSTER_YAML.read_text()
    for usage in ("ray up cluster.yaml", "ray submit", "ray job submit", "engine.address=auto"):
        assert usage in text


def test_shipped_cluster_yaml_is_hardened(shipped) -> None:
    """Dashboard and MLflow on the head's loopback only, token auth on every `ray start`, the
    token shipped to every node, and the exposure written down."""
    head_start = shipped["head_start_ray_commands"]
    (ray_head,) = [c for c in head_start if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in ray_head and "0.0.0.0" not in " ".join(head_start)
    (mlflow,) = [c for c in head_start if "mlflow server" in c]
    assert "--host 127.0.0.1" in mlflow
    for cmd in [ray_head, *[c for c in shipped["worker_start_ray_commands"] if "ray start" in c]]:
        assert "RAY_AUTH_MODE=token" in cmd.split("ray start")[0], cmd
    assert shipped["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    text = CLUSTER_YAML.read_text()
    assert "security group" in text and "ray get-auth-token --generate" in text
    assert "ray dashboard cluster.yaml" in text and "ray attach cluster.yaml -p 5000" in text


@pytest.mark.parametrize(
    "experiment",
    sorted(
        str(p.relative_to(CLUSTER_YAML.parent))
        for p in (CLUSTER_YAML.parent / "experiments").rglob("*.yaml")
        if "executor: ray" in p.read_text()
        and not {"suite", "sweep", "bench"} & set(yaml.safe_load(p.read_text()))
    ),
)
def test_the_shipped_ray_experiments_fit_the_shipped_cluster(
    shipped, experiment, monkeypatch
) -> None:
    from rayfl.config import clients_per_round, load_config
    from rayfl.engine import pool

    cfg = load_config(CLUSTER_YAML.parent / experiment)
    # the cluster scaled out to every node type's max_workers (head: 1)
    full = cluster_size(shipped, CLUSTER_YAML).total()
    monkeypatch.setattr(pool.ray, "cluster_resources", lambda: full)
    workers = pool.plan_workers(cfg.engine, clients_per_round(cfg))
    wanted = cfg.engine.num_workers or -(-clients_per_round(cfg) // cfg.engine.clients_per_call)
    assert workers == wanted, f"{experiment}: {workers} workers fit, {wanted} wanted"


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(config: dict[str, Any]) -> None:
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return mutate


def _delete(path: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(config: dict[str, Any]) -> None:
        node = config
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return mutate


MUTATIONS = {
    "typo_top_level_key": (
        lambda c: c.update(idle_timout_minutes=c.pop("idle_timeout_minutes")),
        ["$.idle_timout_minutes", "unknown key", "did you mean 'idle_timeout_minutes'"],
    ),
    "typo_in_node_type": (
        _set(("available_node_types", WORKER, "max_worker"), 4),
        [f'$.available_node_types["{WORKER}"].max_worker', "did you mean 'max_workers'"],
    ),
    "missing_provider_type": (
        _delete(("provider", "type")),
        ["$.provider.type", "required key is missing"],
    ),
    "unknown_provider_type": (
        _set(("provider", "type"), "awz"),
        ["$.provider.type", "'awz'", "did you mean 'aws'"],
    ),
    "fractional_gpu": (
        _set(("available_node_types", WORKER, "resources", "GPU"), 0.5),
        [f'$.available_node_types["{WORKER}"].resources.GPU', "integers", "0.5"],
    ),
    "float_that_looks_whole": (
        _set(("available_node_types", HEAD, "resources", "CPU"), 8.0),
        [f'$.available_node_types["{HEAD}"].resources.CPU', "integers", "8.0"],
    ),
    "head_type_missing": (
        _set(("head_node_type",), "ray.head.gpu"),
        ["$.head_node_type", "'ray.head.gpu'", "did you mean 'ray.head.cpu'"],
    ),
    "min_above_max": (
        _set(("available_node_types", WORKER, "min_workers"), 9),
        [f'$.available_node_types["{WORKER}"].min_workers', "min_workers=9", "max_workers=8"],
    ),
    "cluster_max_below_min_sum": (
        lambda c: (
            _set(("available_node_types", WORKER, "min_workers"), 3)(c),
            c.update(max_workers=2),
        ),
        ["$.max_workers", "sum", "min_workers (3)"],
    ),
    "docker_without_container_name": (  # the schema cannot say it; ray up refuses it
        _delete(("docker", "container_name")),
        ["container & image name"],
    ),
    "wrong_type": (
        _set(("setup_commands",), "pip install -e ~/rayfl"),
        ["$.setup_commands", "is not of type 'array'"],
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_broken_copies_fail_naming_the_problem(name, shipped, tmp_path) -> None:
    mutate, expected = MUTATIONS[name]
    config = copy.deepcopy(shipped)
    mutate(config)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        validate_cluster_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_unreadable_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        validate_cluster_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster_name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        validate_cluster_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        validate_cluster_config(listing)


def test_json_path_quotes_dotted_keys_and_indexes_lists() -> None:
    assert json_path([]) == "$"
    assert json_path(["provider", "type"]) == "$.provider.type"
    assert json_path(["available_node_types", "ray.head.cpu", "resources"]) == (
        '$.available_node_types["ray.head.cpu"].resources'
    )
    assert json_path(["setup_commands", 0]) == "$.setup_commands[0]"


def test_schema_is_the_one_shipped_with_ray() -> None:
    path = ray_schema_path()
    assert path.is_file() and path.parent.name == "autoscaler"
    assert Path(ray.__file__).parent in path.parents


def test_rayfl_validate_checks_a_cluster_file_as_one(tmp_path, shipped, capsys) -> None:
    from rayfl.cli import main

    assert main(["validate", str(CLUSTER_YAML)]) == 0
    out = capsys.readouterr().out
    assert f"ok (Ray cluster 'rayfl' on aws: head {HEAD}, workers {WORKER} (0-" in out
    broken = copy.deepcopy(shipped)
    broken["head_node_type"] = "ray.head.typo"
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(broken))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "$.head_node_type" in err and "algorithm" not in err  # not read as an experiment
    assert main(["run", str(CLUSTER_YAML)]) == 2
    assert "ray up" in capsys.readouterr().err

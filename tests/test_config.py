import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from rayfl.config import build_config, load_config, to_dict
from rayfl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_and_types(synthetic_raw):
    cfg = build_config(
        synthetic_raw,
        ["engine.rounds=5", "algorithm.alpha=0.3", "seed=1", "model.proportions=[0.5, 0.5]"],
    )
    assert cfg.engine.rounds == 5
    assert cfg.algorithm.params.alpha == 0.3
    assert cfg.seed == 1
    assert cfg.model.proportions == (0.5, 0.5)
    assert to_dict(cfg)["algorithm"]["name"] == "pfedes"


def test_config_is_frozen(synthetic_raw):
    cfg = build_config(synthetic_raw)
    with pytest.raises(AttributeError):
        cfg.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("engine.roundz=3", "unknown key engine.roundz (did you mean 'rounds'?)"),
        ("engine.rounds=abc", "engine.rounds: expected an integer"),
        ("algorithm.alpha=-1", "algorithm.alpha: must be >= 0"),
        ("engine.fraction=1.5", "engine.fraction: must be in (0, 1]"),
        ("engine.fraction=0", "engine.fraction: must be in (0, 1]"),
        (
            "engine.clients_per_round=50",
            "engine.clients_per_round: 50 sampled clients but only 6 exist",
        ),
        ("algorithm.name=pfedez", "unknown algorithm 'pfedez' (did you mean 'pfedes'?)"),
        ("algorithm.temperature=3", "unknown key algorithm.temperature"),
        ("engine.executor=dask", "engine.executor: 'dask' is not allowed"),
        ("data.dataset=cifar11", "unknown dataset 'cifar11'"),
        ("engine.worker_resources.num_gpus=1.5", "fractions above 1 must be whole numbers"),
        ("engine.server_in=maybe", "'maybe' is not allowed; choose one of auto, driver, actor"),
    ],
)
def test_bad_values_name_the_key(synthetic_raw, override, needle):
    with pytest.raises(ConfigError) as info:
        build_config(synthetic_raw, [override])
    assert needle in str(info.value)


def test_a_server_in_the_driver_cannot_reserve_resources(synthetic_raw):
    with pytest.raises(ConfigError) as info:
        build_config(
            synthetic_raw, ["engine.server_in=driver", "engine.server_resources.num_gpus=0.5"]
        )
    assert "engine.server_in: driver runs the server in the driver's process" in str(info.value)
    assert "engine.server_in=actor" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "in_driver"),
    [
        ([], True),  # a private local Ray, a server that reserves nothing
        (["engine.address=auto"], False),  # a joined cluster: the server goes where there is room
        (["engine.server_resources.num_cpus=1"], False),  # it asks for a reservation
        (["engine.server_resources.num_gpus=0.25"], False),
        (["engine.server_in=actor"], False),
        (["engine.server_in=driver", "engine.address=auto"], True),
    ],
)
def test_where_auto_runs_the_server(synthetic_raw, overrides, in_driver):
    from rayfl.config import server_in_driver

    assert server_in_driver(build_config(synthetic_raw, overrides).engine) is in_driver


@pytest.mark.parametrize("key", ["driver_trains", "lean_ray", "grouped"])
def test_removed_engine_settings_are_refused_with_one_line_saying_so(synthetic_raw, key):
    with pytest.raises(ConfigError) as info:
        build_config(synthetic_raw, [f"engine.{key}=true"])
    message = str(info.value)
    assert message.startswith(f"engine.{key} was removed: ") and "delete the key" in message
    assert "\n" not in message
    synthetic_raw["engine"][key] = True  # in the file, too
    with pytest.raises(ConfigError, match=f"engine.{key} was removed"):
        build_config(synthetic_raw)


def test_switching_algorithm_drops_the_files_other_settings(synthetic_raw):
    cfg = build_config(synthetic_raw, ["algorithm.name=local"])
    assert cfg.algorithm.name == "local"
    with pytest.raises(ConfigError, match="unknown key algorithm.alpha for algorithm 'local'"):
        build_config(synthetic_raw, ["algorithm.name=local", "algorithm.alpha=0.2"])


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["run", "experiments/pfedes_fmnist.yaml", "algorithm.alpha=-0.5"],
            "algorithm.alpha: must be >= 0",
        ),
        (
            ["run", "experiments/pfedes_fmnist.yaml", "model.family=seed4"],
            "unknown model family 'seed4'",
        ),
        (
            ["run", "experiments/pfedes_fmnist.yaml", "model.architectures=[cnn_small, cnn9]"],
            "cnn9",
        ),
        (
            ["run", "experiments/pfedes_fmnist.yaml", "algorithm.name=fedavg"],
            "needs one architecture",
        ),
        (
            ["validate", "experiments/pfedes_fmnist.yaml", "--set", "engine.fraction=2"],
            "engine.fraction",
        ),
    ],
)
def test_cli_errors_are_one_line_exit_2(args, needle):
    # The error is one line, and no Ray process outlives the command (a config error must stop
    # `rayfl run` before it starts Ray, or take down what it started).
    ray_tmp = tempfile.mkdtemp(prefix="rf", dir="/tmp")  # short: Ray's socket paths live there
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "rayfl.cli", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "RAY_TMPDIR": ray_tmp},
        )
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        deadline = time.monotonic() + 5
        while (left := _processes_mentioning(ray_tmp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == []
    finally:
        for leftover in _processes_mentioning(ray_tmp):
            leftover.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(text in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def test_every_shipped_yaml_validates():
    from rayfl.cli import validate_file

    files = sorted((ROOT / "experiments").rglob("*.yaml"))
    assert files
    for path in files:
        if path.name == "results_plan.yaml":  # experiments/results_plan.py's, not rayfl's
            continue
        assert validate_file(path)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["data.partition.min_samples=100000"], "data.partition.min_samples"),
        (
            ["data.partition.name=pathological", "data.partition.classes_per_client=50"],
            "data.partition.classes_per_client",
        ),
        (["engine.min_replies=7"], "engine.min_replies"),  # 6 clients
        (["data.options.num_samples=1e12"], "data.options.num_samples"),
        (["train.local_epochs=100000000"], "train.local_epochs"),
        (["engine.num_workers=1000000"], "engine.num_workers"),
    ],
)
def test_validate_refuses_what_run_would_refuse_only_after_starting(
    synthetic_raw, tmp_path, capsys, overrides, key
):
    """`rayfl validate` runs every check that needs no Ray and no data, in one line."""
    import yaml

    from rayfl import cli

    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(synthetic_raw))
    assert cli.main(["validate", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayfl: error: ") and key in err
    assert len(err.strip().splitlines()) == 1


def test_fmnist_partition_feasibility_is_known_without_the_data(synthetic_raw):
    raw = {**synthetic_raw, "data": {"dataset": "fmnist", "num_clients": 100}}
    build_config(raw, ["data.partition.min_samples=600"])  # 60,000 samples: exactly enough
    with pytest.raises(ConfigError, match="exceeds the 60000 training samples"):
        build_config(raw, ["data.partition.min_samples=601"])


@pytest.mark.parametrize(
    "text",
    [
        "a: &a [*a]\n",
        "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else '1'}]\n" for i in range(8)),
    ],
    ids=["recursive-alias", "billion-laughs"],
)
def test_validate_refuses_alias_bombs_in_one_line(tmp_path, capsys, text):
    from rayfl import cli

    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "alias" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "text",
    ["a: " + "[" * 20_000 + "]" * 20_000 + "\n", "".join("  " * i + "k:\n" for i in range(5_000))],
    ids=["flow", "block"],
)
def test_deep_yaml_is_refused_before_it_is_composed(tmp_path, capsys, text):
    from rayfl import cli

    path = tmp_path / "deep.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "nests deeper than 100 levels" in err and len(err.splitlines()) == 1, err
    # a deep override value is a string, which the key's type then refuses in one line
    with pytest.raises(ConfigError, match="engine.rounds: expected an integer"):
        build_config({"algorithm": {"name": "local"}}, ["engine.rounds=" + "[" * 5_000])


def test_yaml_within_the_depth_limit_loads():
    from rayfl.yamlfile import YAML_DEPTH, yaml_load

    assert yaml_load("[" * YAML_DEPTH + "]" * YAML_DEPTH) is not None


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("engine.rounds=1e300", "engine.rounds: expected an integer, got 1e+300"),
        ("engine.rounds=1000001", "engine.rounds: must be in [1, 1000000] (got 1000001)"),
        ("seed=100000000000000000000", "seed: must be below 2^63"),
        ("train.lr=.inf", "train.lr: must be a finite number"),
        ("name=../../x", "name: '../../x' is not a single name"),
        ("name=a/b", "name: 'a/b' is not a single name"),
        ("name=.hidden", "name: '.hidden' is not a single name"),
        ("name=''", "name: '' is not a single name"),
    ],
)
def test_bounds_refuse_in_one_line(synthetic_raw, override, needle):
    with pytest.raises(ConfigError) as info:
        build_config(synthetic_raw, [override])
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bounds_accept_what_they_should(synthetic_raw):
    cfg = build_config(synthetic_raw, ["engine.rounds=1000000", "name=my_run-2.v1", "seed=1e3"])
    assert (cfg.engine.rounds, cfg.name, cfg.seed) == (1_000_000, "my_run-2.v1", 1000)

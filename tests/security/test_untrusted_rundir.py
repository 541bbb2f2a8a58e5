"""A run directory is untrusted input (docs/security.md): malicious run directories, and each
command that reads one (`rayfl run --resume DIR`, `rayfl report DIR`, `rayfl ls-runs DIR`)
refuses them in one line with exit code 2, runs no code from them and touches nothing outside.

One real run (serial, synthetic data, 2 rounds, a checkpoint each round) is copied and changed per
case. Its config.yaml then names the Ray executor, so a resume that got as far as starting Ray
would call `startup.init_ray` (patched to fail: the session's shared Ray may be up already);
every refusal happens before.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from rayfl import cli
from rayfl.config import build_config
from rayfl.engine.checkpoint import config_hash
from tests.conftest import SYNTHETIC

VICTIM = b"precious data that no rayfl command may change\n"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    from rayfl.launch import simulate

    raw = json.loads(json.dumps(SYNTHETIC))
    raw["engine"].update({"checkpoint_every": 1, "rounds": 2})
    run_dir = tmp_path_factory.mktemp("base") / "run"
    simulate(build_config(raw), run_dir, progress=False)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["engine"]["executor"] = "ray"  # placement only: the checkpoint still matches
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


@pytest.fixture
def world(base_run, tmp_path):
    """A fresh copy of the run, a victim file beside it, and a marker no code may create."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir, symlinks=True)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    return run_dir, victim, tmp_path / "code-ran"


def _folder(run_dir: Path) -> Path:
    return run_dir / os.readlink(run_dir / "checkpoint")


def _manifest(run_dir: Path) -> dict:
    return json.loads((_folder(run_dir) / "manifest.json").read_text())


def _rewrite(run_dir: Path, name: str, data: bytes, **manifest_changes) -> None:
    """Replace checkpoint file `name` and make the manifest vouch for it (what an attacker
    who can write the directory can always do: a checksum is no signature)."""
    folder = _folder(run_dir)
    (folder / name).write_bytes(data)
    manifest = _manifest(run_dir)
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest.update(manifest_changes)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _link(path: Path, target: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(target)


class Evil:
    """Unpickling this runs a shell command: the marker file appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def pickle_in_cifar_folder(run_dir: Path, victim: Path, marker: Path) -> None:
    folder = run_dir / "cifar-10-batches-py"
    folder.mkdir()
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (folder / name).write_bytes(pickle.dumps(Evil(marker), protocol=2))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["data"].update({"dataset": "cifar10", "root": str(run_dir), "options": {}})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    # the attacker recomputes the config hash, so the checkpoint matches the changed config
    config["engine"]["executor"] = "serial"
    manifest = _manifest(run_dir)
    manifest["config_hash"] = config_hash(build_config(config))
    (_folder(run_dir) / "manifest.json").write_text(json.dumps(manifest))


def oversized_npz(run_dir: Path, victim: Path, marker: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        tree = io.BytesIO()
        np.lib.format.write_array(tree, np.frombuffer(b'{"a": "a0"}', np.uint8))
        z.writestr("__tree__.npy", tree.getvalue())
        big = io.BytesIO()
        header = {"descr": "<f8", "fortran_order": False, "shape": (2**28,)}  # 2 GiB
        np.lib.format.write_array_header_1_0(big, header)
        z.writestr("a0.npy", big.getvalue() + bytes(2 << 20))  # holds 2 MB
    _rewrite(run_dir, "server.npz", buf.getvalue())


def deep_json(run_dir: Path, victim: Path, marker: Path) -> None:
    deep = "[" * 200_000 + "]" * 200_000
    (run_dir / "summary.json").write_text(deep)
    (_folder(run_dir) / "manifest.json").write_text(deep)


def round_inf(run_dir: Path, victim: Path, marker: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["rounds"] = "inf"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    manifest = _manifest(run_dir)
    manifest["round"] = "inf"
    (_folder(run_dir) / "manifest.json").write_text(json.dumps(manifest))


def fifo_summary(run_dir: Path, victim: Path, marker: Path) -> None:
    (run_dir / "summary.json").unlink()
    os.mkfifo(run_dir / "summary.json")


def fifo_manifest(run_dir: Path, victim: Path, marker: Path) -> None:
    (_folder(run_dir) / "manifest.json").unlink()
    os.mkfifo(_folder(run_dir) / "manifest.json")


def linked(name: str, to_victim: bool = True) -> Callable[[Path, Path, Path], None]:
    def change(run_dir: Path, victim: Path, marker: Path) -> None:
        _link(run_dir / name, victim)

    change.__name__ = f"symlink_{name}"
    return change


def manifest_to_dev_zero(run_dir: Path, victim: Path, marker: Path) -> None:
    _link(_folder(run_dir) / "manifest.json", Path("/dev/zero"))


def checkpoint_folder_elsewhere(run_dir: Path, victim: Path, marker: Path) -> None:
    folder = _folder(run_dir)
    other = victim.parent / "other-run"
    shutil.copytree(folder, other)
    _link(folder, other)


def client_npz_elsewhere(run_dir: Path, victim: Path, marker: Path) -> None:
    other = victim.parent / "other-client.npz"
    client = sorted((_folder(run_dir) / "clients").iterdir())[0]
    shutil.copy(client, other)
    _link(client, other)


# (case, whether `report` and `ls-runs` read what it changed: else they must just succeed)
CASES = [
    (pickle_in_cifar_folder, False),
    (linked(".lock"), True),
    (linked("partition.parquet"), True),
    (linked("class_counts.parquet"), True),
    (linked("learning_curves.png"), True),
    (linked("label_distribution.png"), True),
    (linked("report.html"), True),
    (linked("config.yaml"), True),
    (linked("metrics.parquet"), True),
    (linked("summary.json"), True),
    (linked("mlflow_run.json"), True),
    (checkpoint_folder_elsewhere, True),
    (client_npz_elsewhere, True),
    (manifest_to_dev_zero, True),
    (fifo_summary, True),
    (fifo_manifest, True),
    (oversized_npz, False),
    (deep_json, True),
    (round_inf, True),
]


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every regular file under `root` outside the run directory (FIFOs skipped)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if "run" in path.relative_to(root).parts[:1] or path.is_symlink() or not path.is_file():
            continue
        out[str(path)] = path.read_bytes()
    return out


@pytest.mark.parametrize("case,all_refuse", CASES, ids=[c.__name__ for c, _ in CASES])
@pytest.mark.parametrize("command", ["resume", "report", "ls-runs"])
def test_every_command_refuses_a_malicious_run_directory_in_one_line(
    world, case, all_refuse, command, capsys, monkeypatch
):
    from rayfl.engine import startup

    ray_starts: list[str] = []  # (the test session's shared Ray may already be up)

    def no_ray(*args: object, **kwargs: object) -> bool:
        ray_starts.append(command)
        raise AssertionError("the command reached Ray's start")

    monkeypatch.setattr(startup, "init_ray", no_ray)
    run_dir, victim, marker = world
    case(run_dir, victim, marker)
    outside = _snapshot(victim.parent)
    argv = {
        "resume": ["run", "--resume", str(run_dir), "--no-progress"],
        "report": ["report", str(run_dir)],
        "ls-runs": ["ls-runs", str(run_dir)],
    }[command]
    code = cli.main(argv)
    err = capsys.readouterr().err
    if command == "resume" or all_refuse:
        assert code == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("rayfl: error: "), err
        assert "Traceback" not in err
    else:  # it never reads what the case changed: it works, and runs nothing from it
        assert code == 0, err
    assert victim.read_bytes() == VICTIM
    assert _snapshot(victim.parent) == outside
    assert not marker.exists()
    assert ray_starts == []


def test_a_resume_names_the_path_to_repeat_on_the_command_line(world, capsys):
    run_dir, victim, marker = world
    pickle_in_cifar_folder(run_dir, victim, marker)
    assert cli.main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"data.root={run_dir}" in err and "trust" in err
    assert not marker.exists()


def test_a_resume_refuses_a_tracking_uri_it_did_not_get_from_the_user(world, capsys):
    run_dir, victim, _ = world
    planted = victim.parent / "planted.db"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["tracking"].update({"backend": "mlflow", "uri": f"sqlite:///{planted}"})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["run", "--resume", str(run_dir)]) == 2
    assert "tracking.uri" in capsys.readouterr().err
    assert not planted.exists()


def test_a_resume_refuses_an_mlflow_run_recorded_in_another_store(world, capsys, monkeypatch):
    from rayfl.engine.rundir import write_mlflow_run

    run_dir, victim, _ = world
    monkeypatch.chdir(victim.parent)
    planted = victim.parent / "elsewhere.db"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["tracking"]["backend"] = "mlflow"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    write_mlflow_run(run_dir, "0123abcd", f"sqlite:///{planted}")
    assert cli.main(["run", "--resume", str(run_dir)]) == 2
    assert "MLflow run is in" in capsys.readouterr().err
    assert not planted.exists() and not (victim.parent / "mlflow.db").exists()


def test_report_refuses_a_malformed_summary_in_one_line(world, capsys):
    run_dir, _, _ = world
    for final in ([], {"personal/acc": "high"}, "x"):
        summary = json.loads((run_dir / "summary.json").read_text())
        summary["final"] = final
        (run_dir / "summary.json").write_text(json.dumps(summary))
        assert cli.main(["report", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rayfl: error: ") and len(err.strip().splitlines()) == 1


def test_a_resume_from_python_refuses_what_the_cli_refuses(world):
    # The check of the directory's entries sits where every resume goes (launch.simulate), not
    # only in the CLI's: rayfl.run(resume=True) and a suite's resumed runs pass through it too.
    from rayfl.errors import UserError
    from rayfl.launch import simulate

    run_dir, victim, marker = world
    os.mkfifo(run_dir / "stray")  # nothing reads it: only the directory check can see it
    raw = json.loads(json.dumps(SYNTHETIC))
    raw["engine"].update({"checkpoint_every": 1, "rounds": 3})
    with pytest.raises(UserError) as err:
        simulate(build_config(raw), run_dir, progress=False, resume=True)
    assert "stray" in str(err.value) and "\n" not in str(err.value)
    assert victim.read_bytes() == VICTIM

"""The Python API (`rayfl.run | suite | sweep`): docs/api.md's examples run as written, results
carry what the docs promise, and mistakes raise rayfl's own error with the CLI's one line."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rayfl
from rayfl.api import overrides_of
from rayfl.config import build_config
from tests.conftest import SYNTHETIC

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), flags=re.S)


def test_overrides_of_spells_the_command_line():
    assert overrides_of(
        {"engine__rounds": 2, "train": {"lr": 0.1, "optimizer": "adam"}, "seed": 1},
        ["algorithm.name=local"],
    ) == [
        "algorithm.name=local",
        "engine.rounds=2",
        "train.lr=0.1",
        'train.optimizer="adam"',
        "seed=1",
    ]
    # values parse back as they were given: a string that looks like a number stays a string
    cfg = build_config(
        SYNTHETIC, overrides_of({"name": "1e-3", "model__architectures": ("tiny_a",)})
    )
    assert cfg.name == "1e-3" and cfg.model.architectures == ("tiny_a",)


@pytest.mark.slow
def test_run_returns_the_result_and_raises_config_errors(tmp_path):
    raw = copy.deepcopy(SYNTHETIC)
    result = rayfl.run(raw, out=tmp_path / "run", progress=False, engine__rounds=1)
    assert isinstance(result, rayfl.RunResult)
    assert result.status == "FINISHED" and result.run_dir == tmp_path / "run"
    assert [row["round"] for row in result.history] == [1]
    assert result.final["personal/acc"] == result.history[-1]["personal/acc"]
    assert result.mlflow_run_id is None and result.config.engine.rounds == 1
    with pytest.raises(rayfl.ConfigError, match=r"^unknown key engine\.roundz \(did you mean"):
        rayfl.run(raw, out=tmp_path / "bad", engine__roundz=1)
    with pytest.raises(rayfl.UserError, match="needs out="):
        rayfl.run(raw, resume=True)


@pytest.mark.slow
def test_the_api_docs_examples_run(tmp_path, mlflow_uri):
    """Every ```python block of docs/api.md, in order, in one interpreter, from a copy of the
    repository's docs/examples (so runs/ and mlflow.db land in tmp_path)."""
    shutil.copytree(ROOT / "docs" / "examples", tmp_path / "docs" / "examples")
    blocks = python_blocks(ROOT / "docs" / "api.md")
    assert len(blocks) >= 5
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MLFLOW_TRACKING_URI": mlflow_uri,
    }
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(blocks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine.rounds: must be in [1, 1000000] (got 0)" in proc.stdout
    assert (tmp_path / "runs" / "moon_mu5" / "metrics.parquet").is_file()
    assert (tmp_path / "runs" / "suite_digits" / "table.txt").is_file()
    assert (tmp_path / "runs" / "sweep_digits" / "best_config.yaml").is_file()

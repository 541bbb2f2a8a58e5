"""The guide stays true: README's two commands, length and configuration keys (read from the
schema), its links; the tutorial's code is the file the test runs, and it trains."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pyarrow.parquet as pq

from rayfl.config import AlgorithmConfig, RunConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMANDS = [
    "bash setup.sh && rayfl run experiments/pfedes_fmnist.yaml",
    "bash setup.sh && ruff check rayfl tests && ruff format --check rayfl tests && mypy rayfl "
    "&& python3 -m pytest -q",
]


def test_readme_opens_with_the_two_commands_and_stays_short():
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert blocks[:2] == COMMANDS
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text()
    assert len(text.splitlines()) <= 200


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, nested sections included (of `algorithm`: its
    `name`; the rest are each algorithm's own keys, listed by `rayfl ls NAME`)."""
    if cls is AlgorithmConfig:
        return [f"{prefix}name"]
    hints = typing.get_type_hints(cls)
    keys = []
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            keys += schema_keys(tp, f"{prefix}{field.name}.")
        keys.append(f"{prefix}{field.name}")
    return keys


def test_readme_configuration_names_every_section_and_key():
    section = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    keys = schema_keys(RunConfig)
    assert "privacy.dp.noise_multiplier" in keys and "eval.protocol" in keys
    missing = [k for k in keys if f"`{k.rsplit('.', 1)[-1]}`" not in section]
    assert missing == [], f"README's Configuration lacks {missing}"
    top = [f.name for f in dataclasses.fields(RunConfig)]
    assert all(f"- `{name}`" in section or f"`{name}`" in section for name in top)
    assert "`plugins`" in section


def test_readme_and_docs_links_resolve():
    for doc in [README, *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.exists(), f"{doc.name} links to missing {target}"


def test_the_tutorial_shows_the_file_that_runs():
    doc = (ROOT / "docs" / "your_algorithm.md").read_text()
    code = (ROOT / "docs" / "examples" / "my_algorithm.py").read_text()
    experiment = (ROOT / "docs" / "examples" / "moon_digits.yaml").read_text()
    assert f"```python\n{code}```" in doc
    assert f"```yaml\n{experiment}```" in doc


def test_the_tutorial_algorithm_trains_through_the_cli_plugin(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    plugin = ROOT / "docs" / "examples" / "my_algorithm.py"
    base = ["--plugin", str(plugin), "--no-progress"]

    def run(*args: str) -> Path:
        out = tmp_path / args[0]
        cmd = [sys.executable, "-m", "rayfl.cli", "run", *args[1:], "--out", str(out), *base]
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads((out / "summary.json").read_text())["status"] == "FINISHED"
        return out

    # the tutorial's own experiment (which also names the plugin), on Ray
    moon = run("moon", str(ROOT / "docs" / "examples" / "moon_digits.yaml"))
    rows = pq.read_table(moon / "metrics.parquet").to_pylist()
    assert len(rows) == 5
    # 10 classes: chance is 0.1; MOON's local models learn
    assert rows[-1]["personal/acc"] > 0.3 and rows[-1]["personal/acc"] > rows[0]["personal/acc"]

"""The guide stays true, checked as facts rather than sentences: README's two commands are the
CI's and the main job's, its configuration names every key of the schema, every link, cited
test and module path resolves, every `rayfl ...` command in the docs parses, the headline's
numbers are those of its generated file; the tutorial's code is the file the test runs, and it
trains."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import typing
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rayfl.config import AlgorithmConfig, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Hand-written pages; docs/results.md is generated and has its own test (test_results_doc.py).
DOCS = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "results.md")]


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_readme_opens_with_the_main_job_and_the_ci_command_and_stays_short():
    text = README.read_text()
    main_job, checks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)[:2]
    setup, run = main_job.split(" && ", 1)
    assert setup == "bash setup.sh" and run.startswith("rayfl run ")
    load_config(ROOT / run.split()[2])  # the main job's file exists and validates
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert checks == ci  # .ci/run runs exactly the README's second command
    assert checks.startswith("bash setup.sh && ")
    assert checks.endswith("python3 -m pytest -q -n 2 --dist loadfile")
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


def test_cited_tests_and_package_paths_exist():
    """`tests/x.py::test_name` and `rayfl/...` paths named in the docs, e.g. as the evidence for
    a guarantee, still exist after a rename."""
    for doc in DOCS:
        text = doc.read_text()
        for path, name in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?", text):
            assert (ROOT / path).is_file(), f"{doc.name} cites missing {path}"
            if name:
                assert f"def {name}(" in (ROOT / path).read_text(), f"{doc.name}: {path}::{name}"
        for path in re.findall(r"`(rayfl/[\w/]*\w(?:\.py)?)/?`", text):
            assert (ROOT / path).exists(), f"{doc.name} names missing {path}"


def rayfl_commands(text: str) -> list[str]:
    """Every `rayfl ...` line of the code blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in fenced_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("rayfl ") and not line.startswith("rayfl run ──"):
                commands.append(shlex.split(line, comments=True))
    return commands


def test_every_documented_rayfl_command_parses():
    from rayfl.cli import build_parser

    parser = build_parser()
    seen = 0
    for doc in DOCS:
        for argv in rayfl_commands(doc.read_text()):
            try:
                parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{doc.name}: `{shlex.join(argv)}` does not parse")
            files = [a for a in argv[2:] if re.fullmatch(r"(experiments|docs)/[\w/.-]+\.yaml", a)]
            assert all((ROOT / f).is_file() for f in files), f"{doc.name}: {files}"
            seen += 1
    assert seen >= 10


def test_the_readme_headline_numbers_are_the_generated_files():
    """README's gains over local training and over the control are the results plan's headline
    table (docs/results/plan/headline/*.json): mean ± sample std over its seeds, as
    docs/results.md tabulates them."""
    parts = sorted((ROOT / "docs" / "results" / "plan" / "headline").glob("s*.json"))
    runs = sorted(
        (run for p in parts for run in json.loads(p.read_text())["runs"]), key=lambda r: r["seed"]
    )
    assert len(runs) == 3, "the headline needs its three seeds"
    readme = " ".join(README.read_text().split())
    for key in ("baseline/gain_points", "baseline/federated_gain_points"):
        gains = [r["final"][key] for r in runs]
        shown = f"{statistics.mean(gains):+.1f} ± {statistics.stdev(gains):.1f}"
        assert shown in readme, (key, shown)
    assert "seeds " + ", ".join(str(r["seed"]) for r in runs) in readme


def test_the_tutorial_shows_the_file_that_runs():
    doc = (ROOT / "docs" / "your_algorithm.md").read_text()
    code = (ROOT / "docs" / "examples" / "my_algorithm.py").read_text()
    experiment = (ROOT / "docs" / "examples" / "moon_digits.yaml").read_text()
    assert f"```python\n{code}```" in doc
    assert f"```yaml\n{experiment}```" in doc


@pytest.mark.slow
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

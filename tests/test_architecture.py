"""House rules that keep the package easy to change."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = (
    "ray",
    "mlflow",
    "rayfl.engine",
    "rayfl.tracking",
    "rayfl.cli",
    "rayfl.tune",
    "rayfl.compare",
)


def test_algorithms_import_no_ray_mlflow_or_engine_statically():
    for path in sorted((ROOT / "rayfl" / "algorithms").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (
                    f"{path.name} imports {name}"
                )


@pytest.mark.slow
def test_importing_algorithms_loads_no_ray_or_mlflow():
    code = (
        "import sys, rayfl.algorithms, rayfl.data, rayfl.models, rayfl.plugins, rayfl.registry;"
        "rayfl.registry.load();"
        "bad = [m for m in ('ray', 'mlflow', 'rayfl.engine') if m in sys.modules]; print(bad); assert not bad"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""The package's import structure: no cycles, every module importable on its own, and the cheap
commands (`rayfl validate`, `rayfl ls`) never load Ray."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rayfl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, everywhere: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: module level, `try`/`if` bodies included,
    `if TYPE_CHECKING:` blocks excluded. `everywhere`: also those inside functions and classes
    (a function-level import is a dependency all the same: it only runs later)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            todo += node.orelse
        elif everywhere or isinstance(node, (ast.If, ast.Try)):
            todo += list(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):  # a `try`'s handler
            todo += node.body
    return found


def _with_parents(name: str) -> list[str]:
    """Importing `a.b.c` runs `a`, `a.b` and `a.b.c`: every one that is a rayfl module."""
    parts = name.split(".")
    return [m for m in (".".join(parts[: i + 1]) for i in range(len(parts))) if m in MODULES]


def import_graph(everywhere: bool = False) -> dict[str, set[str]]:
    """`module -> rayfl modules its import runs`, from the source alone (`everywhere`: also the
    imports inside its functions)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text()), everywhere):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                edges.update(_with_parents(target))
        edges.discard(name)
        # a package's own parents are already being imported when it runs: not a cycle
        graph[name] = {e for e in edges if not name.startswith(e + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path `[a, b, ..., a]`, or None (depth-first, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "rayfl.engine.loop" in graph and "rayfl.config" in graph["rayfl.engine.loop"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_function_level_imports_make_no_cycle_either():
    # A cycle hidden in a function-level import (startup <-> executor, privacy -> engine) is
    # still two modules that cannot be understood, tested or moved apart.
    graph = import_graph(everywhere=True)
    assert "rayfl.engine.ray_executor" in graph["rayfl.engine.loop"]  # inside make_executor
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_module_imports_on_its_own():
    # One fresh interpreter; before each module, every rayfl module is forgotten so it is
    # imported first, as a user's `import rayfl.x` would (heavy third-party imports stay cached).
    code = (
        "import importlib, json, sys, traceback\n"
        "failed = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    for m in [m for m in sys.modules if m == 'rayfl' or m.startswith('rayfl.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed[name] = traceback.format_exc(limit=3)\n"
        "print(json.dumps(failed))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(sorted(MODULES))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failed == {}, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


def _loaded_after_cli(args: list[str]) -> tuple[int, list[str], str]:
    code = (
        "import json, sys\n"
        "from rayfl.cli import main\n"
        "rc = main(json.loads(sys.argv[1]))\n"
        "heavy = sorted(m for m in ('ray', 'mlflow', 'rayfl.engine.executor') if m in sys.modules)\n"
        "print(json.dumps([rc, heavy]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rc, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    return rc, heavy, proc.stdout


def test_validate_and_ls_never_import_ray():
    files = [
        "pfedes_fmnist.yaml",
        "suites/seed3_fmnist.yaml",
        "sweeps/pfedes_T_alpha.yaml",
        "benchmarks/throughput.yaml",
    ]
    rc, heavy, out = _loaded_after_cli(
        ["validate", *(str(ROOT / "experiments" / f) for f in files)]
    )
    assert rc == 0 and out.count(": ok (") == len(files), out
    assert heavy == [], f"rayfl validate imported {heavy}"
    rc, heavy, out = _loaded_after_cli(["ls"])
    assert rc == 0 and "fedprox" in out, out
    assert heavy == [], f"rayfl ls imported {heavy}"

"""The package's import structure: no cycles, every module importable on its own, and the cheap
commands (`rayfl validate`, `rayfl ls`) never load Ray."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rayfl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import in the module: module level, inside functions and classes, and under
    `if TYPE_CHECKING:` (a typing-only or function-level import is a dependency all the same)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _with_parents(name: str) -> list[str]:
    """Importing `a.b.c` runs `a`, `a.b` and `a.b.c`: every one that is a rayfl module."""
    parts = name.split(".")
    return [m for m in (".".join(parts[: i + 1]) for i in range(len(parts))) if m in MODULES]


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> tuple[list[str], list[str]]:
    """(every module the import runs, the modules it names): `from a import b` names `a.b`
    when that is a module, else `a` (whose attribute `b` must exist by then)."""
    if isinstance(node, ast.Import):
        named = [a.name for a in node.names]
        return named, named
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    subs = [f"{base}.{a.name}" for a in node.names]
    named = [m for m in subs if m in MODULES]
    if len(named) < len(subs):
        named.append(base)
    return [base, *subs], named


def import_graph() -> dict[str, set[str]]:
    """`module -> rayfl modules it imports`, from the source alone. A module's own parent
    packages are already being imported when it runs, so the parents an import runs on the way
    are no edge; a parent the import names (`import rayfl`, `from rayfl import run`) is one."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
            runs, named = _targets(node, package)
            found = {m for target in runs for m in _with_parents(target)}
            edges |= {m for m in found if not name.startswith(m + ".") or m in named}
        edges.discard(name)
        graph[name] = edges
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same edges between rayfl's subpackages (`rayfl.engine`, ...) and top-level modules."""

    def unit(module: str) -> str:
        top = ".".join(module.split(".")[:2])
        return top if MODULES.get(top, Path()).name == "__init__.py" else module

    out: dict[str, set[str]] = {}
    for module, edges in graph.items():
        out.setdefault(unit(module), set()).update(unit(e) for e in edges)
    for node, edges in out.items():
        edges.discard(node)
    return out


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


def test_the_graph_follows_every_kind_of_import():
    graph = import_graph()
    assert "rayfl.schema" in graph["rayfl.engine.loop"]  # module level
    assert "rayfl.engine.ray_executor" in graph["rayfl.engine.loop"]  # inside make_executor
    assert "rayfl.schema" in graph["rayfl.resources"]  # under `if TYPE_CHECKING:`
    assert "rayfl.api" in graph["rayfl"]  # a package's __init__ importing its modules
    assert "rayfl.algorithms" not in graph["rayfl.algorithms.fedavg"]  # only its parent, ran
    assert "rayfl" not in graph["rayfl.tracking.provenance"]  # no `import rayfl` any more
    tree = ast.parse("import rayfl\nfrom rayfl import run\nfrom rayfl.engine import loop\n")
    named = [_targets(n, "rayfl.engine")[1] for n in _imports(tree)]
    assert sorted(map(sorted, named)) == [["rayfl"], ["rayfl"], ["rayfl.engine.loop"]]


def test_the_schema_and_the_registry_know_no_domain():
    graph = import_graph()
    assert graph["rayfl.schema"] == set()  # the types every layer may use
    assert graph["rayfl.registry"] == {"rayfl.errors"}  # a generic name -> object registry
    assert graph["rayfl.yamlfile"] == set()


def test_the_package_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_subpackages_have_no_import_cycles_either():
    # engine -> tracking -> engine is a cycle even when no two modules close it
    graph = package_graph(import_graph())
    assert "rayfl.privacy" in graph["rayfl.engine"] and "rayfl.schema" in graph["rayfl.data"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


@pytest.mark.slow
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


@pytest.mark.slow
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

"""No import circles: the modules' imports, lazy ones included, form no cycle (read from the
source), and every module imports alone in a fresh interpreter (what a circle breaks, depending
on which module comes first)."""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specmesh", "router", "verifier_service", "drafter_service")
GENERATED = "specmesh.v1"


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if not name.startswith(GENERATED):
                out[name] = path
    return out


def _imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import statement, at module level or inside a function (a lazy import that closes a
    circle is a circle all the same), but not under `if TYPE_CHECKING:` (never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a package's __init__ counted for each module
    imported from it)."""
    mods = modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                parts = t.split(".")
                for k in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                    dep = ".".join(parts[:k])
                    if dep in graph and dep != name and not name.startswith(dep + "."):
                        graph[name].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and "specmesh.kernels" in graph["specmesh.model"], "the graph was not read"
    assert cycles(graph) == []


def test_the_core_imports_no_service():
    """specmesh/ is what the router and the services build on, never the reverse: the registry
    contract the services heartbeat through (specmesh.registry) included."""
    graph = import_graph()
    assert "specmesh.registry" in graph["router.state"], "the graph was not read"
    services = set(PACKAGES) - {"specmesh"}
    upward = {name: sorted(d for d in deps if d.split(".")[0] in services)
              for name, deps in graph.items() if name.split(".")[0] == "specmesh"}
    assert {name: deps for name, deps in upward.items() if deps} == {}


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_imports_alone():
    def alone(name: str) -> tuple[str, str]:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        return name, "" if r.returncode == 0 else r.stderr.strip().splitlines()[-1]

    with ThreadPoolExecutor(2) as pool:
        failed = {name: err for name, err in pool.map(alone, modules()) if err}
    assert failed == {}

"""Dependencies point one way: no import cycle inside gpumon/, and config/model know no plugin.

An import counts wherever it is written, at module level or inside a function: a deferred import
only hides a cycle until the function runs. Imports under ``if TYPE_CHECKING:`` are left out; they
never execute. ``from package import name`` is an edge to ``package.name`` when that is a module,
else to ``package``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = Path(REPO) / "gpumon"

KNOWN_CYCLES: list[set[str]] = []
"""Cycles that exist today in modules owned elsewhere, to be removed by their owners (none now)."""

PLUGIN_SIDE = ("gpumon.collectors", "gpumon.sinks", "gpumon.simulate", "gpumon.daemon")


def modules() -> dict[str, Path]:
    """Every module under gpumon/ by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _source_of(node: ast.ImportFrom, name: str, is_package: bool) -> str | None:
    if not node.level:
        return node.module
    base = name if is_package else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The gpumon modules ``name`` imports anywhere in its body, TYPE_CHECKING blocks excepted."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    stack: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"), str(path))]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            source = _source_of(node, name, is_package)
            for alias in node.names if source else ():
                target = f"{source}.{alias.name}"
                out.add(target if target in known else source)
        stack.extend(child for child in ast.iter_child_nodes(node)
                     if not (isinstance(child, ast.stmt) and _is_type_checking(child)))
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_graph_sees_real_edges():
    """Guards the parser itself: a graph with no edges would make every other test pass."""
    edges = graph()
    assert "gpumon.config" in edges["gpumon.collectors.base"]
    assert "gpumon.sources.ib_sysfs" in edges["gpumon.simulate.sysfs"]
    assert "gpumon.simulate" in edges["gpumon.daemon.context"]  # imported inside make_context
    assert "gpumon.daemon" in edges["gpumon.cli"]       # `from gpumon import daemon`


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(planted) == [{"a", "b", "c"}]


def test_no_import_cycles_inside_gpumon():
    found = cycles(graph())
    unexpected = [c for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {[sorted(c) for c in unexpected]}"
    stale = [c for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"fixed cycles still allowed in KNOWN_CYCLES: {[sorted(c) for c in stale]}"


def test_config_and_model_know_no_plugin_loop_or_simulation():
    edges = graph()
    for core in ("gpumon.config", "gpumon.model"):
        wrong = sorted(m for m in edges[core] if m.startswith(PLUGIN_SIDE))
        assert not wrong, f"{core} imports {wrong}"

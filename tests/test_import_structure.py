"""Dependencies point one way: no import cycle inside gpumon/, and config/model know no plugin.

An import counts wherever it is written, at module level or inside a function: a deferred import
only hides a cycle until the function runs. Imports under ``if TYPE_CHECKING:`` are left out; they
never execute. ``from package import name`` is an edge to ``package.name`` when that is a module,
else to ``package``.
"""

from __future__ import annotations

from tests.support.imports import graph

KNOWN_CYCLES: list[set[str]] = []
"""Cycles that exist today in modules owned elsewhere, to be removed by their owners (none now)."""

PLUGIN_SIDE = ("gpumon.collectors", "gpumon.sinks", "gpumon.simulate", "gpumon.daemon")


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

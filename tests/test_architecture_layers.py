"""The layer picture of docs/architecture.md, enforced on the import graph (imports inside functions
count; ``if TYPE_CHECKING:`` blocks do not): face -> loop -> collectors, health, sinks -> sources ->
core; simulate beside them, reached only from the loop and the face."""

from __future__ import annotations

from gpumon.registry import BUILTIN_COLLECTORS
from tests.test_import_structure import graph

FACE = ("gpumon.cli", "gpumon.__main__", "gpumon.report", "gpumon.confdoc")
LOOP = ("gpumon.daemon", "gpumon.registry", "gpumon.selfmetrics")

COLLECTOR_MODULES = frozenset(target.partition(":")[0] for target in BUILTIN_COLLECTORS.values())
"""Modules a built-in collector is registered from; every other module in collectors/ is a helper."""

SELF_CONTAINED = ("gpumon.model", "gpumon.config", "gpumon.table", "gpumon.backoff")
"""The core types and the one backoff, which every layer may import; they import nothing of gpumon."""

KNOWN_BREACHES: set[tuple[str, str]] = set()
"""Edges that break a rule today, each to be removed by its module's owner; a fixed one must leave."""


def inside(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def breaches() -> dict[str, set[tuple[str, str]]]:
    """Every edge that breaks a rule, by rule."""
    found: dict[str, set[tuple[str, str]]] = {}

    def breach(rule: str, source: str, target: str) -> None:
        found.setdefault(rule, set()).add((source, target))

    for source, targets in graph().items():
        for target in targets:
            upward = inside(target, *FACE, *LOOP)
            if inside(source, "gpumon.collectors"):
                if target in COLLECTOR_MODULES and target != source:
                    breach("collectors import no collector module (helpers in collectors/ are fine)", source, target)
                if upward or inside(target, "gpumon.sinks", "gpumon.health", "gpumon.simulate"):
                    breach("collectors import no sink, health, simulate, loop or face module", source, target)
            if inside(source, "gpumon.sinks") and (
                    upward or inside(target, "gpumon.collectors", "gpumon.health", "gpumon.simulate")):
                breach("sinks import no collector, health, simulate, loop or face module", source, target)
            if inside(source, "gpumon.health") and (
                    upward or inside(target, "gpumon.collectors", "gpumon.simulate")
                    or (inside(target, "gpumon.sinks") and target != "gpumon.sinks.common")):
                breach("health imports no collector, simulate, loop or face module, of sinks only common",
                       source, target)
            if inside(source, "gpumon.sources") and not (
                    inside(target, "gpumon.sources") or target in ("gpumon.model", "gpumon.config")):
                breach("sources import only model, config and sources", source, target)
            if inside(target, "gpumon.simulate") and not (
                    inside(source, "gpumon.simulate") or source in ("gpumon.daemon.context", "gpumon.cli")):
                breach("simulate is imported only by simulate, daemon.context and cli", source, target)
            if source in SELF_CONTAINED and target != "gpumon":
                breach("model, config, table and backoff import nothing of gpumon", source, target)
            if inside(target, "gpumon.report") and not inside(source, *FACE):
                breach("the report (once's output, the terminal tables) is imported only by the face",
                       source, target)
            if source == "gpumon.metric_catalogue" and target != "gpumon.model":
                breach("the metric catalogue (hint types, pure data) imports only the model", source, target)
    return found


def test_the_rules_see_the_modules_they_are_about():
    """Guards the rules themselves: a renamed package would make every rule pass vacuously."""
    edges = graph()
    assert set(edges) >= COLLECTOR_MODULES, COLLECTOR_MODULES - set(edges)
    assert {"gpumon.collectors.base", "gpumon.collectors.gpu_directory"} <= set(edges) - COLLECTOR_MODULES
    assert "gpumon.collectors.gpu_directory" in edges["gpumon.collectors.attribution"]
    assert "gpumon.sources.ib_sysfs" in edges["gpumon.collectors.infiniband"]
    assert "gpumon.collectors.infiniband" in edges["gpumon.report.tables"]  # the report owns the tables
    assert "gpumon.report" in edges["gpumon.cli"]
    assert "gpumon.backoff" in edges["gpumon.health.actions.worker"]  # the actions use the shared backoff
    assert "gpumon.backoff" in edges["gpumon.collectors.nvml_session"]  # and so does NVML's re-init
    for package in ("gpumon.sinks", "gpumon.health", "gpumon.sources", "gpumon.simulate"):
        assert any(inside(m, package) for m in edges), package


def test_the_rules_catch_a_planted_breach(monkeypatch):
    import tests.test_architecture_layers as me

    real = graph()
    planted = {**real, "gpumon.sources.kvp": real["gpumon.sources.kvp"] | {"gpumon.collectors.nvml"},
               "gpumon.collectors.kmsg": real["gpumon.collectors.kmsg"] | {"gpumon.collectors.xid"},
               "gpumon.metric_catalogue": real["gpumon.metric_catalogue"] | {"gpumon.sources.ib_sysfs"},
               "gpumon.sinks.otel_mapping": real["gpumon.sinks.otel_mapping"]
               | {"gpumon.collectors.nvml_metrics"},
               "gpumon.collectors.nvml": real["gpumon.collectors.nvml"] | {"gpumon.report.tables"},
               "gpumon.daemon.once": real["gpumon.daemon.once"] | {"gpumon.report"},
               "gpumon.table": real["gpumon.table"] | {"gpumon.model"},
               "gpumon.backoff": real["gpumon.backoff"] | {"gpumon.sinks.common"}}
    monkeypatch.setattr(me, "graph", lambda: planted)
    found = {edge for edges in breaches().values() for edge in edges}
    assert ("gpumon.sources.kvp", "gpumon.collectors.nvml") in found
    assert ("gpumon.collectors.kmsg", "gpumon.collectors.xid") in found
    assert ("gpumon.metric_catalogue", "gpumon.sources.ib_sysfs") in found
    assert ("gpumon.sinks.otel_mapping", "gpumon.collectors.nvml_metrics") in found
    assert ("gpumon.collectors.nvml", "gpumon.report.tables") in found
    assert ("gpumon.daemon.once", "gpumon.report") in found
    assert ("gpumon.table", "gpumon.model") in found
    assert ("gpumon.backoff", "gpumon.sinks.common") in found


def test_imports_point_down_the_layers():
    found = breaches()
    unexpected = {rule: sorted(edges - KNOWN_BREACHES) for rule, edges in found.items() if edges - KNOWN_BREACHES}
    assert not unexpected, f"imports against docs/architecture.md's layers: {unexpected}"
    stale = KNOWN_BREACHES - {edge for edges in found.values() for edge in edges}
    assert not stale, f"fixed breaches still listed in KNOWN_BREACHES: {sorted(stale)}"

"""The registry's side of the plugin contract, in process: what gpumon.plugin exports, the run-time
screen of a third-party collector's families, and the list of ignored entry points."""

from __future__ import annotations

import gpumon.plugin
from gpumon import registry
from gpumon.collectors.base import Collector, Context
from gpumon.model import Collection, MetricSpec, MetricType
from tests.conftest import write_distribution

SNEAKY = """
    from gpumon.plugin import Collection, Collector, MetricSpec, MetricType

    OWN = MetricSpec("acme_sneak_value", MetricType.GAUGE, "Declared.")
    STOLEN = MetricSpec("gpumon_collector_up", MetricType.GAUGE, "Not declared.", labels=("collector",))

    class Sneaky(Collector):
        name = "acme_sneak"

        @classmethod
        def metrics(cls):
            return (OWN,)

        def collect(self):
            result = Collection()
            result.add(OWN, [OWN.sample(1)])
            result.add(STOLEN, [STOLEN.sample(1, "nvml")])
            return result
"""


def install(root, monkeypatch, entry_points: str, modules: dict[str, str]) -> None:
    monkeypatch.syspath_prepend(str(write_distribution(root, "acme-sneak", entry_points, modules)))


def test_the_public_module_is_the_same_objects_as_their_homes():
    from gpumon import config, model
    from gpumon.collectors import base as collectors_base
    from gpumon.sinks import base as sinks_base

    homes = (collectors_base, config, model, sinks_base)
    for name in gpumon.plugin.__all__:
        value = getattr(gpumon.plugin, name)
        if isinstance(value, str):
            continue
        assert any(getattr(home, name, None) is value for home in homes), name
    assert gpumon.plugin.COLLECTOR_GROUP == registry.COLLECTORS_GROUP
    assert gpumon.plugin.SINK_GROUP == registry.SINKS_GROUP
    for required in ("Collector", "Sink", "Context", "SinkContext", "Availability", "CollectorUnavailable",
                     "Collection", "MetricSpec", "MetricType", "MetricFamily", "Sample", "Event", "Severity",
                     "Snapshot", "Option", "SectionSchema", "Section", "CheckResult", "SinkHealth", "Table"):
        assert required in gpumon.plugin.__all__


def test_screen_drops_an_undeclared_gpumon_family_of_a_plugin_and_counts_it(tmp_path, monkeypatch, caplog):
    install(tmp_path, monkeypatch, "[gpumon.collectors]\nacme_sneak = acme_sneak:Sneaky\n", {"acme_sneak.py": SNEAKY})
    cls = registry.collector_class("acme_sneak")  # declared metrics are fine: it loads
    collector = cls(Context(hostname="node-1"))
    for _ in range(2):
        result = registry.screen(collector, collector.collect())
        assert [f.name for f in result.families] == ["acme_sneak_value"]
        assert result.errors == {"reserved_metric_name": 1}
    logged = [r.getMessage() for r in caplog.records if r.name == "gpumon.registry"]
    assert logged == ["collector plugin 'acme_sneak' returned gpumon_collector_up: the 'gpumon_' prefix is "
                      "gpumon's own (its collectors, self-metrics and health series); name the plugin's metrics "
                      "after the plugin; its samples are dropped"]  # once, not per run


def test_screen_leaves_collectors_not_loaded_from_an_entry_point_alone():
    spec = MetricSpec("gpumon_collector_up", MetricType.GAUGE, "A test double's family.")

    class Double(Collector):
        name = "double"

        def collect(self) -> Collection:
            result = Collection()
            result.add(spec, [spec.sample(1)])
            return result

    collector = Double(Context(hostname="node-1"))
    assert [f.name for f in registry.screen(collector, collector.collect()).families] == ["gpumon_collector_up"]


def test_conflicts_lists_each_entry_point_whose_name_is_taken(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "[gpumon.collectors]\nxid = acme_sneak:Sneaky\nacme_sneak = acme_sneak:Sneaky\n"
            "[gpumon.sinks]\notel = acme_sneak:Sink\n", {"acme_sneak.py": SNEAKY})
    found = [(c.group, c.name, c.distribution) for c in registry.conflicts()]
    assert found == [("gpumon.collectors", "xid", "acme-sneak 1.0"), ("gpumon.sinks", "otel", "acme-sneak 1.0")]
    assert registry.collector_class("xid").__module__ == "gpumon.collectors.xid"
    assert "acme_sneak" in registry.available_collectors()

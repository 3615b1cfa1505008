"""One metric catalogue: a metric's sink hints sit beside its declaration (or in the catalogue's
registry, by name, until they move there); the OTel routes and the Azure columns come from them."""

from __future__ import annotations

from gpumon import metric_catalogue as cat
from gpumon.confdoc import declared_specs
from gpumon.model import MetricFamily, MetricSpec, MetricType, Sample, Snapshot
from gpumon.sinks import otel_mapping
from gpumon.sinks.azure_rows import GPU, RowBuilder, stream_columns

OWN = MetricSpec(
    "gpumon_gpu_widget_ratio", MetricType.GAUGE, "A widget.", "ratio", ("gpu", "uuid"),
    otel=(cat.OtelMetric("hw.gpu.widget", "1", cat.Kind.GAUGE, cat.Domain.GPU, semconv=True),),
    azure=(cat.MetricColumns("", GPU, "WidgetRatio", ("max",)),))


def snapshot(*families: MetricFamily) -> Snapshot:
    return Snapshot("node-1", 1000.0, families, (), ())


def test_a_hint_beside_the_declaration_routes_the_otel_metric():
    assert otel_mapping.routes(OWN) == OWN.otel
    assert OWN.name not in otel_mapping.TABLE  # the registry is not involved
    bare = MetricSpec(OWN.name, OWN.type, OWN.help, OWN.unit, OWN.labels)
    assert otel_mapping.routes(bare)[0].name == "gpumon.gpu.widget"  # without it: the mechanical name
    assert bare == OWN  # hints do not make another metric


def test_a_hint_beside_the_declaration_fills_azure_columns_and_the_template():
    assert ("WidgetRatioMax", "real") in stream_columns([OWN])[GPU]
    assert ("WidgetRatioMax", "real") not in stream_columns()[GPU]
    rows = RowBuilder("node-1")
    rows.add(snapshot(MetricFamily(OWN, (Sample((("gpu", "0"), ("uuid", "GPU-a")), 0.5),))), 0.0)
    (row,) = rows.close_interval(1_700_000_060.0, 60.0)[GPU]
    assert row["WidgetRatioMax"] == 0.5
    assert OWN.name not in rows.unmapped


def test_a_plugins_azure_hint_adds_no_column():
    """The deployed tables are generated from gpumon's declarations: only gpumon's names own columns."""
    plugin = MetricSpec("acme_widget_ratio", MetricType.GAUGE, "A widget.", "ratio", ("gpu",),
                        azure=(cat.MetricColumns("", GPU, "AcmeWidget", ("max",)),))
    assert cat.azure_hints(plugin) == ()
    assert ("AcmeWidgetMax", "real") not in stream_columns([plugin])[GPU]


def test_the_registry_reads_the_same_as_before():
    util = otel_mapping.routes(MetricSpec("gpumon_gpu_utilization_ratio", MetricType.GAUGE, "", "ratio",
                                          ("gpu", "uuid", "engine")))
    assert [m.name for m in util] == ["hw.gpu.utilization", "hw.gpu.memory.utilization"]
    power = MetricSpec("gpumon_gpu_power_watts", MetricType.GAUGE, "", "watts", ("gpu", "uuid"))
    assert [h.column for h in cat.azure_hints(power)] == ["PowerWatts"]


def test_every_registered_hint_names_a_declared_metric_and_none_is_declared_twice():
    declared = {s.name: s for s in declared_specs()}
    orphans = sorted(set(cat.registered()) - set(declared))
    assert not orphans, f"hints for metrics nobody declares (renamed? removed?): {orphans}"
    twice = sorted(n for n, s in declared.items() if (s.otel and n in cat.OTEL)
                   or (s.azure and n in cat.AZURE_BY_METRIC))
    assert not twice, f"hinted beside the declaration and in the registry: {twice}"

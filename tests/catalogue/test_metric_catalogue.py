"""One metric catalogue: a metric's sink hints sit on its declaration, the only place they are read
from; the OTel routes and the Azure columns come from them.

Nothing lost in the move from the old name-keyed registry is proven by the committed outputs the hints
generate: docs/metrics.md's OTel table (tests/sinks/otel/test_otel_mapping_names.py: every generated row is in
it) and the DCR template (tests/sinks/azure_monitor/test_azure_template_matches_code.py: generated == committed, and
every per-GPU and per-port metric of nvml, infiniband and linkflap has an Azure hint on its spec),
plus the tests below that each hint fits the declaration it sits on."""

from __future__ import annotations

import dataclasses

import pytest

from gpumon.catalogue import daemon as daemon_metrics
from gpumon.catalogue import gpu as gpu_metrics
from gpumon.catalogue import hints as cat
from gpumon.catalogue import lookup
from gpumon.collectors import nvml_readings
from gpumon.confdoc import declared_specs
from gpumon.model import MetricFamily, MetricSpec, MetricType, Sample, Snapshot
from gpumon.sinks.azure_monitor.rows import GPU, IB, RowBuilder, stream_columns
from gpumon.sinks.otel import mapping as otel_mapping
from gpumon.stages import selfmetrics

OWN = MetricSpec(
    "gpumon_gpu_widget_ratio", MetricType.GAUGE, "A widget.", "ratio", ("gpu", "uuid"),
    otel=(cat.OtelMetric("hw.gpu.widget", "1", cat.Kind.GAUGE, cat.Domain.GPU, semconv=True),),
    azure=(cat.MetricColumns("", GPU, "WidgetRatio", ("max",)),))

DECLARED = {s.name: s for s in declared_specs()}


def snapshot(*families: MetricFamily) -> Snapshot:
    return Snapshot("node-1", 1000.0, families, (), ())


def test_a_hint_beside_the_declaration_routes_the_otel_metric():
    assert otel_mapping.routes(OWN) == OWN.otel
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
    assert lookup.azure_hints(plugin) == ()
    assert ("AcmeWidgetMax", "real") not in stream_columns([plugin])[GPU]


def test_the_spec_is_the_only_source_a_name_is_no_key():
    """A spec made again under a built-in's name, without hints, is mapped as any unhinted metric."""
    power = gpu_metrics.POWER
    assert [h.column for h in lookup.azure_hints(power)] == ["PowerWatts"]
    assert otel_mapping.resolve(power).name == "hw.power"
    bare = MetricSpec(power.name, power.type, power.help, power.unit, power.labels)
    assert lookup.otel_hints(bare) == () and lookup.azure_hints(bare) == ()
    assert otel_mapping.resolve(bare).name == "gpumon.gpu.power"
    util = otel_mapping.routes(gpu_metrics.UTIL)
    assert [m.name for m in util] == ["hw.gpu.utilization", "hw.gpu.memory.utilization"]


def test_a_no_columns_hint_keeps_the_metric_out_of_the_generic_rows():
    per_link = gpu_metrics.NVLINK_LINK_UP
    (hint,) = lookup.azure_hints(per_link)
    assert isinstance(hint, cat.NoColumns) and hint.metric == per_link.name and hint.reason
    rows = RowBuilder("node-1")
    rows.add(snapshot(MetricFamily(per_link, (per_link.sample(1, "0", "GPU-a", "3"),))), 0.0)
    assert per_link.name not in rows.unmapped
    assert not rows.close_interval(1_700_000_060.0, 60.0)["metrics"]


ROW_TABLE = {"gpu": GPU, "device": IB}


@pytest.mark.parametrize("name", sorted(n for n, s in DECLARED.items() if s.otel or s.azure))
def test_each_hint_fits_the_declaration_it_sits_on(name):
    """Labels a hint selects, splits or renames are the spec's; a column hint is on the row of the
    spec's identity (gpu -> GpuMonGpu_CL, device -> GpuMonInfiniBand_CL)."""
    spec = DECLARED[name]
    labels = set(spec.labels)
    for otel in lookup.otel_hints(spec):
        used = {k for k, _ in otel.select + otel.exclude + otel.label_map}
        assert used <= labels, (name, otel.name, used - labels)
        if spec.type is MetricType.COUNTER:
            assert otel.kind is cat.Kind.COUNTER, name
    for hint in lookup.azure_hints(spec):
        assert hint.metric == name
        if isinstance(hint, cat.NoColumns):
            assert hint.reason and len(lookup.azure_hints(spec)) == 1, name
            continue
        assert ROW_TABLE.get(spec.labels[0]) == hint.table, (name, hint.table)
        if isinstance(hint, cat.InfoColumns):
            assert spec.type is MetricType.INFO and {k for k, _ in hint.labels} <= labels, name
        else:
            used = {k for k, _ in hint.where} | ({hint.split_label} if hint.split_label else set())
            assert used <= labels and bool(hint.split) == bool(hint.split_label), name


def test_the_violation_columns_cover_every_reason_nvml_fields_read():
    reasons = {f.extra[0] for f in nvml_readings.FIELDS if f.spec is gpu_metrics.CLOCK_VIOLATION}
    (hint,) = lookup.azure_hints(gpu_metrics.CLOCK_VIOLATION)
    assert isinstance(hint, cat.MetricColumns)
    assert {value for value, _ in hint.split} == reasons


def test_the_process_metrics_read_at_run_time_carry_their_declarations_hints():
    """prometheus-client makes the process_* samples; each is paired with gpumon's declaration."""
    read = {fam.name: fam.spec for fam in selfmetrics.SelfMetrics().families({}, {})
            if fam.name.startswith("process_")}
    assert read, "prometheus-client read no process metrics"
    for spec in daemon_metrics.PROCESS_SPECS:
        if spec.name in read:
            assert read[spec.name] == spec and read[spec.name].otel == spec.otel, spec.name
    assert otel_mapping.resolve(read["process_cpu_seconds_total"]).name == "process.cpu.time"


def test_hints_do_not_change_what_a_spec_is():
    """Hints take no part in equality or hashing: the attribution copies (dataclasses.replace) keep them."""
    power = gpu_metrics.POWER
    copy = dataclasses.replace(power, labels=power.labels + ("pod",))
    assert copy.otel == power.otel and copy.azure == power.azure
    assert hash(power) == hash(MetricSpec(power.name, power.type, power.help, power.unit, power.labels))


def test_every_catalogue_metric_declares_a_typed_unit_that_its_name_agrees_with():
    """The OpenTelemetry unit comes from the declaration, never from words in the name: every metric of
    the catalogue carries a Unit (Prometheus word + UCUM), and a name that ends in a unit word has it."""
    from gpumon.catalogue import every
    from gpumon.catalogue.units import Unit

    for spec in every.ALL:
        assert isinstance(spec.unit, Unit), spec.name
        assert spec.unit.ucum, spec.name
        if spec.unit:
            assert spec.name.removesuffix("_total").endswith("_" + spec.unit), spec.name
        else:
            assert spec.unit.ucum.startswith("{"), spec.name  # a count or a state: {error}, {state} ...
        assert otel_mapping.ucum(spec) == spec.unit.ucum


def test_a_unit_is_its_prometheus_word_and_keeps_its_ucum_code_through_copy_and_pickle():
    import copy
    import json
    import pickle

    from gpumon.catalogue.units import BYTES, ERRORS

    assert BYTES == "bytes" and json.dumps({"unit": BYTES}) == '{"unit": "bytes"}' and f"{BYTES}" == "bytes"
    assert not ERRORS and ERRORS.ucum == "{error}"
    for again in (copy.deepcopy(BYTES), pickle.loads(pickle.dumps(BYTES))):
        assert (again, again.ucum) == ("bytes", "By")


def test_a_plugin_unit_word_is_translated_and_a_missing_one_is_not_guessed_from_the_name():
    gauge = MetricSpec("acme_inlet_bytes", MetricType.GAUGE, "x")
    assert otel_mapping.ucum(gauge) == "{count}"  # not "By": a plugin without a unit says nothing
    assert otel_mapping.ucum(MetricSpec("acme_x_total", MetricType.COUNTER, "x")) == "{event}"
    assert otel_mapping.ucum(MetricSpec("acme_t_celsius", MetricType.GAUGE, "x", "celsius")) == "Cel"
    assert otel_mapping.ucum(MetricSpec("acme_w", MetricType.GAUGE, "x", "widgets")) == "{widgets}"


def test_the_label_values_the_catalogue_gives_columns_are_the_sources():
    """The catalogue names the label values it gives an Azure column (it imports no collector or source);
    the collectors and sources pair the same values with NVML bits and sysfs files."""
    from gpumon import flaps
    from gpumon.catalogue import infiniband as ib_metrics
    from gpumon.collectors import nvml_tables
    from gpumon.sources import ib_sysfs

    assert tuple(name for _, name in nvml_tables.CLOCK_EVENT_REASONS) == gpu_metrics.CLOCK_EVENT_REASON_VALUES
    assert tuple(name for _, name in nvml_tables.GPM_RATIOS) == gpu_metrics.ACTIVITY_VALUES
    assert tuple(c.name for c in nvml_tables.FABRIC_CONDITIONS) == gpu_metrics.FABRIC_CONDITION_VALUES
    assert ib_metrics.HW_COUNTER_COLUMN_VALUES == ib_sysfs.MLX5_QUEUE_COUNTERS + ib_sysfs.MLX5_ROCE_COUNTERS
    assert ib_metrics.FLAP_SIGNAL_VALUES == flaps.SIGNALS


def test_the_built_in_sinks_gauges_keep_their_units():
    """``gpumon_sink_<key>`` gauges are made from each sink's health at run time; their units are
    declared in the catalogue (the UCUM codes they were always exported with), their Prometheus unit
    word stays empty (no ``# UNIT`` line), and a plugin sink's unknown key is a plain count."""
    from gpumon.sinks.base import SinkHealth

    expected = {"spool_bytes": "By", "last_success_timestamp_seconds": "s", "queued_records": "{record}",
                "consecutive_failures": "{failure}", "exported_data_points": "{data_point}",
                "exported_log_records": "{record}", "connections": "{count}", "requests_queued": "{count}",
                "rows_queued": "{count}", "unmapped_metrics": "{count}", "acme_widgets_bytes": "{count}"}
    health = {"azure_monitor": SinkHealth(up=True, extra={key: 1.0 for key in expected})}
    families = {fam.name: fam for fam in selfmetrics.SelfMetrics().families({}, health)}
    for key, ucum in expected.items():
        spec = families[f"gpumon_sink_{key}"].spec
        assert (str(spec.unit), otel_mapping.ucum(spec), spec.labels) == ("", ucum, ("sink",)), key
        assert spec.help == f"Sink-specific gauge {key!r} (see the sink's docs)."

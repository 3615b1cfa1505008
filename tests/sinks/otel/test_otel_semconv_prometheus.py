"""What the otel sink sends, decoded from the wire, against the semantic conventions it targets and
through the Prometheus OTLP receiver's name translation.

``fixtures/semconv_v1.44.0.json`` pins the facts (instrument, unit, required attributes, enum values)
taken from the semantic-conventions YAML model at v1.44.0; its header names the files. The translation
follows the rules of the Prometheus OTLP receiver with name suffixes on (prometheus/otlptranslator,
``normalizeName``): the name is split into tokens on every character outside ``[a-zA-Z0-9:]``; the
unit's main part is appended through the UCUM -> word table unless it is an annotation in braces or
already a token; a per-unit ``/s`` becomes ``per_second``; a monotonic sum gets ``_total``; a gauge in
unit ``1`` gets ``_ratio``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time

import pytest

from gpumon.catalogue import daemon as daemon_metrics
from gpumon.confdoc import declared_specs
from gpumon.model import MetricFamily
from gpumon.sinks.otel import mapping
from tests.conftest import REPO
from tests.fakes import otlp as receivers
from tests.fakes.simulated_host import SimulatedHost
from tests.support.otel import attrs, make_sink

http_receiver = receivers.http_receiver

with open(os.path.join(REPO, "tests", "fixtures", "semconv_v1.44.0.json"), encoding="utf-8") as _fh:
    SEMCONV = json.load(_fh)

# prometheus/otlptranslator's unit tables (the entries gpumon's units can reach)
PROM_UNITS = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "V": "volts", "A": "amperes", "J": "joules",
              "W": "watts", "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent"}
PROM_PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day"}


def prometheus_name(name: str, unit: str, data: str, monotonic: bool) -> str:
    """The Prometheus name the OTLP receiver gives a metric (UTF-8 escaping to underscores, suffixes on)."""
    tokens = [t for t in re.split(r"[^a-zA-Z0-9:]+", name) if t]
    main, _, per = unit.partition("/")
    main_word = PROM_UNITS.get(main, main) if main and not re.search(r"[{}]", main) else ""
    per_word = "per_" + PROM_PER_UNITS.get(per, per) if per and not re.search(r"[{}]", per) else ""
    for word in (main_word, per_word):
        if word and word not in tokens:
            tokens.append(word)
    if data == "sum" and monotonic:
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if unit == "1" and data == "gauge":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    return "_".join(tokens)


@pytest.mark.parametrize(("name", "unit", "data", "monotonic", "expected"), [
    ("http.server.duration", "s", "histogram", False, "http_server_duration_seconds"),
    ("requests.count", "1", "sum", True, "requests_count_total"),
    ("memory.usage", "By", "gauge", False, "memory_usage_bytes"),
    ("gpumon.gpu.info", "1", "gauge", False, "gpumon_gpu_info_ratio"),  # what unit 1 did to the info series
    ("gpumon.gpu.info", "{info}", "gauge", False, "gpumon_gpu_info"),
    ("hw.network.bandwidth.limit", "By/s", "sum", False, "hw_network_bandwidth_limit_bytes_per_second"),
])
def test_the_translation_rules(name, unit, data, monotonic, expected):
    assert prometheus_name(name, unit, data, monotonic) == expected


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    """One export of the simulated ND H100 v5 host plus the process self-metrics, as the receiver
    decoded it: {name: Metric}."""
    tmp_path = tmp_path_factory.mktemp("semconv")
    receiver = receivers.OtlpHttpReceiver()
    host = SimulatedHost(str(tmp_path))
    sink = make_sink(receiver.endpoint, tmp_path, logs=False)
    try:
        snap = host.snapshot()
        process = tuple(MetricFamily(spec, (spec.sample(value),)) for spec, value in zip(
            daemon_metrics.PROCESS_SPECS, (1.5, 2 ** 26, 2 ** 30, 12, 1024, time.time() - 5), strict=True))
        snap = snap.__class__(snap.host, snap.time, snap.families + process, (), snap.collectors, snap.seq)
        sink.start()
        sink.publish(snap)
        receiver.wait(lambda r: r.metrics)
    finally:
        sink.stop(5)
        host.close()
        receiver.close()
    out = {}
    for rm in receiver.metrics[0].resource_metrics:
        for sm in rm.scope_metrics:
            out.update((m.name, m) for m in sm.metrics)
    return out


def points(metric) -> list:
    return list(getattr(metric, metric.WhichOneof("data")).data_points)


def test_every_convention_metric_matches_the_pinned_model(received):
    sent = {name for name in received if not name.startswith("gpumon.")}
    assert sent <= set(SEMCONV["metrics"]), f"names the model does not have: {sent - set(SEMCONV['metrics'])}"
    for required in ("hw.gpu.memory.utilization", "hw.temperature.limit", "hw.status",
                     "process.cpu.time", "hw.errors", "hw.gpu.utilization"):
        assert required in sent, required
    enums = SEMCONV["enums"]
    for name in sent:
        model, metric = SEMCONV["metrics"][name], received[name]
        assert metric.unit == model["unit"], name
        data = metric.WhichOneof("data")
        instrument = "gauge" if data == "gauge" else ("counter" if metric.sum.is_monotonic else "updowncounter")
        assert instrument == model["instrument"], name
        for point in points(metric):
            a = attrs(point)
            missing = set(model["required_attributes"]) - set(a)
            assert not missing, f"{name}: {missing} missing from {a}"
            for key in ("hw.type", "hw.state", "hw.limit_type", "hw.gpu.task", "network.io.direction", "cpu.mode"):
                if key in a:
                    assert a[key] in enums[key], f"{name}: {key}={a[key]}"


def test_gpu_errors_are_counted_once_with_the_refinement_values(received):
    gpu_errors = [attrs(p) for p in points(received["hw.errors"]) if attrs(p)["hw.type"] == "gpu"]
    ecc = [a for a in gpu_errors if not str(a["error.type"]).startswith(("xid_", "pcie_"))]
    assert ecc, "no ECC points"
    assert {a["error.type"] for a in ecc} <= set(SEMCONV["enums"]["error.type (hw.errors, hw.type=gpu)"])
    assert all("counter" not in a for a in gpu_errors)
    keys = [(a["hw.id"], a["error.type"]) for a in ecc]
    assert len(keys) == len(set(keys)), "an ECC error type sent twice for one GPU"
    lifetime = [attrs(p) for p in points(received["gpumon.gpu.ecc.errors.lifetime"])]
    assert {a["error.type"] for a in lifetime} == {"corrected", "uncorrected"}


def test_cpu_time_is_split_by_mode_and_carries_the_pid(received):
    cpu = {attrs(p)["cpu.mode"]: attrs(p) for p in points(received["process.cpu.time"])}
    assert set(cpu) == {"user", "system"}
    assert all(a["process.pid"] == os.getpid() for a in cpu.values())


def test_every_gpu_and_port_point_carries_hw_id(received):
    for name, metric in received.items():
        for point in points(metric):
            a = attrs(point)
            if "uuid" in a or "gpu" in a or {"device", "port"} <= set(a):
                assert "hw.id" in a, f"{name}: {a}"
            assert "direction" not in a, f"{name}: direction instead of network.io.direction"


def test_gpumon_names_come_back_unchanged_through_the_prometheus_receiver(received):
    """A gpumon.* metric arrives in Prometheus under the name the Prometheus sink gives it. (The
    process_* metrics without a convention are sent as gpumon.process.*: the process.* namespace is
    the conventions' own.)"""
    for spec in declared_specs():
        for otel in mapping.routes(spec):
            if otel.semconv or otel.select or not spec.name.startswith("gpumon_"):
                continue
            data = "gauge" if otel.kind is mapping.Kind.GAUGE else "sum"
            assert prometheus_name(otel.name, otel.unit, data, otel.kind is mapping.Kind.COUNTER) == spec.name, (
                spec.name, otel.name, otel.unit)


def test_the_documented_promql_names_match(received):
    """Every gpumon_* name the docs, rules and dashboards query exists among what the OTLP path
    produces in Prometheus (for the series the OTel sink sends under a gpumon.* name)."""
    translated = {prometheus_name(name, m.unit, m.WhichOneof("data"),
                                  m.WhichOneof("data") == "sum" and m.sum.is_monotonic)
                  for name, m in received.items()}
    mechanical = {spec.name for spec in declared_specs()
                  if not any(o.semconv or o.select for o in mapping.routes(spec))}
    sent = {spec_name for spec_name in mechanical
            if mapping.mechanical_name(spec_name) in received}
    texts = [os.path.join(REPO, "docs", "metrics.md")]
    texts += glob.glob(os.path.join(REPO, "dashboards", "**", "*.json"), recursive=True)
    texts += glob.glob(os.path.join(REPO, "deploy", "prometheus", "*.yaml"))
    queried: set[str] = set()
    for path in texts:
        with open(path, encoding="utf-8") as fh:
            queried |= set(re.findall(r"\bgpumon_[a-z0-9_]+", fh.read()))
    checked = queried & sent
    assert {"gpumon_gpu_info", "gpumon_ib_port_info"} <= checked
    assert checked <= translated, sorted(checked - translated)
    assert "gpumon_gpu_info_ratio" not in translated and "hw_gpu_utilization_ratio" in translated
    assert {"hw_errors_total", "hw_network_io_bytes_total", "hw_gpu_memory_utilization_ratio",
            "process_cpu_time_seconds_total"} <= translated

"""OTLP points and log records of attributed GPUs carry the Kubernetes semantic-convention attributes
(k8s.namespace.name, k8s.pod.name, k8s.container.name) and gpumon.job.id, encoded as real protobuf."""

from __future__ import annotations

import pytest

from gpumon import attribution_labels as al
from gpumon.collectors.attribution import ALLOCATION
from gpumon.model import Event, MetricFamily, MetricSpec, MetricType, Severity, Snapshot
from gpumon.sinks import otel
from gpumon.sinks.otel import mapping as m
from tests.support.declared_hints import hinted

pytest.importorskip("opentelemetry.proto.metrics.v1.metrics_pb2")

UTIL = hinted(MetricSpec("gpumon_gpu_utilization_ratio", MetricType.GAUGE, "u", "ratio",
                         ("gpu", "uuid", "engine")))
CLOCK = MetricSpec("gpumon_gpu_clock_hertz", MetricType.GAUGE, "c", "hertz", ("gpu", "uuid", "clock"))


def allocation(*rows: tuple[str, str, str, str, str]) -> MetricFamily:
    return MetricFamily(ALLOCATION, tuple(ALLOCATION.sample(1, g, f"GPU-{g}", "", ns, pod, c, job)
                                          for g, ns, pod, c, job in rows))


def points(snapshot: Snapshot, name: str) -> list[dict[str, object]]:
    request, _ = otel.MetricEncoder("test").encode(snapshot, {"service.name": "gpumon"})
    metric = next(x for x in request.resource_metrics[0].scope_metrics[0].metrics if x.name == name)
    return [{kv.key: kv.value.string_value for kv in p.attributes} for p in metric.gauge.data_points]


def test_semconv_and_gpumon_points_of_a_held_gpu_carry_its_pods_one_point_per_holder() -> None:
    held = allocation(("0", "ml", "a", "main", ""), ("0", "ml", "b", "main", ""), ("1", "", "", "", "4242"))
    families = (held, MetricFamily(UTIL, tuple(UTIL.sample(0.5, g, f"GPU-{g}", "gpu") for g in "012")),
                MetricFamily(CLOCK, (CLOCK.sample(1e9, "0", "GPU-0", "sm"),)))
    snap = Snapshot("node-1", 1_700_000_000.0, al.relabel(families, held), (), ())
    util = points(snap, "hw.gpu.utilization")
    pods = sorted((p["hw.id"], p.get("k8s.pod.name"), p.get("gpumon.job.id")) for p in util)
    assert pods == [("GPU-0", "a", None), ("GPU-0", "b", None), ("GPU-1", None, "4242"), ("GPU-2", None, None)]
    assert all(p.get("k8s.namespace.name") == "ml" and p["k8s.container.name"] == "main"
               for p in util if p["hw.id"] == "GPU-0")
    assert not any({"namespace", "pod", "container", "job_id"} & set(p) for p in util)
    clock = points(snap, "gpumon.gpu.clock")
    assert {p["k8s.pod.name"] for p in clock} == {"a", "b"} and all(p["gpu"] == "0" for p in clock)


def test_without_attribution_labels_only_the_join_series_names_holders() -> None:
    held = allocation(("0", "ml", "a", "main", ""))
    snap = Snapshot("node-1", 1_700_000_000.0, (held, MetricFamily(UTIL, (UTIL.sample(0.5, "0", "GPU-0", "gpu"),))),
                    (), ())
    assert "k8s.pod.name" not in points(snap, "hw.gpu.utilization")[0]
    (join,) = points(snap, "gpumon.gpu.allocation_info")
    assert (join["k8s.namespace.name"], join["k8s.pod.name"], join["k8s.container.name"]) == ("ml", "a", "main")


def test_a_container_without_a_pod_is_a_container_id() -> None:
    assert m.holder_attributes({"namespace": "", "pod": "", "container": "0123456789ab", "job_id": ""}) == {
        "container.id": "0123456789ab"}


def test_log_records_of_gpu_events_name_the_holders_in_the_conventions() -> None:
    event = Event("gpu_xid", Severity.ERROR, {"gpu": "0", "uuid": "GPU-0"}, "GPU 0: XID 79", {"xid": 79})
    (enriched,) = al.enrich([event], allocation(("0", "ml", "a", "main", "")))
    attrs = otel.event_attributes(enriched)
    assert (attrs["k8s.namespace.name"], attrs["k8s.pod.name"], attrs["k8s.container.name"]) == ("ml", "a", "main")
    assert attrs["xid"] == 79 and not {"namespace", "pod", "container"} & set(attrs)

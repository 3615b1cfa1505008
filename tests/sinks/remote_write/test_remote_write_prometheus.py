"""Remote write into a real Prometheus (`--web.enable-remote-write-receiver`): every sample on gpumon's
page for a simulated ND H100 v5 host arrives with the same value and labels, and the samples sent while
the receiver was down arrive after it comes back."""

from __future__ import annotations

import math

from prometheus_client import parser

from gpumon.render import Renderer
from tests.conftest import http_get, wait_for
from tests.fakes.remote_write import delivered, make_sink
from tests.fakes.simulated_host import SimulatedOnce

RECEIVER = ("--web.enable-remote-write-receiver",)


def page_samples(snapshot) -> dict[frozenset, float]:
    """The page's samples as Prometheus stores them from a scrape by job gpumon of instance nd-node."""
    text = Renderer().render(snapshot.families)
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if v}
            labels.update({"__name__": sample.name, "job": "gpumon", "instance": "nd-node"})
            out[frozenset(labels.items())] = sample.value
    return out


def stored_samples(prometheus, at_ms: int) -> dict[frozenset, float]:
    result = prometheus.query('{job="gpumon"}', at=at_ms / 1000)
    return {frozenset(r["metric"].items()): float(r["value"][1]) for r in result}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_every_sample_on_the_page_arrives_with_its_value_and_labels(prometheus_server, tmp_path):
    prometheus = prometheus_server(None, *RECEIVER)
    snapshot = SimulatedOnce(str(tmp_path / "sim")).snapshot()
    sink = make_sink(tmp_path, prometheus.url + "/api/v1/write")
    sink.start()
    try:
        sink.publish(snapshot)
        wait_for(lambda: delivered(sink), timeout=10)
    finally:
        sink.stop(2.0)
    expected = page_samples(snapshot)
    assert len(expected) > 1000  # 8 GPUs, 9 IB ports and gpumon's own metrics
    stored = stored_samples(prometheus, round(snapshot.time * 1000))
    assert set(stored) == set(expected)
    wrong = {labels: (stored[labels], value) for labels, value in expected.items()
             if not same(stored[labels], value)}
    assert not wrong
    health = sink.health()
    assert health.exported == len(expected) and health.failed == 0 and health.dropped == 0


def test_samples_sent_during_an_outage_arrive_after_the_receiver_restarts(prometheus_server, tmp_path):
    prometheus = prometheus_server(None, *RECEIVER)
    host = SimulatedOnce(str(tmp_path / "sim"))
    sink = make_sink(tmp_path, prometheus.url + "/api/v1/write")
    sink.start()
    try:
        first = host.snapshot()
        sink.publish(first)
        wait_for(lambda: delivered(sink), timeout=10)
        prometheus.stop()
        during = [host.snapshot() for _ in range(3)]
        for snapshot in during:
            sink.publish(snapshot)
        wait_for(lambda: sink.health().failed > 0, timeout=10)
        assert sink.health().extra["requests_queued"] >= 1
        prometheus.start()
        wait_for(lambda: delivered(sink) and sink.health().up, timeout=15)
    finally:
        sink.stop(2.0)
    for snapshot in during:
        at_ms = round(snapshot.time * 1000)
        stored = stored_samples(prometheus, at_ms)
        expected = page_samples(snapshot)
        assert set(stored) == set(expected)
        assert all(same(stored[k], v) for k, v in expected.items())
    count = prometheus.query('count_over_time(gpumon_build_info{job="gpumon"}[1h])', at=during[-1].time + 0.001)
    assert float(count[0]["value"][1]) == 1 + len(during)


def test_gpumon_run_writes_its_page_into_prometheus(prometheus_server, gpumon_run):
    prometheus = prometheus_server(None, *RECEIVER)
    gpumon = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1", "--sinks", "prometheus,remote_write",
                        env={"GPUMON_REMOTE_WRITE_URL": prometheus.url + "/api/v1/write"})

    def series_match() -> bool:
        status, _, body = http_get(gpumon.url + "/metrics")
        stored = {frozenset(r["metric"].items()) for r in prometheus.query('{job="gpumon"}')}
        instance = {dict(key).get("instance") for key in stored}
        if status != 200 or len(instance) != 1:  # no collection yet
            return False
        return parser_keys(body.decode(), instance.pop()) == stored

    wait_for(series_match, timeout=15, interval=0.25)
    assert 'gpumon_sink_up{sink="remote_write"} 1' in gpumon.metrics()
    code, _ = gpumon.stop()
    assert code == 0


def parser_keys(text: str, instance: str) -> set[frozenset]:
    """The page's series as label sets, with the job and instance the sink adds."""
    keys = set()
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if v}
            labels.update({"__name__": sample.name, "job": "gpumon", "instance": instance})
            keys.add(frozenset(labels.items()))
    return keys

"""Scheduled Events against a loopback IMDS stand-in serving the documented JSON: one Event per EventId
and status, the pending series, faults counted without losing the last answer, opt-in acknowledgement
checked by the stand-in, and off Azure unavailable after one short probe."""

from __future__ import annotations

import time

import pytest

from gpumon import imds
from gpumon.collectors.azure_events import OPTIONS, AzureEventsCollector
from gpumon.collectors.base import Context
from gpumon.config import DAEMON, load
from gpumon.model import Collection, Severity
from tests.conftest import closed_port, wait_for
from tests.fakes.imds import EVENTS_PATH, ImdsServer, rfc1123, scheduled_event


@pytest.fixture
def server():
    srv = ImdsServer()
    yield srv
    srv.close()


def collector(url: str, **env: str) -> AzureEventsCollector:
    variables = {"GPUMON_AZURE_IMDS_URL": url, **{f"GPUMON_AZURE_EVENTS_{k.upper()}": v for k, v in env.items()}}
    config = load([DAEMON, imds.OPTIONS, OPTIONS], None, variables, {})
    return AzureEventsCollector(Context("test", config=config), config.sections["azure_events"])


def series(coll: Collection, name: str) -> dict[tuple, float]:
    return {s.labels: s.value for f in coll.families if f.name == name for s in f.samples}


def statuses(coll: Collection) -> list[tuple[str, str]]:
    return [(e.attributes["event_id"], e.attributes["status"]) for e in coll.events]


def test_an_event_moving_scheduled_started_gone_is_reported_once_per_status(server):
    c = collector(server.url)
    assert c.probe().available
    when = time.time() + 900
    server.set_events(scheduled_event("E1", "Reboot", not_before=rfc1123(when), duration=-1))
    first = c.collect()
    assert statuses(first) == [("E1", "Scheduled")]
    (event,) = first.events
    assert event.kind == "azure_scheduled_event" and event.severity is Severity.ERROR
    assert dict(event.subject) == {"event_id": "E1", "type": "Reboot"}
    attrs = event.attributes
    assert (attrs["type"], attrs["source"], attrs["duration_seconds"]) == ("Reboot", "Platform", -1)
    assert attrs["not_before"] == rfc1123(when) and attrs["not_before_timestamp"] == int(when)
    assert attrs["resources"] == ["gpu-node-0_3"] and attrs["description"]
    assert series(first, "gpumon_azure_scheduled_event") == {
        (("type", "Reboot"), ("source", "Platform"), ("status", "Scheduled")): 1.0}
    assert series(first, "gpumon_azure_scheduled_event_not_before_timestamp_seconds") == {
        (("event_id", "E1"), ("type", "Reboot"), ("source", "Platform")): float(int(when))}

    assert c.collect().events == []  # same document: nothing new

    server.set_events(scheduled_event("E1", "Reboot", status="Started", not_before=""))
    started = c.collect()
    assert statuses(started) == [("E1", "Started")]
    assert started.events[0].attributes["not_before_timestamp"] is None
    assert "has started" in started.events[0].message
    assert series(started, "gpumon_azure_scheduled_event_not_before_timestamp_seconds") == {}
    assert series(started, "gpumon_azure_scheduled_event") == {
        (("type", "Reboot"), ("source", "Platform"), ("status", "Started")): 1.0}

    server.set_events()
    gone = c.collect()
    assert statuses(gone) == [("E1", "Removed")] and gone.events[0].severity is Severity.INFO
    assert series(gone, "gpumon_azure_scheduled_event") == {}
    assert series(gone, "gpumon_azure_scheduled_events_document_incarnation") == {(): server.incarnation}
    assert c.collect().events == []


def test_several_events_count_by_type_source_and_status(server):
    c = collector(server.url)
    server.set_events(scheduled_event("A", "Freeze", duration=9),
                      scheduled_event("B", "Freeze", duration=9, source="User"),
                      scheduled_event("C", "Freeze", duration=9),
                      scheduled_event("D", "Preempt", status="Started", not_before=""))
    coll = c.collect()
    assert sorted(statuses(coll)) == [("A", "Scheduled"), ("B", "Scheduled"), ("C", "Scheduled"),
                                      ("D", "Started")]
    assert {e.attributes["event_id"]: e.severity for e in coll.events}["D"] is Severity.CRITICAL
    got = series(coll, "gpumon_azure_scheduled_event")
    assert got[(("type", "Freeze"), ("source", "Platform"), ("status", "Scheduled"))] == 2
    assert got[(("type", "Freeze"), ("source", "User"), ("status", "Scheduled"))] == 1
    assert got[(("type", "Preempt"), ("source", "Platform"), ("status", "Started"))] == 1


@pytest.mark.parametrize("fault, reason", [(404, "imds_http_error"), (500, "imds_http_error"),
                                           ("malformed", "imds_malformed"), (429, "imds_throttled")])
def test_a_failed_poll_is_counted_and_keeps_the_last_answer(server, fault, reason):
    c = collector(server.url)
    server.set_events(scheduled_event("E1", "Freeze"))
    c.collect()
    server.fail(EVENTS_PATH, fault)
    coll = c.collect()
    assert coll.errors == {reason: 1} and coll.events == []
    assert series(coll, "gpumon_azure_scheduled_event")  # the last good document, for a few polls
    server.fail(EVENTS_PATH, None)


def test_a_slow_imds_costs_one_timeout_and_the_event_arrives_once_it_answers(server):
    c = collector(server.url, timeout="0.3")
    server.set_events(scheduled_event("E1", "Redeploy", not_before=""))
    server.hold(EVENTS_PATH)
    started = time.monotonic()
    coll = c.collect()
    assert time.monotonic() - started < 2.0
    assert coll.errors == {"imds_timeout": 1} and coll.events == [] and coll.families == []
    server.release()
    assert statuses(c.collect()) == [("E1", "Scheduled")]


def test_nothing_is_acknowledged_by_default(server):
    c = collector(server.url)
    server.set_events(scheduled_event("E1", "Freeze"), scheduled_event("E2", "Reboot"))
    c.collect()
    c.collect()
    assert server.count(EVENTS_PATH, "POST") == 0


def test_listed_types_are_acknowledged_once_per_event_with_the_documented_body(server):
    c = collector(server.url, acknowledge="Freeze")
    server.set_events(scheduled_event("F1", "Freeze"), scheduled_event("R1", "Reboot"),
                      scheduled_event("F0", "Freeze", status="Started", not_before=""))
    c.collect()
    c.collect()
    assert server.acks == ["F1"]  # the stand-in parsed {"StartRequests": [{"EventId": "F1"}]}
    server.set_events(scheduled_event("F1", "Freeze"), scheduled_event("F2", "Freeze"))
    c.collect()
    assert server.acks == ["F1", "F2"]


def test_a_failed_acknowledgement_is_counted_and_tried_again(server):
    c = collector(server.url, acknowledge="Freeze,Reboot")
    server.set_events(scheduled_event("R1", "Reboot"))
    original = server._acknowledge

    def refuse_once(h, body):
        server._acknowledge = original
        server._send(h, 500, {"error": "busy"})

    server._acknowledge = refuse_once
    assert c.collect().errors == {"acknowledge_http_error": 1}
    assert server.acks == []
    c.collect()
    assert server.acks == ["R1"]


def test_off_azure_unavailable_after_one_short_cached_probe():
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    first = collector(url).probe()
    again = collector(url).probe()  # a second collector on the same IMDS asks nothing
    assert time.monotonic() - started < 1.0
    assert not first.available and "not on Azure" in first.reason
    assert not again.available


def test_the_own_interval_is_ten_seconds_by_default_whatever_the_daemon_says(server):
    assert collector(server.url).interval(60.0) == 10.0
    assert collector(server.url, interval="2").interval(60.0) == 2.0


def test_a_hostile_imds_forges_no_log_line_and_its_infinite_numbers_are_counted(gpumon_run, server):
    """`gpumon run` against an IMDS whose event text holds a newline and a forged log line, then whose
    DocumentIncarnation is Infinity: the text is logged on its own line, escaped; the bad document is
    counted as malformed and logged once; the collector stays up and serving."""
    server.set_events(scheduled_event("E1", "Freeze", description="maintenance\n2026-01-01 00:00:00,000 CRITICAL "
                                      "gpumon.health: forged\x1b[2K"))
    gpumon = gpumon_run("--collectors", "azure_events", "--sinks", "prometheus",
                        env={"GPUMON_AZURE_IMDS_URL": server.url, "GPUMON_AZURE_EVENTS_INTERVAL": "1"})
    wait_for(lambda: 'gpumon_azure_scheduled_event{' in gpumon.metrics(), timeout=10)
    server.fail(EVENTS_PATH, b'{"DocumentIncarnation": Infinity, "Events": []}')
    malformed = 'gpumon_collector_errors_total{collector="azure_events",reason="imds_malformed"}'
    wait_for(lambda: any(line.startswith(malformed) and float(line.split()[-1]) >= 2
                         for line in gpumon.metrics().splitlines()), timeout=10)
    assert 'gpumon_collector_up{collector="azure_events"} 1' in gpumon.metrics()
    code, output = gpumon.stop()
    assert code == 0, output
    assert r"maintenance\x0a2026-01-01 00:00:00,000 CRITICAL gpumon.health: forged\x1b[2K" in output
    assert not any(line.startswith("2026-01-01") or "\x1b" in line for line in output.splitlines())
    assert output.count("Infinity is not JSON") == 1 and "Traceback" not in output

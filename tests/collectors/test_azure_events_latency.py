"""The figure: a Scheduled Event reaches a snapshot (so every sink) within the poll interval + 1 s.

The real loop plans the collector (probe through the shared IMDS client) and runs it on its own
thread; the IMDS is a loopback stand-in. Measured loosely with a 1 s interval.
"""

from __future__ import annotations

import time

import pytest

from gpumon import imds
from gpumon.collectors.azure_events import OPTIONS
from gpumon.collectors.base import Context
from gpumon.config import DAEMON, load
from gpumon.daemon import Loop, plan_collectors
from gpumon.model import Snapshot
from gpumon.sinks.base import Sink, SinkContext
from tests.conftest import wait_for
from tests.fakes.imds import ImdsServer, rfc1123, scheduled_event

INTERVAL = 1.0


class Recorder(Sink):
    name = "recorder"

    def __init__(self) -> None:
        super().__init__(SinkContext("test", "/tmp", "0"))
        self.arrivals: list[tuple[float, Snapshot]] = []

    def publish(self, snapshot: Snapshot) -> None:
        self.arrivals.append((time.monotonic(), snapshot))


def first_arrival(sink: Recorder, event_id: str) -> float | None:
    for when, snap in list(sink.arrivals):
        if any(e.kind == "azure_scheduled_event" and e.subject.get("event_id") == event_id for e in snap.events):
            return when
    return None


@pytest.mark.alone  # its 1 s bound is about this daemon's path to the sinks, not another test's load
def test_a_scheduled_event_reaches_the_sinks_within_the_interval_plus_one_second():
    server = ImdsServer()
    config = load([DAEMON, imds.OPTIONS, OPTIONS], None,
                  {"GPUMON_DAEMON_COLLECTORS": "azure_events", "GPUMON_AZURE_IMDS_URL": server.url,
                   "GPUMON_AZURE_EVENTS_INTERVAL": str(INTERVAL)}, {})
    ctx = Context("test", config=config)
    plan = plan_collectors(ctx.config, ctx)
    assert [p.name for p in plan.running] == ["azure_events"]
    sink = Recorder()
    loop = Loop(config, plan, ctx, [sink])
    loop.start()
    try:
        wait_for(lambda: sink.arrivals, timeout=5)
        worst = 0.0
        for n in range(3):
            posted = time.monotonic()
            server.set_events(scheduled_event(f"E{n}", "Freeze", not_before=rfc1123(time.time() + 900)))
            arrived = wait_for(lambda n=n: first_arrival(sink, f"E{n}"), timeout=INTERVAL + 5)
            worst = max(worst, arrived - posted)
        print(f"\nScheduled Event to snapshot, worst of 3 at a {INTERVAL:g} s interval: {worst:.3f} s")
        assert worst < INTERVAL + 1.0
    finally:
        loop.stop(2)
        server.close()

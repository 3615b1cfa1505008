"""A Scheduled Event reaches a snapshot (so every sink) at the collector's own pace, not the daemon's.

The real loop plans the collector (probe through the shared IMDS client) and runs it on its own
thread; the IMDS is a loopback stand-in. The daemon's interval is an hour here, so an event that
waited for it would never arrive within the test's bound; the figure itself (within the poll
interval + 1 s, whole daemon) is ``python -m bench scheduled_events``.
"""

from __future__ import annotations

import time

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
DAEMON_INTERVAL = 3600.0


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


def test_a_scheduled_event_reaches_the_sinks_at_the_collectors_pace_not_the_daemons():
    server = ImdsServer()
    config = load([DAEMON, imds.OPTIONS, OPTIONS], None,
                  {"GPUMON_DAEMON_COLLECTORS": "azure_events", "GPUMON_AZURE_IMDS_URL": server.url,
                   "GPUMON_DAEMON_INTERVAL": str(DAEMON_INTERVAL),
                   "GPUMON_AZURE_EVENTS_INTERVAL": str(INTERVAL)}, {})
    ctx = Context("test", config=config)
    plan = plan_collectors(ctx.config, ctx)
    assert [p.name for p in plan.running] == ["azure_events"]
    sink = Recorder()
    loop = Loop(config, plan, ctx, [sink])
    loop.start()
    try:
        wait_for(lambda: sink.arrivals, timeout=5)
        for n in range(3):
            server.set_events(scheduled_event(f"E{n}", "Freeze", not_before=rfc1123(time.time() + 900)))
            # bounded far below the daemon's hour: only the collector's own 1 s pace brings it
            assert wait_for(lambda n=n: first_arrival(sink, f"E{n}"), timeout=60)
        assert loop.runners[0].interval == INTERVAL
    finally:
        loop.stop(2)
        server.close()

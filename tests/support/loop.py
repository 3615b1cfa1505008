"""A loop the test drives: :class:`Scripted` collectors (return, raise, hang, go unavailable on
demand), a :class:`Recorder` sink keeping every snapshot, and the ``loop_of`` fixture that starts a
loop and stops it after the test (a module takes it with ``loop_of = loops.loop_of``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gpumon.cli import schemas
from gpumon.collectors.base import Collector, CollectorUnavailable, Context
from gpumon.config import load
from gpumon.daemon import Loop, Plan, PlannedCollector
from gpumon.model import Collection, Event, MetricSpec, MetricType, Snapshot, StateReason
from gpumon.sinks.base import Sink, SinkContext

VALUE = MetricSpec("gpumon_test_value", MetricType.GAUGE, "A test value.", labels=("source",))


class Scripted(Collector):
    """A collector whose next behaviour the test chooses: return, raise, hang, or go unavailable."""

    name = "scripted"

    def __init__(self, name: str) -> None:
        super().__init__(Context(hostname="test"))
        self.name = name
        self.mode = "ok"
        self.release = threading.Event()
        self.runs = 0
        self.events: list[Event] = []

    def collect(self) -> Collection:
        self.runs += 1
        if self.mode == "raise":
            raise RuntimeError("sensor on fire")
        if self.mode == "hang":
            self.release.wait(30)
        if self.mode == "unavailable":
            raise CollectorUnavailable("driver not loaded", StateReason.DRIVER_NOT_LOADED)
        result = Collection()
        result.add(VALUE, [VALUE.sample(self.runs, self.name)])
        result.count_error("parse", 2)
        result.events.extend(self.events)
        self.events = []
        return result


class Recorder(Sink):
    name = "recorder"

    def __init__(self) -> None:
        super().__init__(SinkContext("test", "/tmp", "0"))
        self.snapshots: list[Snapshot] = []

    def publish(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)


def make_loop(*collectors: Scripted, interval: float = 0.05, deadline: float = 0.5,
              health: Any = None) -> tuple[Loop, Recorder]:
    config = load(schemas(), None, {"GPUMON_DAEMON_INTERVAL": str(interval),
                                    "GPUMON_DAEMON_DEADLINE": str(deadline)}, {})
    plan = Plan([PlannedCollector(c.name, c, True, True) for c in collectors])
    sink = Recorder()
    return Loop(config, plan, Context(hostname="test"), [sink], health=health), sink


@pytest.fixture
def loop_of():
    loops: list[Loop] = []

    def make(*collectors, **kw):
        loop, sink = make_loop(*collectors, **kw)
        loops.append(loop)
        loop.start()
        return loop, sink

    yield make
    for loop in loops:
        for runner in loop.runners:
            runner.collector.release.set()
        loop.stop(2)


def latest(sink: Recorder) -> Snapshot:
    return sink.snapshots[-1]

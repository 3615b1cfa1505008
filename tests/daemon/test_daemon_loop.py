"""The loop: own thread per collector, deadlines, withdrawal of series, events, self-metrics."""

from __future__ import annotations

import threading

from gpumon.cli import schemas
from gpumon.collectors.base import Context
from gpumon.config import load
from gpumon.daemon import Plan, PlannedCollector, collect_once
from gpumon.model import Event, Severity, Snapshot
from tests.conftest import series, wait_for
from tests.support import loop as loops
from tests.support.loop import Scripted, latest, make_loop

loop_of = loops.loop_of  # the fixture, shared with this module


def test_results_compose_into_snapshots_with_self_metrics(loop_of):
    a, b = Scripted("a"), Scripted("b")
    loop, sink = loop_of(a, b)
    wait_for(lambda: len(series(latest(sink), "gpumon_test_value")) == 2)
    snap = latest(sink)
    assert series(snap, "gpumon_collector_up") == {(("collector", "a"),): 1, (("collector", "b"),): 1}
    assert series(snap, "gpumon_collector_errors_total")[(("collector", "a"), ("reason", "parse"))] >= 2
    assert snap.family("gpumon_build_info") is not None
    assert snap.family("process_resident_memory_bytes") is not None
    assert [c.name for c in snap.collectors] == ["a", "b"] and all(c.ok for c in snap.collectors)


def test_raising_collector_is_down_withdrawn_and_recovers(loop_of):
    bad, good = Scripted("bad"), Scripted("good")
    loop, sink = loop_of(bad, good)
    wait_for(lambda: (("source", "bad"),) in series(latest(sink), "gpumon_test_value"))
    bad.mode = "raise"
    wait_for(lambda: series(latest(sink), "gpumon_collector_up").get((("collector", "bad"),)) == 0)
    snap = latest(sink)
    assert (("source", "bad"),) not in series(snap, "gpumon_test_value")  # withdrawn, not stale
    runs_before = good.runs
    wait_for(lambda: good.runs > runs_before + 3)  # the other collector keeps going
    downs = [e for s in sink.snapshots for e in s.events if e.kind == "collector_down"]
    assert len(downs) == 1 and "sensor on fire" in downs[0].message  # reported once, not every run
    status = {c.name: c for c in latest(sink).collectors}["bad"]
    assert not status.ok and "RuntimeError" in status.error
    bad.mode = "ok"
    wait_for(lambda: (("source", "bad"),) in series(latest(sink), "gpumon_test_value"))
    assert series(latest(sink), "gpumon_collector_errors_total")[(("collector", "bad"), ("reason", "exception"))] >= 1


def test_hung_collector_misses_deadline_without_stalling_others(loop_of):
    hung, good = Scripted("hung"), Scripted("good")
    hung.mode = "hang"
    loop, sink = loop_of(hung, good, deadline=0.3)
    wait_for(lambda: series(latest(sink), "gpumon_collector_up").get((("collector", "hung"),)) == 0, timeout=5)
    status = {c.name: c for c in latest(sink).collectors}["hung"]
    assert "deadline" in status.error
    runs_before = good.runs
    wait_for(lambda: good.runs > runs_before + 3)
    assert series(latest(sink), "gpumon_collector_up")[(("collector", "good"),)] == 1
    hung.mode = "ok"
    hung.release.set()
    wait_for(lambda: series(latest(sink), "gpumon_collector_up").get((("collector", "hung"),)) == 1)


def test_events_reach_one_snapshot_each(loop_of):
    a = Scripted("a")
    a.events = [Event("gpu_xid", Severity.CRITICAL, {"gpu": "0"}, "XID 79")]
    loop, sink = loop_of(a)
    wait_for(lambda: a.runs > 3)
    seen = [e for s in list(sink.snapshots) for e in s.events if e.kind == "gpu_xid"]
    assert len(seen) == 1


def test_unavailable_at_run_time_is_reported_as_such(loop_of):
    a = Scripted("a")
    a.mode = "unavailable"
    loop, sink = loop_of(a)
    wait_for(lambda: latest(sink).collectors[0].error == "driver not loaded")
    assert not latest(sink).collectors[0].available
    assert series(latest(sink), "gpumon_collector_errors_total")[(("collector", "a"), ("reason", "unavailable"))] >= 1


def test_once_bounds_a_hung_collector():
    hung, good = Scripted("hung"), Scripted("good")
    hung.mode = "hang"
    config = load(schemas(), None, {"GPUMON_DAEMON_DEADLINE": "0.2"}, {})
    plan = Plan([PlannedCollector(c.name, c, True, True) for c in (hung, good)])
    snapshot = collect_once(config, plan, Context(hostname="t"))
    hung.release.set()
    status = {c.name: c for c in snapshot.collectors}
    assert status["good"].ok and not status["hung"].ok and "deadline" in status["hung"].error
    assert list(series(snapshot, "gpumon_test_value")) == [(("source", "good"),)]


def test_stop_is_prompt_with_a_hung_collector():
    import time

    hung = Scripted("hung")
    hung.mode = "hang"
    loop, sink = make_loop(hung)
    loop.start()
    t0 = time.monotonic()
    loop.stop(2.0)
    hung.release.set()
    assert time.monotonic() - t0 < 2.5


class Broken(Scripted):
    """Returns something that is not a Collection on its second run."""

    def collect(self):
        result = super().collect()
        return {"oops": 1} if self.runs == 2 else result


def test_a_result_that_is_not_a_collection_marks_down_instead_of_going_stale(loop_of):
    broken = Broken("broken")
    loop, sink = loop_of(broken)
    wait_for(lambda: series(latest(sink), "gpumon_collector_up").get((("collector", "broken"),)) == 0)
    assert (("source", "broken"),) not in series(latest(sink), "gpumon_test_value")
    status = latest(sink).collectors[0]
    assert "not a Collection" in status.error
    wait_for(lambda: series(latest(sink), "gpumon_collector_up").get((("collector", "broken"),)) == 1)


class Slow(Scripted):
    def collect(self):
        import time

        time.sleep(0.4)
        return super().collect()


def test_runs_that_always_finish_late_keep_the_collector_down(loop_of):
    slow = Slow("slow")
    loop, sink = loop_of(slow, deadline=0.2)
    wait_for(lambda: slow.runs >= 4, timeout=10)
    snap = latest(sink)
    assert series(snap, "gpumon_collector_up")[(("collector", "slow"),)] == 0
    assert (("source", "slow"),) not in series(snap, "gpumon_test_value")
    downs = [e for s in sink.snapshots for e in s.events if e.kind == "collector_down"]
    assert len(downs) == 1  # one outage, not one event per late run


class HangingProbe(Scripted):
    def probe(self):
        from gpumon.collectors.base import Availability

        self.release.wait(30)
        return Availability(True)


def test_a_probe_that_hangs_is_unavailable_after_the_deadline():
    import time

    from gpumon.daemon.plan import _probe

    collector = HangingProbe("hp")
    t0 = time.monotonic()
    available, reason, finished, retry, cause = _probe(collector, 0.3)
    collector.release.set()
    assert not available and not finished and not retry and "did not answer within 0.3 s" in reason
    assert cause == "deadline_exceeded"
    assert time.monotonic() - t0 < 2


def test_once_deadlines_run_in_parallel_not_one_after_another():
    import time

    hung = [Scripted(f"h{i}") for i in range(4)]
    for c in hung:
        c.mode = "hang"
    config = load(schemas(), None, {"GPUMON_DAEMON_DEADLINE": "0.5"}, {})
    plan = Plan([PlannedCollector(c.name, c, True, True) for c in hung])
    t0 = time.monotonic()
    snapshot = collect_once(config, plan, Context(hostname="t"))
    elapsed = time.monotonic() - t0
    for c in hung:
        c.release.set()
    assert all(not c.ok for c in snapshot.collectors)
    assert elapsed < 1.5, elapsed


class SlowHealth:
    """A health stage whose evaluation stalls (a slow disk under its state file, a hung action)."""

    def __init__(self, seconds: float) -> None:
        import tempfile

        from gpumon.health.rules import Thresholds
        from gpumon.health.stage import HealthSettings, HealthStage

        self.stage = HealthStage(tempfile.mkdtemp(), HealthSettings(Thresholds()), persist=False)
        self.seconds = seconds
        self.updates = 0

    def update(self, snapshot: Snapshot):
        self.updates += 1
        threading.Event().wait(self.seconds)
        return self.stage.update(snapshot)

    def verdict(self):
        return self.stage.verdict()

    def close(self) -> None:
        pass


def test_a_slow_health_evaluation_never_makes_a_fast_collector_late(loop_of) -> None:
    """The rules run outside the loop's lock: a collector handing in a run while the health stage
    takes longer than the collector's deadline is not reported down."""
    fast = Scripted("fast")
    slow = SlowHealth(1.2)
    loop, sink = make_loop(fast, interval=0.1, deadline=0.5, health=slow)
    loop.start()
    try:
        wait_for(lambda: slow.updates >= 3, timeout=20)
        downs = [e for s in sink.snapshots for e in s.events if e.kind == "collector_down"]
        assert downs == []
        assert all(s.collectors[0].ok for s in sink.snapshots if s.collectors and s.collectors[0].name == "fast"
                   and s.collectors[0].error != "no run yet")
    finally:
        loop.stop(2.0)


def test_a_collector_that_has_not_run_keeps_one_status_object() -> None:
    """Sinks tell a new run by the status object (has_new_results): a placeholder must not be new on
    every compose."""
    waiting = Scripted("waiting")
    loop, _ = make_loop(waiting)
    first, second = loop.compose(), loop.compose()
    assert first.collectors[0] is second.collectors[0]

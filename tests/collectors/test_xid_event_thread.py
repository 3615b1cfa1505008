"""XIDs end to end: the driver posts an event, the watcher thread blocked in nvmlEventSetWait_v2 picks it
up, collect() turns it into a gpu_xid event and a counter; XID 79 / GPU-unavailable mark the GPU lost for
the nvml collector too; recovery-action events (R565+); a lost GPU in the set does not deafen the thread;
the totals survive a reload; close() stops the thread promptly."""

from __future__ import annotations

import threading
import time

import pynvml
import pytest

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.collectors.xid import XidCollector
from gpumon.model import Collection, Severity
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import wait_for
from tests.support.nvml import Clock, assert_watched_again, xid_counts


def rig(count: int = 4, driver: str = "550.90.07") -> tuple[FakeNVML, Context, XidCollector]:
    fake = FakeNVML("h100-sxm5-80gb", count, driver_version=driver)
    ctx = Context(hostname="test", nvml=fake)
    x = XidCollector(ctx)
    x.collect()
    wait_for(lambda: x._watching.is_set(), 5)
    return fake, ctx, x


def collect_until(x: XidCollector, kind: str) -> Collection:
    def attempt() -> Collection | None:
        out = x.collect()
        return out if any(e.kind == kind for e in out.events) else None

    return wait_for(attempt, 5)  # type: ignore[return-value]


def test_xid_becomes_an_event_with_meaning_and_a_counter() -> None:
    fake, _, x = rig()
    fake.inject_xid(2, 48)
    out = collect_until(x, "gpu_xid")
    event = next(e for e in out.events if e.kind == "gpu_xid")
    assert event.subject["gpu"] == "2" and event.subject["uuid"].startswith("GPU-")
    assert event.severity is Severity.CRITICAL
    assert event.attributes["xid"] == 48 and "Double-bit ECC" in event.attributes["meaning"]
    assert xid_counts(out) == {("2", "48"): 1.0}
    fake.inject_xid(2, 48)
    fake.inject_xid(0, 13)
    out = wait_for(lambda: (o := x.collect()) and len(xid_counts(o)) == 2 and o, 5)
    assert xid_counts(out) == {("2", "48"): 2.0, ("0", "13"): 1.0}   # counts, never "the last XID"
    assert "gpumon_gpu_xid_errors_total" in {m.name for m in XidCollector.metrics()}
    x.close()


def test_unknown_xid_is_reported_with_a_generic_meaning() -> None:
    fake, _, x = rig()
    fake.inject_xid(1, 4242)
    event = next(e for e in collect_until(x, "gpu_xid").events if e.kind == "gpu_xid")
    assert event.severity is Severity.ERROR and "4242" in event.message
    x.close()


def both_watching(fake: FakeNVML, clock: Clock) -> tuple[NvmlSession, NvmlCollector, XidCollector]:
    """The nvml collector and the XID watcher on one session, after a first run, the thread waiting."""
    ctx = Context(hostname="test", nvml=fake)
    session = ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    c = NvmlCollector(ctx)
    x = XidCollector(ctx)
    c.collect()
    x.collect()
    wait_for(lambda: x._watching.is_set(), 5)
    return session, c, x


def test_xid_79_marks_the_gpu_lost_for_the_nvml_collector() -> None:
    fake = FakeNVML("h100-sxm5-80gb", 4)
    clock = Clock()
    _, c, x = both_watching(fake, clock)
    fake.set_lost(3)                       # falls off the bus: XID 79, every call GPU_IS_LOST
    out_x = collect_until(x, "gpu_xid")
    assert xid_counts(out_x) == {("3", "79"): 1.0}
    kinds = [e.kind for e in out_x.events]
    out = c.collect()
    kinds += [e.kind for e in out.events]
    assert kinds.count("gpu_lost") == 1
    lost = {s.label("gpu"): s.value for f in out.families if f.name == "gpumon_gpu_lost" for s in f.samples}
    assert lost == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 1.0}
    assert {s.label("gpu") for f in out.families if f.name == "gpumon_gpu_power_watts" for s in f.samples} \
        == {"0", "1", "2"}
    # back after a reset: asked again a minute later, recovered with a gpu_recovered event
    fake.restore(3)
    clock.t += 61
    out = c.collect()
    assert any(e.kind == "gpu_recovered" for e in out.events)
    assert "3" in {s.label("gpu") for f in out.families if f.name == "gpumon_gpu_power_watts" for s in f.samples}
    c.close()
    x.close()


def test_gpu_unavailable_and_recovery_action_events() -> None:
    fake, ctx, x = rig(driver="580.65.06")
    fake.set_recovery_action(1, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    out = collect_until(x, "gpu_recovery_action")
    event = next(e for e in out.events if e.kind == "gpu_recovery_action")
    assert event.attributes["action"] == "gpu_reset" and event.severity is Severity.ERROR
    fake.inject_event(0, pynvml.nvmlEventTypeGpuUnavailableError, 0)
    out = collect_until(x, "gpu_unavailable")
    assert any(e.kind == "gpu_lost" and e.subject["gpu"] == "0" for e in out.events)
    assert ctx.get_shared("nvml", lambda: None).devices[0].lost
    x.close()


def test_close_stops_the_thread_promptly() -> None:
    _, _, x = rig(1)
    thread = x._thread
    assert thread is not None and thread.is_alive()
    t0 = time.monotonic()
    x.close()
    assert time.monotonic() - t0 < 1.5
    assert not thread.is_alive()


def test_watcher_restarts_after_nvml_reinitialises() -> None:
    fake, ctx, x = rig(2)
    session = ctx.get_shared("nvml", lambda: None)
    first = x._thread
    session.invalidate("driver reloaded")

    def collected() -> bool:
        try:
            x.collect()
        except CollectorUnavailable:
            return False     # inside the 1 s re-init backoff
        return True

    wait_for(collected, 5)
    wait_for(lambda: x._watching.is_set(), 5)
    assert x._thread is not first and first is not None and not first.is_alive()
    fake.inject_xid(1, 31)
    assert xid_counts(collect_until(x, "gpu_xid")) == {("1", "31"): 1.0}
    x.close()


def test_event_wait_errors_are_counted_not_fatal() -> None:
    fake, _, x = rig(1)
    fake.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_UNKNOWN, times=1)
    out = wait_for(lambda: (o := x.collect()) and o.errors and o, 5)
    assert out.errors == {"nvml_unknown": 1}
    fake.inject_xid(0, 94)
    assert xid_counts(collect_until(x, "gpu_xid")) == {("0", "94"): 1.0}
    x.close()


def test_a_550_driver_registers_xids_alone_and_still_counts_them() -> None:
    """GPU-unavailable and recovery-action events exist from R565: asking for them on a 550 driver would
    make the registration fail (NOT_SUPPORTED), and no XID would be reported at all."""
    fake, _, x = rig(2)
    fake.set_recovery_action(1, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)   # no such event on 550
    fake.inject_xid(1, 94)
    out = collect_until(x, "gpu_xid")
    assert xid_counts(out) == {("1", "94"): 1.0}
    assert not out.errors
    assert not any(e.kind == "gpu_recovery_action" for e in out.events)
    x.close()


def lost_gauge(out: Collection) -> dict[str, float]:
    return {s.label("gpu") or "": s.value for f in out.families if f.name == "gpumon_gpu_lost" for s in f.samples}


def watcher_up(out: Collection) -> float:
    return next(s.value for f in out.families if f.name == "gpumon_xid_watcher_up" for s in f.samples)


@pytest.mark.parametrize("xid79", [True, False])
def test_a_gpu_lost_from_the_event_set_does_not_deafen_the_watcher(xid79: bool) -> None:
    """Every wait answers GPU_IS_LOST while a lost GPU is in the set: the thread finds the GPU, marks it
    lost for both collectors, and rebuilds the set without it; the other GPUs' XIDs keep coming, and the
    GPU's own once it answers again."""
    fake = FakeNVML("h100-sxm5-80gb", 4)
    clock = Clock()
    session, c, x = both_watching(fake, clock)
    first_sets = set(fake._sets)
    fake.set_lost(2, xid=xid79)            # without XID 79 only the wait's GPU_IS_LOST tells
    wait_for(lambda: session.devices[2].lost, 5)
    wait_for(lambda: x._watching.is_set() and set(fake._sets) - first_sets, 5)
    assert all(fake._sets[sid].freed for sid in first_sets)      # the old set was freed
    fake.inject_xid(0, 13)
    runs: list[Collection] = []
    wait_for(lambda: runs.append(x.collect()) or xid_counts(runs[-1]).get(("0", "13")), 5)
    counts = xid_counts(runs[-1])
    assert counts.get(("2", "79"), 0.0) == (1.0 if xid79 else 0.0)
    assert watcher_up(runs[-1]) == 1.0
    assert sum(r.errors.get("nvml_gpu_is_lost", 0) for r in runs) <= 1   # counted, not in a loop
    runs.append(c.collect())
    assert [e.kind for r in runs for e in r.events].count("gpu_lost") == 1
    assert lost_gauge(runs[-1]) == {"0": 0.0, "1": 0.0, "2": 1.0, "3": 0.0}
    # after a reset the nvml collector finds it again, and the watcher takes it back into the set
    fake.restore(2)
    clock.t += 61
    assert lost_gauge(c.collect())["2"] == 0.0
    assert_watched_again(fake, x, 2)
    c.close()
    x.close()


def test_xid_in_mig_gpu_instance_0_keeps_its_instance() -> None:
    """0xFFFFFFFF means "no MIG instance"; GPU instance 0 is a real one."""
    fake, _, x = rig(2)
    fake.inject_xid(1, 43, gpu_instance=0, compute_instance=0)
    event = next(e for e in collect_until(x, "gpu_xid").events if e.kind == "gpu_xid")
    assert event.attributes["gpu_instance"] == 0 and event.attributes["compute_instance"] == 0
    fake.inject_xid(1, 43)
    event = next(e for e in collect_until(x, "gpu_xid").events if e.kind == "gpu_xid")
    assert "gpu_instance" not in event.attributes
    x.close()


def test_reload_takes_over_the_xid_and_recovery_totals() -> None:
    fake, ctx, old = rig(2, driver="580.65.06")
    fake.inject_xid(1, 48)
    fake.set_recovery_action(1, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    wait_for(lambda: xid_counts(old.collect()) and len(old._recovery) == 1, 5)
    fake.inject_xid(1, 48)                            # seen by the old thread, not yet published
    wait_for(lambda: len(old._queue) == 1, 5)
    old.close()
    new = XidCollector(ctx)
    new.inherit(old)
    out = new.collect()
    assert xid_counts(out) == {("1", "48"): 2.0}     # no reset, and the queued one is not lost
    assert [e.attributes["xid"] for e in out.events if e.kind == "gpu_xid"] == [48]
    recovery = {s.label("action"): s.value for f in out.families
                if f.name == "gpumon_gpu_recovery_action_events_total" for s in f.samples}
    assert recovery == {"gpu_reset": 1.0}
    wait_for(lambda: new._watching.is_set(), 5)
    fake.inject_xid(1, 48)
    wait_for(lambda: xid_counts(new.collect()) == {("1", "48"): 3.0}, 5)
    new.close()


def test_a_gpu_recovering_while_the_event_set_is_rebuilt_is_registered_again() -> None:
    """The recovery lands between registering the new set and waiting on it (the nvml collector's
    thread, any time): the set is rebuilt once more with that GPU, and its XIDs keep coming."""
    fake = FakeNVML("h100-sxm5-80gb", 4)
    clock = Clock()
    session, c, x = both_watching(fake, clock)
    register, armed = x._register, threading.Event()

    def register_then_recover(event_set):
        members = register(event_set)
        if armed.is_set() and session.devices[2].lost:
            armed.clear()
            fake.restore(2)
            clock.t += 61
            c.collect()                      # finds GPU 2 again: a recovery in the gap
            assert not session.devices[2].lost
        return members

    x._register = register_then_recover
    armed.set()
    fake.set_lost(2, xid=False)
    wait_for(lambda: not armed.is_set(), 5)
    assert_watched_again(fake, x, 2)
    c.close()
    x.close()

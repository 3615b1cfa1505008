"""XIDs end to end: the driver posts an event, the watcher thread blocked in nvmlEventSetWait_v2 picks it
up, collect() turns it into a gpu_xid event and a counter; XID 79 / GPU-unavailable mark the GPU lost for
the nvml collector too; recovery-action events; close() stops the thread promptly."""

from __future__ import annotations

import time

import pynvml

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.collectors.xid import XidCollector
from gpumon.model import Collection, Severity
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig(count: int = 4) -> tuple[FakeNVML, Context, XidCollector]:
    fake = FakeNVML("h100-sxm5-80gb", count)
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


def xid_counts(out: Collection) -> dict[tuple[str, str], float]:
    return {(s.label("gpu") or "", s.label("xid") or ""): s.value for f in out.families
            if f.name == "gpumon_gpu_xid_errors_total" for s in f.samples}


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


def test_xid_79_marks_the_gpu_lost_for_the_nvml_collector() -> None:
    fake = FakeNVML("h100-sxm5-80gb", 4)
    clock = Clock()
    ctx = Context(hostname="test", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    c = NvmlCollector(ctx)
    c._clock = clock
    x = XidCollector(ctx)
    c.collect()
    x.collect()
    wait_for(lambda: x._watching.is_set(), 5)
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
    fake, ctx, x = rig()
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

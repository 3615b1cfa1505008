"""One GPU that fails discovery does not take down the nvml and xid collectors: NVML still counts it, so
it is kept and reported lost (its UUID may be unknown), or, when NVML refuses it to this process, left out
and said once. A discovery that fails as a whole gives back its nvmlInit."""

from __future__ import annotations

import logging

import pynvml
import pytest

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import UNKNOWN_UUID, NvmlSession
from gpumon.collectors.nvml_tables import error_name
from gpumon.collectors.xid import XidCollector
from gpumon.model import Collection
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import wait_for
from tests.support.nvml import assert_watched_again


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig(count: int = 4) -> tuple[FakeNVML, NvmlCollector, XidCollector, Clock]:
    fake = FakeNVML("h100-sxm5-80gb", count)
    clock = Clock()
    ctx = Context(hostname="test", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    c = NvmlCollector(ctx)
    return fake, c, XidCollector(ctx), clock


def lost(out: Collection) -> dict[tuple[str, str], float]:
    return {(s.label("gpu") or "", s.label("uuid") or ""): s.value for f in out.families
            if f.name == "gpumon_gpu_lost" for s in f.samples}


def gpus_with(out: Collection, name: str) -> set[str]:
    return {s.label("gpu") or "" for f in out.families if f.name == name for s in f.samples}


def xid_counts(out: Collection) -> dict[tuple[str, str], float]:
    return {(s.label("gpu") or "", s.label("xid") or ""): s.value for f in out.families
            if f.name == "gpumon_gpu_xid_errors_total" for s in f.samples}


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_IRQ_ISSUE,
                                  pynvml.NVML_ERROR_UNKNOWN])
def test_a_gpu_without_a_handle_is_reported_lost_and_the_others_are_collected(code: int) -> None:
    fake, c, x, clock = rig()
    fake.fail("nvmlDeviceGetHandleByIndex", code, gpu=2)
    assert c.probe().available and x.probe().available
    out = c.collect()
    assert lost(out) == {("0", fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(0))): 0.0,
                         ("1", fake._gpus[1].uuid): 0.0, ("2", UNKNOWN_UUID): 1.0, ("3", fake._gpus[3].uuid): 0.0}
    assert gpus_with(out, "gpumon_gpu_power_watts") == {"0", "1", "3"}
    events = [e for e in out.events if e.kind == "gpu_lost"]
    assert len(events) == 1 and events[0].subject == {"gpu": "2", "uuid": UNKNOWN_UUID}
    assert "nvmlDeviceGetHandleByIndex" in events[0].attributes["reason"]
    assert out.errors[f"nvml_{error_name(code)}"] == 1   # the discovery error is counted once
    # the xid collector runs too, on the GPUs that answer
    x.collect()
    wait_for(lambda: x._watching.is_set(), 5)
    fake.inject_xid(3, 94)
    wait_for(lambda: xid_counts(x.collect()) == {("3", "94"): 1.0}, 5)
    assert not [e for e in c.collect().events if e.kind == "gpu_lost"]   # said once
    # it answers a minute later: collected again, under the UUID it now reports
    fake.clear_faults()
    clock.t += 61
    out = c.collect()
    assert lost(out)[("2", fake._gpus[2].uuid)] == 0.0 and ("2", UNKNOWN_UUID) not in lost(out)
    assert "2" in gpus_with(out, "gpumon_gpu_power_watts")
    assert any(e.kind == "gpu_recovered" and e.subject["uuid"] == fake._gpus[2].uuid for e in out.events)
    # and the XID watcher takes it into its event set
    assert_watched_again(fake, x, 2)
    c.close()
    x.close()


def test_a_gpu_whose_uuid_cannot_be_read_is_lost_with_an_unknown_uuid() -> None:
    fake, c, x, clock = rig(2)
    fake.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_IRQ_ISSUE, gpu=1, times=1)
    out = c.collect()
    assert lost(out) == {("0", fake._gpus[0].uuid): 0.0, ("1", UNKNOWN_UUID): 1.0}
    assert out.errors["nvml_irq_issue"] == 1
    event = next(e for e in out.events if e.kind == "gpu_lost")
    assert event.message.startswith("GPU 1 is lost") and "nvmlDeviceGetUUID" in event.message
    clock.t += 61
    out = c.collect()
    assert lost(out) == {("0", fake._gpus[0].uuid): 0.0, ("1", fake._gpus[1].uuid): 0.0}
    c.close()
    x.close()


def test_a_gpu_refused_to_this_process_is_left_out_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    fake, c, x, clock = rig(4)
    fake.fail("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_NO_PERMISSION, gpu=3)
    caplog.set_level(logging.WARNING, logger="gpumon.nvml")
    out = c.collect()
    assert gpus_with(out, "gpumon_gpu_lost") == {"0", "1", "2"}   # not ours to watch: not "lost" either
    assert not [e for e in out.events if e.kind == "gpu_lost"]
    assert out.errors["nvml_no_permission"] == 1
    assert set(c.session.skipped) == {3}
    c.session.invalidate("driver reloaded")                 # a second discovery, same answer
    clock.t += 1
    c.collect()
    assert len([r for r in caplog.records if "GPU 3 left out" in r.getMessage()]) == 1
    c.close()
    x.close()


@pytest.mark.parametrize(("function", "code"), [
    ("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN),
    ("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_DRIVER_NOT_LOADED),   # NVML itself gone mid-way
])
def test_a_discovery_that_fails_as_a_whole_gives_back_its_nvml_init(function: str, code: int) -> None:
    fake, c, x, clock = rig(2)
    fake.fail(function, code, times=1)
    with pytest.raises(CollectorUnavailable, match="NVML init failed"):
        c.collect()
    assert fake.calls["nvmlInitWithFlags"] == fake.calls["nvmlShutdown"] == 1
    assert fake._inits == 0
    clock.t += 1                                           # after the backoff it comes up
    assert gpus_with(c.collect(), "gpumon_gpu_lost") == {"0", "1"}
    assert fake._inits == 1
    c.close()
    x.close()
    assert fake._inits == 0

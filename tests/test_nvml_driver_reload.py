"""No library / no driver / version mismatch: the collector is unavailable with the reason, retries init
with backoff, and comes back (with the GPUs rediscovered) once the driver is loaded again."""

from __future__ import annotations

import pynvml
import pytest

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.collectors.xid import XidCollector
from gpumon.simulate.nvml import FakeNVML


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig() -> tuple[FakeNVML, NvmlCollector, Clock, Context]:
    fake = FakeNVML("h100-sxm5-80gb", 2)
    clock = Clock()
    ctx = Context(hostname="test", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    c = NvmlCollector(ctx)
    c._clock = clock
    return fake, c, clock, ctx


@pytest.mark.parametrize(("code", "text"), [
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "version mismatch"),
])
def test_init_failure_is_unavailable_then_recovers_after_backoff(code: int, text: str) -> None:
    fake, c, clock, _ = rig()
    fake.fail_init(code)
    availability = c.probe()
    assert not availability.available and text in availability.reason
    with pytest.raises(CollectorUnavailable, match=text):
        c.collect()
    assert fake.calls["nvmlInitWithFlags"] == 1   # only the probe tried: the backoff holds
    fake.fail_init(None)                   # the driver is back
    with pytest.raises(CollectorUnavailable):
        c.collect()                        # still inside the backoff window
    clock.t += 1.0
    out = c.collect()
    assert {s.label("gpu") for f in out.families if f.name == "gpumon_gpu_power_watts" for s in f.samples} \
        == {"0", "1"}
    assert c.probe().available
    c.close()


def test_backoff_grows_while_the_driver_stays_away() -> None:
    fake, c, clock, _ = rig()
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    tries = []
    for _ in range(40):
        clock.t += 1.0
        before = fake.calls["nvmlInitWithFlags"]
        with pytest.raises(CollectorUnavailable):
            c.collect()
        tries.append(fake.calls["nvmlInitWithFlags"] - before)
    assert sum(tries) <= 7        # 1, 2, 4, 8, 16 s ... not every second
    c.close()


def test_driver_unloaded_mid_run_reinitialises_and_rediscovers() -> None:
    fake, c, clock, _ = rig()
    c.collect()
    generation = c.session.generation
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_DRIVER_NOT_LOADED, times=1)
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, times=1)
    with pytest.raises(CollectorUnavailable, match="Driver Not Loaded"):
        c.collect()
    clock.t += 1.0
    with pytest.raises(CollectorUnavailable):
        c.collect()                               # init fails once more while the module reloads
    clock.t += 2.0
    out = c.collect()
    assert c.session.generation == generation + 1
    assert {s.label("gpu") for f in out.families if f.name == "gpumon_gpu_info" for s in f.samples} == {"0", "1"}
    c.close()


def test_session_is_shared_and_shut_down_by_the_last_user() -> None:
    fake, c, _, ctx = rig()
    x = XidCollector(ctx)
    assert x.session is c.session
    c.collect()
    x.collect()
    assert fake.calls["nvmlInitWithFlags"] == 1
    c.close()
    assert fake.calls["nvmlShutdown"] == 0
    x.close()
    assert fake.calls["nvmlShutdown"] == 1

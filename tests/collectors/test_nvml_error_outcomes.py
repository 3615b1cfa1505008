"""Every NVML error class of the reference table, per call and per field, has its outcome: metric absent
(dropped and re-probed hourly, or absent just this run), GPU lost, or collector unavailable. None
escapes collect() as anything but CollectorUnavailable."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.config import Section
from gpumon.model import Collection
from gpumon.simulate.nvml import FakeNVML

UNSUPPORTED = [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION,
               pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_DEPRECATED]
LOST = [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_GPU_NOT_FOUND]
UNAVAILABLE = [pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
               pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, pynvml.NVML_ERROR_UNINITIALIZED]
TRANSIENT = [pynvml.NVML_ERROR_TIMEOUT, pynvml.NVML_ERROR_INSUFFICIENT_SIZE, pynvml.NVML_ERROR_UNKNOWN,
             pynvml.NVML_ERROR_IRQ_ISSUE, pynvml.NVML_ERROR_CORRUPTED_INFOROM,
             pynvml.NVML_ERROR_OPERATING_SYSTEM, pynvml.NVML_ERROR_MEMORY, pynvml.NVML_ERROR_NO_DATA,
             pynvml.NVML_ERROR_NOT_READY, pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES]
OUTCOMES = ([(c, "dropped") for c in UNSUPPORTED] + [(c, "lost") for c in LOST]
            + [(c, "unavailable") for c in UNAVAILABLE] + [(c, "absent_once") for c in TRANSIENT])


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig(count: int = 2, **opts: Any) -> tuple[FakeNVML, NvmlCollector, Clock]:
    fake = FakeNVML("h100-sxm5-80gb", count)
    clock = Clock()
    ctx = Context(hostname="test", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    values = {o.key: o.default for o in NvmlCollector.options.options}
    values.update(opts)
    c = NvmlCollector(ctx, Section("nvml", values))
    return fake, c, clock


def gpus_with(out: Collection, name: str, **labels: str) -> set[str]:
    return {s.label("gpu") or "" for f in out.families if f.name == name for s in f.samples
            if all(s.label(k) == v for k, v in labels.items())}


def gpu_series(out: Collection, gpu: str) -> set[str]:
    return {f.name for f in out.families for s in f.samples if s.label("gpu") == gpu}


def check_lost(fake: FakeNVML, c: NvmlCollector, out: Collection) -> None:
    lost = {s.label("gpu"): s.value for f in out.families if f.name == "gpumon_gpu_lost" for s in f.samples}
    assert lost == {"0": 0.0, "1": 1.0}
    assert gpu_series(out, "1") == {"gpumon_gpu_lost"}   # every other series of GPU 1 withdrawn
    assert "gpumon_gpu_power_watts" in gpu_series(out, "0")  # GPU 0 unaffected
    events = [e for e in out.events if e.kind == "gpu_lost"]
    assert len(events) == 1 and events[0].subject["gpu"] == "1"
    fake.reset_calls()
    out2 = c.collect()
    assert fake.calls_for_gpu(1) == 0           # a lost GPU is not hammered every run
    assert not [e for e in out2.events if e.kind == "gpu_lost"]   # the event is reported once


@pytest.mark.parametrize(("code", "outcome"), OUTCOMES)
def test_error_in_a_call(code: int, outcome: str) -> None:
    fake, c, clock = rig()
    c.collect()
    fake.fail("nvmlDeviceGetUtilizationRates", code, gpu=1)
    if outcome == "unavailable":
        with pytest.raises(CollectorUnavailable):
            c.collect()
        return
    out = c.collect()
    if outcome == "lost":
        check_lost(fake, c, out)
        return
    assert gpus_with(out, "gpumon_gpu_utilization_ratio", engine="gpu") == {"0"}
    assert gpus_with(out, "gpumon_gpu_power_watts") == {"0", "1"}
    assert sum(out.errors.values()) >= 1
    fake.reset_calls()
    out = c.collect()
    asked = fake.gpu_calls[("nvmlDeviceGetUtilizationRates", 1)]
    if outcome == "dropped":
        assert asked == 0 and gpus_with(out, "gpumon_gpu_utilization_ratio", engine="gpu") == {"0"}
        fake.clear_faults()
        clock.t += 3600                              # the hourly re-probe asks again
        out = c.collect()
        assert gpus_with(out, "gpumon_gpu_utilization_ratio", engine="gpu") == {"0", "1"}
    else:
        assert asked == 1                            # transient: asked again next run
        fake.clear_faults()
        out = c.collect()
        assert gpus_with(out, "gpumon_gpu_utilization_ratio", engine="gpu") == {"0", "1"}
    c.close()


@pytest.mark.parametrize(("code", "outcome"), OUTCOMES)
def test_error_in_one_field(code: int, outcome: str) -> None:
    fake, c, clock = rig()
    c.collect()
    fake.fail_field(pynvml.NVML_FI_DEV_MEMORY_TEMP, code, gpu=1)
    if outcome == "unavailable":
        with pytest.raises(CollectorUnavailable):
            c.collect()
        return
    out = c.collect()
    if outcome == "lost":
        check_lost(fake, c, out)
        return
    assert gpus_with(out, "gpumon_gpu_temperature_celsius", sensor="memory") == {"0"}
    # the other fields of the same call are unaffected
    assert gpus_with(out, "gpumon_gpu_energy_joules_total") == {"0", "1"}
    fake.clear_faults()
    out = c.collect()
    expected = {"0"} if outcome == "dropped" else {"0", "1"}
    assert gpus_with(out, "gpumon_gpu_temperature_celsius", sensor="memory") == expected
    clock.t += 3600
    out = c.collect()
    assert gpus_with(out, "gpumon_gpu_temperature_celsius", sensor="memory") == {"0", "1"}
    c.close()


def test_unsupported_power_field_falls_back_to_its_call() -> None:
    fake, c, _ = rig()
    fake.fail_field(pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    c.collect()
    fake.reset_calls()
    out = c.collect()
    assert gpus_with(out, "gpumon_gpu_power_watts") == {"0", "1"}
    assert fake.gpu_calls[("nvmlDeviceGetPowerUsage", 1)] == 1
    assert fake.gpu_calls[("nvmlDeviceGetPowerUsage", 0)] == 0
    c.close()


def test_whole_field_call_unsupported_moves_every_field_to_its_fallback() -> None:
    fake, c, _ = rig()
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    c.collect()
    out = c.collect()
    assert gpus_with(out, "gpumon_gpu_power_watts") == {"0", "1"}
    assert gpus_with(out, "gpumon_gpu_ecc_errors_total", type="corrected", counter="volatile") == {"0", "1"}
    assert "gpumon_gpu_clock_event_violation_seconds_total" not in {f.name for f in out.families}
    c.close()


@pytest.mark.parametrize("code", UNSUPPORTED + TRANSIENT)
def test_error_in_a_gpm_metric_or_sample(code: int) -> None:
    fake, c, _ = rig()
    fake.fail_gpm_metric(pynvml.NVML_GPM_METRIC_FP64_UTIL, code, gpu=1)
    out = c.collect()
    assert gpus_with(out, "gpumon_gpu_activity_ratio", activity="fp64") == {"0"}
    assert gpus_with(out, "gpumon_gpu_activity_ratio", activity="sm") == {"0", "1"}
    fake.clear_faults()
    fake.fail("nvmlGpmSampleGet", code, gpu=0)
    out = c.collect()
    assert "0" not in gpus_with(out, "gpumon_gpu_activity_ratio")
    assert "gpumon_gpu_power_watts" in gpu_series(out, "0")
    c.close()


@pytest.mark.parametrize(("code", "outcome"), OUTCOMES)
def test_error_in_a_static_identity_call(code: int, outcome: str) -> None:
    fake, c, _ = rig()
    fake.fail("nvmlDeviceGetVbiosVersion", code, gpu=1)
    if outcome == "unavailable":
        with pytest.raises(CollectorUnavailable):
            c.collect()
        return
    out = c.collect()
    if outcome == "lost":
        assert gpus_with(out, "gpumon_gpu_lost") == {"0", "1"}
        assert gpu_series(out, "1") == {"gpumon_gpu_lost"}
        return
    vbios = {s.label("gpu"): s.label("vbios") for f in out.families if f.name == "gpumon_gpu_info"
             for s in f.samples}
    assert vbios == {"0": "96.00.DA.00.0C", "1": ""}   # identity still exported, the field blank
    c.close()


def test_a_non_nvml_exception_is_contained_and_counted() -> None:
    fake, c, _ = rig()
    c.collect()
    # the 550 driver has no GetTemperatureV: the GPU temperature comes from GetTemperature
    fake.fail("nvmlDeviceGetTemperature", 12345, gpu=0)   # an unknown code still maps to NVMLError
    out = c.collect()
    assert gpus_with(out, "gpumon_gpu_temperature_celsius", sensor="gpu") == {"1"}
    assert out.errors
    c.close()


@pytest.mark.parametrize("driver", ["535.183.06", "550.90.07", "580.65.06"])
def test_a_lost_gpu_is_found_again_on_every_driver(driver: str) -> None:
    """The liveness probe of a lost GPU must be a call the driver has (GetTemperatureV is R570+)."""
    fake = FakeNVML("h100-sxm5-80gb", 2, driver_version=driver)
    clock = Clock()
    ctx = Context(hostname="test", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    c = NvmlCollector(ctx)
    c.collect()
    fake.set_lost(1, xid=False)
    out = c.collect()
    assert gpus_with(out, "gpumon_gpu_lost") == {"0", "1"} and gpu_series(out, "1") == {"gpumon_gpu_lost"}
    fake.restore(1)
    clock.t += 61
    out = c.collect()
    assert any(e.kind == "gpu_recovered" for e in out.events)
    assert "gpumon_gpu_temperature_celsius" in gpu_series(out, "1")
    c.close()

"""The pynvml double answers like nvidia-ml-py: same names, arguments, return types, exception classes."""

from __future__ import annotations

import inspect
import threading

import pynvml
import pytest

from gpumon.simulate.nvml import PROFILES, FakeNVML


@pytest.fixture
def fake() -> FakeNVML:
    f = FakeNVML("h100-sxm5-80gb", 2)
    f.nvmlInit()
    return f


def test_constants_structs_and_exception_classes_are_the_real_ones(fake: FakeNVML) -> None:
    assert fake.NVMLError is pynvml.NVMLError
    assert fake.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert fake.NVML_FI_DEV_MEMORY_TEMP == pynvml.NVML_FI_DEV_MEMORY_TEMP == 82
    assert fake.c_nvmlGpmMetricsGet_t is pynvml.c_nvmlGpmMetricsGet_t
    assert fake.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    with pytest.raises(AttributeError):
        _ = fake.no_such_thing


def test_every_simulated_function_has_pynvml_signature() -> None:
    """Parameter names and defaults of each implemented nvml* function match nvidia-ml-py's."""
    checked = 0
    for name, member in vars(FakeNVML).items():
        if not name.startswith("nvml") or not callable(member):
            continue
        real = getattr(pynvml, name)
        ours = list(inspect.signature(getattr(FakeNVML(), name)).parameters)
        theirs = list(inspect.signature(real).parameters)
        assert ours == theirs, name
        checked += 1
    assert checked >= 50


def test_unimplemented_function_raises_function_not_found(fake: FakeNVML) -> None:
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetJpgUtilization(fake.nvmlDeviceGetHandleByIndex(0))
    assert fake.calls["nvmlDeviceGetJpgUtilization"] == 1


def test_calls_before_init_raise_uninitialized() -> None:
    f = FakeNVML("a10", 1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        f.nvmlDeviceGetCount()


def test_return_structures_match_pynvml(fake: FakeNVML) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    mem = fake.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert isinstance(mem, pynvml.c_nvmlMemory_v2_t)
    assert mem.total == mem.used + mem.free + mem.reserved
    assert isinstance(fake.nvmlDeviceGetMemoryInfo(h), pynvml.c_nvmlMemory_t)
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        fake.nvmlDeviceGetMemoryInfo(h, version=0x01000018)
    assert isinstance(fake.nvmlDeviceGetUtilizationRates(h), pynvml.c_nvmlUtilization_t)
    pci = fake.nvmlDeviceGetPciInfo_v3(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t) and pci.busId in ("00000001:00:00.0", b"00000001:00:00.0")
    assert isinstance(fake.nvmlDeviceGetName(h), str) and fake.nvmlDeviceGetUUID(h).startswith("GPU-")
    values = fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_POWER_INSTANT, (165, 17), 29])
    assert isinstance(values[0], pynvml.c_nvmlFieldValue_t)
    assert values[0].nvmlReturn == 0 and values[0].value.uiVal > 0
    assert (values[1].scopeId, values[1].nvmlReturn, values[1].value.uiVal) == (17, 0, 1)
    assert values[2].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    procs = fake.nvmlDeviceGetComputeRunningProcesses(h)
    assert isinstance(procs[0], pynvml.nvmlFriendlyObject) and procs[0].usedGpuMemory > 0
    assert fake.nvmlDeviceGetEncoderUtilization.__name__ == "nvmlDeviceGetEncoderUtilization"
    assert fake.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    assert fake.nvmlDeviceGetMigMode(h) == [0, 0]


def test_profiles_differ_where_the_hardware_does() -> None:
    a10 = FakeNVML("a10", 1)
    a10.nvmlInit()
    h = a10.nvmlDeviceGetHandleByIndex(0)
    memtemp, links = a10.nvmlDeviceGetFieldValues(h, [82, 91])
    assert memtemp.nvmlReturn == links.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert 0 < a10.nvmlDeviceGetFanSpeed(h) <= 100
    assert a10.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
    h100 = FakeNVML("h100-sxm5-80gb", 1)
    h100.nvmlInit()
    hh = h100.nvmlDeviceGetHandleByIndex(0)
    assert h100.nvmlDeviceGetFieldValues(hh, [91])[0].value.uiVal == 18
    assert h100.nvmlGpmQueryDeviceSupport(hh).isSupportedDevice == 1
    with pytest.raises(pynvml.NVMLError_NotSupported):
        h100.nvmlDeviceGetFanSpeed(hh)
    assert set(PROFILES) == {"a100-sxm4-80gb", "h100-sxm5-80gb", "a10"}


def test_tick_moves_values_and_counters_only_grow(fake: FakeNVML) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(0)
    before = fake.nvmlDeviceGetFieldValues(h, [83, 197])
    e0, tx0 = before[0].value.ullVal, before[1].value.ullVal
    fake.tick(30)
    after = fake.nvmlDeviceGetFieldValues(h, [83, 197])
    assert after[0].value.ullVal > e0 and after[1].value.ullVal > tx0


def test_gpm_two_samples_give_metrics(fake: FakeNVML) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(0)
    s1, s2 = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    fake.nvmlGpmSampleGet(h, s1)
    fake.tick(1)
    fake.nvmlGpmSampleGet(h, s2)
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics, mg.sample1, mg.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 2, s1, s2
    mg.metrics[0].metricId, mg.metrics[1].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL, 4
    fake.nvmlGpmMetricsGet(mg)
    assert mg.metrics[0].nvmlReturn == 0 and 0 < mg.metrics[0].value <= 100
    assert mg.metrics[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_fault_scripts(fake: FakeNVML) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(1)
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, gpu=1, times=1)
    with pytest.raises(pynvml.NVMLError_Unknown):
        fake.nvmlDeviceGetPowerUsage(h)
    assert fake.nvmlDeviceGetPowerUsage(h) > 0
    fake.fail_field(186, pynvml.NVML_ERROR_NO_PERMISSION, gpu=1)
    assert fake.nvmlDeviceGetFieldValues(h, [186])[0].nvmlReturn == pynvml.NVML_ERROR_NO_PERMISSION
    fake.set_lost(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)
    fake.restore(1)
    assert fake.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU) > 0
    fake.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, times=1)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        fake.nvmlInit()
    fake.nvmlInit()
    assert fake.calls_for_gpu(1) >= 4


def test_hang_blocks_until_released(fake: FakeNVML) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(0)
    hang = fake.hang("nvmlDeviceGetClockInfo", gpu=0)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(fake.nvmlDeviceGetClockInfo(h, 1)), daemon=True)
    t.start()
    assert hang.entered.wait(5)
    assert t.is_alive() and not result
    hang.release()
    t.join(5)
    assert result == [1980]


def test_event_set_delivers_injected_xid_to_registered_sets(fake: FakeNVML) -> None:
    es = fake.nvmlEventSetCreate()
    h = fake.nvmlDeviceGetHandleByIndex(1)
    fake.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(es, 10)
    fake.inject_xid(1, 94)
    data = fake.nvmlEventSetWait_v2(es, 1000)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert data.eventData == 94 and data.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert fake.nvmlDeviceGetUUID(data.device) == fake.nvmlDeviceGetUUID(h)
    fake.nvmlEventSetFree(es)

"""The pynvml double answers like nvidia-ml-py: same names, arguments, return types, exception classes."""

from __future__ import annotations

import inspect
import threading

import pynvml
import pytest

from gpumon.simulate.nvml import PROFILES, FakeNVML
from tests.conftest import wait_for


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
    assert set(PROFILES) == {"a100-sxm4-80gb", "h100-sxm5-80gb", "a10", "gb200"}


def test_tick_moves_values_and_counters_only_grow(fake: FakeNVML) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(0)
    before = fake.nvmlDeviceGetFieldValues(h, [83, (138, 0)])
    e0, tx0 = before[0].value.ullVal, before[1].value.ullVal
    fake.tick(30)
    after = fake.nvmlDeviceGetFieldValues(h, [83, (138, 0)])
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
        fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    fake.restore(1)
    assert fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) > 0
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


def inited(driver: str, profile: str = "h100-sxm5-80gb", count: int = 2) -> FakeNVML:
    f = FakeNVML(profile, count, driver_version=driver)
    f.nvmlInit()
    return f


@pytest.mark.parametrize("driver", ["535.183.06", "550.90.07", "565.57.01"])
def test_before_r570_there_is_no_get_temperature_v(driver: str) -> None:
    f = inited(driver)
    h = f.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        f.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)
    assert 20 < f.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) < 100
    f.set_lost(0, xid=False)   # a missing function is missing whatever the GPU's state
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        f.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU)
    assert f.calls["nvmlDeviceGetTemperatureV"] == 2
    g = inited("570.133.20")
    assert g.nvmlDeviceGetTemperatureV(g.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_TEMPERATURE_GPU) > 0


def test_gpu_unavailable_and_recovery_action_exist_from_r565() -> None:
    newer = (pynvml.nvmlEventTypeGpuUnavailableError | pynvml.nvmlEventTypeGpuRecoveryAction)
    old = inited("550.90.07")
    h = old.nvmlDeviceGetHandleByIndex(0)
    assert old.nvmlDeviceGetSupportedEventTypes(h) & newer == 0
    es = old.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):   # one unsupported type fails the registration
        old.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError | newer, es)
    old.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    assert old.nvmlDeviceGetFieldValues(h, [230])[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    new = inited("565.57.01")
    hn = new.nvmlDeviceGetHandleByIndex(0)
    assert new.nvmlDeviceGetSupportedEventTypes(hn) & newer == newer
    assert new.nvmlDeviceGetFieldValues(hn, [230])[0].nvmlReturn == pynvml.NVML_SUCCESS


@pytest.mark.parametrize(("driver", "pcie_bytes", "clock_event_counters"), [
    ("550.90.07", False, "absent"), ("555.42.06", True, "absent"),
    ("575.57.08", True, "power_smoothing"), ("580.65.06", True, "counters"),
])
def test_field_ids_follow_the_driver(driver: str, pcie_bytes: bool, clock_event_counters: str) -> None:
    f = inited(driver)
    h = f.nvmlDeviceGetHandleByIndex(0)
    tx, sw_therm = f.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 269])
    assert (tx.nvmlReturn == pynvml.NVML_SUCCESS) == pcie_bytes
    if clock_event_counters == "absent":
        assert sw_therm.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    else:   # R570/R575 answer 269 too, with a power-smoothing value (a small number, not nanoseconds)
        assert sw_therm.nvmlReturn == pynvml.NVML_SUCCESS
        assert (sw_therm.value.ullVal > 10**9) == (clock_event_counters == "counters")


def test_tlimit_fields_are_signed_margins_not_temperatures(fake: FakeNVML) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(0)
    values = fake.nvmlDeviceGetFieldValues(h, [193, 194, 195, 196])
    assert all(v.valueType == pynvml.NVML_VALUE_TYPE_SIGNED_INT for v in values)
    # a real H100 (driver 580): shutdown 95, slowdown 89, memory max 95, GPU max 87 degrees, and
    # nvidia-smi -q's T.Limit lines -8, -2, 0 (memory, from its own maximum), 0
    assert [v.value.siVal for v in values] == [-8, -2, 0, 0]
    assert fake.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN) == 95


def test_nvlink_total_error_fields_take_the_link_in_scope(fake: FakeNVML) -> None:
    fake.add_nvlink_errors(0, 5, "replay", 7)
    fake.add_nvlink_errors(0, 6, "crc_data", 2)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    replay = pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
    data = pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
    v = fake.nvmlDeviceGetFieldValues(h, [(replay, 5), (replay, 0), (data, 6), (data, 18)])
    assert [x.value.ullVal for x in v[:3]] == [7, 0, 2]
    assert v[3].nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT   # no link 18
    assert fake.nvmlDeviceGetNvLinkErrorCounter(h, 5, pynvml.NVML_NVLINK_ERROR_DL_REPLAY) == 7


@pytest.mark.parametrize("xid", [True, False])
def test_event_wait_answers_gpu_is_lost_while_a_registered_gpu_is_lost(fake: FakeNVML, xid: bool) -> None:
    es = fake.nvmlEventSetCreate()
    for i in range(2):
        fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(i), pynvml.nvmlEventTypeXidCriticalError, es)
    fake.set_lost(1, xid=xid)
    if xid:
        assert fake.nvmlEventSetWait_v2(es, 1000).eventData == 79   # what was queued comes first
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlEventSetWait_v2(es, 10)
    fake.restore(1)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(es, 10)
    fake.nvmlEventSetFree(es)


def _wait_on_a_thread(fake: FakeNVML, es) -> tuple[threading.Thread, list[BaseException]]:
    """A thread blocked in nvmlEventSetWait_v2 (10 s), and where the error it ends with lands."""
    result: list[BaseException] = []

    def wait() -> None:
        try:
            fake.nvmlEventSetWait_v2(es, 10_000)
        except pynvml.NVMLError as exc:
            result.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t, result


def test_a_lost_gpu_wakes_a_waiting_thread(fake: FakeNVML) -> None:
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(1), pynvml.nvmlEventTypeXidCriticalError, es)
    t, result = _wait_on_a_thread(fake, es)
    wait_for(lambda: fake._sets[max(fake._sets)].cond._waiters, 5)
    fake.set_lost(1, xid=False)
    t.join(5)
    assert isinstance(result[0], pynvml.NVMLError_GpuIsLost)


def test_a_freed_event_set_is_an_error_not_a_timeout(fake: FakeNVML) -> None:
    es = fake.nvmlEventSetCreate()
    t, result = _wait_on_a_thread(fake, es)
    event_set = next(s for s in fake._sets.values() if not s.freed)
    wait_for(lambda: event_set.cond._waiters, 5)   # blocked inside the wait (Condition's own bookkeeping)
    fake.nvmlEventSetFree(es)
    t.join(5)
    assert isinstance(result[0], pynvml.NVMLError_InvalidArgument)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlEventSetWait_v2(es, 10)


def test_gpm_sample_buffers_are_tracked(fake: FakeNVML) -> None:
    s1, s2 = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    assert fake.gpm_samples_allocated() == 2
    fake.nvmlGpmSampleFree(s1)
    fake.nvmlGpmSampleFree(s2)
    assert fake.gpm_samples_allocated() == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlGpmSampleFree(s1)


def test_handle_by_index_faults_can_target_one_gpu(fake: FakeNVML) -> None:
    fake.fail("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_NO_PERMISSION, gpu=1)
    assert fake.nvmlDeviceGetHandleByIndex(0) is not None
    with pytest.raises(pynvml.NVMLError_NoPermission):
        fake.nvmlDeviceGetHandleByIndex(1)
    fake.clear_faults()
    fake.set_lost(1, xid=False)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(1)

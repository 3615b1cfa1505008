"""NVLink fabric (nvmlDeviceGetGpuFabricInfoV): membership, state, status, health bits, change events,
struct versions and the deprecated call, on the GB200, H100 and A100 doubles."""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from gpumon.collectors.nvml_tables import FABRIC_CONDITIONS, FABRIC_STATES, FABRIC_SUMMARIES
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import gpu_values
from tests.support.nvml import names, rig

TRUE = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE
FALSE = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_FALSE


def test_the_health_mask_table_is_the_one_pynvml_defines() -> None:
    for cond in FABRIC_CONDITIONS:
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{cond.nvml}") == cond.shift, cond.name
        assert getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{cond.nvml}") == cond.width, cond.name
        assert not cond.holds & cond.clear and 0 not in cond.holds | cond.clear   # 0 = NOT_SUPPORTED
    assert {getattr(pynvml, f"NVML_GPU_FABRIC_STATE_{n.upper()}"): n for n in FABRIC_STATES.values()} \
        == FABRIC_STATES
    assert {getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_SUMMARY_{n.upper()}"): n
            for n in FABRIC_SUMMARIES.values()} == FABRIC_SUMMARIES


def gb200(driver: str = "570.133.20", **opts):
    return rig("gb200", 4, driver=driver, **opts)


def read_fabric_again(fake: FakeNVML, c, runs: int = 12):
    """Runs until the slow tier has read the fabric again; returns the events of those runs."""
    before = fake.gpu_calls[("nvmlDeviceGetGpuFabricInfoV", 1)]
    events = []
    for _ in range(runs):
        fake.tick(10)
        out = c.collect()
        events.extend(out.events)
        if fake.gpu_calls[("nvmlDeviceGetGpuFabricInfoV", 1)] > before:
            return out, events
    raise AssertionError("the fabric was not read again within the runs given")


def test_gb200_exports_its_nvlink_domain_state_status_and_health() -> None:
    fake, c, _ = gb200()
    out = c.collect()
    info = [s for f in out.families if f.name == "gpumon_gpu_fabric_info" for s in f.samples]
    assert len(info) == 4
    assert len({s.label("cluster_uuid") for s in info}) == 1          # one NVL72 rack
    assert {s.label("clique_id") for s in info} == {"32766"}
    assert info[0].label("cluster_uuid") != "00000000-0000-0000-0000-000000000000"
    assert set(gpu_values(out, "gpumon_gpu_fabric_state").values()) == {3.0}
    assert set(gpu_values(out, "gpumon_gpu_fabric_status").values()) == {0.0}
    assert set(gpu_values(out, "gpumon_gpu_fabric_health_overall").values()) == {1.0}
    conds = {s.label("condition"): s.value for f in out.families
             if f.name == "gpumon_gpu_fabric_health_condition" for s in f.samples if s.label("gpu") == "0"}
    # every field the driver reports, healthy; GFM_STATE is NOT_SUPPORTED on this driver: absent
    assert conds == {"degraded_bandwidth": 0, "route_recovery": 0, "route_unhealthy": 0,
                     "access_timeout_recovery": 0, "incorrect_configuration": 0, "partition_unassigned": 0}
    c.close()


def test_h100_with_nvswitch_completes_without_a_domain_or_health() -> None:
    _, c, _ = rig("h100-sxm5-80gb", 2)
    out = c.collect()
    assert gpu_values(out, "gpumon_gpu_fabric_state") == {"0": 3.0, "1": 3.0}
    assert gpu_values(out, "gpumon_gpu_fabric_status") == {"0": 0.0, "1": 0.0}
    # a zero cluster UUID is no multi-node domain; health fields are NOT_SUPPORTED: no series
    assert not names(out) & {"gpumon_gpu_fabric_info", "gpumon_gpu_fabric_health_condition",
                             "gpumon_gpu_fabric_health_overall"}
    c.close()


def test_a_gpu_without_fabric_is_asked_once_and_dropped() -> None:
    fake, c, _ = rig("a100-sxm4-80gb", 1)
    out = c.collect()
    assert out.errors.get("nvml_not_supported", 0) >= 1
    for _ in range(20):
        fake.tick(10)
        out = c.collect()
    assert not {n for n in names(out) if "fabric" in n}
    # the versioned call (v3 struct: version mismatch on R550, then v2: NOT_SUPPORTED), then its
    # stand-in (also refused), never again until the hourly re-probe
    assert fake.gpu_calls[("nvmlDeviceGetGpuFabricInfoV", 0)] == 2
    assert fake.gpu_calls[("nvmlDeviceGetGpuFabricInfo", 0)] == 1
    c.close()


def test_a_health_bit_that_changes_is_one_event_each_way() -> None:
    fake, c, _ = gb200()
    c.collect()
    fake.set_fabric(1, health={"ROUTE_UNHEALTHY": TRUE})
    out, events = read_fabric_again(fake, c)
    assert gpu_values(out, "gpumon_gpu_fabric_health_condition", condition="route_unhealthy")["1"] == 1.0
    assert gpu_values(out, "gpumon_gpu_fabric_health_condition", condition="route_unhealthy")["0"] == 0.0
    fabric = [e for e in events if e.kind == "gpu_fabric_changed"]
    assert len(fabric) == 1
    ev = fabric[0]
    assert ev.subject["gpu"] == "1" and ev.severity.value == "warning"
    assert ev.attributes == {"what": "health", "condition": "route_unhealthy", "old": "no", "new": "yes"}
    fake.set_fabric(1, health={"ROUTE_UNHEALTHY": FALSE})
    _, events = read_fabric_again(fake, c)
    back = [e for e in events if e.kind == "gpu_fabric_changed"]
    assert [(e.attributes["new"], e.severity.value) for e in back] == [("no", "info")]
    c.close()


def test_state_and_status_changes_are_events_and_status_is_only_read_when_completed() -> None:
    fake, c, _ = gb200()
    c.collect()
    fake.set_fabric(1, state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
    out, events = read_fabric_again(fake, c)
    assert gpu_values(out, "gpumon_gpu_fabric_state")["1"] == 2.0
    assert "1" not in gpu_values(out, "gpumon_gpu_fabric_status")
    kinds = {(e.attributes["what"], e.attributes["new"]) for e in events if e.kind == "gpu_fabric_changed"}
    assert ("state", "in_progress") in kinds and ("status", "not reported") in kinds
    fake.set_fabric(1, state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
                    status=pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    out, events = read_fabric_again(fake, c)
    assert gpu_values(out, "gpumon_gpu_fabric_status")["1"] == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    status = [e for e in events if e.kind == "gpu_fabric_changed" and e.attributes["what"] == "status"]
    assert status and status[0].attributes["new"] == "insufficient_resources"
    assert status[0].severity.value == "warning"
    c.close()


def test_a_driver_without_the_v3_struct_gets_v2_and_remembers_it() -> None:
    fake, c, _ = gb200(driver="565.57.01")
    out = c.collect()
    assert set(gpu_values(out, "gpumon_gpu_fabric_state").values()) == {3.0}
    assert "gpumon_gpu_fabric_health_condition" in names(out)
    assert "gpumon_gpu_fabric_health_overall" not in names(out)     # v3 only
    assert out.errors.get("nvml_argument_version_mismatch", 0) == 0   # a version step, not an error
    assert fake.gpu_calls[("nvmlDeviceGetGpuFabricInfoV", 0)] == 2   # v3 refused, then v2
    read_fabric_again(fake, c)
    assert fake.gpu_calls[("nvmlDeviceGetGpuFabricInfoV", 1)] == 3   # v2 straight away
    c.close()


def test_a_driver_without_the_versioned_call_falls_back_to_the_deprecated_one() -> None:
    fake, c, _ = rig("h100-sxm5-80gb", 1, driver="535.183.01")
    c.collect()
    assert fake.gpu_calls[("nvmlDeviceGetGpuFabricInfoV", 0)] == 1   # FUNCTION_NOT_FOUND
    out = None
    for _ in range(12):
        fake.tick(10)
        out = c.collect()
    assert fake.gpu_calls[("nvmlDeviceGetGpuFabricInfo", 0)] >= 1
    assert out is not None and gpu_values(out, "gpumon_gpu_fabric_state") == {"0": 3.0}
    assert fake.gpu_calls[("nvmlDeviceGetGpuFabricInfoV", 0)] == 1   # not asked again
    c.close()


def test_the_double_wants_the_struct_by_reference_and_of_the_size_its_version_says() -> None:
    fake = FakeNVML("gb200", 1, driver_version="570.133.20")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.c_nvmlGpuFabricInfo_v3_t()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuFabricInfoV(h, info)              # by value: garbage for the C function
    assert fake.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)) == pynvml.NVML_SUCCESS
    assert info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED and info.cliqueId == 32766
    assert info.healthSummary == pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
    small = pynvml.c_nvmlGpuFabricInfo_v2_t()
    small.version = pynvml.nvmlGpuFabricInfo_v3
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuFabricInfoV(h, ctypes.pointer(small))
    legacy = pynvml.c_nvmlGpuFabricInfo_t()
    assert fake.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(legacy)) == pynvml.NVML_SUCCESS
    assert bytes(legacy.clusterUuid) == bytes(info.clusterUuid)
    a100 = FakeNVML("a100-sxm4-80gb", 1)
    a100.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):   # nvml.h: "doesn't support gpu fabric"
        a100.nvmlDeviceGetGpuFabricInfoV(a100.nvmlDeviceGetHandleByIndex(0),
                                         ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))

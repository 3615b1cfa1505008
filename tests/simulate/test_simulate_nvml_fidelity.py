"""The NVML double against a real driver's record (tests/fixtures/nvml/h100_r580.json, README beside it).

The record is what ``python tools/nvml_record.py`` wrote on one NVIDIA H100 80GB HBM3 with
driver 580.159.04; the same recorder runs here over :class:`FakeNVML` with the H100 profile and that
driver version. Every call gpumon makes must end the same way (a value of the same shape, or the same
NVML error code), every field must answer with the same ``nvmlReturn`` and ``valueType``, and the facts
the collector relies on (units, sample spacing, buffer size, event types) must be equal.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest

from gpumon.simulate.nvml import FakeNVML
from tests.conftest import REPO
from tools.nvml_record import record

FIXTURE = os.path.join(REPO, "tests", "fixtures", "nvml", "h100_r580.json")

NO_NVLINK_IN_THE_RECORDED_VM = "the recorded GPU was passed into its VM alone, without its NVSwitch fabric"
DIFFERENCES: dict[tuple[str, str], str] = {
    **{("fields", str(fid)): NO_NVLINK_IN_THE_RECORDED_VM for fid in (91, 165, 138, 139, 38, 45, 52, 59, 161, 162, 163)},
    ("calls", "fabric"): NO_NVLINK_IN_THE_RECORDED_VM,
    ("calls", "fabric_legacy"): NO_NVLINK_IN_THE_RECORDED_VM,
    ("static", "nvlink_crc_data_link0"): NO_NVLINK_IN_THE_RECORDED_VM,
}
"""Where the double answers as an ND H100 v5 GPU does (18 NVLinks, NVSwitch fabric) and the recorded
VM could not: not a difference in how the driver answers."""


def shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool | int | float):
        return "number"
    return type(value).__name__


def outcome(entry: dict[str, Any]) -> Any:
    """An error code, or the value's shape; an empty list is a list of any shape (no process ran)."""
    if "error" in entry:
        return ("error", entry["error"])
    found = shape(entry["value"])
    return ("value", "list" if isinstance(found, list) and not found else found)


def same_outcome(got: dict[str, Any], want: dict[str, Any]) -> bool:
    a, b = outcome(got), outcome(want)
    if a[0] == b[0] == "value" and "list" in (a[1], b[1]):
        return isinstance(a[1], list | str) and isinstance(b[1], list | str)
    return a == b


@pytest.fixture(scope="module")
def real() -> dict[str, Any]:
    with open(FIXTURE, encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def double(real: dict[str, Any]) -> dict[str, Any]:
    fake = FakeNVML("h100-sxm5-80gb", 1, driver_version=real["driver_version"], cuda_version=13000)
    fake.tick(3.0)      # a real driver has been sampling since it loaded
    return record(fake, repeats=1, sleep=fake.tick)


def test_the_record_is_a_real_h100_on_driver_580(real: dict[str, Any]) -> None:
    dev = real["devices"][0]
    assert dev["static"]["name"]["value"] == "NVIDIA H100 80GB HBM3" and real["driver_version"] == "580.159.04"
    assert dev["static"]["pci"]["value"]["pciDeviceId"] == 0x233010DE


@pytest.mark.parametrize("part", ["static", "calls"])
def test_every_call_ends_as_on_the_real_driver(real: dict[str, Any], double: dict[str, Any], part: str) -> None:
    got, want = double["devices"][0][part], real["devices"][0][part]
    assert set(got) == set(want)
    for key in want:
        if (part, key) in DIFFERENCES:
            continue
        assert same_outcome(got[key], want[key]), (part, key, got[key], want[key])


def test_every_field_answers_with_the_real_return_code_and_value_type(real: dict[str, Any],
                                                                      double: dict[str, Any]) -> None:
    want = {str(v["id"]): v for v in real["devices"][0]["fields"]["values"]}
    got = {str(v["id"]): v for v in double["devices"][0]["fields"]["values"]}
    assert set(got) == set(want)
    for fid, w in want.items():
        if ("fields", fid) in DIFFERENCES:
            continue
        g = got[fid]
        assert (g["nvmlReturn"], g["valueType"]) == (w["nvmlReturn"], w["valueType"]), fid


def test_static_facts_equal_the_real_gpu(real: dict[str, Any], double: dict[str, Any]) -> None:
    for key in ("max_clock_sm", "max_clock_memory", "max_clock_graphics", "max_pcie_generation", "max_pcie_width",
                "threshold_shutdown", "threshold_slowdown", "threshold_memory_max", "threshold_gpu_max",
                "ecc_mode", "mig_mode", "max_mig_devices", "supported_events", "name", "gpm_support"):
        assert double["devices"][0]["static"][key]["value"] == real["devices"][0]["static"][key]["value"], key
    want, got = real["devices"][0]["calls"], double["devices"][0]["calls"]
    for key in ("total", "reserved"):
        assert got["memory"]["value"][key] == want["memory"]["value"][key], key
    assert got["bar1"]["value"]["bar1Total"] == want["bar1"]["value"]["bar1Total"]
    assert got["encoder"]["value"] == want["encoder"]["value"] == [0, 100_000]   # no NVENC: 0, not refused
    assert got["power_limit"]["value"] == want["power_limit"]["value"]


def test_power_samples_are_milliwatts_20_ms_apart_in_a_ring_of_119(real: dict[str, Any],
                                                                   double: dict[str, Any]) -> None:
    want, got = real["devices"][0]["power_samples"], double["devices"][0]["power_samples"]
    # the real samples are milliwatts: within a few percent of nvmlDeviceGetPowerUsage (mW) read between
    assert want["min"] * 0.9 <= want["power_usage_mw"] <= want["max"] * 1.1
    assert got["sampleValType"] == want["sampleValType"] == 1          # NVML_VALUE_TYPE_UNSIGNED_INT
    assert abs(got["median_step_us"] - want["median_step_us"]) <= 100   # 20 ms, give or take the clock
    assert got["buffer_after_wait"]["count"] == want["buffer_after_wait"]["count"] == 119
    assert got["after_1s"]["count"] == want["after_1s"]["count"] == 50


def test_gpm_answers_every_metric_gpumon_asks(real: dict[str, Any], double: dict[str, Any]) -> None:
    want, got = real["devices"][0]["gpm"], double["devices"][0]["gpm"]
    assert want["supported"] and got["supported"]
    assert [(m["id"], m["nvmlReturn"]) for m in got["metrics"]] == [(m["id"], m["nvmlReturn"]) for m in want["metrics"]]
    assert all(0.0 <= m["value"] <= 100.0 for m in want["metrics"] if m["id"] < 20)   # ratios are percent


def test_events_time_out_and_an_xid_arrives_as_the_real_one_did(real: dict[str, Any]) -> None:
    fake = FakeNVML("h100-sxm5-80gb", 1, driver_version=real["driver_version"])
    xid = threading.Timer(0.3, fake.inject_xid, (0, 31))   # once the recorder has registered
    xid.start()
    try:
        got = record(fake, repeats=1, events=1.0, sleep=fake.tick)["events"]
    finally:
        xid.cancel()
    want = real["events"]
    assert got["empty_wait"]["error"] == want["empty_wait"]["error"] == 10    # NVML_ERROR_TIMEOUT
    assert got["registered"] == {0: want["registered"]["0"]}
    xid = [e for e in got["events"] if e.get("eventType") == 8]
    keys = ("eventType", "eventData", "gpuInstanceId", "computeInstanceId", "gpu")
    assert [{k: e[k] for k in keys} for e in xid] == [{k: e[k] for k in keys} for e in want["events"]]


# --- per-process utilization ------------------------------------------------------------------------
# The record has no per-process calls (it was taken without a workload); these hold the double to what
# shared/reference/wave3.md section 3 documents of the same H100 and driver 580 under two processes,
# and to the struct layouts of nvml.h as nvidia-ml-py declares them. No value is taken from the record.

def _two_processes() -> tuple[FakeNVML, Any]:
    fake = FakeNVML("h100-sxm5-80gb", 1, driver_version="580.159.04", cuda_version=13000)
    fake.nvmlInit()
    fake.run_processes(0, ["python3", "python3"])
    fake.tick(40.0)
    return fake, fake.nvmlDeviceGetHandleByIndex(0)


def test_process_utilization_structs_are_nvml_h_layouts() -> None:
    import ctypes

    import pynvml

    # wave3.md: nvmlProcessUtilizationInfo_v1_t is 40 bytes; the container's version is sizeof | 1 << 24
    assert ctypes.sizeof(pynvml.c_nvmlProcessUtilizationInfo_v1_t) == 40
    assert pynvml.ProcessesUtilizationInfo_v1 == ctypes.sizeof(pynvml.c_nvmlProcessesUtilizationInfo_v1_t) | 1 << 24
    fake, h = _two_processes()
    assert all(type(s) is pynvml.c_nvmlProcessUtilizationInfo_v1_t
               for s in fake.nvmlDeviceGetProcessesUtilizationInfo(h, 0))
    assert all(type(s) is pynvml.c_nvmlProcessUtilizationSample_t for s in fake.nvmlDeviceGetProcessUtilization(h, 0))


PROCESS_FIXTURE = os.path.join(REPO, "tests", "fixtures", "nvml", "h100_r580_processes.json")
PROCESS_FNS = ("nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization")


@pytest.fixture(scope="module")
def real_processes() -> dict[str, Any]:
    with open(PROCESS_FIXTURE, encoding="utf-8") as fh:
        return json.load(fh)["processes"]


@pytest.fixture(scope="module")
def double_processes() -> dict[str, Any]:
    """The recorder over the double, with the recorded workload: two processes, one of them ending
    about halfway through the window, as on the real H100."""
    fake = FakeNVML("h100-sxm5-80gb", 1, driver_version="580.159.04", cuda_version=13000)
    fake.tick(3.0)
    busy, short = fake.run_processes(0, ["python3", "python3"])
    fake.tick(7.0)              # the recording started 7 s after the workload

    def sleep(seconds: float) -> None:
        fake.tick(seconds)
        if short in dict(fake._gpus[0].processes) and fake.time >= 10.0 + 34.0:
            fake.end_process(0, short)

    doc = record(fake, processes=60.0, sleep=sleep, clock=lambda: fake.time, wall_us=fake.wall_us)
    return doc["processes"]


def _answers(doc: dict[str, Any], fn: str) -> list[dict[str, Any]]:
    return doc["answers"][fn]


def _gaps_of_busiest(doc: dict[str, Any], fn: str) -> list[int]:
    stamps: dict[int, list[int]] = {}
    for a in _answers(doc, fn):
        for smp in a["samples"]:
            stamps.setdefault(smp["pid"], []).append(smp["timeStamp"])
    busiest = max(stamps.values(), key=len)
    return [b - a for a, b in zip(busiest, busiest[1:])]


def test_the_process_record_is_a_real_h100_with_two_compute_processes_one_ending() -> None:
    with open(PROCESS_FIXTURE, encoding="utf-8") as fh:
        doc = json.load(fh)
    assert doc["gpu"]["name"] == "NVIDIA H100 80GB HBM3" and doc["driver_version"] == "580.159.04"
    assert doc["gpu"]["mig_mode"] == [0, 0]
    running = doc["processes"]["running"]
    assert len(running[0]["processes"]) == 2 and len(running[-1]["processes"]) == 1


@pytest.mark.parametrize("fn", PROCESS_FNS)
def test_an_immediate_second_call_answers_not_found_as_on_the_h100(real_processes: dict[str, Any],
                                                                    double_processes: dict[str, Any],
                                                                    fn: str) -> None:
    not_found = "6"
    for doc in (real_processes, double_processes):
        assert set(doc["again"][fn]) == {not_found} and doc["again"][fn][not_found] == len(_answers(doc, fn))
        assert doc["not_found"][fn] > 0 and doc["errors"][fn] == {}


@pytest.mark.parametrize("fn", PROCESS_FNS)
def test_each_answer_holds_one_newer_sample_per_pid_at_most(real_processes: dict[str, Any],
                                                             double_processes: dict[str, Any], fn: str) -> None:
    for doc in (real_processes, double_processes):
        answers = _answers(doc, fn)
        for a in answers:
            pids = [smp["pid"] for smp in a["samples"]]
            assert len(pids) == len(set(pids))
            assert all(smp["timeStamp"] > a["since"] for smp in a["samples"])
            assert all(0 <= smp[k] <= 100 for smp in a["samples"] for k in ("smUtil", "memUtil", "encUtil", "decUtil"))
        # only the process that had the GPU in a period gets that period's sample: after the first
        # answer (each PID's newest), answers hold one sample (375 of 376 on the H100)
        single = sum(1 for a in answers[1:] if len(a["samples"]) == 1)
        assert single >= 0.99 * (len(answers) - 1)


@pytest.mark.parametrize("fn", PROCESS_FNS)
def test_samples_are_200_ms_apart_on_the_wall_clock(real_processes: dict[str, Any],
                                                    double_processes: dict[str, Any], fn: str) -> None:
    import statistics

    real_gaps, double_gaps = _gaps_of_busiest(real_processes, fn), _gaps_of_busiest(double_processes, fn)
    assert round(statistics.median(real_gaps), -4) == round(statistics.median(double_gaps), -4) == 200_000
    assert min(double_gaps) >= min(real_gaps) - 10_000
    for doc in (real_processes, double_processes):
        # timeStamp is the wall clock in µs, a little behind the moment of the answer
        lags = [a["wall_us"] - max(smp["timeStamp"] for smp in a["samples"]) for a in _answers(doc, fn)]
        assert min(lags) >= 0 and max(lags) <= 250_000


def test_last_seen_zero_answers_each_running_process_and_forgets_one_that_ended(
        real_processes: dict[str, Any], double_processes: dict[str, Any]) -> None:
    for doc in (real_processes, double_processes):
        running = [(r["at"], {p["pid"] for p in r["processes"]}) for r in doc["running"]]
        first = running[0][1]
        ended_at = next(at for at, pids in running if pids != first)
        (gone,) = first - next(pids for at, pids in running if at == ended_at)
        for z in doc["from_zero"]:
            pids = {smp["pid"] for smp in z["samples"] or []}
            if z["at"] < ended_at - 1.0:
                assert pids == first                # however old a waiting process's newest sample is
            elif z["at"] > ended_at:
                assert gone not in pids and pids    # forgotten once ended; the other still answered


def test_the_running_process_list_has_the_real_fields(real_processes: dict[str, Any],
                                                      double_processes: dict[str, Any]) -> None:
    def fields(doc: dict[str, Any]) -> set[tuple[str, ...]]:
        return {tuple(sorted(p)) for r in doc["running"] for p in r["processes"]}

    assert fields(real_processes) == fields(double_processes)
    for doc in (real_processes, double_processes):   # MIG off: no GPU or compute instance
        assert {(p["gpuInstanceId"], p["computeInstanceId"]) for r in doc["running"] for p in r["processes"]} \
            == {(0xFFFFFFFF, 0xFFFFFFFF)}


def test_process_utilization_exists_from_r550_and_blackwell_refuses_the_legacy_call() -> None:
    import pynvml

    old = FakeNVML("h100-sxm5-80gb", 1, driver_version="535.183.01")
    old.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        old.nvmlDeviceGetProcessesUtilizationInfo(old.nvmlDeviceGetHandleByIndex(0), 0)
    gb200 = FakeNVML("gb200", 1, driver_version="580.159.04")
    gb200.nvmlInit()
    h = gb200.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        gb200.nvmlDeviceGetProcessUtilization(h, 0)
    assert gb200.nvmlDeviceGetProcessesUtilizationInfo(h, 0)

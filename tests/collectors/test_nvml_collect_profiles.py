"""The NVML collector on the simulated profiles: every family with sane values, the call budget, the
series count, the opt-ins and MIG (its terminal table: tests/report/test_report_tables.py)."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from gpumon.catalogue import gpu as CG
from gpumon.collectors import nvml_readings as M
from gpumon.collectors.nvml import NvmlCollector
from gpumon.model import Collection
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import gpu_values
from tests.support.nvml import names, rig


def field_ids_asked(fake: FakeNVML) -> list[set[int]]:
    """The field ids of each nvmlDeviceGetFieldValues call from now on, one set per call."""
    asked: list[set[int]] = []
    real = fake.nvmlDeviceGetFieldValues

    def spy(handle: Any, ids: Any) -> Any:
        asked.append({fid for fid, _ in ids})
        return real(handle, ids)

    fake.nvmlDeviceGetFieldValues = spy  # type: ignore[method-assign]
    return asked


def gpm_ids_asked(fake: FakeNVML) -> list[set[int]]:
    """The GPM metric ids of each nvmlGpmMetricsGet call from now on, one set per call."""
    asked: list[set[int]] = []
    real = fake.nvmlGpmMetricsGet

    def spy(mg: Any) -> Any:
        asked.append({int(mg.metrics[i].metricId) for i in range(mg.numMetrics)})
        return real(mg)

    fake.nvmlGpmMetricsGet = spy  # type: ignore[method-assign]
    return asked


def series(out: Collection, gpu_only: bool = False) -> int:
    return sum(len(f.samples) for f in out.families if not gpu_only or f.name != "gpumon_nvml_calls_total")


R580_ONLY = {"gpumon_gpu_pcie_bytes_total", "gpumon_gpu_recovery_action"}   # fields 197/198 (R555), 230 (R565)


def test_h100_exports_every_default_family_with_the_profiles_values() -> None:
    fake, c, clock = rig()
    out = c.collect()
    expected = {
        "gpumon_gpu_info", "gpumon_gpu_lost", "gpumon_gpu_utilization_ratio", "gpumon_gpu_memory_total_bytes",
        "gpumon_gpu_memory_used_bytes", "gpumon_gpu_memory_free_bytes", "gpumon_gpu_memory_reserved_bytes",
        "gpumon_gpu_bar1_total_bytes", "gpumon_gpu_bar1_used_bytes", "gpumon_gpu_temperature_celsius",
        "gpumon_gpu_temperature_threshold_celsius", "gpumon_gpu_power_watts", "gpumon_gpu_power_limit_watts",
        "gpumon_gpu_energy_joules_total", "gpumon_gpu_clock_hertz", "gpumon_gpu_clock_max_hertz",
        "gpumon_gpu_clock_event_reason_active", "gpumon_gpu_clock_event_violation_seconds_total",
        "gpumon_gpu_pcie_link_generation", "gpumon_gpu_pcie_link_generation_max", "gpumon_gpu_pcie_link_width",
        "gpumon_gpu_pcie_link_width_max", "gpumon_gpu_pcie_bytes_total", "gpumon_gpu_pcie_replay_total",
        "gpumon_gpu_ecc_enabled", "gpumon_gpu_ecc_errors_total", "gpumon_gpu_remapped_rows",
        "gpumon_gpu_remapped_rows_pending", "gpumon_gpu_remapped_rows_failure", "gpumon_gpu_recovery_action",
        "gpumon_gpu_nvlink_links", "gpumon_gpu_nvlink_links_active", "gpumon_gpu_nvlink_errors_total",
        "gpumon_gpu_nvlink_bytes_total", "gpumon_gpu_performance_state", "gpumon_gpu_compute_processes",
        "gpumon_gpu_compute_processes_memory_bytes", "gpumon_gpu_activity_ratio",
        "gpumon_gpu_pcie_throughput_bytes_per_second", "gpumon_gpu_nvlink_throughput_bytes_per_second",
        "gpumon_nvml_calls_total",
    } - R580_ONLY
    assert expected <= names(out), expected - names(out)
    assert not names(out) & R580_ONLY      # the 550 driver does not know those fields
    # pre-Ampere page retirement and a fan do not exist on H100; per-link and per-process are opt-in
    assert not names(out) & {"gpumon_gpu_retired_pages", "gpumon_gpu_fan_speed_ratio",
                             "gpumon_gpu_nvlink_link_up", "gpumon_gpu_process_memory_bytes"}
    assert set(gpu_values(out, "gpumon_gpu_info")) == {str(i) for i in range(8)}
    info = next(f for f in out.families if f.name == "gpumon_gpu_info").samples[0]
    assert info.label("model") == "NVIDIA H100 80GB HBM3" and info.label("driver_version") == "550.90.07"
    assert info.label("cuda_version") == "12.4" and info.label("mig_mode") == "disabled"
    for gpu, watts in gpu_values(out, "gpumon_gpu_power_watts").items():
        assert 70 <= watts <= gpu_values(out, "gpumon_gpu_power_limit_watts")[gpu] == 700
    assert all(0 <= v <= 1 for v in gpu_values(out, "gpumon_gpu_utilization_ratio").values())
    assert all(0 <= v <= 1 for v in gpu_values(out, "gpumon_gpu_activity_ratio").values())
    assert gpu_values(out, "gpumon_gpu_clock_max_hertz", clock="sm")["0"] == 1980e6
    assert gpu_values(out, "gpumon_gpu_nvlink_links_active")["0"] == 18
    assert gpu_values(out, "gpumon_gpu_temperature_threshold_celsius", threshold="slowdown")["0"] == 89   # a real H100, driver 580
    assert set(gpu_values(out, "gpumon_gpu_temperature_celsius", sensor="gpu")) == {str(i) for i in range(8)}
    assert gpu_values(out, "gpumon_gpu_memory_total_bytes")["0"] == 81559 * 2**20
    energy = gpu_values(out, "gpumon_gpu_energy_joules_total")["0"]
    fake.tick(M.SLOW_FIELD_SECONDS)     # energy is a slow field: asked again after 30 s
    clock.t += M.SLOW_FIELD_SECONDS
    assert gpu_values(c.collect(), "gpumon_gpu_energy_joules_total")["0"] > energy
    c.close()


def test_slow_fields_are_asked_every_30_seconds_and_their_last_value_stands_in_between() -> None:
    """The fields the driver answers with milliseconds of CPU (energy, thermal violation counters, PCIe
    counters: tests/fixtures/nvml/h100_r580.json) are asked once every SLOW_FIELD_SECONDS; every run
    in between still exports them, with the value last read."""
    fake, c, clock = rig(count=1, driver="580.159.04")
    slow_ids = {fs.field_id for fs in M.FIELDS if fs.slow}
    assert {83, 75, 269, 270, 94, 197, 198} == slow_ids
    asked = field_ids_asked(fake)
    first = gpu_values(c.collect(), "gpumon_gpu_energy_joules_total")["0"]
    assert slow_ids <= asked[-1]
    for _ in range(2):
        fake.tick(10)
        clock.t += 10
        out = c.collect()
        assert not asked[-1] & slow_ids and 82 in asked[-1]          # every other field, every run
        assert gpu_values(out, "gpumon_gpu_energy_joules_total")["0"] == first
        assert gpu_values(out, "gpumon_gpu_pcie_bytes_total", direction="tx")
    fake.tick(10)
    clock.t += 10
    out = c.collect()
    assert slow_ids <= asked[-1]
    assert gpu_values(out, "gpumon_gpu_energy_joules_total")["0"] > first
    c.close()


def test_h100_steady_state_is_at_most_8_nvml_calls_per_gpu_per_run() -> None:
    """8 calls, the power sample buffer (min/max/mean power) among them: the SM clock shares the slow
    rotation so that the per-run power-sample call fits the budget."""
    fake, c, _ = rig()
    c.collect()   # discovery run: identity, maxima, GPM buffers, every slow value once
    per_run = []
    for _ in range(30):
        fake.reset_calls()
        fake.tick(10)
        c.collect()
        per_run.append([fake.calls_for_gpu(g) for g in range(8)])
    assert max(max(r) for r in per_run) <= 8
    assert per_run[-1] == [8] * 8   # the budget is used, not wasted
    assert fake.gpu_calls[("nvmlDeviceGetSamples", 0)] == 1   # in the last run: once per GPU per run
    c.close()


def test_without_budget_everything_is_read_every_run() -> None:
    fake, c, _ = rig(max_calls_per_gpu=0)
    c.collect()
    fake.reset_calls()
    c.collect()
    assert fake.calls_for_gpu(0) > 9
    assert fake.gpu_calls[("nvmlDeviceGetCurrentClocksEventReasons", 0)] == 1
    c.close()


def test_slow_values_all_refresh_within_a_bounded_number_of_runs() -> None:
    fake, c, _ = rig(count=1)
    c.collect()
    fake.reset_calls()
    for _ in range(30):
        c.collect()
    for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetBAR1MemoryInfo",
               "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetCurrPcieLinkWidth"):
        assert fake.gpu_calls[(fn, 0)] >= 2, fn
    # clock-event reasons are weighted to refresh more often than the rest
    assert fake.gpu_calls[("nvmlDeviceGetCurrentClocksEventReasons", 0)] > \
        fake.gpu_calls[("nvmlDeviceGetBAR1MemoryInfo", 0)]
    c.close()


def test_h100_default_series_count_fits_the_host_budget() -> None:
    _, c, _ = rig()
    out = c.collect()
    n = series(out)
    # 8 GPUs + 9 IB ports must fit 2,500 series; IB takes up to ~800
    assert 600 <= n <= 1000, n
    _, c2, _ = rig(nvlink_per_link=True)
    out2 = c2.collect()
    assert {"gpumon_gpu_nvlink_link_up", "gpumon_gpu_nvlink_link_errors_total",
            "gpumon_gpu_nvlink_link_bytes_total"} <= names(out2)
    # up, 4 error types, 2 directions per link
    assert series(out2, gpu_only=True) - series(out, gpu_only=True) == 8 * 18 * 7
    link_types = {s.label("type") for f in out2.families if f.name == "gpumon_gpu_nvlink_link_errors_total"
                  for s in f.samples}
    assert link_types == {"replay", "recovery", "crc_flit", "crc_data"}
    c.close()
    c2.close()


def test_a10_has_a_fan_an_encoder_and_no_nvlink_hbm_or_gpm() -> None:
    _, c, _ = rig("a10", 1)
    out = c.collect()
    assert "gpumon_gpu_fan_speed_ratio" in names(out)
    assert set(gpu_values(out, "gpumon_gpu_utilization_ratio", engine="encoder")) == {"0"}
    assert gpu_values(out, "gpumon_gpu_temperature_celsius", sensor="memory") == {}
    assert not names(out) & {"gpumon_gpu_nvlink_links", "gpumon_gpu_nvlink_bytes_total",
                             "gpumon_gpu_activity_ratio"}
    info = next(f for f in out.families if f.name == "gpumon_gpu_info").samples[0]
    assert info.label("mig_mode") == ""   # not MIG-capable
    c.close()


def test_a100_has_nvlink_but_no_gpm() -> None:
    _, c, _ = rig("a100-sxm4-80gb", 8)
    out = c.collect()
    assert gpu_values(out, "gpumon_gpu_nvlink_links")["3"] == 12
    assert "gpumon_gpu_activity_ratio" not in names(out)
    c.close()


def test_per_process_series_are_opt_in() -> None:
    _, c, _ = rig(count=2, per_process=True)
    out = c.collect()
    pids = {s.label("pid") for f in out.families if f.name == "gpumon_gpu_process_memory_bytes"
            for s in f.samples}
    assert pids == {"4000", "4010"}
    c.close()


def test_mig_gives_per_instance_memory_and_gpm_and_drops_refused_whole_gpu_metrics() -> None:
    fake, c, _ = rig(count=2)
    fake.set_mig(0, instances=3)
    out = c.collect()
    mig_mem = [s for f in out.families if f.name == "gpumon_gpu_mig_memory_used_bytes" for s in f.samples]
    assert {(s.label("gpu"), s.label("gpu_instance"), s.label("compute_instance")) for s in mig_mem} == \
        {("0", "7", "0"), ("0", "8", "0"), ("0", "9", "0")}
    assert {s.label("activity") for f in out.families if f.name == "gpumon_gpu_mig_activity_ratio"
            for s in f.samples} >= {"sm", "dram_bandwidth"}
    assert set(gpu_values(out, "gpumon_gpu_utilization_ratio", engine="gpu")) == {"1"}   # refused under MIG
    assert set(gpu_values(out, "gpumon_gpu_power_watts")) == {"0", "1"}
    info = {s.label("gpu"): s.label("mig_mode") for f in out.families if f.name == "gpumon_gpu_info"
            for s in f.samples}
    assert info == {"0": "enabled", "1": "disabled"}
    assert out.errors.get("nvml_not_supported", 0) >= 1
    c.close()


def test_each_mig_device_is_named_with_its_profile_and_a_layout_change_shows_at_the_reprobe() -> None:
    fake, c, clock = rig(count=2)
    fake.set_mig(1, instances=2)

    def mig_info() -> set[tuple[str | None, ...]]:
        return {(s.label("gpu"), s.label("gpu_instance"), s.label("profile")) for f in c.collect().families
                if f.name == "gpumon_gpu_mig_info" for s in f.samples}

    assert mig_info() == {("1", "7", "1g.10gb"), ("1", "8", "1g.10gb")}
    mh = fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(1), 0)
    assert fake.nvmlDeviceGetName(mh) == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"   # nvidia-smi -L's form
    fake.set_mig(0, instances=1)                                   # MIG on mid-run: seen at the re-probe
    assert ("0", "7", "1g.10gb") not in mig_info()
    clock.t += 3600
    assert mig_info() == {("0", "7", "1g.10gb"), ("1", "7", "1g.10gb"), ("1", "8", "1g.10gb")}
    c.close()


def test_a_mig_name_without_a_profile_gives_an_empty_one() -> None:
    from gpumon.collectors.nvml import mig_profile

    assert mig_profile("NVIDIA A100-SXM4-40GB MIG 3g.20gb") == "3g.20gb"
    assert mig_profile("NVIDIA H100 80GB HBM3") == ""


def test_every_declared_metric_is_well_formed_and_documented() -> None:
    specs = NvmlCollector.metrics()
    assert len({s.name for s in specs}) == len(specs)
    with open("docs/metrics.md", encoding="utf-8") as fh:
        doc = fh.read()
    section = doc[doc.index("<!-- BEGIN nvml -->"):doc.index("<!-- END nvml -->")]
    for spec in specs:
        assert spec.name.startswith("gpumon_")
        assert f"`{spec.name}`" in section, spec.name
    assert CG.INFO_SPEC in specs


@pytest.mark.parametrize("profile", ["h100-sxm5-80gb", "a100-sxm4-80gb", "a10"])
def test_counters_never_go_backwards_across_runs(profile: str) -> None:
    fake, c, _ = rig(profile, 2)
    prev: dict[tuple[str, tuple], float] = {}
    for _ in range(5):
        fake.tick(5)
        out = c.collect()
        for fam in out.families:
            if fam.spec.type.value == "counter":
                for s in fam.samples:
                    key = (fam.name, s.labels)
                    assert s.value >= prev.get(key, 0.0), key
                    prev[key] = s.value
    c.close()


def reasons(out: Collection, gpu: str = "0") -> set[str]:
    return {s.label("reason") or "" for f in out.families if f.name == "gpumon_gpu_clock_event_violation_seconds_total"
            for s in f.samples if s.label("gpu") == gpu}


def test_a_580_driver_adds_pcie_bytes_recovery_action_and_the_newer_violation_counters() -> None:
    _, c, _ = rig(count=2, driver="580.65.06")
    out = c.collect()
    assert names(out) >= R580_ONLY
    assert {"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"} <= reasons(out)
    c.close()


@pytest.mark.parametrize("driver", ["550.90.07", "570.133.20", "575.57.08"])
def test_fields_269_to_271_are_not_read_before_r580(driver: str) -> None:
    """R570/R575 numbered power-smoothing fields 269-271 (the double answers them, as those drivers
    do): read as clock-event counters they would be nonsense."""
    _, c, _ = rig(count=1, driver=driver)
    out = c.collect()
    assert not reasons(out) & {"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
    assert {"sw_power_cap", "thermal"} <= reasons(out)   # fields 74-81 are there on every driver
    c.close()


@pytest.mark.parametrize("driver", ["535.183.06", "550.90.07"])
def test_gpu_temperature_before_r570_comes_from_the_older_call(driver: str) -> None:
    fake, c, _ = rig(count=2, driver=driver)
    out = c.collect()
    assert set(gpu_values(out, "gpumon_gpu_temperature_celsius", sensor="gpu")) == {"0", "1"}   # first run too
    assert all(20 < t < 100 for t in gpu_values(out, "gpumon_gpu_temperature_celsius", sensor="gpu").values())
    fake.reset_calls()
    for _ in range(3):
        out = c.collect()
        assert set(gpu_values(out, "gpumon_gpu_temperature_celsius", sensor="gpu")) == {"0", "1"}
    assert fake.calls["nvmlDeviceGetTemperatureV"] == 0      # not asked again every run
    assert fake.gpu_calls[("nvmlDeviceGetTemperature", 0)] == 3
    c.close()


def test_gpu_temperature_from_r570_uses_the_v_call() -> None:
    fake, c, _ = rig(count=1, driver="570.133.20")
    out = c.collect()
    assert set(gpu_values(out, "gpumon_gpu_temperature_celsius", sensor="gpu")) == {"0"}
    assert fake.calls["nvmlDeviceGetTemperature"] == 0
    c.close()


def test_thresholds_are_absolute_temperatures_not_tlimit_margins() -> None:
    fake, c, clock = rig(count=2)
    asked: list[Any] = []
    real_get = fake.nvmlDeviceGetFieldValues

    def recording(handle: Any, field_ids: list[Any]) -> Any:
        asked.extend(f[0] if isinstance(f, tuple) else f for f in field_ids)
        return real_get(handle, field_ids)

    fake.nvmlDeviceGetFieldValues = recording  # type: ignore[method-assign]
    out = c.collect()
    thresholds = {s.label("threshold"): s.value for f in out.families
                  if f.name == "gpumon_gpu_temperature_threshold_celsius" for s in f.samples if s.label("gpu") == "1"}
    assert thresholds == {"shutdown": 95, "slowdown": 89, "memory_max": 95, "gpu_max": 87}   # a real H100
    assert not {193, 194, 195, 196} & set(asked)        # the signed T.Limit fields are not read
    fake.reset_calls()
    c.collect()
    assert fake.calls["nvmlDeviceGetTemperatureThreshold"] == 0   # static: discovery and hourly
    clock.t += 3600
    c.collect()
    assert fake.calls["nvmlDeviceGetTemperatureThreshold"] == 2 * 4
    _, a10, _ = rig("a10", 1)
    out = a10.collect()
    assert {s.label("threshold"): s.value for f in out.families
            if f.name == "gpumon_gpu_temperature_threshold_celsius" for s in f.samples} == \
        {"shutdown": 98, "slowdown": 95, "gpu_max": 93}   # no HBM: no memory_max
    c.close()
    a10.close()


def nvlink_errors(out: Collection, gpu: str = "0") -> dict[str, float]:
    return {s.label("type") or "": s.value for f in out.families if f.name == "gpumon_gpu_nvlink_errors_total"
            for s in f.samples if s.label("gpu") == gpu}


def test_nvlink_error_totals_sum_every_link() -> None:
    fake, c, _ = rig(count=1)
    fake.add_nvlink_errors(0, 0, "replay", 2)
    fake.add_nvlink_errors(0, 7, "replay", 3)
    fake.add_nvlink_errors(0, 17, "recovery", 1)
    fake.add_nvlink_errors(0, 11, "crc_data", 4)
    out = c.collect()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    flit = sum(fake.nvmlDeviceGetNvLinkErrorCounter(h, link, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)
               for link in range(18))
    assert nvlink_errors(out) == {"replay": 5, "recovery": 1, "crc_flit": flit, "crc_data": 4}
    # one link answering an error this run: no total for that type (a partial sum would look like a reset)
    fake.fail_field(52, 999, gpu=0, scope=9)
    out = c.collect()
    assert "replay" not in nvlink_errors(out) and nvlink_errors(out)["crc_data"] == 4
    # one link refusing the field for good: the total covers the links that have it
    fake.clear_faults()
    fake.fail_field(59, 3, gpu=0, scope=17)   # NOT_SUPPORTED
    c.collect()
    out = c.collect()
    assert nvlink_errors(out)["recovery"] == 0 and nvlink_errors(out)["replay"] == 5
    # the budget holds: still one field call per GPU
    fake.reset_calls()
    c.collect()
    assert fake.gpu_calls[("nvmlDeviceGetFieldValues", 0)] == 1
    c.close()


def test_nvlink_error_totals_from_a_driver_that_ignores_the_link_are_not_multiplied(monkeypatch) -> None:
    """Should a driver answer the GPU-wide total whatever the scopeId, every link reads the same value:
    that value is the total (summing would count it 18 times)."""
    fake, c, _ = rig(count=1)
    real_field = FakeNVML._field

    def scope_ignored(self: FakeNVML, g: Any, fid: int, scope: int) -> Any:
        if fid in (38, 45, 52, 59):
            gpu_total = sum(real_field(self, g, fid, link)[2] for link in range(18))
            return pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, gpu_total
        return real_field(self, g, fid, scope)

    monkeypatch.setattr(FakeNVML, "_field", scope_ignored)
    fake.add_nvlink_errors(0, 3, "replay", 6)
    fake.add_nvlink_errors(0, 4, "replay", 1)
    out = c.collect()
    assert nvlink_errors(out)["replay"] == 7
    c.close()


def test_gpm_buffers_are_freed_whenever_they_are_dropped() -> None:
    fake, c, clock = rig(count=2)
    fake.set_mig(0, instances=3)
    c.collect()
    assert fake.gpm_samples_allocated() == 2 * 2 + 3 * 2          # a pair per GPU and per GPU instance
    fake.set_mig(0, instances=2)                                   # one GPU instance destroyed
    clock.t += 3600                                                # layout re-read at the re-probe
    c.collect()
    assert fake.gpm_samples_allocated() == 2 * 2 + 2 * 2
    fake.set_mig(0, instances=0)                                   # MIG off
    clock.t += 3600
    c.collect()
    assert fake.gpm_samples_allocated() == 2 * 2
    fake.set_lost(1, xid=False)                                    # lost, then back after a reset
    c.collect()
    fake.restore(1)
    clock.t += 61
    c.collect()
    assert fake.gpm_samples_allocated() == 2 * 2
    fake.fail("nvmlGpmSampleGet", 3, gpu=1)                        # GPM refused: its pair goes
    c.collect()
    assert fake.gpm_samples_allocated() == 2
    c.session.invalidate("driver reloaded")                        # a new session generation
    clock.t += 1
    c.collect()
    assert fake.gpm_samples_allocated() == 2
    c.close()
    assert fake.gpm_samples_allocated() == 0


def test_a_failed_second_gpm_allocation_frees_the_first(monkeypatch) -> None:
    fake, c, _ = rig(count=1)
    real_alloc = fake.nvmlGpmSampleAlloc
    allocs = iter([False, True])

    def second_fails() -> Any:
        if next(allocs, False):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_MEMORY)
        return real_alloc()

    fake.nvmlGpmSampleAlloc = second_fails  # type: ignore[method-assign]
    c.collect()
    assert fake.gpm_samples_allocated() == 0
    c.close()


def test_gpm_graphics_activity_is_asked_every_30_seconds_and_stands_in_between() -> None:
    """GRAPHICS_UTIL costs the driver 1.5 ms of CPU per metrics call (the other GPM metrics 11 µs:
    tests/fixtures/nvml/h100_r580.json), so it is asked once every SLOW_FIELD_SECONDS; the other
    activity ratios are asked every run, and graphics keeps its last value in between."""
    fake, c, clock = rig(count=1)
    asked = gpm_ids_asked(fake)
    first = gpu_values(c.collect(), "gpumon_gpu_activity_ratio", activity="graphics")
    assert 1 in asked[-1] and 2 in asked[-1] and "0" in first
    fake.tick(10)
    clock.t += 10
    out = c.collect()
    assert 1 not in asked[-1] and 2 in asked[-1]
    assert gpu_values(out, "gpumon_gpu_activity_ratio", activity="graphics") == first
    fake.tick(M.SLOW_FIELD_SECONDS)
    clock.t += M.SLOW_FIELD_SECONDS
    c.collect()
    assert 1 in asked[-1]
    c.close()


def test_pcie_byte_counters_wrapping_at_4_gib_still_only_grow() -> None:
    """Fields 197/198 are 32-bit counters in the driver (valueType unsigned int on a real H100,
    tests/fixtures/nvml/h100_r580.json): a wrap between two reads adds the bytes that passed, it does
    not look like a counter reset."""
    fake, c, clock = rig(count=1, driver="580.159.04")
    gpu = fake._gpus[0]
    gpu.pcie_tx = 2**32 - 1000
    first = gpu_values(c.collect(), "gpumon_gpu_pcie_bytes_total", direction="tx")["0"]
    assert first == 2**32 - 1000
    gpu.pcie_tx = 2**32 + 5000          # the driver answers 5000: the counter wrapped
    clock.t += M.SLOW_FIELD_SECONDS
    second = gpu_values(c.collect(), "gpumon_gpu_pcie_bytes_total", direction="tx")["0"]
    assert second - first == 6000
    c.close()


def test_a_slow_field_that_fails_once_is_asked_again_on_the_next_run() -> None:
    """A transient error (UNKNOWN, not a refusal that drops the field) leaves energy absent for that
    run only, as for any field: it is asked again on the next run, not 30 s later."""
    fake, c, clock = rig(count=1, driver="580.159.04")
    asked = field_ids_asked(fake)
    fake.fail_field(83, pynvml.NVML_ERROR_UNKNOWN)
    assert "0" not in gpu_values(c.collect(), "gpumon_gpu_energy_joules_total")
    fake.clear_faults()
    clock.t += 10
    out = c.collect()
    assert 83 in asked[-1] and "0" in gpu_values(out, "gpumon_gpu_energy_joules_total")
    clock.t += 10
    c.collect()
    assert 83 not in asked[-1]           # read well: back to once every 30 s
    c.close()


def test_gpm_graphics_that_fails_once_is_asked_again_on_the_next_run() -> None:
    fake, c, clock = rig(count=1)
    asked = gpm_ids_asked(fake)
    fake.fail_gpm_metric(1, pynvml.NVML_ERROR_UNKNOWN)
    assert "0" not in gpu_values(c.collect(), "gpumon_gpu_activity_ratio", activity="graphics")
    fake.clear_faults()
    fake.tick(10)
    clock.t += 10
    out = c.collect()
    assert 1 in asked[-1] and "0" in gpu_values(out, "gpumon_gpu_activity_ratio", activity="graphics")
    c.close()

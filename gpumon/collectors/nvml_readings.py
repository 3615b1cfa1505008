"""Where each GPU metric's value comes from in NVML (the metrics themselves are declared in
:mod:`gpumon.catalogue.gpu`).

Three tiers keep the NVML call count per GPU small and bounded:

- **fields**: one ``nvmlDeviceGetFieldValues`` call per GPU per run fetches every value that has a
  field id (power, energy, memory temperature, ECC, row remapping, PCIe counters, clock-event
  violation times, NVLink per-link values and their sums), each with its own return code;
- **fast calls**: values with no field id that move every second (utilization, memory, GPU
  temperature) and the power sample buffer, one call each per run;
- **slow calls**: point readings and values that move slowly (SM/memory/graphics clocks, clock-event
  reason bits, PCIe link state, BAR1, P-state, encoder/decoder, processes, fan) share the per-GPU call
  budget left after the fast tier, oldest first, weighted so the SM clock and the clock-event reasons
  refresh more often.

Static facts (identity, maxima, temperature thresholds, ECC/MIG mode, GPM support, NVLink count) are
read at discovery and at every hourly re-probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumon.catalogue.gpu import (
    BAR1_TOTAL,
    BAR1_USED,
    CLOCK,
    CLOCK_REASON,
    CLOCK_VIOLATION,
    ECC,
    ENERGY,
    FAN,
    MEM_FREE,
    MEM_RESERVED,
    MEM_TOTAL,
    MEM_USED,
    NVLINK_ERRORS,
    PCIE_BYTES,
    PCIE_GEN,
    PCIE_REPLAY,
    PCIE_WIDTH,
    POWER,
    POWER_LIMIT,
    PROC_MEM,
    PROCS,
    PROCS_MEM,
    PSTATE,
    RECOVERY,
    REMAP,
    REMAP_FAILURE,
    REMAP_PENDING,
    RETIRED,
    RETIRED_PENDING,
    TEMP,
    UTIL,
)
from gpumon.collectors.nvml_tables import CLOCK_EVENT_REASONS
from gpumon.model import MetricSpec

Row = tuple[MetricSpec, tuple[str, ...], float]
"""One value: its family, the label values after ``gpu, uuid``, and the value."""

# --- the field tier ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldSpec:
    field_id: int
    name: str           # NVML_FI_DEV_* suffix, for the docs
    spec: MetricSpec
    extra: tuple[str, ...] = ()
    scale: float = 1.0
    fallback: str = ""  # key of a slow call that stands in when this field is not supported
    min_driver: int = 0  # asked only from this driver branch on (the id meant something else before)
    #: The driver answers it slowly (busy CPU, not waiting): asked at most every SLOW_FIELD_SECONDS,
    #: and its last value stands in between. Measured on an H100 with driver 580
    #: (tests/fixtures/nvml/h100_r580.json, ``us_per_field_alone``): these cost 0.14-3.2 ms of CPU
    #: each per call, every other field about 15 µs.
    slow: bool = False
    #: The driver's counter wraps at this value (0: it does not): the collector adds up differences
    #: modulo it, so the exported total only grows.
    wraps: int = 0


SLOW_FIELD_SECONDS = 30.0
"""How often the slow fields are asked: their values are counters read with rate() over minutes."""


# Fields 193-196 (TEMPERATURE_*_TLIMIT) are not used: they are signed margins on the T.Limit scale
# (nvidia-smi's "GPU Shutdown T.Limit Temp: -5 C"), not temperatures; the absolute thresholds come from
# nvmlDeviceGetTemperatureThreshold (THRESHOLDS, static).
FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(82, "MEMORY_TEMP", TEMP, ("memory",)),
    FieldSpec(83, "TOTAL_ENERGY_CONSUMPTION", ENERGY, (), 1e-3, "energy", slow=True),
    FieldSpec(186, "POWER_INSTANT", POWER, (), 1e-3, "power"),
    FieldSpec(190, "POWER_CURRENT_LIMIT", POWER_LIMIT, (), 1e-3, "power_limit"),
    FieldSpec(74, "PERF_POLICY_POWER", CLOCK_VIOLATION, ("sw_power_cap",), 1e-9),
    FieldSpec(75, "PERF_POLICY_THERMAL", CLOCK_VIOLATION, ("thermal",), 1e-9, slow=True),
    FieldSpec(76, "PERF_POLICY_SYNC_BOOST", CLOCK_VIOLATION, ("sync_boost",), 1e-9),
    FieldSpec(77, "PERF_POLICY_BOARD_LIMIT", CLOCK_VIOLATION, ("board_limit",), 1e-9),
    FieldSpec(78, "PERF_POLICY_LOW_UTILIZATION", CLOCK_VIOLATION, ("low_utilization",), 1e-9),
    FieldSpec(79, "PERF_POLICY_RELIABILITY", CLOCK_VIOLATION, ("reliability",), 1e-9),
    FieldSpec(80, "PERF_POLICY_TOTAL_APP_CLOCKS", CLOCK_VIOLATION, ("total_app_clocks",), 1e-9),
    FieldSpec(81, "PERF_POLICY_TOTAL_BASE_CLOCKS", CLOCK_VIOLATION, ("total_base_clocks",), 1e-9),
    # 269-271 are these counters from R580 on; R570/R575 numbered power-smoothing fields there
    FieldSpec(269, "CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN", CLOCK_VIOLATION, ("sw_thermal_slowdown",), 1e-9,
              min_driver=580, slow=True),
    FieldSpec(270, "CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN", CLOCK_VIOLATION, ("hw_thermal_slowdown",), 1e-9,
              min_driver=580, slow=True),
    FieldSpec(271, "CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN", CLOCK_VIOLATION,
              ("hw_power_brake_slowdown",), 1e-9, min_driver=580),
    FieldSpec(94, "PCIE_REPLAY_COUNTER", PCIE_REPLAY, (), 1.0, "pcie_replay", slow=True),
    FieldSpec(197, "PCIE_COUNT_TX_BYTES", PCIE_BYTES, ("tx",), slow=True, wraps=2**32),
    FieldSpec(198, "PCIE_COUNT_RX_BYTES", PCIE_BYTES, ("rx",), slow=True, wraps=2**32),
    FieldSpec(3, "ECC_SBE_VOL_TOTAL", ECC, ("corrected", "volatile"), 1.0, "ecc_cv"),
    FieldSpec(4, "ECC_DBE_VOL_TOTAL", ECC, ("uncorrected", "volatile"), 1.0, "ecc_uv"),
    FieldSpec(5, "ECC_SBE_AGG_TOTAL", ECC, ("corrected", "aggregate"), 1.0, "ecc_ca"),
    FieldSpec(6, "ECC_DBE_AGG_TOTAL", ECC, ("uncorrected", "aggregate"), 1.0, "ecc_ua"),
    FieldSpec(29, "RETIRED_SBE", RETIRED, ("sbe",)),
    FieldSpec(30, "RETIRED_DBE", RETIRED, ("dbe",)),
    FieldSpec(31, "RETIRED_PENDING", RETIRED_PENDING),
    FieldSpec(142, "REMAPPED_COR", REMAP, ("correctable",), 1.0, "remap"),
    FieldSpec(143, "REMAPPED_UNC", REMAP, ("uncorrectable",), 1.0, "remap"),
    FieldSpec(144, "REMAPPED_PENDING", REMAP_PENDING, (), 1.0, "remap"),
    FieldSpec(145, "REMAPPED_FAILURE", REMAP_FAILURE, (), 1.0, "remap"),
    FieldSpec(230, "GET_GPU_RECOVERY_ACTION", RECOVERY),
)
SLOW_FIELD_IDS = frozenset(fs.field_id for fs in FIELDS if fs.slow)

# The "_TOTAL" error fields count all lanes of the link named in scopeId: asked per link and summed.
NVLINK_TOTAL_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(38, "NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", NVLINK_ERRORS, ("crc_flit",)),
    FieldSpec(45, "NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", NVLINK_ERRORS, ("crc_data",)),
    FieldSpec(52, "NVLINK_REPLAY_ERROR_COUNT_TOTAL", NVLINK_ERRORS, ("replay",)),
    FieldSpec(59, "NVLINK_RECOVERY_ERROR_COUNT_TOTAL", NVLINK_ERRORS, ("recovery",)),
)
FIELD_NVLINK_LINK_COUNT = 91
FIELD_NVLINK_STATE = 165          # scopeId = link
FIELD_NVLINK_TX_KIB = 138         # scopeId = link
FIELD_NVLINK_RX_KIB = 139         # scopeId = link
NVLINK_LINK_ERROR_FIELDS: tuple[tuple[int, str], ...] = ((161, "replay"), (162, "recovery"), (163, "crc_flit"))
NVLINK_ERROR_DL_CRC_DATA = 3      # nvmlDeviceGetNvLinkErrorCounter counter id (no per-link field for 12+)

# nvmlDeviceGetTemperatureThreshold(h, NVML_TEMPERATURE_THRESHOLD_*): absolute celsius, static
THRESHOLDS: tuple[tuple[int, str], ...] = ((0, "shutdown"), (1, "slowdown"), (2, "memory_max"), (3, "gpu_max"))

# --- the call tiers ----------------------------------------------------------------------------------

Parser = Callable[[Any, "ParseContext"], list[Row]]


@dataclass
class ParseContext:
    per_process: bool = False
    #: ``(pid, gpu_instance or None)`` of the processes the last processes call returned; set per
    #: GPU by the collector (None before the call), read back to publish the GPU directory
    processes: list[tuple[int, int | None]] | None = None


@dataclass(frozen=True)
class CallItem:
    key: str
    fn: str
    args: tuple[Any, ...]
    parse: Parser
    weight: int = 1
    fallback: str = ""
    #: Reads the value in place of ``fn(handle, *args)``, for calls that fill a struct passed by
    #: reference: ``read(session, device)``.
    read: Callable[[Any, Any], Any] | None = None


def _ratio_percent(engine: str) -> Parser:
    return lambda v, _c: [(UTIL, (engine,), v[0] / 100.0)]


def _util(v: Any, _c: ParseContext) -> list[Row]:
    return [(UTIL, ("gpu",), v.gpu / 100.0), (UTIL, ("memory",), v.memory / 100.0)]


def _memory(v: Any, _c: ParseContext) -> list[Row]:
    rows: list[Row] = [(MEM_TOTAL, (), float(v.total)), (MEM_USED, (), float(v.used)), (MEM_FREE, (), float(v.free))]
    if hasattr(v, "reserved"):
        rows.append((MEM_RESERVED, (), float(v.reserved)))
    return rows


def _clock(name: str, spec: MetricSpec = CLOCK) -> Parser:
    return lambda v, _c: [(spec, (name,), float(v) * 1e6)]


def _scalar(spec: MetricSpec, extra: tuple[str, ...] = (), scale: float = 1.0) -> Parser:
    return lambda v, _c: [(spec, extra, float(v) * scale)]


def _reasons(v: Any, _c: ParseContext) -> list[Row]:
    mask = int(v)
    return [(CLOCK_REASON, (name,), 1.0 if mask & bit else 0.0) for bit, name in CLOCK_EVENT_REASONS]


def _bar1(v: Any, _c: ParseContext) -> list[Row]:
    return [(BAR1_TOTAL, (), float(v.bar1Total)), (BAR1_USED, (), float(v.bar1Used))]


def _pstate(v: Any, _c: ParseContext) -> list[Row]:
    return [(PSTATE, (), float(v))] if 0 <= int(v) <= 15 else []


def _processes(v: Any, ctx: ParseContext) -> list[Row]:
    procs = list(v or [])
    ctx.processes = [(int(p.pid), _instance(getattr(p, "gpuInstanceId", None))) for p in procs]
    used = [p.usedGpuMemory for p in procs if getattr(p, "usedGpuMemory", None) is not None]
    rows: list[Row] = [(PROCS, (), float(len(procs))), (PROCS_MEM, (), float(sum(used)))]
    if ctx.per_process:
        per_pid: dict[int, float] = {}
        for p in procs:
            if getattr(p, "usedGpuMemory", None) is not None:
                per_pid[p.pid] = per_pid.get(p.pid, 0.0) + float(p.usedGpuMemory)
        rows.extend((PROC_MEM, (str(pid),), mem) for pid, mem in sorted(per_pid.items()))
    return rows


def _instance(gi: Any) -> int | None:
    """A process's MIG GPU instance; NVML answers 0xFFFFFFFF (NVML_VALUE_NOT_AVAILABLE) without MIG."""
    return None if gi is None or int(gi) >= 0xFFFFFFFF else int(gi)


def _remapped(v: Any, _c: ParseContext) -> list[Row]:
    corr, unc, pending, failure = v
    return [(REMAP, ("correctable",), float(corr)), (REMAP, ("uncorrectable",), float(unc)),
            (REMAP_PENDING, (), float(pending)), (REMAP_FAILURE, (), float(failure))]


NVML_MEMORY_V2 = 0x02000028
CLOCK_GRAPHICS, CLOCK_SM, CLOCK_MEM = 0, 1, 2

FAST_CALLS: tuple[CallItem, ...] = (
    CallItem("utilization", "nvmlDeviceGetUtilizationRates", (), _util),
    CallItem("memory", "nvmlDeviceGetMemoryInfo", (NVML_MEMORY_V2,), _memory, fallback="memory_v1"),
    # nvmlDeviceGetTemperatureV exists from R570 on; older drivers answer FUNCTION_NOT_FOUND
    CallItem("temperature", "nvmlDeviceGetTemperatureV", (0,), _scalar(TEMP, ("gpu",)),
             fallback="temperature_legacy"),
)
SLOW_CALLS: tuple[CallItem, ...] = (
    CallItem("clock_reasons", "nvmlDeviceGetCurrentClocksEventReasons", (), _reasons, weight=3),
    # the SM clock, a point reading, left the per-run tier so that the per-run power-sample call fits the
    # budget of 8; the violation counters (fields, every run) are the precise throttling measure
    CallItem("clock_sm", "nvmlDeviceGetClockInfo", (CLOCK_SM,), _clock("sm")),
    CallItem("clock_memory", "nvmlDeviceGetClockInfo", (CLOCK_MEM,), _clock("memory")),
    CallItem("clock_graphics", "nvmlDeviceGetClockInfo", (CLOCK_GRAPHICS,), _clock("graphics")),
    CallItem("pcie_generation", "nvmlDeviceGetCurrPcieLinkGeneration", (), _scalar(PCIE_GEN)),
    CallItem("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", (), _scalar(PCIE_WIDTH)),
    CallItem("processes", "nvmlDeviceGetComputeRunningProcesses", (), _processes),
    CallItem("pstate", "nvmlDeviceGetPerformanceState", (), _pstate),
    CallItem("bar1", "nvmlDeviceGetBAR1MemoryInfo", (), _bar1),
    CallItem("encoder", "nvmlDeviceGetEncoderUtilization", (), _ratio_percent("encoder")),
    CallItem("decoder", "nvmlDeviceGetDecoderUtilization", (), _ratio_percent("decoder")),
    CallItem("fan", "nvmlDeviceGetFanSpeed", (), _scalar(FAN, (), 0.01)),
)
# Fallbacks read in the fast tier, every run; the others share the slow rotation. Energy is not among
# them: its call costs as much as its field (3 ms of CPU on an H100, driver 580).
FAST_FALLBACKS = frozenset({"power"})
FALLBACK_CALLS: dict[str, CallItem] = {c.key: c for c in (
    CallItem("memory_v1", "nvmlDeviceGetMemoryInfo", (), _memory),
    CallItem("temperature_legacy", "nvmlDeviceGetTemperature", (0,), _scalar(TEMP, ("gpu",))),
    CallItem("power", "nvmlDeviceGetPowerUsage", (), _scalar(POWER, (), 1e-3)),
    CallItem("energy", "nvmlDeviceGetTotalEnergyConsumption", (), _scalar(ENERGY, (), 1e-3)),
    CallItem("power_limit", "nvmlDeviceGetEnforcedPowerLimit", (), _scalar(POWER_LIMIT, (), 1e-3)),
    CallItem("pcie_replay", "nvmlDeviceGetPcieReplayCounter", (), _scalar(PCIE_REPLAY)),
    CallItem("ecc_cv", "nvmlDeviceGetTotalEccErrors", (0, 0), _scalar(ECC, ("corrected", "volatile"))),
    CallItem("ecc_uv", "nvmlDeviceGetTotalEccErrors", (1, 0), _scalar(ECC, ("uncorrected", "volatile"))),
    CallItem("ecc_ca", "nvmlDeviceGetTotalEccErrors", (0, 1), _scalar(ECC, ("corrected", "aggregate"))),
    CallItem("ecc_ua", "nvmlDeviceGetTotalEccErrors", (1, 1), _scalar(ECC, ("uncorrected", "aggregate"))),
    CallItem("remap", "nvmlDeviceGetRemappedRows", (), _remapped),
)}

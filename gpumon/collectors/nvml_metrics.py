"""The GPU metric families and where each value comes from in NVML.

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

from gpumon.collectors.nvml_tables import CLOCK_EVENT_REASONS, FABRIC_CONDITIONS, GPM_RATIOS
from gpumon.metric_catalogue import (
    AGG_COUNTER,
    AGG_FLAG,
    AGG_LAST,
    ERRORS_DESCRIPTION,
    STATUS_DESCRIPTION,
    AzureHint,
    Domain,
    InfoColumns,
    Kind,
    NoColumns,
    OtelMetric,
    each,
    gpu_columns,
)
from gpumon.metric_catalogue import GPU as GPU_ROW
from gpumon.model import MetricSpec, MetricType

G = ("gpu", "uuid")
GAUGE, COUNTER, INFO = MetricType.GAUGE, MetricType.COUNTER, MetricType.INFO
MIG_LABELS = ("gpu", "uuid", "gpu_instance", "compute_instance")


def _m(name: str, kind: MetricType, help: str, unit: str = "", labels: tuple[str, ...] = (), *,
       otel: tuple[OtelMetric, ...] = (), azure: tuple[AzureHint, ...] = ()) -> MetricSpec:
    return MetricSpec(name, kind, help, unit, G + labels, otel=otel, azure=azure)


# Label values the Azure GPU row gives a column each (the other sinks take every value as it comes).
_DIRECTIONS = (("tx", "Transmit"), ("rx", "Receive"))
_VIOLATIONS = ("sw_power_cap", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability",
               "total_app_clocks", "total_base_clocks", "sw_thermal_slowdown", "hw_thermal_slowdown",
               "hw_power_brake_slowdown")
"""The ``reason`` values of CLOCK_VIOLATION that FIELDS reads (a test checks the two agree)."""


INFO_SPEC = MetricSpec(
    "gpumon_gpu_info", INFO, "GPU identity (value 1).", "",
    G + ("model", "pci_bus_id", "serial", "vbios", "driver_version", "cuda_version", "mig_mode"),
    azure=(InfoColumns("", GPU_ROW, (
        ("model", "Model"), ("pci_bus_id", "PciBusId"), ("serial", "Serial"), ("vbios", "VbiosVersion"),
        ("driver_version", "DriverVersion"), ("cuda_version", "CudaVersion"), ("mig_mode", "MigMode"))),))
LOST = _m("gpumon_gpu_lost", GAUGE, "1 when the GPU stopped answering (fell off the bus, needs a reset).",
          otel=(OtelMetric("hw.status", "1", Kind.STATUS_INVERTED, Domain.GPU, semconv=True,
                           description=STATUS_DESCRIPTION),),
          azure=(gpu_columns("Lost", AGG_FLAG),))
UTIL = _m("gpumon_gpu_utilization_ratio", GAUGE,
          "Fraction of the last sample period the engine was busy (gpu, memory, encoder, decoder).",
          "ratio", ("engine",),
          otel=(OtelMetric("hw.gpu.utilization", "1", Kind.GAUGE, Domain.GPU,
                           label_map=(("engine", "hw.gpu.task"),),
                           description="Fraction of time the GPU's engines were busy (hw.gpu.task: general, "
                                       "encoder, decoder).", semconv=True, exclude=(("engine", "memory"),)),
                OtelMetric("hw.gpu.memory.utilization", "1", Kind.GAUGE, Domain.GPU, semconv=True,
                           description="Fraction of time the GPU's memory controller was busy.",
                           select=(("engine", "memory"),))),
          azure=(gpu_columns("", split_label="engine",
                             split=(("gpu", "Utilization"), ("memory", "MemoryUtilization"))),
                 gpu_columns("", ("max",), split_label="engine", split=(
                     ("encoder", "EncoderUtilization"), ("decoder", "DecoderUtilization")))))
MEM_TOTAL = _m("gpumon_gpu_memory_total_bytes", GAUGE, "Framebuffer memory size.", "bytes",
               otel=(OtelMetric("hw.gpu.memory.limit", "By", Kind.UPDOWN, Domain.GPU, semconv=True),),
               azure=(gpu_columns("MemoryTotalBytes", AGG_LAST, static=True),))
MEM_USED = _m("gpumon_gpu_memory_used_bytes", GAUGE, "Framebuffer memory in use.", "bytes",
              otel=(OtelMetric("hw.gpu.memory.usage", "By", Kind.UPDOWN, Domain.GPU, semconv=True),),
              azure=(gpu_columns("MemoryUsedBytes"),))
MEM_FREE = _m("gpumon_gpu_memory_free_bytes", GAUGE, "Framebuffer memory free.", "bytes",
              azure=(gpu_columns("MemoryFreeBytes", ("min",)),))
MEM_RESERVED = _m("gpumon_gpu_memory_reserved_bytes", GAUGE, "Framebuffer memory reserved by the driver.",
                  "bytes", azure=(gpu_columns("MemoryReservedBytes", AGG_LAST, static=True),))
BAR1_TOTAL = _m("gpumon_gpu_bar1_total_bytes", GAUGE, "BAR1 aperture size.", "bytes",
                azure=(gpu_columns("Bar1TotalBytes", AGG_LAST, static=True),))
BAR1_USED = _m("gpumon_gpu_bar1_used_bytes", GAUGE, "BAR1 aperture in use.", "bytes",
               azure=(gpu_columns("Bar1UsedBytes", ("max",)),))
TEMP = _m("gpumon_gpu_temperature_celsius", GAUGE, "Temperature of the GPU die or the HBM (sensor).",
          "celsius", ("sensor",),
          otel=(OtelMetric("hw.temperature", "Cel", Kind.GAUGE, Domain.GPU_TEMPERATURE,
                           label_map=(("sensor", "hw.sensor_location"),), semconv=True),),
          azure=(gpu_columns("", split_label="sensor", split=(
              ("gpu", "TemperatureCelsius"), ("memory", "MemoryTemperatureCelsius"))),))
TEMP_THRESHOLD = _m("gpumon_gpu_temperature_threshold_celsius", GAUGE,
                    "Temperature at which the GPU slows down or shuts down, or the maximum operating "
                    "temperature of the GPU or its memory (absolute, like the temperature).", "celsius",
                    ("threshold",),
                    otel=(OtelMetric("hw.temperature.limit", "Cel", Kind.GAUGE, Domain.GPU_TEMPERATURE,
                                     label_map=(("threshold", "hw.limit_type"),), semconv=True,
                                     description="Temperature limit of the GPU's or its memory's sensor, by "
                                                 "hw.limit_type."),),
                    azure=(gpu_columns("", AGG_LAST, split_label="threshold", static=True, split=(
                        ("shutdown", "ShutdownTemperatureCelsius"),
                        ("slowdown", "SlowdownTemperatureCelsius"), ("gpu_max", "MaxTemperatureCelsius"),
                        ("memory_max", "MemoryMaxTemperatureCelsius"))),))
POWER = _m("gpumon_gpu_power_watts", GAUGE, "Power draw.", "watts",
           otel=(OtelMetric("hw.power", "W", Kind.GAUGE, Domain.GPU, semconv=True),),
           azure=(gpu_columns("PowerWatts"),))
POWER_LIMIT = _m("gpumon_gpu_power_limit_watts", GAUGE, "Enforced power limit.", "watts",
                 azure=(gpu_columns("PowerLimitWatts", AGG_LAST, static=True),))
ENERGY = _m("gpumon_gpu_energy_joules_total", COUNTER, "Energy used since the driver was loaded.", "joules",
            otel=(OtelMetric("hw.energy", "J", Kind.COUNTER, Domain.GPU, semconv=True),),
            azure=(gpu_columns("EnergyJoules", AGG_COUNTER),))
CLOCK = _m("gpumon_gpu_clock_hertz", GAUGE, "Current clock (sm, memory, graphics).", "hertz", ("clock",),
           azure=(gpu_columns("", split_label="clock", split=(("sm", "SmClockHertz"),)),
                  gpu_columns("", ("min",), split_label="clock",
                              split=(("memory", "MemoryClockHertz"), ("graphics", "GraphicsClockHertz")))))
CLOCK_MAX = _m("gpumon_gpu_clock_max_hertz", GAUGE, "Maximum clock (sm, memory, graphics).", "hertz",
               ("clock",), azure=(gpu_columns("", AGG_LAST, split_label="clock",
                                              split=each("", ("sm", "memory", "graphics"), "ClockMaxHertz"),
                                              static=True),))
CLOCK_REASON = _m("gpumon_gpu_clock_event_reason_active", GAUGE,
                  "1 while the reason holds clocks back (sampled; use the violation counters for totals).",
                  "", ("reason",), azure=(gpu_columns("", ("avg",), split_label="reason", split=each(
                      "ClockEvent", tuple(name for _, name in CLOCK_EVENT_REASONS))),))
CLOCK_VIOLATION = _m("gpumon_gpu_clock_event_violation_seconds_total", COUNTER,
                     "Time clocks were held below target, per reason.", "seconds", ("reason",),
                     azure=(gpu_columns("", ("increase",), split_label="reason",  # seconds, as the metric
                                        split=each("ClockViolation", _VIOLATIONS)),))
PCIE_GEN = _m("gpumon_gpu_pcie_link_generation", GAUGE, "Current PCIe link generation.",
              azure=(gpu_columns("PcieLinkGeneration", ("min",)),))
PCIE_GEN_MAX = _m("gpumon_gpu_pcie_link_generation_max", GAUGE, "Maximum PCIe link generation.",
                  azure=(gpu_columns("PcieLinkGenerationMax", AGG_LAST, static=True),))
PCIE_WIDTH = _m("gpumon_gpu_pcie_link_width", GAUGE, "Current PCIe link width (lanes).",
                azure=(gpu_columns("PcieLinkWidth", ("min",)),))
PCIE_WIDTH_MAX = _m("gpumon_gpu_pcie_link_width_max", GAUGE, "Maximum PCIe link width (lanes).",
                    azure=(gpu_columns("PcieLinkWidthMax", AGG_LAST, static=True),))
PCIE_BYTES = _m("gpumon_gpu_pcie_bytes_total", COUNTER, "PCIe bytes transferred (tx from the GPU, rx to it).",
                "bytes", ("direction",),
                otel=(OtelMetric("hw.gpu.io", "By", Kind.COUNTER, Domain.GPU,
                                 label_map=(("direction", "network.io.direction"),), semconv=True),),
                azure=(gpu_columns("", ("increase", "rate"), split_label="direction",
                                   split=tuple((v, f"Pcie{name}Bytes") for v, name in _DIRECTIONS)),))
PCIE_REPLAY = _m("gpumon_gpu_pcie_replay_total", COUNTER, "PCIe replays (link-level retransmissions).",
                 otel=(OtelMetric("hw.errors", "{error}", Kind.COUNTER, Domain.GPU,
                                  (("error.type", "pcie_replay"),), description=ERRORS_DESCRIPTION,
                                  semconv=True),),
                 azure=(gpu_columns("PcieReplays", AGG_COUNTER),))
ECC_MODE = _m("gpumon_gpu_ecc_enabled", GAUGE, "1 when ECC is on.",
              azure=(gpu_columns("EccEnabled", AGG_FLAG, static=True),))
# ECC: the volatile counter is hw.errors (see docs/metrics.md for why); the lifetime one has its own name
ECC = _m("gpumon_gpu_ecc_errors_total", COUNTER,
         "ECC errors: type corrected/uncorrected, counter volatile (since driver load) or aggregate "
         "(lifetime).", "", ("type", "counter"),
         otel=(OtelMetric("hw.errors", "{error}", Kind.COUNTER, Domain.GPU,
                          label_map=(("type", "error.type"),), description=ERRORS_DESCRIPTION, semconv=True,
                          select=(("counter", "volatile"),)),
               OtelMetric("gpumon.gpu.ecc.errors.lifetime", "{error}", Kind.COUNTER, Domain.GPU,
                          label_map=(("type", "error.type"),), select=(("counter", "aggregate"),),
                          description="ECC errors over the GPU's lifetime (NVML's aggregate counter, kept in "
                                      "the InfoROM across driver reloads and reboots), error.type "
                                      "corrected/uncorrected.")),
         azure=(gpu_columns("", AGG_COUNTER, split_label="type", where=(("counter", "volatile"),), split=(
             ("corrected", "EccCorrectedErrors"), ("uncorrected", "EccUncorrectedErrors"))),))
RETIRED = _m("gpumon_gpu_retired_pages", GAUGE, "Pages retired (pre-Ampere), by cause (sbe, dbe).", "",
             ("cause",), azure=(gpu_columns("", AGG_LAST, split_label="cause",
                                            split=each("RetiredPages", ("sbe", "dbe"))),))
RETIRED_PENDING = _m("gpumon_gpu_retired_pages_pending", GAUGE, "1 when a page awaits retirement (reset).",
                     azure=(gpu_columns("RetiredPagesPending", AGG_FLAG),))
REMAP = _m("gpumon_gpu_remapped_rows", GAUGE, "Rows remapped (Ampere+), by cause.", "", ("cause",),
           azure=(gpu_columns("", AGG_LAST, split_label="cause",
                              split=each("RemappedRows", ("correctable", "uncorrectable"))),))
REMAP_PENDING = _m("gpumon_gpu_remapped_rows_pending", GAUGE, "1 when a row remap awaits a GPU reset.",
                   azure=(gpu_columns("RemappedRowsPending", AGG_FLAG),))
REMAP_FAILURE = _m("gpumon_gpu_remapped_rows_failure", GAUGE, "1 when a row remap failed (replace the GPU).",
                   azure=(gpu_columns("RemappedRowsFailure", AGG_FLAG),))
RECOVERY = _m("gpumon_gpu_recovery_action", GAUGE,
              "Recovery the driver asks for: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and "
              "reset, 5 recover IMEX domain, 6 bus reset, 7 system reboot.",
              azure=(gpu_columns("RecoveryAction", AGG_LAST),))
NVLINK_LINKS = _m("gpumon_gpu_nvlink_links", GAUGE, "NVLink links the GPU has.",
                  azure=(gpu_columns("NvlinkLinks", AGG_LAST, static=True),))
NVLINK_ACTIVE = _m("gpumon_gpu_nvlink_links_active", GAUGE, "NVLink links up.",
                   azure=(gpu_columns("NvlinkLinksActive", ("min",)),))
NVLINK_ERRORS = _m("gpumon_gpu_nvlink_errors_total", COUNTER, "NVLink errors over all links, by type.", "",
                   ("type",), azure=(gpu_columns("", ("increase",), split_label="type", split=each(
                       "Nvlink", ("crc_flit", "crc_data", "replay", "recovery"), "Errors")),))
NVLINK_BYTES = _m("gpumon_gpu_nvlink_bytes_total", COUNTER, "NVLink data bytes over all links.", "bytes",
                  ("direction",), azure=(gpu_columns("", ("increase", "rate"), split_label="direction",
                                                     split=tuple((v, f"Nvlink{name}Bytes")
                                                                 for v, name in _DIRECTIONS)),))
NVLINK_LINK_UP = _m("gpumon_gpu_nvlink_link_up", GAUGE, "1 when the link is up (opt-in per link).", "",
                    ("link",), azure=(NoColumns("per-link (opt-in); the row has NvlinkLinksActiveMin"),))
NVLINK_LINK_ERRORS = _m("gpumon_gpu_nvlink_link_errors_total", COUNTER,
                        "NVLink errors per link, by type (opt-in per link).", "", ("link", "type"),
                        azure=(NoColumns("per-link (opt-in); the row has the per-type totals"),))
NVLINK_LINK_BYTES = _m("gpumon_gpu_nvlink_link_bytes_total", COUNTER,
                       "NVLink data bytes per link (opt-in per link).", "bytes", ("link", "direction"),
                       azure=(NoColumns("per-link (opt-in); the row has the totals"),))
FAN = _m("gpumon_gpu_fan_speed_ratio", GAUGE, "Fan speed as a fraction of its maximum.", "ratio",
         otel=(OtelMetric("hw.fan.speed_ratio", "1", Kind.GAUGE, Domain.GPU_FAN, semconv=True),),
         azure=(gpu_columns("FanSpeed", ("max",)),))
PSTATE = _m("gpumon_gpu_performance_state", GAUGE, "Performance state (0 = P0, fastest; 15 slowest).",
            azure=(gpu_columns("PerformanceState", ("min", "max")),))
PROCS = _m("gpumon_gpu_compute_processes", GAUGE, "Compute processes on the GPU.",
           azure=(gpu_columns("ComputeProcesses", ("max",)),))
PROCS_MEM = _m("gpumon_gpu_compute_processes_memory_bytes", GAUGE, "GPU memory used by compute processes.",
               "bytes", azure=(gpu_columns("ComputeProcessesMemoryBytes", ("max",)),))
PROC_MEM = _m("gpumon_gpu_process_memory_bytes", GAUGE, "GPU memory used per process (opt-in).", "bytes",
              ("pid",), azure=(NoColumns("per process id: unbounded, no fixed column"),))
PROC_UTIL = _m("gpumon_gpu_process_utilization_ratio", GAUGE,
               "Utilization per process in the driver's newest sampling period since the previous run "
               "(sm, memory, encoder, decoder); the top per_process_top processes per GPU by name, the "
               "rest summed as pid=\"other\" (opt-in).", "ratio", ("pid", "process", "engine"),
               azure=(NoColumns("per process id: unbounded, no fixed column"),))
ACTIVITY = _m("gpumon_gpu_activity_ratio", GAUGE,
              "GPM profiling over the run interval (Hopper+): graphics, sm, sm_occupancy, tensor, "
              "dram_bandwidth, fp64, fp32, fp16.", "ratio", ("activity",),
              azure=(gpu_columns("", ("avg",), split_label="activity",
                                 split=each("", tuple(name for _, name in GPM_RATIOS), "Activity")),))
GPM_PCIE = _m("gpumon_gpu_pcie_throughput_bytes_per_second", GAUGE, "PCIe throughput measured by GPM.",
              "bytes_per_second", ("direction",),
              azure=(gpu_columns("", ("avg",), split_label="direction", split=tuple(
                  (v, f"GpmPcie{name}BytesPerSecond") for v, name in _DIRECTIONS)),))
GPM_NVLINK = _m("gpumon_gpu_nvlink_throughput_bytes_per_second", GAUGE, "NVLink throughput measured by GPM.",
                "bytes_per_second", ("direction",),
                azure=(gpu_columns("", ("avg",), split_label="direction", split=tuple(
                    (v, f"GpmNvlink{name}BytesPerSecond") for v, name in _DIRECTIONS)),))
MIG_MEM_TOTAL = MetricSpec("gpumon_gpu_mig_memory_total_bytes", GAUGE, "Memory of a MIG instance.", "bytes",
                           MIG_LABELS, azure=(NoColumns("per MIG instance: no fixed column"),))
MIG_MEM_USED = MetricSpec("gpumon_gpu_mig_memory_used_bytes", GAUGE, "Memory in use in a MIG instance.",
                          "bytes", MIG_LABELS, azure=(NoColumns("per MIG instance: no fixed column"),))
MIG_INFO = MetricSpec("gpumon_gpu_mig_info", INFO,
                      "A MIG device: its GPU instance profile (as nvidia-smi -L names it) and MIG UUID "
                      "(value 1).", "", MIG_LABELS + ("profile", "mig_uuid"),
                      azure=(NoColumns("per MIG instance: no fixed column"),))
MIG_ACTIVITY = MetricSpec("gpumon_gpu_mig_activity_ratio", GAUGE,
                          "GPM profiling per MIG GPU instance.", "ratio", MIG_LABELS + ("activity",),
                          azure=(NoColumns("per MIG instance: no fixed column"),))
POWER_MIN = _m("gpumon_gpu_power_min_watts", GAUGE,
               "Lowest power sample the driver took since the previous run (NVML_TOTAL_POWER_SAMPLES).", "watts",
               azure=(gpu_columns("PowerSamplesWatts", ("min",)),))
POWER_MAX = _m("gpumon_gpu_power_max_watts", GAUGE,
               "Highest power sample the driver took since the previous run (NVML_TOTAL_POWER_SAMPLES).",
               "watts", azure=(gpu_columns("PowerSamplesWatts", ("max",)),))
POWER_MEAN = _m("gpumon_gpu_power_mean_watts", GAUGE,
                "Mean of the power samples the driver took since the previous run.", "watts",
                azure=(gpu_columns("PowerSamplesWatts", ("avg",)),))
FABRIC_INFO = MetricSpec(
    "gpumon_gpu_fabric_info", INFO,
    "NVLink fabric membership (value 1) once registration completed: GPUs with the same cluster_uuid and "
    "clique_id share one NVLink domain.", "", G + ("cluster_uuid", "clique_id"),
    azure=(InfoColumns("", GPU_ROW, (
        ("cluster_uuid", "FabricClusterUuid"), ("clique_id", "FabricCliqueId"))),))
FABRIC_STATE = _m("gpumon_gpu_fabric_state", GAUGE,
                  "Registration with the NVLink fabric manager: 0 not supported, 1 not started, 2 in progress, "
                  "3 completed.", azure=(gpu_columns("FabricState", ("min",)),))
FABRIC_STATUS = _m("gpumon_gpu_fabric_status", GAUGE,
                   "Outcome of the fabric registration as an NVML return code (0 success); only once the state "
                   "is completed.", azure=(gpu_columns("FabricStatus", AGG_LAST),))
FABRIC_HEALTH = _m("gpumon_gpu_fabric_health_condition", GAUGE,
                   "1 while the NVLink fabric health condition holds (degraded_bandwidth, route_recovery, "
                   "route_unhealthy, access_timeout_recovery, incorrect_configuration, partition_unassigned, "
                   "gfm_disconnected); absent where the driver does not report it.", "", ("condition",),
                   azure=(gpu_columns("", AGG_FLAG, split_label="condition",
                                      split=each("Fabric", tuple(c.name for c in FABRIC_CONDITIONS))),))
FABRIC_SUMMARY = _m("gpumon_gpu_fabric_health_overall", GAUGE,
                    "The driver's fabric health summary: 1 healthy, 2 unhealthy, 3 limited capacity.",
                    azure=(gpu_columns("FabricHealthSummary", ("max",)),))
CALLS = MetricSpec("gpumon_nvml_calls_total", COUNTER, "NVML library calls made, by function.", "",
                   ("function",))

ALL_SPECS: tuple[MetricSpec, ...] = (
    INFO_SPEC, LOST, UTIL, MEM_TOTAL, MEM_USED, MEM_FREE, MEM_RESERVED, BAR1_TOTAL, BAR1_USED, TEMP,
    TEMP_THRESHOLD, POWER, POWER_LIMIT, ENERGY, CLOCK, CLOCK_MAX, CLOCK_REASON, CLOCK_VIOLATION, PCIE_GEN,
    PCIE_GEN_MAX, PCIE_WIDTH, PCIE_WIDTH_MAX, PCIE_BYTES, PCIE_REPLAY, ECC_MODE, ECC, RETIRED,
    RETIRED_PENDING, REMAP, REMAP_PENDING, REMAP_FAILURE, RECOVERY, NVLINK_LINKS, NVLINK_ACTIVE,
    NVLINK_ERRORS, NVLINK_BYTES, NVLINK_LINK_UP, NVLINK_LINK_ERRORS, NVLINK_LINK_BYTES, FAN, PSTATE, PROCS,
    PROCS_MEM, PROC_MEM, PROC_UTIL, ACTIVITY, GPM_PCIE, GPM_NVLINK, MIG_INFO, MIG_MEM_TOTAL, MIG_MEM_USED,
    MIG_ACTIVITY,
    POWER_MIN, POWER_MAX, POWER_MEAN, FABRIC_INFO, FABRIC_STATE, FABRIC_STATUS, FABRIC_HEALTH, FABRIC_SUMMARY,
    CALLS,
)

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

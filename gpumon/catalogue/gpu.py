"""The GPU metrics: NVML's (the nvml collector) and the XID watcher's, each declared once.

The nvml collector (:mod:`gpumon.collectors.nvml_readings`) says where each value comes from in NVML;
this module says what the metric is: name, type, typed unit, help, labels and its sink hints.
"""

from __future__ import annotations

from gpumon.catalogue.hints import (
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
from gpumon.catalogue.hints import GPU as GPU_ROW
from gpumon.catalogue.units import (
    BYTES,
    BYTES_PER_SECOND,
    CELSIUS,
    COUNT,
    ERRORS,
    EVENTS,
    HERTZ,
    JOULES,
    RATIO,
    SECONDS,
    STATE,
    WATTS,
    Unit,
    count,
)
from gpumon.catalogue.units import (
    INFO as INFO_UNIT,
)
from gpumon.model import MetricSpec, MetricType

CLOCK_EVENT_REASON_VALUES = ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown",
                             "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown",
                             "hw_power_brake_slowdown", "display_clock_setting")
"""The ``reason`` values of CLOCK_REASON, one per nvmlClocksEventReason bit (the collector's
``nvml_tables.CLOCK_EVENT_REASONS`` pairs each with its bit; a test checks the two agree)."""
ACTIVITY_VALUES = ("graphics", "sm", "sm_occupancy", "tensor", "dram_bandwidth", "fp64", "fp32", "fp16")
"""The ``activity`` values of ACTIVITY, one per GPM ratio (``nvml_tables.GPM_RATIOS``)."""
FABRIC_CONDITION_VALUES = ("degraded_bandwidth", "route_recovery", "route_unhealthy", "access_timeout_recovery",
                           "incorrect_configuration", "partition_unassigned", "gfm_disconnected")
"""The ``condition`` values of FABRIC_HEALTH (``nvml_tables.FABRIC_CONDITIONS``)."""

G = ("gpu", "uuid")
GAUGE, COUNTER, INFO = MetricType.GAUGE, MetricType.COUNTER, MetricType.INFO
MIG_LABELS = ("gpu", "uuid", "gpu_instance", "compute_instance")


def _m(name: str, kind: MetricType, help: str, unit: Unit, labels: tuple[str, ...] = (), *,
       otel: tuple[OtelMetric, ...] = (), azure: tuple[AzureHint, ...] = ()) -> MetricSpec:
    """A per-GPU metric: labelled ``gpu, uuid`` first, then ``labels``."""
    return MetricSpec(name, kind, help, unit, G + labels, otel=otel, azure=azure)


# Label values the Azure GPU row gives a column each (the other sinks take every value as it comes).
_DIRECTIONS = (("tx", "Transmit"), ("rx", "Receive"))
_VIOLATIONS = ("sw_power_cap", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability",
               "total_app_clocks", "total_base_clocks", "sw_thermal_slowdown", "hw_thermal_slowdown",
               "hw_power_brake_slowdown")
"""The ``reason`` values of CLOCK_VIOLATION that FIELDS reads (a test checks the two agree)."""


INFO_SPEC = MetricSpec(
    "gpumon_gpu_info", INFO, "GPU identity (value 1).", INFO_UNIT,
    G + ("model", "pci_bus_id", "serial", "vbios", "driver_version", "cuda_version", "mig_mode"),
    azure=(InfoColumns("", GPU_ROW, (
        ("model", "Model"), ("pci_bus_id", "PciBusId"), ("serial", "Serial"), ("vbios", "VbiosVersion"),
        ("driver_version", "DriverVersion"), ("cuda_version", "CudaVersion"), ("mig_mode", "MigMode"))),))
LOST = _m("gpumon_gpu_lost", GAUGE, "1 when the GPU stopped answering (fell off the bus, needs a reset).",
unit=STATE,
          otel=(OtelMetric("hw.status", "1", Kind.STATUS_INVERTED, Domain.GPU, semconv=True,
                           description=STATUS_DESCRIPTION),),
          azure=(gpu_columns("Lost", AGG_FLAG),))
UTIL = _m("gpumon_gpu_utilization_ratio", GAUGE,
          "Fraction of the last sample period the engine was busy (gpu, memory, encoder, decoder).",
          RATIO, ("engine",),
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
MEM_TOTAL = _m("gpumon_gpu_memory_total_bytes", GAUGE, "Framebuffer memory size.", BYTES,
               otel=(OtelMetric("hw.gpu.memory.limit", "By", Kind.UPDOWN, Domain.GPU, semconv=True),),
               azure=(gpu_columns("MemoryTotalBytes", AGG_LAST, static=True),))
MEM_USED = _m("gpumon_gpu_memory_used_bytes", GAUGE, "Framebuffer memory in use.", BYTES,
              otel=(OtelMetric("hw.gpu.memory.usage", "By", Kind.UPDOWN, Domain.GPU, semconv=True),),
              azure=(gpu_columns("MemoryUsedBytes"),))
MEM_FREE = _m("gpumon_gpu_memory_free_bytes", GAUGE, "Framebuffer memory free.", BYTES,
              azure=(gpu_columns("MemoryFreeBytes", ("min",)),))
MEM_RESERVED = _m("gpumon_gpu_memory_reserved_bytes", GAUGE, "Framebuffer memory reserved by the driver.",
                  BYTES, azure=(gpu_columns("MemoryReservedBytes", AGG_LAST, static=True),))
BAR1_TOTAL = _m("gpumon_gpu_bar1_total_bytes", GAUGE, "BAR1 aperture size.", BYTES,
                azure=(gpu_columns("Bar1TotalBytes", AGG_LAST, static=True),))
BAR1_USED = _m("gpumon_gpu_bar1_used_bytes", GAUGE, "BAR1 aperture in use.", BYTES,
               azure=(gpu_columns("Bar1UsedBytes", ("max",)),))
TEMP = _m("gpumon_gpu_temperature_celsius", GAUGE, "Temperature of the GPU die or the HBM (sensor).",
          CELSIUS, ("sensor",),
          otel=(OtelMetric("hw.temperature", "Cel", Kind.GAUGE, Domain.GPU_TEMPERATURE,
                           label_map=(("sensor", "hw.sensor_location"),), semconv=True),),
          azure=(gpu_columns("", split_label="sensor", split=(
              ("gpu", "TemperatureCelsius"), ("memory", "MemoryTemperatureCelsius"))),))
TEMP_THRESHOLD = _m("gpumon_gpu_temperature_threshold_celsius", GAUGE,
                    "Temperature at which the GPU slows down or shuts down, or the maximum operating "
                    "temperature of the GPU or its memory (absolute, like the temperature).", CELSIUS,
                    ("threshold",),
                    otel=(OtelMetric("hw.temperature.limit", "Cel", Kind.GAUGE, Domain.GPU_TEMPERATURE,
                                     label_map=(("threshold", "hw.limit_type"),), semconv=True,
                                     description="Temperature limit of the GPU's or its memory's sensor, by "
                                                 "hw.limit_type."),),
                    azure=(gpu_columns("", AGG_LAST, split_label="threshold", static=True, split=(
                        ("shutdown", "ShutdownTemperatureCelsius"),
                        ("slowdown", "SlowdownTemperatureCelsius"), ("gpu_max", "MaxTemperatureCelsius"),
                        ("memory_max", "MemoryMaxTemperatureCelsius"))),))
POWER = _m("gpumon_gpu_power_watts", GAUGE, "Power draw.", WATTS,
           otel=(OtelMetric("hw.power", "W", Kind.GAUGE, Domain.GPU, semconv=True),),
           azure=(gpu_columns("PowerWatts"),))
POWER_LIMIT = _m("gpumon_gpu_power_limit_watts", GAUGE, "Enforced power limit.", WATTS,
                 azure=(gpu_columns("PowerLimitWatts", AGG_LAST, static=True),))
ENERGY = _m("gpumon_gpu_energy_joules_total", COUNTER, "Energy used since the driver was loaded.", JOULES,
            otel=(OtelMetric("hw.energy", "J", Kind.COUNTER, Domain.GPU, semconv=True),),
            azure=(gpu_columns("EnergyJoules", AGG_COUNTER),))
CLOCK = _m("gpumon_gpu_clock_hertz", GAUGE, "Current clock (sm, memory, graphics).", HERTZ, ("clock",),
           azure=(gpu_columns("", split_label="clock", split=(("sm", "SmClockHertz"),)),
                  gpu_columns("", ("min",), split_label="clock",
                              split=(("memory", "MemoryClockHertz"), ("graphics", "GraphicsClockHertz")))))
CLOCK_MAX = _m("gpumon_gpu_clock_max_hertz", GAUGE, "Maximum clock (sm, memory, graphics).", HERTZ,
               ("clock",), azure=(gpu_columns("", AGG_LAST, split_label="clock",
                                              split=each("", ("sm", "memory", "graphics"), "ClockMaxHertz"),
                                              static=True),))
CLOCK_REASON = _m("gpumon_gpu_clock_event_reason_active", GAUGE,
                  "1 while the reason holds clocks back (sampled; use the violation counters for totals).",
                  STATE, ("reason",), azure=(gpu_columns("", ("avg",), split_label="reason", split=each(
                      "ClockEvent", CLOCK_EVENT_REASON_VALUES)),))
CLOCK_VIOLATION = _m("gpumon_gpu_clock_event_violation_seconds_total", COUNTER,
                     "Time clocks were held below target, per reason.", SECONDS, ("reason",),
                     azure=(gpu_columns("", ("increase",), split_label="reason",  # seconds, as the metric
                                        split=each("ClockViolation", _VIOLATIONS)),))
PCIE_GEN = _m("gpumon_gpu_pcie_link_generation", GAUGE, "Current PCIe link generation.",
unit=count("generation"),
              azure=(gpu_columns("PcieLinkGeneration", ("min",)),))
PCIE_GEN_MAX = _m("gpumon_gpu_pcie_link_generation_max", GAUGE, "Maximum PCIe link generation.",
unit=count("generation"),
                  azure=(gpu_columns("PcieLinkGenerationMax", AGG_LAST, static=True),))
PCIE_WIDTH = _m("gpumon_gpu_pcie_link_width", GAUGE, "Current PCIe link width (lanes).", unit=count("lane"),
                azure=(gpu_columns("PcieLinkWidth", ("min",)),))
PCIE_WIDTH_MAX = _m("gpumon_gpu_pcie_link_width_max", GAUGE, "Maximum PCIe link width (lanes).",
unit=count("lane"),
                    azure=(gpu_columns("PcieLinkWidthMax", AGG_LAST, static=True),))
PCIE_BYTES = _m("gpumon_gpu_pcie_bytes_total", COUNTER, "PCIe bytes transferred (tx from the GPU, rx to it).",
                BYTES, ("direction",),
                otel=(OtelMetric("hw.gpu.io", "By", Kind.COUNTER, Domain.GPU,
                                 label_map=(("direction", "network.io.direction"),), semconv=True),),
                azure=(gpu_columns("", ("increase", "rate"), split_label="direction",
                                   split=tuple((v, f"Pcie{name}Bytes") for v, name in _DIRECTIONS)),))
PCIE_REPLAY = _m("gpumon_gpu_pcie_replay_total", COUNTER, "PCIe replays (link-level retransmissions).",
unit=EVENTS,
                 otel=(OtelMetric("hw.errors", "{error}", Kind.COUNTER, Domain.GPU,
                                  (("error.type", "pcie_replay"),), description=ERRORS_DESCRIPTION,
                                  semconv=True),),
                 azure=(gpu_columns("PcieReplays", AGG_COUNTER),))
ECC_MODE = _m("gpumon_gpu_ecc_enabled", GAUGE, "1 when ECC is on.", unit=STATE,
              azure=(gpu_columns("EccEnabled", AGG_FLAG, static=True),))
# ECC: the volatile counter is hw.errors (see docs/metrics.md for why); the lifetime one has its own name
ECC = _m("gpumon_gpu_ecc_errors_total", COUNTER,
         "ECC errors: type corrected/uncorrected, counter volatile (since driver load) or aggregate "
         "(lifetime).", ERRORS, ("type", "counter"),
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
RETIRED = _m("gpumon_gpu_retired_pages", GAUGE, "Pages retired (pre-Ampere), by cause (sbe, dbe).", count("page"),
             ("cause",), azure=(gpu_columns("", AGG_LAST, split_label="cause",
                                            split=each("RetiredPages", ("sbe", "dbe"))),))
RETIRED_PENDING = _m("gpumon_gpu_retired_pages_pending", GAUGE, "1 when a page awaits retirement (reset).",
unit=STATE,
                     azure=(gpu_columns("RetiredPagesPending", AGG_FLAG),))
REMAP = _m("gpumon_gpu_remapped_rows", GAUGE, "Rows remapped (Ampere+), by cause.", count("row"), ("cause",),
           azure=(gpu_columns("", AGG_LAST, split_label="cause",
                              split=each("RemappedRows", ("correctable", "uncorrectable"))),))
REMAP_PENDING = _m("gpumon_gpu_remapped_rows_pending", GAUGE, "1 when a row remap awaits a GPU reset.",
unit=STATE,
                   azure=(gpu_columns("RemappedRowsPending", AGG_FLAG),))
REMAP_FAILURE = _m("gpumon_gpu_remapped_rows_failure", GAUGE, "1 when a row remap failed (replace the GPU).",
unit=STATE,
                   azure=(gpu_columns("RemappedRowsFailure", AGG_FLAG),))
RECOVERY = _m("gpumon_gpu_recovery_action", GAUGE,
              "Recovery the driver asks for: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and "
              "reset, 5 recover IMEX domain, 6 bus reset, 7 system reboot.", unit=STATE,
              azure=(gpu_columns("RecoveryAction", AGG_LAST),))
NVLINK_LINKS = _m("gpumon_gpu_nvlink_links", GAUGE, "NVLink links the GPU has.", unit=count("link"),
                  azure=(gpu_columns("NvlinkLinks", AGG_LAST, static=True),))
NVLINK_ACTIVE = _m("gpumon_gpu_nvlink_links_active", GAUGE, "NVLink links up.", unit=count("link"),
                   azure=(gpu_columns("NvlinkLinksActive", ("min",)),))
NVLINK_ERRORS = _m("gpumon_gpu_nvlink_errors_total", COUNTER, "NVLink errors over all links, by type.", ERRORS,
                   ("type",), azure=(gpu_columns("", ("increase",), split_label="type", split=each(
                       "Nvlink", ("crc_flit", "crc_data", "replay", "recovery"), "Errors")),))
NVLINK_BYTES = _m("gpumon_gpu_nvlink_bytes_total", COUNTER, "NVLink data bytes over all links.", BYTES,
                  ("direction",), azure=(gpu_columns("", ("increase", "rate"), split_label="direction",
                                                     split=tuple((v, f"Nvlink{name}Bytes")
                                                                 for v, name in _DIRECTIONS)),))
NVLINK_LINK_UP = _m("gpumon_gpu_nvlink_link_up", GAUGE, "1 when the link is up (opt-in per link).", STATE,
                    ("link",), azure=(NoColumns("per-link (opt-in); the row has NvlinkLinksActiveMin"),))
NVLINK_LINK_ERRORS = _m("gpumon_gpu_nvlink_link_errors_total", COUNTER,
                        "NVLink errors per link, by type (opt-in per link).", ERRORS, ("link", "type"),
                        azure=(NoColumns("per-link (opt-in); the row has the per-type totals"),))
NVLINK_LINK_BYTES = _m("gpumon_gpu_nvlink_link_bytes_total", COUNTER,
                       "NVLink data bytes per link (opt-in per link).", BYTES, ("link", "direction"),
                       azure=(NoColumns("per-link (opt-in); the row has the totals"),))
FAN = _m("gpumon_gpu_fan_speed_ratio", GAUGE, "Fan speed as a fraction of its maximum.", RATIO,
         otel=(OtelMetric("hw.fan.speed_ratio", "1", Kind.GAUGE, Domain.GPU_FAN, semconv=True),),
         azure=(gpu_columns("FanSpeed", ("max",)),))
PSTATE = _m("gpumon_gpu_performance_state", GAUGE, "Performance state (0 = P0, fastest; 15 slowest).",
unit=count("pstate"),
            azure=(gpu_columns("PerformanceState", ("min", "max")),))
PROCS = _m("gpumon_gpu_compute_processes", GAUGE, "Compute processes on the GPU.", unit=count("process"),
           azure=(gpu_columns("ComputeProcesses", ("max",)),))
PROCS_MEM = _m("gpumon_gpu_compute_processes_memory_bytes", GAUGE, "GPU memory used by compute processes.",
               BYTES, azure=(gpu_columns("ComputeProcessesMemoryBytes", ("max",)),))
PROC_MEM = _m("gpumon_gpu_process_memory_bytes", GAUGE, "GPU memory used per process (opt-in).", BYTES,
              ("pid",), azure=(NoColumns("per process id: unbounded, no fixed column"),))
PROC_UTIL = _m("gpumon_gpu_process_utilization_ratio", GAUGE,
               "Utilization per process in the driver's newest sampling period since the previous run "
               "(sm, memory, encoder, decoder); the top per_process_top processes per GPU by name, the "
               "rest summed as pid=\"other\" (opt-in).", RATIO, ("pid", "process", "engine"),
               azure=(NoColumns("per process id: unbounded, no fixed column"),))
ACTIVITY = _m("gpumon_gpu_activity_ratio", GAUGE,
              "GPM profiling over the run interval (Hopper+): graphics, sm, sm_occupancy, tensor, "
              "dram_bandwidth, fp64, fp32, fp16.", RATIO, ("activity",),
              azure=(gpu_columns("", ("avg",), split_label="activity",
                                 split=each("", ACTIVITY_VALUES, "Activity")),))
GPM_PCIE = _m("gpumon_gpu_pcie_throughput_bytes_per_second", GAUGE, "PCIe throughput measured by GPM.",
              BYTES_PER_SECOND, ("direction",),
              azure=(gpu_columns("", ("avg",), split_label="direction", split=tuple(
                  (v, f"GpmPcie{name}BytesPerSecond") for v, name in _DIRECTIONS)),))
GPM_NVLINK = _m("gpumon_gpu_nvlink_throughput_bytes_per_second", GAUGE, "NVLink throughput measured by GPM.",
                BYTES_PER_SECOND, ("direction",),
                azure=(gpu_columns("", ("avg",), split_label="direction", split=tuple(
                    (v, f"GpmNvlink{name}BytesPerSecond") for v, name in _DIRECTIONS)),))
MIG_MEM_TOTAL = MetricSpec("gpumon_gpu_mig_memory_total_bytes", GAUGE, "Memory of a MIG instance.", BYTES,
                           MIG_LABELS, azure=(NoColumns("per MIG instance: no fixed column"),))
MIG_MEM_USED = MetricSpec("gpumon_gpu_mig_memory_used_bytes", GAUGE, "Memory in use in a MIG instance.",
                          BYTES, MIG_LABELS, azure=(NoColumns("per MIG instance: no fixed column"),))
MIG_INFO = MetricSpec("gpumon_gpu_mig_info", INFO,
                      "A MIG device: its GPU instance profile (as nvidia-smi -L names it) and MIG UUID "
                      "(value 1).", INFO_UNIT, MIG_LABELS + ("profile", "mig_uuid"),
                      azure=(NoColumns("per MIG instance: no fixed column"),))
MIG_ACTIVITY = MetricSpec("gpumon_gpu_mig_activity_ratio", GAUGE,
                          "GPM profiling per MIG GPU instance.", RATIO, MIG_LABELS + ("activity",),
                          azure=(NoColumns("per MIG instance: no fixed column"),))
POWER_MIN = _m("gpumon_gpu_power_min_watts", GAUGE,
               "Lowest power sample the driver took since the previous run (NVML_TOTAL_POWER_SAMPLES).", WATTS,
               azure=(gpu_columns("PowerSamplesWatts", ("min",)),))
POWER_MAX = _m("gpumon_gpu_power_max_watts", GAUGE,
               "Highest power sample the driver took since the previous run (NVML_TOTAL_POWER_SAMPLES).",
               WATTS, azure=(gpu_columns("PowerSamplesWatts", ("max",)),))
POWER_MEAN = _m("gpumon_gpu_power_mean_watts", GAUGE,
                "Mean of the power samples the driver took since the previous run.", WATTS,
                azure=(gpu_columns("PowerSamplesWatts", ("avg",)),))
FABRIC_INFO = MetricSpec(
    "gpumon_gpu_fabric_info", INFO,
    "NVLink fabric membership (value 1) once registration completed: GPUs with the same cluster_uuid and "
    "clique_id share one NVLink domain.", INFO_UNIT, G + ("cluster_uuid", "clique_id"),
    azure=(InfoColumns("", GPU_ROW, (
        ("cluster_uuid", "FabricClusterUuid"), ("clique_id", "FabricCliqueId"))),))
FABRIC_STATE = _m("gpumon_gpu_fabric_state", GAUGE,
                  "Registration with the NVLink fabric manager: 0 not supported, 1 not started, 2 in progress, "
                  "3 completed.", unit=STATE, azure=(gpu_columns("FabricState", ("min",)),))
FABRIC_STATUS = _m("gpumon_gpu_fabric_status", GAUGE,
                   "Outcome of the fabric registration as an NVML return code (0 success); only once the state "
                   "is completed.", unit=STATE, azure=(gpu_columns("FabricStatus", AGG_LAST),))
FABRIC_HEALTH = _m("gpumon_gpu_fabric_health_condition", GAUGE,
                   "1 while the NVLink fabric health condition holds (degraded_bandwidth, route_recovery, "
                   "route_unhealthy, access_timeout_recovery, incorrect_configuration, partition_unassigned, "
                   "gfm_disconnected); absent where the driver does not report it.", STATE, ("condition",),
                   azure=(gpu_columns("", AGG_FLAG, split_label="condition",
                                      split=each("Fabric", FABRIC_CONDITION_VALUES)),))
FABRIC_SUMMARY = _m("gpumon_gpu_fabric_health_overall", GAUGE,
                    "The driver's fabric health summary: 1 healthy, 2 unhealthy, 3 limited capacity.",
                    unit=COUNT,
                    azure=(gpu_columns("FabricHealthSummary", ("max",)),))
CALLS = MetricSpec("gpumon_nvml_calls_total", COUNTER, "NVML library calls made, by function.", count("call"),
                   ("function",))

NVML_SPECS: tuple[MetricSpec, ...] = (
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
"""What the nvml collector declares (``NvmlCollector.metrics()``), in the order it adds them."""

# --- the XID watcher (collectors/xid.py) ------------------------------------------------------------
XID_TOTAL = MetricSpec("gpumon_gpu_xid_errors_total", MetricType.COUNTER,
                       "XID errors reported by the driver since gpumon started, by XID number.", ERRORS,
                       ("gpu", "uuid", "xid"),
                       otel=(OtelMetric("hw.errors", "{error}", Kind.COUNTER, Domain.GPU,
                                        label_map=(("xid", "error.type"),), description=ERRORS_DESCRIPTION,
                                        semconv=True),))
RECOVERY_TOTAL = MetricSpec("gpumon_gpu_recovery_action_events_total", MetricType.COUNTER,
                            "Recovery-action events from the driver, by requested action.", EVENTS,
                            ("gpu", "uuid", "action"))
THREAD_UP = MetricSpec("gpumon_xid_watcher_up", MetricType.GAUGE,
                       "1 while the XID event thread is waiting on NVML events.", unit=STATE)

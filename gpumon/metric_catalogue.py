"""The metric catalogue: the hints a sink needs to map a metric, keyed by the metric's name.

A metric is declared once, as a :class:`gpumon.model.MetricSpec` (name, type, unit, help, labels),
by the collector that produces it. What a sink needs beyond that is a *hint* beside the declaration:

- ``MetricSpec.otel``: the OpenTelemetry metric(s) it maps to (:class:`OtelMetric`), where a semantic
  convention or a better name applies; without one the OTel sink derives a name mechanically;
- ``MetricSpec.azure``: the Log Analytics columns it fills (:class:`MetricColumns`, :class:`InfoColumns`);
  without one the Azure Monitor sink sends it as generic rows (``GpuMonMetrics_CL``: Name, Labels, Value).

The built-in collectors' hints are registered here by metric name (:data:`OTEL`, :data:`AZURE`) until
each moves beside its declaration (docs/architecture.md, "One metric catalogue"); :func:`otel_hints` and
:func:`azure_hints` read the spec's own hint first and this registry second, so both forms work and the
sinks never keep tables of their own. Pure data: nothing here imports a sink or an SDK.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpumon.model import MetricSpec
from gpumon.sources.ib_sysfs import MLX5_QUEUE_COUNTERS, MLX5_ROCE_COUNTERS


# ------------------------------------------------------------------------------------ OpenTelemetry
class Kind(str, enum.Enum):
    """The OpenTelemetry instrument a metric is exported as."""

    GAUGE = "gauge"
    """Gauge data points."""
    COUNTER = "counter"
    """Cumulative, monotonic Sum."""
    UPDOWN = "updowncounter"
    """Cumulative, non-monotonic Sum (hw.gpu.memory.usage, hw.network.up ...)."""
    STATUS = "status"
    """A 0/1 health gauge exported as ``hw.status`` (non-monotonic Sum): one point per ``hw.state``."""
    STATUS_INVERTED = "status_inverted"
    """As STATUS, from a gauge that is 1 when the component failed (``gpumon_gpu_lost``)."""


class Domain(str, enum.Enum):
    """Which hardware component a series describes, so the right hw.* attributes are attached."""

    NONE = ""
    GPU = "gpu"
    GPU_TEMPERATURE = "gpu_temperature"
    """A GPU's temperature sensor (hw.type=temperature, hw.parent=the GPU)."""
    GPU_FAN = "gpu_fan"
    """A GPU's fan (hw.type=fan, hw.parent=the GPU)."""
    NETWORK = "network"
    PROCESS = "process"
    """The gpumon process itself (process.pid on the point)."""


@dataclass(frozen=True)
class OtelMetric:
    """The OpenTelemetry side of one Prometheus metric (or of the samples of it that ``select`` picks)."""

    name: str
    unit: str
    kind: Kind
    domain: Domain = Domain.NONE
    attributes: tuple[tuple[str, str], ...] = ()
    """Fixed attributes added to every point (``network.io.direction=receive``)."""
    label_map: tuple[tuple[str, str], ...] = ()
    """Prometheus label -> attribute name, for labels that have a convention (``xid`` -> ``error.type``)."""
    description: str = ""
    """Used instead of the spec's help where several Prometheus metrics share one OpenTelemetry name."""
    semconv: bool = False
    select: tuple[tuple[str, str], ...] = ()
    """Only samples with all these label values go to this metric; the labels are dropped (the name
    says them): ``engine=memory`` -> ``hw.gpu.memory.utilization``."""
    exclude: tuple[tuple[str, str], ...] = ()
    """Samples with any of these label values do not go to this metric (another route takes them)."""
    cpu_modes: bool = False
    """The Prometheus value sums user and system time; the sink sends one point per ``cpu.mode``."""

    def takes(self, labels: Mapping[str, str]) -> bool:
        """Whether a sample with these labels is exported under this metric."""
        if any(labels.get(k) != v for k, v in self.select):
            return False
        return not any(labels.get(k) == v for k, v in self.exclude)



_RX = (("network.io.direction", "receive"),)
_TX = (("network.io.direction", "transmit"),)
_ERRORS_DESC = "Errors encountered by the hardware component."
_STATUS_DESC = "Operational status of the component, one point per hw.state."

# The explicit part of the mapping: each Prometheus metric -> one or more OpenTelemetry metrics. Several
# Prometheus metrics may share an OpenTelemetry name as long as their attributes tell their points apart
# (received/transmitted -> one hw.network.io); one Prometheus metric may feed several names, each taking
# the samples its ``select`` / ``exclude`` picks (engine=memory -> hw.gpu.memory.utilization).
OTEL: dict[str, tuple[OtelMetric, ...]] = {
    # GPU: hw.gpu.* and the common hw.* metrics with hw.type=gpu
    "gpumon_gpu_utilization_ratio": (
        OtelMetric("hw.gpu.utilization", "1", Kind.GAUGE, Domain.GPU, label_map=(("engine", "hw.gpu.task"),),
                   description="Fraction of time the GPU's engines were busy (hw.gpu.task: general, encoder, "
                               "decoder).", semconv=True, exclude=(("engine", "memory"),)),
        OtelMetric("hw.gpu.memory.utilization", "1", Kind.GAUGE, Domain.GPU, semconv=True,
                   description="Fraction of time the GPU's memory controller was busy.",
                   select=(("engine", "memory"),)),
    ),
    "gpumon_gpu_memory_used_bytes": (OtelMetric("hw.gpu.memory.usage", "By", Kind.UPDOWN, Domain.GPU, semconv=True),),
    "gpumon_gpu_memory_total_bytes": (
        OtelMetric("hw.gpu.memory.limit", "By", Kind.UPDOWN, Domain.GPU, semconv=True),),
    "gpumon_gpu_pcie_bytes_total": (OtelMetric(
        "hw.gpu.io", "By", Kind.COUNTER, Domain.GPU, label_map=(("direction", "network.io.direction"),),
        semconv=True),),
    "gpumon_gpu_power_watts": (OtelMetric("hw.power", "W", Kind.GAUGE, Domain.GPU, semconv=True),),
    "gpumon_gpu_energy_joules_total": (OtelMetric("hw.energy", "J", Kind.COUNTER, Domain.GPU, semconv=True),),
    "gpumon_gpu_temperature_celsius": (OtelMetric(
        "hw.temperature", "Cel", Kind.GAUGE, Domain.GPU_TEMPERATURE,
        label_map=(("sensor", "hw.sensor_location"),), semconv=True),),
    "gpumon_gpu_temperature_threshold_celsius": (OtelMetric(
        "hw.temperature.limit", "Cel", Kind.GAUGE, Domain.GPU_TEMPERATURE,
        label_map=(("threshold", "hw.limit_type"),), semconv=True,
        description="Temperature limit of the GPU's or its memory's sensor, by hw.limit_type."),),
    "gpumon_gpu_fan_speed_ratio": (OtelMetric("hw.fan.speed_ratio", "1", Kind.GAUGE, Domain.GPU_FAN, semconv=True),),
    "gpumon_gpu_xid_errors_total": (OtelMetric(
        "hw.errors", "{error}", Kind.COUNTER, Domain.GPU, label_map=(("xid", "error.type"),),
        description=_ERRORS_DESC, semconv=True),),
    # ECC: the volatile counter is hw.errors (see docs/metrics.md for why); the lifetime one has its own name
    "gpumon_gpu_ecc_errors_total": (
        OtelMetric("hw.errors", "{error}", Kind.COUNTER, Domain.GPU, label_map=(("type", "error.type"),),
                   description=_ERRORS_DESC, semconv=True, select=(("counter", "volatile"),)),
        OtelMetric("gpumon.gpu.ecc.errors.lifetime", "{error}", Kind.COUNTER, Domain.GPU,
                   label_map=(("type", "error.type"),), select=(("counter", "aggregate"),),
                   description="ECC errors over the GPU's lifetime (NVML's aggregate counter, kept in the "
                               "InfoROM across driver reloads and reboots), error.type corrected/uncorrected."),
    ),
    "gpumon_gpu_pcie_replay_total": (OtelMetric(
        "hw.errors", "{error}", Kind.COUNTER, Domain.GPU, (("error.type", "pcie_replay"),),
        description=_ERRORS_DESC, semconv=True),),
    "gpumon_gpu_lost": (OtelMetric("hw.status", "1", Kind.STATUS_INVERTED, Domain.GPU, semconv=True,
                                   description=_STATUS_DESC),),
    # InfiniBand ports: hw.network.* and the common hw.* metrics with hw.type=network
    "gpumon_ib_port_data_received_bytes_total": (OtelMetric(
        "hw.network.io", "By", Kind.COUNTER, Domain.NETWORK, _RX,
        description="Bytes received and transmitted by the port.", semconv=True),),
    "gpumon_ib_port_data_transmitted_bytes_total": (OtelMetric(
        "hw.network.io", "By", Kind.COUNTER, Domain.NETWORK, _TX,
        description="Bytes received and transmitted by the port.", semconv=True),),
    "gpumon_ib_port_packets_received_total": (OtelMetric(
        "hw.network.packets", "{packet}", Kind.COUNTER, Domain.NETWORK, _RX,
        description="Packets received and transmitted by the port.", semconv=True),),
    "gpumon_ib_port_packets_transmitted_total": (OtelMetric(
        "hw.network.packets", "{packet}", Kind.COUNTER, Domain.NETWORK, _TX,
        description="Packets received and transmitted by the port.", semconv=True),),
    "gpumon_ib_port_up": (
        OtelMetric("hw.network.up", "1", Kind.UPDOWN, Domain.NETWORK, semconv=True),
        OtelMetric("hw.status", "1", Kind.STATUS, Domain.NETWORK, semconv=True, description=_STATUS_DESC),
    ),
    "gpumon_ib_port_rate_bytes_per_second": (OtelMetric(
        "hw.network.bandwidth.limit", "By/s", Kind.UPDOWN, Domain.NETWORK, semconv=True),),
    # The process_* self-metrics, in the process.* semantic conventions
    "process_cpu_seconds_total": (OtelMetric("process.cpu.time", "s", Kind.COUNTER, Domain.PROCESS, semconv=True,
                                             cpu_modes=True, description="CPU time of the gpumon process."),),
    "process_resident_memory_bytes": (
        OtelMetric("process.memory.usage", "By", Kind.UPDOWN, Domain.PROCESS, semconv=True),),
    "process_virtual_memory_bytes": (
        OtelMetric("process.memory.virtual", "By", Kind.UPDOWN, Domain.PROCESS, semconv=True),),
    "process_open_fds": (OtelMetric(
        "process.unix.file_descriptor.count", "{file_descriptor}", Kind.UPDOWN, Domain.PROCESS, semconv=True),),
}

# The IB PMA error counters: hw.errors with hw.type=network, told apart by error.type (and direction).
for _stem, _etype, _direction in (
    ("symbol_errors", "symbol", ""),
    ("receive_errors", "receive", "receive"),
    ("receive_remote_physical_errors", "remote_physical", "receive"),
    ("receive_switch_relay_errors", "switch_relay", "receive"),
    ("receive_constraint_errors", "constraint", "receive"),
    ("transmit_constraint_errors", "constraint", "transmit"),
    ("local_link_integrity_errors", "local_link_integrity", ""),
    ("excessive_buffer_overrun_errors", "excessive_buffer_overrun", ""),
):
    OTEL[f"gpumon_ib_port_{_stem}_total"] = (OtelMetric(
        "hw.errors", "{error}", Kind.COUNTER, Domain.NETWORK,
        (("error.type", _etype),) + ((("network.io.direction", _direction),) if _direction else ()),
        description=_ERRORS_DESC, semconv=True),)

# ------------------------------------------------------------------------------------ Azure Monitor
GPU, IB, EVENTS, METRICS = "gpu", "ib", "events", "metrics"
"""The Azure Monitor sink's tables: one row per GPU, per IB port, per event, and generic metric rows."""

_SUFFIX = {"min": "Min", "avg": "Avg", "max": "Max", "increase": "Increase", "rate": "PerSecond"}
_MINMAX = ("min", "avg", "max")
_COUNTER = ("increase", "last")
_RATE = ("increase", "rate", "last")
_LAST = ("last",)
_FLAG = ("flag",)


@dataclass(frozen=True)
class MetricColumns:
    """How one metric becomes columns of one table."""

    metric: str
    table: str
    column: str
    aggs: tuple[str, ...]
    split: tuple[tuple[str, str], ...] = ()
    """(label value, column infix) pairs; with ``split_label`` set, one column group per value."""
    split_label: str = ""
    static: bool = False
    """Changes rarely (limits, sizes, maxima): sent when it changes and at least every ``static_every``."""
    where: tuple[tuple[str, str], ...] = ()
    """Only samples with these label values count (e.g. ECC's volatile counter, not the lifetime one)."""

    def column_names(self) -> list[tuple[str, str]]:
        """(column name, Log Analytics type) pairs this metric contributes."""
        bases = [self.column + infix for _, infix in self.split] if self.split else [self.column]
        out = []
        for base in bases:
            for agg in self.aggs:
                out.append((self._name(base, agg), "boolean" if agg == "flag" else "real"))
        return out

    def _name(self, base: str, agg: str) -> str:
        if agg == "flag":
            return base
        if agg == "last":
            if len(self.aggs) == 1:
                return base
            return base + "Total"
        return base + _SUFFIX[agg]


@dataclass(frozen=True)
class InfoColumns:
    """An ``_info`` metric whose labels become string columns of the row it describes."""

    metric: str
    table: str
    labels: tuple[tuple[str, str], ...]




HW_COUNTERS = MLX5_QUEUE_COUNTERS + MLX5_ROCE_COUNTERS
"""The mlx5 hw_counters given columns; others the firmware offers are left to the other sinks."""

EXCLUDED: dict[str, str] = {
    "gpumon_ib_port_pma_other_total": "counters/ files gpumon does not know by name: no fixed column",
    "gpumon_gpu_nvlink_link_up": "per-link (opt-in); the row has NvlinkLinksActiveMin",
    "gpumon_gpu_nvlink_link_errors_total": "per-link (opt-in); the row has the per-type totals",
    "gpumon_gpu_nvlink_link_bytes_total": "per-link (opt-in); the row has the totals",
    "gpumon_gpu_process_memory_bytes": "per process id: unbounded, no fixed column",
    "gpumon_gpu_mig_memory_total_bytes": "per MIG instance: no fixed column",
    "gpumon_gpu_mig_memory_used_bytes": "per MIG instance: no fixed column",
    "gpumon_gpu_mig_activity_ratio": "per MIG instance: no fixed column",
}
"""Metrics deliberately without columns, and why (the coverage test reads this)."""


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def _g(metric: str, column: str, aggs: tuple[str, ...] = _MINMAX, **kw: Any) -> MetricColumns:
    return MetricColumns(metric, GPU, column, aggs, **kw)


def _i(metric: str, column: str, aggs: tuple[str, ...] = _COUNTER, **kw: Any) -> MetricColumns:
    return MetricColumns(metric, IB, column, aggs, **kw)


def _each(prefix: str, values: tuple[str, ...], suffix: str = "") -> tuple[tuple[str, str], ...]:
    return tuple((v, prefix + _camel(v) + suffix) for v in values)


_REASONS = ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
            "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting")
_VIOLATIONS = ("sw_power_cap", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability",
               "total_app_clocks", "total_base_clocks", "sw_thermal_slowdown", "hw_thermal_slowdown",
               "hw_power_brake_slowdown")
_ACTIVITIES = ("graphics", "sm", "sm_occupancy", "tensor", "dram_bandwidth", "fp64", "fp32", "fp16")
_DIRECTIONS = (("tx", "Transmit"), ("rx", "Receive"))

METRIC_COLUMNS: tuple[MetricColumns, ...] = (
    # GPU: health
    _g("gpumon_gpu_lost", "Lost", _FLAG),
    _g("gpumon_gpu_recovery_action", "RecoveryAction", _LAST),
    _g("gpumon_gpu_performance_state", "PerformanceState", ("min", "max")),
    # GPU: utilisation and memory
    _g("gpumon_gpu_utilization_ratio", "", split_label="engine", split=(
        ("gpu", "Utilization"), ("memory", "MemoryUtilization"))),
    _g("gpumon_gpu_utilization_ratio", "", ("max",), split_label="engine", split=(
        ("encoder", "EncoderUtilization"), ("decoder", "DecoderUtilization"))),
    _g("gpumon_gpu_activity_ratio", "", ("avg",), split_label="activity",
       split=_each("", _ACTIVITIES, "Activity")),
    _g("gpumon_gpu_memory_total_bytes", "MemoryTotalBytes", _LAST, static=True),
    _g("gpumon_gpu_memory_used_bytes", "MemoryUsedBytes"),
    _g("gpumon_gpu_memory_free_bytes", "MemoryFreeBytes", ("min",)),
    _g("gpumon_gpu_memory_reserved_bytes", "MemoryReservedBytes", _LAST, static=True),
    _g("gpumon_gpu_bar1_total_bytes", "Bar1TotalBytes", _LAST, static=True),
    _g("gpumon_gpu_bar1_used_bytes", "Bar1UsedBytes", ("max",)),
    _g("gpumon_gpu_compute_processes", "ComputeProcesses", ("max",)),
    _g("gpumon_gpu_compute_processes_memory_bytes", "ComputeProcessesMemoryBytes", ("max",)),
    # GPU: power, energy, thermals, clocks
    _g("gpumon_gpu_power_watts", "PowerWatts"),
    _g("gpumon_gpu_power_limit_watts", "PowerLimitWatts", _LAST, static=True),
    _g("gpumon_gpu_power_min_watts", "PowerSamplesWatts", ("min",)),
    _g("gpumon_gpu_power_max_watts", "PowerSamplesWatts", ("max",)),
    _g("gpumon_gpu_power_mean_watts", "PowerSamplesWatts", ("avg",)),
    _g("gpumon_gpu_energy_joules_total", "EnergyJoules", _COUNTER),
    _g("gpumon_gpu_temperature_celsius", "", split_label="sensor", split=(
        ("gpu", "TemperatureCelsius"), ("memory", "MemoryTemperatureCelsius"))),
    _g("gpumon_gpu_temperature_threshold_celsius", "", _LAST, split_label="threshold", split=(
        ("shutdown", "ShutdownTemperatureCelsius"), ("slowdown", "SlowdownTemperatureCelsius"),
        ("gpu_max", "MaxTemperatureCelsius"), ("memory_max", "MemoryMaxTemperatureCelsius")), static=True),
    _g("gpumon_gpu_fan_speed_ratio", "FanSpeed", ("max",)),
    _g("gpumon_gpu_clock_hertz", "", split_label="clock", split=(("sm", "SmClockHertz"),)),
    _g("gpumon_gpu_clock_hertz", "", ("min",), split_label="clock",
       split=(("memory", "MemoryClockHertz"), ("graphics", "GraphicsClockHertz"))),
    _g("gpumon_gpu_clock_max_hertz", "", _LAST, split_label="clock",
       split=_each("", ("sm", "memory", "graphics"), "ClockMaxHertz"), static=True),
    _g("gpumon_gpu_clock_event_reason_active", "", ("avg",), split_label="reason",
       split=_each("ClockEvent", _REASONS)),
    _g("gpumon_gpu_clock_event_violation_seconds_total", "", ("increase",), split_label="reason",
       split=_each("ClockViolation", _VIOLATIONS)),  # seconds, as the metric
    # GPU: PCIe and NVLink
    _g("gpumon_gpu_pcie_link_generation", "PcieLinkGeneration", ("min",)),
    _g("gpumon_gpu_pcie_link_generation_max", "PcieLinkGenerationMax", _LAST, static=True),
    _g("gpumon_gpu_pcie_link_width", "PcieLinkWidth", ("min",)),
    _g("gpumon_gpu_pcie_link_width_max", "PcieLinkWidthMax", _LAST, static=True),
    _g("gpumon_gpu_pcie_bytes_total", "", ("increase", "rate"), split_label="direction",
       split=tuple((v, f"Pcie{name}Bytes") for v, name in _DIRECTIONS)),
    _g("gpumon_gpu_pcie_replay_total", "PcieReplays", _COUNTER),
    _g("gpumon_gpu_pcie_throughput_bytes_per_second", "", ("avg",), split_label="direction",
       split=tuple((v, f"GpmPcie{name}BytesPerSecond") for v, name in _DIRECTIONS)),
    _g("gpumon_gpu_nvlink_links", "NvlinkLinks", _LAST, static=True),
    _g("gpumon_gpu_nvlink_links_active", "NvlinkLinksActive", ("min",)),
    _g("gpumon_gpu_nvlink_bytes_total", "", ("increase", "rate"), split_label="direction",
       split=tuple((v, f"Nvlink{name}Bytes") for v, name in _DIRECTIONS)),
    _g("gpumon_gpu_nvlink_throughput_bytes_per_second", "", ("avg",), split_label="direction",
       split=tuple((v, f"GpmNvlink{name}BytesPerSecond") for v, name in _DIRECTIONS)),
    _g("gpumon_gpu_nvlink_errors_total", "", ("increase",), split_label="type",
       split=_each("Nvlink", ("crc_flit", "crc_data", "replay", "recovery"), "Errors")),
    _g("gpumon_gpu_fabric_state", "FabricState", ("min",)),
    _g("gpumon_gpu_fabric_status", "FabricStatus", _LAST),
    _g("gpumon_gpu_fabric_health_overall", "FabricHealthSummary", ("max",)),
    _g("gpumon_gpu_fabric_health_condition", "", _FLAG, split_label="condition", split=_each("Fabric", (
        "degraded_bandwidth", "route_recovery", "route_unhealthy", "access_timeout_recovery",
        "incorrect_configuration", "partition_unassigned", "gfm_disconnected"))),
    # GPU: memory errors
    _g("gpumon_gpu_ecc_enabled", "EccEnabled", _FLAG, static=True),
    _g("gpumon_gpu_ecc_errors_total", "", _COUNTER, split_label="type", where=(("counter", "volatile"),),
       split=(("corrected", "EccCorrectedErrors"), ("uncorrected", "EccUncorrectedErrors"))),
    _g("gpumon_gpu_retired_pages", "", _LAST, split_label="cause", split=_each("RetiredPages", ("sbe", "dbe"))),
    _g("gpumon_gpu_retired_pages_pending", "RetiredPagesPending", _FLAG),
    _g("gpumon_gpu_remapped_rows", "", _LAST, split_label="cause",
       split=_each("RemappedRows", ("correctable", "uncorrectable"))),
    _g("gpumon_gpu_remapped_rows_pending", "RemappedRowsPending", _FLAG),
    _g("gpumon_gpu_remapped_rows_failure", "RemappedRowsFailure", _FLAG),
    # InfiniBand: state and speed
    _i("gpumon_ib_port_up", "Up", ("min", "max")),
    _i("gpumon_ib_port_state", "State", _LAST),
    _i("gpumon_ib_port_phys_state", "PhysState", _LAST),
    _i("gpumon_ib_port_rate_bytes_per_second", "RateBytesPerSecond", _LAST),
    # InfiniBand: traffic
    _i("gpumon_ib_port_data_received_bytes_total", "DataReceivedBytes", _RATE),
    _i("gpumon_ib_port_data_transmitted_bytes_total", "DataTransmittedBytes", _RATE),
    _i("gpumon_ib_port_packets_received_total", "PacketsReceived", _RATE),
    _i("gpumon_ib_port_packets_transmitted_total", "PacketsTransmitted", _RATE),
    _i("gpumon_ib_port_unicast_packets_received_total", "UnicastPacketsReceived", ("increase",)),
    _i("gpumon_ib_port_unicast_packets_transmitted_total", "UnicastPacketsTransmitted", ("increase",)),
    _i("gpumon_ib_port_multicast_packets_received_total", "MulticastPacketsReceived", ("increase",)),
    _i("gpumon_ib_port_multicast_packets_transmitted_total", "MulticastPacketsTransmitted", ("increase",)),
    _i("gpumon_ib_port_transmit_wait_ticks_total", "TransmitWaitTicks", ("increase", "rate")),
    # InfiniBand: PMA error counters
    _i("gpumon_ib_port_symbol_errors_total", "SymbolErrors", ("increase",)),
    _i("gpumon_ib_port_link_error_recoveries_total", "LinkErrorRecoveries", ("increase",)),
    _i("gpumon_ib_port_link_downed_total", "LinkDowned", _COUNTER),
    _i("gpumon_ib_port_receive_errors_total", "ReceiveErrors", ("increase",)),
    _i("gpumon_ib_port_receive_remote_physical_errors_total", "ReceiveRemotePhysicalErrors", ("increase",)),
    _i("gpumon_ib_port_receive_switch_relay_errors_total", "ReceiveSwitchRelayErrors", ("increase",)),
    _i("gpumon_ib_port_transmit_discards_total", "TransmitDiscards", ("increase",)),
    _i("gpumon_ib_port_transmit_constraint_errors_total", "TransmitConstraintErrors", ("increase",)),
    _i("gpumon_ib_port_receive_constraint_errors_total", "ReceiveConstraintErrors", ("increase",)),
    _i("gpumon_ib_port_local_link_integrity_errors_total", "LocalLinkIntegrityErrors", ("increase",)),
    _i("gpumon_ib_port_excessive_buffer_overrun_errors_total", "ExcessiveBufferOverrunErrors",
       ("increase",)),
    _i("gpumon_ib_port_vl15_dropped_total", "Vl15Dropped", ("increase",)),
    _i("gpumon_ib_port_saturated", "CountersSaturated", _LAST),
    # InfiniBand: mlx5 hw_counters, one column per counter, named by the counter file
    _i("gpumon_ib_hw_stat_total", "", ("increase",), split_label="counter",
       split=tuple((name, _camel(name)) for name in HW_COUNTERS)),
    # InfiniBand: link flaps
    _i("gpumon_ib_link_flaps_total", "Flaps", _COUNTER),
    _i("gpumon_ib_link_flap_signals_total", "FlapSignals", ("increase",), split_label="signal",
       split=(("state", "State"), ("link_downed", "LinkDowned"), ("carrier_changes", "CarrierChanges"))),
    _i("gpumon_ib_port_flaps_in_window", "FlapsInWindow", _LAST),
    _i("gpumon_ib_port_flapping", "Flapping", _FLAG),
    _i("gpumon_ib_last_flap_timestamp_seconds", "LastFlapTimestampSeconds", _LAST),
    _i("gpumon_ib_port_down_seconds", "DownSeconds", ("max",)),
    _i("gpumon_ib_port_last_down_duration_seconds", "LastDownDurationSeconds", _LAST),
)

INFO_COLUMNS: tuple[InfoColumns, ...] = (
    InfoColumns("gpumon_gpu_info", GPU, (
        ("model", "Model"), ("pci_bus_id", "PciBusId"), ("serial", "Serial"), ("vbios", "VbiosVersion"),
        ("driver_version", "DriverVersion"), ("cuda_version", "CudaVersion"), ("mig_mode", "MigMode"))),
    InfoColumns("gpumon_gpu_fabric_info", GPU, (("cluster_uuid", "FabricClusterUuid"), ("clique_id", "FabricCliqueId"))),
    InfoColumns("gpumon_ib_port_info", IB, (
        ("link_layer", "LinkLayer"), ("fw_version", "FirmwareVersion"), ("board_id", "BoardId"),
        ("hca_type", "HcaType"), ("node_guid", "NodeGuid"), ("netdev", "Netdev"))),
)

AzureHint = MetricColumns | InfoColumns
"""An Azure hint: columns of a GPU or port row (a metric) or string columns from an ``_info`` metric."""

def otel_hints(spec: MetricSpec) -> tuple[OtelMetric, ...]:
    """The OpenTelemetry metrics ``spec`` names beside its declaration, else the registry's; () when
    neither (the sink derives a name mechanically)."""
    if spec.otel:
        return tuple(spec.otel)
    return OTEL.get(spec.name, ())


def azure_hints(spec: MetricSpec) -> tuple[AzureHint, ...]:
    """The Azure columns of ``spec``: its own hints (for gpumon's own names only: a plugin's metric
    cannot add columns to the deployed tables), else the registry's; () when it has none (generic rows)."""
    if spec.azure and owns_columns(spec.name):
        return tuple(h if h.metric else replace(h, metric=spec.name) for h in spec.azure)
    return AZURE_BY_METRIC.get(spec.name, ())


def owns_columns(name: str) -> bool:
    """Whether a metric may have columns of its own: the DCR template is generated from gpumon's
    declarations, so only gpumon's names (``gpumon_``, ``process_``) can have deployed columns."""
    return name.startswith(("gpumon_", "process_"))


AZURE: tuple[AzureHint, ...] = METRIC_COLUMNS + INFO_COLUMNS
AZURE_BY_METRIC: dict[str, tuple[AzureHint, ...]] = {}
for _hint in AZURE:
    AZURE_BY_METRIC[_hint.metric] = AZURE_BY_METRIC.get(_hint.metric, ()) + (_hint,)


def registered() -> Mapping[str, Mapping[str, Any]]:
    """Every name the registry holds a hint for, with its hints: ``{"otel": ..., "azure": ...}``."""
    names = sorted(set(OTEL) | set(AZURE_BY_METRIC) | set(EXCLUDED))
    return {n: {"otel": OTEL.get(n, ()), "azure": AZURE_BY_METRIC.get(n, ()), "excluded": EXCLUDED.get(n)}
            for n in names}

"""Snapshots -> Log Analytics rows: the column table, the interval aggregation, the event rows.

The three custom tables have a *fixed* set of columns (a DCR stream declaration cannot grow at run
time), so every metric the Azure tables carry is listed in :data:`METRIC_COLUMNS`, keyed by metric
name. ``deploy/azure/generate.py`` builds the template's ``streamDeclarations`` from
:func:`stream_columns`, and a test checks that the committed template equals the generated one: the
code and the deployed schema cannot drift apart. A metric that is not in the table is not sent (it
is still exported by the other sinks); a test lists the collectors' metrics that are missing.

Aggregations per metric (a column suffix each):
- ``min``/``avg``/``max`` (``...Min``, ``...Avg``, ``...Max``): over the interval's samples;
- ``last`` (the bare name for a gauge, ``...Total`` for a counter): the last value seen;
- ``increase`` (``...Increase``): a counter's growth over the interval; a decrease is a reset (driver
  reload, ``perfquery -R``) and the new value counts from zero;
- ``rate`` (``...PerSecond``): ``increase`` over the seconds it was measured across;
- ``flag`` (a boolean, bare name): last value non-zero.
A metric with labels beyond the row's identity (an NVLink ``link``, an ECC ``type``) is either split
into one column per listed label value (``split``) or, without ``split``, summed over them.

Who held a GPU (``Namespace``, ``Pod``, ``Container``, ``JobId``) comes from the snapshots'
``gpumon_gpu_allocation_info``: every holder seen during the interval, comma-joined in the same order
in all four columns. The copies ``[attribution] labels = true`` makes of a per-GPU series are one
series here, never summed twice.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumon import attribution_labels
from gpumon.imds import AzureInstance
from gpumon.model import Event, MetricFamily, MetricType, Snapshot
from gpumon.sources.ib_sysfs import MLX5_QUEUE_COUNTERS, MLX5_ROCE_COUNTERS

log = logging.getLogger("gpumon.sinks.azure_monitor")

GPU, IB, EVENTS = "gpu", "ib", "events"
TABLES = {GPU: "GpuMonGpu_CL", IB: "GpuMonInfiniBand_CL", EVENTS: "GpuMonEvents_CL"}
DEFAULT_STREAMS = {key: f"Custom-{table}" for key, table in TABLES.items()}

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

IDENTITY = {GPU: (("gpu", "Gpu", "int"), ("uuid", "Uuid", "string")),
            IB: (("device", "Device", "string"), ("port", "Port", "int"))}
"""Per table: (label, column, type) that make a series belong to one row."""

HOST_COLUMNS: tuple[tuple[str, str], ...] = (
    ("vm_id", "VmId"), ("vm_size", "VmSize"), ("region", "Region"), ("zone", "Zone"), ("vmss", "Vmss"),
    ("placement_group", "PlacementGroup"), ("fault_domain", "FaultDomain"), ("physical_host", "PhysicalHost"))
"""The Azure VM and its placement (``gpumon_host_info``'s label -> column), on the rows of all three
tables: IMDS vmId, vmSize, location, zone, vmScaleSetName, placementGroupId, platformFaultDomain, and
the KVP pool's PhysicalHostName; left out where unknown."""
COMMON_COLUMNS: tuple[tuple[str, str], ...] = (
    ("TimeGenerated", "datetime"),
    ("Computer", "string"),
    ("RowId", "string"),
    *((column, "string") for _, column in HOST_COLUMNS),
)
INTERVAL_COLUMNS: tuple[tuple[str, str], ...] = (("IntervalSeconds", "real"), ("Samples", "int"))
HOLDER_COLUMNS: tuple[tuple[str, str], ...] = (
    ("namespace", "Namespace"), ("pod", "Pod"), ("container", "Container"), ("job_id", "JobId"))
"""Attribution label -> column, on GPU rows and GPU event rows (comma-joined when several hold it)."""
EVENT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("Kind", "string"), ("Severity", "string"), ("Message", "string"), ("Subject", "dynamic"),
    ("Attributes", "dynamic"), ("Gpu", "int"), ("Uuid", "string"), ("Device", "string"), ("Port", "int"),
    ("Collector", "string"), *((column, "string") for _, column in HOLDER_COLUMNS),
)

BY_METRIC: dict[str, tuple[MetricColumns, ...]] = {}
for _mapping in METRIC_COLUMNS:
    BY_METRIC[_mapping.metric] = BY_METRIC.get(_mapping.metric, ()) + (_mapping,)
INFO_BY_METRIC: dict[str, InfoColumns] = {i.metric: i for i in INFO_COLUMNS}


def stream_columns() -> dict[str, list[tuple[str, str]]]:
    """Table key -> ordered (column, type) list: the one source for the streamDeclarations."""
    out: dict[str, list[tuple[str, str]]] = {}
    for table in (GPU, IB):
        cols = list(COMMON_COLUMNS) + list(INTERVAL_COLUMNS)
        cols += [(col, typ) for _, col, typ in IDENTITY[table]]
        if table == GPU:
            cols += [(col, "string") for _, col in HOLDER_COLUMNS]
        seen = {c for c, _ in cols}
        for info in INFO_COLUMNS:
            if info.table == table:
                for _, col in info.labels:
                    if col not in seen:
                        cols.append((col, "string"))
                        seen.add(col)
        for mapping in METRIC_COLUMNS:
            if mapping.table == table:
                for col, typ in mapping.column_names():
                    if col in seen:
                        raise ValueError(f"column {col} of {TABLES[table]} defined twice")
                    cols.append((col, typ))
                    seen.add(col)
        out[table] = cols
    out[EVENTS] = list(COMMON_COLUMNS) + list(EVENT_COLUMNS)
    return out


# -- values ---------------------------------------------------------------------------------------


def iso_time(ts: float) -> str:
    """UTC ISO 8601 with milliseconds, the form Log Analytics parses for a datetime column."""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _num(value: float, derived: bool = False, digits: int = 6) -> float | int | None:
    """Compact JSON numbers: integral values as ints, derived ones to ``digits`` significant digits.

    Gauge statistics and rates keep 6 digits (telemetry, not accounting); increases 9; a counter's
    last value is exact."""
    if value is None:
        return None
    value = float(value)  # samples built by hand may carry ints; bools become 0/1
    if not math.isfinite(value):
        return None
    if derived:
        value = float(f"{value:.{digits}g}")
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


@dataclass
class _Series:
    """One series' interval statistics; the counter baseline survives from interval to interval."""

    n: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    total: float = 0.0
    last: float = math.nan
    increase: float = 0.0
    base_time: float | None = None
    last_time: float = 0.0

    def add(self, value: float, counter: bool, when: float) -> None:
        if counter:
            if self.base_time is None:
                self.base_time = when
            elif value >= self.last:
                self.increase += value - self.last
            else:  # a reset: the counter restarted from zero
                self.increase += value
        self.n += 1
        self.lo = min(self.lo, value)
        self.hi = max(self.hi, value)
        self.total += value
        self.last = value
        self.last_time = when

    def restart(self) -> None:
        """Start the next interval: keep the last value and time as the counter baseline."""
        self.n, self.lo, self.hi, self.total, self.increase = 0, math.inf, -math.inf, 0.0, 0.0
        if self.base_time is not None:
            self.base_time = self.last_time


@dataclass
class _Row:
    identity: tuple[str, ...]
    info: dict[str, str] = field(default_factory=dict)
    static_sent: dict[str, Any] = field(default_factory=dict)
    static_time: float | None = None
    series: dict[tuple[MetricColumns, str, tuple], _Series] = field(default_factory=dict)


class RowBuilder:
    """Folds snapshots into per-GPU and per-port interval rows, and turns events into rows.

    Not thread-safe: the sink calls it from the loop's thread only.
    """

    def __init__(self, computer: str, omit_zero_increases: bool = True, static_every: float = 3600.0) -> None:
        self.computer = computer
        self.static_every = static_every
        """Seconds between rows that repeat unchanged static columns (info labels, limits, sizes);
        0 puts them on every row. A change is always sent at once."""
        self.omit_zero_increases = omit_zero_increases
        """Leave out ``...Increase`` columns that are 0: most error counters never move, and KQL's
        sum() reads a missing value as nothing added (use coalesce(x, 0) to show zeros)."""
        self.vm: dict[str, str] = {}
        """The host's facts by ``HOST_COLUMNS`` key (:func:`host_values`); the sink's IMDS thread swaps
        the whole dict."""
        self._rows: dict[str, dict[tuple[str, ...], _Row]] = {GPU: {}, IB: {}}
        self._seen: dict[str, MetricFamily] = {}
        self._snapshots = 0
        self._unmapped: set[str] = set()
        self._allocation: MetricFamily | None = None
        self._holders: dict[str, dict[attribution_labels.Holding, None]] = {}
        """Per GPU index: who held it during the interval, in the order first seen."""
        self.build_errors = 0

    @property
    def unmapped(self) -> set[str]:
        """Metric names seen that have no columns (the other sinks still export them)."""
        return set(self._unmapped)

    def add(self, snapshot: Snapshot, when: float) -> None:
        """Fold one snapshot in; ``when`` is a monotonic time for rates."""
        self._snapshots += 1
        self._allocation = snapshot.family(attribution_labels.ALLOCATION_FAMILY)
        self._add_holders(self._allocation)
        for fam in snapshot.families:
            # The loop hands the same family object again while a collector has not run anew;
            # counting it twice would weigh that collector's samples in min/avg/max.
            if self._seen.get(fam.name) is fam:
                continue
            self._seen[fam.name] = fam
            mappings = BY_METRIC.get(fam.name)
            if mappings is not None:
                for mapping in mappings:
                    self._add_metric(mapping, fam, when)
                continue
            info = INFO_BY_METRIC.get(fam.name)
            if info is not None:
                self._add_info(info, fam)
                continue
            if fam.name != attribution_labels.ALLOCATION_FAMILY:
                self._unmapped.add(fam.name)

    def _add_holders(self, allocation: MetricFamily | None) -> None:
        """Remember who holds each GPU now (no allocation family: nobody holds any)."""
        for gpu, held in attribution_labels.holders(allocation).by_gpu.items():
            self._holders.setdefault(gpu, {}).update(dict.fromkeys(held))

    def _row(self, table: str, labels: Mapping[str, str]) -> _Row | None:
        ident = tuple(labels.get(label, "") for label, _, _ in IDENTITY[table])
        if not ident[0]:
            return None
        rows = self._rows[table]
        row = rows.get(ident)
        if row is None:
            row = rows[ident] = _Row(ident)
        return row

    def _add_metric(self, mapping: MetricColumns, fam: MetricFamily, when: float) -> None:
        counter = fam.spec.type is MetricType.COUNTER
        ident_labels = {label for label, _, _ in IDENTITY[mapping.table]} | set(attribution_labels.LABELS)
        done: set[tuple[int, tuple[MetricColumns, str, tuple]]] = set()
        for sample in fam.samples:
            labels = dict(sample.labels)
            if mapping.where and any(labels.get(k) != v for k, v in mapping.where):
                continue
            row = self._row(mapping.table, labels)
            if row is None:
                continue
            if mapping.split:
                infix = dict(mapping.split).get(labels.get(mapping.split_label, ""))
                if infix is None:
                    continue
                base = mapping.column + infix
                skip = ident_labels | {mapping.split_label} | {k for k, _ in mapping.where}
                extra = tuple(sorted((k, v) for k, v in labels.items() if k not in skip))
            else:
                base = mapping.column
                extra = tuple(sorted((k, v) for k, v in labels.items() if k not in ident_labels))
            key = (mapping, base, extra)
            if (id(row), key) in done:
                continue  # another holder's copy of a series already counted (attribution labels)
            done.add((id(row), key))
            series = row.series.get(key)
            if series is None:
                series = row.series[key] = _Series()
            series.add(sample.value, counter, when)

    def _add_info(self, info: InfoColumns, fam: MetricFamily) -> None:
        names = dict(info.labels)
        for sample in fam.samples:
            labels = dict(sample.labels)
            row = self._row(info.table, labels)
            if row is None:
                continue
            for label, value in labels.items():
                column = names.get(label)
                if column is not None and value:
                    row.info[column] = value

    def close_interval(self, wall_time: float, seconds: float) -> dict[str, list[dict[str, Any]]]:
        """The rows of the interval that ends now; statistics restart, counter baselines stay."""
        out: dict[str, list[dict[str, Any]]] = {GPU: [], IB: []}
        for table in (GPU, IB):
            for row in list(self._rows[table].values()):
                try:
                    built = self._build(table, row, wall_time, seconds)
                except (TypeError, ValueError, OverflowError) as exc:  # one odd series costs one row
                    self.build_errors += 1
                    if self.build_errors == 1:
                        log.error("azure_monitor: cannot build a %s row for %s: %s", TABLES[table],
                                  "/".join(row.identity), exc)
                    built = None
                if built is not None:
                    out[table].append(built)
                for series in row.series.values():
                    series.restart()
        self._snapshots = 0
        self._holders = {}
        self._add_holders(self._allocation)
        return out

    def _common(self, wall_time: float) -> dict[str, Any]:
        row: dict[str, Any] = {"TimeGenerated": iso_time(wall_time), "Computer": self.computer,
                               "RowId": str(uuid.uuid4())}
        vm = self.vm
        for key, column in HOST_COLUMNS:
            if vm.get(key):
                row[column] = vm[key]
        return row

    def _build(self, table: str, row: _Row, wall_time: float, seconds: float) -> dict[str, Any] | None:
        if not any(s.n for s in row.series.values()):
            return None  # nothing seen for this GPU/port in the interval (gone, or collector down)
        out = self._common(wall_time)
        out["IntervalSeconds"] = _num(seconds, derived=True)
        out["Samples"] = max(s.n for s in row.series.values())
        for (_label, column, typ), value in zip(IDENTITY[table], row.identity):
            out[column] = _int_or_none(value) if typ == "int" else value
        if table == GPU:
            out.update(_holder_columns(attribution_labels.joined(self._holders.get(row.identity[0], {}))))
        static: dict[str, Any] = dict(row.info)
        groups: dict[tuple[MetricColumns, str], list[_Series]] = {}
        for (mapping, base, _extra), series in row.series.items():
            if series.n:
                groups.setdefault((mapping, base), []).append(series)
        for (mapping, base), members in groups.items():
            for agg in mapping.aggs:
                value = _aggregate(agg, members)
                if value is None or (agg == "increase" and value == 0 and self.omit_zero_increases):
                    continue
                (static if mapping.static else out)[mapping._name(base, agg)] = value
        due = row.static_time is None or wall_time - row.static_time >= self.static_every
        if due or static != row.static_sent:
            row.static_sent, row.static_time = static, wall_time
            out.update(static)
        return out

    def event_row(self, event: Event) -> dict[str, Any]:
        row = self._common(event.time)
        subject = {str(k): str(v) for k, v in event.subject.items()}
        row.update({
            "Kind": event.kind,
            "Severity": event.severity.value,
            "Message": event.message,
            "Subject": subject,
            "Attributes": _jsonable(event.attributes),
        })
        for label, column, typ in (("gpu", "Gpu", "int"), ("uuid", "Uuid", "string"),
                                   ("device", "Device", "string"), ("port", "Port", "int"),
                                   ("collector", "Collector", "string")):
            if label in subject:
                value = _int_or_none(subject[label]) if typ == "int" else subject[label]
                if value is not None:
                    row[column] = value
        row.update(_holder_columns(event.attributes))
        return row


def host_values(instance: AzureInstance | None, physical_host: str = "") -> dict[str, str]:
    """``RowBuilder.vm`` from IMDS's answer (None: none) and the KVP pool's physical host."""
    out = {"physical_host": physical_host}
    if instance is not None:
        out.update(vm_id=instance.vm_id, vm_size=instance.vm_size, region=instance.location,
                   zone=instance.zone, vmss=instance.vmss_name, placement_group=instance.placement_group_id,
                   fault_domain=instance.platform_fault_domain)
    return {k: v for k, v in out.items() if v}


def _holder_columns(values: Mapping[str, Any]) -> dict[str, str]:
    """Namespace, Pod, Container, JobId from attribution labels (``attribution_labels.joined``)."""
    return {column: str(values[label]) for label, column in HOLDER_COLUMNS if values.get(label)}


def _aggregate(agg: str, members: list[_Series]) -> Any:
    if agg == "min":
        return _num(min(s.lo for s in members), derived=True)
    if agg == "max":
        return _num(max(s.hi for s in members), derived=True)
    if agg == "avg":
        return _num(sum(s.total / s.n for s in members) / len(members), derived=True)
    if agg == "last":
        return _num(sum(s.last for s in members))
    if agg == "flag":
        return any(s.last != 0 for s in members)
    if agg == "increase":
        if all(s.base_time is None for s in members):
            return None
        return _num(sum(s.increase for s in members), derived=True, digits=9)
    if agg == "rate":
        total = 0.0
        measured = False
        for s in members:
            if s.base_time is not None and s.last_time > s.base_time:
                total += s.increase / (s.last_time - s.base_time)
                measured = True
        return _num(total, derived=True) if measured else None
    raise ValueError(f"unknown aggregation {agg!r}")  # pragma: no cover - table bug


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)

"""Static knowledge about NVML: what error codes mean for us, XID meanings, clock-event reasons, GPM ids.

Kept apart from the collectors so the docs, the double and the tests read the same tables. Numeric
values are the NVML ABI (they never change), so this module does not import ``pynvml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumon.model import Severity, StateReason

# --- error codes (NVML_ERROR_*) and what the collector does with them -------------------------------

SUCCESS = 0
TIMEOUT = 10
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
ERROR_NAMES: dict[int, str] = {
    1: "uninitialized", 2: "invalid_argument", 3: "not_supported", 4: "no_permission",
    5: "already_initialized", 6: "not_found", 7: "insufficient_size", 8: "insufficient_power",
    9: "driver_not_loaded", 10: "timeout", 11: "irq_issue", 12: "library_not_found",
    13: "function_not_found", 14: "corrupted_inforom", 15: "gpu_is_lost", 16: "reset_required",
    17: "operating_system", 18: "lib_rm_version_mismatch", 19: "in_use", 20: "memory", 21: "no_data",
    22: "vgpu_ecc_not_supported", 23: "insufficient_resources", 24: "freq_not_supported",
    25: "argument_version_mismatch", 26: "deprecated", 27: "not_ready", 28: "gpu_not_found",
    29: "invalid_state", 30: "reset_type_not_supported", 999: "unknown",
}

UNSUPPORTED_CODES = frozenset({3, 4, 13, 26, 25, 2, 6})
"""This metric does not exist on this GPU (or not with this driver/permission/MIG mode): drop it for
the GPU and ask again only at the hourly re-probe."""

LOST_CODES = frozenset({15, 16, 28})
"""The GPU is gone (fell off the bus, needs a reset, vanished): report it lost, keep the others."""

UNAVAILABLE_CODES = frozenset({1, 9, 12, 18})
"""NVML itself is unusable (no library, no driver, version mismatch): the collector is unavailable and
re-initialises with backoff."""

# Everything else (TIMEOUT, INSUFFICIENT_SIZE, UNKNOWN, IRQ_ISSUE, CORRUPTED_INFOROM, ...) is transient:
# the metric is absent for this run, the error is counted, and the next run asks again.


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"code_{code}")


_UNUSABLE_CAUSES = {12: StateReason.LIBRARY_NOT_FOUND, 9: StateReason.DRIVER_NOT_LOADED,
                    4: StateReason.NO_PERMISSION}


def unusable_cause(code: int | None, otherwise: StateReason) -> StateReason:
    """Why NVML is unusable, for ``gpumon_collector_state``: no library, no driver, no permission
    (NVML_ERROR_LIBRARY_NOT_FOUND, _DRIVER_NOT_LOADED, _NO_PERMISSION), else ``otherwise``."""
    return _UNUSABLE_CAUSES.get(code, otherwise) if code is not None else otherwise


def error_kind(code: int) -> str:
    """One of ``unsupported``, ``lost``, ``unavailable``, ``transient``."""
    if code in UNSUPPORTED_CODES:
        return "unsupported"
    if code in LOST_CODES:
        return "lost"
    if code in UNAVAILABLE_CODES:
        return "unavailable"
    return "transient"


# --- XIDs ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Xid:
    meaning: str
    severity: Severity
    action: str = ""


XIDS: dict[int, Xid] = {
    13: Xid("Graphics engine exception (usually an application fault)", Severity.WARNING,
            "check the application; repeated on one GPU: run diagnostics"),
    31: Xid("GPU memory page fault (MMU fault, usually an application bug)", Severity.WARNING,
            "check the application"),
    32: Xid("Invalid or corrupted push buffer stream", Severity.ERROR, "check PCIe health"),
    38: Xid("Driver firmware error", Severity.ERROR, "reset the GPU"),
    43: Xid("GPU stopped processing (channel reset)", Severity.WARNING, "usually an application fault"),
    45: Xid("Preemptive cleanup due to a previous error", Severity.INFO, "follows another XID"),
    48: Xid("Double-bit ECC error", Severity.CRITICAL, "reset the GPU; replace if it recurs"),
    61: Xid("Internal micro-controller breakpoint/warning", Severity.ERROR, "reset the GPU"),
    62: Xid("Internal micro-controller halt", Severity.CRITICAL, "reset the GPU"),
    63: Xid("ECC page retirement or row remapping recording event", Severity.WARNING,
            "reset the GPU to apply the remap when convenient"),
    64: Xid("ECC page retirement or row remapping recording failure", Severity.CRITICAL,
            "reset the GPU; replace if it recurs"),
    68: Xid("Video decoder (NVDEC) exception", Severity.WARNING, "check the application"),
    69: Xid("Graphics engine class error", Severity.WARNING, "check the application"),
    74: Xid("NVLink error", Severity.ERROR, "check NVLink counters; reset the GPU"),
    79: Xid("GPU has fallen off the bus", Severity.CRITICAL, "drain the node; reboot; check the GPU"),
    92: Xid("High single-bit ECC error rate", Severity.WARNING, "watch ECC counters"),
    94: Xid("Contained ECC error", Severity.ERROR, "reset the GPU when the affected job ends"),
    95: Xid("Uncontained ECC error", Severity.CRITICAL, "drain the node and reset the GPU"),
    109: Xid("Context switch timeout", Severity.ERROR, "check the application; reset the GPU"),
    119: Xid("GSP RPC timeout", Severity.CRITICAL, "reset the GPU; update the driver if it recurs"),
    120: Xid("GSP error", Severity.CRITICAL, "reset the GPU"),
    140: Xid("Unrecovered ECC error", Severity.CRITICAL, "drain the node and reset the GPU"),
    154: Xid("GPU recovery action changed", Severity.WARNING, "see the recovery action metric"),
}


def xid_info(xid: int) -> Xid:
    info = XIDS.get(xid)
    if info is None:  # built only when needed: a busy log asks for the known ones again and again
        info = Xid(f"XID {xid} (not in gpumon's table; see NVIDIA's XID catalog)", Severity.ERROR)
    return info


RECOVERY_ACTIONS: dict[int, tuple[str, Severity]] = {
    0: ("none", Severity.INFO),
    1: ("gpu_reset", Severity.ERROR),
    2: ("node_reboot", Severity.CRITICAL),
    3: ("drain_p2p", Severity.WARNING),
    4: ("drain_and_reset", Severity.ERROR),
    5: ("recover_imex_domain", Severity.ERROR),
    6: ("bus_reset", Severity.ERROR),
    7: ("system_reboot", Severity.CRITICAL),
}

# Event type bits (nvmlEventType*); the last two exist from driver R565 on
EVENT_XID = 0x0000000000000008
EVENT_GPU_UNAVAILABLE = 0x0000000000004000
EVENT_GPU_RECOVERY_ACTION = 0x0000000000008000

NO_INSTANCE = 0xFFFFFFFF
"""``gpuInstanceId`` / ``computeInstanceId`` of an event that belongs to no MIG instance (0 is a real
instance)."""

# --- clock-event reasons (nvmlClocksEventReason* bits) ------------------------------------------------

CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

# Reasons that mean "clocks are held back" (not idle, not an admin setting): the terminal table shows them.
THROTTLE_REASONS = frozenset({"sw_power_cap", "hw_slowdown", "sync_boost", "sw_thermal_slowdown",
                              "hw_thermal_slowdown", "hw_power_brake_slowdown"})

# --- GPM (nvmlGpmMetricId) ----------------------------------------------------------------------------

GPM_RATIOS: tuple[tuple[int, str], ...] = (
    (1, "graphics"),        # GRAPHICS_UTIL: time any context was active
    (2, "sm"),              # SM_UTIL: SMs busy
    (3, "sm_occupancy"),    # SM_OCCUPANCY: resident warps vs maximum
    (5, "tensor"),          # ANY_TENSOR_UTIL
    (10, "dram_bandwidth"),  # DRAM_BW_UTIL
    (11, "fp64"),
    (12, "fp32"),
    (13, "fp16"),
)
GPM_PCIE: tuple[tuple[int, str], ...] = ((20, "tx"), (21, "rx"))         # MiB/s
GPM_NVLINK: tuple[tuple[int, str], ...] = ((61, "tx"), (60, "rx"))       # MiB/s
GPM_ALL_IDS: tuple[int, ...] = tuple(i for i, _ in GPM_RATIOS + GPM_PCIE + GPM_NVLINK)
GPM_SLOW_IDS = frozenset({1})
"""GPM metrics the driver computes slowly, asked once every SLOW_FIELD_SECONDS: on an H100 with
driver 580 GRAPHICS_UTIL alone costs 1.5 ms of CPU per nvmlGpmMetricsGet, every other metric about
11 µs (tests/fixtures/nvml/h100_r580.json, ``metrics_get_cpu_us_per_id_alone``)."""

# --- NVLink fabric (nvmlDeviceGetGpuFabricInfo[V]) ----------------------------------------------------
# Values as pynvml 13.x defines them (NVML_GPU_FABRIC_STATE_*, NVML_GPU_FABRIC_HEALTH_MASK_*,
# NVML_GPU_FABRIC_HEALTH_SUMMARY_*), which copies nvml.h's nvmlGpuFabricInfo_v2_t / _v3_t.

FABRIC_STATE_NOT_SUPPORTED = 0
FABRIC_STATE_COMPLETED = 3
FABRIC_STATES: dict[int, str] = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
"""``state``: where the GPU is in its registration with the fabric manager; ``status`` (an nvmlReturn_t)
means something only once the state is COMPLETED."""

FABRIC_SUMMARIES: dict[int, str] = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
"""``healthSummary`` (struct v3 only); 0 is NOT_SUPPORTED."""


@dataclass(frozen=True)
class FabricCondition:
    """One field of ``healthMask``, exported as a series that is 1 while the condition holds.

    ``nvml`` is the NVML_GPU_FABRIC_HEALTH_MASK_<nvml> suffix; the field is ``(mask >> shift) & width``.
    Raw values in ``holds`` make the series 1, in ``clear`` 0; anything else (0 = NOT_SUPPORTED) leaves
    the series out, so a driver or GPU that does not report the field adds nothing."""

    name: str
    nvml: str
    shift: int
    width: int
    holds: frozenset[int]
    clear: frozenset[int]

    def decode(self, mask: int) -> bool | None:
        raw = (mask >> self.shift) & self.width
        if raw in self.holds:
            return True
        if raw in self.clear:
            return False
        return None


# 2-bit fields answer 1 TRUE / 2 FALSE; partition and GFM state answer 1 good / 2 bad; the 4-bit
# incorrect-configuration field answers 1 NONE or 2..8 the reason.
FABRIC_CONDITIONS: tuple[FabricCondition, ...] = (
    FabricCondition("degraded_bandwidth", "DEGRADED_BW", 0, 0x3, frozenset({1}), frozenset({2})),
    FabricCondition("route_recovery", "ROUTE_RECOVERY", 2, 0x3, frozenset({1}), frozenset({2})),
    FabricCondition("route_unhealthy", "ROUTE_UNHEALTHY", 4, 0x3, frozenset({1}), frozenset({2})),
    FabricCondition("access_timeout_recovery", "ACCESS_TIMEOUT_RECOVERY", 6, 0x3, frozenset({1}),
                    frozenset({2})),
    FabricCondition("incorrect_configuration", "INCORRECT_CONFIGURATION", 8, 0xF, frozenset(range(2, 9)),
                    frozenset({1})),
    FabricCondition("partition_unassigned", "PARTITION_ASSIGNED", 12, 0x3, frozenset({2}), frozenset({1})),
    FabricCondition("gfm_disconnected", "GFM_STATE", 14, 0x3, frozenset({2}), frozenset({1})),
)

# --- driver sample buffers (nvmlDeviceGetSamples) -----------------------------------------------------

TOTAL_POWER_SAMPLES = 0
"""NVML_TOTAL_POWER_SAMPLES: the board's power draw, milliwatts, as the value type the call names."""
NOT_FOUND = 6
"""nvmlDeviceGetSamples answers NOT_FOUND when no sample is newer than ``lastSeenTimeStamp``."""

VALUE_MEMBERS: dict[int, str] = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                                 6: "usVal"}
"""nvmlValueType_t -> the c_nvmlValue_t union member holding the value (NVML_VALUE_TYPE_*)."""


def union_value(value: object, value_type: int) -> float:
    """A c_nvmlValue_t read through the member its value type names (unknown types: ullVal)."""
    return float(getattr(value, VALUE_MEMBERS.get(int(value_type), "ullVal")))

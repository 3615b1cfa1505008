"""Static knowledge about NVML: what error codes mean for us, XID meanings, clock-event reasons, GPM ids.

Kept apart from the collectors so the docs, the double and the tests read the same tables. Numeric
values are the NVML ABI (they never change), so this module does not import ``pynvml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumon.model import Severity

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
    return XIDS.get(xid, Xid(f"XID {xid} (not in gpumon's table; see NVIDIA's XID catalog)",
                             Severity.ERROR))


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

"""The health rules: id, severity, action and whether a verdict sticks, as data.

Severities: ``ok`` < ``degraded`` < ``unhealthy``. Actions are one fixed vocabulary, ordered from
least to most disruptive, aligned with NVML's recovery actions (``nvmlDeviceGetGpuRecoveryAction``,
field 230: none, GPU reset, node reboot, drain P2P, drain and reset) and gpud's repair actions
(``REBOOT_SYSTEM``, ``HARDWARE_INSPECTION``, ``CHECK_USER_APP_AND_GPU``): the node's action is the
most disruptive one any finding asks for. A *sticky* verdict (hardware-fatal) stays until an
operator clears it, the host reboots or the GPU is reset; any other clears itself once its
condition has been absent for ``[health] hold_seconds``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Level(enum.IntEnum):
    OK = 0
    DEGRADED = 1
    UNHEALTHY = 2

    @property
    def label(self) -> str:
        return self.name.lower()


ACTIONS: tuple[str, ...] = ("none", "check_fabric", "drain", "reset_gpu", "reboot", "replace_hardware")
"""The action vocabulary, least to most disruptive."""


def worst_action(actions: list[str]) -> str:
    return max(actions, key=ACTIONS.index, default="none")


@dataclass(frozen=True)
class Rule:
    id: str
    level: Level
    action: str
    sticky: bool
    summary: str


RULES: tuple[Rule, ...] = (
    Rule("gpu.lost", Level.UNHEALTHY, "reboot", True, "The GPU stopped answering (fell off the bus)."),
    Rule("gpu.row_remap.failure", Level.UNHEALTHY, "replace_hardware", True,
         "A row remap failed: the GPU's memory cannot be repaired."),
    Rule("gpu.retired_pages.full", Level.UNHEALTHY, "replace_hardware", False,
         "A GPU before Ampere has retired 64 pages (single- and double-bit), all its page retirement "
         "table holds: a new bad page cannot be mapped out."),
    Rule("gpu.row_remap.pending", Level.DEGRADED, "reset_gpu", False,
         "A row remap waits for a GPU reset to take effect."),
    Rule("gpu.recovery_action", Level.UNHEALTHY, "reset_gpu", False,
         "The driver asks for a recovery action (NVML field 230); the action follows the driver's."),
    Rule("gpu.ecc.uncorrectable", Level.DEGRADED, "reset_gpu", False,
         "Uncorrectable ECC errors since the last GPU reset (volatile count above zero)."),
    Rule("gpu.missing", Level.UNHEALTHY, "reboot", False, "Fewer GPUs than this VM size has."),
    Rule("gpu.model", Level.DEGRADED, "none", False, "A GPU model other than this VM size has."),
    Rule("gpu.pcie.degraded", Level.DEGRADED, "reboot", False,
         "A GPU's PCIe link is narrower, or capable of a lower generation, than this VM size has."),
    Rule("gpu.thermal_slowdown", Level.DEGRADED, "none", False, "A GPU is slowed down for temperature."),
    Rule("gpu.fabric.health", Level.UNHEALTHY, "check_fabric", False,
         "The NVLink fabric reports a GPU's route unhealthy, its configuration incorrect or its fabric "
         "manager gone (unhealthy); degraded bandwidth or a recovery in progress (degraded)."),
    Rule("gpu.fabric.registration", Level.DEGRADED, "check_fabric", False,
         "A GPU has not completed NVLink fabric registration, or completed it with an error."),
    Rule("ib.port.down", Level.UNHEALTHY, "check_fabric", False, "An InfiniBand port is not up."),
    Rule("ib.port.flapping", Level.DEGRADED, "check_fabric", False,
         "An InfiniBand port flapped [health] flap_threshold times within flap_window."),
    Rule("ib.port.rate", Level.DEGRADED, "check_fabric", False,
         "An InfiniBand port runs below this VM size's rate."),
    Rule("ib.port.missing", Level.UNHEALTHY, "reboot", False, "Fewer InfiniBand ports than this VM size has."),
    Rule("ib.port.errors", Level.DEGRADED, "check_fabric", False,
         "An InfiniBand port's physical errors grew by [health] ib_error_threshold within ib_error_window."),
    Rule("collector.down", Level.DEGRADED, "none", False,
         "A hardware collector is down: the verdict cannot see that hardware."),
    Rule("gpu.xid", Level.UNHEALTHY, "reset_gpu", True,
         "An XID the catalogue below (or `[health] xids`) counts as a hardware fault (rule id gpu.xid.<n>)."),
    Rule("gpu.xid.repeated", Level.UNHEALTHY, "reset_gpu", False,
         "The same application-class XID (`[health] xid_repeat`: 13, 31, 43) on one GPU "
         "xid_repeat_threshold times within xid_repeat_window: the GPU, not the application."),
    Rule("gpu.xid.same_gpc", Level.UNHEALTHY, "reset_gpu", False,
         "XID 13 or 31 on the same GPC of one GPU xid_gpc_threshold times within xid_repeat_window "
         "(the kernel log names the GPC): one failing GPC, not the application."),
    Rule("gpu.reset.repeated", Level.UNHEALTHY, "replace_hardware", True,
         "A GPU reset cleared a hardware fault on the same GPU reset_repeat_threshold times within "
         "reset_repeat_window: the fault keeps coming back."),
    Rule("node.remediation_budget", Level.UNHEALTHY, "replace_hardware", True,
         "The verdict asked for a drain or a report (an unhealthy verdict with a drain-worthy action) more "
         "than remediation_budget times within remediation_window: replace the hardware, stop re-filing."),
)
RULE_BY_ID = {rule.id: rule for rule in RULES}


@dataclass(frozen=True)
class XidPolicy:
    level: Level
    action: str
    sticky: bool


# XIDs that say something about the hardware (NVIDIA's XID catalog, docs.nvidia.com/deploy/xid-errors,
# "Resolution bucket"); application faults (13, 31, 43, 45, 68, 69) are not the node's health.
XID_POLICY: dict[int, XidPolicy] = {
    48: XidPolicy(Level.UNHEALTHY, "reset_gpu", True),     # double-bit ECC
    62: XidPolicy(Level.UNHEALTHY, "reset_gpu", True),     # micro-controller halt
    64: XidPolicy(Level.UNHEALTHY, "reset_gpu", True),     # row-remap recording failure
    74: XidPolicy(Level.DEGRADED, "check_fabric", False),  # NVLink error
    79: XidPolicy(Level.UNHEALTHY, "reboot", True),        # fallen off the bus
    92: XidPolicy(Level.DEGRADED, "none", False),          # high single-bit ECC rate
    94: XidPolicy(Level.DEGRADED, "reset_gpu", True),      # contained ECC error
    95: XidPolicy(Level.UNHEALTHY, "reset_gpu", True),     # uncontained ECC error
    119: XidPolicy(Level.UNHEALTHY, "reset_gpu", True),    # GSP RPC timeout
    120: XidPolicy(Level.UNHEALTHY, "reset_gpu", True),    # GSP error
    140: XidPolicy(Level.UNHEALTHY, "reset_gpu", True),    # unrecovered ECC error
    **{x: XidPolicy(Level.UNHEALTHY, "check_fabric", False) for x in range(144, 151)},  # GB200 NVLink
}

REMEDIATION_ACTIONS = frozenset({"drain", "reset_gpu", "reboot", "replace_hardware"})
"""Actions that take the node out of service (Slurm drains it; a report files it)."""

# NVML recovery actions (nvmlDeviceGetGpuRecoveryAction / NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) -> ours
RECOVERY_ACTIONS: dict[int, str] = {
    1: "reset_gpu",  # GPU_RESET
    2: "reboot",  # NODE_REBOOT
    3: "drain",  # DRAIN_P2P
    4: "reset_gpu",  # DRAIN_AND_RESET
    5: "check_fabric",  # recover the IMEX domain (GB200)
    6: "reset_gpu",  # bus reset
    7: "reboot",  # system reboot
}

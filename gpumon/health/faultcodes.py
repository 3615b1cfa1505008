"""Azure's node health check fault codes (AzNHC NHC2001-NHC2022) and the Guest Health Reporting
impact category each one files under, and which gpumon rule carries which code.

Source: Azure/azurehpc-health-checks, ``triggerGHR/config/nhc_fault_dictionary.cfg`` (code -> category
name); the full category is ``Resource.Hpc.Unhealthy.<name>``, the value the Impact Reporting API's
``impactCategory`` takes. A rule without an AzNHC equivalent has no code (and is never reported to
Azure): gpumon does not invent codes.
"""

from __future__ import annotations

from dataclasses import dataclass

CATEGORY_PREFIX = "Resource.Hpc.Unhealthy."


@dataclass(frozen=True)
class FaultCode:
    code: str  # NHC2009
    name: str  # HpcMissingGpu

    @property
    def category(self) -> str:
        """The Guest Health Reporting impact category: Resource.Hpc.Unhealthy.HpcMissingGpu."""
        return CATEGORY_PREFIX + self.name


FAULT_CODES: dict[str, FaultCode] = {fc.code: fc for fc in (
    FaultCode("NHC2001", "HpcGenericFailure"),
    FaultCode("NHC2002", "MissingIB"),
    FaultCode("NHC2003", "IBPerformance"),
    FaultCode("NHC2004", "IBPortDown"),
    FaultCode("NHC2005", "IBPortFlapping"),
    FaultCode("NHC2006", "HpcGpuDcgmDiagFailure"),
    FaultCode("NHC2007", "HpcRowRemapFailure"),
    FaultCode("NHC2008", "HpcInforomCorruption"),
    FaultCode("NHC2009", "HpcMissingGpu"),
    FaultCode("NHC2010", "ManualInvestigation"),
    FaultCode("NHC2011", "XID95UncontainedECCError"),
    FaultCode("NHC2012", "XID94ContainedECCError"),
    FaultCode("NHC2013", "XID79FallenOffBus"),
    FaultCode("NHC2014", "XID48DoubleBitECC"),
    FaultCode("NHC2015", "UnhealthyGPUNvidiasmi"),
    FaultCode("NHC2016", "NvLink"),
    FaultCode("NHC2017", "HpcDcgmiThermalReport"),
    FaultCode("NHC2018", "ECCPageRetirementTableFull"),
    FaultCode("NHC2019", "DBEOverLimit"),
    FaultCode("NHC2020", "HpcGpuDcgmDiagFailure"),
    FaultCode("NHC2021", "GPUMemoryBWFailure"),
    FaultCode("NHC2022", "CPUPerformance"),
)}

RULE_CODES: dict[str, str] = {
    "ib.port.flapping": "NHC2005",   # AzNHC check_ib_link_flapping
    "ib.port.down": "NHC2004",       # check_hw_ib port state
    "ib.port.missing": "NHC2002",    # IB devices missing
    "gpu.missing": "NHC2009",        # check_gpu_count (AKS: "Expected to see 8 GPUs but found 7")
    "gpu.lost": "NHC2013",           # NVML GPU_IS_LOST is the GPU fallen off the bus, as XID 79
    "gpu.row_remap.failure": "NHC2007",
    "gpu.retired_pages.full": "NHC2018",  # ECCPageRetirementTableFull: pre-Ampere, 64 pages retired
    "gpu.ecc.uncorrectable": "NHC2019",  # check_gpu_ecc: volatile double-bit errors over its limit
    "gpu.thermal_slowdown": "NHC2017",
    "gpu.fabric.health": "NHC2016",
    "gpu.fabric.registration": "NHC2016",
    "gpu.xid.95": "NHC2011",
    "gpu.xid.94": "NHC2012",
    "gpu.xid.79": "NHC2013",
    "gpu.xid.48": "NHC2014",
    "gpu.xid.74": "NHC2016",         # NVLink error
    **{f"gpu.xid.{x}": "NHC2016" for x in range(144, 151)},  # GB200 NVLink XIDs
}
"""gpumon rule id -> AzNHC fault code."""


def for_rule(rule: str) -> FaultCode | None:
    """The fault code a finding of ``rule`` carries; None where AzNHC has no equivalent."""
    code = RULE_CODES.get(rule)
    return FAULT_CODES[code] if code else None


def with_code(reason: str, code: str | None) -> str:
    """A reason ending ``. FaultCode: NHC2009`` where it has a code, as AKS's node-problem-detector
    writes its NodeCondition messages."""
    return f"{reason.rstrip('.')}. FaultCode: {code}" if code else reason


def nhc_line(rule: str, reason: str) -> str:
    """NHC's own failure line, as distributed NHC and its Kusto table read it."""
    fc = for_rule(rule)
    line = f"ERROR:  nhc:  Health check failed:  {rule}: {reason.rstrip('.')}."
    return line + (f" FaultCode: {fc.code}" if fc else "")


def markdown() -> str:
    """The rule -> fault code table of docs/health-actions.md (a test keeps it in sync):
    ``python -m gpumon.health.faultcodes``."""
    rows = ["| gpumon rule | AzNHC fault code | Guest Health Reporting impact category |", "|---|---|---|"]
    for rule, code in sorted(RULE_CODES.items(), key=lambda item: (item[1], _order(item[0]))):
        rows.append(f"| `{rule}` | {code} | `{FAULT_CODES[code].category}` |")
    return "\n".join(rows) + "\n"


def _order(rule: str) -> tuple[str, int]:
    head, _, tail = rule.rpartition(".")
    return (head, int(tail)) if tail.isdigit() else (rule, 0)


if __name__ == "__main__":
    print(markdown(), end="")

"""NVLink fabric membership and health of a GPU (GB200 and later; Hopper with NVSwitch reports a state).

``nvmlDeviceGetGpuFabricInfoV`` fills a versioned struct passed by reference (pynvml hands the argument
to the C function as is, so it must be ``ctypes.byref``): the v3 struct (``healthSummary``) first, the
v2 one (``healthMask``) when the driver answers ARGUMENT_VERSION_MISMATCH, and the deprecated
``nvmlDeviceGetGpuFabricInfo`` (no health at all) when the library has no ``...V`` (FUNCTION_NOT_FOUND,
via the item's fallback). The struct version that worked is remembered per GPU.

A GPU that is part of no fabric answers NOT_SUPPORTED (pre-Hopper) or a struct whose state says so; the
collector then drops the call like any refused one. Every change of state, status or a health
condition between two reads is one ``gpu_fabric_changed`` event.
"""

from __future__ import annotations

import ctypes
from typing import Any

from gpumon.catalogue import gpu as CG
from gpumon.collectors import nvml_readings as M
from gpumon.collectors.nvml_session import Device, nvml_code
from gpumon.collectors.nvml_tables import (
    FABRIC_CONDITIONS,
    FABRIC_STATE_COMPLETED,
    FABRIC_STATE_NOT_SUPPORTED,
    FABRIC_STATES,
    FABRIC_SUMMARIES,
    error_name,
)
from gpumon.model import Event, Severity

NOT_SUPPORTED = 3
ARGUMENT_VERSION_MISMATCH = 25
ZERO_UUID = "00000000-0000-0000-0000-000000000000"


def read_fabric_v(session: Any, device: Device) -> Any:
    """The filled v3 struct, or v2 where the driver knows no v3 (remembered in ``device.extra``)."""
    lib = session.lib
    versions = ["c_nvmlGpuFabricInfo_v3_t", "c_nvmlGpuFabricInfo_v2_t"]
    start = device.extra.get("fabric_struct", 0)
    for i in range(start, len(versions)):
        info = getattr(lib, versions[i])()   # its __init__ sets .version
        try:
            session.call("nvmlDeviceGetGpuFabricInfoV", device.handle, ctypes.byref(info))
        except Exception as exc:
            if nvml_code(exc) == ARGUMENT_VERSION_MISMATCH and i + 1 < len(versions):
                device.extra["fabric_struct"] = i + 1
                continue
            raise
        return _member(session, info)
    raise AssertionError("unreachable")  # pragma: no cover


def read_fabric_legacy(session: Any, device: Device) -> Any:
    """The deprecated call of drivers before ``...V``: state, status, cluster and clique only."""
    info = session.lib.c_nvmlGpuFabricInfo_t()
    session.call("nvmlDeviceGetGpuFabricInfo", device.handle, ctypes.byref(info))
    return _member(session, info)


def _member(session: Any, info: Any) -> Any:
    """The struct, unless its state says the GPU takes part in no fabric (PCIe Hopper, for one): that
    is raised as NOT_SUPPORTED so the collector drops the call for the GPU like any refused one."""
    if int(info.state) == FABRIC_STATE_NOT_SUPPORTED:
        raise session.lib.NVMLError(NOT_SUPPORTED)
    return info


def cluster_uuid(info: Any) -> str:
    """The 16 bytes of ``clusterUuid`` in the 8-4-4-4-12 form nvidia-smi prints."""
    raw = bytes(info.clusterUuid).hex()
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def parse_fabric(info: Any, _ctx: M.ParseContext) -> list[M.Row]:
    """Rows for one struct of any version (v1 has no health, v2 no summary)."""
    state = int(info.state)
    rows: list[M.Row] = [(CG.FABRIC_STATE, (), float(state))]
    if state == FABRIC_STATE_COMPLETED:
        rows.append((CG.FABRIC_STATUS, (), float(int(info.status))))
        uuid = cluster_uuid(info)
        if uuid != ZERO_UUID:   # Hopper + NVSwitch: completed with a zero UUID, no multi-node domain
            rows.append((CG.FABRIC_INFO, (uuid, str(int(info.cliqueId))), 1.0))
    mask = int(getattr(info, "healthMask", 0))
    for cond in FABRIC_CONDITIONS:
        holds = cond.decode(mask)
        if holds is not None:
            rows.append((CG.FABRIC_HEALTH, (cond.name,), 1.0 if holds else 0.0))
    summary = int(getattr(info, "healthSummary", 0))
    if summary in FABRIC_SUMMARIES:
        rows.append((CG.FABRIC_SUMMARY, (), float(summary)))
    return rows


FABRIC_ITEM = M.CallItem("fabric", "nvmlDeviceGetGpuFabricInfoV", (), parse_fabric, weight=3,
                         fallback="fabric_legacy", read=read_fabric_v)
FABRIC_LEGACY_ITEM = M.CallItem("fabric_legacy", "nvmlDeviceGetGpuFabricInfo", (), parse_fabric,
                                weight=3, read=read_fabric_legacy)


# --- changes -----------------------------------------------------------------------------------------

def _facts(rows: list[M.Row]) -> dict[str, float]:
    """What an event compares: state, status, summary and each health condition."""
    facts: dict[str, float] = {}
    for spec, extra, value in rows:
        if spec is CG.FABRIC_STATE:
            facts["state"] = value
        elif spec is CG.FABRIC_STATUS:
            facts["status"] = value
        elif spec is CG.FABRIC_SUMMARY:
            facts["summary"] = value
        elif spec is CG.FABRIC_HEALTH:
            facts[extra[0]] = value
    return facts


def _describe(key: str, value: float | None) -> str:
    if value is None:
        return "not reported"
    if key == "state":
        return FABRIC_STATES.get(int(value), str(int(value)))
    if key == "status":
        return error_name(int(value)) if value else "success"
    if key == "summary":
        return FABRIC_SUMMARIES.get(int(value), str(int(value)))
    return "yes" if value else "no"


def _worse(key: str, old: float | None, new: float | None) -> bool:
    """True when the change is a step towards trouble (it is logged as a warning)."""
    if new is None:
        return False
    if key == "state":
        return old == FABRIC_STATE_COMPLETED
    if key == "status":
        return new != 0
    if key == "summary":
        return new in (2, 3)
    return new == 1


def fabric_events(device: Device, old: list[M.Row] | None, new: list[M.Row]) -> list[Event]:
    """One ``gpu_fabric_changed`` event per fact that changed; none on the first read (``old`` None)."""
    if old is None:
        return []
    before, after = _facts(old), _facts(new)
    events = []
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key), after.get(key)
        if was == now:
            continue
        what = key if key in ("state", "status", "summary") else "health"
        attrs: dict[str, Any] = {"what": what, "old": _describe(key, was), "new": _describe(key, now)}
        if what == "health":
            attrs["condition"] = key
        label = "fabric " + (key if what != "health" else f"health {key}")
        events.append(Event(
            "gpu_fabric_changed", Severity.WARNING if _worse(key, was, now) else Severity.INFO,
            {"gpu": str(device.index), "uuid": device.uuid},
            f"{device.name}: NVLink {label} {attrs['old']} -> {attrs['new']}", attrs))
    return events

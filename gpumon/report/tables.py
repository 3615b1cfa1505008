"""The built-in collectors' sections of ``gpumon once --format table``, one function per collector.

Each builds its section from the snapshot alone (the catalogue's metric specs, read back from the
families), and returns None when the snapshot holds nothing of that collector. :func:`table_for`
looks one up by collector name; a collector without one here (a plugin's) may build its own section in
its class's ``summarize`` (:mod:`gpumon.report` asks that second). The report is a face: it may import
a collector's reading tables (the IB ``counters/`` files); no collector imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gpumon.catalogue import gpu as gpu_metrics
from gpumon.catalogue import infiniband as ib_metrics
from gpumon.catalogue.host import HOST_INFO, HOST_LABELS
from gpumon.catalogue.infiniband import SPEC_INFO, SPEC_RATE, SPEC_STATE
from gpumon.collectors.infiniband import PMA_COUNTERS, PMA_SPECS
from gpumon.collectors.nvml_tables import THROTTLE_REASONS
from gpumon.model import MetricSpec, Sample, Snapshot
from gpumon.sources.ib_sysfs import STATE_NAMES
from gpumon.table import Table

TableFunction = Callable[[Snapshot], Table | None]


def nvml_table(snapshot: Snapshot) -> Table | None:
    """``nvml``: one row per GPU (a lost one says LOST), within 100 columns."""
    info = snapshot.family(gpu_metrics.INFO_SPEC.name)
    lost = snapshot.family(gpu_metrics.LOST.name)
    if info is None and lost is None:
        return None
    gpus: dict[str, dict[str, Any]] = {}
    for fam in (lost, info):
        for s in fam.samples if fam else ():
            gpus.setdefault(s.label("gpu") or "?", {"uuid": s.label("uuid")})
    for s in info.samples if info else ():
        gpus[s.label("gpu") or "?"]["model"] = s.label("model") or ""
    for s in lost.samples if lost else ():
        gpus[s.label("gpu") or "?"]["lost"] = s.value == 1

    def each(name: str, **match: str) -> Iterator[tuple[dict[str, Any], Sample]]:
        fam = snapshot.family(name)
        for s in fam.samples if fam else ():
            gpu = s.label("gpu")
            if all(s.label(k) == v for k, v in match.items()) and gpu is not None and gpu in gpus:
                yield gpus[gpu], s

    columns: tuple[tuple[str, MetricSpec, dict[str, str]], ...] = (
        ("util", gpu_metrics.UTIL, {"engine": "gpu"}), ("used", gpu_metrics.MEM_USED, {}), ("total", gpu_metrics.MEM_TOTAL, {}),
        ("temp", gpu_metrics.TEMP, {"sensor": "gpu"}), ("power", gpu_metrics.POWER, {}), ("limit", gpu_metrics.POWER_LIMIT, {}),
        ("sm", gpu_metrics.CLOCK, {"clock": "sm"}))
    for column, spec, match in columns:
        for row, s in each(spec.name, **match):
            row[column] = s.value
    short = {"sw_power_cap": "pwr", "hw_slowdown": "hw", "sync_boost": "sync",
             "sw_thermal_slowdown": "swtherm", "hw_thermal_slowdown": "hwtherm",
             "hw_power_brake_slowdown": "brake"}
    for row, s in each(gpu_metrics.CLOCK_REASON.name):
        if s.value == 1 and s.label("reason") in THROTTLE_REASONS:
            row.setdefault("reasons", []).append(short.get(s.label("reason") or "", "?"))
    for row, s in each(gpu_metrics.ECC.name, type="uncorrected", counter="volatile"):
        if s.value:
            row.setdefault("health", []).append(f"dbe{int(s.value)}")
    for row, s in each(gpu_metrics.REMAP_PENDING.name):
        if s.value:
            row.setdefault("health", []).append("remap-pend")
    for row, s in each(gpu_metrics.REMAP_FAILURE.name):
        if s.value:
            row.setdefault("health", []).append("remap-FAIL")
    xid_fam = snapshot.family(gpu_metrics.XID_TOTAL.name)
    for s in xid_fam.samples if xid_fam else ():
        xid_row = gpus.get(s.label("gpu") or "")
        if xid_row is not None and s.value:
            xid_row.setdefault("xids", []).append(f"{s.label('xid')}x{int(s.value)}")

    def num(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
        return fmt.format(row[key] * scale) if key in row else "-"

    out_rows = []
    for index in sorted(gpus, key=lambda g: (len(g), g)):
        r = gpus[index]
        model = (r.get("model") or "").removeprefix("NVIDIA ")[:14]
        if r.get("lost"):
            out_rows.append((index, model, "LOST", "-", "-", "-", "-", "-", "-",
                             ",".join(r.get("xids", [])) or "-"))
            continue
        mem = (f"{r['used'] / 2**30:.1f}/{r['total'] / 2**30:.0f}G" if "used" in r and "total" in r else "-")
        power = (f"{r['power']:.0f}/{r['limit']:.0f}W" if "power" in r and "limit" in r
                 else num(r, "power", "{:.0f}W"))
        out_rows.append((
            index, model, num(r, "util", "{:.0f}%", 100.0), mem, num(r, "temp", "{:.0f}C"), power,
            num(r, "sm", "{:.0f}M", 1e-6), ",".join(r.get("reasons", [])) or "-",
            ",".join(r.get("health", [])) or "ok", ",".join(r.get("xids", [])) or "-",
        ))
    return Table("GPUs (NVML)",
                 ("GPU", "Model", "Util", "Memory", "Temp", "Power", "SM clk", "Throttle", "ECC/remap",
                  "XID"),
                 tuple(out_rows))


def infiniband_table(snapshot: Snapshot) -> Table | None:
    """``infiniband``: one row per port, its state, rate, traffic, flaps and non-zero error counters."""
    info = snapshot.family(SPEC_INFO.name)
    if info is None:
        return None

    def by_port(name: str) -> dict[tuple[str | None, str | None], float]:
        fam = snapshot.family(name)
        if fam is None:
            return {}
        return {(s.label("device"), s.label("port")): s.value for s in fam.samples}

    state = by_port(SPEC_STATE.name)
    rate = by_port(SPEC_RATE.name)
    rx = by_port(PMA_SPECS["port_rcv_data"].name)
    tx = by_port(PMA_SPECS["port_xmit_data"].name)
    flaps = by_port(ib_metrics.SPEC_FLAPS.name)
    errors: dict[tuple[str | None, str | None], list[str]] = {}
    for counter in PMA_COUNTERS:
        if counter.scale != 1 or "packets" in counter.file:
            continue
        if counter.file == "port_xmit_wait":
            continue
        for key, value in by_port(counter.metric).items():
            if value:
                errors.setdefault(key, []).append(f"{_ERROR_SHORT.get(counter.file, counter.file)}={value:g}")
    rows = []
    for sample in info.samples:
        key = (sample.label("device"), sample.label("port"))
        layer = "ETH" if sample.label("link_layer") == "Ethernet" else "IB"
        state_id = state.get(key)
        errs = " ".join(errors.get(key, [])) or "-"
        if len(errs) > 34:
            errs = errs[:31] + "..."
        rows.append((
            f"{key[0]}/{key[1]}",
            (sample.label("netdev") or "-")[:12],
            f"{layer} {STATE_NAMES.get(int(state_id), '?') if state_id is not None else '?'}",
            f"{rate[key] * 8 / 1e9:g}G" if key in rate else "?",
            _human(rx.get(key)),
            _human(tx.get(key)),
            f"{flaps[key]:g}" if key in flaps else "-",
            errs,
        ))
    return Table("InfiniBand ports", ("port", "netdev", "state", "rate", "rx", "tx", "flaps", "errors"),
                 tuple(rows))


_ERROR_SHORT = {
    "symbol_error": "sym", "link_error_recovery": "recov", "link_downed": "downed",
    "port_rcv_errors": "rcv_err", "port_rcv_remote_physical_errors": "rcv_rphys",
    "port_rcv_switch_relay_errors": "relay", "port_xmit_discards": "discards",
    "port_xmit_constraint_errors": "xconstr", "port_rcv_constraint_errors": "rconstr",
    "local_link_integrity_errors": "integrity", "excessive_buffer_overrun_errors": "overrun",
    "VL15_dropped": "vl15",
}


def _human(value: float | None) -> str:
    if value is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(value) < 1000 or unit == "PB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1000
    return f"{value:.1f}PB"  # pragma: no cover - loop always returns


def host_info_table(snapshot: Snapshot) -> Table | None:
    """``host_info``: the Azure identity and placement labels, one row."""
    fam = snapshot.family(HOST_INFO.name)
    if fam is None:
        return None
    rows = tuple(tuple(s.label(name) or "-" for name in HOST_LABELS) for s in fam.samples)
    return Table("Azure host", ("Size", "Region", "Zone", "VMSS", "VM id", "Placement group", "FD", "Host"),
                 rows)


BUILTIN: dict[str, TableFunction] = {
    "nvml": nvml_table,
    "infiniband": infiniband_table,
    "host_info": host_info_table,
}
"""Collector name -> its section of the table; a built-in collector not listed here has none."""


def table_for(name: str) -> TableFunction | None:
    """The report's own table function for the collector ``name``, or None (a plugin, or no section)."""
    return BUILTIN.get(name)

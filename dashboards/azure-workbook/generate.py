#!/usr/bin/env python3
"""Writes the Azure Monitor Workbook over gpumon's Log Analytics tables and the ARM template deploying it.

    python dashboards/azure-workbook/generate.py           # rewrite gpumon-workbook.json and azuredeploy.json
    python dashboards/azure-workbook/generate.py --check   # exit 1 if a committed file is stale

gpumon-workbook.json is the Workbook itself (Notebook/1.0: paste it into a Workbook's Advanced Editor);
azuredeploy.json deploys the same content as a Microsoft.Insights/workbooks resource bound to a Log
Analytics workspace. The queries read GpuMonGpu_CL, GpuMonInfiniBand_CL and GpuMonEvents_CL, whose
columns are declared in deploy/azure/azuredeploy.json; tests/deploy/test_workbook_kql_schema.py parses every
query against those columns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # runnable from a checkout

from gpumon.generated import sync  # noqa: E402

WORKSPACE = "microsoft.operationalinsights/workspaces"
HOSTS = "('*' in ({Computer}) or Computer in ({Computer}))"
"""Host picker filter: the multi-select parameter offers All as '*'."""
GRAIN = "{TimeRange:grain}"


def total(*columns: str) -> str:
    """The sum of ``...Increase`` columns over the group: each summed on its own and missing ones read as 0.

    The sink leaves an increase of 0 out of the row (omit_zero_increases) and a counter the driver lacks
    is never there, so `A + B` of two columns is null on most rows; sum() skips nulls, coalesce() turns a
    column without any value in the group into 0."""
    return " + ".join(f"coalesce(sum({c}), 0.0)" for c in columns)


def longest(*columns: str) -> str:
    """The largest of the summed ``...Increase`` columns: for clock-event reasons that overlap in time
    (adding them would count the same second twice), the time at least one of them held clocks down."""
    return "max_of(" + ", ".join(f"coalesce(sum({c}), 0.0)" for c in columns) + ")"


POWER_SECONDS = longest("ClockViolationSwPowerCapIncrease", "ClockViolationHwPowerBrakeSlowdownIncrease")
"""Seconds held down for power: the power-cap counter (every driver) or the power brake (R580+)."""
THERMAL_SECONDS = longest("ClockViolationThermalIncrease", "ClockViolationSwThermalSlowdownIncrease",
                          "ClockViolationHwThermalSlowdownIncrease")
"""Seconds held down for temperature: the thermal policy counter (every driver) or the software and
hardware thermal slowdown counters (R580+)."""
NVLINK_ERRORS = total("NvlinkCrcFlitErrorsIncrease", "NvlinkCrcDataErrorsIncrease", "NvlinkReplayErrorsIncrease",
                      "NvlinkRecoveryErrorsIncrease")
PORT_ERRORS = ("SymbolErrorsIncrease", "LinkErrorRecoveriesIncrease", "ReceiveErrorsIncrease",
               "ReceiveRemotePhysicalErrorsIncrease", "ReceiveSwitchRelayErrorsIncrease", "TransmitDiscardsIncrease",
               "TransmitConstraintErrorsIncrease", "ReceiveConstraintErrorsIncrease",
               "LocalLinkIntegrityErrorsIncrease", "ExcessiveBufferOverrunErrorsIncrease", "Vl15DroppedIncrease")
"""The PMA error counters, as port:gpumon_ib_errors:rate5m adds them (link_downed is counted as flaps)."""


def text(name: str, markdown: str) -> dict[str, Any]:
    return {"type": 1, "name": name, "content": {"json": markdown}}


def query(name: str, title: str, kql: str, visualization: str, *, size: int = 0, width: str | None = None,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {
        "version": "KqlItem/1.0", "query": kql.strip(), "size": size, "title": title,
        "timeContextFromParameter": "TimeRange", "queryType": 0, "resourceType": WORKSPACE,
        "visualization": visualization,
    }
    content.update(extra or {})
    item: dict[str, Any] = {"type": 3, "name": name, "content": content}
    if width:
        item["customWidth"] = width
    return item


def group(name: str, title: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": 12, "name": name, "content": {
        "version": "NotebookGroup/1.0", "groupType": "editable", "title": title, "items": items}}


def parameters() -> dict[str, Any]:
    return {"type": 9, "name": "parameters", "content": {
        "version": "KqlParameterItem/1.0", "crossComponentResources": ["{Workspace}"],
        "style": "pills", "queryType": 0, "resourceType": WORKSPACE,
        "parameters": [
            {"id": "b3c1f3f0-51c8-4c0e-9a43-1d7c2e0f0a01", "version": "KqlParameterItem/1.0", "name": "Workspace",
             "label": "Log Analytics workspace", "type": 5, "isRequired": True,
             "typeSettings": {"resourceTypeFilter": {WORKSPACE: True}, "additionalResourceOptions": [],
                              "showDefault": False},
             "value": None, "timeContext": {"durationMs": 86400000}},
            {"id": "b3c1f3f0-51c8-4c0e-9a43-1d7c2e0f0a02", "version": "KqlParameterItem/1.0", "name": "TimeRange",
             "label": "Time range", "type": 4, "isRequired": True, "value": {"durationMs": 21600000},
             "typeSettings": {"selectableValues": [{"durationMs": ms} for ms in (
                 900000, 3600000, 14400000, 21600000, 43200000, 86400000, 259200000, 604800000)],
                 "allowCustom": True}},
            {"id": "b3c1f3f0-51c8-4c0e-9a43-1d7c2e0f0a03", "version": "KqlParameterItem/1.0", "name": "Computer",
             "label": "Hosts", "type": 2, "multiSelect": True, "quote": "'", "delimiter": ",",
             "query": "union GpuMonGpu_CL, GpuMonInfiniBand_CL\n| distinct Computer\n| order by Computer asc",
             "typeSettings": {"additionalResourceOptions": ["value::all"], "selectAllValue": "*",
                              "showDefault": False},
             "defaultValue": "value::all", "timeContextFromParameter": "TimeRange",
             "queryType": 0, "resourceType": WORKSPACE},
        ],
    }}


def fleet() -> list[dict[str, Any]]:
    tiles = f"""
let gpus = GpuMonGpu_CL | where {HOSTS} | summarize arg_max(TimeGenerated, Lost) by Computer, Gpu;
let ports = GpuMonInfiniBand_CL | where {HOSTS} | summarize arg_max(TimeGenerated, UpMin, Flapping) by Computer, Device, Port;
let events = GpuMonEvents_CL | where {HOSTS};
union
    (gpus | summarize Value = dcount(Computer) | extend Metric = "Hosts reporting", Order = 1),
    (gpus | summarize Value = count() | extend Metric = "GPUs reporting", Order = 2),
    (gpus | where Lost | summarize Value = count() | extend Metric = "GPUs lost", Order = 3),
    (events | where Kind == "gpu_xid" | summarize Value = count() | extend Metric = "XIDs", Order = 4),
    (events | where Kind == "ib_link_flap" | summarize Value = count() | extend Metric = "IB link flaps", Order = 5),
    (ports | where UpMin < 1 | summarize Value = count() | extend Metric = "IB ports down", Order = 6),
    (ports | where Flapping | summarize Value = count() | extend Metric = "IB ports flapping", Order = 7),
    (events | where Kind == "collector_down" | summarize Value = count() | extend Metric = "Collector failures", Order = 8)
| order by Order asc
| project Metric, Value
"""
    util = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize Utilization = avg(UtilizationAvg) by Computer, bin(TimeGenerated, {GRAIN})
| render timechart
"""
    hot = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize MaxTemperatureC = max(TemperatureCelsiusMax), AvgPowerW = avg(PowerWattsAvg),
    PowerLimitW = max(PowerLimitWatts), AvgUtilization = avg(UtilizationAvg),
    PowerCappedSeconds = {POWER_SECONDS},
    ThermalSeconds = {THERMAL_SECONDS}
    by Computer, Gpu
| top 20 by MaxTemperatureC desc
"""
    hosts = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize GPUs = dcount(Uuid), AvgUtilization = avg(UtilizationAvg), PowerW = sum(PowerWattsAvg) / dcount(TimeGenerated),
    LostGPUs = dcountif(Uuid, Lost), Model = take_anyif(Model, isnotempty(Model)),
    Driver = take_anyif(DriverVersion, isnotempty(DriverVersion)), VmSize = take_anyif(VmSize, isnotempty(VmSize))
    by Computer
| join kind=leftouter (
    GpuMonInfiniBand_CL
    | where {HOSTS}
    | summarize Ports = dcount(strcat(Device, "/", Port)), PortsDown = dcountif(strcat(Device, "/", Port), UpMin < 1),
        Flaps = sum(FlapsIncrease) by Computer
) on Computer
| project-away Computer1
| order by Computer asc
"""
    return [
        text("fleet-title", "## Fleet\nHosts, GPUs and InfiniBand ports reporting to this workspace through gpumon."),
        query("fleet-tiles", "Fleet health", tiles, "tiles", size=4, extra={"tileSettings": {
            "titleContent": {"columnMatch": "Metric", "formatter": 1},
            "leftContent": {"columnMatch": "Value", "formatter": 12,
                            "formatOptions": {"palette": "auto"}, "numberFormat": {"unit": 17, "options": {
                                "style": "decimal", "maximumFractionDigits": 0}}},
            "showBorder": True}}),
        query("fleet-utilization", "Mean GPU utilization by host (0-1)", util, "timechart", width="50",
              extra={"chartSettings": {"ySettings": {"numberFormatSettings": {"unit": 0, "options": {
                  "style": "percent"}}, "min": 0, "max": 1}}}),
        query("fleet-hot", "Hottest GPUs", hot, "table", width="50", extra={"gridSettings": {"formatters": [
            {"columnMatch": "MaxTemperatureC", "formatter": 8, "formatOptions": {"palette": "greenRed", "min": 40,
                                                                                  "max": 90}},
            {"columnMatch": "AvgUtilization", "formatter": 0, "numberFormat": {"unit": 0, "options": {
                "style": "percent"}}},
        ]}}),
        query("fleet-hosts", "Hosts", hosts, "table"),
    ]


def gpus() -> list[dict[str, Any]]:
    util = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize Utilization = avg(UtilizationAvg) by Series = strcat(Computer, " GPU ", Gpu), bin(TimeGenerated, {GRAIN})
| render timechart
"""
    power = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize PowerW = avg(PowerWattsAvg) by Series = strcat(Computer, " GPU ", Gpu), bin(TimeGenerated, {GRAIN})
| render timechart
"""
    temp = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize TemperatureC = max(TemperatureCelsiusMax) by Series = strcat(Computer, " GPU ", Gpu), bin(TimeGenerated, {GRAIN})
| render timechart
"""
    memory = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize UsedBytes = max(MemoryUsedBytesMax) by Series = strcat(Computer, " GPU ", Gpu), bin(TimeGenerated, {GRAIN})
| render timechart
"""
    health = f"""
GpuMonGpu_CL
| where {HOSTS}
| summarize arg_max(TimeGenerated, Lost, RemappedRowsPending, RemappedRowsFailure, RemappedRowsCorrectable,
        RemappedRowsUncorrectable, RecoveryAction, NvlinkLinksActiveMin, PcieLinkWidthMin, PcieLinkGenerationMin),
    Model = take_anyif(Model, isnotempty(Model)), Serial = take_anyif(Serial, isnotempty(Serial)),
    NvlinkLinks = max(NvlinkLinks),
    EccCorrected = {total("EccCorrectedErrorsIncrease")}, EccUncorrected = {total("EccUncorrectedErrorsIncrease")},
    NvlinkErrors = {NVLINK_ERRORS},
    PcieReplays = {total("PcieReplaysIncrease")},
    PowerCappedSeconds = {POWER_SECONDS},
    ThermalSeconds = {THERMAL_SECONDS}
    by Computer, Gpu, Uuid
| project Computer, Gpu, Uuid, Model, Serial, Lost, RecoveryAction, EccUncorrected, EccCorrected,
    RemapPending = RemappedRowsPending, RemapFailure = RemappedRowsFailure,
    RemappedRows = RemappedRowsCorrectable + RemappedRowsUncorrectable,
    NvlinkActive = strcat(NvlinkLinksActiveMin, "/", NvlinkLinks), NvlinkErrors, PcieReplays,
    PcieLink = strcat("Gen", PcieLinkGenerationMin, " x", PcieLinkWidthMin), PowerCappedSeconds, ThermalSeconds
| order by Lost desc, EccUncorrected desc, RemapFailure desc, NvlinkErrors desc
"""
    return [
        text("gpu-title", "## GPUs\nPer GPU, from one row per GPU per upload interval (min/avg/max and increases). "
                          "*PowerCappedSeconds* and *ThermalSeconds*: time the clocks were held down for power or "
                          "for temperature; NVML's reasons overlap, so each is the longest of its counters, not "
                          "their sum (the thermal-slowdown and power-brake counters need driver R580; the power-cap "
                          "and thermal counters are there on every driver). Model and serial are sent on a GPU's "
                          "first row, on a change and at least hourly (`static_every`): pick a range of an hour "
                          "or more to see them."),
        query("gpu-utilization", "GPU utilization (0-1)", util, "timechart", width="50"),
        query("gpu-power", "Power draw (W)", power, "timechart", width="50"),
        query("gpu-temperature", "Temperature (°C)", temp, "timechart", width="50"),
        query("gpu-memory", "Memory used (bytes)", memory, "timechart", width="50",
              extra={"chartSettings": {"ySettings": {"numberFormatSettings": {"unit": 2, "options": {
                  "style": "decimal"}}}}}),
        query("gpu-health", "GPU health: ECC, row remapping, NVLink, PCIe", health, "table",
              extra={"gridSettings": {"formatters": [
                  {"columnMatch": "Lost", "formatter": 18, "formatOptions": {"thresholdsOptions": "icons",
                   "thresholdsGrid": [{"operator": "==", "thresholdValue": "true", "representation": "4"},
                                      {"operator": "Default", "representation": "success"}]}},
                  {"columnMatch": "EccUncorrected", "formatter": 8, "formatOptions": {"palette": "greenRed"}},
              ]}}),
    ]


def infiniband() -> list[dict[str, Any]]:
    throughput = f"""
GpuMonInfiniBand_CL
| where {HOSTS}
| summarize Rx = avg(DataReceivedBytesPerSecond), Tx = avg(DataTransmittedBytesPerSecond)
    by Computer, Device, Port, bin(TimeGenerated, {GRAIN})
| summarize ReceivedBytesPerSecond = sum(Rx), TransmittedBytesPerSecond = sum(Tx) by TimeGenerated
| render timechart
"""
    ports = f"""
GpuMonInfiniBand_CL
| where {HOSTS}
| summarize arg_max(TimeGenerated, State, PhysState, UpMin, RateBytesPerSecond, FlapsInWindow, Flapping,
        CountersSaturated),
    LinkLayer = take_anyif(LinkLayer, isnotempty(LinkLayer)), LastFlapTimestampSeconds = max(LastFlapTimestampSeconds),
    Errors = {total(*PORT_ERRORS)},
    SymbolErrors = {total("SymbolErrorsIncrease")}, LinkDowned = {total("LinkDownedIncrease")},
    Flaps = {total("FlapsIncrease")},
    PeakRxBytesPerSecond = max(DataReceivedBytesPerSecond), PeakTxBytesPerSecond = max(DataTransmittedBytesPerSecond)
    by Computer, Device, Port
| extend StateName = case(State == 1, "DOWN", State == 2, "INIT", State == 3, "ARMED", State == 4, "ACTIVE",
    State == 5, "ACTIVE_DEFER", "?"),
    LastFlap = iff(isnull(LastFlapTimestampSeconds), datetime(null), unixtime_seconds_todatetime(LastFlapTimestampSeconds)),
    PeakUtilization = max_of(PeakRxBytesPerSecond, PeakTxBytesPerSecond) / RateBytesPerSecond
| project Computer, Device, Port, LinkLayer, StateName, Up = UpMin >= 1, RateBytesPerSecond, PeakUtilization,
    Errors, SymbolErrors, LinkDowned, Flaps, FlapsInWindow, Flapping, LastFlap, CountersSaturated
| order by Up asc, Flapping desc, Errors desc, Flaps desc
"""
    errors = f"""
GpuMonInfiniBand_CL
| where {HOSTS}
| summarize Errors = {total(*PORT_ERRORS)}
    by Port = strcat(Computer, " ", Device, "/", Port), bin(TimeGenerated, {GRAIN})
| render timechart
"""
    congestion = f"""
GpuMonInfiniBand_CL
| where {HOSTS}
| summarize TransmitWaitTicksPerSecond = avg(TransmitWaitTicksPerSecond), OutOfSequence = sum(OutOfSequenceIncrease),
    LocalAckTimeouts = sum(LocalAckTimeoutErrIncrease), OutOfBuffer = sum(OutOfBufferIncrease),
    EcnMarked = sum(NpEcnMarkedRocePacketsIncrease), CnpSent = sum(NpCnpSentIncrease), CnpHandled = sum(RpCnpHandledIncrease),
    TransportRetriesExceeded = sum(ReqTransportRetriesExceededIncrease)
    by Computer, Device, Port
| order by TransmitWaitTicksPerSecond desc
"""
    return [
        text("ib-title", "## InfiniBand\nEvery port of every host: throughput, state, errors, flaps and congestion."),
        query("ib-throughput", "Fabric throughput (bytes/s)", throughput, "timechart", width="50"),
        query("ib-errors", "Port errors per interval", errors, "timechart", width="50"),
        query("ib-ports", "Ports: state, errors and flaps", ports, "table", extra={"gridSettings": {"formatters": [
            {"columnMatch": "Up", "formatter": 18, "formatOptions": {"thresholdsOptions": "icons", "thresholdsGrid": [
                {"operator": "==", "thresholdValue": "false", "representation": "4"},
                {"operator": "Default", "representation": "success"}]}},
            {"columnMatch": "PeakUtilization", "formatter": 8, "formatOptions": {"min": 0, "max": 1,
                                                                                  "palette": "blue"},
             "numberFormat": {"unit": 0, "options": {"style": "percent"}}},
            {"columnMatch": "Errors", "formatter": 8, "formatOptions": {"palette": "greenRed"}},
            {"columnMatch": "RateBytesPerSecond", "formatter": 0, "numberFormat": {"unit": 11, "options": {
                "style": "decimal"}}},
        ]}}),
        query("ib-congestion", "Congestion and retransmission counters", congestion, "table"),
    ]


def events() -> list[dict[str, Any]]:
    over_time = f"""
GpuMonEvents_CL
| where {HOSTS}
| summarize Events = count() by Kind, bin(TimeGenerated, {GRAIN})
| render columnchart
"""
    xids = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind == "gpu_xid"
| extend Xid = toint(Attributes.xid), Meaning = tostring(Attributes.meaning)
| summarize Count = count(), First = min(TimeGenerated), Last = max(TimeGenerated) by Computer, Gpu, Uuid, Xid, Meaning
| order by Last desc
"""
    flaps = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind in ("ib_link_flap", "ib_link_down", "ib_link_up", "ib_port_flapping")
| summarize Flaps = countif(Kind == "ib_link_flap"), Downs = countif(Kind == "ib_link_down"),
    Flapping = countif(Kind == "ib_port_flapping"), Last = max(TimeGenerated) by Computer, Device, Port
| order by Flaps desc
"""
    recent = f"""
GpuMonEvents_CL
| where {HOSTS}
| project TimeGenerated, Computer, Severity, Kind, Message, Gpu, Device, Port, Collector, Attributes
| order by TimeGenerated desc
| take 500
"""
    return [
        text("events-title", "## Events\nLink flaps and downs, XIDs, lost GPUs and collector failures, as gpumon logged them."),
        query("events-over-time", "Events by kind", over_time, "barchart", width="50"),
        query("events-xids", "XIDs by GPU", xids, "table", width="50"),
        query("events-flaps", "Link events by port", flaps, "table", width="50"),
        query("events-recent", "Recent events", recent, "table", width="50", extra={"gridSettings": {"formatters": [
            {"columnMatch": "Severity", "formatter": 18, "formatOptions": {"thresholdsOptions": "icons",
             "thresholdsGrid": [
                 {"operator": "==", "thresholdValue": "critical", "representation": "4"},
                 {"operator": "==", "thresholdValue": "error", "representation": "3"},
                 {"operator": "==", "thresholdValue": "warning", "representation": "2"},
                 {"operator": "Default", "representation": "info"}]}}]}}),
    ]


def health() -> list[dict[str, Any]]:
    """The health verdicts from the health_changed events (one per change of a host's verdict or findings):
    a host's latest event holds its current verdict and every finding behind it."""
    latest = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind == "health_changed"
| summarize arg_max(TimeGenerated, Attributes, Severity, VmSize, Region) by Computer
"""
    verdicts = latest + """| project Computer, Verdict = tostring(Attributes.current), Previous = tostring(Attributes.previous),
    Action = tostring(Attributes.action), Findings = array_length(Attributes.findings), Since = TimeGenerated
| order by Verdict desc, Since desc
"""
    findings = latest + """| mv-expand Finding = Attributes.findings
| project Computer, Rule = tostring(Finding.rule), Subject = tostring(Finding.subject),
    Verdict = tostring(Finding.severity), Action = tostring(Finding.action), Sticky = tobool(Finding.sticky),
    Reason = tostring(Finding.reason), Since = tostring(Finding.since)
| where isnotempty(Rule)
| order by Verdict desc, Computer asc
"""
    by_verdict = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind == "health_changed"
| summarize Changes = count() by Verdict = tostring(Attributes.current), bin(TimeGenerated, {GRAIN})
| render columnchart
"""
    by_size = latest + """| summarize Hosts = count() by Verdict = tostring(Attributes.current), VmSize, Region
"""
    return [
        text("health-title", "## Health\ngpumon's verdict per host (healthy, degraded, unhealthy) and the rules "
                             "behind it, from the `health_changed` events: a host's latest event holds its current "
                             "verdict and findings."),
        query("health-verdicts", "Current verdict per host", verdicts, "table", width="50"),
        query("health-changes", "Verdict changes over time", by_verdict, "barchart", width="50"),
        query("health-findings", "Failing rules", findings, "table", width="50"),
        query("health-by-size", "Verdicts by VM size and region", by_size, "table", width="50"),
    ]


def unknown(column: str) -> str:
    """A placement column as a group key: rows written before it was known (or off Azure) say so."""
    return f'{column} = iff(isempty({column}), "(unknown)", {column})'


PROBLEM_KINDS = '("ib_link_flap", "ib_port_flapping", "gpu_xid", "gpu_lost", "health_changed")'
PROBLEM_COUNTS = """Flaps = countif(Kind == "ib_link_flap"), FlappingPorts = dcountif(strcat(Device, "/", Port), Kind == "ib_port_flapping"),
    Xids = countif(Kind == "gpu_xid"), LostGpus = countif(Kind == "gpu_lost"),
    Unhealthy = dcountif(Computer, Kind == "health_changed" and tostring(Attributes.current) != "healthy"),
    Hosts = dcount(Computer), Last = max(TimeGenerated)"""
"""Per group of hosts: what went wrong on how many of them (several hosts of one placement group or
physical host at once point at what they share: the fabric, the chassis)."""


def placement() -> list[dict[str, Any]]:
    """Problems grouped by what hosts share: the placement group (one InfiniBand fabric) and the
    physical host (Hyper-V KVP), from the rows' placement columns."""
    by_group = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind in {PROBLEM_KINDS}
| extend {unknown("PlacementGroup")}
| summarize {PROBLEM_COUNTS} by PlacementGroup
| order by Hosts desc, Xids desc, Flaps desc
"""
    by_host = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind in {PROBLEM_KINDS}
| extend {unknown("PhysicalHost")}, {unknown("PlacementGroup")}
| summarize {PROBLEM_COUNTS}, VMs = make_set(Computer, 16) by PhysicalHost, PlacementGroup
| order by Hosts desc, Xids desc, Flaps desc
"""
    over_time = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind in {PROBLEM_KINDS}
| extend {unknown("PlacementGroup")}
| summarize Events = count() by PlacementGroup, bin(TimeGenerated, {GRAIN})
| render columnchart
"""
    hosts = f"""
union GpuMonGpu_CL, GpuMonInfiniBand_CL
| where {HOSTS}
| summarize arg_max(TimeGenerated, VmSize, Region, Zone, Vmss, PlacementGroup, FaultDomain, PhysicalHost) by Computer
| project Computer, VmSize, Region, Zone, Vmss, PlacementGroup, FaultDomain, PhysicalHost, LastSeen = TimeGenerated
| order by PlacementGroup asc, FaultDomain asc, Computer asc
"""
    return [
        text("placement-title", "## Placement\nFlaps, XIDs, lost GPUs and health changes grouped by what hosts "
                                "share: the placement group (one InfiniBand fabric) and the physical host. Several "
                                "hosts of one group at once point at the group, not the hosts. `(unknown)`: rows "
                                "from before IMDS answered, or off Azure."),
        query("placement-groups", "Problems by placement group", by_group, "table", width="50"),
        query("placement-physical-hosts", "Problems by physical host", by_host, "table", width="50"),
        query("placement-over-time", "Problems by placement group over time", over_time, "barchart", width="50"),
        query("placement-hosts", "Where each host sits", hosts, "table", width="50"),
    ]


SCHEDULED = f"""
GpuMonEvents_CL
| where {HOSTS}
| where Kind == "azure_scheduled_event"
| extend EventId = tostring(Attributes.event_id), Type = tostring(Attributes.type),
    Status = tostring(Attributes.status), Source = tostring(Attributes.source),
    NotBefore = tostring(Attributes.not_before), DurationSeconds = toint(Attributes.duration_seconds),
    Description = tostring(Attributes.description)
"""
"""The ``azure_scheduled_event`` rows (one when an event is first seen and one per status change,
``Removed`` when it left the document) with their attributes as columns."""


def scheduled_events() -> list[dict[str, Any]]:
    """Azure's planned maintenance (Scheduled Events from IMDS) per host, and where it falls."""
    latest = SCHEDULED + """| summarize arg_max(TimeGenerated, Type, Status, Source, NotBefore, DurationSeconds,
    Description, PlacementGroup, PhysicalHost) by Computer, EventId
"""
    pending = latest + """| where Status != "Removed"
| project Computer, Type, Status, NotBefore, DurationSeconds, Source, EventId, Description, PlacementGroup,
    PhysicalHost, Seen = TimeGenerated
| order by Seen desc
"""
    history = SCHEDULED + f"""| where Status != "Removed"
| summarize Events = dcount(EventId) by Type, bin(TimeGenerated, {GRAIN})
| render columnchart
"""
    by_group = latest + f"""| extend {unknown("PlacementGroup")}
| summarize Events = dcount(EventId), Hosts = dcount(Computer), Types = make_set(Type),
    Last = max(TimeGenerated) by PlacementGroup
| order by Hosts desc
"""
    log_ = SCHEDULED + """| project TimeGenerated, Computer, Type, Status, Source, NotBefore, EventId, Message
| order by TimeGenerated desc
| take 500
"""
    return [
        text("scheduled-title", "## Scheduled events\nAzure's planned maintenance (Freeze, Reboot, Redeploy, "
                                "Preempt, Terminate) as each host's IMDS announced it: the events not over yet, "
                                "their history, and the placement groups they fell on."),
        query("scheduled-pending", "Announced, not over yet", pending, "table", width="50"),
        query("scheduled-over-time", "Scheduled events by type", history, "barchart", width="50"),
        query("scheduled-by-group", "Scheduled events by placement group", by_group, "table", width="50"),
        query("scheduled-log", "Status changes", log_, "table", width="50"),
    ]


def attribution() -> list[dict[str, Any]]:
    """Who held the GPUs (Namespace, Pod, JobId on GPU rows and GPU event rows): GPU time, utilisation
    and the problems each workload met."""
    holders = """| extend Namespace = iff(isempty(Namespace), "(none)", Namespace), Pod = iff(isempty(Pod), "(none)", Pod),
    JobId = iff(isempty(JobId), "(none)", JobId)"""
    usage = f"""
GpuMonGpu_CL
| where {HOSTS}
| where isnotempty(Namespace) or isnotempty(Pod) or isnotempty(JobId)
{holders}
| summarize GpuHours = round(sum(IntervalSeconds) / 3600.0, 2), Utilization = avg(UtilizationAvg),
    PowerWatts = avg(PowerWattsAvg), Gpus = dcount(strcat(Computer, "/", Gpu)), Hosts = dcount(Computer),
    First = min(TimeGenerated), Last = max(TimeGenerated) by Namespace, Pod, JobId
| order by GpuHours desc
"""
    problems = f"""
GpuMonEvents_CL
| where {HOSTS}
| where isnotempty(Namespace) or isnotempty(Pod) or isnotempty(JobId)
{holders}
| summarize Xids = countif(Kind == "gpu_xid"), LostGpus = countif(Kind == "gpu_lost"), Events = count(),
    Kinds = make_set(Kind), Hosts = make_set(Computer, 16), Last = max(TimeGenerated) by Namespace, Pod, JobId
| order by Xids desc, LostGpus desc, Events desc
"""
    util = f"""
GpuMonGpu_CL
| where {HOSTS}
| where isnotempty(JobId) or isnotempty(Pod)
| extend Workload = iff(isnotempty(JobId), strcat("job ", JobId), strcat(Namespace, "/", Pod))
| summarize Utilization = avg(UtilizationAvg) by Workload, bin(TimeGenerated, {GRAIN})
| render timechart
"""
    return [
        text("attribution-title", "## Attribution\nWho held the GPUs: the Kubernetes pod (namespace, pod) or "
                                  "the Slurm job on the GPU rows and GPU events, comma-joined where several held a "
                                  "GPU in one interval. GPU hours are row seconds: one GPU for one hour is 1."),
        query("attribution-usage", "GPU time by workload", usage, "table", width="50"),
        query("attribution-problems", "Problems by workload", problems, "table", width="50"),
        query("attribution-utilization", "Utilization by workload", util, "timechart"),
    ]


LEMON_WINDOW = "7d"
"""The window lemons are counted over, whatever the time range (as the Prometheus rules count them)."""
REMAP_BUDGET = 64
"""Remapped rows (both causes) a GPU may reach within 14 days before it is flagged (the
GpumonGpuRemapTableFilling budget of deploy/prometheus/job-rules.yaml)."""
FAULTS_BY_PLACEMENT = f"""
let serials = GpuMonGpu_CL
| where TimeGenerated > ago({LEMON_WINDOW})
| summarize Serial = take_anyif(Serial, isnotempty(Serial)) by Uuid;
let xids = GpuMonEvents_CL
| where TimeGenerated > ago({LEMON_WINDOW}) and Kind == "gpu_xid" and isnotempty(Uuid)
| summarize Xids = count() by Uuid, Computer, PhysicalHost;
let remaps = GpuMonGpu_CL
| where TimeGenerated > ago({LEMON_WINDOW}) and isnotempty(Uuid)
| extend Rows = coalesce(RemappedRowsCorrectable, 0.0) + coalesce(RemappedRowsUncorrectable, 0.0)
| where isnotnull(RemappedRowsCorrectable) or isnotnull(RemappedRowsUncorrectable)
| summarize RemappedRows = max(Rows) - min(Rows) by Uuid, Computer, PhysicalHost;
union xids, remaps
| summarize Xids = coalesce(sum(Xids), 0), RemappedRows = coalesce(sum(RemappedRows), 0.0) by Uuid, Computer, PhysicalHost
| where Xids > 0 or RemappedRows > 0
| join kind=leftouter serials on Uuid
| extend Serial = iff(isempty(Serial), strcat("uuid ", Uuid), Serial)
"""
"""XIDs and rows remapped in the last 7 days per GPU (by serial) and VM placement (Computer, PhysicalHost):
a VM reallocated elsewhere leaves its rows behind under the old placement."""


def lemons() -> list[dict[str, Any]]:
    """GPUs and physical hosts that fail again after a VM reallocation, and GPUs whose memory wears (the same
    judgement as the gpumon-job-lemons rules of deploy/prometheus/job-rules.yaml, from the Log Analytics rows)."""
    gpus = FAULTS_BY_PLACEMENT + """| summarize Placements = dcount(strcat(Computer, "|", PhysicalHost)), VMs = make_set(Computer, 16),
    PhysicalHosts = make_set(PhysicalHost, 16), Xids = sum(Xids), RemappedRows = sum(RemappedRows) by Serial
| extend Lemon = Placements >= 2
| order by Lemon desc, Placements desc, Xids desc, RemappedRows desc
"""
    hosts = FAULTS_BY_PLACEMENT + """| where isnotempty(PhysicalHost)
| summarize VMs = dcount(Computer), VMNames = make_set(Computer, 16), Serials = make_set(Serial, 16),
    Xids = sum(Xids), RemappedRows = sum(RemappedRows) by PhysicalHost
| extend Lemon = VMs >= 2
| order by Lemon desc, VMs desc, Xids desc
"""
    remap_trend = f"""
GpuMonGpu_CL
| where TimeGenerated > ago(3d)
| where isnotnull(RemappedRowsCorrectable) or isnotnull(RemappedRowsUncorrectable)
| extend Remapped = coalesce(RemappedRowsCorrectable, 0.0) + coalesce(RemappedRowsUncorrectable, 0.0)
| make-series Rows = max(Remapped) default = real(null) on TimeGenerated from ago(3d) to now() step 1h
    by Computer, Uuid
| extend Rows = series_fill_forward(Rows)
| extend (RSquare, Slope, Variance, RVariance, Intercept, Fit) = series_fit_line(Rows)
| extend Now = todouble(Rows[array_length(Rows) - 1]), PerDay = Slope * 24
| extend In14Days = Now + PerDay * 14
| where PerDay > 0
| project Computer, Uuid, Now, PerDay, In14Days, OverBudget = In14Days >= {REMAP_BUDGET}
| order by In14Days desc
"""
    ecc_trend = """
GpuMonGpu_CL
| where TimeGenerated > ago(7d)
| make-series Corrected = sum(EccCorrectedErrorsIncrease) default = 0.0 on TimeGenerated from startofday(ago(7d))
    to now() step 1d by Computer, Uuid
| extend (RSquare, Slope, Variance, RVariance, Intercept, Fit) = series_fit_line(Corrected)
| extend LastDay = todouble(Corrected[array_length(Corrected) - 1])
| where Slope > 0
| project Computer, Uuid, LastDay, GrowthPerDay = Slope, RSquare
| order by GrowthPerDay desc
| take 50
"""
    return [
        text("lemons-title", "## Lemons and trends\nOver the last 7 days whatever the time range: GPUs (by serial) "
                             "and physical hosts with XIDs or remapped rows under two or more VM placements (they "
                             "fail again after the VM was reallocated), GPUs whose remapped rows (both causes) "
                             f"would pass {REMAP_BUDGET} within 14 days at the slope of the last 3 days, and GPUs "
                             "whose corrected ECC errors grow day by day. The Prometheus rules "
                             "(deploy/prometheus/job-rules.yaml) judge the same way."),
        query("lemons-gpus", "GPUs failing under several placements", gpus, "table", width="50"),
        query("lemons-hosts", "Physical hosts failing under several VMs", hosts, "table", width="50"),
        query("lemons-remap-trend", "Remapped rows, trend", remap_trend, "table", width="50"),
        query("lemons-ecc-trend", "Corrected ECC errors per day, growing", ecc_trend, "table", width="50"),
    ]


def workbook() -> dict[str, Any]:
    return {
        "version": "Notebook/1.0",
        "items": [
            text("title", "# gpumon\nGPU and InfiniBand health from gpumon's tables GpuMonGpu_CL, "
                          "GpuMonInfiniBand_CL and GpuMonEvents_CL. Pick the workspace, the time range and hosts."),
            parameters(),
            group("fleet", "Fleet", fleet()),
            group("gpus", "GPUs", gpus()),
            group("infiniband", "InfiniBand", infiniband()),
            group("events", "Events", events()),
            group("health", "Health", health()),
            group("placement", "Placement", placement()),
            group("scheduled", "Scheduled events", scheduled_events()),
            group("attribution", "Attribution", attribution()),
            group("lemons", "Lemons and trends", lemons()),
        ],
        "fallbackResourceIds": [],
        "$schema": "https://github.com/Microsoft/Application-Insights-Workbooks/blob/master/schema/workbook.json",
    }


def template(content: dict[str, Any]) -> dict[str, Any]:
    return {
        "$schema": "https://schema.management.azure.com/schemas/2019-04-01/deploymentTemplate.json#",
        "contentVersion": "1.0.0.0",
        "metadata": {"description": "The gpumon Workbook (GPU and InfiniBand health) over a Log Analytics "
                                    "workspace that receives gpumon's tables."},
        "parameters": {
            "workbookDisplayName": {"type": "string", "defaultValue": "gpumon",
                                    "metadata": {"description": "Name shown in the Workbooks gallery."}},
            "workspaceResourceId": {"type": "string", "metadata": {
                "description": "Resource ID of the Log Analytics workspace holding the GpuMon*_CL tables."}},
            "workbookId": {"type": "string", "defaultValue": "[newGuid()]",
                           "metadata": {"description": "Resource name (a GUID) of the Workbook; reuse it to update."}},
            "location": {"type": "string", "defaultValue": "[resourceGroup().location]"},
        },
        "variables": {
            # The workspace picker defaults to the workspace the Workbook is deployed for.
            "workbookContent": content,
        },
        "resources": [{
            "type": "Microsoft.Insights/workbooks",
            "apiVersion": "2022-04-01",
            "name": "[parameters('workbookId')]",
            "location": "[parameters('location')]",
            "kind": "shared",
            "properties": {
                "displayName": "[parameters('workbookDisplayName')]",
                "serializedData": "[replace(string(variables('workbookContent')), '__WORKSPACE__', "
                                  "parameters('workspaceResourceId'))]",
                "version": "1.0",
                "sourceId": "[parameters('workspaceResourceId')]",
                "category": "workbook",
            },
        }],
        "outputs": {"workbookId": {"type": "string", "value": "[resourceId('Microsoft.Insights/workbooks', "
                                                              "parameters('workbookId'))]"}},
    }


def deployed_content() -> dict[str, Any]:
    """The Workbook with its workspace parameter defaulting to the deployment's workspace."""
    content = json.loads(json.dumps(workbook()))
    for item in content["items"]:
        if item["type"] == 9:
            for p in item["content"]["parameters"]:
                if p["name"] == "Workspace":
                    p["value"] = "__WORKSPACE__"
    return content


FILES = {
    "gpumon-workbook.json": lambda: workbook(),
    "azuredeploy.json": lambda: template(deployed_content()),
}


def render(name: str) -> str:
    return json.dumps(FILES[name](), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file differs")
    args = parser.parse_args(argv)
    outputs = {os.path.join(HERE, name): render(name) for name in FILES}
    return sync(outputs, args.check, "python dashboards/azure-workbook/generate.py")


if __name__ == "__main__":
    sys.exit(main())

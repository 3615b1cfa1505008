#!/usr/bin/env python3
"""Writes the Grafana dashboards (fleet, node, InfiniBand fabric, job) as importable JSON.

    python dashboards/grafana/generate.py           # rewrite the four JSON files
    python dashboards/grafana/generate.py --check   # exit 1 if a committed file is stale

The dashboards are built from code so that every panel gets the same data source variable, the same
label filters and a unit, and so that the tests can walk one structure. Panels read gpumon's metrics
and the recording rules of deploy/prometheus/recording-rules.yaml (load those rules too).
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

DS = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
UIDS = {"fleet": "gpumon-fleet", "node": "gpumon-node", "fabric": "gpumon-ib-fabric", "job": "gpumon-job"}
TAGS = ["gpumon", "gpu", "infiniband"]
INPUT = "DS_PROMETHEUS"
"""The data source Grafana's import asks for (``__inputs``); it becomes the ``datasource`` variable's
default, and the panels keep reading the variable, so it can still be switched afterwards."""
PANEL_NAMES = {"bargauge": "Bar gauge", "heatmap": "Heatmap", "stat": "Stat", "state-timeline": "State timeline",
               "status-history": "Status history", "table": "Table", "timeseries": "Time series"}
"""The names of the core panel plugins the dashboards use, as ``__requires`` lists them."""

# Data links: from a row of a table to the node dashboard of that host, keeping data source and time.
NODE_LINK = {
    "title": "Node dashboard for ${__data.fields.instance}",
    "url": "/d/" + UIDS["node"] + "/gpumon-node?var-instance=${__data.fields.instance}"
           "&${datasource:queryparam}&${cluster:queryparam}&${__url_time_range}",
}
FABRIC_LINK = {
    "title": "InfiniBand fabric",
    "url": "/d/" + UIDS["fabric"] + "/gpumon-infiniband-fabric?${datasource:queryparam}&${cluster:queryparam}"
           "&${__url_time_range}",
}

JOB_LINK = {
    "title": "Job dashboard for ${__data.fields.pod}${__data.fields.job_id}",
    "url": "/d/" + UIDS["job"] + "/gpumon-job?var-job_id=${__data.fields.job_id}&var-pod=${__data.fields.pod}"
           "&${datasource:queryparam}&${cluster:queryparam}&${__url_time_range}",
}
"""From an allocation to the job dashboard: a pod's row has an empty job_id and a job's an empty pod, and
an empty value selects exactly the allocations without it, so the link shows that pod or that job."""
HEALTH_MAPPINGS = [{"type": "value", "options": {
    "0": {"text": "healthy", "color": "green", "index": 0},
    "1": {"text": "degraded", "color": "orange", "index": 1},
    "2": {"text": "unhealthy", "color": "red", "index": 2},
}}]
FABRIC_STATE_MAPPINGS = [{"type": "value", "options": {
    "0": {"text": "not supported", "color": "transparent", "index": 0},
    "1": {"text": "not started", "color": "red", "index": 1},
    "2": {"text": "in progress", "color": "orange", "index": 2},
    "3": {"text": "completed", "color": "green", "index": 3},
}}]
CONDITION_MAPPINGS = [{"type": "value", "options": {
    "0": {"text": "-", "color": "green", "index": 0},
    "1": {"text": "holds", "color": "red", "index": 1},
}}]
HOST_JOIN = "on (cluster, job, instance)"
GPU_JOIN = "on (cluster, job, instance, gpu)"
"""Joins of a series with gpumon_gpu_allocation_info: by host, or by GPU (the target's labels and the index)."""
UTIL = 'gpumon_gpu_utilization_ratio{engine="gpu"}'
IB_STATE_MAPPINGS = [{"type": "value", "options": {
    "1": {"text": "DOWN", "color": "red", "index": 0},
    "2": {"text": "INIT", "color": "orange", "index": 1},
    "3": {"text": "ARMED", "color": "yellow", "index": 2},
    "4": {"text": "ACTIVE", "color": "green", "index": 3},
    "5": {"text": "ACTIVE_DEFER", "color": "blue", "index": 4},
}}]
IB_PHYS_MAPPINGS = [{"type": "value", "options": {
    "1": {"text": "Sleep", "color": "red", "index": 0},
    "2": {"text": "Polling", "color": "red", "index": 1},
    "3": {"text": "Disabled", "color": "red", "index": 2},
    "4": {"text": "Training", "color": "orange", "index": 3},
    "5": {"text": "LinkUp", "color": "green", "index": 4},
    "6": {"text": "ErrorRecovery", "color": "orange", "index": 5},
    "7": {"text": "PhyTest", "color": "purple", "index": 6},
}}]
ON_OFF_MAPPINGS = [{"type": "value", "options": {
    "0": {"text": "-", "color": "transparent", "index": 0},
    "1": {"text": "active", "color": "orange", "index": 1},
}}]
THROTTLE_REASONS = "sw_power_cap|sw_thermal_slowdown|hw_thermal_slowdown|hw_slowdown|hw_power_brake_slowdown"
"""Clock-event reason bits (gpumon_gpu_clock_event_reason_active) that mean throttling; every driver has them."""
VIOLATION_REASONS = ("sw_power_cap|thermal|board_limit|reliability"
                     "|sw_thermal_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown")
"""Violation counters (gpumon_gpu_clock_event_violation_seconds_total) that mean throttling. The first four
are there on every driver; the last three only from R580. They overlap in time (`thermal` covers the
thermal slowdowns), so a panel never adds them: it shows each, or the largest."""
ERROR_COUNTERS = (
    ("symbol_errors", "symbol errors"),
    ("link_error_recoveries", "link error recoveries"),
    ("receive_errors", "receive errors"),
    ("transmit_discards", "transmit discards"),
    ("receive_remote_physical_errors", "remote physical errors"),
)
CONGESTION_HW = ("out_of_sequence|local_ack_timeout_err|out_of_buffer|packet_seq_err|np_ecn_marked_roce_packets"
                 "|np_cnp_sent|rp_cnp_handled|roce_adp_retrans|req_transport_retries_exceeded")


def xids_in_range(sel: str) -> str:
    """XIDs counted in the dashboard range. The XID counter is born with the first XID, so a series
    that did not exist at the start of the range counts whole (increase() would miss its first one)."""
    metric = f"gpumon_gpu_xid_errors_total{{{sel}}}"
    return f"(increase({metric}[$__range]) and {metric} offset $__range) or {metric}"


# ----------------------------------------------------------------------------------------- building


class Board:
    """Lays panels out left to right, 24 columns wide, and numbers them."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "id": len(self.panels) + 1, "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def target(expr: str, legend: str = "", *, instant: bool = False, table: bool = False,
           ref: str = "A") -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "refId": ref, "expr": expr, "editorMode": "code",
                         "range": not instant, "instant": instant}
    if legend:
        t["legendFormat"] = legend
    if table:
        t["format"] = "table"
    return t


def refs(targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return targets


def panel(kind: str, title: str, targets: list[dict[str, Any]], unit: str, *, description: str = "",
          minimum: float | None = None, maximum: float | None = None, decimals: int | None = None,
          thresholds: list[tuple[float | None, str]] | None = None, mappings: list[dict[str, Any]] | None = None,
          options: dict[str, Any] | None = None, custom: dict[str, Any] | None = None,
          links: list[dict[str, Any]] | None = None, color: dict[str, Any] | None = None,
          transformations: list[dict[str, Any]] | None = None,
          overrides: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if decimals is not None:
        defaults["decimals"] = decimals
    steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])]
    defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    if mappings:
        defaults["mappings"] = mappings
    if links:
        defaults["links"] = links
    if color:
        defaults["color"] = color
    if custom:
        defaults["custom"] = custom
    p: dict[str, Any] = {
        "type": kind, "title": title, "datasource": DS, "targets": refs(targets),
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options or {},
    }
    if description:
        p["description"] = description
    if transformations:
        p["transformations"] = transformations
    return p


def stat(title: str, expr: str, unit: str, *, description: str = "", bad_above: float | None = None,
         decimals: int | None = 0, links: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    thresholds = [(None, "green")] if bad_above is None else [(None, "green"), (bad_above, "red")]
    return panel("stat", title, [target(expr, instant=True)], unit, description=description,
                 decimals=decimals, thresholds=thresholds, links=links,
                 options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "background" if bad_above is not None else "value",
                          "graphMode": "none", "textMode": "value"})


def timeseries(title: str, targets: list[dict[str, Any]], unit: str, *, description: str = "",
               minimum: float | None = None, maximum: float | None = None, stack: bool = False,
               bars: bool = False, overrides: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "bars" if bars else "line", "lineWidth": 1,
                              "fillOpacity": 60 if bars else 10, "showPoints": "never",
                              "spanNulls": False}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return panel("timeseries", title, targets, unit, description=description, minimum=minimum,
                 maximum=maximum, custom=custom, overrides=overrides,
                 options={"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                          "tooltip": {"mode": "multi", "sort": "desc"}})


def table(title: str, targets: list[dict[str, Any]], unit: str, *, description: str = "",
          hide: tuple[str, ...] = ("Time", "__name__", "job", "uuid"), rename: dict[str, str] | None = None,
          links: list[dict[str, Any]] | None = None, mappings: list[dict[str, Any]] | None = None,
          thresholds: list[tuple[float | None, str]] | None = None, sort: str | None = None,
          overrides: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    for t in targets:
        t.update({"instant": True, "range": False, "format": "table"})
    transformations: list[dict[str, Any]] = []
    if len(targets) > 1:
        transformations.append({"id": "merge", "options": {}})
    organize: dict[str, Any] = {"excludeByName": dict.fromkeys(hide, True), "renameByName": rename or {}}
    transformations.append({"id": "organize", "options": organize})
    options: dict[str, Any] = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    if sort:
        options["sortBy"] = [{"displayName": sort, "desc": True}]
    return panel("table", title, targets, unit, description=description, links=links, mappings=mappings,
                 thresholds=thresholds, options=options, transformations=transformations,
                 overrides=overrides, custom={"align": "auto", "cellOptions": {"type": "auto"}})


def field_unit(name: str, unit: str, **more: Any) -> dict[str, Any]:
    """An override giving one table column (by display name) its own unit and settings."""
    props = [{"id": "unit", "value": unit}] + [{"id": k, "value": v} for k, v in more.items()]
    return {"matcher": {"id": "byName", "options": name}, "properties": props}


def status_history(title: str, targets: list[dict[str, Any]], unit: str, *, description: str = "",
                   minimum: float | None = None, maximum: float | None = None,
                   mappings: list[dict[str, Any]] | None = None, kind: str = "status-history",
                   continuous: bool = True) -> dict[str, Any]:
    color = {"mode": "continuous-GrYlRd"} if continuous else {"mode": "thresholds"}
    return panel(kind, title, targets, unit, description=description, minimum=minimum, maximum=maximum,
                 mappings=mappings, color=color,
                 options={"showValue": "never", "rowHeight": 0.9, "legend": {"showLegend": False},
                          "tooltip": {"mode": "single"}})


def heatmap(title: str, expr: str, unit: str, *, description: str = "") -> dict[str, Any]:
    """A distribution over time: Grafana buckets the series' values itself."""
    return panel("heatmap", title, [target(expr)], unit, description=description,
                 options={"calculate": True, "calculation": {"yBuckets": {"mode": "count", "value": "20"}},
                          "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                          "yAxis": {"unit": unit}, "cellGap": 1, "tooltip": {"show": True, "yHistogram": True},
                          "legend": {"show": True}})


def bargauge(title: str, expr: str, unit: str, legend: str, *, description: str = "",
             maximum: float | None = None, links: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return panel("bargauge", title, [target(expr, legend, instant=True)], unit, description=description,
                 minimum=0, maximum=maximum, links=links,
                 thresholds=[(None, "green"), (0.8 * maximum if maximum else 1, "orange")],
                 options={"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                          "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}})


# ----------------------------------------------------------------------------------------- variables


def var_datasource() -> dict[str, Any]:
    # Import replaces ${DS_PROMETHEUS} with the data source picked; loaded without import (provisioning),
    # the name matches no data source and Grafana picks a Prometheus one itself.
    return {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
            "current": {"selected": False, "text": "${" + INPUT + "}", "value": "${" + INPUT + "}"},
            "hide": 0, "refresh": 1, "regex": "", "options": []}


def panel_types(panels: list[dict[str, Any]]) -> set[str]:
    return {t for p in panels for t in ({p["type"]} | panel_types(p.get("panels", [])))}


def var_query(name: str, label: str, definition: str, *, multi: bool, include_all: bool,
              all_value: str | None = ".*") -> dict[str, Any]:
    v: dict[str, Any] = {
        "type": "query", "name": name, "label": label, "datasource": DS,
        "definition": definition,
        "query": {"qryType": 1, "query": definition, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2, "sort": 3 if name in ("gpu",) else 1, "multi": multi, "includeAll": include_all,
        "current": {}, "options": [], "hide": 0, "regex": "",
    }
    if include_all and all_value is not None:
        v["allValue"] = all_value
    return v


def var_cluster() -> dict[str, Any]:
    # Azure Managed Prometheus adds `cluster`; a plain Prometheus has none, and then All (.*) matches all.
    return var_query("cluster", "Cluster", "label_values(gpumon_build_info, cluster)", multi=True, include_all=True)


def var_instance(multi: bool) -> dict[str, Any]:
    return var_query("instance", "Host", 'label_values(gpumon_build_info{cluster=~"$cluster"}, instance)',
                     multi=multi, include_all=multi)


def var_gpu() -> dict[str, Any]:
    return var_query("gpu", "GPU", 'label_values(gpumon_gpu_info{cluster=~"$cluster", instance=~"$instance"}, gpu)',
                     multi=True, include_all=True)


def var_device() -> dict[str, Any]:
    return var_query("device", "IB device",
                     'label_values(gpumon_ib_port_info{cluster=~"$cluster", instance=~"$instance"}, device)',
                     multi=True, include_all=True)


def var_job_id(host_filter: bool) -> dict[str, Any]:
    sel = 'cluster=~"$cluster", instance=~"$instance"' if host_filter else 'cluster=~"$cluster"'
    v = var_query("job_id", "Job", f"label_values(gpumon_gpu_allocation_info{{{sel}}}, job_id)",
                  multi=True, include_all=True)
    v["description"] = "A batch job holding GPUs (gpumon_gpu_allocation_info job_id: Slurm job id, job mapping)."
    return v


def var_pod(host_filter: bool) -> dict[str, Any]:
    sel = 'cluster=~"$cluster", instance=~"$instance"' if host_filter else 'cluster=~"$cluster"'
    v = var_query("pod", "Pod", f"label_values(gpumon_gpu_allocation_info{{{sel}}}, pod)", multi=True,
                  include_all=True)
    v["description"] = "A Kubernetes pod holding GPUs (gpumon_gpu_allocation_info pod)."
    return v


def allocations(host: str) -> str:
    """The GPU allocations the job and pod variables select (All: every allocation)."""
    return f'gpumon_gpu_allocation_info{{{host}, job_id=~"$job_id", pod=~"$pod"}}'


def per_allocation(alloc: str, metric: str) -> str:
    """A per-GPU series (one per GPU) for each selected allocation, carrying the allocation's labels.
    The allocation is on the left, so two pods sharing a GPU (MIG) each get the GPU's value."""
    return f"{alloc} * {GPU_JOIN} group_left () {metric}"


def dashboard(key: str, title: str, description: str, board: Board, variables: list[dict[str, Any]],
              links: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "__inputs": [{"name": INPUT, "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus",
                      "description": "The Prometheus (or Azure Monitor workspace) holding gpumon's metrics"}],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": t, "name": PANEL_NAMES[t], "version": ""}
              for t in sorted(panel_types(board.panels) - {"row"})),
        ],
        "id": None, "uid": UIDS[key], "title": title, "description": description, "tags": [*TAGS, key],
        "editable": True, "graphTooltip": 1, "timezone": "browser", "refresh": "1m",
        "time": {"from": "now-6h", "to": "now"}, "timepicker": {},
        "schemaVersion": SCHEMA_VERSION, "version": 1, "fiscalYearStartMonth": 0, "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "templating": {"list": variables},
        "links": links,
        "panels": board.panels,
    }


def dash_links(*keys: str) -> list[dict[str, Any]]:
    titles = {"fleet": "Fleet", "node": "Node", "fabric": "InfiniBand fabric", "job": "Job"}
    return [{"title": titles[k], "type": "link", "url": f"/d/{UIDS[k]}", "icon": "dashboard",
             "includeVars": False, "keepTime": True, "targetBlank": False, "tooltip": "", "tags": [],
             "asDropdown": False} for k in keys]


# ----------------------------------------------------------------------------------------- fleet


def fleet() -> dict[str, Any]:
    sel = 'cluster=~"$cluster", instance=~"$instance"'
    b = Board()
    b.row("Overview")
    for title, expr, unit, bad, desc in (
        ("Hosts reporting", f"count(gpumon_build_info{{{sel}}})", "none", None, "gpumon daemons scraped now."),
        ("Hosts down", f'count(up{{job=~"gpumon.*", {sel}}} == 0) or vector(0)', "none", 1,
         "Scrape targets of the gpumon job that fail to answer."),
        ("GPUs reporting", f"count(gpumon_gpu_info{{{sel}}})", "none", None, "GPUs with an identity series."),
        ("GPUs lost", f"sum(gpumon_gpu_lost{{{sel}}})", "none", 1, "GPUs NVML reports lost (fallen off the bus)."),
        ("Collectors down", f"count(gpumon_collector_up{{{sel}}} == 0) or vector(0)", "none", 1,
         "gpumon collectors failing or hung, all hosts together."),
        ("XIDs in range", f"sum({xids_in_range(sel)}) or vector(0)", "none", 1,
         "XID errors reported by the driver within the dashboard's time range."),
        ("IB flaps in range", f"sum(increase(gpumon_ib_link_flaps_total{{{sel}}}[$__range]))", "none", 1,
         "InfiniBand link flaps within the time range."),
        ("IB ports down", f"count(gpumon_ib_port_up{{{sel}}} == 0) or vector(0)", "none", 1,
         "Ports not ACTIVE/LinkUp now."),
        ("IB ports flapping", f"sum(gpumon_ib_port_flapping{{{sel}}})", "none", 1,
         "Ports over the flap threshold (default 5 flaps in 24 h)."),
    ):
        b.add(stat(title, expr, unit, description=desc, bad_above=bad), 3 if title != "IB ports flapping" else 3, 4)
    b.add(stat("Mean GPU utilization", f"avg(instance:gpumon_gpu_utilization:avg{{{sel}}})", "percentunit",
               decimals=1, description="Mean of every GPU's utilization (recording rule)."), 3, 4)
    b.add(stat("GPU power", f"sum(instance:gpumon_gpu_power_watts:sum{{{sel}}})", "watt", decimals=1,
               description="Power drawn by all GPUs together."), 3, 4)
    b.add(stat("IB throughput", f"sum(port:gpumon_ib_receive_bytes:rate5m{{{sel}}})"
               f" + sum(port:gpumon_ib_transmit_bytes:rate5m{{{sel}}})", "Bps", decimals=1,
               description="Received plus transmitted bytes per second, all ports (5 min rate)."), 3, 4)

    b.row("GPUs")
    b.add(status_history("GPU utilization across the fleet",
                         [target(f'gpumon_gpu_utilization_ratio{{{sel}, engine="gpu"}}', "{{instance}} GPU {{gpu}}")],
                         "percentunit", minimum=0, maximum=1,
                         description="One row per GPU: a cold (idle) or hot (busy) streak shows at a glance."),
          24, 10)
    b.add(heatmap("GPU power distribution", f"gpumon_gpu_power_watts{{{sel}}}", "watt",
                  description="How many GPUs draw how much power, over time."), 12, 8)
    b.add(heatmap("GPU temperature distribution", f'gpumon_gpu_temperature_celsius{{{sel}, sensor="gpu"}}',
                  "celsius", description="How many GPUs run how hot, over time."), 12, 8)
    b.add(bargauge("Hottest GPUs", f'topk(10, gpumon_gpu_temperature_celsius{{{sel}, sensor="gpu"}})', "celsius",
                   "{{instance}} GPU {{gpu}}", maximum=95, links=[NODE_LINK],
                   description="The ten hottest GPUs now (core sensor)."), 8, 9)
    b.add(bargauge("Most throttled GPUs",
                   f"topk(10, max by (instance, gpu) (rate(gpumon_gpu_clock_event_violation_seconds_total"
                   f'{{{sel}, reason=~"{VIOLATION_REASONS}"}}'
                   f"[$__range])))", "percentunit", "{{instance}} GPU {{gpu}}", maximum=1, links=[NODE_LINK],
                   description="Share of the time range each GPU's clocks were held down, by the reason that held "
                               "them longest: power cap, thermal, board limit or reliability (NVML violation "
                               "counters; R580 drivers add thermal slowdown and power brake). The reasons overlap "
                               "in time, so they are not added up."), 8, 9)
    b.add(bargauge("Highest power draw vs limit", f"topk(10, gpu:gpumon_power_limit:ratio{{{sel}}})", "percentunit",
                   "{{instance}} GPU {{gpu}}", maximum=1, links=[NODE_LINK],
                   description="Power draw over the enforced power limit (recording rule)."), 8, 9)

    b.row("InfiniBand")
    b.add(timeseries("Fabric throughput", [
        target(f"sum(port:gpumon_ib_receive_bytes:rate5m{{{sel}}})", "received"),
        target(f"sum(port:gpumon_ib_transmit_bytes:rate5m{{{sel}}})", "transmitted"),
    ], "Bps", minimum=0, description="All InfiniBand/RoCE ports of the selected hosts (5 min rate)."), 12, 8)
    b.add(table("Ports down or flapping", [
        target(f"gpumon_ib_port_down_seconds{{{sel}}} > 0 or gpumon_ib_port_flaps_in_window{{{sel}}} > 0"
               f" or gpumon_ib_port_flapping{{{sel}}} == 1"),
    ], "none", hide=("Time", "__name__", "job"), rename={"Value": "down s / flaps"},
        links=[NODE_LINK, FABRIC_LINK], thresholds=[(None, "orange")],
        description="Ports down now (value: seconds down) or with flaps in the flap window (value: flaps)."),
        12, 8)
    b.add(bargauge("Flaps in range by host",
                   f"topk(10, sum by (instance) (increase(gpumon_ib_link_flaps_total{{{sel}}}[$__range])))",
                   "none", "{{instance}}", maximum=10, links=[NODE_LINK],
                   description="Hosts with the most link flaps in the time range."), 12, 8)
    b.add(bargauge("Highest port error rates",
                   f"topk(10, port:gpumon_ib_errors:rate5m{{{sel}}})", "cps", "{{instance}} {{device}}/{{port}}",
                   maximum=1, links=[NODE_LINK],
                   description="Symbol, receive, recovery and discard errors per second (recording rule)."), 12, 8)

    fleet_health(b, sel)
    fleet_workloads(b, sel)
    fleet_placement(b, sel)
    fleet_hardware(b, sel)

    b.row("Hosts")
    b.add(table("Hosts", [
        target(f"instance:gpumon_gpu_utilization:avg{{{sel}}}"),
        target(f"instance:gpumon_gpu_power_watts:sum{{{sel}}}"),
        target(f"count by (cluster, instance, job) (gpumon_gpu_info{{{sel}}})"),
        target(f"sum by (cluster, instance, job) (gpumon_ib_port_up{{{sel}}})"),
        target(f"sum by (cluster, instance, job) (gpumon_gpu_lost{{{sel}}})"),
    ], "none", hide=("Time", "job"),
        rename={"Value #A": "GPU utilization", "Value #B": "GPU power", "Value #C": "GPUs",
                "Value #D": "IB ports up", "Value #E": "GPUs lost"},
        links=[NODE_LINK], sort="GPU utilization",
        overrides=[field_unit("GPU utilization", "percentunit"), field_unit("GPU power", "watt")],
        description="One row per host; click a host for its node dashboard."), 24, 8)

    return dashboard("fleet", "gpumon / Fleet",
                     "GPU and InfiniBand health of every host running gpumon.", b,
                     [var_datasource(), var_cluster(), var_instance(multi=True), var_job_id(True), var_pod(True)],
                     dash_links("node", "fabric", "job"))


def fleet_health(b: Board, sel: str) -> None:
    b.row("Health")
    b.add(stat("Hosts unhealthy", f"count(gpumon_node_health{{{sel}}} == 2) or vector(0)", "none", bad_above=1,
               description="Hosts whose health verdict is unhealthy (gpumon_node_health 2): drain or repair."), 4, 4)
    b.add(stat("Hosts degraded", f"count(gpumon_node_health{{{sel}}} == 1) or vector(0)", "none", bad_above=1,
               description="Hosts whose verdict is degraded (1): still running, repair at the next drain."), 4, 4)
    b.add(bargauge("Failing rules across the fleet", f"count by (rule) (gpumon_health_state{{{sel}}} > 0)", "none",
                   "{{rule}}", maximum=None,
                   description="How many GPUs, ports or hosts each health rule finds degraded or unhealthy now."),
          16, 8)
    b.add(status_history("Node health", [target(f"gpumon_node_health{{{sel}}}", "{{instance}}")], "none",
                         mappings=HEALTH_MAPPINGS, kind="state-timeline", continuous=False,
                         description="Each host's verdict over time: healthy, degraded, unhealthy."), 12, 9)
    b.add(table("Failing health rules", [target(f"gpumon_health_state{{{sel}}} > 0")], "none",
                rename={"Value": "verdict"}, links=[NODE_LINK], sort="verdict",
                overrides=[{"matcher": {"id": "byName", "options": "verdict"}, "properties": [
                    {"id": "mappings", "value": HEALTH_MAPPINGS},
                    {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}],
                description="Each rule failing now, with the GPU (gpu) or port (device, port) it judges; "
                            "`gpumon health` on the host says why and since when."), 12, 9)


def fleet_workloads(b: Board, sel: str) -> None:
    alloc = allocations(sel)
    b.row("Workloads")
    b.add(table("GPU allocations", [
        target(per_allocation(alloc, UTIL)),
    ], "percentunit", rename={"Value": "GPU utilization"}, sort="GPU utilization", links=[JOB_LINK, NODE_LINK],
        hide=("Time", "__name__", "job", "uuid", "cluster"),
        description="The GPUs each pod or job holds (gpumon_gpu_allocation_info, filtered by the Job and Pod "
                    "variables) and how busy they are; click for the job dashboard."), 12, 9)
    b.add(timeseries("GPU utilization by workload", [
        target(f"avg by (namespace, pod, job_id) ({per_allocation(alloc, UTIL)})",
               "{{namespace}}/{{pod}} {{job_id}}"),
    ], "percentunit", minimum=0, maximum=1, description="Mean utilization of each pod's or job's GPUs."), 12, 9)
    b.add(stat("Hosts with pending maintenance",
               f"count(count by (cluster, job, instance) (gpumon_azure_scheduled_event{{{sel}}} > 0)) or vector(0)",
               "none", bad_above=1, description="Hosts with an Azure Scheduled Event (Freeze, Reboot, Redeploy, "
                                                "Preempt, Terminate) scheduled or started."), 4, 8)
    b.add(table("Pending Azure scheduled events", [
        target(f"gpumon_azure_scheduled_event{{{sel}}} > 0"),
    ], "none", rename={"Value": "events"}, links=[NODE_LINK],
        description="Scheduled Events from IMDS by type, source and status (collector azure_events)."), 10, 8)
    b.add(table("Workloads on hosts with pending maintenance", [
        target(f"{alloc} * {HOST_JOIN} group_left () "
               f"count by (cluster, job, instance) (gpumon_azure_scheduled_event{{{sel}}} > 0)"),
    ], "none", rename={"Value": "pending events"}, links=[JOB_LINK, NODE_LINK],
        hide=("Time", "__name__", "job", "uuid", "cluster"),
        description="The pods and jobs whose GPUs sit on a host the platform is about to freeze, reboot or "
                    "take away: checkpoint or move them."), 10, 8)


def fleet_placement(b: Board, sel: str) -> None:
    b.row("Placement")
    b.add(timeseries("Link flaps by placement group", [
        target(f"sum by (placement_group) (instance:gpumon_ib_link_flaps:rate5m{{{sel}}})", "{{placement_group}}"),
    ], "cps", minimum=0, description="InfiniBand link flaps per second summed by placement group (one "
                                      "InfiniBand fabric): a bad switch shows as one group rising."), 12, 8)
    b.add(timeseries("XIDs by physical host", [
        target(f"sum by (physical_host) (instance:gpumon_gpu_xid_errors:rate5m{{{sel}}})", "{{physical_host}}"),
    ], "cps", minimum=0, description="XID errors per second summed by the physical host under the VMs (Hyper-V "
                                      "KVP): a bad host shows as one line rising."), 12, 8)
    b.add(timeseries("Unhealthy hosts by placement group", [
        target(f"sum by (placement_group) (instance:gpumon_node_health:max{{{sel}}} == bool 2)",
               "{{placement_group}}"),
    ], "none", minimum=0, stack=True, description="Hosts judged unhealthy, by placement group."), 12, 8)
    b.add(status_history("Health by physical host", [
        target(f"max by (physical_host) (instance:gpumon_node_health:max{{{sel}}})", "{{physical_host}}"),
    ], "none", mappings=HEALTH_MAPPINGS, kind="state-timeline", continuous=False,
        description="The worst verdict of the VMs on each physical host over time."), 12, 8)
    b.add(table("Hosts by placement", [
        target(f"gpumon_host_info{{{sel}}}"),
        target(f"max by (cluster, job, instance) (gpumon_node_health{{{sel}}})"),
        target(f"sum by (cluster, job, instance) (increase(gpumon_ib_link_flaps_total{{{sel}}}[$__range]))"),
    ], "none", hide=("Time", "__name__", "job", "Value #A"),
        rename={"Value #B": "health", "Value #C": "flaps in range"}, links=[NODE_LINK], sort="health",
        overrides=[{"matcher": {"id": "byName", "options": "health"}, "properties": [
            {"id": "mappings", "value": HEALTH_MAPPINGS},
            {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}],
        description="Each host's Azure size, region, zone, scale set, placement group, fault domain and physical "
                    "host (gpumon_host_info) beside its verdict and flaps."), 24, 8)


def fleet_hardware(b: Board, sel: str) -> None:
    b.row("NVLink fabric, PCIe and power")
    b.add(stat("GPUs not on the NVLink fabric", f"count(gpumon_gpu_fabric_state{{{sel}}} != 3) or vector(0)", "none",
               bad_above=1, description="GPUs whose fabric registration is not completed (Hopper with NVSwitch, "
                                        "GB200)."), 4, 8)
    b.add(table("NVLink domains", [
        target(f"count by (cluster_uuid, clique_id) (gpumon_gpu_fabric_info{{{sel}}})"),
    ], "none", rename={"Value": "GPUs"},
        description="GPUs per NVLink domain (cluster UUID and clique): GB200 racks."), 8, 8)
    b.add(bargauge("Widest power swings", f"topk(10, gpu:gpumon_power_swing:ratio{{{sel}}})", "percentunit",
                   "{{instance}} GPU {{gpu}}", maximum=1, links=[NODE_LINK],
                   description="Highest minus lowest power sample within one gpumon run over the power limit "
                               "(recording rule)."), 12, 8)
    b.add(timeseries("PCIe AER errors", [
        target(f'sum by (instance, severity) (rate(gpumon_pcie_aer_errors_total{{{sel}}}[$__rate_interval]))',
               "{{instance}} {{severity}}"),
    ], "cps", minimum=0, description="PCIe Advanced Error Reporting: correctable, non-fatal and fatal errors of "
                                      "the GPUs, HCAs and bridges above them, per second."), 12, 8)
    b.add(timeseries("Kernel log", [
        target(f"sum by (instance, kind) (rate(gpumon_kmsg_records_total{{{sel}}}[$__rate_interval]))",
               "{{instance}} {{kind}}"),
        target(f"sum by (instance) (rate(gpumon_kmsg_lost_records_total{{{sel}}}[$__rate_interval]))",
               "{{instance}} lost"),
    ], "cps", minimum=0, description="Kernel log records per second by the driver message recognised (XID, SXID, "
                                      "mlx5, link up/down), and records the ring buffer lost before gpumon read "
                                      "them."), 12, 8)


# ----------------------------------------------------------------------------------------- node


def node() -> dict[str, Any]:
    host = 'cluster=~"$cluster", instance=~"$instance"'
    sel = f'{host}, gpu=~"$gpu"'
    ib = f'{host}, device=~"$device"'
    b = Board()
    b.row("Host")
    b.add(stat("GPUs", f"count(gpumon_gpu_info{{{host}}})", "none"), 3, 4)
    b.add(stat("GPUs lost", f"sum(gpumon_gpu_lost{{{host}}})", "none", bad_above=1), 3, 4)
    b.add(stat("Collectors down", f"count(gpumon_collector_up{{{host}}} == 0) or vector(0)", "none", bad_above=1), 3, 4)
    b.add(stat("IB ports up", f"sum(gpumon_ib_port_up{{{host}}})", "none"), 3, 4)
    b.add(stat("XIDs in range", f"sum({xids_in_range(host)}) or vector(0)", "none", bad_above=1), 3, 4)
    b.add(stat("IB flaps in range", f"sum(increase(gpumon_ib_link_flaps_total{{{host}}}[$__range]))", "none",
               bad_above=1), 3, 4)
    b.add(table("Identity", [target(f"gpumon_gpu_info{{{host}}}")], "none",
                hide=("Time", "__name__", "job", "Value", "cluster", "instance"),
                description="Model, driver, VBIOS and serial of each GPU (gpumon_gpu_info)."), 6, 4)
    node_health(b, host)

    b.row("GPUs")
    b.add(timeseries("GPU utilization", [
        target(f'gpumon_gpu_utilization_ratio{{{sel}, engine="gpu"}}', "GPU {{gpu}}"),
    ], "percentunit", minimum=0, maximum=1, description="Share of time a kernel was running."), 8, 8)
    b.add(timeseries("SM and tensor activity", [
        target(f'gpumon_gpu_activity_ratio{{{sel}, activity=~"sm|tensor"}}', "GPU {{gpu}} {{activity}}"),
    ], "percentunit", minimum=0, maximum=1, description="Profiling activity (GPM/DCP): how busy the SMs and "
                                                        "tensor cores really are."), 8, 8)
    b.add(timeseries("Memory used", [
        target(f"gpumon_gpu_memory_used_bytes{{{sel}}}", "GPU {{gpu}} used"),
        target(f"max(gpumon_gpu_memory_total_bytes{{{sel}}})", "total"),
    ], "bytes", minimum=0, overrides=[{"matcher": {"id": "byName", "options": "total"}, "properties": [
        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]}]), 8, 8)
    b.add(timeseries("Power vs limit", [
        target(f"gpumon_gpu_power_watts{{{sel}}}", "GPU {{gpu}}"),
        target(f"max(gpumon_gpu_power_limit_watts{{{sel}}})", "limit"),
    ], "watt", minimum=0, overrides=[{"matcher": {"id": "byName", "options": "limit"}, "properties": [
        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}, {"id": "color", "value": {
            "mode": "fixed", "fixedColor": "red"}}]}]), 8, 8)
    b.add(timeseries("Temperatures", [
        target(f"gpumon_gpu_temperature_celsius{{{sel}}}", "GPU {{gpu}} {{sensor}}"),
        target(f'min(gpumon_gpu_temperature_threshold_celsius{{{sel}, threshold="slowdown"}})', "slowdown"),
    ], "celsius", description="Core and memory (HBM) temperature; dashed: the slowdown threshold.",
        overrides=[{"matcher": {"id": "byName", "options": "slowdown"}, "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}]), 8, 8)
    b.add(timeseries("Clocks", [
        target(f'gpumon_gpu_clock_hertz{{{sel}, clock=~"sm|memory"}}', "GPU {{gpu}} {{clock}}"),
    ], "hertz", minimum=0), 8, 8)
    b.add(status_history("Clock event reasons", [
        target(f'gpumon_gpu_clock_event_reason_active{{{sel}, reason=~"{THROTTLE_REASONS}"}}',
               "GPU {{gpu}} {{reason}}"),
    ], "none", mappings=ON_OFF_MAPPINGS, kind="state-timeline", continuous=False,
        description="Why clocks are held below maximum: power cap, thermal or hardware slowdown."), 12, 8)
    b.add(timeseries("Time throttled", [
        target(f'rate(gpumon_gpu_clock_event_violation_seconds_total{{{sel}, reason=~"{VIOLATION_REASONS}"}}'
               "[$__rate_interval])", "GPU {{gpu}} {{reason}}"),
    ], "percentunit", minimum=0,
        description="Share of time spent throttled, per reason, from NVML's violation counters: power cap, "
                    "thermal, board limit, reliability (every driver); sw/hw thermal slowdown and power brake "
                    "(R580+). The reasons overlap: do not add the lines."),
        12, 8)
    b.add(table("ECC and row remapping", [
        target(f'sum by (gpu) (gpumon_gpu_ecc_errors_total{{{sel}, type="corrected", counter="aggregate"}})'),
        target(f'sum by (gpu) (gpumon_gpu_ecc_errors_total{{{sel}, type="uncorrected", counter="aggregate"}})'),
        target(f"sum by (gpu) (gpumon_gpu_remapped_rows{{{sel}}})"),
        target(f"max by (gpu) (gpumon_gpu_remapped_rows_pending{{{sel}}})"),
        target(f"max by (gpu) (gpumon_gpu_remapped_rows_failure{{{sel}}})"),
    ], "none", rename={"Value #A": "corrected ECC (lifetime)", "Value #B": "uncorrected ECC (lifetime)",
                       "Value #C": "remapped rows", "Value #D": "remap pending", "Value #E": "remap failure"},
        thresholds=[(None, "green"), (1, "red")],
        description="Lifetime ECC counts and row-remapping state per GPU; pending needs a GPU reset, "
                    "failure a replacement."), 12, 8)
    b.add(timeseries("ECC errors", [
        target(f'increase(gpumon_gpu_ecc_errors_total{{{sel}, counter="volatile"}}[$__rate_interval])',
               "GPU {{gpu}} {{type}}"),
    ], "none", bars=True, minimum=0, description="New ECC errors per interval (volatile counters)."), 12, 8)
    b.add(timeseries("NVLink throughput", [
        target(f"gpumon_gpu_nvlink_throughput_bytes_per_second{{{sel}}}", "GPU {{gpu}} {{direction}}"),
    ], "Bps", minimum=0), 8, 8)
    b.add(timeseries("NVLink errors", [
        target(f"rate(gpumon_gpu_nvlink_errors_total{{{sel}}}[$__rate_interval])", "GPU {{gpu}} {{type}}"),
    ], "cps", minimum=0, description="CRC, replay and recovery errors per second, all links of a GPU."), 8, 8)
    b.add(timeseries("NVLinks active", [
        target(f"gpumon_gpu_nvlink_links_active{{{sel}}}", "GPU {{gpu}}"),
    ], "none", minimum=0), 8, 8)
    b.add(timeseries("PCIe throughput", [
        target(f"gpumon_gpu_pcie_throughput_bytes_per_second{{{sel}}}", "GPU {{gpu}} {{direction}}"),
    ], "Bps", minimum=0), 8, 8)
    b.add(timeseries("PCIe replays", [
        target(f"rate(gpumon_gpu_pcie_replay_total{{{sel}}}[$__rate_interval])", "GPU {{gpu}}"),
    ], "cps", minimum=0, description="Link-level retransmissions: a noisy slot or riser."), 8, 8)
    b.add(table("PCIe link", [
        target(f"gpumon_gpu_pcie_link_generation{{{sel}}}"),
        target(f"gpumon_gpu_pcie_link_generation_max{{{sel}}}"),
        target(f"gpumon_gpu_pcie_link_width{{{sel}}}"),
        target(f"gpumon_gpu_pcie_link_width_max{{{sel}}}"),
    ], "none", hide=("Time", "__name__", "job", "uuid", "cluster", "instance"),
        rename={"Value #A": "gen", "Value #B": "gen max", "Value #C": "width", "Value #D": "width max"},
        description="Negotiated PCIe generation and width against the maximum."), 8, 8)

    node_hardware(b, host, sel)

    b.row("InfiniBand ports")
    b.add(timeseries("Received vs link rate", [
        target(f"rate(gpumon_ib_port_data_received_bytes_total{{{ib}}}[$__rate_interval])", "{{device}} rx"),
        target(f"gpumon_ib_port_rate_bytes_per_second{{{ib}}}", "{{device}} link rate"),
    ], "Bps", minimum=0), 12, 8)
    b.add(timeseries("Transmitted vs link rate", [
        target(f"rate(gpumon_ib_port_data_transmitted_bytes_total{{{ib}}}[$__rate_interval])", "{{device}} tx"),
        target(f"gpumon_ib_port_rate_bytes_per_second{{{ib}}}", "{{device}} link rate"),
    ], "Bps", minimum=0), 12, 8)
    b.add(timeseries("Port error rates", [
        target(f"rate(gpumon_ib_port_{name}_total{{{ib}}}[$__rate_interval])", f"{{{{device}}}} {label}")
        for name, label in ERROR_COUNTERS
    ], "cps", minimum=0, description="PMA error counters per second; symbol errors and recoveries point at "
                                     "the cable, discards at congestion."), 12, 8)
    b.add(timeseries("Congestion counters", [
        target(f'rate(gpumon_ib_hw_stat_total{{{ib}, counter=~"{CONGESTION_HW}"}}[$__rate_interval])',
               "{{device}} {{counter}}"),
        target(f"rate(gpumon_ib_port_transmit_wait_ticks_total{{{ib}}}[$__rate_interval])",
               "{{device}} transmit wait ticks"),
    ], "cps", minimum=0, description="Driver hw_counters tied to congestion and retransmission (out of "
                                     "sequence, ACK timeouts, ECN/CNP) and the PMA transmit-wait ticks."), 12, 8)
    b.add(status_history("Port state", [
        target(f"gpumon_ib_port_state{{{ib}}}", "{{device}}/{{port}}"),
    ], "none", mappings=IB_STATE_MAPPINGS, kind="state-timeline", continuous=False,
        description="Logical port state over time; a flap shorter than the scrape shows in the flaps panel."),
        12, 8)
    b.add(timeseries("Link flaps", [
        target(f"increase(gpumon_ib_link_flaps_total{{{ib}}}[$__rate_interval])", "{{device}}/{{port}}"),
    ], "none", bars=True, minimum=0, description="Flaps per interval, including those shorter than a poll "
                                                 "(seen by link_downed or carrier changes)."), 12, 8)

    b.row("Recent events")
    b.add(table("XIDs in range", [target(xids_in_range(host))], "none",
                hide=("Time", "__name__", "job", "uuid", "cluster", "instance"), rename={"Value": "count"},
                thresholds=[(None, "red")],
                description="XID errors per GPU and XID number within the time range. The messages are in the "
                            "gpumon log and in GpuMonEvents_CL."), 8, 8)
    b.add(table("Last flap per port", [target(f"gpumon_ib_last_flap_timestamp_seconds{{{ib}}} * 1000")],
                "dateTimeAsIso", hide=("Time", "__name__", "job", "cluster", "instance"),
                rename={"Value": "last flap"}, sort="last flap",
                description="When each port last flapped (within the flap window or since gpumon started)."), 8, 8)
    b.add(table("Ports down now", [
        target(f"gpumon_ib_port_down_seconds{{{ib}}} > 0"),
    ], "s", hide=("Time", "__name__", "job", "cluster", "instance"), rename={"Value": "down for"},
        thresholds=[(None, "red")], description="Ports currently down and for how long."), 8, 8)

    return dashboard("node", "gpumon / Node",
                     "Every GPU and InfiniBand port of one host, and what happened to them recently.", b,
                     [var_datasource(), var_cluster(), var_instance(multi=False), var_gpu(), var_device(),
                      var_job_id(True), var_pod(True)],
                     dash_links("fleet", "fabric", "job"))


def node_health(b: Board, host: str) -> None:
    b.row("Health and workloads")
    b.add(panel("stat", "Verdict", [target(f"gpumon_node_health{{{host}}}", "{{instance}}", instant=True)], "none",
                mappings=HEALTH_MAPPINGS, thresholds=[(None, "green"), (1, "orange"), (2, "red")],
                description="gpumon's health verdict for the host (gpumon_node_health).",
                options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                         "colorMode": "background", "graphMode": "none", "textMode": "value"}), 4, 8)
    b.add(table("Health findings", [target(f"gpumon_health_state{{{host}}} > 0")], "none",
                hide=("Time", "__name__", "job", "cluster", "instance"), rename={"Value": "verdict"},
                overrides=[{"matcher": {"id": "byName", "options": "verdict"}, "properties": [
                    {"id": "mappings", "value": HEALTH_MAPPINGS},
                    {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}],
                description="The health rules failing now and what they judge (GPU, or device and port)."), 8, 8)
    b.add(table("GPU allocations", [target(per_allocation(allocations(host), UTIL))], "percentunit",
                hide=("Time", "__name__", "job", "uuid", "cluster", "instance"), rename={"Value": "GPU utilization"},
                links=[JOB_LINK],
                description="Which pod or job holds each GPU (gpumon_gpu_allocation_info, filtered by the Job and "
                            "Pod variables), with the GPU's utilization."), 12, 8)


def node_hardware(b: Board, host: str, sel: str) -> None:
    b.row("NVLink fabric")
    b.add(status_history("Fabric registration", [
        target(f"gpumon_gpu_fabric_state{{{sel}}}", "GPU {{gpu}}"),
    ], "none", mappings=FABRIC_STATE_MAPPINGS, kind="state-timeline", continuous=False,
        description="Registration of each GPU with the NVLink fabric manager (Hopper with NVSwitch, GB200)."), 8, 8)
    b.add(status_history("Fabric health conditions", [
        target(f"gpumon_gpu_fabric_health_condition{{{sel}}}", "GPU {{gpu}} {{condition}}"),
    ], "none", mappings=CONDITION_MAPPINGS, kind="state-timeline", continuous=False,
        description="The driver's NVLink fabric health conditions (degraded bandwidth, route recovery or unhealthy, "
                    "access timeout, incorrect configuration, partition unassigned, GFM disconnected)."), 8, 8)
    b.add(table("Fabric membership", [
        target(f"gpumon_gpu_fabric_info{{{sel}}}"),
        target(f"gpumon_gpu_fabric_status{{{sel}}}"),
    ], "none", hide=("Time", "__name__", "job", "uuid", "cluster", "instance", "Value #A"),
        rename={"Value #B": "status"}, thresholds=[(None, "green"), (1, "red")],
        description="NVLink domain (cluster UUID, clique) of each GPU and its registration status (an NVML return "
                    "code, 0 success)."), 8, 8)

    b.row("Power swings, kernel log and PCIe AER")
    b.add(timeseries("Power swings", [
        target(f"gpumon_gpu_power_max_watts{{{sel}}}", "GPU {{gpu}} max"),
        target(f"gpumon_gpu_power_mean_watts{{{sel}}}", "GPU {{gpu}} mean"),
        target(f"gpumon_gpu_power_min_watts{{{sel}}}", "GPU {{gpu}} min"),
        target(f"gpumon_gpu_power_watts{{{sel}}}", "GPU {{gpu}} now"),
    ], "watt", minimum=0, description="Lowest, mean and highest of the driver's power samples between two gpumon "
                                       "runs beside the instant reading: a training step's swing shows as a wide "
                                       "band the instant reading hides."), 12, 8)
    b.add(timeseries("Power swing vs limit", [
        target(f"gpu:gpumon_power_swing:ratio{{{sel}}}", "GPU {{gpu}}"),
    ], "percentunit", minimum=0, maximum=1,
        description="Highest minus lowest power sample over the power limit (recording rule); "
                    "GpumonGpuPowerSwing fires above 60 %."), 12, 8)
    b.add(timeseries("PCIe AER errors", [
        target(f"rate(gpumon_pcie_aer_errors_total{{{host}}}[$__rate_interval])",
               "{{role}} {{device}} {{pci_bus_id}} {{severity}}"),
    ], "cps", minimum=0, description="AER errors per second of the GPUs, HCAs and bridges above them."), 8, 8)
    b.add(table("AER errors since boot", [target(f"gpumon_pcie_aer_errors_total{{{host}}}")], "none",
                hide=("Time", "__name__", "job", "cluster", "instance"), rename={"Value": "errors"}, sort="errors",
                thresholds=[(None, "green"), (1, "orange")],
                description="AER totals per PCI function and severity since boot (aer_dev_*)."), 8, 8)
    b.add(timeseries("Kernel log records", [
        target(f"rate(gpumon_kmsg_records_total{{{host}}}[$__rate_interval])", "{{kind}}"),
        target(f"rate(gpumon_kmsg_lost_records_total{{{host}}}[$__rate_interval])", "lost"),
    ], "cps", minimum=0, description="Kernel log records per second by driver message (xid, sxid, mlx5, netdev "
                                      "link) and records lost before gpumon read them."), 8, 8)


# ----------------------------------------------------------------------------------------- fabric


def fabric() -> dict[str, Any]:
    sel = 'cluster=~"$cluster", instance=~"$instance", device=~"$device"'
    b = Board()
    b.row("Fabric")
    b.add(stat("Ports", f"count(gpumon_ib_port_info{{{sel}}})", "none"), 4, 4)
    b.add(stat("Ports down", f"count(gpumon_ib_port_up{{{sel}}} == 0) or vector(0)", "none", bad_above=1), 4, 4)
    b.add(stat("Ports flapping", f"sum(gpumon_ib_port_flapping{{{sel}}})", "none", bad_above=1), 4, 4)
    b.add(stat("Flaps in range", f"sum(increase(gpumon_ib_link_flaps_total{{{sel}}}[$__range]))", "none",
               bad_above=1), 4, 4)
    b.add(stat("Saturated counters", f"count(gpumon_ib_port_saturated{{{sel}}} == 1) or vector(0)", "none",
               bad_above=1, description="Counters stuck at their maximum: they no longer count."), 4, 4)
    b.add(stat("Error rate", f"sum(port:gpumon_ib_errors:rate5m{{{sel}}})", "cps", decimals=2,
               description="Port errors per second, all ports."), 4, 4)
    b.add(timeseries("Throughput", [
        target(f"sum(port:gpumon_ib_receive_bytes:rate5m{{{sel}}})", "received"),
        target(f"sum(port:gpumon_ib_transmit_bytes:rate5m{{{sel}}})", "transmitted"),
    ], "Bps", minimum=0), 12, 8)
    b.add(timeseries("Error rate by kind", [
        target(f"sum(rate(gpumon_ib_port_{name}_total{{{sel}}}[$__rate_interval]))", label)
        for name, label in ERROR_COUNTERS
    ], "cps", minimum=0), 12, 8)

    b.row("Ports")
    b.add(status_history("Link utilization per port", [
        target(f"port:gpumon_ib_utilization:ratio_rate5m{{{sel}}}", "{{instance}} {{device}}/{{port}}"),
    ], "percentunit", minimum=0, maximum=1,
        description="Busier direction over the negotiated rate; one row per port."), 24, 10)
    b.add(table("Port state", [
        target(f"gpumon_ib_port_state{{{sel}}}"),
        target(f"gpumon_ib_port_phys_state{{{sel}}}"),
        target(f"gpumon_ib_port_rate_bytes_per_second{{{sel}}}"),
        target(f"gpumon_ib_port_flaps_in_window{{{sel}}}"),
    ], "none", hide=("Time", "__name__", "job"),
        rename={"Value #A": "state", "Value #B": "physical", "Value #C": "rate", "Value #D": "flaps in window"},
        links=[NODE_LINK],
        overrides=[
            {"matcher": {"id": "byName", "options": "state"}, "properties": [
                {"id": "mappings", "value": IB_STATE_MAPPINGS},
                {"id": "custom.cellOptions", "value": {"type": "color-background"}}]},
            {"matcher": {"id": "byName", "options": "physical"}, "properties": [
                {"id": "mappings", "value": IB_PHYS_MAPPINGS},
                {"id": "custom.cellOptions", "value": {"type": "color-background"}}]},
            field_unit("rate", "Bps"),
        ],
        description="Every port of every host: logical and physical state, link rate and flaps in the window."),
        24, 10)

    b.row("Problems")
    b.add(table("Error rates ranked", [target(f"topk(20, port:gpumon_ib_errors:rate5m{{{sel}}})")], "cps",
                rename={"Value": "errors/s"}, sort="errors/s", links=[NODE_LINK],
                thresholds=[(None, "green"), (0.1, "red")],
                description="Ports with the highest error rate (symbol, receive, recovery, discards, ...)."), 8, 10)
    b.add(table("Flapping ports", [target(f"topk(20, gpumon_ib_port_flaps_in_window{{{sel}}})")], "none",
                rename={"Value": "flaps in window"}, sort="flaps in window", links=[NODE_LINK],
                thresholds=[(None, "green"), (1, "orange"), (5, "red")],
                description="Ports with the most flaps in the flap window (default 24 h)."), 8, 10)
    b.add(table("Saturated counters", [target(f"gpumon_ib_port_saturated{{{sel}}} == 1")], "none",
                hide=("Time", "__name__", "job", "Value"), links=[NODE_LINK],
                description="Counters stuck at the maximum of their width: reset them (perfquery -R)."), 8, 10)
    b.add(timeseries("Flaps per interval", [
        target(f"sum by (instance, device, port) (increase(gpumon_ib_link_flaps_total{{{sel}}}[$__rate_interval]))",
               "{{instance}} {{device}}/{{port}}"),
    ], "none", bars=True, minimum=0), 12, 8)
    b.add(bargauge("Most congested ports", f"topk(10, port:gpumon_ib_transmit_wait_ticks:rate5m{{{sel}}})",
                   "cps", "{{instance}} {{device}}/{{port}}", maximum=None, links=[NODE_LINK],
                   description="Transmit-wait ticks per second: time with data to send and no credits."), 12, 8)

    return dashboard("fabric", "gpumon / InfiniBand fabric",
                     "All InfiniBand and RoCE ports of all hosts: throughput, errors, state and flaps.", b,
                     [var_datasource(), var_cluster(), var_instance(multi=True), var_device()],
                     dash_links("fleet", "node"))


# ----------------------------------------------------------------------------------------- job


def job() -> dict[str, Any]:
    """One job or pod: its GPUs and hosts, how they run, and the ports and health of those hosts."""
    cl = 'cluster=~"$cluster"'
    alloc = f'gpumon_gpu_allocation_info{{{cl}, job_id=~"$job_id", pod=~"$pod"}}'
    on_gpus = f"and {GPU_JOIN} {alloc}"
    on_hosts = f"and {HOST_JOIN} {alloc}"
    b = Board()
    b.row("Selection")
    b.add(stat("GPUs", f"count({alloc})", "none", description="GPUs (or MIG instances) the selection holds."), 4, 4)
    b.add(stat("Hosts", f"count(count by (cluster, job, instance) ({alloc}))", "none"), 4, 4)
    b.add(stat("Mean GPU utilization", f"avg({per_allocation(alloc, UTIL)})", "percentunit", decimals=1), 4, 4)
    b.add(stat("XIDs in range", f"sum(({xids_in_range(cl)}) {on_gpus}) or vector(0)", "none", bad_above=1,
               description="XIDs on the selection's GPUs within the time range."), 4, 4)
    b.add(stat("Hosts unhealthy", f"count((gpumon_node_health{{{cl}}} == 2) {on_hosts}) or vector(0)", "none",
               bad_above=1, description="Hosts of the selection whose health verdict is unhealthy."), 4, 4)
    b.add(stat("Hosts with pending maintenance",
               f"count(count by (cluster, job, instance) ((gpumon_azure_scheduled_event{{{cl}}} > 0) {on_hosts}))"
               " or vector(0)", "none", bad_above=1,
               description="Hosts of the selection with an Azure Scheduled Event scheduled or started."), 4, 4)
    b.add(table("GPUs and hosts", [target(per_allocation(alloc, UTIL))], "percentunit",
                hide=("Time", "__name__", "job", "cluster"), rename={"Value": "GPU utilization"}, links=[NODE_LINK],
                description="Each GPU of the selection: host, index, UUID, pod or job, and utilization now."), 24, 8)

    job_straggler(b, cl, alloc)

    b.row("GPUs")
    b.add(timeseries("GPU utilization", [
        target(per_allocation(alloc, UTIL), "{{instance}} GPU {{gpu}}"),
    ], "percentunit", minimum=0, maximum=1), 8, 8)
    b.add(timeseries("Power", [
        target(per_allocation(alloc, f"gpumon_gpu_power_watts{{{cl}}}"), "{{instance}} GPU {{gpu}}"),
    ], "watt", minimum=0), 8, 8)
    b.add(timeseries("Memory used", [
        target(per_allocation(alloc, f"gpumon_gpu_memory_used_bytes{{{cl}}}"), "{{instance}} GPU {{gpu}}"),
    ], "bytes", minimum=0), 8, 8)
    b.add(status_history("Clock event reasons", [
        target(f'gpumon_gpu_clock_event_reason_active{{{cl}, reason=~"{THROTTLE_REASONS}"}} {on_gpus}',
               "{{instance}} GPU {{gpu}} {{reason}}"),
    ], "none", mappings=ON_OFF_MAPPINGS, kind="state-timeline", continuous=False,
        description="Why the selection's GPUs run below their maximum clocks: power cap, thermal or hardware "
                    "slowdown."), 12, 8)
    b.add(timeseries("Time throttled", [
        target(f'rate(gpumon_gpu_clock_event_violation_seconds_total{{{cl}, reason=~"{VIOLATION_REASONS}"}}'
               f"[$__rate_interval]) {on_gpus}", "{{instance}} GPU {{gpu}} {{reason}}"),
    ], "percentunit", minimum=0, description="Share of time each reason held the clocks down (the reasons overlap: "
                                              "do not add the lines)."), 12, 8)
    b.add(table("XIDs in range", [target(f"({xids_in_range(cl)}) {on_gpus}")], "none",
                hide=("Time", "__name__", "job", "uuid", "cluster"), rename={"Value": "count"},
                thresholds=[(None, "red")], links=[NODE_LINK],
                description="XID errors on the selection's GPUs within the time range."), 24, 6)

    b.row("Hosts")
    b.add(table("Health of the hosts", [target(f"(gpumon_health_state{{{cl}}} > 0) {on_hosts}")], "none",
                hide=("Time", "__name__", "job", "cluster"), rename={"Value": "verdict"}, links=[NODE_LINK],
                overrides=[{"matcher": {"id": "byName", "options": "verdict"}, "properties": [
                    {"id": "mappings", "value": HEALTH_MAPPINGS},
                    {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}],
                description="Health rules failing on the selection's hosts (any GPU or port of them)."), 12, 8)
    b.add(table("Pending Azure scheduled events", [
        target(f"(gpumon_azure_scheduled_event{{{cl}}} > 0) {on_hosts}"),
    ], "none", hide=("Time", "__name__", "job", "cluster"), rename={"Value": "events"}, links=[NODE_LINK],
        description="Maintenance the platform has scheduled on the selection's hosts: checkpoint before it."), 12, 8)

    b.row("InfiniBand ports of the hosts")
    b.add(status_history("Link utilization", [
        target(f"port:gpumon_ib_utilization:ratio_rate5m{{{cl}}} {on_hosts}", "{{instance}} {{device}}/{{port}}"),
    ], "percentunit", minimum=0, maximum=1, description="Busier direction over the link rate, per port of the "
                                                          "selection's hosts."), 24, 8)
    b.add(timeseries("Port error rates", [
        target(f"port:gpumon_ib_errors:rate5m{{{cl}}} {on_hosts}", "{{instance}} {{device}}/{{port}}"),
    ], "cps", minimum=0), 8, 8)
    b.add(timeseries("Link flaps", [
        target(f"increase(gpumon_ib_link_flaps_total{{{cl}}}[$__rate_interval]) {on_hosts}",
               "{{instance}} {{device}}/{{port}}"),
    ], "none", bars=True, minimum=0), 8, 8)
    b.add(table("Ports down or flapping", [
        target(f"(gpumon_ib_port_down_seconds{{{cl}}} > 0 or gpumon_ib_port_flaps_in_window{{{cl}}} > 0) {on_hosts}"),
    ], "none", hide=("Time", "__name__", "job", "cluster"), rename={"Value": "down s / flaps"},
        links=[NODE_LINK, FABRIC_LINK], thresholds=[(None, "orange")]), 8, 8)

    return dashboard("job", "gpumon / Job",
                     "One job or pod: its GPUs and hosts, their utilization, throttling, XIDs and health, and the "
                     "InfiniBand ports of those hosts.", b,
                     [var_datasource(), var_cluster(), var_job_id(False), var_pod(False)],
                     dash_links("fleet", "node", "fabric"))


STRAGGLER_THRESHOLD = 5.0
"""GpumonJobStraggler's threshold (deploy/prometheus/job-rules.yaml), drawn on the score panels."""


def job_straggler(b: Board, cl: str, alloc: str) -> None:
    """The job rules' verdicts (deploy/prometheus/job-rules.yaml): each GPU's and host's straggler score
    against the job's median, worst first, and whether the job is stalled."""
    gpus = f'gpumon_job:straggler_score{{{cl}, job_id!="", gpu!=""}} and {GPU_JOIN} {alloc}'
    ports = f'gpumon_job:straggler_score{{{cl}, job_id!="", gpu=""}} and {HOST_JOIN} {alloc}'
    hosts = f'gpumon_job_host:straggler_score{{{cl}, job_id!=""}} and {HOST_JOIN} {alloc}'
    limit = [(None, "green"), (STRAGGLER_THRESHOLD / 2, "orange"), (STRAGGLER_THRESHOLD, "red")]
    how = ("Robust distance from the job's median (median and MAD over the job's GPUs of one model): 0 is the "
           f"median, positive is worse; GpumonJobStraggler fires above {STRAGGLER_THRESHOLD:g}. The signal named is "
           "the member's worst. Needs deploy/prometheus/job-rules.yaml.")
    b.row("Stragglers and stalls")
    b.add(stat("Worst straggler score", f"max({gpus} or {ports})", "none", decimals=1,
               bad_above=STRAGGLER_THRESHOLD, description=how), 8, 4)
    b.add(stat("Members past the threshold", f"count(({gpus} or {ports}) > {STRAGGLER_THRESHOLD:g}) or vector(0)",
               "none", bad_above=1, description="GPUs and InfiniBand ports of the selection whose score is past "
                                                "the alert threshold now."), 8, 4)
    b.add(stat("Hosts stalled", f"sum(gpumon_job_host:stalled:bool{{{cl}}} and {HOST_JOIN} {alloc}) or vector(0)",
               "none", bad_above=1, description="Hosts whose GPUs of the job all hold processes and memory but "
                                                "idle (or spin at idle power): GpumonJobStalled after 10 minutes, "
                                                "naming the host that went quiet first."), 8, 4)
    b.add(table("Ranked: GPUs, ports and hosts by straggler score", [
        target(f"sort_desc({gpus})"), target(f"sort_desc({ports})"), target(f"sort_desc({hosts})"),
    ], "none", hide=("Time", "__name__", "job", "cluster"), rename={"Value": "score"}, links=[NODE_LINK],
        thresholds=limit, sort="score",
        overrides=[{"matcher": {"id": "byName", "options": "score"}, "properties": [
            {"id": "decimals", "value": 1}, {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}],
        description="Every GPU, InfiniBand port and host of the selection, worst first: " + how), 24, 8)
    threshold_line = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0, "showPoints": "never",
                      "spanNulls": False, "thresholdsStyle": {"mode": "line"}}
    legend = {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"],
                         "sortBy": "Last *", "sortDesc": True}, "tooltip": {"mode": "multi", "sort": "desc"}}
    b.add(panel("timeseries", "Straggler score by GPU", [
        target(gpus, "{{instance}} GPU {{gpu}} {{gpu_instance}} ({{signal}})"),
        target(ports, "{{instance}} {{device}}/{{port}} ({{signal}})"),
    ], "none", custom=threshold_line, thresholds=[(None, "transparent"), (STRAGGLER_THRESHOLD, "red")],
        options=legend, description=how), 12, 9)
    b.add(panel("timeseries", "Straggler score by host", [
        target(hosts, "{{instance}} ({{signal}})"),
    ], "none", custom=threshold_line, thresholds=[(None, "transparent"), (STRAGGLER_THRESHOLD, "red")],
        options=legend, description="Each host's worst GPU or port: " + how), 12, 9)


# ----------------------------------------------------------------------------------------- main

BUILDERS = {"fleet": fleet, "node": node, "fabric": fabric, "job": job}
FILES = {"fleet": "gpumon-fleet.json", "node": "gpumon-node.json", "fabric": "gpumon-infiniband-fabric.json",
         "job": "gpumon-job.json"}


def render(key: str) -> str:
    return json.dumps(BUILDERS[key](), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file differs")
    args = parser.parse_args(argv)
    outputs = {os.path.join(HERE, name): render(key) for key, name in FILES.items()}
    return sync(outputs, args.check, "python dashboards/grafana/generate.py")


if __name__ == "__main__":
    sys.exit(main())

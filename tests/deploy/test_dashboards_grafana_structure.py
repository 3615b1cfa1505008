"""The Grafana dashboards are importable as they are: generated, one data source variable, units on every
panel, the label variables, links that lead somewhere, and only metrics gpumon exports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO, clean_env
from tests.support.dashboards import dashboards, walk_panels
from tests.support.rules import known_metrics, metric_names, rules

GRAFANA = os.path.join(REPO, "dashboards", "grafana")
DS = {"type": "prometheus", "uid": "${datasource}"}
VARIABLES = {
    "gpumon-fleet.json": ["datasource", "cluster", "instance", "job_id", "pod"],
    "gpumon-node.json": ["datasource", "cluster", "instance", "gpu", "device", "job_id", "pod"],
    "gpumon-infiniband-fabric.json": ["datasource", "cluster", "instance", "device"],
    "gpumon-job.json": ["datasource", "cluster", "job_id", "pod"],
}


def test_committed_dashboards_are_generated() -> None:
    proc = subprocess.run([sys.executable, os.path.join(GRAFANA, "generate.py"), "--check"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_all_four_dashboards_exist_with_stable_uids() -> None:
    uids = {name: d["uid"] for name, d in dashboards().items()}
    assert uids == {"gpumon-fleet.json": "gpumon-fleet", "gpumon-node.json": "gpumon-node",
                    "gpumon-infiniband-fabric.json": "gpumon-ib-fabric", "gpumon-job.json": "gpumon-job"}


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_variables(name: str) -> None:
    dash = dashboards()[name]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert list(variables) == VARIABLES[name]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DS
            assert re.fullmatch(r"label_values\(.+, \w+\)", v["definition"]), v["definition"]
            if v["includeAll"]:
                assert v["allValue"] == ".*", f"{v['name']}: All must match series without the label too"


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_every_panel_has_the_datasource_variable_and_a_unit(name: str) -> None:
    dash = dashboards()[name]
    panels = [p for p in walk_panels(dash["panels"]) if p["type"] != "row"]
    assert len(panels) >= 10
    for p in panels:
        assert p["datasource"] == DS, p["title"]
        assert all(t["datasource"] == DS for t in p["targets"]), p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"{name}: {p['title']} has no unit"
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_layout_fits_the_grid(name: str) -> None:
    dash = dashboards()[name]
    ids = [p["id"] for p in walk_panels(dash["panels"])]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for p in walk_panels(dash["panels"]):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{p['title']} overlaps another panel"
        occupied |= cells


def test_links_point_at_the_dashboards_here() -> None:
    uids = {d["uid"] for d in dashboards().values()}
    found = 0
    for dash in dashboards().values():
        urls = [link["url"] for link in dash["links"]]
        for p in walk_panels(dash["panels"]):
            urls += [link["url"] for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])]
        for url in urls:
            m = re.match(r"/d/([\w-]+)", url)
            assert m and m.group(1) in uids, url
            found += 1
    assert found >= 10
    fleet = dashboards()["gpumon-fleet.json"]
    assert any("var-instance=${__data.fields.instance}" in link["url"] for p in walk_panels(fleet["panels"])
               for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", []))


def test_panels_read_only_metrics_gpumon_exports() -> None:
    known = known_metrics()
    for name, dash in dashboards().items():
        for p in walk_panels(dash["panels"]):
            for t in p.get("targets", []):
                used = metric_names(t["expr"])
                assert used, f"{name}: {p['title']}: no metric in {t['expr']}"
                assert not used - known, f"{name}: {p['title']} reads unknown metrics {used - known}"


def test_each_issue_item_has_a_panel() -> None:
    """The panels the dashboards promise, by title."""
    titles: dict[str, set[str]] = {n: {p["title"] for p in walk_panels(d["panels"])} for n, d in dashboards().items()}
    assert {"Hosts reporting", "GPUs reporting", "Collectors down", "GPUs lost", "XIDs in range", "IB flaps in range",
            "GPU utilization across the fleet", "GPU power distribution", "GPU temperature distribution",
            "Hottest GPUs", "Most throttled GPUs", "Ports down or flapping"} <= titles["gpumon-fleet.json"]
    assert {"GPU utilization", "Memory used", "Power vs limit", "Temperatures", "Clocks", "Clock event reasons",
            "ECC and row remapping", "NVLink throughput", "NVLink errors", "PCIe throughput", "Received vs link rate",
            "Transmitted vs link rate", "Port error rates", "Congestion counters", "Port state", "Link flaps",
            "XIDs in range"} <= titles["gpumon-node.json"]
    assert {"Throughput", "Error rates ranked", "Port state", "Flapping ports",
            "Saturated counters"} <= titles["gpumon-infiniband-fabric.json"]
    # Health (21.6), attribution (20.4), placement (19.5), hardware depth (22.5).
    assert {"Hosts unhealthy", "Hosts degraded", "Node health", "Failing health rules", "GPU allocations",
            "Pending Azure scheduled events", "Workloads on hosts with pending maintenance",
            "Link flaps by placement group", "XIDs by physical host", "Health by physical host", "Hosts by placement",
            "NVLink domains", "Widest power swings", "PCIe AER errors", "Kernel log"} <= titles["gpumon-fleet.json"]
    assert {"Verdict", "Health findings", "GPU allocations", "Fabric registration", "Fabric health conditions",
            "Fabric membership", "Power swings", "PCIe AER errors", "Kernel log records"} <= titles["gpumon-node.json"]
    assert {"GPUs and hosts", "GPU utilization", "Clock event reasons", "XIDs in range", "Health of the hosts",
            "Pending Azure scheduled events", "Link utilization", "Port error rates", "Worst straggler score",
            "Ranked: GPUs, ports and hosts by straggler score", "Straggler score by GPU", "Straggler score by host",
            "Hosts stalled"} <= titles["gpumon-job.json"]


def test_allocation_joins_keep_every_pod_of_a_shared_gpu() -> None:
    """A per-GPU value is brought to an allocation with the allocation on the left (`alloc * on(..., gpu)
    group_left () metric`): two pods sharing a GPU (MIG) would make the other direction a many-to-many error."""
    joins = [t["expr"] for d in dashboards().values() for p in walk_panels(d["panels"]) for t in p.get("targets", [])
             if "gpumon_gpu_allocation_info" in t["expr"]]
    assert len(joins) >= 10
    for expr in joins:
        assert "group_right" not in expr, expr
        for m in re.finditer(r"group_left\s*\(([^)]*)\)", expr):
            assert m.group(1).strip() == "", f"allocation labels pulled onto a GPU series: {expr}"


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def test_dashboards_are_plain_json_for_import() -> None:
    for name, dash in dashboards().items():
        assert _json_roundtrip(dash) == dash
        assert dash["schemaVersion"] >= 39 and dash["id"] is None, name  # import creates, never overwrites by id


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_import_asks_for_the_prometheus_data_source(name: str) -> None:
    """grafana.com-style import: one data source input, which is the default of the datasource variable
    (Grafana replaces every ${DS_...} with the data source picked), and nothing else names it."""
    dash = dashboards()[name]
    (ds_input,) = dash["__inputs"]
    assert ds_input["type"] == "datasource" and ds_input["pluginId"] == "prometheus"
    assert re.fullmatch(r"DS_[A-Z0-9_]+", ds_input["name"]) and ds_input["label"]
    placeholder = "${" + ds_input["name"] + "}"
    text = json.dumps(dash)
    assert set(re.findall(r"\$\{(DS_\w+)\}", text)) == {ds_input["name"]}
    variable = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == placeholder
    assert text.count(placeholder) == 2, "only the variable's default: the panels read ${datasource}"


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_requires_lists_grafana_the_data_source_and_every_panel_type(name: str) -> None:
    dash = dashboards()[name]
    required = {(r["type"], r["id"]) for r in dash["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    used = {p["type"] for p in walk_panels(dash["panels"])} - {"row"}
    assert {i for t, i in required if t == "panel"} == used
    grafana = next(r for r in dash["__requires"] if r["id"] == "grafana")
    assert re.fullmatch(r"\d+\.\d+\.\d+", grafana["version"])


def test_uids_tags_and_versions_identify_each_dashboard() -> None:
    """Stable uids keep links and bookmarks across re-imports; tags find them in Grafana's search; the
    version is a positive integer, as Grafana stores it."""
    found = dashboards()
    assert len({d["uid"] for d in found.values()}) == len(found)
    for name, dash in found.items():
        assert re.fullmatch(r"[a-z0-9-]{1,40}", dash["uid"]), name
        assert "gpumon" in dash["tags"] and len(set(dash["tags"])) == len(dash["tags"]) > 1, name
        assert isinstance(dash["version"], int) and dash["version"] >= 1, name
    assert len({tuple(d["tags"]) for d in found.values()}) == len(found), "each has a tag of its own"


# --- clock-event reasons ---------------------------------------------------------------------------------------

CLOCK_METRICS = ("gpumon_gpu_clock_event_violation_seconds_total", "gpumon_gpu_clock_event_reason_active")


@pytest.fixture(scope="module")
def r550_reasons(tmp_path_factory) -> dict[str, set[str]]:
    """Per clock-event metric, the reasons a simulated host on the default (R550) driver exports."""
    state = str(tmp_path_factory.mktemp("state"))
    proc = subprocess.run([sys.executable, "-m", "gpumon", "once", "--simulate", "nd-h100-v5", "--format",
                           "prometheus"], capture_output=True, text=True, timeout=120, check=False,
                          env=clean_env(GPUMON_DAEMON_STATE_DIR=state), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert 'driver_version="550.' in proc.stdout, "the simulated default driver is no longer R550"
    out: dict[str, set[str]] = {m: set() for m in CLOCK_METRICS}
    for m in re.finditer(r'^(\w+)\{[^}]*\breason="(\w+)"', proc.stdout, re.M):
        if m.group(1) in out:
            out[m.group(1)].add(m.group(2))
    return out


def clock_event_queries() -> list[tuple[str, str]]:
    """(where, expr) for every dashboard query and alert that reads a clock-event metric."""
    out = [(f"{name}: {p['title']}", t["expr"]) for name, dash in dashboards().items()
           for p in walk_panels(dash["panels"]) for t in p.get("targets", [])]
    out += [(f"alert {r['alert']}", r["expr"]) for r in rules("alert")]
    return [(where, expr) for where, expr in out if any(m in expr for m in CLOCK_METRICS)]


def reason_sets(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, reasons its selector matches) for each clock-event selector of an expression."""
    found = []
    for m in re.finditer(r"(gpumon_gpu_clock_event_\w+)\{([^}]*)\}", expr):
        reason = re.search(r'reason=~?"([^"]*)"', m.group(2))
        found.append((m.group(1), set(reason.group(1).split("|")) if reason else {"*"}))
    return found


def test_clock_event_queries_read_reasons_every_driver_exports(r550_reasons) -> None:
    """A throttling panel or alert that selects only R580's violation counters shows nothing on older drivers."""
    from gpumon.collectors.nvml_tables import CLOCK_EVENT_REASONS

    assert {"sw_power_cap", "thermal"} <= r550_reasons["gpumon_gpu_clock_event_violation_seconds_total"]
    assert not {"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"} & r550_reasons[
        "gpumon_gpu_clock_event_violation_seconds_total"], "R580-only counters on the R550 simulation"
    known = {"gpumon_gpu_clock_event_violation_seconds_total": {
        "sw_power_cap", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability", "total_app_clocks",
        "total_base_clocks", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"},
        "gpumon_gpu_clock_event_reason_active": {name for _, name in CLOCK_EVENT_REASONS}}
    queries = clock_event_queries()
    assert len(queries) >= 5, queries
    for where, expr in queries:
        for metric, reasons in reason_sets(expr):
            assert "*" not in reasons, f"{where}: {metric} without a reason filter"
            assert reasons <= known[metric], f"{where}: unknown reasons {reasons - known[metric]}"
            assert reasons & r550_reasons[metric], f"{where}: no reason an R550 driver exports in {expr}"
            if metric == "gpumon_gpu_clock_event_violation_seconds_total" and reasons & {
                    "sw_thermal_slowdown", "hw_thermal_slowdown"}:
                assert "thermal" in reasons, f"{where}: thermal time only from the R580 counters"


def test_overlapping_reasons_are_never_added() -> None:
    """NVML's reasons overlap in time: a sum over them can pass 100 % of the time."""
    for where, expr in clock_event_queries():
        for _metric, reasons in reason_sets(expr):
            if len(reasons) > 1:
                assert not re.search(r"\bsum\b", expr), f"{where}: adds overlapping reasons: {expr}"

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

from tests.conftest import REPO
from tests.test_alert_rules_promtool import known_metrics, metric_names
from tests.test_dashboards_live_prometheus import dashboards, walk_panels

GRAFANA = os.path.join(REPO, "dashboards", "grafana")
DS = {"type": "prometheus", "uid": "${datasource}"}
VARIABLES = {
    "gpumon-fleet.json": ["datasource", "cluster", "instance"],
    "gpumon-node.json": ["datasource", "cluster", "instance", "gpu", "device"],
    "gpumon-infiniband-fabric.json": ["datasource", "cluster", "instance", "device"],
}


def test_committed_dashboards_are_generated() -> None:
    proc = subprocess.run([sys.executable, os.path.join(GRAFANA, "generate.py"), "--check"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_all_three_dashboards_exist_with_stable_uids() -> None:
    uids = {name: d["uid"] for name, d in dashboards().items()}
    assert uids == {"gpumon-fleet.json": "gpumon-fleet", "gpumon-node.json": "gpumon-node",
                    "gpumon-infiniband-fabric.json": "gpumon-ib-fabric"}


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


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def test_dashboards_are_plain_json_for_import() -> None:
    for name, dash in dashboards().items():
        assert _json_roundtrip(dash) == dash
        assert dash["schemaVersion"] >= 39 and dash["id"] if "id" in dash else True
        assert "__inputs" in dash and dash["__inputs"] == [], name

"""A real Prometheus scrapes a simulated ND H100 v5 host with injected faults; every dashboard panel's
query returns data and every alert the faults provoke fires (and no other).

Time is compressed for the test only: Prometheus scrapes and evaluates every second, and a copy of the
rules has each group's interval set to 1 s and each alert's `for:` set to 1 s. Grafana's built-in
variables are replaced the way Grafana would for a short dashboard range ($__rate_interval: 10s,
$__range: 1m, $__interval: 1s); the dashboard variables by real values read from Prometheus.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from gpumon.simulate import control
from tests.conftest import REPO, GpumonProcess, clean_env, free_port, http_get, wait_for

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus server")

GRAFANA = os.path.join(REPO, "dashboards", "grafana")
RULES = os.path.join(REPO, "deploy", "prometheus")
BUILTINS = {"$__rate_interval": "10s", "$__range": "1m", "$__range_s": "60", "$__interval": "1s"}
FLAPPING_PORT = "mlx5_ib1"  # flapped past the flap threshold (5 in the window by default)
FLAPPED_ONCE = "mlx5_ib2"
DOWN_PORT = "mlx5_ib3"
STUCK_PORT = "mlx5_ib4"  # its 16-bit port_xmit_discards counter is stuck at 65535
XID_GPU = 3

# What the injected faults must set off, as (alertname, identifying label) pairs, and nothing else.
EXPECTED_ALERTS = {
    ("GpumonIBPortDown", DOWN_PORT),
    ("GpumonIBPortFlapping", FLAPPING_PORT),
    ("GpumonIBLinkFlapped", FLAPPING_PORT),
    ("GpumonIBLinkFlapped", FLAPPED_ONCE),
    ("GpumonIBCounterSaturated", STUCK_PORT),
    ("GpumonIBPortErrorsHigh", STUCK_PORT),
    ("GpumonGpuXidCritical", str(XID_GPU)),
    ("GpumonGpuLost", str(XID_GPU)),
    # The health rules judge the host unhealthy (a port down, a GPU lost): keyed by instance, see firing().
    ("GpumonNodeUnhealthy", "HOST"),
}
# The flapping port's link error recoveries (one per flap) may still be above the error-rate threshold
# when the alerts are read, or no longer: either is right.
# The linkflap collector also counts the down port's link_downed step as a flap.
MAY_FIRE = {("GpumonIBPortErrorsHigh", FLAPPING_PORT), ("GpumonIBLinkFlapped", DOWN_PORT)}


def dashboards() -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(os.listdir(GRAFANA)):
        if name.endswith(".json"):
            with open(os.path.join(GRAFANA, name), encoding="utf-8") as fh:
                out[name] = json.load(fh)
    return out


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def panel_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard file, panel title, refId, expr) for every query of every panel."""
    out = []
    for name, dash in dashboards().items():
        for p in walk_panels(dash["panels"]):
            for t in p.get("targets", []):
                out.append((name, p["title"], t["refId"], t["expr"]))
    return out


def inject(workdir: str, commands: list[dict[str, Any]]) -> None:
    """Drop control files one per clock tick: control() names a file after os.times().elapsed, whose
    resolution is a clock tick, so two drops within one tick would share a name and one would be lost."""
    last: list[float] = []
    for command in commands:
        wait_for(lambda: os.times().elapsed not in last, timeout=5, interval=0.001)
        control(workdir, command)
        last[:] = [os.times().elapsed]


@dataclass
class Live:
    url: str
    variables: dict[str, str]

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, _, body = http_get(f"{self.url}/api/v1/query?query={urllib.parse.quote(expr)}", timeout=5)
        payload = json.loads(body)
        if status != 200:
            raise AssertionError(f"{expr}: {payload.get('errorType')}: {payload.get('error')}")
        return payload["data"]["result"]

    def firing(self) -> set[tuple[str, str]]:
        _, _, body = http_get(f"{self.url}/api/v1/alerts", timeout=5)
        out = set()
        for alert in json.loads(body)["data"]["alerts"]:
            if alert["state"] == "firing":
                labels = alert["labels"]
                key = labels.get("device") or labels.get("gpu") or labels.get("collector") or "HOST"
                out.add((labels["alertname"], key))
        return out

    def substitute(self, expr: str) -> str:
        for name in sorted(BUILTINS, key=len, reverse=True):
            expr = expr.replace(name, BUILTINS[name])
        for name, value in self.variables.items():
            expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
        assert "$" not in expr.replace("$1", ""), f"unsubstituted variable in {expr}"
        return expr


def fast_rules(tmp: str) -> list[str]:
    """Copies of the rule files with 1 s evaluation and 1 s `for:` (see the module docstring)."""
    paths = []
    for name in ("recording-rules.yaml", "alerting-rules.yaml"):
        with open(os.path.join(RULES, name), encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
        for group in doc["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = "1s"
        path = os.path.join(tmp, name)
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(doc, fh)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    tmp = str(tmp_path_factory.mktemp("live"))
    state = os.path.join(tmp, "state")
    exporter = GpumonProcess(["--simulate", "nd-h100-v5", "--interval", "1"],
                             clean_env(GPUMON_DAEMON_STATE_DIR=state), free_port())
    prometheus = None
    try:
        exporter.wait_ready(timeout=30)
        rules = fast_rules(tmp)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": rules,
            "scrape_configs": [{"job_name": "gpumon", "static_configs": [
                {"targets": [f"127.0.0.1:{exporter.port}"], "labels": {"cluster": "sim"}}]}],
        }
        with open(os.path.join(tmp, "prometheus.yml"), "w", encoding="utf-8") as fh:
            yaml.safe_dump(config, fh)
        port = free_port()
        with open(os.path.join(tmp, "prometheus.log"), "wb") as log:
            prometheus = subprocess.Popen(
                ["prometheus", f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=log)
        lv = Live(f"http://127.0.0.1:{port}", {})

        def query_quietly(expr: str) -> list[dict[str, Any]]:
            try:
                return lv.query(expr)
            except (OSError, ValueError):
                return []

        # A few clean scrapes first, so counters have a baseline before the faults.
        wait_for(lambda: query_quietly('count_over_time(up{job="gpumon"}[1m]) >= 4'), timeout=40, interval=0.2)
        workdir = os.path.join(state, "simulate", "nd-h100-v5")
        # A stuck counter is written into the synthetic tree by hand (the simulation never grows discards,
        # so it leaves the file alone); the other faults go through the simulation's control files.
        discards = os.path.join(workdir, "sys", "class", "infiniband", STUCK_PORT, "ports", "1", "counters",
                                "port_xmit_discards")
        with open(discards, "w", encoding="utf-8") as fh:
            fh.write("65535\n")
        faults = [{"action": "flap", "device": FLAPPING_PORT, "port": 1}] * 6 + [
            {"action": "flap", "device": FLAPPED_ONCE, "port": 1},
            {"action": "port_down", "device": DOWN_PORT, "port": 1, "seconds": 0},
            {"action": "xid", "gpu": XID_GPU, "xid": 79},
        ]
        inject(workdir, faults)
        try:
            wait_for(lambda: lv.firing() >= EXPECTED_ALERTS, timeout=40, interval=0.2)
        except AssertionError:
            raise AssertionError(f"alerts not firing within 40 s: {sorted(EXPECTED_ALERTS - lv.firing())}") from None

        cluster = [r["metric"]["cluster"] for r in lv.query("count by (cluster) (gpumon_build_info)")]
        instance = [r["metric"]["instance"] for r in lv.query("count by (instance) (gpumon_build_info)")]
        assert cluster == ["sim"] and len(instance) == 1
        lv.variables = {"datasource": "prometheus", "cluster": "sim", "instance": re.escape(instance[0]).replace("\\", "\\\\"),
                        "gpu": f"(0|{XID_GPU})", "device": f"({FLAPPING_PORT}|{DOWN_PORT}|{STUCK_PORT})"}
        yield lv
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(10)
        exporter.stop()


@pytest.mark.parametrize(("dashboard", "title", "ref", "expr"), panel_queries(),
                         ids=[f"{d}:{t}:{r}" for d, t, r, _ in panel_queries()])
def test_panel_query_returns_data(live: Live, dashboard: str, title: str, ref: str, expr: str) -> None:
    result = live.query(live.substitute(expr))
    assert result, f"{dashboard} / {title} / {ref}: no data for {live.substitute(expr)}"


def test_variable_queries_list_real_values(live: Live) -> None:
    for name, dash in dashboards().items():
        for var in dash["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
            assert m, f"{name}: variable {var['name']} is not a label_values() query"
            selector, label = m.group(1), m.group(2)
            values = {r["metric"].get(label) for r in live.query(f"count by ({label}) ({live.substitute(selector)})")}
            assert values - {None}, f"{name}: variable {var['name']} lists nothing"


def test_provoked_alerts_fire_and_nothing_else(live: Live) -> None:
    firing = live.firing()
    assert firing >= EXPECTED_ALERTS, f"not firing: {sorted(EXPECTED_ALERTS - firing)}"
    assert firing <= EXPECTED_ALERTS | MAY_FIRE, f"unexpected: {sorted(firing - EXPECTED_ALERTS - MAY_FIRE)}"


def test_host_inventory_counts_keep_a_lost_gpu(live: Live) -> None:
    """The count alerts' recording rules on a real exposition: 8 GPUs and 9 RDMA ports (8 NDR + the Ethernet
    VF), and GPU 3, lost by the injected XID 79, still counted (GpumonGpuLost reports it, not a lower count)."""
    assert ("GpumonGpuLost", str(XID_GPU)) in live.firing()
    gpus = live.query("instance:gpumon_gpus:count")
    ports = live.query("instance:gpumon_ib_ports:count")
    assert [float(r["value"][1]) for r in gpus] == [8.0], gpus
    assert [float(r["value"][1]) for r in ports] == [9.0], ports
    assert {k: v for k, v in gpus[0]["metric"].items() if k != "__name__"} == {
        "cluster": "sim", "job": "gpumon", "instance": gpus[0]["metric"]["instance"]}

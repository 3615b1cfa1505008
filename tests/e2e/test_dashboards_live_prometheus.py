"""A real Prometheus scrapes three gpumon daemons with injected faults; every dashboard panel's query
returns data and every alert the faults provoke fires (and no other).

- host a: a simulated ND H100 v5 with link faults, an XID 79, PCIe AER errors (a correctable one at GPU 3,
  a non-fatal one at an HCA) and GPU allocations (a pod on GPU 0, job 4242 on GPUs 3 and 5), behind its
  own IMDS stand-in (identity, placement, a pending Freeze) and KVP pool (physical host); its simulated
  kernel log and PCI tree feed the kernel-log and AER panels;
- host b: a simulated ND GB200 v6 in the same placement group on another physical host, whose GPU 1
  reports an unhealthy NVLink route;
- host c: gpumon's kmsg and aer collectors, not simulated, on this machine's kernel log (where readable)
  and a synthetic PCI tree with bridges and a root port (tests/collectors/test_aer_collector.py); off Azure, so
  without host identity.

Time is compressed for the test only: Prometheus scrapes and evaluates every second, and a copy of the
rules has each group's interval set to 1 s and each alert's `for:` set to 1 s. Grafana's built-in
variables are replaced the way Grafana would for a short dashboard range ($__rate_interval: 10s,
$__range: 1m, $__interval: 1s); the dashboard variables by real values read from Prometheus.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from gpumon.simulate import control
from gpumon.sources import kvp
from tests.conftest import REPO, GpumonProcess, PrometheusServer, clean_env, http_get, wait_for
from tests.fakes import imds as imds_server
from tests.fakes.aer_sysfs import build as build_pci_tree
from tests.support.dashboards import GRAFANA, dashboards, walk_panels

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus server")

RULES = os.path.join(REPO, "deploy", "prometheus")
BUILTINS = {"$__rate_interval": "10s", "$__range": "1m", "$__range_s": "60", "$__interval": "1s"}
FLAPPING_PORT = "mlx5_ib1"  # flapped past the flap threshold (5 in the window by default)
FLAPPED_ONCE = "mlx5_ib2"
DOWN_PORT = "mlx5_ib3"
STUCK_PORT = "mlx5_ib4"  # its 16-bit port_xmit_discards counter is stuck at 65535
XID_GPU = 3
AER_HCA = "mlx5_ib5"  # a non-fatal AER error at its PCI function
FABRIC_GPU = 1  # host b's GPU with an unhealthy NVLink route
POD, JOB_ID = "train-0", "4242"
ALLOCATIONS = [{"action": "allocate", "gpu": 0, "namespace": "ml", "pod": POD, "container": "main"},
               {"action": "allocate", "gpu": XID_GPU, "job_id": JOB_ID},
               {"action": "allocate", "gpu": 5, "job_id": JOB_ID}]
PLACEMENT_GROUP = "pg-sim-1"
KMSG = os.access("/dev/kmsg", os.R_OK)
"""Host c reads this machine's kernel log where it can (host a's simulated one feeds the panels anyway)."""

# What the injected faults must set off, as (alertname, host, identifying label) and nothing else.
EXPECTED_ALERTS = {
    ("GpumonIBPortDown", "a", DOWN_PORT),
    ("GpumonIBPortFlapping", "a", FLAPPING_PORT),
    ("GpumonIBLinkFlapped", "a", FLAPPING_PORT),
    ("GpumonIBLinkFlapped", "a", FLAPPED_ONCE),
    ("GpumonIBCounterSaturated", "a", STUCK_PORT),
    ("GpumonIBPortErrorsHigh", "a", STUCK_PORT),
    ("GpumonGpuXidCritical", "a", str(XID_GPU)),
    ("GpumonGpuLost", "a", str(XID_GPU)),
    ("GpumonPcieAerNonFatal", "a", AER_HCA),
    # The health rules judge host a unhealthy (a port down, a GPU lost).
    ("GpumonNodeUnhealthy", "a", ""),
    ("GpumonGpuFabricUnhealthy", "b", str(FABRIC_GPU)),
    # An unhealthy NVLink route makes host b unhealthy too (health rule gpu.fabric).
    ("GpumonNodeUnhealthy", "b", ""),
}
# The flapping port's link error recoveries (one per flap) may still be above the error-rate threshold
# when the alerts are read, or no longer: either is right.
# The linkflap collector also counts the down port's link_downed step as a flap.
MAY_FIRE = {("GpumonIBPortErrorsHigh", "a", FLAPPING_PORT), ("GpumonIBLinkFlapped", "a", DOWN_PORT)}


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
    hosts: dict[str, str]  # instance -> a, b, c

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, _, body = http_get(f"{self.url}/api/v1/query?query={urllib.parse.quote(expr)}", timeout=5)
        payload = json.loads(body)
        if status != 200:
            raise AssertionError(f"{expr}: {payload.get('errorType')}: {payload.get('error')}")
        return payload["data"]["result"]

    def firing(self) -> set[tuple[str, str, str]]:
        _, _, body = http_get(f"{self.url}/api/v1/alerts", timeout=5)
        out = set()
        for alert in json.loads(body)["data"]["alerts"]:
            if alert["state"] == "firing":
                labels = alert["labels"]
                key = labels.get("device") or labels.get("gpu") or labels.get("collector") or ""
                out.add((labels["alertname"], self.hosts.get(labels.get("instance", ""), "?"), key))
        return out

    def substitute(self, expr: str) -> str:
        for name in sorted(BUILTINS, key=len, reverse=True):
            expr = expr.replace(name, BUILTINS[name])
        for name, value in self.variables.items():
            expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
        assert "$" not in expr.replace("$1", ""), f"unsubstituted variable in {expr}"
        return expr


def fast_rules(tmp: str) -> list[str]:
    """Copies of the rule files with 1 s evaluation and 1 s `for:` (see the module docstring). The job
    rules come without their alerts: the Job dashboard reads their recorded series, and promtool tests the
    alerts on series built for them (deploy/prometheus/tests/job-*-test.yaml)."""
    paths = []
    for name in ("recording-rules.yaml", "alerting-rules.yaml", "job-rules.yaml"):
        with open(os.path.join(RULES, name), encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
        for group in doc["groups"]:
            group["interval"] = "1s"
            if name == "job-rules.yaml":
                group["rules"] = [rule for rule in group["rules"] if "record" in rule]
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = "1s"
        path = os.path.join(tmp, name)
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(doc, fh)
        paths.append(path)
    return paths


def kvp_pool(path: str, physical_host: str) -> str:
    """A Hyper-V KVP pool file as hv_kvp_daemon writes it, naming the physical host."""
    def record(key: str, value: str) -> bytes:
        return key.encode().ljust(kvp.KEY_SIZE, b"\0") + value.encode().ljust(kvp.VALUE_SIZE, b"\0")

    with open(path, "wb") as fh:
        fh.write(record("PhysicalHostName", physical_host))
    return path


def imds(name: str, vm_size: str, vm_id: str) -> imds_server.ImdsServer:
    return imds_server.ImdsServer({**imds_server.COMPUTE, "name": name, "vmSize": vm_size, "vmId": vm_id,
                                   "placementGroupId": PLACEMENT_GROUP, "vmScaleSetName": "sim"})


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    tmp = str(tmp_path_factory.mktemp("live"))
    states = {h: os.path.join(tmp, f"state-{h}") for h in "abc"}
    imds_a = imds("node-a", "Standard_ND96isr_H100_v5", "00000000-0000-4000-8000-00000000000a")
    imds_b = imds("node-b", "Standard_ND128isr_NDR_GB200_v6", "00000000-0000-4000-8000-00000000000b")
    imds_a.set_events(imds_server.scheduled_event("sim-freeze-1", "Freeze", resources=("node-a",),
                                                  not_before=imds_server.rfc1123(4102444800)))
    pci = pathlib.Path(tmp) / "pci"
    build_pci_tree(pci)
    exporters = {
        "a": GpumonProcess(["--simulate", "nd-h100-v5", "--interval", "1"], clean_env(
            GPUMON_DAEMON_STATE_DIR=states["a"], GPUMON_AZURE_IMDS_URL=imds_a.url,
            GPUMON_AZURE_IMDS_TIMEOUT="5",  # the stand-in answers from this busy test process
            GPUMON_HOST_INFO_KVP_POOL=kvp_pool(os.path.join(tmp, "kvp-a"), "SIM-RACK1-N01"),
            GPUMON_HOST_INFO_INTERVAL="1", GPUMON_AZURE_EVENTS_INTERVAL="1")),
        "b": GpumonProcess(["--simulate", "nd-gb200-v6", "--interval", "1"], clean_env(
            GPUMON_DAEMON_STATE_DIR=states["b"], GPUMON_AZURE_IMDS_URL=imds_b.url,
            GPUMON_AZURE_IMDS_TIMEOUT="5",  # the stand-in answers from this busy test process
            GPUMON_HOST_INFO_KVP_POOL=kvp_pool(os.path.join(tmp, "kvp-b"), "SIM-RACK1-N02"),
            GPUMON_HOST_INFO_INTERVAL="1", GPUMON_AZURE_EVENTS_INTERVAL="1")),
        "c": GpumonProcess(["--collectors", "aer,kmsg" if KMSG else "aer", "--sysfs-root", str(pci),
                            "--interval", "1"], clean_env(GPUMON_DAEMON_STATE_DIR=states["c"])),
    }
    prometheus = None
    try:
        for exporter in exporters.values():
            exporter.wait_ready(timeout=30)
        rules = fast_rules(tmp)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": rules,
            "scrape_configs": [{"job_name": "gpumon", "static_configs": [
                {"targets": [f"127.0.0.1:{e.port}" for e in exporters.values()], "labels": {"cluster": "sim"}}]}],
        }
        prometheus = PrometheusServer(tmp, config).start()
        lv = Live(prometheus.url, {}, {f"127.0.0.1:{e.port}": h for h, e in exporters.items()})

        def query_quietly(expr: str) -> list[dict[str, Any]]:
            try:
                return lv.query(expr)
            except (OSError, ValueError):
                return []

        # A few clean scrapes first, so counters have a baseline before the faults.
        wait_for(lambda: len(query_quietly('count_over_time(up{job="gpumon"}[1m]) >= 4')) == 3, timeout=40,
                 interval=0.2)
        workdir = os.path.join(states["a"], "simulate", "nd-h100-v5")
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
            {"action": "aer", "gpu": XID_GPU, "severity": "correctable", "type": "BadTLP"},
            {"action": "aer", "device": AER_HCA, "severity": "nonfatal", "type": "CmpltTO"},
        ]
        inject(workdir, faults + ALLOCATIONS)
        inject(os.path.join(states["b"], "simulate", "nd-gb200-v6"),
               [{"action": "fabric", "gpu": FABRIC_GPU, "health": {"route_unhealthy": "true"}}])
        try:
            wait_for(lambda: lv.firing() >= EXPECTED_ALERTS, timeout=40, interval=0.2)
        except AssertionError:
            raise AssertionError(f"alerts not firing within 40 s: {sorted(EXPECTED_ALERTS - lv.firing())}") from None
        # The series the newer panels read, before any panel is asked.
        for expr in ("count(gpumon_host_info) == 2", "gpumon_azure_scheduled_event",
                     "count(gpumon_gpu_allocation_info) == 3", "gpu:gpumon_power_swing:ratio",
                     "instance:gpumon_node_health:max", "gpumon_pcie_aer_errors_total",
                     'gpumon_kmsg_records_total{kind="gpu_off_bus"} > 0',
                     'gpumon_pcie_aer_error_types_total{type="BadTLP"}',
                     'gpumon_job:straggler_score{job_id="4242", gpu=""}', "gpumon_job_host:straggler_score"):
            try:
                wait_for(lambda expr=expr: query_quietly(expr), timeout=60, interval=0.2)
            except AssertionError:
                raise AssertionError(f"no data within 60 s for {expr}") from None

        cluster = [r["metric"]["cluster"] for r in lv.query("count by (cluster) (gpumon_build_info)")]
        instance = [r["metric"]["instance"] for r in lv.query("count by (instance) (gpumon_build_info)")]
        assert cluster == ["sim"] and len(instance) == 3
        hosts = "(" + "|".join(re.escape(i).replace("\\", "\\\\") for i in instance) + ")"
        lv.variables = {"datasource": "prometheus", "cluster": "sim", "instance": hosts,
                        "gpu": f"(0|{FABRIC_GPU}|{XID_GPU})", "device": f"({FLAPPING_PORT}|{DOWN_PORT}|{STUCK_PORT})",
                        "job_id": f"({JOB_ID}|)", "pod": f"({POD}|)"}
        yield lv
    finally:
        if prometheus is not None:
            prometheus.stop()
        for exporter in exporters.values():
            exporter.stop()
        imds_a.close()
        imds_b.close()


@pytest.mark.parametrize(("dashboard", "title", "ref", "expr"), panel_queries(),
                         ids=[f"{d}:{t}:{r}" for d, t, r, _ in panel_queries()])
def test_panel_query_returns_data(live: Live, dashboard: str, title: str, ref: str, expr: str) -> None:
    # Asked again for a few scrapes: a series a busy daemon left out of one scrape is stale at that
    # instant (Prometheus marks it so), as is every rule built on it, though a panel's range shows it.
    try:
        wait_for(lambda: live.query(live.substitute(expr)), timeout=10, interval=0.5)
    except AssertionError:
        raise AssertionError(f"{dashboard} / {title} / {ref}: no data for {live.substitute(expr)}") from None


KERNEL_PANELS = [q for q in panel_queries() if "gpumon_kmsg_" in q[3] or "gpumon_pcie_aer" in q[3]]
FABRIC_PANELS = [q for q in panel_queries() if "gpumon_gpu_fabric_" in q[3] or "gpumon_gpu_nvlink_" in q[3]]


def _on_host_alone(live: Live, host: str, where: str, expr: str) -> None:
    """The query with ``$instance`` set to one host returns data from that host alone."""
    address = next(i for i, h in live.hosts.items() if h == host)
    only = Live(live.url, {**live.variables, "instance": re.escape(address).replace("\\", "\\\\")}, live.hosts)
    result = only.query(only.substitute(expr))
    assert result, f"{where}: no data from host {host} for {only.substitute(expr)}"
    assert {r["metric"].get("instance", address) for r in result} == {address}


@pytest.mark.parametrize(("dashboard", "title", "ref", "expr"), KERNEL_PANELS,
                         ids=[f"{d}:{t}:{r}" for d, t, r, _ in KERNEL_PANELS])
def test_kernel_log_and_aer_panels_show_the_simulated_host(live: Live, dashboard: str, title: str, ref: str,
                                                           expr: str) -> None:
    """The kernel-log and AER panels on host a alone: the simulated host's log and PCI tree feed them."""
    _on_host_alone(live, "a", f"{dashboard} / {title} / {ref}", expr)


@pytest.mark.parametrize(("dashboard", "title", "ref", "expr"), FABRIC_PANELS,
                         ids=[f"{d}:{t}:{r}" for d, t, r, _ in FABRIC_PANELS])
def test_nvlink_and_fabric_panels_show_the_simulated_gb200(live: Live, dashboard: str, title: str, ref: str,
                                                           expr: str) -> None:
    """The NVLink and fabric panels on host b alone: a simulated ND GB200 v6 (multi-node NVLink) feeds
    them by itself, without the H100 host's NVSwitch fabric."""
    _on_host_alone(live, "b", f"{dashboard} / {title} / {ref}", expr)


def test_no_panel_of_any_dashboard_is_left_out_of_the_live_check() -> None:
    """Every panel query of every shipped dashboard is asked above (the count the docs quote)."""
    shipped = sorted(f for f in os.listdir(GRAFANA) if f.endswith(".json"))
    assert sorted({d for d, _, _, _ in panel_queries()}) == shipped
    assert len(FABRIC_PANELS) >= 8 and len(KERNEL_PANELS) >= 4


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
    assert ("GpumonGpuLost", "a", str(XID_GPU)) in live.firing()
    a = next(i for i, h in live.hosts.items() if h == "a")
    gpus = live.query(f'instance:gpumon_gpus:count{{instance="{a}"}}')
    ports = live.query(f'instance:gpumon_ib_ports:count{{instance="{a}"}}')
    assert [float(r["value"][1]) for r in gpus] == [8.0], gpus
    assert [float(r["value"][1]) for r in ports] == [9.0], ports
    assert {k: v for k, v in gpus[0]["metric"].items() if k != "__name__"} == {
        "cluster": "sim", "job": "gpumon", "instance": gpus[0]["metric"]["instance"]}

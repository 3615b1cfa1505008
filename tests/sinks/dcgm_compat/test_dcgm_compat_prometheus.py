"""Compat mode scraped by a real Prometheus answers dcgm-exporter's own dashboard and alert queries.

The expressions are those of dcgm-exporter's Grafana dashboard (grafana/dcgm-exporter-dashboard.json:
temperature, power, SM clock, utilisation, framebuffer, tensor activity, and its `gpu` and `instance`
variables) and of the XID alert people write against it, with the variables filled in.
"""

from __future__ import annotations

import json
import urllib.parse

from gpumon.simulate import control
from tests.conftest import http_get, wait_for

DASHBOARD = [
    'DCGM_FI_DEV_GPU_TEMP{instance=~".*", gpu=~".*"}',
    'avg(DCGM_FI_DEV_GPU_TEMP{instance=~".*", gpu=~".*"})',
    'DCGM_FI_DEV_POWER_USAGE{instance=~".*", gpu=~".*"}',
    'sum(DCGM_FI_DEV_POWER_USAGE{instance=~".*", gpu=~".*"})',
    'DCGM_FI_DEV_SM_CLOCK{instance=~".*", gpu=~".*"} * 1000000',
    'DCGM_FI_DEV_GPU_UTIL{instance=~".*", gpu=~".*"}',
    'DCGM_FI_DEV_FB_USED{instance=~".*", gpu=~".*"}',
    'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~".*", gpu=~".*"}',
]


def test_dcgm_exporter_dashboard_queries_work_unchanged(gpumon_run, prometheus_server, tmp_path) -> None:
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1",
                         env={"GPUMON_PROMETHEUS_COMPAT": "dcgm-exporter", "GPUMON_ATTRIBUTION_INTERVAL": "1"})
    control(str(tmp_path / "state" / "simulate" / "nd-h100-v5"),
            {"action": "allocate", "gpu": 4, "namespace": "ml", "pod": "train-0", "container": "main"})
    wait_for(lambda: 'pod="train-0"' in process.metrics(), timeout=20)
    prom = prometheus_server({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "gpumon", "static_configs": [{"targets": [f"127.0.0.1:{process.port}"]}]}]})
    wait_for(lambda: len(prom.query("DCGM_FI_DEV_GPU_TEMP")) == 8, timeout=30)
    for expr in DASHBOARD:
        result = prom.query(expr)
        assert result, expr
        assert len(result) == (1 if expr.startswith(("avg", "sum")) else 8), expr
        assert all(float(r["value"][1]) >= 0 for r in result), expr
    power = sum(float(r["value"][1]) for r in prom.query('DCGM_FI_DEV_POWER_USAGE'))
    gpumon_power = float(prom.query("sum(gpumon_gpu_power_watts)")[0]["value"][1])
    assert abs(power - gpumon_power) < 1e-6 * max(1.0, gpumon_power)  # same scrape, same values
    status, _, body = http_get(f"{prom.url}/api/v1/label/gpu/values?"
                               + urllib.parse.urlencode({"match[]": "DCGM_FI_DEV_GPU_TEMP"}))
    assert status == 200 and json.loads(body)["data"] == [str(i) for i in range(8)]
    assert prom.query("DCGM_FI_DEV_XID_ERRORS > 0") == []  # the usual XID alert: quiet on a healthy host
    by_pod = prom.query('DCGM_FI_DEV_GPU_UTIL{namespace="ml", pod="train-0"}')
    assert [r["metric"]["gpu"] for r in by_pod] == ["4"] and by_pod[0]["metric"]["container"] == "main"
    labels = prom.query('DCGM_FI_DEV_GPU_TEMP{gpu="0"}')[0]["metric"]
    assert labels["device"] == "nvidia0" and labels["modelName"] == "NVIDIA H100 80GB HBM3"
    assert labels["UUID"].startswith("GPU-") and labels["DCGM_FI_DRIVER_VERSION"] == "550.90.07"


def test_health_endpoint_serves_the_verdict_as_json(gpumon_run, tmp_path) -> None:
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1")
    def held_to_the_sku() -> dict | None:  # the VM size comes from the simulated host's IMDS, off the loop
        status, _, body = http_get(process.url + "/health")
        return json.loads(body) if status == 200 and json.loads(body)["sku"] == "ND H100 v5" else None

    verdict = wait_for(held_to_the_sku, timeout=20)
    assert verdict["status"] == "healthy" and verdict["findings"] == []
    control(str(tmp_path / "state" / "simulate" / "nd-h100-v5"), {"action": "xid", "gpu": 3, "xid": 79})
    def lost(verdict: dict) -> dict | None:  # the lost GPU's own finding (its absence shows first)
        return verdict if any(f["rule"] == "gpu.lost" and f["subject"] == {"gpu": "3"}
                              for f in verdict["findings"]) else None

    unhealthy = wait_for(lambda: lost(json.loads(http_get(process.url + "/health")[2])), timeout=10)
    assert unhealthy["status"] == "unhealthy" and unhealthy["action"] == "reboot"
    assert http_get(process.url + "/healthz")[0] == 200  # the liveness probe is not the verdict
    wait_for(lambda: "gpumon_node_health 2" in process.metrics(), timeout=10)


MIG_QUERIES = [  # what MIG panels written against dcgm-exporter ask, per GPU instance
    'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0", GPU_I_PROFILE="1g.10gb"}',
    'avg by (gpu, GPU_I_ID) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{GPU_I_ID!=""})',
    'DCGM_FI_DEV_FB_USED{GPU_I_ID!=""} / (DCGM_FI_DEV_FB_USED{GPU_I_ID!=""} + DCGM_FI_DEV_FB_FREE{GPU_I_ID!=""})',
    'sum by (Hostname, gpu, GPU_I_PROFILE, GPU_I_ID) (DCGM_FI_DEV_FB_USED{GPU_I_ID!=""})',
]


def test_dcgm_exporter_mig_queries_work_per_gpu_instance(gpumon_run, prometheus_server, tmp_path) -> None:
    # MIG on before gpumon starts (the simulated host applies the file as it comes up)
    control(str(tmp_path / "state" / "simulate" / "nd-h100-v5"), {"action": "mig", "gpu": 0, "instances": 7})
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1",
                         env={"GPUMON_PROMETHEUS_COMPAT": "dcgm-exporter"})
    prom = prometheus_server({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "gpumon", "static_configs": [{"targets": [f"127.0.0.1:{process.port}"]}]}]})
    wait_for(lambda: len(prom.query('DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0"}')) == 7, timeout=30)
    for expr in MIG_QUERIES:
        result = prom.query(expr)
        assert len(result) == 7, expr
        assert {r["metric"].get("GPU_I_ID") for r in result} == {str(gi) for gi in range(7, 14)}, expr
        assert all(float(r["value"][1]) >= 0 for r in result), expr
    share = prom.query(MIG_QUERIES[2])
    assert all(0 < float(r["value"][1]) < 1 for r in share)
    temps = prom.query("DCGM_FI_DEV_GPU_TEMP")
    assert len(temps) == 7 + 7  # GPU 0 once per instance, the seven others once each
    assert prom.query('DCGM_FI_DEV_GPU_UTIL{gpu="0"}') == []  # blank under MIG, as DCGM leaves it

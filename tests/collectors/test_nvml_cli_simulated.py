"""`gpumon once --collectors nvml --simulate PROFILE --format json` shows the whole GPU picture."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import clean_env

EXPECTED = {
    "gpumon_gpu_info": "", "gpumon_gpu_utilization_ratio": "ratio", "gpumon_gpu_memory_used_bytes": "bytes",
    "gpumon_gpu_memory_total_bytes": "bytes", "gpumon_gpu_memory_reserved_bytes": "bytes",
    "gpumon_gpu_bar1_used_bytes": "bytes", "gpumon_gpu_temperature_celsius": "celsius",
    "gpumon_gpu_temperature_threshold_celsius": "celsius", "gpumon_gpu_power_watts": "watts",
    "gpumon_gpu_power_limit_watts": "watts", "gpumon_gpu_energy_joules_total": "joules",
    "gpumon_gpu_clock_hertz": "hertz", "gpumon_gpu_clock_max_hertz": "hertz",
    "gpumon_gpu_clock_event_reason_active": "", "gpumon_gpu_clock_event_violation_seconds_total": "seconds",
    "gpumon_gpu_pcie_link_generation": "", "gpumon_gpu_pcie_link_width": "", "gpumon_gpu_pcie_replay_total": "",
    "gpumon_gpu_ecc_errors_total": "", "gpumon_gpu_remapped_rows": "", "gpumon_gpu_performance_state": "",
    "gpumon_gpu_compute_processes": "", "gpumon_gpu_lost": "",
}
H100_ONLY = {"gpumon_gpu_nvlink_links_active": "", "gpumon_gpu_nvlink_errors_total": "",
             "gpumon_gpu_nvlink_bytes_total": "bytes", "gpumon_gpu_activity_ratio": "ratio"}


def once(profile: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "gpumon", "once", "--collectors", "nvml", "--simulate", profile,
                             "--format", "json"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_h100_host_shows_every_family_with_units():
    doc = once("nd-h100-v5")
    metrics = {m["name"]: m for m in doc["metrics"]}
    for name, unit in {**EXPECTED, **H100_ONLY}.items():
        assert name in metrics, name
        assert metrics[name]["unit"] == unit, name
    info = metrics["gpumon_gpu_info"]["samples"]
    assert len(info) == 8 and all("H100" in s["labels"]["model"] for s in info)
    assert {s["labels"]["gpu"] for s in info} == {str(i) for i in range(8)}
    for s in metrics["gpumon_gpu_utilization_ratio"]["samples"]:
        assert 0.0 <= s["value"] <= 1.0
    power = {s["labels"]["gpu"]: s["value"] for s in metrics["gpumon_gpu_power_watts"]["samples"]}
    limit = {s["labels"]["gpu"]: s["value"] for s in metrics["gpumon_gpu_power_limit_watts"]["samples"]}
    assert all(0 < power[g] <= limit[g] <= 1000 for g in power)
    assert {c["name"]: c["ok"] for c in doc["collectors"]} == {"nvml": True, "xid": True}


def test_a10_has_a_fan_and_no_nvlink():
    metrics = {m["name"]: m for m in once("nv-a10-v5")["metrics"]}
    assert "gpumon_gpu_nvlink_links_active" not in metrics or all(
        s["value"] == 0 for s in metrics["gpumon_gpu_nvlink_links_active"]["samples"])
    assert any(name.startswith("gpumon_gpu_fan") for name in metrics)
    assert len(metrics["gpumon_gpu_info"]["samples"]) == 1

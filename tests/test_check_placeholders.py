"""`gpumon check` names every key of the shipped examples still holding its placeholder (the all-zero
GUID, dcr-000…, the example endpoints), with where the value came from, and does not probe a sink with
them (a token request could only fail, with a message about the credential instead of the key)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpumon import placeholders
from gpumon.config import tomllib
from tests.conftest import REPO

OVERLAY = Path(REPO) / "deploy/kubernetes/overlays/azure-logs"


def overlay_environment() -> dict[str, str]:
    """What a pod of the azure-logs overlay gets: azure.env through envFrom, and AZURE_CLIENT_ID, which
    the workload identity webhook copies from the service account's annotation."""
    env = dict(line.split("=", 1) for line in (OVERLAY / "azure.env").read_text().splitlines()
               if line and not line.startswith("#"))
    docs = list(yaml.safe_load_all((OVERLAY / "workload-identity.yaml").read_text()))
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    env["AZURE_CLIENT_ID"] = account["metadata"]["annotations"]["azure.workload.identity/client-id"]
    return env


def check(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMON_", "AZURE_"))}
    # No IMDS answers on this port: the Azure collectors are skipped at once.
    full = {**base, "GPUMON_AZURE_IMDS_URL": "http://127.0.0.1:9", "GPUMON_DAEMON_STATE_DIR": str(tmp_path),
            **env}
    return subprocess.run([sys.executable, "-m", "gpumon", "check", "--listen", "127.0.0.1:0",
                           "--sysfs-root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False, env=full, cwd=REPO)


def test_the_azure_logs_overlay_as_shipped_is_flagged_key_by_key(tmp_path):
    result = check(tmp_path, overlay_environment())
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"^config +\[azure_monitor\] dcr_immutable_id +FAIL +environment variable "
                     r"GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID: is still dcr-000…000", out, re.M), out
    assert re.search(r"^config +\[azure_monitor\] endpoint +FAIL +environment variable GPUMON_AZURE_MONITOR_ENDPOINT: "
                     r"still names gpumon-dce\.eastus-1\.ingest\.monitor\.azure\.com", out, re.M), out
    assert re.search(r"^config +AZURE_CLIENT_ID +FAIL +environment variable: is still 00000000-0000-0000-0000-000000000000"
                     r".*azure\.workload\.identity/client-id", out, re.M), out
    assert re.search(r"^sink +azure_monitor +FAIL +not probed: \[azure_monitor\] endpoint, "
                     r"\[azure_monitor\] dcr_immutable_id, AZURE_CLIENT_ID still a placeholder", out, re.M), out
    assert "token" not in out  # no credential was tried
    assert re.search(r"^sink +prometheus +ok", out, re.M)


def test_filled_in_values_are_not_flagged():
    from gpumon.cli import schemas
    from gpumon.config import load

    shipped = overlay_environment()
    filled = shipped | {
        "GPUMON_AZURE_MONITOR_ENDPOINT": "https://gpu-fleet-dce-x1yz.westus3-1.ingest.monitor.azure.com",
        "GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID": "dcr-5f0a3c2e9b8d4f7a8e6c1b2d3a4f5e6d",
        "AZURE_CLIENT_ID": "9b7f0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d",
    }
    found = {}
    for name, env in (("shipped", shipped), ("filled", filled)):
        config = load(schemas(), None, env, {})
        found[name] = [p.where for p in placeholders.find(config.sections, config.origin, env)]
    assert found == {"shipped": ["[azure_monitor] endpoint", "[azure_monitor] dcr_immutable_id", "AZURE_CLIENT_ID"],
                     "filled": []}


def shipped_values() -> list[tuple[str, str]]:
    """Every value the shipped examples leave for the operator to fill in."""
    found = [(f"azure.env {k}", v) for k, v in overlay_environment().items()
             if k in ("GPUMON_AZURE_MONITOR_ENDPOINT", "GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID", "AZURE_CLIENT_ID")]
    for name in ("cloud-init.yaml", "cloud-init-managed-prometheus.yaml"):
        doc = yaml.safe_load((Path(REPO) / "deploy/vm" / name).read_text())
        for f in doc["write_files"]:
            if f["path"].endswith(".toml"):
                for section, values in tomllib.loads(f["content"]).items():
                    found += [(f"{name} [{section}] {k}", v) for k, v in values.items()
                              if k in ("client_id", "endpoint", "dcr_immutable_id", "url")]
    return found


@pytest.mark.parametrize(("where", "value"), shipped_values())
def test_every_stand_in_of_the_shipped_files_is_recognised(where, value):
    assert placeholders.describe(value), f"{where} = {value!r} would not be flagged by gpumon check"


@pytest.mark.parametrize("value", ["9b7f0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d", "dcr-00000000000000000000000000000001",
                                   "https://x.eastus-1.ingest.monitor.azure.com", "", "00000000"])
def test_real_looking_values_pass(value):
    assert placeholders.describe(value) is None


def test_placeholders_of_a_sink_that_is_not_enabled_are_not_flagged(tmp_path):
    # The overlay's azure.env with the Azure Monitor sink left out: its section is not used.
    result = check(tmp_path, overlay_environment() | {"GPUMON_DAEMON_SINKS": "prometheus"})
    assert "FAIL" not in result.stdout, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr

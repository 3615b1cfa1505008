"""The shipped systemd unit: it verifies, scores <= 2.0 exposure, and keeps NVML's access.

Needs systemd-analyze (Debian package ``systemd``, systemd 252 here).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "gpumon.service"
NODE_EXPORTER_UNIT = Path("/lib/systemd/system/prometheus-node-exporter.service")
MAX_EXPOSURE = 2.0


def _analyze() -> str:
    path = shutil.which("systemd-analyze")
    assert path, "systemd-analyze is missing: apt-get install systemd"
    return path


def exposure(unit: Path) -> float:
    """The overall exposure systemd-analyze prints for a unit file, without a running systemd."""
    out = subprocess.run(
        [_analyze(), "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert match, f"no exposure in systemd-analyze output:\n{out.stdout}\n{out.stderr}"
    return float(match.group(1))


def directives(unit: Path) -> dict[str, list[str]]:
    """Key -> every value it is given, in order (comments and sections dropped)."""
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def test_unit_exposure_is_at_most_two():
    score = exposure(UNIT)
    assert score <= MAX_EXPOSURE, f"gpumon.service exposure {score} > {MAX_EXPOSURE}"


def test_unit_scores_better_than_debians_node_exporter():
    # The comparison docs/deployment.md quotes; node_exporter's unit has no sandboxing at all.
    assert NODE_EXPORTER_UNIT.exists(), "apt-get install prometheus-node-exporter"
    assert exposure(UNIT) < exposure(NODE_EXPORTER_UNIT)


def test_unit_verifies_once_its_executable_exists(tmp_path):
    # verify insists that ExecStart= names an executable; point it at a real one in a copy.
    unit = tmp_path / "gpumon.service"
    unit.write_text(UNIT.read_text().replace("/opt/gpumon/bin/gpumon", shutil.which("true") or "/bin/true"))
    out = subprocess.run(
        [_analyze(), "verify", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "gpumon.service" not in out.stderr, out.stderr


def test_unit_is_a_notify_service_with_a_watchdog():
    d = directives(UNIT)
    assert d["Type"] == ["notify"]
    assert d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] and d["WatchdogSec"][0].endswith("s")
    assert d["Restart"] == ["on-failure"]
    assert d["RestartPreventExitStatus"] == ["2"], "a bad config (exit 2) must not restart-loop"
    assert d["StateDirectory"] == ["gpumon"]
    assert d["ExecStart"][0].startswith("/opt/gpumon/bin/gpumon run")
    assert "--config /etc/gpumon/gpumon.toml" in d["ExecStart"][0]


def test_unit_keeps_nvml_and_sysfs_reachable():
    d = directives(UNIT)
    # NVML needs the NVIDIA character devices; a private /dev would hide them.
    assert d.get("PrivateDevices", ["no"]) == ["no"]
    assert d["DevicePolicy"] == ["closed"]
    allowed = {v.split()[0] for v in d["DeviceAllow"]}
    assert {"char-nvidia-frontend", "char-nvidia", "char-nvidia-caps"} <= allowed
    assert "video" in d["SupplementaryGroups"][0].split()
    # /proc/driver/nvidia must stay visible, and /sys must not be masked.
    assert "ProcSubset" not in d
    assert not any("/sys" in v for v in d.get("InaccessiblePaths", []))
    # No JIT in NVML, so W^X holds.
    assert d["MemoryDenyWriteExecute"] == ["yes"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("DynamicUser", "yes"),
    ],
)
def test_unit_hardening_the_issue_asks_for(key, value):
    assert directives(UNIT)[key] == [value]


def test_unit_filters_system_calls_to_the_service_set():
    assert directives(UNIT)["SystemCallFilter"][0] == "@system-service"


def test_secrets_come_from_a_root_only_environment_file():
    assert directives(UNIT)["EnvironmentFile"] == ["-/etc/gpumon/gpumon.env"]


KMSG_DROP_IN = REPO / "systemd" / "gpumon.service.d" / "kmsg.conf"


def with_drop_in(tmp_path: Path) -> Path:
    """The unit as systemd sees it with the kmsg drop-in: its [Service] lines after the unit's own."""
    text = UNIT.read_text()
    extra = "".join(line + "\n" for line in KMSG_DROP_IN.read_text().splitlines()
                    if line.strip() and not line.startswith(("#", "[")))
    merged = tmp_path / "gpumon.service"
    merged.write_text(text.replace("[Install]", extra + "\n[Install]").replace(
        "/opt/gpumon/bin/gpumon", shutil.which("true") or "/bin/true"))
    return merged


def test_kmsg_drop_in_keeps_exposure_at_most_two_and_verifies(tmp_path):
    merged = with_drop_in(tmp_path)
    assert exposure(merged) <= MAX_EXPOSURE
    out = subprocess.run([_analyze(), "verify", "--no-pager", str(merged)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and "gpumon.service" not in out.stderr, out.stderr
    d = directives(merged)
    assert d["CapabilityBoundingSet"][-1] == "CAP_SYSLOG" and d["AmbientCapabilities"][-1] == "CAP_SYSLOG"
    assert "/dev/kmsg r" in d["DeviceAllow"] and d["ProtectKernelLogs"][-1] == "no"

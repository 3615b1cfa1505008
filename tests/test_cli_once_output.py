"""What `gpumon once` shows a person: the answer on stdout, warnings (not INFO chatter) on stderr, and
values without float noise."""

from __future__ import annotations

import re
import subprocess
import sys

from gpumon.model import MetricFamily, MetricSpec, MetricType
from gpumon.render import Renderer
from gpumon.stages.selfmetrics import SelfMetrics
from tests.conftest import clean_env


def once(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", "once", "--simulate", "nd-h100-v5", *args],
                          env=clean_env(**env), capture_output=True, text=True, timeout=20)


def test_once_keeps_info_lines_off_stderr_unless_asked():
    quiet = once("--format", "json")
    assert quiet.returncode == 0, quiet.stderr
    assert " INFO " not in quiet.stderr, quiet.stderr
    flagged = once("--format", "json", "--log-level", "info")
    assert "INFO gpumon.nvml: NVML initialised" in flagged.stderr, flagged.stderr
    from_env = once("--format", "json", GPUMON_DAEMON_LOG_LEVEL="info")
    assert "INFO gpumon.nvml: NVML initialised" in from_env.stderr, from_env.stderr


def test_once_still_shows_warnings(tmp_path):
    config = tmp_path / "gpumon.toml"
    config.write_text('[daemon]\nlog_level = "info"\n')  # the daemon's level, not once's
    result = subprocess.run([sys.executable, "-m", "gpumon", "once", "--config", str(config), "--sysfs-root",
                             str(tmp_path), "--collectors", "infiniband"], env=clean_env(),
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 1
    assert " INFO " not in result.stderr
    assert "collector 'infiniband' is unavailable" in result.stderr


def test_process_seconds_have_no_float_noise():
    families = SelfMetrics().families({}, {})
    page = Renderer().render(families)
    cpu = re.search(r"^process_cpu_seconds_total (\S+)$", page, re.M)
    assert cpu is not None, page
    assert re.fullmatch(r"\d+(\.\d{1,6})?", cpu.group(1)), cpu.group(1)
    start = re.search(r"^process_start_time_seconds (\S+)$", page, re.M)
    assert start is not None and re.fullmatch(r"\d+(\.\d{1,6})?", start.group(1)), page


def test_renderer_prints_the_shortest_round_trip_value():
    spec = MetricSpec("gpumon_test_seconds", MetricType.GAUGE, "t", "seconds")
    page = Renderer().render([MetricFamily(spec, (spec.sample(0.14),))])
    assert page.splitlines()[-1] == "gpumon_test_seconds 0.14"
    noisy = Renderer().render([MetricFamily(spec, (spec.sample(0.1 + 0.04),))])
    assert float(noisy.splitlines()[-1].split()[1]) == 0.1 + 0.04  # measured values are kept exactly

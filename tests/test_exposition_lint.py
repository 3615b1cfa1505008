"""`promtool check metrics` is clean on the whole page of every simulated host, opt-ins included."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpumon.simulate.sysfs import build_tree
from tests.conftest import clean_env


def lint(*args: str, **env: str) -> tuple[str, str]:
    page = subprocess.run([sys.executable, "-m", "gpumon", "once", "--format", "prometheus", *args],
                          env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert page.returncode == 0, page.stderr
    result = subprocess.run(["promtool", "check", "metrics"], input=page.stdout, capture_output=True, text=True,
                            timeout=30)
    return page.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("profile", ["nd-h100-v5", "nd-a100-v4", "nv-a10-v5", "hbv4"])
def test_simulated_hosts_lint_clean(profile):
    page, problems = lint("--simulate", profile)
    assert problems == "", problems
    assert "gpumon_build_info" in page


def test_opt_in_detail_lints_clean_too():
    page, problems = lint("--simulate", "nd-h100-v5", GPUMON_NVML_NVLINK_PER_LINK="true",
                          GPUMON_NVML_PER_PROCESS="true")
    assert problems == "", problems


def test_saturated_and_pma_less_trees_lint_clean(tmp_path):
    for profile in ("saturated-link-downed", "old-kernel-no-pma"):
        root = tmp_path / profile
        build_tree(profile, str(root))
        page, problems = lint("--collectors", "infiniband", "--sysfs-root", str(root),
                              GPUMON_DAEMON_STATE_DIR=str(root))
        assert problems == "", problems


def test_default_series_budget_for_an_nd_h100_v5_host():
    """Cardinality is cost: 8 GPUs and 9 ports stay within 2,500 series with the defaults."""
    page, _ = lint("--simulate", "nd-h100-v5")
    series = [line for line in page.splitlines() if line and not line.startswith("#")]
    assert len(series) <= 2500, len(series)

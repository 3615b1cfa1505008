"""Cardinality with attribution on: a simulated ND H100 v5 with a pod on each of its 8 GPUs stays
within the default series budget (2,500, as tests/test_exposition_lint.py holds without pods), and
`[prometheus] compat = "dcgm-exporter"` adds at most 300 series to it."""

from __future__ import annotations

from gpumon.simulate import control
from tests.conftest import wait_for
from tests.support.attribution import allocation_rows

PODS = {(str(gpu), "ml", f"train-{gpu}", "main", "") for gpu in range(8)}


def series(page: str) -> list[str]:
    return [line for line in page.splitlines() if line and not line.startswith("#")]


def page_with_eight_pods(gpumon_run, tmp_path, **env: str) -> str:
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1",
                         env={"GPUMON_ATTRIBUTION_INTERVAL": "1", **env})
    sim = str(tmp_path / "state" / "simulate" / "nd-h100-v5")
    for gpu in range(8):
        control(sim, {"action": "allocate", "gpu": gpu, "namespace": "ml", "pod": f"train-{gpu}",
                      "container": "main"})
    wait_for(lambda: allocation_rows(process.metrics()) == PODS, timeout=15)
    page = process.metrics()
    process.stop()
    return page


def test_eight_pods_stay_within_the_budget_and_compat_adds_at_most_300(gpumon_run, tmp_path) -> None:
    plain = series(page_with_eight_pods(gpumon_run, tmp_path))
    assert len(plain) <= 2500, len(plain)
    compat = series(page_with_eight_pods(gpumon_run, tmp_path, GPUMON_PROMETHEUS_COMPAT="dcgm-exporter"))
    dcgm = [line for line in compat if line.startswith("DCGM_")]
    assert dcgm and all('pod="train-' in line for line in dcgm)  # dcgm-exporter's labels, from the pods
    assert len(compat) - len(plain) <= 300, (len(plain), len(compat))

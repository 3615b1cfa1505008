"""The benchmark harness runs end to end in its tiny "smoke" mode and writes one JSON per benchmark.

No timing is asserted (the figures live in docs/performance.md); this pins that every benchmark
still drives the current code and produces the figures its README line promises.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Fast benchmarks: each starts at most a couple of processes. The slower ones (scrape, memory, flap,
# azure_volume) are proven by `python -m bench --smoke` in full; the keys below pin the fast set.
FAST = {
    "ib_cpu": ("ratio_median", "gpumon_cpu_ms_per_run", "node_exporter_cpu_ms_per_scrape"),
    "watcher": ("cpu_ms_per_run", "intervals"),
    "nvml_calls": ("profiles", "h100_calls_per_gpu_per_run"),
    "scale": ("gpus", "ports"),
    "startup": ("cases", "target_met"),
    "cycle": ("without_health", "with_health"),
    "process_util": ("cpu_ms_added_per_run", "series_added", "nvml_calls_per_run_on"),
    "scheduled_events": ("event_to_metrics_s_median", "after_simulator_pickup_s_median", "target_met"),
}


def run_bench(tmp_path, *names: str) -> subprocess.CompletedProcess:
    """The benchmarks in smoke mode; the time limit only bounds a hung run (seven smoke benchmarks take
    about 20 s alone and several times that beside the suite's other workers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON_")}
    return subprocess.run([sys.executable, "-m", "bench", "--smoke", "--quiet", "--out", str(tmp_path), *names],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(shutil.which("prometheus-node-exporter") is None and shutil.which("node_exporter") is None,
                    reason="node_exporter is not installed (Debian: prometheus-node-exporter)")
def test_fast_benchmarks_write_their_figures(tmp_path):
    proc = run_bench(tmp_path, *FAST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, keys in FAST.items():
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert data["benchmark"] == name and data["smoke"] is True
        assert "error" not in data, data["error"]
        for key in keys:
            assert key in data, f"{name}.json lacks {key}"
        assert data["machine"]["nproc"] >= 1
    ib = json.loads((tmp_path / "ib_cpu.json").read_text())
    assert ib["ports"] == 9 and ib["gpumon_series"] > 0 and ib["ratio_median"] > 0
    calls = json.loads((tmp_path / "nvml_calls.json").read_text())
    assert set(calls["profiles"]) >= {"h100-sxm5-80gb"}
    assert all(p["calls_per_gpu_per_run_max"] > 0 for p in calls["profiles"].values())
    cycle = json.loads((tmp_path / "cycle.json").read_text())
    for case in ("without_health", "with_health"):
        assert cycle[case]["series"] > 1000 and cycle[case]["overhead_ms_median"] > 0
        assert set(cycle[case]["collectors"]) >= {"nvml", "infiniband"}
    scale = json.loads((tmp_path / "scale.json").read_text())
    assert [row["gpus"] for row in scale["gpus"]] == [1, 8]
    assert scale["gpus"][1]["series"] > scale["gpus"][0]["series"]


def test_unknown_benchmark_is_a_usage_error(tmp_path):
    proc = run_bench(tmp_path, "no_such_benchmark")
    assert proc.returncode == 2
    assert "unknown benchmark" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_real_gpu_measures_only_where_a_gpu_is(tmp_path):
    """Without an NVIDIA GPU the benchmark says why and measures nothing (it must not fail the run);
    with one, it writes both intervals' shares."""
    proc = run_bench(tmp_path, "real_gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "real_gpu.json").read_text())
    if "not_run" in data:
        assert data["not_run"] and "defaults" not in data
    else:
        assert data["defaults"]["share_of_one_core"] > 0 and data["interval_1s"]["share_of_one_core"] > 0


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus server (Debian package prometheus)")
def test_job_rules_bench_names_the_throttled_gpu(tmp_path):
    """The job rules on a real Prometheus over generated hosts, with the lemon group's history backfilled:
    every group evaluates without a failure, the job groups add series, the one GPU the generator throttles
    is the job's worst, and each lemon rule's reads are counted."""
    proc = run_bench(tmp_path, "job_rules", "--history", "0.02")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "job_rules.json").read_text())
    assert "error" not in data, data.get("error")
    # the backfilled lemon history and the live series are the same series (no label differs)
    joined = data["history"]["joined"]
    assert set(joined) >= {"serial:gpumon_gpu_remapped_rows:sum", "serial:gpumon_gpu_ecc_corrected:max"}
    assert all(row["ever"] == row["backfilled"] > 0 for row in joined.values()), joined
    reads = {row["rule"]: row["samples_read"] for row in data["lemon_rule_reads"]}
    assert {"serial:gpumon_gpu_remapped_rows:increase5m", "serial:gpumon_gpu_ecc_corrected:rate1d"} <= set(reads)
    assert reads["serial:gpumon_gpu_remapped_rows:increase5m"] > 0, reads
    assert data["rule_evaluation_failures"] == 0
    assert {"gpumon-job-members", "gpumon-job-signal-sm-clock", "gpumon-job-score-gpus-159", "gpumon-job-straggler",
            "gpumon-job-stall", "gpumon-job-lemons"} <= set(data["groups"])
    assert data["job_series_per_host"] > 0 and data["host_own_series"] > 1000
    top = data["top_straggler"]
    assert (top["instance"], top["gpu"], top["job_id"]) == ("bench-0001", "5", "bench-1"), top

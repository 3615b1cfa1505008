"""NVML calls per GPU per run for each simulated GPU profile, and the collector's CPU per run.

The NVML double counts every call and the GPU it names (:meth:`FakeNVML.calls_for_gpu`). After the
first run (initialisation, static identity, the probes that drop what a GPU refuses) and a few more,
the counts are reset and the collector runs R times with the default metric set: calls per GPU per
run is the count over R (the slow tier rotates, so R spans several rotations). Calls that name no
GPU (driver version, device count) are reported separately. CPU per run is the median
``time.process_time`` of one run of the collector for the profile's host (8 GPUs for the ND hosts).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from bench.common import Options, rnd, say
from gpumon.collectors.base import Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.simulate import HOSTS
from gpumon.simulate.nvml import PROFILES, FakeNVML

TARGET_CALLS_PER_GPU = 8   # the power sample buffer's call among them


def gpus_for(profile: str) -> int:
    for host in HOSTS.values():
        if host.gpu_profile == profile:
            return host.gpu_count
    return 8


def run(opts: Options) -> dict:
    runs = 5 if opts.smoke else 60
    warm = 2 if opts.smoke else 5
    result: dict = {"runs": runs, "target_calls_per_gpu": TARGET_CALLS_PER_GPU, "profiles": {}}
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-nvml-") as tmp:
        for profile in PROFILES:
            count = gpus_for(profile)
            nvml = FakeNVML(profile, count)
            ctx = Context("bench", state_dir=os.path.join(tmp, profile), nvml=nvml)
            os.makedirs(ctx.state_dir, exist_ok=True)
            collector = NvmlCollector(ctx, None)
            try:
                nvml.reset_calls()
                collector.collect()
                first = max(nvml.calls_for_gpu(g) for g in range(count))
                for _ in range(warm):
                    collector.collect()
                nvml.reset_calls()
                cpu = []
                for _ in range(runs):
                    c0 = time.process_time()
                    collector.collect()
                    cpu.append(time.process_time() - c0)
                per_gpu = [nvml.calls_for_gpu(g) / runs for g in range(count)]
                with nvml._lock:  # a consistent copy of the double's counters
                    gpu0 = {name: n / runs for (name, g), n in nvml.gpu_calls.items() if g == 0}
                    total = sum(nvml.calls.values())
                no_gpu = (total - sum(nvml.calls_for_gpu(g) for g in range(count))) / runs
            finally:
                collector.close()
            entry = {
                "gpus": count,
                "calls_per_gpu_per_run_max": rnd(max(per_gpu)),
                "calls_per_gpu_per_run_mean": rnd(statistics.mean(per_gpu)),
                "calls_per_run_without_gpu": rnd(no_gpu),
                "first_run_calls_per_gpu": first,
                "gpu0_calls_per_run_by_function": {k: rnd(v) for k, v in sorted(gpu0.items())},
                "cpu_ms_per_run": rnd(statistics.median(cpu) * 1e3),
                "cpu_ms_per_run_per_gpu": rnd(statistics.median(cpu) * 1e3 / count),
            }
            entry["target_met"] = entry["calls_per_gpu_per_run_max"] <= TARGET_CALLS_PER_GPU
            result["profiles"][profile] = entry
            say(opts, f"nvml_calls: {profile:15} {count} GPU(s): {entry['calls_per_gpu_per_run_max']} calls/GPU/run "
                      f"(first run {first}), {entry['cpu_ms_per_run']} ms CPU/run")
    h100 = result["profiles"].get("h100-sxm5-80gb")
    if h100:
        result["h100_calls_per_gpu_per_run"] = h100["calls_per_gpu_per_run_max"]
        result["h100_cpu_ms_per_run_8_gpus"] = h100["cpu_ms_per_run"]
    result["target_met"] = all(p["target_met"] for p in result["profiles"].values())
    return result

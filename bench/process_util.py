"""What ``[nvml] per_process`` adds on a simulated ND H100 v5 with 4 processes per GPU.

Two NVML collectors over the same host (8 simulated H100s, each running 4 compute processes whose
names are in a /proc-shaped directory, as ``/proc/<pid>/comm``): one with ``per_process`` off, one
with it on (``per_process_top`` at its default, so every process has its own series). They run in
turns, the host advancing 10 s (the default interval) between runs, so both see the same samples.
Reported: the CPU of the per-process step itself, timed inside the collector (median per run over
the 8 GPUs: the call, the aggregation, top N, the names), beside the median ``time.process_time`` of a
whole run of each collector, whose difference is within the noise of a shared machine (the double's own
work is included in both: a real driver spends about 2 ms of CPU in each per-process call, wave3.md section 3,
which is not in this figure), NVML calls per run added, and series added (per-process memory and
per-process utilization).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from bench.common import Options, rnd, say
from gpumon.collectors.base import Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.config import Section
from gpumon.simulate.nvml import FakeNVML

GPUS = 8
PROCESSES_PER_GPU = 4
INTERVAL = 10.0


def _collector(fake: FakeNVML, proc_root: str, on: bool) -> NvmlCollector:
    ctx = Context("bench", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake))
    values: dict[str, Any] = {o.key: o.default for o in NvmlCollector.options.options}
    values.update(per_process=on, proc_root=proc_root)
    return NvmlCollector(ctx, Section("nvml", values))


def run(opts: Options) -> dict:
    runs = 5 if opts.smoke else 60
    fake = FakeNVML("h100-sxm5-80gb", GPUS)
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-proc-") as proc_root:
        for gpu in range(GPUS):
            for pid in fake.run_processes(gpu, ["python3"] * PROCESSES_PER_GPU):
                os.makedirs(os.path.join(proc_root, str(pid)))
                with open(os.path.join(proc_root, str(pid), "comm"), "w", encoding="utf-8") as fh:
                    fh.write("python3\n")
        fake.tick(40.0)   # the GPUs' idle processes ended: their last samples age out
        pair = {on: _collector(fake, proc_root, on) for on in (False, True)}
        step: list[float] = []
        inner = pair[True]._process_util

        def timed(*args: Any) -> None:
            c0 = time.process_time()
            inner(*args)
            step.append(time.process_time() - c0)

        pair[True]._process_util = timed  # type: ignore[method-assign]
        cpu: dict[bool, list[float]] = {False: [], True: []}
        calls: dict[bool, int] = {False: 0, True: 0}
        series: dict[bool, dict[str, int]] = {}
        try:
            for on in (False, True):
                pair[on].collect()          # the first run: discovery and static facts, not measured
            step.clear()
            for _ in range(runs):
                fake.tick(INTERVAL)
                for on in (False, True):
                    before = sum(fake.calls.values())
                    c0 = time.process_time()
                    out = pair[on].collect()
                    cpu[on].append(time.process_time() - c0)
                    calls[on] += sum(fake.calls.values()) - before
                    series[on] = {f.name: len(f.samples) for f in out.families
                                  if f.name != "gpumon_nvml_calls_total"}
        finally:
            for c in pair.values():
                c.close()
    added = {name: n - series[False].get(name, 0) for name, n in series[True].items()
             if n != series[False].get(name, 0)}
    off_ms, on_ms = (statistics.median(cpu[on]) * 1e3 for on in (False, True))
    per_run = [sum(step[i:i + GPUS]) * 1e3 for i in range(0, len(step), GPUS)]
    added_ms = statistics.median(per_run)
    result = {
        "gpus": GPUS, "processes_per_gpu": PROCESSES_PER_GPU, "runs": runs, "interval_s": INTERVAL,
        "cpu_ms_per_run_off": rnd(off_ms), "cpu_ms_per_run_on": rnd(on_ms),
        "cpu_ms_added_per_run": rnd(added_ms), "cpu_ms_added_per_gpu": rnd(added_ms / GPUS),
        "cpu_ms_whole_run_difference": rnd(on_ms - off_ms),
        "nvml_calls_per_run_off": rnd(calls[False] / runs), "nvml_calls_per_run_on": rnd(calls[True] / runs),
        "series_off": sum(series[False].values()), "series_on": sum(series[True].values()),
        "series_added": sum(added.values()), "series_added_by_family": added,
        "series_added_per_gpu": rnd(sum(added.values()) / GPUS),
    }
    say(opts, f"process_util: {GPUS} GPUs x {PROCESSES_PER_GPU} processes: +{result['cpu_ms_added_per_run']} ms "
              f"CPU/run ({result['cpu_ms_per_run_off']} -> {result['cpu_ms_per_run_on']}), "
              f"+{result['series_added']} series, calls/run {result['nvml_calls_per_run_off']} -> "
              f"{result['nvml_calls_per_run_on']}")
    return result

"""The fast link-state watcher's CPU share at 1 s, 0.5 s and 0.1 s polling on 9 ports.

The linkflap collector (state, phys_state and the netdev's carrier_changes of each port, pread) runs
in a worker process on the daemon's fixed-rate schedule for a while at each interval; its share of
one core is the worker's CPU over that time divided by the time (the worker's own nanosecond clock;
the /proc tick reading is kept beside it). A back-to-back measurement gives the CPU per watcher run,
and per-run / interval is the share without the scheduling overhead.
"""

from __future__ import annotations

import os
import tempfile

from bench.common import Options, rnd, say
from bench.workers import Worker
from gpumon.simulate.sysfs import build_tree

INTERVALS = (1.0, 0.5, 0.1)
TARGET_SHARE_AT_1S = 0.005


def run(opts: Options) -> dict:
    seconds = 0.5 if opts.smoke else 10.0
    runs = 50 if opts.smoke else 3000
    result: dict = {"tree": "nd-h100-v5", "seconds_per_interval": seconds, "target_share_at_1s": TARGET_SHARE_AT_1S,
                    "intervals": {}}
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-watcher-") as tmp:
        sysfs = os.path.join(tmp, "sys")
        fabric = build_tree("nd-h100-v5", sysfs)
        result["ports"] = len(fabric.port_keys)
        with Worker("linkflap", sysfs, os.path.join(tmp, "state")) as worker:
            worker.run(100)
            _proc, own, _wall = worker.run(runs)
            per_run = own / runs
            result["cpu_ms_per_run"] = rnd(per_run * 1e3)
            for interval in INTERVALS:
                proc_cpu, own, count = worker.loop(interval, seconds)
                share = own / seconds
                result["intervals"][f"{interval:g}"] = {
                    "share_of_one_core": rnd(share),
                    "share_of_one_core_proc_ticks": rnd(proc_cpu / seconds),
                    "share_from_cpu_per_run": rnd(per_run / interval),
                    "runs": count,
                }
                say(opts, f"watcher: every {interval:g} s on {result['ports']} ports: {share * 100:.3f} % of one core "
                          f"({per_run * 1e3:.3f} ms per run)")
    result["target_met"] = result["intervals"]["1"]["share_of_one_core"] < TARGET_SHARE_AT_1S
    return result

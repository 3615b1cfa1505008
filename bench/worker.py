"""A process that holds one gpumon collector and runs it on command, so its CPU can be read from /proc.

The parent measures this process exactly as it measures node_exporter (utime + stime from
``/proc/<pid>/stat``); the worker also reports its own ``time.process_time`` (nanosecond clock)
for the figures too small for clock ticks. Protocol, one line each way:

    run N               ->  ok <cpu seconds> <wall seconds>      collect() N times back to back
    loop INTERVAL SECS  ->  ok <cpu seconds> <runs>              collect() every INTERVAL for SECS
    quit

    python -m bench.worker --collector infiniband --sysfs-root TREE --state-dir DIR [--read-mode pread]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from gpumon import registry
from gpumon.collectors.base import Context
from gpumon.config import Section


def make_collector(name: str, sysfs_root: str, state_dir: str, options: dict[str, object]):
    cls = registry.collector_class(name)
    values = {o.key: o.default for o in cls.options.options} if cls.options is not None else {}
    values.update(options)
    ctx = Context("bench", sysfs_root=sysfs_root, state_dir=state_dir)
    return cls(ctx, Section(cls.options.name, values) if cls.options is not None else None)


def loop(collect, interval: float, seconds: float) -> int:
    """The daemon's schedule: fixed-rate runs on a monotonic clock, waiting on an Event between."""
    stop = threading.Event()
    runs = 0
    start = next_run = time.monotonic()
    while True:
        collect()
        runs += 1
        next_run += interval
        now = time.monotonic()
        if now - start >= seconds:
            return runs
        stop.wait(max(0.0, next_run - now))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", required=True)
    parser.add_argument("--sysfs-root", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--read-mode", default="pread")
    args = parser.parse_args()
    collector = make_collector(args.collector, args.sysfs_root, args.state_dir, {"read_mode": args.read_mode})
    first = collector.collect()
    series = sum(len(f.samples) for f in first.families)
    print(f"ready {series} {sum(first.errors.values())}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        c0, w0 = time.process_time(), time.perf_counter()
        if words[0] == "run":
            for _ in range(int(words[1])):
                collector.collect()
            print(f"ok {time.process_time() - c0:.9f} {time.perf_counter() - w0:.9f}", flush=True)
        elif words[0] == "loop":
            runs = loop(collector.collect, float(words[1]), float(words[2]))
            print(f"ok {time.process_time() - c0:.9f} {runs}", flush=True)
        else:
            print(f"error unknown command {words[0]!r}", flush=True)
    collector.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serve a /metrics page of at least ``--series`` series through gpumon's own Prometheus sink.

The page is real collector output, not made-up text: a simulated host with N H100s (the NVML double)
and N InfiniBand ports (the sysfs generator), N grown until the page holds the asked-for number of
series (36 + 36 for 5,000). The snapshot is re-published every ``--republish`` seconds, as the
daemon's loop does when the link watcher reports, so scrapes race with page swaps as they would in
production. Prints ``ready <port> <series> <gpus>`` once serving.

    python -m bench.serve_page --series 5000 --listen 127.0.0.1:0
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import threading
import time

from gpumon import __version__
from gpumon.collectors.base import Context
from gpumon.collectors.infiniband import InfinibandCollector
from gpumon.collectors.nvml import NvmlCollector
from gpumon.config import Section
from gpumon.model import CollectorStatus, MetricFamily, Snapshot
from gpumon.simulate.nvml import FakeNVML
from gpumon.simulate.sysfs import build_tree
from gpumon.sinks.base import SinkContext
from gpumon.sinks.prometheus import OPTIONS, PrometheusSink


def host_families(units: int, workdir: str) -> tuple[MetricFamily, ...]:
    """One collection of a simulated host with ``units`` GPUs and ``units`` IB ports."""
    sysfs = os.path.join(workdir, f"sys-{units}")
    build_tree("plain-mlx5", sysfs, ports=units)
    ctx = Context("bench-page", sysfs_root=sysfs, state_dir=os.path.join(workdir, "state"),
                  nvml=FakeNVML("h100-sxm5-80gb", units))
    os.makedirs(ctx.state_dir, exist_ok=True)
    families: list[MetricFamily] = []
    nvml = NvmlCollector(ctx, None)
    ib = InfinibandCollector(ctx, Section("infiniband", {"read_mode": "open"}))
    try:
        for collector in (nvml, ib):
            collector.collect()  # the first NVML run takes its GPM baseline
            families.extend(collector.collect().families)
    finally:
        nvml.close()
        ib.close()
    return tuple(families)


def build(series: int, workdir: str) -> tuple[tuple[MetricFamily, ...], int]:
    def count(units: int) -> int:
        return sum(len(f.samples) for f in host_families(units, workdir))

    one, two = count(1), count(2)  # per-unit series and the fixed part, so one guess usually fits
    per_unit = max(1, two - one)
    units = max(1, math.ceil((series - (one - per_unit)) / per_unit))
    while True:
        families = host_families(units, workdir)
        if sum(len(f.samples) for f in families) >= series:
            return families, units
        units += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", type=int, default=5000)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--republish", type=float, default=1.0, help="seconds between page swaps (0: never)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-page-") as tmp:
        families, units = build(args.series, tmp)
    values = {o.key: o.default for o in OPTIONS.options}
    values["listen"] = args.listen
    sink = PrometheusSink(SinkContext("bench-page", tempfile.gettempdir(), __version__),
                          Section("prometheus", values))
    status = (CollectorStatus("nvml", True, 0.0), CollectorStatus("infiniband", True, 0.0))
    seq = 0

    def publish() -> None:
        nonlocal seq
        seq += 1
        sink.publish(Snapshot("bench-page", time.time(), families, (), status, seq))

    publish()
    sink.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"ready {sink.port} {sum(len(f.samples) for f in families)} {units}", flush=True)
    while not stop.wait(args.republish if args.republish > 0 else 3600):
        publish()
    sink.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

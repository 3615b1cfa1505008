#!/usr/bin/env python3
"""Bytes and requests per day that the Azure Monitor sink sends for one simulated ND H100 v5 host.

Standalone: builds the simulated host (8 x H100, 8 x NDR IB + the Ethernet VF), runs the real NVML,
InfiniBand and link-flap collectors against it every ``--collect`` seconds of simulated time, feeds
the snapshots to the real ``AzureMonitorSink`` (simulated clock, so a day's intervals take seconds),
and lets it upload to the loopback ingestion server from ``tests/fakes/logs_ingestion.py``, which
validates every row against the template and counts what arrives. Prints JSON:

    python bench/azure_volume.py [--intervals 30] [--upload-interval 60] [--collect 10]

``json_bytes`` (the uncompressed JSON of the rows) is the conservative stand-in for what Log
Analytics bills: it bills the string form of each stored record, which is at most that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gpumon import registry  # noqa: E402
from gpumon.collectors.base import Context  # noqa: E402
from gpumon.config import Section  # noqa: E402
from gpumon.model import Snapshot  # noqa: E402
from gpumon.simulate import Simulation  # noqa: E402
from gpumon.sinks.azure_monitor import AzureMonitorSink  # noqa: E402
from gpumon.sinks.base import SinkContext  # noqa: E402
from tests.fakes.logs_ingestion import IngestionServer  # noqa: E402
from tests.fakes.tokens import FakeCredential  # noqa: E402

PRICE_PER_GB = 2.30
"""Log Analytics analytics-tier pay-as-you-go list price, USD per GB ingested (East US; check your region)."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _section(cls) -> Section | None:
    if cls.options is None:
        return None
    return Section(cls.options.name, {o.key: o.default for o in cls.options.options})


def measure(intervals: int, upload_interval: float, collect_every: float, options: dict | None = None) -> dict:
    work = tempfile.mkdtemp(prefix="gpumon-azure-volume-")
    sim = Simulation("nd-h100-v5", os.path.join(work, "sim"))
    ctx = Context(hostname="nd-h100-v5-0", sysfs_root=sim.sysfs_root, state_dir=os.path.join(work, "state"),
                  simulation=sim, nvml=sim.nvml)
    os.makedirs(ctx.state_dir, exist_ok=True)
    collectors = []
    for name in ("nvml", "infiniband", "linkflap"):
        cls = registry.collector_class(name)
        collectors.append(cls(ctx, _section(cls)))
    clock = Clock()
    with IngestionServer() as srv:
        cfg = {"endpoint": srv.endpoint, "dcr_immutable_id": srv.dcr_id, "ca_file": srv.ca_path,
               "imds_url": "", "upload_interval": upload_interval, **(options or {})}
        sink = AzureMonitorSink(SinkContext(ctx.hostname, work, "bench"), cfg, credential=FakeCredential(),
                                clock=clock)
        sink.start()
        wall = time.time()
        steps = int(round(intervals * upload_interval / collect_every))
        publish_seconds = 0.0
        for step in range(steps + 1):
            sim.step(collect_every)
            families = []
            events = []
            for collector in collectors:
                result = collector.collect()
                families.extend(result.families)
                events.extend(result.events)
            clock.now = step * collect_every
            snap = Snapshot(ctx.hostname, wall + clock.now, tuple(families), tuple(events), (), step)
            t0 = time.perf_counter()
            sink.publish(snap)
            publish_seconds += time.perf_counter() - t0
            # Let each interval's upload finish before the next, as 60 real seconds would.
            deadline = time.monotonic() + 30
            done = threading.Event()
            while sink.health().extra["rows_queued"] and time.monotonic() < deadline:
                done.wait(0.005)
        sink.stop(10)
        for collector in collectors:
            collector.close()
        requests = [r for r in srv.requests() if r.status == 204]
        rows = {s: len(srv.rows(s)) for s in srv.declarations}
        statuses = sorted({r.status for r in srv.requests()})
    per_day = 86400.0 / (intervals * upload_interval)
    wire = sum(r.wire_bytes for r in requests)
    plain = sum(r.json_bytes for r in requests)
    by_stream = {}
    for r in requests:
        entry = by_stream.setdefault(r.stream, {"rows": 0, "json_bytes": 0})
        entry["rows"] += r.rows
        entry["json_bytes"] += r.json_bytes
    return {
        "host": "nd-h100-v5 (simulated: 8 GPUs, 9 RDMA ports)",
        "upload_interval_seconds": upload_interval,
        "options": options or {},
        "collect_interval_seconds": collect_every,
        "intervals_measured": intervals,
        "http_statuses": statuses,
        "rows_per_day": round(sum(rows.values()) * per_day),
        "requests_per_day": round(len(requests) * per_day),
        "wire_bytes_per_day_gzip": round(wire * per_day),
        "json_bytes_per_day": round(plain * per_day),
        "json_megabytes_per_day": round(plain * per_day / 1e6, 1),
        "bytes_per_row": {s: round(v["json_bytes"] / v["rows"]) for s, v in by_stream.items() if v["rows"]},
        "usd_per_host_per_day_at_list_price": round(plain * per_day / 1e9 * PRICE_PER_GB, 3),
        "usd_per_host_per_month_at_list_price": round(plain * per_day * 30 / 1e9 * PRICE_PER_GB, 2),
        "price_per_gb_usd": PRICE_PER_GB,
        "publish_ms_mean": round(publish_seconds / (steps + 1) * 1000, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=int, default=30)
    parser.add_argument("--upload-interval", type=float, default=60.0)
    parser.add_argument("--collect", type=float, default=10.0, help="simulated seconds between collections")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                        help="an [azure_monitor] option, e.g. --option omit_zero_increases=false")
    args = parser.parse_args()
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    print(json.dumps(measure(args.intervals, args.upload_interval, args.collect, options), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

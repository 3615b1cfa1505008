#!/usr/bin/env python3
"""What remote write costs per snapshot of a simulated ND H100 v5 host, and what it holds in memory
while the receiver is down.

- CPU to encode one snapshot as a WriteRequest and snappy-compress it (time.process_time, median of
  ``--runs``), steady state (labels cached from the previous snapshot) and cold (first snapshot);
  the whole ``publish()`` (encode, compress, spool append) on the loop's thread; request sizes.
- An outage: ``--outage`` snapshots published to a receiver that refuses connections, with a
  ``--spool-mib`` spool; the spool's bytes stay at its cap and the Python heap's peak (tracemalloc)
  does not grow with the number of snapshots queued.

    python bench/remote_write.py [--runs 300] [--outage 2000] [--spool-mib 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.common import Options, write_result  # noqa: E402
from gpumon import cli, config, daemon  # noqa: E402
from gpumon.model import Snapshot  # noqa: E402
from gpumon.sinks.base import SinkContext  # noqa: E402
from gpumon.sinks.remote_write import RemoteWriteSink, encoding  # noqa: E402


def host_snapshot(state_dir: str) -> Snapshot:
    """One collection of every collector of the simulated host, self-metrics included."""
    cfg = config.load(cli.schemas(), None, {"GPUMON_DAEMON_STATE_DIR": state_dir}, {"simulate": "nd-h100-v5"})
    ctx = daemon.make_context(cfg)
    return daemon.collect_once(cfg, daemon.plan_collectors(ctx.config, ctx), ctx)


def cpu_ms(fn, runs: int) -> dict[str, float]:
    samples = []
    for _ in range(runs):
        c0 = time.process_time()
        fn()
        samples.append((time.process_time() - c0) * 1000)
    samples.sort()
    return {"median_ms": round(statistics.median(samples), 3), "p90_ms": round(samples[int(len(samples) * 0.9)], 3)}


def encoding_figures(snapshot: Snapshot, runs: int) -> dict[str, object]:
    stamp = round(snapshot.time * 1000)
    cold = []
    for _ in range(min(runs, 50)):
        encoder = encoding.Encoder({"job": "gpumon", "instance": "nd-node"})
        c0 = time.process_time()
        encoding.compress(encoder.encode(snapshot.families, stamp)[0])
        cold.append((time.process_time() - c0) * 1000)
    encoder = encoding.Encoder({"job": "gpumon", "instance": "nd-node"})
    body, samples = encoder.encode(snapshot.families, stamp)
    compressed = encoding.compress(body)
    return {
        "samples": samples,
        "request_bytes_uncompressed": len(body),
        "request_bytes_snappy": len(compressed),
        "encode_and_compress": cpu_ms(lambda: encoding.compress(encoder.encode(snapshot.families, stamp)[0]), runs),
        "encode_only": cpu_ms(lambda: encoder.encode(snapshot.families, stamp), runs),
        "compress_only": cpu_ms(lambda: encoding.compress(body), runs),
        "encode_and_compress_cold_median_ms": round(statistics.median(cold), 3),
    }


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def outage_figures(snapshot: Snapshot, count: int, spool_mib: int, runs: int, tmp: str) -> dict[str, object]:
    ctx = SinkContext(hostname="nd-node", state_dir=tmp, version="bench")
    sink = RemoteWriteSink(ctx, {"url": f"http://127.0.0.1:{closed_port()}/api/v1/write",
                                 "spool_max_bytes": spool_mib << 20, "backoff_initial": 0.5, "backoff_max": 5.0})
    sink.start()
    try:
        frames = (dataclasses.replace(snapshot, time=snapshot.time + i) for i in range(10 ** 9))
        publish = cpu_ms(lambda: sink.publish(next(frames)), runs)
        tracemalloc.start()
        peaks = []
        for i in range(count):
            sink.publish(next(frames))
            if (i + 1) % max(1, count // 4) == 0:
                peaks.append(round(tracemalloc.get_traced_memory()[1] / 2 ** 20, 2))
        tracemalloc.stop()
        health = sink.health()
    finally:
        sink.stop(0.5)
    return {
        "publish": publish,
        "snapshots_published_while_down": count + runs,
        "spool_max_mib": spool_mib,
        "spool_mib_at_end": round(health.extra["spool_bytes"] / 2 ** 20, 2),
        "requests_queued_at_end": int(health.extra["requests_queued"]),
        "samples_dropped_oldest_first": health.dropped,
        "heap_peak_mib_at_each_quarter": peaks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--outage", type=int, default=2000)
    parser.add_argument("--spool-mib", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script, not the figures")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.outage = 5, 20
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-rw-") as tmp:
        snapshot = host_snapshot(os.path.join(tmp, "sim"))
        result = {"encoding": encoding_figures(snapshot, args.runs),
                  "outage": outage_figures(snapshot, args.outage, args.spool_mib, args.runs,
                                           os.path.join(tmp, "state"))}
    result["target_encode_and_compress_ms"] = 3.0
    print(json.dumps(result, indent=2))
    write_result("remote_write", result, Options(smoke=args.smoke, out=args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench [NAME ...] [--smoke] [--leak-seconds S] [--flips N] [--out DIR]``

Runs every benchmark (or the named ones) in order; each prints its figures and writes
``<out>/<name>.json``. See bench/README.md for one command per figure.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from bench.common import RESULTS, Options, write_result

BENCHMARKS: dict[str, str] = {
    "startup": "spawn of `gpumon run` to the first 200 on /metrics",
    "daemon_cpu": "whole `gpumon run` CPU per IB run vs node_exporter's scrape; idle daemon share of a core",
    "cycle": "per-cycle overhead beyond reading (accept, snapshot, render, self-metrics; health apart), ND H100 v5",
    "real_host": "whole daemon on a simulated ND H100 v5 at defaults and at 1 s, the NVML double's and simulation's cost taken out",
    "real_gpu": "whole daemon on this host's real NVIDIA GPUs at defaults and at 1 s, the driver's CPU included (needs a GPU)",
    "ib_cpu": "IB collector alone: CPU per full run vs node_exporter's infiniband scrape (ratio)",
    "watcher": "link-state watcher CPU share at 1 s, 0.5 s and 0.1 s on 9 ports",
    "nvml_calls": "NVML calls per GPU per run for each simulated profile; CPU per run for 8 GPUs",
    "scale": "CPU per run and page size for 1-72 GPUs and 1-36 IB ports, with the slope",
    "scrape": "p50/p99 and req/s at 1, 16, 64 scrapers vs node_exporter; the 5,000-series page",
    "idle_flood": "scrapes answered within 1 s under 130-10,000 idle/slowloris connections from the scraper's address, plain and mTLS, vs node_exporter",
    "flap": "flap in the tree to gpumon_ib_link_flaps_total changed on /metrics",
    "memory": "RSS of `gpumon run` per sink after warm-up and growth over time vs node_exporter",
    "azure_volume": "Azure Monitor sink bytes and requests per host per day",
    "kmsg_aer": "kmsg collector CPU at 1,000 lines/s; AER collector time per run for 16 PCI functions",
    "scheduled_events": "an Azure Scheduled Event posted to the simulated IMDS to /metrics, whole daemon at a 1 s poll",
    "health": "health rules CPU per ND H100 v5 snapshot; XID 79 to an unhealthy /health at the default interval",
    "tuning": "series and CPU per cycle that each opt-in switch adds on a simulated ND H100 v5 (docs/tuning.md)",
    "job_rules": "job rules (straggler, stall, lemons) on a real Prometheus over 1,000 hosts x 8 GPUs: eval time, series",
    "job_straggler": "8 simulated ND H100 v5 hosts in one job, real Prometheus at 1 s: time until a throttled GPU "
                     "scores highest; false positives over a healthy window",
    "process_util": "CPU per run and series that [nvml] per_process adds, simulated ND H100 v5 with 4 processes per GPU",
}

MODULES = {"azure_volume": "bench.sink_volume"}
"""Benchmarks whose module is not named like them: bench/azure_volume.py is the standalone script,
and no module here may be named like a top-level package (bench/ is sys.path[0] for the scripts)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="gpumon benchmarks.",
                                     epilog="benchmarks: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: proves the harness, not the figures")
    parser.add_argument("--out", default=RESULTS, help="directory for <name>.json (default bench/results)")
    parser.add_argument("--leak-seconds", type=float, default=None,
                        help="memory: seconds to watch RSS after warm-up (default 60; the leak check is 600)")
    parser.add_argument("--flips", type=int, default=None, help="flap: flips to time (default 50)")
    parser.add_argument("--hosts", type=int, default=None, help="job_rules: hosts to generate (default 1000)")
    parser.add_argument("--healthy-seconds", type=float, default=None,
                        help="job_straggler: the healthy window (default 600 s)")
    parser.add_argument("--window", type=float, default=None,
                        help="real_gpu, job_rules: seconds measured (default 150)")
    parser.add_argument("--warm", type=float, default=None,
                        help="job_rules: seconds before measuring (default 390; at least 330 for its windows)")
    parser.add_argument("--history", type=float, default=None, metavar="DAYS",
                        help="job_rules: backfill DAYS of the lemon group's history first (default 0: none)")
    parser.add_argument("--faults", default=None, metavar="TEXT",
                        help="job_straggler: only the fault cases whose name contains TEXT (e.g. congest)")
    parser.add_argument("--prometheus", default=None, metavar="PATH",
                        help="job_rules, job_straggler: the Prometheus server to run (default: prometheus on PATH)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary line of each benchmark")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, text in BENCHMARKS.items():
            print(f"{name:13} {text}")
        return 0
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)} (known: {', '.join(BENCHMARKS)})")
    opts = Options(smoke=args.smoke, out=args.out, quiet=args.quiet)
    if args.leak_seconds is not None:
        opts.leak_seconds = args.leak_seconds
    elif args.smoke:
        opts.leak_seconds = 1.0
    if args.hosts is not None:
        opts.extra["hosts"] = args.hosts
    if args.healthy_seconds is not None:
        opts.extra["healthy_seconds"] = args.healthy_seconds
    if args.window is not None:
        opts.extra["window_s"] = args.window
    if args.history is not None:
        opts.extra["history_days"] = args.history
    if args.faults is not None:
        opts.extra["faults"] = args.faults
    if args.prometheus is not None:
        opts.extra["prometheus"] = args.prometheus
    if args.warm is not None:
        opts.extra["warm_s"] = args.warm
    if args.flips is not None:
        opts.flips = args.flips
    elif args.smoke:
        opts.flips = 2
    failed = []
    started = time.monotonic()
    for name in args.names or list(BENCHMARKS):
        t0 = time.monotonic()
        print(f"== {name}: {BENCHMARKS[name]}", flush=True)
        try:
            data = importlib.import_module(MODULES.get(name, f"bench.{name}")).run(opts)
        except Exception as exc:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            failed.append(name)
            data = {"error": f"{type(exc).__name__}: {exc}"}
        data["seconds"] = round(time.monotonic() - t0, 1)
        path = write_result(name, data, opts)
        print(f"   -> {path} ({data['seconds']} s)", flush=True)
    print(f"== done in {time.monotonic() - started:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Scrape serving under load, gpumon against node_exporter, plus the 5,000-series page.

Servers: ``gpumon run --simulate nd-h100-v5`` (8 GPUs + 9 ports, its real loop running) and
node_exporter's infiniband collector on an ND H100 v5 tree (it collects on every scrape; gpumon
serves a pre-rendered page). For 1, 16 and 64 concurrent scrapers each gets the same bounded load
(request count and a time limit), alternating which goes first. Then ``bench.serve_page`` serves a
page of >= 5,000 series through gpumon's Prometheus sink to 16 concurrent scrapers, gzip and plain.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from bench.common import (
    REPO,
    Endpoint,
    Options,
    clean_env,
    gpumon_serving,
    http_get,
    node_exporter_binary,
    node_exporter_serving,
    say,
    series_count,
    stop,
    wait_metrics,
)
from bench.loadgen import paced, scrape
from gpumon.simulate.sysfs import build_tree

TARGET_P99_MS_5000 = 5.0
CONCURRENCY = (1, 16, 64)


def page_server(series: int) -> tuple[subprocess.Popen, int, int, int]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.serve_page", "--series", str(series),
                             "--listen", "127.0.0.1:0"], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    if not words or words[0] != "ready":
        stop(proc)
        raise RuntimeError("bench.serve_page did not start")
    return proc, int(words[1]), int(words[2]), int(words[3])


def run(opts: Options) -> dict:
    requests = {1: 100, 16: 100, 64: 128} if opts.smoke else {1: 3000, 16: 4000, 64: 6000}
    limit = 5.0 if opts.smoke else 10.0
    result: dict = {"load_generator": "ab (ApacheBench), new connection per request, Accept-Encoding: gzip",
                    "requests": requests, "time_limit_seconds": limit, "servers": {}}
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-scrape-") as tmp:
        servers: dict[str, tuple[list[str], dict[str, str] | None, Endpoint, bytes | tuple[bytes, ...]]] = {}
        cmd, endpoint = gpumon_serving(tmp, "--simulate", "nd-h100-v5")
        servers["gpumon"] = (cmd, clean_env(GPUMON_DAEMON_STATE_DIR=os.path.join(tmp, "state")), endpoint,
                             (b"gpumon_ib_port_info{", b"gpumon_gpu_info{"))
        binary = node_exporter_binary()
        if binary is not None:
            sysfs = os.path.join(tmp, "sys")
            build_tree("nd-h100-v5", sysfs)
            cmd, endpoint = node_exporter_serving(binary, sysfs)
            servers["node_exporter"] = (cmd, None, endpoint, b"node_infiniband_")
        procs, ports = {}, {}
        try:
            for name, (cmd, env, endpoint, needle) in servers.items():
                procs[name] = proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
                ports[name] = port = endpoint.port(proc)
                body = wait_metrics(port, timeout=30, proc=proc, needle=needle)
                gz = http_get(f"http://127.0.0.1:{port}/metrics", {"Accept-Encoding": "gzip"})[1]
                result["servers"][name] = {"series": series_count(body), "page_bytes": len(body),
                                           "page_bytes_gzip": len(gz), "runs": {}}
            for i, c in enumerate(CONCURRENCY):
                order = list(servers) if i % 2 == 0 else list(reversed(servers))
                for name in order:
                    port = ports[name]
                    figures = scrape(f"http://127.0.0.1:{port}/metrics", c, requests[c], limit)
                    result["servers"][name]["runs"][str(c)] = figures
                    say(opts, f"scrape: {name:13} c={c:<3} p50 {figures['p50_ms']} ms  p99 {figures['p99_ms']} ms  "
                              f"{figures['requests_per_second']} req/s  errors {figures['errors']}")
        finally:
            for proc in procs.values():
                stop(proc)
        if "node_exporter" in result["servers"]:
            g = result["servers"]["gpumon"]["runs"]["64"]["p99_ms"]
            n = result["servers"]["node_exporter"]["runs"]["64"]["p99_ms"]
            result["p99_at_64_gpumon_below_node_exporter"] = g < n

    big: dict = {"concurrency": 16, "target_p99_ms": TARGET_P99_MS_5000}
    n = 100 if opts.smoke else 4000
    # New connection per request (the harshest case: accept, thread hand-off, TLS if any) and
    # kept-alive connections (how Prometheus scrapes), each gzip and plain.
    proc, port, series, units = page_server(50 if opts.smoke else 5000)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        body = http_get(url)[1]
        gz = http_get(url, {"Accept-Encoding": "gzip"})[1]
        big.update({"series": series, "simulated_gpus": units, "simulated_ib_ports": units,
                    "page_bytes": len(body), "page_bytes_gzip": len(gz)})
        for keepalive in (False, True):
            for gzip in (True, False):
                kind = ("gzip" if gzip else "plain") + ("_keepalive" if keepalive else "")
                big[kind] = scrape(url, 16, n, limit, gzip=gzip, keepalive=keepalive)
        # 16 scrapers at 10 scrapes/s each: 150x a 15 s scrape interval, far from saturating
        for gzip in (True, False):
            kind = "paced_" + ("gzip" if gzip else "plain")
            big[kind] = paced(url, 16, 0.1, 3.0 if opts.smoke else 20.0, gzip=gzip)
    finally:
        stop(proc)
    big["target_met"] = all(big[k]["p99_ms"] < TARGET_P99_MS_5000 for k in ("paced_gzip", "paced_plain"))
    result["page_5000"] = big
    for kind in ("paced_gzip", "paced_plain"):
        f = big[kind]
        say(opts, f"scrape: {big['series']}-series page, 16 scrapers x 10/s, {kind}: p50 {f['p50_ms']} ms  "
                  f"p99 {f['p99_ms']} ms  max {f['max_ms']} ms (target p99 < {TARGET_P99_MS_5000} ms)")
    for kind in ("gzip", "plain", "gzip_keepalive", "plain_keepalive"):
        f = big[kind]
        say(opts, f"scrape: {big['series']}-series page, 16 scrapers, {kind}: p50 {f['p50_ms']} ms  "
                  f"p99 {f['p99_ms']} ms  {f['requests_per_second']} req/s (target p99 < {TARGET_P99_MS_5000} ms)")
    return result

"""Scrapes under idle and slowloris connections from the scraper's own address, gpumon beside node_exporter.

For N = 130, 500, 2,000 and 10,000 connections from 127.0.0.1 (the scraper's own address, so no
per-source cap can tell them apart), each reconnecting as soon as it is closed, either idle (nothing
sent) or slowloris (one byte every 2 s), plain HTTP and mutual TLS: ``/metrics`` is scraped on a new
connection every 0.1 s (the harsh case: it must be accepted amid the flood) with a 1 s limit. Per
case: the fraction answered within 1 s, their p99, and the server's RSS (before, peak) and CPU.
Servers: ``gpumon run --simulate nd-h100-v5`` and node_exporter's infiniband collector on the same
simulated tree, both raised to their hard descriptor limit, run one after the other in one run.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
import selectors
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from typing import Any

from bench.common import (
    REPO,
    Options,
    clean_env,
    cpu_seconds,
    gpumon_serving,
    memory,
    node_exporter_binary,
    node_exporter_serving,
    percentile,
    rnd,
    say,
    stop,
    tool_version,
    wait_until,
)
from gpumon.simulate.sysfs import build_tree
from gpumon.sinks.prometheus.connections import raise_nofile_limit

COUNTS = (130, 500, 2000, 10000)
SLOW_PERIOD = 2.0
"""Seconds between a slowloris connection's bytes."""
TARGET_FRACTION, TARGET_P99_MS = 0.99, 50.0
PLAIN_TRICKLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096
TLS_TRICKLE = b"\x16\x03\x01\x10\x00\x01\x00\x0f\xfc\x03\x03" + b"\x00" * 4096  # a ClientHello that never ends


def _flood(port: int, count: int, slow: bool, tls: bool, ready: Any, halt: Any, out: Any) -> None:
    """A process of its own: ``count`` connections from 127.0.0.1, reconnected when closed; idle, or
    sending the next byte of a request (or ClientHello) that never ends every ``SLOW_PERIOD``."""
    raise_nofile_limit()
    os.nice(5)  # yield to the server under test on a small machine
    trickle = TLS_TRICKLE if tls else PLAIN_TRICKLE
    selector = selectors.DefaultSelector()
    socks: dict[int, socket.socket] = {}
    sent: dict[int, int] = {}
    schedule: list[tuple[float, int, int]] = []  # (when, slot, socket id) for slowloris bytes
    reconnects = 0

    def connect(i: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind(("127.0.0.1", 0))
        err = sock.connect_ex(("127.0.0.1", port))
        if err not in (0, 115):  # EINPROGRESS
            sock.close()
            return
        socks[i], sent[i] = sock, 0
        selector.register(sock, selectors.EVENT_READ, i)
        if slow:
            heapq.heappush(schedule, (time.monotonic() + (i % 20) * SLOW_PERIOD / 20, i, id(sock)))

    for i in range(count):
        try:
            connect(i)
        except OSError:
            pass
    ready.set()
    while not halt.is_set():
        for i in [i for i in range(count) if i not in socks]:
            try:
                connect(i)
            except OSError:
                break
        now = time.monotonic()
        while schedule and schedule[0][0] <= now:
            _, i, ident = heapq.heappop(schedule)
            sock = socks.get(i)
            if sock is None or id(sock) != ident:
                continue
            try:
                sock.send(trickle[sent[i] % len(trickle):sent[i] % len(trickle) + 1])
                sent[i] += 1
            except OSError:
                pass
            heapq.heappush(schedule, (now + SLOW_PERIOD, i, ident))
        timeout = 0.05 if not schedule else max(0.0, min(0.05, schedule[0][0] - now))
        for key, _ in selector.select(timeout):
            i = key.data
            try:
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:
                selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                socks.pop(i, None)
                reconnects += 1
    out.put(reconnects)
    for sock in socks.values():
        sock.close()


def _scrape(url: str, context: ssl.SSLContext | None) -> float | None:
    """Seconds for one whole scrape on a new connection, or None past 1 s or on any failure."""
    import http.client

    host, port = url.split("//")[1].split("/")[0].split(":")
    t0 = time.monotonic()
    conn: http.client.HTTPConnection
    if context is not None:
        conn = http.client.HTTPSConnection(host, int(port), timeout=1.0, context=context)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=1.0)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        response.read()
        ok = response.status == 200
    except (OSError, http.client.HTTPException):
        ok = False
    finally:
        conn.close()
    elapsed = time.monotonic() - t0
    return elapsed if ok and elapsed <= 1.0 else None


def _case(pid: int, port: int, count: int, slow: bool, context: ssl.SSLContext | None, seconds: float,
          idle_rss: int) -> dict[str, Any]:
    mp = multiprocessing.get_context("fork")
    ready, halt, out = mp.Event(), mp.Event(), mp.Queue()
    flood = mp.Process(target=_flood, args=(port, count, slow, context is not None, ready, halt, out), daemon=True)
    flood.start()
    ready.wait(60)
    time.sleep(min(5.0, 1.0 + count / 5000))  # let the connections land (and a slowloris round start)
    peak = [memory(pid)["VmRSS"]]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], memory(pid)["VmRSS"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    latencies: list[float | None] = []
    url = f"{'https' if context else 'http'}://127.0.0.1:{port}/metrics"
    next_at = t0
    while time.monotonic() - t0 < seconds:
        latencies.append(_scrape(url, context))
        next_at += 0.1
        time.sleep(max(0.0, next_at - time.monotonic()))  # the scraper's pace
    wall = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    done.set()
    sampler.join(2)
    halt.set()
    reconnects = out.get(timeout=30)
    flood.join(30)
    answered = [x for x in latencies if x is not None]
    return {"scrapes": len(latencies), "answered_within_1s": rnd(len(answered) / max(1, len(latencies)), 4),
            "p50_ms": rnd(percentile(answered, 50) * 1000, 3) if answered else None,
            "p99_ms": rnd(percentile(answered, 99) * 1000, 3) if answered else None,
            "rss_mib_before": round(idle_rss / 2**20, 1), "rss_mib_peak": round(peak[0] / 2**20, 1),
            "rss_ratio": round(peak[0] / idle_rss, 2), "cpu_share_of_one_core": rnd(cpu / wall, 3),
            "flood_reconnects": reconnects}


def _tls_files(tmp: str) -> tuple[str, ssl.SSLContext]:
    import trustme

    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(os.path.join(tmp, "server.pem"))
    ca.cert_pem.write_to_path(os.path.join(tmp, "ca.pem"))
    web = os.path.join(tmp, "web.yml")
    with open(web, "w", encoding="utf-8") as fh:
        fh.write(f"tls_server_config:\n  cert_file: {tmp}/server.pem\n  key_file: {tmp}/server.pem\n"
                 f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {tmp}/ca.pem\n")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    ca.issue_cert("scraper").configure_cert(context)
    return web, context


def _warm(port: int, context: ssl.SSLContext | None, proc: subprocess.Popen) -> None:
    url = f"{'https' if context else 'http'}://127.0.0.1:{port}/metrics"
    wait_until(lambda: _scrape(url, context) is not None, 60, interval=0.2, alive=proc)
    for _ in range(10):
        _scrape(url, context)


def run(opts: Options) -> dict:
    counts = (130, 500) if opts.smoke else COUNTS
    seconds = 2.0 if opts.smoke else 5.0
    raise_nofile_limit()
    result: dict[str, Any] = {
        "scraper": "a new connection every 0.1 s from 127.0.0.1, 1 s limit; flood from 127.0.0.1 too",
        "slowloris_period_seconds": SLOW_PERIOD, "window_seconds": seconds,
        "targets": {"answered_within_1s": TARGET_FRACTION, "p99_ms": TARGET_P99_MS, "rss_ratio": 2.0},
        "servers": {}}
    binary = node_exporter_binary()
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-idle-") as tmp:
        web, client = _tls_files(tmp)
        sysfs = os.path.join(tmp, "sys")
        build_tree("nd-h100-v5", sysfs)
        # gpumon reports the port it bound; node_exporter's is picked just before it starts: a flood's
        # 10,000 ephemeral ports could take one picked earlier
        servers: dict[str, tuple[Any, dict[str, str] | None, ssl.SSLContext | None]] = {}
        for mode, context in (("plain", None), ("mtls", client)):
            env = clean_env(GPUMON_DAEMON_STATE_DIR=os.path.join(tmp, f"state-{mode}"))
            if context is not None:
                env["GPUMON_PROMETHEUS_WEB_CONFIG_FILE"] = web
            servers[f"gpumon/{mode}"] = (lambda: gpumon_serving(tmp, "--simulate", "nd-h100-v5"), env, context)
            if binary is not None:
                extra = [f"--web.config.file={web}"] if context is not None else []

                def node(extra: list[str] = extra, binary: str = binary) -> tuple[list[str], Any]:
                    cmd, endpoint = node_exporter_serving(binary, sysfs)
                    return cmd + extra, endpoint

                servers[f"node_exporter/{mode}"] = (node, None, context)
        if binary is not None:
            result["node_exporter"] = tool_version(binary)
        for name, (command, run_env, context) in servers.items():
            cmd, endpoint = command()
            proc = subprocess.Popen(cmd, env=run_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    stdin=subprocess.DEVNULL)
            cases: dict[str, Any] = {}
            try:
                port = endpoint.port(proc)
                _warm(port, context, proc)
                idle_rss = memory(proc.pid)["VmRSS"]
                for slow in (False, True):
                    for count in counts:
                        key = f"{'slowloris' if slow else 'idle'}_{count}"
                        cases[key] = figures = _case(proc.pid, port, count, slow, context, seconds, idle_rss)
                        say(opts, f"idle_flood: {name:22} {key:16} answered {figures['answered_within_1s']:.3f}  "
                                  f"p99 {figures['p99_ms']} ms  RSS {figures['rss_mib_before']} -> "
                                  f"{figures['rss_mib_peak']} MiB  CPU {figures['cpu_share_of_one_core']}")
                        time.sleep(1.0)  # the closed flood's sockets drain before the next case
            finally:
                stop(proc)
            result["servers"][name] = {"cases": cases}
    gpumon_cases = [c for name, s in result["servers"].items() if name.startswith("gpumon") for c in s["cases"].values()]
    result["targets_met"] = {
        "answered": all(c["answered_within_1s"] >= TARGET_FRACTION for c in gpumon_cases),
        "p99": all(c["p99_ms"] is not None and c["p99_ms"] < TARGET_P99_MS for c in gpumon_cases),
        "rss": all(c["rss_ratio"] < 2.0 for c in gpumon_cases),
    }
    for mode in ("plain", "mtls"):
        g, n = result["servers"].get(f"gpumon/{mode}"), result["servers"].get(f"node_exporter/{mode}")
        if g and n:
            result.setdefault("at_least_node_exporter", {})[mode] = all(
                g["cases"][k]["answered_within_1s"] >= n["cases"][k]["answered_within_1s"] for k in g["cases"])
    return result

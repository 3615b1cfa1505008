"""Concurrent scrapers through ApacheBench (``ab``, Debian ``apache2-utils``): a C event loop, so the
load generator costs far less CPU than the servers it measures on a 2-core machine.

Each request is a fresh connection (HTTP/1.0, no keep-alive): the worst case for a server, and what
a scraper that does not pool connections does. ``Accept-Encoding: gzip`` as Prometheus sends it.
Latencies come from ab's CSV percentile table (microsecond resolution); "Length" failures are not
errors here, since a metrics page changes length between snapshots.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

from bench.common import rnd


class LoadGeneratorMissing(RuntimeError):
    pass


def ab_binary() -> str:
    found = shutil.which("ab")
    if found is None:
        raise LoadGeneratorMissing("ApacheBench `ab` is not installed (Debian: apt-get install apache2-utils)")
    return found


def _field(text: str, label: str, default: float = 0.0) -> float:
    match = re.search(rf"^{re.escape(label)}:\s+([0-9.]+)", text, re.MULTILINE)
    return float(match.group(1)) if match else default


def scrape(url: str, concurrency: int, requests: int, time_limit: float, gzip: bool = True,
           keepalive: bool = False) -> dict:
    """``requests`` GETs of ``url``, ``concurrency`` at a time, stopping early at ``time_limit`` s.
    ``keepalive`` reuses each scraper's connection, as Prometheus does between scrapes."""
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-ab-") as tmp:
        csv = os.path.join(tmp, "percentiles.csv")
        # -t must come before -n: -t alone implies 50,000 requests.
        cmd = [ab_binary(), "-q", "-r", "-t", str(time_limit), "-n", str(requests), "-c", str(concurrency),
               "-s", "10", "-e", csv]
        if gzip:
            cmd += ["-H", "Accept-Encoding: gzip"]
        if keepalive:
            cmd.append("-k")
        cmd.append(url)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=time_limit + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"ab failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-400:]}")
        text = proc.stdout
        percentiles: dict[int, float] = {}
        with open(csv, encoding="ascii") as fh:
            for line in fh:
                pct, _, ms = line.strip().partition(",")
                if pct.isdigit():
                    percentiles[int(pct)] = float(ms)
    connect_fail = re.search(r"\(Connect: (\d+), Receive: (\d+), Length: (\d+), Exceptions: (\d+)\)", text)
    done = int(_field(text, "Complete requests"))
    if done < 100 and 100 in percentiles:
        # ab reads entry int(0.5 + done * q / 100) of its sorted table, past the end for the top
        # percentiles when done < 100: use the maximum, which it reads correctly.
        for q in (90, 99):
            if q in percentiles and int(0.5 + done * q / 100) >= done:
                percentiles[q] = percentiles[100]
    errors = 0
    if connect_fail:
        errors = int(connect_fail.group(1)) + int(connect_fail.group(2)) + int(connect_fail.group(4))
    return {
        "concurrency": concurrency,
        "requests": done,
        "errors": errors,
        "non_2xx": int(_field(text, "Non-2xx responses")),
        "requests_per_second": rnd(_field(text, "Requests per second"), 4),
        "p50_ms": rnd(percentiles.get(50, float("nan"))),
        "p90_ms": rnd(percentiles.get(90, float("nan"))),
        "p99_ms": rnd(percentiles.get(99, float("nan"))),
        "max_ms": rnd(percentiles.get(100, float("nan"))),
        "bytes_per_response": int(_field(text, "Document Length")),
        "seconds": rnd(_field(text, "Time taken for tests")),
    }


def paced(url: str, clients: int, period: float, duration: float, gzip: bool = True) -> dict:
    """``clients`` scrapers, each on its own kept-alive connection, one scrape every ``period`` s
    (open loop: a late answer does not delay the next slot's start time more than it must).

    This is how scrapers load an exporter (a Prometheus server scrapes every 15-60 s; 10 per second
    per client is already far beyond that), as opposed to ``scrape``'s back-to-back saturation."""
    import http.client
    import threading
    import time
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    headers = {"Accept-Encoding": "gzip"} if gzip else {}
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    end = time.monotonic() + duration

    def client(offset: float) -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        slot = time.monotonic() + offset
        mine = []
        while True:
            slot += period
            now = time.monotonic()
            if slot > end:
                break
            if slot > now:
                time.sleep(slot - now)  # pacing the client, not waiting for the server
            t0 = time.perf_counter()
            try:
                conn.request("GET", parts.path, headers=headers)
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
            if ok:
                mine.append((time.perf_counter() - t0) * 1000)
            else:
                with lock:
                    errors[0] += 1
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(period * i / clients,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 30)
    latencies.sort()

    def pct(q: float) -> float:
        return rnd(latencies[min(len(latencies) - 1, int(q / 100 * len(latencies)))]) if latencies else float("nan")

    return {"clients": clients, "period_seconds": period, "requests": len(latencies), "errors": errors[0],
            "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": pct(100)}

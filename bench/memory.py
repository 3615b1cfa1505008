"""Memory: RSS of ``gpumon run`` per sink, after a warm-up and over a watch period, vs node_exporter.

All processes run side by side for the same period (so the figures share one clock and one load):

- ``gpumon run`` on this machine (no GPU, no IB; the Prometheus sink) -- the foundation's figure;
- ``gpumon run --simulate nd-h100-v5`` with the Prometheus sink, with the OTel sink (to a loopback
  OTLP/HTTP receiver in this process) and with the Azure Monitor sink (to the loopback ingestion
  service and managed-identity endpoint from ``tests/fakes/logs_ingestion.py``, uploading every
  10 s instead of 60 s so the watch period sees several uploads);
- node_exporter with its infiniband collector on an ND H100 v5 tree.

Every Prometheus endpoint is scraped once a second throughout (a busy Prometheus). RSS is read from
``/proc/<pid>/status`` every few seconds; growth is the last reading minus the one after warm-up,
and the slope of a least-squares line through all readings after warm-up (MiB per hour).
``--leak-seconds`` sets the watch period (the issue's leak check is 600 s).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.common import (
    MIB,
    Endpoint,
    Options,
    clean_env,
    gpumon_command,
    gpumon_serving,
    http_get,
    memory,
    node_exporter_binary,
    node_exporter_serving,
    rnd,
    say,
    slope,
    spawn,
    stop,
    wait_metrics,
)
from gpumon.simulate.sysfs import build_tree

TARGET_PLAIN_MIB = 40.0
TARGET_SIMULATED_MIB = 50.0
TARGET_GROWTH_MIB = 1.0


class OtlpSink:
    """A loopback OTLP/HTTP receiver that accepts everything and keeps only byte counts."""

    def __init__(self) -> None:
        counts = self.counts = {"requests": 0, "bytes": 0}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                length = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(length)
                counts["requests"] += 1
                counts["bytes"] += length
                # An empty Export*ServiceResponse serializes to zero bytes: full success.
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="otlp-receiver").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run(opts: Options) -> dict:
    warmup = 2.0 if opts.smoke else 15.0
    watch = opts.leak_seconds
    every = 0.5 if opts.smoke else 5.0
    result: dict = {"warmup_seconds": warmup, "watch_seconds": watch, "scrape_every_seconds": 1.0,
                    "targets_mib": {"gpumon run": TARGET_PLAIN_MIB, "simulated, prometheus": TARGET_SIMULATED_MIB,
                                    "growth": TARGET_GROWTH_MIB}, "processes": {}}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpumon-bench-memory-"))
        cases: dict[str, tuple[list[str], dict[str, str] | None, Endpoint | None, tuple[bytes, ...]]] = {}
        full = (b"gpumon_gpu_info{", b"gpumon_ib_port_info{")

        def state(name: str) -> str:
            return os.path.join(tmp, name.replace(" ", "_"))

        cmd, endpoint = gpumon_serving(tmp)
        cases["gpumon run (prometheus)"] = (cmd, clean_env(GPUMON_DAEMON_STATE_DIR=state("plain")), endpoint, ())
        cmd, endpoint = gpumon_serving(tmp, "--simulate", "nd-h100-v5")
        cases["simulated nd-h100-v5, prometheus"] = (cmd, clean_env(GPUMON_DAEMON_STATE_DIR=state("prom")),
                                                     endpoint, full)
        skipped: dict[str, str] = {}
        try:
            otlp = OtlpSink()
            stack.callback(otlp.close)
            cases["simulated nd-h100-v5, otel"] = (
                gpumon_command("run", "--simulate", "nd-h100-v5", "--sinks", "otel"),
                clean_env(GPUMON_DAEMON_STATE_DIR=state("otel"), GPUMON_OTEL_ENDPOINT=otlp.endpoint,
                          GPUMON_OTEL_PROTOCOL="http/protobuf", GPUMON_OTEL_AZURE_DETECT="false"), None, ())
        except Exception as exc:  # pragma: no cover - depends on the environment
            skipped["otel"] = str(exc)
        try:
            from tests.fakes.imds import ImdsServer
            from tests.fakes.logs_ingestion import IngestionServer

            ingest = stack.enter_context(IngestionServer())
            imds = ImdsServer()
            stack.callback(imds.close)
            cases["simulated nd-h100-v5, azure_monitor"] = (
                gpumon_command("run", "--simulate", "nd-h100-v5", "--sinks", "azure_monitor"),
                clean_env(GPUMON_DAEMON_STATE_DIR=state("azure"), GPUMON_AZURE_MONITOR_ENDPOINT=ingest.endpoint,
                          GPUMON_AZURE_MONITOR_DCR_IMMUTABLE_ID=ingest.dcr_id,
                          GPUMON_AZURE_MONITOR_CA_BUNDLE=ingest.ca_path,
                          GPUMON_AZURE_MONITOR_UPLOAD_INTERVAL="10",
                          GPUMON_AZURE_MONITOR_IMDS_URL=imds.compute_url,
                          AZURE_POD_IDENTITY_AUTHORITY_HOST=imds.url), None, ())
        except Exception as exc:  # the Azure SDK or trustme missing: measure the rest
            skipped["azure_monitor"] = f"{type(exc).__name__}: {exc}"
        binary = node_exporter_binary()
        if binary is not None:
            sysfs = os.path.join(tmp, "sys")
            build_tree("nd-h100-v5", sysfs)
            cmd, endpoint = node_exporter_serving(binary, sysfs)
            cases["node_exporter --collector.infiniband"] = (cmd, None, endpoint, (b"node_infiniband_",))
        procs = {}
        for name, (cmd, env, _port, _needle) in cases.items():
            procs[name] = spawn(cmd, env, log=os.path.join(tmp, f"{len(procs)}.log"))
            stack.callback(stop, procs[name])
        ports = {name: c[2].port(procs[name]) for name, c in cases.items() if c[2] is not None}
        for name, port in ports.items():
            wait_metrics(port, timeout=30, proc=procs[name], needle=cases[name][3])
        done = threading.Event()

        def scraper() -> None:
            urls = [f"http://127.0.0.1:{port}/metrics" for port in ports.values()]
            while not done.wait(1.0):
                for url in urls:
                    with contextlib.suppress(OSError):
                        http_get(url, {"Accept-Encoding": "gzip"})

        thread = threading.Thread(target=scraper, daemon=True)
        thread.start()
        t0 = time.monotonic()
        done.wait(warmup)
        readings: dict[str, list[tuple[float, int]]] = {name: [] for name in procs}
        while True:
            now = time.monotonic() - t0
            for name, proc in procs.items():
                if proc.poll() is None:
                    readings[name].append((now, memory(proc.pid)["VmRSS"]))
            if now >= warmup + watch:
                break
            done.wait(min(every, warmup + watch - now))
        peaks = {name: memory(proc.pid).get("VmHWM", 0) for name, proc in procs.items() if proc.poll() is None}
        done.set()
        thread.join(5)
        if "simulated nd-h100-v5, azure_monitor" in cases:
            result["azure_rows_received"] = sum(len(ingest.rows(s)) for s in ingest.declarations)
        if "simulated nd-h100-v5, otel" in cases:
            result["otlp_requests_received"] = otlp.counts["requests"]
        for name, proc in procs.items():
            points = readings[name]
            if proc.poll() is not None or not points:
                with open(os.path.join(tmp, f"{list(procs).index(name)}.log"), encoding="utf-8",
                          errors="replace") as fh:
                    tail = fh.read()[-600:]
                result["processes"][name] = {"error": f"exited with {proc.returncode}: {tail}"}
                continue
            xs, ys = [p[0] / 3600.0 for p in points], [p[1] / MIB for p in points]
            per_hour = slope(xs, ys)[0] if len(points) > 2 else 0.0
            result["processes"][name] = {
                "rss_mib_after_warmup": rnd(ys[0]),
                "rss_mib_end": rnd(ys[-1]),
                "rss_mib_max": rnd(max(ys)),
                "peak_rss_mib": rnd(peaks.get(name, 0) / MIB),
                "growth_mib": rnd(ys[-1] - ys[0], 2),
                "slope_mib_per_hour": rnd(per_hour, 2),
                "readings": len(points),
            }
    if skipped:
        result["skipped"] = skipped
    procs_out = result["processes"]
    plain = procs_out.get("gpumon run (prometheus)", {})
    sim = procs_out.get("simulated nd-h100-v5, prometheus", {})
    result["target_met"] = {
        "gpumon run < 40 MiB": plain.get("rss_mib_max", 1e9) < TARGET_PLAIN_MIB,
        "simulated prometheus < 50 MiB": sim.get("rss_mib_max", 1e9) < TARGET_SIMULATED_MIB,
        f"growth < 1 MiB over {watch:g} s": all(p.get("growth_mib", 1e9) < TARGET_GROWTH_MIB
                                               for n, p in procs_out.items() if n.startswith(("gpumon", "sim"))),
    }
    for name, p in procs_out.items():
        if "error" in p:
            say(opts, f"memory: {name}: {p['error'][:200]}")
        else:
            say(opts, f"memory: {name:42} RSS {p['rss_mib_after_warmup']} MiB after warm-up, "
                      f"{p['rss_mib_end']} MiB after {watch:g} s (growth {p['growth_mib']} MiB, peak {p['peak_rss_mib']})")
    return result

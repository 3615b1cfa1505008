"""Job rules at fleet scale: what deploy/prometheus/job-rules.yaml costs a real Prometheus.

A loopback exporter serves generated series for N hosts (default 1,000) x 8 GPUs in one job, 8 InfiniBand
ports and one Ethernet RDMA port each: every series the rules read, with the labels gpumon gives them, small
noise, and one GPU throttled to 0.7. A real Prometheus scrapes it every 30 s (in ten targets, so that
parsing spreads over cores) with all three rule files loaded at their own intervals. After the 5-minute
windows have filled, it reads per rule group ``prometheus_rule_group_last_duration_seconds`` (each
evaluation, median and max) and ``prometheus_rule_group_last_evaluation_samples`` (the series the group
writes), and ``prometheus_rule_evaluation_failures_total`` (must stay 0). Series added per host are the
job groups' samples over N, against what one simulated ND H100 v5 exports (``gpumon once``).

The lemon and trend groups' windows (7 days of faults, a day back for the corrected ECC errors, the hour
before the last evaluation for the remapped rows, 3 days of them for the trend) read only the series the
lemon group records, and those hold only the run's few minutes unless ``--history DAYS`` backfills them
first (:func:`backfill`): one sample per 5 minutes over DAYS, written as OpenMetrics and turned into TSDB
blocks with ``promtool tsdb create-blocks-from openmetrics`` before Prometheus starts. Their labels are the
ones the rules give, so the live evaluations continue the same series (``history.joined`` in the result
counts them). The exporter's counters start with the history, so the lifetime ECC counts it serves continue
the backfilled ones. ``lemon_rule_reads`` gives the samples each lemon and trend rule reads.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import yaml

from bench.common import (
    REPO,
    Options,
    clean_env,
    gpumon_command,
    http_get,
    median,
    picked_port,
    prometheus_binary,
    rnd,
    say,
    stop,
    tool_version,
    wait_until,
)

RULES = os.path.join(REPO, "deploy", "prometheus")
RULE_FILES = ("recording-rules.yaml", "alerting-rules.yaml", "job-rules.yaml")
JOB_PREFIX = "gpumon-job-"  # every group of job-rules.yaml
PARTS = 10
TARGET_EVAL_S = 1.0
TARGET_SERIES_SHARE = 0.10
LEMON_STEP_S = 300  # the lemon group's interval: one sample of its series per 5 minutes
LEMON_GROUPS = ("gpumon-job-lemons", "gpumon-job-trends")  # the groups whose windows --history fills
BLOCK_S = 7200  # promtool writes 2-hour blocks; one file per block is parsed once
PORT_ERRORS = ("symbol_errors", "link_error_recoveries", "receive_errors", "receive_remote_physical_errors",
               "receive_switch_relay_errors", "transmit_discards", "transmit_constraint_errors",
               "receive_constraint_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
               "vl15_dropped")


def ecc_rate(h: int, g: int) -> float:
    """Corrected ECC errors per second: on a few GPUs only, as in a real fleet."""
    return 0.001 if (h * 8 + g) % 97 == 0 else 0.0


def remapped_rows(h: int, g: int) -> dict[str, float]:
    """Rows remapped in the GPU's life, by cause: a few on one GPU in 13, none elsewhere."""
    return {"correctable": 2 if (h * 8 + g) % 13 == 3 else 0, "uncorrectable": 0}


def xid_gpu(h: int, g: int) -> bool:
    """The few GPUs that reported an XID."""
    return (h * 8 + g) % 211 == 5


def host_name(h: int) -> str:
    return f"bench-{h:04d}"


def physical_host(h: int) -> str:
    return f"PH-{h:04d}"


def gpu_labels(h: int, g: int) -> str:
    """The labels that name GPU g of host h, as the exporter serves them (without ``job``)."""
    return f'instance="{host_name(h)}",gpu="{g}",uuid="GPU-{h:04d}-{g}"'


def serial(h: int, g: int) -> str:
    return f"SN-{h:04d}-{g}"


def host_lines(h: int) -> list[tuple[str, str, float]]:
    """(series, kind, base) of one host: kind g = gauge with noise, c = counter at base per second,
    k = constant."""
    base = f'job="gpumon",instance="{host_name(h)}"'
    out: list[tuple[str, str, float]] = [
        (f'gpumon_host_info{{{base},vm_id="vm-{h}",physical_host="{physical_host(h)}",placement_group="pg-1"}}',
         "k", 1)]
    for g in range(8):
        gl = f'job="gpumon",{gpu_labels(h, g)}'
        slow = 0.7 if (h, g) == (1, 5) else 1.0  # one throttled GPU
        out += [
            (f'gpumon_gpu_info{{{gl},model="NVIDIA H100 80GB HBM3",serial="{serial(h, g)}"}}', "k", 1),
            (f'gpumon_gpu_allocation_info{{{gl},job_id="bench-1"}}', "k", 1),
            (f'gpumon_gpu_activity_ratio{{{gl},activity="sm"}}', "g", 0.9 * slow),
            (f'gpumon_gpu_utilization_ratio{{{gl},engine="gpu"}}', "g", 1.0),
            (f'gpumon_gpu_clock_hertz{{{gl},clock="sm"}}', "g", 1.98e9 * slow),
            (f'gpumon_gpu_power_watts{{{gl}}}', "g", 650 * slow),
            (f'gpumon_gpu_power_limit_watts{{{gl}}}', "k", 700),
            (f'gpumon_gpu_compute_processes{{{gl}}}', "k", 1),
            (f'gpumon_gpu_memory_used_bytes{{{gl}}}', "k", 6e10),
            (f'gpumon_gpu_lost{{{gl}}}', "k", 0),
            (f'gpumon_gpu_clock_event_reason_active{{{gl},reason="hw_slowdown"}}', "k", 0),
            (f'gpumon_gpu_pcie_replay_total{{{gl}}}', "c", 0),
            # corrected ECC errors on a few GPUs only, as in a real fleet
            (f'gpumon_gpu_ecc_errors_total{{{gl},type="corrected",counter="aggregate"}}', "c", ecc_rate(h, g)),
            # remapped rows on a few, and an XID 79 on fewer (the counter stays at 1: gpumon counts from its start)
            *((f'gpumon_gpu_remapped_rows{{{gl},cause="{cause}"}}', "k", rows)
              for cause, rows in remapped_rows(h, g).items()),
            *([(f'gpumon_gpu_xid_errors_total{{{gl},xid="79"}}', "k", 1)] if xid_gpu(h, g) else []),
        ]
        out += [(f'gpumon_gpu_{m}_throughput_bytes_per_second{{{gl},direction="{d}"}}', "g", v * slow)
                for m, v in (("nvlink", 1e11), ("pcie", 2e10)) for d in ("tx", "rx")]
        out += [(f'gpumon_gpu_clock_event_violation_seconds_total{{{gl},reason="{r}"}}', "c",
                 0.3 if r == "sw_power_cap" and slow < 1 else 0.0)
                for r in ("sw_power_cap", "thermal", "reliability", "sync_boost")]
    for p in range(9):
        device, layer = (f"mlx5_ib{p}", "InfiniBand") if p < 8 else ("mlx5_an0", "Ethernet")
        pl = f'{base},device="{device}",port="1"'
        out += [
            (f'gpumon_ib_port_info{{{pl},link_layer="{layer}"}}', "k", 1),
            (f'gpumon_ib_port_rate_bytes_per_second{{{pl}}}', "k", 5e10),
            (f'gpumon_ib_port_transmit_wait_ticks_total{{{pl}}}', "c", 1e6),
            (f'gpumon_ib_port_data_transmitted_bytes_total{{{pl}}}', "c", 2e10),
            (f'gpumon_ib_port_data_received_bytes_total{{{pl}}}', "c", 2e10),
        ]
        out += [(f'gpumon_ib_port_{e}_total{{{pl}}}', "c", 0) for e in PORT_ERRORS]
    return out


class Exporter:
    """Serves the generated hosts over loopback, in PARTS pages (``/metrics?part=N``)."""

    def __init__(self, hosts: int, origin: float | None = None) -> None:
        """``origin``: when the counters were at 0 (default now); a backfilled run starts them where its
        history ends."""
        self.parts = [[line for h in range(hosts) if h % PARTS == part for line in host_lines(h)]
                      for part in range(PARTS)]
        self.series = sum(len(p) for p in self.parts)
        self.origin = time.time() if origin is None else origin
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                part = int(self.path.rsplit("=", 1)[-1]) if "part=" in self.path else 0
                body = exporter.page(part)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # Prometheus stopped mid-scrape
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def page(self, part: int) -> bytes:
        elapsed = time.time() - self.origin
        rng = random.Random()
        out = []
        for series, kind, base in self.parts[part]:
            if kind == "g":
                value = base * (1 + rng.uniform(-0.01, 0.01))
            elif kind == "c":
                value = base * elapsed
            else:
                value = base
            out.append(f"{series} {value:g}\n")
        return "".join(out).encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def history_series(hosts: int) -> list[tuple[str, str, float]]:
    """The series the lemon group records, as (series, kind, base) like :func:`host_lines` (k: the value is
    ``base``; c: ``base`` per second since the counters' origin, only once above 0, as the rule keeps it),
    with the labels its rules give them (the ``by`` labels, ``serial`` and ``physical_host`` joined in; no
    ``cluster`` here)."""
    recorded: list[tuple[str, str, float]] = []
    for h in range(hosts):
        recorded.append((f'instance:gpumon_physical_host:info{{instance="{host_name(h)}",'
                         f'physical_host="{physical_host(h)}"}}', "k", 1))
        for g in range(8):
            placed = f'{gpu_labels(h, g)},serial="{serial(h, g)}",physical_host="{physical_host(h)}"'
            rows = sum(remapped_rows(h, g).values())
            if rows:
                recorded.append((f"serial:gpumon_gpu_remapped_rows:sum{{{placed}}}", "k", rows))
            if xid_gpu(h, g):
                recorded.append((f"serial:gpumon_gpu_xid_errors:sum{{{placed}}}", "k", 1))
            if ecc_rate(h, g):
                recorded.append((f"serial:gpumon_gpu_ecc_corrected:max{{{placed}}}", "c", ecc_rate(h, g)))
                recorded.append((f"serial:gpumon_gpu_ecc_corrected:rate1d{{{placed}}}", "k", ecc_rate(h, g)))
    return recorded


def family(series: str) -> str:
    return series.split("{", 1)[0]


def backfill(promtool: str, data: str, hosts: int, days: float, end: float) -> dict[str, Any]:
    """Writes ``days`` of the lemon group's history ending at ``end`` into the TSDB at ``data``, on the
    group's 5-minute grid counted back from ``end``: one OpenMetrics file per 2-hour block (promtool parses
    its input once per block), each turned into a block and removed. Counters start at the history's start
    (``origin``), where the exporter's continue."""
    recorded = sorted(history_series(hosts), key=lambda r: family(r[0]))
    start = end - days * 86400
    origin = start
    os.makedirs(data, exist_ok=True)
    samples = 0
    t0 = time.monotonic()
    block = int(start // BLOCK_S) * BLOCK_S
    while block < end:
        upper = min(block + BLOCK_S, end)
        first = end - LEMON_STEP_S * ((end - max(block, start)) // LEMON_STEP_S)
        grid = [t for t in range(int(first), int(upper), LEMON_STEP_S) if t >= start]
        lines: list[str] = []
        for series, kind, base in recorded:
            values = ((t, base * (t - origin) if kind == "c" else base) for t in grid)
            lines.extend(f"{series} {value:g} {t}\n" for t, value in values if value > 0)
        if lines:
            samples += len(lines)
            path = os.path.join(os.path.dirname(data), f"history-{block}.om")
            with open(path, "w", encoding="utf-8") as fh:
                fh.writelines(lines)
                fh.write("# EOF\n")
            subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "--quiet", path, data],
                           check=True, capture_output=True, timeout=600)
            os.remove(path)
        block += BLOCK_S
    families = Counter(family(series) for series, *_ in recorded)
    return {"days": days, "samples": samples, "series": dict(families),
            "seconds": rnd(time.monotonic() - t0, 1), "origin": origin}


def history_joined(url: str, backfilled: dict[str, int]) -> dict[str, dict[str, int]]:
    """Whether the live series continued the backfilled ones: the distinct series of each backfilled family
    over the whole run (``ever``) equal those backfilled when every label matched, and double when not."""
    out = {}
    for name, count in backfilled.items():
        ever = query(url, f"count(last_over_time({name}[30d]))")
        out[name] = {"backfilled": count, "ever": int(float(ever[0]["value"][1])) if ever else 0}
    return out


def rule_files(directory: str, fast: bool) -> list[str]:
    """The shipped rule files; in smoke mode every group at 1 s."""
    paths = []
    for name in RULE_FILES:
        with open(os.path.join(RULES, name), encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
        if fast:
            for group in doc["groups"]:
                group["interval"] = "1s"
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(doc, fh)
        paths.append(path)
    return paths


def query(url: str, expr: str) -> list[dict[str, Any]]:
    import json
    import urllib.parse

    status, body = http_get(f"{url}/api/v1/query?query={urllib.parse.quote(expr)}", timeout=30)
    if status != 200:
        raise RuntimeError(f"{expr}: HTTP {status}: {body[:200]!r}")
    return json.loads(body)["data"]["result"]


SELF = ("prometheus_rule_group_last_duration_seconds", "prometheus_rule_group_last_evaluation_timestamp_seconds",
        "prometheus_rule_group_last_evaluation_samples", "prometheus_rule_evaluation_failures_total")


def server_cpu_seconds(url: str) -> float:
    """The Prometheus server's own CPU time so far (``process_cpu_seconds_total``): what the rules, the
    scrapes and the storage cost it together."""
    status, body = http_get(f"{url}/metrics", timeout=30)
    found = re.search(r"^process_cpu_seconds_total (\S+)$", body.decode(), re.M) if status == 200 else None
    return float(found.group(1)) if found else 0.0


def self_metrics(url: str) -> dict[str, dict[str, float]]:
    """Prometheus's own rule-group metrics from its /metrics, per group name (the rule_group label is
    ``<file>;<group>``)."""
    status, body = http_get(f"{url}/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"{url}/metrics: HTTP {status}")
    out: dict[str, dict[str, float]] = {name: {} for name in SELF}
    for m in re.finditer(r'^(\w+)\{rule_group="[^"]*;([^"]+)"\} (\S+)$', body.decode(), re.M):
        if m.group(1) in out:
            out[m.group(1)][m.group(2)] = float(m.group(3))
    return out


def rule_reads(url: str, groups: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each recording rule of ``groups`` run once more as an instant query with the query API's statistics:
    the samples it reads (``totalQueryableSamples``, the same whatever else the server does) and its time
    on the server then."""
    import json
    import urllib.parse

    status, body = http_get(f"{url}/api/v1/rules?type=record", timeout=30)
    if status != 200:
        return []
    rules = [r for g in json.loads(body)["data"]["groups"] if g["name"] in groups for r in g["rules"]]
    out = []
    for rule in rules:
        status, body = http_get(f"{url}/api/v1/query?stats=all&query={urllib.parse.quote(rule['query'])}", timeout=120)
        data = json.loads(body).get("data", {}) if status == 200 else {}
        stats = data.get("stats", {})
        out.append({"rule": rule["name"], "samples_read": stats.get("samples", {}).get("totalQueryableSamples"),
                    "seconds": rnd(float(stats.get("timings", {}).get("evalTotalTime", 0.0)), 4),
                    "series_out": len(data.get("result", []))})
    return out


def rule_times(url: str) -> list[dict[str, Any]]:
    """Each rule's last evaluation time (the rules API's ``evaluationTime``), slowest first: where a
    group's time goes."""
    import json

    status, body = http_get(f"{url}/api/v1/rules", timeout=30)
    if status != 200:
        return []
    rows = [{"group": g["name"], "rule": r["name"], "seconds": rnd(float(r.get("evaluationTime", 0.0)), 4)}
            for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
    return sorted(rows, key=lambda r: -r["seconds"])


def host_series() -> int:
    """Series one simulated ND H100 v5 exports (gpumon once, every collector the simulation has)."""
    with tempfile.TemporaryDirectory() as state:
        proc = subprocess.run(gpumon_command("once", "--simulate", "nd-h100-v5", "--format", "prometheus"),
                              capture_output=True, text=True, timeout=120, check=True,
                              env=clean_env(GPUMON_DAEMON_STATE_DIR=state))
    return sum(1 for line in proc.stdout.splitlines() if line and not line.startswith("#"))


def run(opts: Options) -> dict[str, Any]:
    server = prometheus_binary(opts)
    if server is None:
        return {"not_run": "needs the prometheus server (Debian package prometheus)"}
    hosts = int(opts.extra.get("hosts", 4 if opts.smoke else 1000))
    scrape_s = 1 if opts.smoke else 30
    # the 5-minute windows full, the 5-minute lemon group run once
    warm_s = 5 if opts.smoke else float(opts.extra.get("warm_s", 390))
    sample_s = 3 if opts.smoke else float(opts.extra.get("window_s", 150))
    days = float(opts.extra.get("history_days", 0.0))
    promtool = shutil.which("promtool", path=os.path.dirname(server)) or shutil.which("promtool")
    if days and promtool is None:
        return {"not_run": "--history needs promtool (Debian package prometheus)"}
    history_end = int(time.time())
    tmp = tempfile.mkdtemp(prefix="bench-job-rules-")
    prometheus = None
    exporter = None
    try:
        history: dict[str, Any] = {}
        if days:
            assert promtool is not None
            say(opts, f"   backfilling {days:g} days of the lemon group's history")
            history = backfill(promtool, os.path.join(tmp, "data"), hosts, days, history_end)
            say(opts, f"   {history['samples']} samples in {history['seconds']} s")
        exporter = Exporter(hosts, origin=history.get("origin"))
        say(opts, f"   {hosts} hosts, {exporter.series} generated series")
        config = {
            "global": {"scrape_interval": f"{scrape_s}s", "scrape_timeout": f"{min(scrape_s, 25)}s",
                       "evaluation_interval": f"{scrape_s}s"},
            "rule_files": rule_files(tmp, opts.smoke),
            "scrape_configs": [{"job_name": "bench", "honor_labels": True, "static_configs": [
                {"targets": [f"127.0.0.1:{exporter.port}"], "labels": {"__param_part": str(part)}}
                for part in range(PARTS)]}],
        }
        with open(os.path.join(tmp, "prometheus.yml"), "w", encoding="utf-8") as fh:
            yaml.safe_dump(config, fh)
        port = picked_port()  # Prometheus cannot say which port it bound
        url = f"http://127.0.0.1:{port}"
        with open(os.path.join(tmp, "prometheus.log"), "wb") as log:
            prometheus = subprocess.Popen(
                [server, f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=log)
        wait_until(lambda: http_get(f"{url}/-/ready", timeout=2)[0] == 200, timeout=60, interval=0.2)
        t0 = time.monotonic()
        wait_until(lambda: query(url, "gpumon_job:straggler_score"), timeout=120 + warm_s, interval=1)
        time.sleep(max(0.0, warm_s - (time.monotonic() - t0)))  # bench pacing, not a wait for an event
        durations: dict[str, list[float]] = {}
        seen: dict[str, float] = {}
        cpu0, t_cpu0 = server_cpu_seconds(url), time.monotonic()
        end = time.monotonic() + sample_s
        while time.monotonic() < end:
            metrics = self_metrics(url)
            for group, stamp in metrics["prometheus_rule_group_last_evaluation_timestamp_seconds"].items():
                if stamp > 0 and seen.get(group) != stamp:
                    seen[group] = stamp
                    durations.setdefault(group, []).append(metrics["prometheus_rule_group_last_duration_seconds"][group])
            time.sleep(0.5 if opts.smoke else 5)  # bench pacing: one reading per evaluation or so
        server_cores = (server_cpu_seconds(url) - cpu0) / (time.monotonic() - t_cpu0)
        metrics = self_metrics(url)
        samples = metrics["prometheus_rule_group_last_evaluation_samples"]
        failures = sum(metrics["prometheus_rule_evaluation_failures_total"].values())
        top = query(url, "topk(1, gpumon_job:straggler_score)")
        slowest = rule_times(url)[:12]
        lemon_reads = rule_reads(url, LEMON_GROUPS)
        own = host_series()
        job_groups = sorted(g for g in samples if g.startswith(JOB_PREFIX))
        job_series = sum(samples.get(g, 0.0) for g in job_groups)
        per_host = job_series / hosts
        groups = {g: {"evaluations": len(v), "median_s": rnd(median(v), 4), "max_s": rnd(max(v), 4),
                      "series_written": int(samples.get(g, 0)), "series_per_host": rnd(samples.get(g, 0) / hosts, 2)}
                  for g, v in sorted(durations.items())}
        worst = max((groups[g]["max_s"] for g in job_groups if g in groups), default=0.0)
        worst_median = max((groups[g]["median_s"] for g in job_groups if g in groups), default=0.0)
        # the groups run side by side; their sum is what one round of them costs the server in all
        job_round_s = sum(groups[g]["median_s"] for g in job_groups if g in groups)
        if days:
            history["joined"] = history_joined(url, history["series"])
        result = {
            "prometheus": tool_version(server), "history": history, "hosts": hosts, "gpus": hosts * 8,
            "generated_series": exporter.series, "scrape_interval_s": scrape_s,
            "groups": groups, "rule_evaluation_failures": failures,
            "job_series_per_host": rnd(per_host, 2), "host_own_series": own,
            "job_series_share_of_host": rnd(per_host / own, 4),
            "worst_job_group_eval_s": worst,
            "worst_job_group_median_s": worst_median,
            "job_groups": len(job_groups),
            "job_groups_round_s": rnd(job_round_s, 3),
            "server_cpu_cores": rnd(server_cores, 3),
            "top_straggler": top[0]["metric"] if top else {},
            "slowest_rules": slowest, "lemon_rule_reads": lemon_reads,
            "load_average": os.getloadavg(),
            "targets": {"eval_s": TARGET_EVAL_S, "series_share": TARGET_SERIES_SHARE},
            "target_met": bool(worst < TARGET_EVAL_S and per_host / own < TARGET_SERIES_SHARE and failures == 0),
        }
        say(opts, f"   {len(job_groups)} job groups: slowest {worst_median} s median (max {worst}), "
                  f"{job_round_s:.2f} s per round in all; server {server_cores:.2f} cores")
        say(opts, f"   {per_host:.1f} series per host added vs {own} of its own ({100 * per_host / own:.1f} %); "
                  f"failures {failures:g}; load {os.getloadavg()[0]:.1f}")
        return result
    finally:
        if prometheus is not None:
            stop(prometheus)
        if exporter is not None:
            exporter.close()
        shutil.rmtree(tmp, ignore_errors=True)

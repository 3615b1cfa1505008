"""``gpumon job`` against a real Prometheus scraping two simulated hosts of one job, one GPU throttled.

The straggler recording rules are tests/fakes/job_rules.py's stand-in, written to the test's
directory: it produces the contract's names (``gpumon_job:straggler_score{job_id, instance, gpu,
signal}``, the per-host ``gpumon_job_host:straggler_score``) from one signal, activity. The command
reads only those names; the shipped rules replace the stand-in by loading deploy/prometheus's file.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from gpumon.simulate import control
from tests.conftest import REPO, GpumonProcess, PrometheusServer, clean_env, closed_port, wait_for
from tests.fakes import job_rules

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus server")

JOB = "4242"
SLOW_HOST, SLOW_GPU = "node-b", "5"
SIGNALS = {"activity", "sm_activity", "sm_clock", "thermal_violation", "power"}
"""What a GPU throttled by heat to 0.7 may lag on most: the stand-in scores activity only."""


@dataclass
class Live:
    url: str            # Prometheus with the rules
    bare_url: str       # Prometheus scraping the same hosts without them
    hosts: dict[str, GpumonProcess]


def gpumon_job(*args: str, env: dict[str, str] | None = None, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", "job", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=clean_env(**(env or {})))


def scrape_config(hosts: dict[str, GpumonProcess]) -> dict:
    # 2 s: a scrape that outlives its timeout on a busy machine would blank a host for a second
    return {"global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "gpumon", "static_configs": [
                {"targets": [f"127.0.0.1:{p.port}"], "labels": {"instance": f"{name}:9470"}}
                for name, p in hosts.items()]}]}


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("job")
    hosts: dict[str, GpumonProcess] = {}
    servers: list[PrometheusServer] = []
    try:
        for name in ("node-a", "node-b"):
            env = clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp / name))
            env.pop("GPUMON_AZURE_IMDS_URL")   # a simulated host answers from its own loopback IMDS
            hosts[name] = GpumonProcess(["--simulate", "nd-h100-v5", "--interval", "1", "--collectors",
                                          "nvml,infiniband,linkflap,attribution"], env)
        for name, process in hosts.items():
            process.wait_ready(timeout=30)
            workdir = str(tmp / name / "simulate" / "nd-h100-v5")
            for gpu in range(8):
                control(workdir, {"action": "allocate", "gpu": gpu, "job_id": JOB})
            if name == SLOW_HOST:
                control(workdir, {"action": "throttle", "gpu": int(SLOW_GPU), "reason": "hw_thermal_slowdown",
                                  "factor": 0.7})
        rules, _ = job_rules.rule_files(str(tmp))
        for with_rules in (True, False):
            directory = tmp / f"prometheus-{with_rules}"
            directory.mkdir()
            config = {**scrape_config(hosts), **({"rule_files": rules} if with_rules else {})}
            servers.append(PrometheusServer(str(directory), config).start())
        ruled, bare = servers
        wait_for(lambda: ruled.query(f'ALERTS{{alertname="GpumonJobStraggler", alertstate="firing", gpu="{SLOW_GPU}"}}'),
                 timeout=60, interval=0.2)
        wait_for(lambda: len(ruled.query(f'gpumon_job:straggler_score{{job_id="{JOB}", gpu!=""}}')) == 16
                 and ruled.query("count(rate(gpumon_ib_port_data_transmitted_bytes_total[1m]))"), timeout=20,
                 interval=0.2)
        wait_for(lambda: bare.query(f'count(gpumon_gpu_allocation_info{{job_id="{JOB}"}}) == 16'), timeout=20,
                 interval=0.2)
        yield Live(ruled.url, bare.url, hosts)
    finally:
        for server in servers:
            server.stop()
        for process in hosts.values():
            process.stop()


def test_rows_rank_the_throttled_gpu_first_as_json(live: Live) -> None:
    done = gpumon_job(JOB, "--prometheus", live.url, "--format", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert len([r for r in rows if r["gpu"] is not None]) == 16
    worst = rows[0]
    assert (worst["host"], worst["instance"], worst["gpu"]) == (SLOW_HOST, f"{SLOW_HOST}:9470", SLOW_GPU)
    assert worst["signal"] in SIGNALS
    assert worst["score"] > 5 > max(r["score"] for r in rows[1:] if r["score"] is not None)
    assert worst["alerts"] == ["GpumonJobStraggler"]
    assert worst["sm_clock_ratio"] == pytest.approx(0.7, abs=0.01)
    assert worst["activity"] < 0.8 * next(r["activity"] for r in rows[1:] if r["gpu"] is not None)
    # the health rule gpu.thermal_slowdown judges GPU 5 alone; its neighbours stay healthy
    assert worst["verdict"] == "degraded"
    assert {r["verdict"] for r in rows[1:]} == {"healthy"}
    for row in rows:
        assert row["ib_transmit_bytes_per_second"] > 1e9 and row["ib_flaps"] == 0
        assert row["host_score"] >= row["score"]
        if row["gpu"] is not None:
            assert row["power_watts"] > 100 and row["sm_clock_hertz"] > 1e9
        else:   # a host's InfiniBand ports, scored by the shipped rules
            assert row["device"].startswith("mlx5_ib") and row["power_watts"] is None
    scored = [r["score"] for r in rows if r["score"] is not None]   # a row without a score sorts last
    assert [r["score"] for r in rows][:len(scored)] == sorted(scored, reverse=True)


def test_table_names_the_straggler_on_its_first_row(live: Live) -> None:
    done = gpumon_job(JOB, "--prometheus", live.url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"job {JOB}: 2 host(s), 16 GPU(s), worst first"
    assert lines[1].split()[:5] == ["HOST", "GPU", "VERDICT", "SCORE", "SIGNAL"]
    assert lines[2].split()[:3] == [SLOW_HOST, SLOW_GPU, "straggler"]
    assert " Gb/s" in lines[2] and " MHz" in lines[2] and "70%" in lines[2]
    assert len(lines) == 2 + len(json.loads(gpumon_job(JOB, "--prometheus", live.url, "--format", "json").stdout))


def test_list_shows_the_job_with_its_worst_gpu(live: Live) -> None:
    done = gpumon_job("--list", "--prometheus", live.url, "--format", "json")
    assert done.returncode == 0, done.stderr
    (job,) = json.loads(done.stdout)
    assert (job["job_id"], job["hosts"], job["gpus"]) == (JOB, 2, 16)
    assert (job["worst_instance"], job["worst_gpu"]) == (f"{SLOW_HOST}:9470", SLOW_GPU)
    assert job["worst_signal"] in SIGNALS
    assert job["alerts"] == ["GpumonJobStraggler"]
    table = gpumon_job("--list", "--prometheus", live.url)
    assert table.returncode == 0 and table.stdout.splitlines()[2].split()[:3] == [JOB, "2", "16"]


def test_watch_redraws_in_place(live: Live) -> None:
    done = gpumon_job(JOB, "--prometheus", live.url, "--watch", "--interval", "0.2", "--iterations", "2")
    assert done.returncode == 0, done.stderr
    frames = done.stdout.split("\x1b[H\x1b[2J")
    assert len(frames) == 3 and frames[0] == ""
    for frame in frames[1:]:
        assert frame.startswith(live.url) and f"job {JOB}: 2 host(s)" in frame


def test_unknown_job_is_a_usage_error(live: Live) -> None:
    done = gpumon_job("9999", "--prometheus", live.url)
    assert done.returncode == 2 and done.stdout == ""
    assert "no GPU is held by job '9999'" in done.stderr
    odd = gpumon_job('x"} or vector(1) #\\', "--prometheus", live.url)   # quoted as a PromQL string, not code
    assert odd.returncode == 2 and "no GPU is held by job" in odd.stderr


def test_missing_rules_are_named(live: Live) -> None:
    done = gpumon_job(JOB, "--prometheus", live.bare_url)
    assert done.returncode == 1
    assert ("does not evaluate the recording rule(s) gpumon_job:straggler_score, gpumon_job_host:straggler_score"
            in done.stderr)
    listed = gpumon_job("--list", "--prometheus", live.bare_url)
    assert listed.returncode == 1 and "gpumon_job:straggler_score" in listed.stderr


def test_unreachable_url_fails_clearly() -> None:
    port = closed_port()   # nothing listens there
    done = gpumon_job(JOB, "--prometheus", f"http://127.0.0.1:{port}", "--timeout", "2")
    assert done.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}" in done.stderr and "refused" in done.stderr


def test_a_server_that_never_answers_times_out() -> None:
    with socket.socket() as listener:   # the kernel completes the handshake; nobody ever reads or answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        done = gpumon_job("--list", "--prometheus", url, "--timeout", "1")
    assert done.returncode == 1
    assert f"cannot reach {url}: " in done.stderr and "timed out" in done.stderr


class _Gate(http.server.BaseHTTPRequestHandler):
    """An auth gateway in front of Prometheus (as a Mimir or a proxy would be): one credential passes."""

    upstream = ""
    accepted = ""   # the Authorization header it lets through

    def _forward(self) -> None:
        if self.headers.get("Authorization") != self.accepted:
            self.send_response(401)
            self.end_headers()
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
        request = urllib.request.Request(self.upstream + self.path, data=body, method=self.command)
        if body:
            request.add_header("Content-Type", self.headers["Content-Type"])
        with urllib.request.urlopen(request, timeout=5) as answer:
            data = answer.read()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _forward

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def gate(upstream: str, accepted: str) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("G", (_Gate,), {
        "upstream": upstream, "accepted": accepted}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def test_basic_auth_from_the_urls_user_information_never_shown(live: Live) -> None:
    secret = base64.b64encode(b"alice:s@cret").decode()
    with gate(live.url, f"Basic {secret}") as port:
        done = gpumon_job("--list", "--prometheus", f"http://alice:s%40cret@127.0.0.1:{port}", "--format", "json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)[0]["job_id"] == JOB
        refused = gpumon_job("--list", "--prometheus", f"http://alice:wr0ng@127.0.0.1:{port}")
        assert refused.returncode == 1
        assert f"http://127.0.0.1:{port}: HTTP 401: the user name and password in the URL were refused" in refused.stderr
        assert "wr0ng" not in refused.stderr + refused.stdout


def test_bearer_token_from_a_file(live: Live, tmp_path) -> None:
    with gate(live.url, "Bearer s3cret") as port:
        url = f"http://127.0.0.1:{port}"
        token = tmp_path / "token"
        token.write_text("s3cret\n")
        done = gpumon_job(JOB, "--prometheus", url, "--auth", "bearer", "--bearer-token-file", str(token),
                          "--format", "json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)[0]["gpu"] == SLOW_GPU
        token.write_text("wrong\n")
        refused = gpumon_job(JOB, "--prometheus", url, "--auth", "bearer", "--bearer-token-file", str(token))
        assert refused.returncode == 1 and "HTTP 401: the bearer token was refused" in refused.stderr
        anonymous = gpumon_job(JOB, "--prometheus", url)
        assert anonymous.returncode == 1 and "--bearer-token-file or --auth azure" in anonymous.stderr


@pytest.mark.parametrize("args, message", [
    ((), "give a JOB_ID or --list, not both"),
    ((JOB, "--list", "--prometheus", "http://127.0.0.1:1"), "give a JOB_ID or --list, not both"),
    ((JOB,), "--prometheus URL (or $GPUMON_PROMETHEUS_URL) is required"),
    ((JOB, "--prometheus", "prometheus:9090"), "must be an http:// or https:// URL"),
    ((JOB, "--prometheus", "http://127.0.0.1:1", "--auth", "bearer"), "--bearer-token-file is required"),
    ((JOB, "--prometheus", "https://ws.eastus.prometheus.monitor.azure.com", "--auth", "azure",
      "--credential", "service_principal"), "--tenant-id: is required with credential = service_principal"),
])
def test_bad_usage_exits_2(args, message) -> None:
    done = gpumon_job(*args)
    assert done.returncode == 2, done
    assert message in done.stderr


def test_url_from_the_environment(live: Live) -> None:
    done = gpumon_job("--list", env={"GPUMON_PROMETHEUS_URL": live.url})
    assert done.returncode == 0, done.stderr
    assert JOB in done.stdout


def test_rule_file_under_test_is_valid_for_promtool(tmp_path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("needs promtool")
    path = job_rules.write(str(tmp_path))
    done = subprocess.run(["promtool", "check", "rules", path], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stdout + done.stderr


def test_docs_mention_every_flag() -> None:
    with open(os.path.join(REPO, "docs", "job-health.md"), encoding="utf-8") as fh:
        text = fh.read()
    for flag in ("--prometheus", "--list", "--format json", "--watch", "--auth bearer", "--bearer-token-file",
                 "--auth azure", "--credential", "--iterations"):
        assert flag in text, flag

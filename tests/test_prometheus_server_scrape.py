"""A real Prometheus server scrapes `gpumon run` and stores what the page says."""

from __future__ import annotations

import json
import subprocess
import urllib.parse

from tests.conftest import free_port, http_get, wait_for


def test_real_prometheus_scrapes_gpumon(gpumon_run, tmp_path):
    exporter = gpumon_run()
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: gpumon\n    static_configs:\n      - targets: ['127.0.0.1:{exporter.port}']\n")
    server = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def query(expr: str) -> list:
            url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
            try:
                status, _, body = http_get(url, timeout=2)
            except OSError:
                return []
            return json.loads(body)["data"]["result"] if status == 200 else []

        up = wait_for(lambda: query('up{job="gpumon"} == 1'), timeout=30)
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{exporter.port}"
        build = wait_for(lambda: query("gpumon_build_info"), timeout=10)
        assert build[0]["metric"]["version"]
        assert wait_for(lambda: query("process_resident_memory_bytes > 0"), timeout=10)
    finally:
        server.terminate()
        server.wait(10)

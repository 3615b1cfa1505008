"""A real Prometheus server scrapes `gpumon run` and stores what the page says."""

from __future__ import annotations

from tests.conftest import wait_for


def test_real_prometheus_scrapes_gpumon(gpumon_run, prometheus_server):
    exporter = gpumon_run()
    server = prometheus_server({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "gpumon", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
    })
    up = wait_for(lambda: server.query('up{job="gpumon"} == 1'), timeout=30)
    assert up[0]["metric"]["instance"] == f"127.0.0.1:{exporter.port}"
    build = wait_for(lambda: server.query("gpumon_build_info"), timeout=10)
    assert build[0]["metric"]["version"]
    assert wait_for(lambda: server.query("process_resident_memory_bytes > 0"), timeout=10)

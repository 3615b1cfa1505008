"""`gpumon check` with an IMDS that answers but refuses (403, as from a proxy or firewall that
intercepts 169.254.169.254): the Azure collectors are reported failing, with the reason, as the daemon
will meet them, not `ok` because an answer came back. Driven against the loopback IMDS stand-in."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from gpumon import imds
from gpumon.collectors.azure_events import OPTIONS as EVENTS
from gpumon.collectors.azure_events import AzureEventsCollector
from gpumon.collectors.base import Context
from gpumon.collectors.host_info import OPTIONS as HOST_INFO
from gpumon.collectors.host_info import HostInfoCollector
from gpumon.config import DAEMON, load
from tests.conftest import REPO
from tests.fakes.imds import COMPUTE_PATH, EVENTS_PATH, ImdsServer


@pytest.fixture
def server():
    srv = ImdsServer()
    yield srv
    srv.close()


def check(server: ImdsServer, tmp_path, collectors: str = "host_info,azure_events") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUMON_AZURE_IMDS_URL": server.url, "GPUMON_HOST_INFO_KVP_POOL": "",
           "GPUMON_DAEMON_STATE_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "gpumon", "check", "--collectors", collectors,
                           "--sinks", "prometheus", "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=30, check=False, env=env, cwd=REPO)


def verdict(stdout: str, collector: str) -> tuple[str, str]:
    match = re.search(rf"^collector +{collector} +(\S+) +(.*)$", stdout, re.M)
    assert match, stdout
    return match.group(1), match.group(2)


def test_imds_answering_403_fails_both_azure_collectors_with_the_reason(server, tmp_path):
    server.fail(COMPUTE_PATH, 403)
    server.fail(EVENTS_PATH, 403)
    result = check(server, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for name, path in (("host_info", "/metadata/instance/compute"), ("azure_events", "/metadata/scheduledevents")):
        status, detail = verdict(result.stdout, name)
        assert status == "FAIL", result.stdout
        assert f"IMDS http_error asking {path}: HTTP 403" in detail
        assert "never through a proxy" in detail
        assert f'gpumon_collector_errors_total{{collector="{name}",reason="imds_http_error"}}' in detail


def test_only_scheduled_events_refused_fails_only_that_collector(server, tmp_path):
    server.fail(EVENTS_PATH, 403)
    result = check(server, tmp_path)
    assert result.returncode == 1
    assert verdict(result.stdout, "host_info")[0] == "ok"
    assert verdict(result.stdout, "azure_events")[0] == "FAIL"


def test_imds_answering_is_ok(server, tmp_path):
    result = check(server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert verdict(result.stdout, "host_info")[0] == "ok"
    assert verdict(result.stdout, "azure_events")[0] == "ok"


def test_check_says_what_a_daemon_run_counts(server):
    # The same stand-in, the collectors as the daemon runs them: the failure check names is the one
    # each run counts.
    server.fail(COMPUTE_PATH, 403)
    server.fail(EVENTS_PATH, 403)
    config = load([DAEMON, imds.OPTIONS, EVENTS, HOST_INFO], None,
                  {"GPUMON_AZURE_IMDS_URL": server.url, "GPUMON_HOST_INFO_KVP_POOL": ""}, {})
    ctx = Context("test", config=config)
    for cls in (HostInfoCollector, AzureEventsCollector):
        collector = cls(ctx, config.sections[cls.name])
        assert collector.probe().available  # IMDS is there...
        trial = collector.check()
        assert not trial.available and not trial.retry and "HTTP 403" in trial.reason
        assert collector.collect().errors == {"imds_http_error": 1}  # ...and refuses every run


def test_a_slow_first_scheduled_events_answer_is_a_wait_not_a_failure(server):
    config = load([DAEMON, imds.OPTIONS, EVENTS], None,
                  {"GPUMON_AZURE_IMDS_URL": server.url, "GPUMON_AZURE_EVENTS_TIMEOUT": "0.2"}, {})
    collector = AzureEventsCollector(Context("test", config=config), config.sections["azure_events"])
    server.hold(EVENTS_PATH)
    trial = collector.check()
    server.release()
    assert not trial.available and trial.retry
    assert "can take up to 2 minutes" in trial.reason

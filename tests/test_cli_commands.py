"""The face: `gpumon run|once|check|--version`, exit codes, signals and reload, as a user runs them."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from gpumon import __version__
from tests.conftest import clean_env, http_get, wait_for


def gpumon(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], env=clean_env(**env),
                          capture_output=True, text=True, timeout=60)


def test_version():
    result = gpumon("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"gpumon {__version__}"


def test_no_command_is_usage_error():
    assert gpumon().returncode == 2


def test_once_json_has_the_contract_shape(tmp_path):
    result = gpumon("once", "--format", "json", "--sysfs-root", str(tmp_path))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) == {"host", "time", "metrics", "events", "collectors"}
    build = next(m for m in doc["metrics"] if m["name"] == "gpumon_build_info")
    assert build["type"] == "info" and build["samples"][0]["labels"]["version"] == __version__
    for status in doc["collectors"]:
        assert set(status) == {"name", "ok", "duration_seconds", "error"}


def test_once_prometheus_is_promtool_clean():
    result = gpumon("once", "--format", "prometheus")
    assert result.returncode == 0
    lint = subprocess.run(["promtool", "check", "metrics"], input=result.stdout, capture_output=True,
                          text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_once_table_fits_100_columns():
    result = gpumon("once", "--format", "table")
    assert result.returncode == 0
    assert "Collectors" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 100


def test_run_serves_then_stops_on_sigterm_within_5_s(gpumon_run):
    process = gpumon_run("--collectors", "auto")
    assert "gpumon_build_info" in process.metrics()
    status, _, body = http_get(process.url + "/")
    assert status == 200
    t0 = time.monotonic()
    code, output = process.stop(signal.SIGTERM)
    assert code == 0 and time.monotonic() - t0 < 5.0, output


def test_sigint_stops_too(gpumon_run):
    process = gpumon_run()
    code, _ = process.stop(signal.SIGINT)
    assert code == 0


def test_sighup_reload_keeps_old_config_when_new_is_bad(gpumon_run, tmp_path):
    config = tmp_path / "gpumon.toml"
    config.write_text('[daemon]\nlog_level = "info"\n')
    process = gpumon_run("--config", str(config))
    config.write_text("[daemon]\ninterval = -5\n")
    process.proc.send_signal(signal.SIGHUP)
    # the endpoint keeps serving through and after the rejected reload, and says it was rejected
    wait_for(lambda: 'gpumon_config_reloads_total{result="failure"} 1' in process.metrics())
    assert "gpumon_config_last_reload_successful 0" in process.metrics()
    config.write_text('[daemon]\nlog_level = "debug"\n')
    process.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: 'gpumon_config_reloads_total{result="success"} 1' in process.metrics())
    page = process.metrics()
    assert "gpumon_config_last_reload_successful 1" in page
    assert sorted(line.split("}")[0] for line in page.splitlines()
                  if line.startswith("gpumon_config_reloads_total{")) == [
        'gpumon_config_reloads_total{result="failure"', 'gpumon_config_reloads_total{result="success"']
    code, output = process.stop()
    assert "new configuration rejected" in output and "[daemon] interval" in output
    assert output.count("SIGHUP: reloading") == 2


def test_reload_and_stop_do_not_report_collectors_down(gpumon_run, tmp_path):
    """Collector threads told to stop (for a reload, at SIGTERM) have not died: no collector_down
    event reaches the log or the sinks, and the page keeps gpumon_collector_up 1 across a reload."""
    process = gpumon_run("--simulate", "nd-h100-v5", "--interval", "1")
    wait_for(lambda: 'gpumon_collector_up{collector="nvml"} 1' in process.metrics(), timeout=20)
    process.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: 'gpumon_config_reloads_total{result="success"} 1' in process.metrics(), timeout=20)
    assert 'gpumon_collector_up{collector="infiniband"} 0' not in process.metrics()
    code, output = process.stop()
    assert code == 0 and "collector_down" not in output, output


def test_run_with_unavailable_explicit_collector_exits_1(tmp_path):
    result = gpumon("run", "--collectors", "infiniband", "--sysfs-root", str(tmp_path), "--listen",
                    "127.0.0.1:0", GPUMON_DAEMON_STATE_DIR=str(tmp_path))
    assert result.returncode == 1
    assert "collector 'infiniband' is unavailable" in result.stderr


def test_run_with_port_in_use_exits_1(gpumon_run, tmp_path):
    process = gpumon_run()
    result = gpumon("run", "--listen", f"127.0.0.1:{process.port}", GPUMON_DAEMON_STATE_DIR=str(tmp_path / "2"))
    assert result.returncode == 1 and "sink 'prometheus' failed to start" in result.stderr
    assert (f"cannot listen on 127.0.0.1:{process.port} (flag --listen): Address already in use"
            in result.stderr), result.stderr


def test_check_reports_each_item(tmp_path):
    result = gpumon("check", "--listen", "127.0.0.1:0", "--sysfs-root", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^sink +prometheus +ok ", result.stdout, re.M)


def test_check_config_only_names_renamed_keys_and_probes_nothing(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not read: the sink is off\n")
    config = tmp_path / "gpumon.toml"
    config.write_text(f'[otel]\ncertificate = "{ca}"\n')
    result = gpumon("check", "--config-only", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == f"config    {config}: ok\n"  # no collector or sink line: nothing probed
    assert "[otel] certificate is deprecated (honoured for now): use [otel] ca_file" in result.stderr

    config.write_text("[daemon]\nintervl = 3\n")
    result = gpumon("check", "--config-only", "--config", str(config))
    assert result.returncode == 2
    assert f"{config}: [daemon] intervl: unknown key" in result.stderr


def test_missing_sink_extra_names_the_pip_command(monkeypatch):
    from gpumon import registry
    from gpumon.cli import schemas
    from gpumon.config import load
    from gpumon.daemon import StartupError, make_sinks, sink_context
    from gpumon.sinks.base import Sink

    class Needy(Sink):
        name = "azure_monitor"
        requires = ("surely_not_installed_module",)
        extra = "azure"

    monkeypatch.setattr(registry, "sink_class", lambda name: Needy)
    config = load(schemas(), None, {}, {})
    config.daemon._values["sinks"] = ["azure_monitor"]
    try:
        make_sinks(config, sink_context(config))
    except StartupError as exc:
        assert str(exc) == "sink 'azure_monitor' needs: pip install 'gpumon-exporter[azure]'"
    else:
        raise AssertionError("a sink without its extra must not start")


def test_run_speaks_sd_notify(gpumon_run, tmp_path):
    import socket as socketlib

    path = str(tmp_path / "notify.sock")
    receiver = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(10)
    try:
        process = gpumon_run(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
        messages = [receiver.recv(4096).decode()]
        while "WATCHDOG=1" not in messages:
            messages.append(receiver.recv(4096).decode())
        assert messages[0] == "READY=1"
        process.stop()
        while "STOPPING=1" not in messages:
            messages.append(receiver.recv(4096).decode())
    finally:
        receiver.close()


def test_reload_to_a_config_that_cannot_start_keeps_serving(gpumon_run, tmp_path):
    config = tmp_path / "gpumon.toml"
    config.write_text('[daemon]\nlog_level = "info"\n')
    process = gpumon_run("--config", str(config), "--sysfs-root", str(tmp_path))
    # valid TOML, but an explicitly requested collector this host does not have
    config.write_text('[daemon]\ncollectors = ["infiniband"]\n')
    process.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: 'gpumon_config_reloads_total{result="failure"} 1' in process.metrics())
    # a web config file that does not exist
    config.write_text(f'[prometheus]\nweb_config_file = "{tmp_path}/missing.yml"\n')
    process.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: 'gpumon_config_reloads_total{result="failure"} 2' in process.metrics())
    assert process.proc.poll() is None
    code, output = process.stop()
    assert code == 0 and "collector 'infiniband' is unavailable" in output and "missing.yml" in output


def test_reload_picks_up_a_changed_web_config_file(gpumon_run, tmp_path):
    import bcrypt

    web = tmp_path / "web.yml"
    web.write_text("")
    config = tmp_path / "gpumon.toml"
    config.write_text(f'[prometheus]\nweb_config_file = "{web}"\n')
    process = gpumon_run("--config", str(config))
    assert http_get(process.url + "/metrics")[0] == 200
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    web.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")  # same path, new content
    process.proc.send_signal(signal.SIGHUP)

    def asks_for_credentials() -> bool:
        try:  # the sink is restarted with its new settings: a connection may be cut meanwhile
            return http_get(process.url + "/metrics", timeout=2)[0] == 401
        except OSError:
            return False

    wait_for(asks_for_credentials)

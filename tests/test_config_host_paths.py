"""Values naming the host to watch: a sysfs root given explicitly that is not there, and an unknown
simulation profile, are configuration errors (exit 2 naming key and origin), not a host without
InfiniBand; the default /sys is never refused."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import clean_env, wait_for


def gpumon(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], env=clean_env(**env),
                          capture_output=True, text=True, timeout=15)


@pytest.mark.parametrize("command", ["run", "once", "check"])
def test_missing_sysfs_root_flag_is_exit_2(tmp_path, command):
    missing = tmp_path / "host" / "sys"
    extra = [] if command == "once" else ["--listen", "127.0.0.1:0"]  # once serves nothing: no --listen
    result = gpumon(command, "--sysfs-root", str(missing), *extra, GPUMON_DAEMON_STATE_DIR=str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == f"gpumon: error: flag --sysfs-root: [daemon] sysfs_root: {missing}: no such directory"


def test_missing_sysfs_root_from_file_and_environment_names_its_origin(tmp_path):
    config = tmp_path / "gpumon.toml"
    config.write_text('[daemon]\nsysfs_root = "/host/sys-not-mounted"\n')
    from_file = gpumon("once", "--config", str(config))
    assert from_file.returncode == 2
    assert f"{config}: [daemon] sysfs_root: /host/sys-not-mounted: no such directory" in from_file.stderr
    from_env = gpumon("once", GPUMON_DAEMON_SYSFS_ROOT=str(config))
    assert from_env.returncode == 2
    assert (f"environment variable GPUMON_DAEMON_SYSFS_ROOT: [daemon] sysfs_root: {config}: not a directory"
            in from_env.stderr)


def test_an_existing_root_without_infiniband_is_a_host_without_infiniband(tmp_path):
    result = gpumon("once", "--format", "json", "--sysfs-root", str(tmp_path))
    assert result.returncode == 0, result.stderr


def test_unknown_simulation_profile_is_exit_2_and_leaves_nothing_behind(tmp_path):
    result = gpumon("run", "--listen", "127.0.0.1:0", GPUMON_DAEMON_SIMULATE="nd-z9",
                    GPUMON_DAEMON_STATE_DIR=str(tmp_path))
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.startswith("gpumon: error: environment variable GPUMON_DAEMON_SIMULATE: [daemon] simulate: "
                           "unknown simulation profile 'nd-z9' (known: "), line
    assert not (tmp_path / "simulate").exists()


def test_reload_to_a_missing_sysfs_root_keeps_the_running_config(gpumon_run, tmp_path):
    config = tmp_path / "gpumon.toml"
    config.write_text(f'[daemon]\nsysfs_root = "{tmp_path}"\n')
    process = gpumon_run("--config", str(config))
    config.write_text(f'[daemon]\nsysfs_root = "{tmp_path}/gone"\n')
    process.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: 'gpumon_config_reloads_total{result="failure"} 1' in process.metrics())
    code, output = process.stop()
    assert code == 0 and f"[daemon] sysfs_root: {tmp_path}/gone: no such directory" in output, output

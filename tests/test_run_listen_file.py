"""`gpumon run --listen HOST:0`: the kernel picks the port and gpumon says which, in the log,
``<state_dir>/listen`` and ``--listen-file``, so nothing races for a port between choosing and binding."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.conftest import GpumonProcess, clean_env, http_get, read_listen_file, wait_for


def test_two_daemons_on_port_0_at_once_report_distinct_ports(tmp_path):
    processes = [GpumonProcess(["--sysfs-root", str(tmp_path)], clean_env(
        GPUMON_DAEMON_STATE_DIR=str(tmp_path / f"state-{i}"))) for i in range(2)]
    try:
        for process in processes:
            process.wait_ready()
        ports = [process.port for process in processes]
        assert len(set(ports)) == 2 and 0 not in ports
        for i, process in enumerate(processes):
            address = f"127.0.0.1:{process.port}"
            assert read_listen_file(process.listen_file) == address
            assert read_listen_file(str(tmp_path / f"state-{i}" / "listen")) == address  # the state dir's too
            assert http_get(process.url + "/healthz")[0] == 200
        for i, process in enumerate(processes):
            code, out = process.stop()
            assert code == 0, out
            assert f"listening on 127.0.0.1:{process.port} (written to {process.listen_file})" in out
            # a clean stop takes the address back: a file left behind would name a port nobody serves
            assert not os.path.exists(process.listen_file)
            assert not os.path.exists(tmp_path / f"state-{i}" / "listen")
    finally:
        for process in processes:
            process.cleanup()


def test_a_reload_that_restarts_the_endpoint_rewrites_the_file(tmp_path):
    config = tmp_path / "gpumon.toml"
    config.write_text("[prometheus]\nbacklog = 64\n")
    process = GpumonProcess(["--config", str(config), "--sysfs-root", str(tmp_path)],
                            clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path / "state")))
    try:
        process.wait_ready()
        first = read_listen_file(process.listen_file)
        config.write_text("[prometheus]\nbacklog = 32\n")  # a changed sink setting: a new server, a new port 0
        process.proc.send_signal(signal.SIGHUP)
        second = str(wait_for(lambda: (read_listen_file(process.listen_file) or first) != first
                              and read_listen_file(process.listen_file), timeout=15))
        assert http_get(f"http://{second}/healthz")[0] == 200
        assert process.stop()[0] == 0
    finally:
        process.cleanup()


def test_a_listen_file_that_cannot_be_written_fails_the_start(tmp_path):
    missing = tmp_path / "no-such-dir" / "listen"
    result = subprocess.run([sys.executable, "-m", "gpumon", "run", "--listen", "127.0.0.1:0", "--listen-file",
                             str(missing), "--sysfs-root", str(tmp_path)],
                            env=clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path / "state")),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1, result.stderr
    assert f"cannot write the listen address to {missing}: No such file or directory" in result.stderr
    assert not os.path.exists(tmp_path / "state" / "listen")  # stopped: nothing claims to listen


def test_the_state_dir_file_is_best_effort_and_the_asked_for_one_is_kept_current(tmp_path, caplog):
    from gpumon.daemon.listen_file import ListenFiles

    explicit = tmp_path / "addr"
    files = ListenFiles(str(explicit))
    nowhere = str(tmp_path / "not-a-dir")
    (tmp_path / "not-a-dir").write_text("")  # a state "directory" that is a file: nothing can go under it
    with caplog.at_level("INFO", logger="gpumon.listen"):
        files.update("127.0.0.1:41000", nowhere)
        files.update("[::1]:41001", nowhere)  # the endpoint moved (a reload)
    assert explicit.read_text() == "[::1]:41001\n"
    assert sum("cannot write the listen address" in r.getMessage() for r in caplog.records) == 1  # logged once
    files.update(None, nowhere)  # nothing listens any more
    assert not explicit.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-dir"]  # no temporary file left behind

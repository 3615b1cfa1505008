"""One `gpumon run` per state directory: the second exits 2 naming the holder's PID and the directory;
a lock left by a killed process never blocks; `once` and `check` run beside a daemon."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

from gpumon.statelock import LOCK_FILE
from tests.conftest import GpumonProcess, clean_env, wait_for


def gpumon(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], env=clean_env(**env),
                          capture_output=True, text=True, timeout=15)


def test_second_instance_on_the_same_state_dir_exits_2_naming_the_holder(gpumon_run, tmp_path):
    first = gpumon_run()
    state = tmp_path / "state"
    assert (state / LOCK_FILE).read_text() == f"{first.proc.pid}\n"
    second = gpumon("run", "--listen", "127.0.0.1:0", GPUMON_DAEMON_STATE_DIR=str(state))
    assert second.returncode == 2
    assert second.stderr.strip() == (
        f"gpumon: error: environment variable GPUMON_DAEMON_STATE_DIR: [daemon] state_dir: {state} is in use "
        f"by another gpumon (pid {first.proc.pid}; lock {state / LOCK_FILE})")
    assert first.proc.poll() is None and "gpumon_build_info" in first.metrics()


def test_once_and_check_run_beside_a_daemon(gpumon_run, tmp_path):
    gpumon_run()
    env = {"GPUMON_DAEMON_STATE_DIR": str(tmp_path / "state")}
    assert gpumon("once", "--format", "json", "--sysfs-root", str(tmp_path), **env).returncode == 0
    assert gpumon("check", "--listen", "127.0.0.1:0", "--sysfs-root", str(tmp_path), **env).returncode == 0


def test_a_killed_holder_does_not_block_the_next_start(gpumon_run, tmp_path):
    first = gpumon_run()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.communicate(timeout=10)
    lock = tmp_path / "state" / LOCK_FILE
    assert lock.read_text() == f"{first.proc.pid}\n"  # the file stays, with the dead PID in it
    second = gpumon_run()
    assert lock.read_text() == f"{second.proc.pid}\n"
    code, output = second.stop()
    assert code == 0, output
    assert lock.read_text() == ""  # released at exit: no PID of a process that is gone


def test_lock_is_released_at_exit(gpumon_run, tmp_path):
    first = gpumon_run()
    assert first.stop()[0] == 0
    with open(tmp_path / "state" / LOCK_FILE, "rb+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if gpumon still held it


def test_reload_onto_a_busy_state_dir_is_rejected_and_the_old_lock_kept(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    config = tmp_path / "gpumon.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path}/state"\n')
    process = GpumonProcess(["--config", str(config)], clean_env())  # state_dir from the file
    try:
        process.wait_ready()
        _reload_between_directories(process, tmp_path, busy, config)
    finally:
        process.cleanup()


def _reload_between_directories(process: GpumonProcess, tmp_path, busy, config) -> None:
    with open(busy / LOCK_FILE, "w") as holder:  # another instance, as far as gpumon can tell
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write(f"{os.getpid()}\n")
        holder.flush()
        config.write_text(f'[daemon]\nstate_dir = "{busy}"\n')
        process.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: 'gpumon_config_reloads_total{result="failure"} 1' in process.metrics())
    assert (tmp_path / "state" / LOCK_FILE).read_text() == f"{process.proc.pid}\n"
    # a free new directory: the lock moves with the reload
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path}/moved"\n')
    process.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: 'gpumon_config_reloads_total{result="success"} 1' in process.metrics())
    assert (tmp_path / "moved" / LOCK_FILE).read_text() == f"{process.proc.pid}\n"
    assert (tmp_path / "state" / LOCK_FILE).read_text() == ""
    code, output = process.stop()
    assert code == 0 and f"{busy} is in use by another gpumon (pid {os.getpid()}" in output, output


REMOTE_WRITE = {"GPUMON_REMOTE_WRITE_URL": "http://127.0.0.1:1/api/v1/write"}   # a closed port: kept spooled


def test_a_second_daemon_on_an_explicit_spool_dir_another_holds_exits_2(gpumon_run, tmp_path):
    shared = tmp_path / "shared-spool"
    first = gpumon_run("--sinks", "prometheus,remote_write",
                       env={**REMOTE_WRITE, "GPUMON_REMOTE_WRITE_SPOOL_DIR": str(shared)})
    second = gpumon("run", "--listen", "127.0.0.1:0", "--sinks", "prometheus,remote_write",
                    GPUMON_DAEMON_STATE_DIR=str(tmp_path / "other-state"),
                    GPUMON_REMOTE_WRITE_SPOOL_DIR=str(shared), **REMOTE_WRITE)
    assert second.returncode == 2, second.stderr
    assert f"spool directory {shared} is in use by another gpumon (pid {first.proc.pid}" in second.stderr
    assert "[remote_write]: spool_dir" in second.stderr
    assert first.proc.poll() is None and "gpumon_build_info" in first.metrics()
    code, output = first.stop()
    assert code == 0, output
    again = gpumon_run("--sinks", "prometheus,remote_write",       # the holder gone, the spool is free
                       env={**REMOTE_WRITE, "GPUMON_REMOTE_WRITE_SPOOL_DIR": str(shared),
                            "GPUMON_DAEMON_STATE_DIR": str(tmp_path / "other-state")})
    assert "gpumon_build_info" in again.metrics()


def test_a_default_spool_that_cannot_be_made_exits_2(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "spool").write_text("a file where the spool directories go\n")
    result = gpumon("run", "--listen", "127.0.0.1:0", "--sinks", "prometheus,remote_write",
                    GPUMON_DAEMON_STATE_DIR=str(state), **REMOTE_WRITE)
    assert result.returncode == 2, result.stderr
    assert "spool_dir" in result.stderr and str(state / "spool" / "remote_write") in result.stderr


def test_simulate_with_a_read_only_state_dir_leaves_no_temporary_directory(gpumon_run, tmp_path):
    import shutil

    import pytest

    state, scratch = tmp_path / "read-only-state", tmp_path / "tmp"
    state.mkdir()
    scratch.mkdir()
    # immutable: unwritable even for root (the tests run as root, for whom a mode 0555 directory is writable)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(state)]).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        process = gpumon_run("--simulate", "nd-h100-v5", env={"GPUMON_DAEMON_STATE_DIR": str(state),
                                                              "TMPDIR": str(scratch)})
        assert [p.name for p in scratch.iterdir()][0].startswith("gpumon-simulate-")   # simulating there
        wait_for(lambda: "gpumon_ib_port_info{" in process.metrics(), timeout=15)      # the simulated host
        code, output = process.stop()
        assert code == 0, output
        assert list(scratch.iterdir()) == []                   # and nothing of it left behind
    finally:
        subprocess.run(["chattr", "-i", str(state)])


def test_a_spool_made_unwritable_mid_run_is_logged_once_and_the_sink_stays_up(gpumon_run, tmp_path):
    import shutil

    import pytest

    from tests.fakes.remote_write import Receiver

    if shutil.which("chattr") is None:
        pytest.skip("no chattr")
    receiver = Receiver()
    spool = tmp_path / "state" / "spool" / "remote_write"
    process = gpumon_run("--simulate", "nd-h100-v5", "--sinks", "prometheus,remote_write", "--interval", "0.5",
                         env={"GPUMON_REMOTE_WRITE_URL": receiver.url})
    wait_for(lambda: len(receiver.received) >= 2, timeout=10)
    # immutable: no file can be made or renamed in it, even by root (the cursor is written by rename)
    if subprocess.run(["chattr", "+i", str(spool)]).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        before = len(receiver.received)
        wait_for(lambda: len(receiver.received) >= before + 4, timeout=10)       # delivery goes on
        assert 'gpumon_sink_up{sink="remote_write"} 1' in process.metrics()
    finally:
        subprocess.run(["chattr", "-i", str(spool)])
    after = len(receiver.received)
    wait_for(lambda: len(receiver.received) >= after + 2, timeout=10)
    code, output = process.stop()
    assert code == 0, output
    assert output.count("cannot save the read position") == 1, output
    assert output.count("can be saved again") == 1

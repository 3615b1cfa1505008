"""Hostile config files: rejected with the file and key named, at start-up (exit 2, no traceback) and
on SIGHUP (the running daemon keeps serving and counts the failed reload). Non-regular files (FIFOs,
directories, devices) are refused without blocking."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from gpumon.cli import schemas
from gpumon.config import ConfigError, load, readable_file_check
from tests.conftest import clean_env, wait_for

HUGE = "9" * 400
BAD_FILES = {
    # name: (file text, the key the message must name, a fragment of the message)
    "400-digit float": (f"[daemon]\ninterval = {HUGE}\n", "[daemon] interval", "out of range"),
    "400-digit int": (f"[prometheus]\nbacklog = {HUGE}\n", "[prometheus] backlog", "out of range"),
    "negative 400 digits": (f"[daemon]\ndeadline = -{HUGE}\n", "[daemon] deadline", "out of range"),
    "5000-digit integer": ("[daemon]\ninterval = " + "9" * 5000 + "\n", "(syntax)", "digits"),
    "arrays nested 5000 deep": ("[daemon]\nsinks = " + "[" * 5000 + "]" * 5000 + "\n", "(syntax)",
                                "nested too deeply"),
    "inline tables nested 3000 deep": ("x = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n", "(syntax)", ""),
    "list nested 100 deep": ("[daemon]\nsinks = " + "[" * 100 + "]" * 100 + "\n", "[daemon] sinks",
                             "list of strings"),
    "regex nested 20000 deep": ("[infiniband]\ninclude_devices = '" + "(" * 20000 + ")" * 20000 + "'\n",
                                "[infiniband] include_devices", "regular expression"),
    "regex repeat overflow": ("[infiniband]\nexclude_devices = 'a{99999999999}'\n",
                              "[infiniband] exclude_devices", "regular expression"),
    "not UTF-8": ("[daemon]\nhostname = '\udcff'\n", "(file)", "UTF-8"),
}


def write_bad(tmp_path, name: str) -> str:
    text = BAD_FILES[name][0]
    path = tmp_path / f"{name.replace(' ', '-')}.toml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    return str(path)


def gpumon(*args: str, timeout: float = 15, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], env=clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_load_raises_config_error_naming_file_and_key(tmp_path, name):
    path = write_bad(tmp_path, name)
    _, key, fragment = BAD_FILES[name]
    with pytest.raises(ConfigError) as err:
        load(schemas(), path, {}, {})
    assert err.value.source == path and err.value.key == key
    assert fragment in err.value.message
    assert len(str(err.value)) < 400, "the error line must stay one short line"


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_start_up_exits_2_with_one_line_and_no_traceback(tmp_path, name):
    path = write_bad(tmp_path, name)
    result = gpumon("once", "--config", path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and BAD_FILES[name][1] in lines[0], result.stderr


def test_environment_with_huge_numbers_is_a_config_error():
    for var in ("GPUMON_DAEMON_INTERVAL", "GPUMON_PROMETHEUS_BACKLOG"):
        with pytest.raises(ConfigError) as err:
            load(schemas(), None, {var: "9" * 5000}, {})
        assert var in str(err.value)


def test_running_daemon_rejects_every_bad_file_on_sighup(gpumon_run, tmp_path):
    config = tmp_path / "gpumon.toml"
    config.write_text('[daemon]\nlog_level = "info"\n')
    process = gpumon_run("--config", str(config))
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    bad = [BAD_FILES[name][0] for name in sorted(BAD_FILES)]
    for count, text in enumerate(bad, start=1):
        config.write_bytes(text.encode("utf-8", "surrogateescape"))
        process.proc.send_signal(signal.SIGHUP)
        wait_for(lambda n=count: f'gpumon_config_reloads_total{{result="failure"}} {n}' in process.metrics())
    # the file swapped for a FIFO: the reload must not wait for a writer that never comes
    os.replace(fifo, config)
    process.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: f'gpumon_config_reloads_total{{result="failure"}} {len(bad) + 1}' in process.metrics())
    assert process.proc.poll() is None
    assert "gpumon_config_last_reload_successful 0" in process.metrics()
    code, output = process.stop()
    assert code == 0 and "Traceback" not in output, output
    assert output.count("new configuration rejected") == len(bad) + 1
    assert "[prometheus] backlog" in output and "is a FIFO" in output


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_non_regular_config_file_is_refused_without_blocking(tmp_path, kind):
    path = tmp_path / "gpumon.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path = "/dev/zero"  # endless: reading it would never finish
    words = {"fifo": "a FIFO", "directory": "a directory", "device": "a character device"}[kind]
    result = gpumon("run", "--config", str(path), "--listen", "127.0.0.1:0",
                    GPUMON_DAEMON_STATE_DIR=str(tmp_path / "state"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"gpumon: error: {path}: (file): is {words}, not a regular file"


def test_readable_file_check_for_options_naming_a_file(tmp_path):
    fifo = tmp_path / "web.yml"
    os.mkfifo(fifo)
    regular = tmp_path / "ok.yml"
    regular.write_text("")
    assert readable_file_check("") is None  # unset
    assert readable_file_check(str(regular)) is None
    assert readable_file_check(str(fifo)) == f"{fifo} is a FIFO, not a regular file"
    assert readable_file_check(str(tmp_path)) == f"{tmp_path} is a directory, not a regular file"
    assert "No such file" in readable_file_check(str(tmp_path / "absent.yml"))

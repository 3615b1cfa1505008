"""Sink options that name a file are checked when the config loads: a file that is not there, a
directory or a FIFO is a config error naming the section and key (exit 2, or a refused reload), never
a sink that blocks on a read or a thread that dies on its first export. Empty means unset."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from gpumon.cli import schemas
from gpumon.config import ConfigError, load

FILE_OPTIONS = [
    ("otel", "certificate"),
    ("otel", "client_certificate"),
    ("otel", "client_key"),
    ("prometheus", "web_config_file"),
    ("remote_write", "password_file"),
    ("remote_write", "bearer_token_file"),
    ("remote_write", "ca_file"),
    ("remote_write", "cert_file"),
    ("remote_write", "key_file"),
    ("azure_monitor", "ca_bundle"),
]


def _load(tmp_path, section: str, key: str, value: str):
    path = tmp_path / "gpumon.toml"
    path.write_text(f"[{section}]\n{key} = {value!r}\n")
    return load(schemas(), str(path), {}, {})


@pytest.mark.parametrize(("section", "key"), FILE_OPTIONS)
def test_a_file_option_naming_no_file_is_a_config_error(tmp_path, section, key):
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, section, key, missing)
    assert err.value.key == f"[{section}] {key}" and missing in err.value.message


@pytest.mark.parametrize(("section", "key"), FILE_OPTIONS)
def test_a_file_option_naming_a_fifo_is_refused_without_blocking(tmp_path, section, key):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, section, key, fifo)
    assert "FIFO" in err.value.message


@pytest.mark.parametrize(("section", "key"), FILE_OPTIONS)
def test_a_file_option_left_empty_or_naming_a_file_loads(tmp_path, section, key):
    regular = tmp_path / "file.pem"
    regular.write_text("x\n")
    assert _load(tmp_path, section, key, "")[section][key] == ""
    assert _load(tmp_path, section, key, str(regular))[section][key] == str(regular)


def _without_blocking(call: Callable[[], Any]) -> BaseException | None:
    """Run ``call`` on a thread; the exception it raised. Fails the test if it is still blocked."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive(), "blocked on a FIFO"
    return raised[0] if raised else None


def _unblock(fifo: str) -> None:
    """Release a reader left blocked by the code under test (only before the fix)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def test_a_web_config_swapped_for_a_fifo_is_refused_without_blocking(tmp_path):
    """The option is checked at load; the file is read again at start and on reload."""
    from gpumon.sinks.prometheus.webconfig import load_web_config

    fifo = str(tmp_path / "web.yml")
    os.mkfifo(fifo)
    try:
        exc = _without_blocking(lambda: load_web_config(fifo))
    finally:
        _unblock(fifo)
    assert isinstance(exc, ConfigError) and "regular file" in exc.message


@pytest.mark.parametrize("auth", ["basic", "bearer"])
def test_a_remote_write_secret_file_swapped_for_a_fifo_fails_the_request_without_blocking(tmp_path, auth):
    from tests.fakes.remote_write import make_sink

    fifo = str(tmp_path / "secret")
    os.mkfifo(fifo)
    key = "password_file" if auth == "basic" else "bearer_token_file"
    sink = make_sink(tmp_path, "http://127.0.0.1:9/api/v1/write", auth=auth, username="u", **{key: fifo})
    try:
        exc = _without_blocking(sink._authorization)
    finally:
        _unblock(fifo)
    assert isinstance(exc, OSError) and "regular file" in str(exc)

"""sd_notify over a real AF_UNIX datagram socket, as systemd's manager receives it."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator

import pytest

from gpumon import sdnotify


def _receive(sock: socket.socket) -> str:
    sock.settimeout(5.0)
    return sock.recv(4096).decode()


@pytest.fixture
def path_socket(tmp_path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        yield sock, {"NOTIFY_SOCKET": path}


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, dict[str, str]]]:
    name = f"gpumon-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        yield sock, {"NOTIFY_SOCKET": "@" + name}


def test_ready_reaches_a_path_socket(path_socket):
    sock, env = path_socket
    assert sdnotify.notify("READY=1", env) is True
    assert _receive(sock) == "READY=1"


def test_abstract_namespace_socket_is_addressed_with_a_nul(abstract_socket):
    sock, env = abstract_socket
    assert sdnotify.notify("STOPPING=1", env) is True
    assert _receive(sock) == "STOPPING=1"


def test_reads_notify_socket_from_the_process_environment(path_socket, monkeypatch):
    sock, env = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", env["NOTIFY_SOCKET"])
    assert sdnotify.notify("READY=1") is True
    assert _receive(sock) == "READY=1"


def test_no_socket_means_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.notify("READY=1", {}) is False


def test_missing_socket_file_returns_false_and_warns_once(tmp_path, caplog):
    env = {"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}
    sdnotify._warned.clear()
    with caplog.at_level("WARNING", logger="gpumon.sdnotify"):
        assert sdnotify.notify("WATCHDOG=1", env) is False
        assert sdnotify.notify("WATCHDOG=1", env) is False
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


def test_unsupported_address_is_refused(caplog):
    sdnotify._warned.clear()
    with caplog.at_level("WARNING", logger="gpumon.sdnotify"):
        assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert "not a path" in caplog.text


def test_reloading_carries_a_monotonic_timestamp(path_socket):
    sock, env = path_socket
    start = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading(env) is True
    lines = _receive(sock).split("\n")
    assert lines[0] == "RELOADING=1"
    key, _, value = lines[1].partition("=")
    assert key == "MONOTONIC_USEC"
    end = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert start <= int(value) <= end


def test_status_is_one_line(path_socket):
    sock, env = path_socket
    assert sdnotify.status("2 collectors up\n1 down", env) is True
    assert _receive(sock) == "STATUS=2 collectors up 1 down"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "60000000"}, 30.0),
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "4242"}, 30.0),
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "x"}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_for_our_pid(environ, expected):
    assert sdnotify.watchdog_interval(environ, pid=4242) == expected


def test_watchdog_interval_defaults_to_our_own_pid():
    env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert sdnotify.watchdog_interval(env) == 1.0


def test_watchdog_pings_at_most_once_per_interval(path_socket):
    sock, env = path_socket
    env = {**env, "WATCHDOG_USEC": "20000000"}  # 20 s timeout -> a ping every 10 s
    now = [100.0]
    wd = sdnotify.Watchdog(sdnotify.watchdog_interval(env), env, clock=lambda: now[0])
    assert wd.enabled and wd.interval == 10.0
    assert wd.next_due() == 0.0
    assert wd.tick() is True
    assert _receive(sock) == "WATCHDOG=1"
    now[0] = 105.0
    assert wd.next_due() == 5.0
    assert wd.tick() is False
    now[0] = 110.0
    assert wd.tick() is True
    assert _receive(sock) == "WATCHDOG=1"
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


def test_watchdog_without_systemd_never_pings():
    wd = sdnotify.Watchdog.from_environ({})
    assert not wd.enabled
    assert wd.next_due() is None
    assert wd.tick() is False

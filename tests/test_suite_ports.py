"""The suite's own servers never lose a race for a port (tests/conftest.py): Prometheus, which
cannot say which port it got, starts again on another when its port was taken first."""

from __future__ import annotations

import shutil
import socket

import pytest

from tests.conftest import PrometheusServer, http_get

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus server")


def test_prometheus_moves_to_another_port_when_its_port_was_taken(tmp_path):
    with socket.socket() as squatter:  # another program on loopback took the port first
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = PrometheusServer(str(tmp_path))
        server.port = squatter.getsockname()[1]
        try:
            server.start()
            assert server.port != squatter.getsockname()[1]
            assert http_get(server.url + "/-/ready", timeout=5)[0] == 200
        finally:
            server.stop()
    assert "address already in use" in (tmp_path / "prometheus.log").read_text()

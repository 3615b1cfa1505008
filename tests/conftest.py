"""Shared test plumbing: ports, polling with a deadline, and a real `gpumon run` process.

Ports: nothing in the suite picks a port and binds it later, which loses the port whenever another
program on the machine (or another copy of the suite) binds in between. Every server binds port 0
and says which port it got: `gpumon run --listen 127.0.0.1:0 --listen-file F` (:class:`GpumonProcess`),
the in-process stand-ins (IMDS, kubelet, kube API, OTLP, remote write and Logs Ingestion receivers)
from their socket. Prometheus cannot say which port it got, so :class:`PrometheusServer` starts it
on a port free a moment before and again on another when it exits with "address already in use".
:func:`closed_port` is only for an endpoint that must refuse connections ("unreachable").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from gpumon.model import Collection, Sample, Snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def closed_port() -> int:
    """A loopback port nothing listens on now, for an "unreachable" endpoint: connecting to it is
    refused. Never for a server to bind later (another program can take it in between): a server
    binds port 0 and reports the port it got (gpumon: ``--listen 127.0.0.1:0`` + ``--listen-file``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_http(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """A threaded HTTP stand-in for ``handler`` on a loopback port the kernel picks, already serving in
    a daemon thread, and its ``http://127.0.0.1:PORT`` origin. Stop it with :func:`stop_http`."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def stop_http(httpd: ThreadingHTTPServer) -> None:
    httpd.shutdown()
    httpd.server_close()


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0,
             context=None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _samples(result: Collection | Snapshot, name: str) -> list[Sample]:
    return [s for fam in result.families if fam.name == name for s in fam.samples]


def values(result: Collection | Snapshot, name: str) -> dict[tuple[str, ...], float]:
    """Label values (in the metric's label order) -> value, for every sample of ``name``."""
    return {tuple(v for _, v in s.labels): s.value for s in _samples(result, name)}


def series(result: Collection | Snapshot, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Label pairs -> value, for every sample of ``name``."""
    return {s.labels: s.value for s in _samples(result, name)}


def gpu_values(result: Collection | Snapshot, name: str, **labels: str) -> dict[str, float]:
    """GPU index -> value, for the samples of ``name`` matching ``labels``."""
    return {s.label("gpu") or "": s.value for s in _samples(result, name)
            if all(s.label(k) == v for k, v in labels.items())}


def write_distribution(root: Path, name: str, entry_points: str, modules: dict[str, str] | None = None) -> Path:
    """An installed distribution as importlib.metadata finds it on a ``sys.path`` directory: its
    dist-info (``entry_points`` in entry_points.txt form) and its top-level modules (dedented)."""
    root.mkdir(parents=True, exist_ok=True)
    dist = root / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(entry_points)
    for module, text in (modules or {}).items():
        (root / module).write_text(textwrap.dedent(text))
    return root


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any GPUMON_ variable leaking in from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON_")}
    env["GPUMON_AZURE_IMDS_URL"] = "http://127.0.0.1:1"  # a closed loopback port: never the real IMDS
    env.update(extra)
    return env


class GpumonProcess:
    """A real `gpumon run` child process on a loopback port the kernel picks (``--listen 127.0.0.1:0``):
    it writes the address it bound to ``--listen-file`` and :attr:`port` reads it there, so no other
    program on the machine can take the port between choosing and binding it."""

    def __init__(self, args: list[str], env: dict[str, str], command: list[str] | None = None,
                 cwd: str | None = None) -> None:
        """``command`` runs another gpumon than this checkout's (a venv's ``bin/gpumon``)."""
        self._dir = tempfile.mkdtemp(prefix="gpumon-listen-")
        self.listen_file = os.path.join(self._dir, "listen")
        self._port: int | None = None
        self.proc = subprocess.Popen([*(command or [sys.executable, "-m", "gpumon"]), "run",
                                      "--listen", "127.0.0.1:0", "--listen-file", self.listen_file, *args],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)

    @property
    def port(self) -> int:
        """The port gpumon serves on now, from its listen file: waited for (it is written once bound)
        and read again each time, since a reload that restarts the endpoint binds a new port 0."""
        address = read_listen_file(self.listen_file) if self.proc.poll() is None else None
        if address is None and self._port is None:
            address = str(wait_for(self._listening, timeout=15))
        if address is not None:
            self._port = int(address.rpartition(":")[2])
        assert self._port is not None
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listening(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"gpumon exited {self.proc.returncode}: {self.proc.stdout.read()}")
        return read_listen_file(self.listen_file)

    def wait_ready(self, timeout: float = 15.0) -> None:
        def ready() -> bool:
            if self._port is None and self._listening() is None:  # not bound yet (or exited: raises)
                return False
            try:  # serving (/healthz) and past the first snapshot (/metrics is 503 only before it)
                return (http_get(self.url + "/healthz", timeout=1)[0] == 200
                        and http_get(self.url + "/metrics", timeout=2)[0] != 503)
            except OSError:
                return False

        wait_for(ready, timeout)

    def metrics(self) -> str:
        status, _, body = http_get(self.url + "/metrics")
        assert status == 200
        return body.decode()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            raise AssertionError(f"gpumon did not stop within {timeout} s: {out}") from None
        with contextlib.suppress(OSError):  # empty once a clean stop removed the listen file
            os.rmdir(self._dir)
        return self.proc.returncode, out

    def cleanup(self) -> None:
        """Kill a process still running and drop its listen-file directory."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        shutil.rmtree(self._dir, ignore_errors=True)


def read_listen_file(path: str) -> str | None:
    """``HOST:PORT`` from a listen file, or None before it is written (it is replaced by rename,
    so a line that is there is whole)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


@pytest.fixture
def gpumon_run(tmp_path):
    """Start `gpumon run` with extra args; stopped (SIGTERM) at the end of the test."""
    started: list[GpumonProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, ready: bool = True) -> GpumonProcess:
        environment = clean_env(GPUMON_DAEMON_STATE_DIR=str(tmp_path / "state"))
        if "--simulate" in args:  # a simulated host answers from its own loopback IMDS
            environment.pop("GPUMON_AZURE_IMDS_URL", None)
        environment.update(env or {})
        process = GpumonProcess(list(args), environment)
        started.append(process)
        if ready:
            process.wait_ready()
        return process

    yield start
    for process in started:
        process.cleanup()


class PrometheusServer:
    """A real Prometheus (the Debian package) on a loopback port with its TSDB under ``directory``.

    ``config`` is the prometheus.yml as a dict; ``args`` extra flags such as
    ``--web.enable-remote-write-receiver``. ``stop()`` and ``start()`` again keep the port and the data,
    as a restarted receiver would.

    Ports: Prometheus does not report the port it got for ``--web.listen-address=127.0.0.1:0``, so
    the first start takes a port that is free now (:func:`closed_port`) and, when another program
    took it before Prometheus bound it (Prometheus exits with "bind: address already in use"), starts
    again on another, up to :data:`BIND_ATTEMPTS` times. A restart keeps its port, as a real one does.
    """

    BIND_ATTEMPTS = 5

    def __init__(self, directory: str, config: dict | None = None, args: tuple[str, ...] = ()) -> None:
        import yaml

        self.directory = directory
        self.port = closed_port()
        self.args = args
        self.proc: subprocess.Popen | None = None
        self._started = False
        with open(os.path.join(directory, "prometheus.yml"), "w", encoding="utf-8") as fh:
            yaml.safe_dump(config or {"global": {"scrape_interval": "1m"}}, fh)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.directory, "prometheus.log")

    def start(self, wait: bool = True) -> PrometheusServer:
        attempts = 1 if self._started else self.BIND_ATTEMPTS
        for attempt in range(attempts):
            offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
            self._spawn()
            if not wait:
                break
            try:
                wait_for(self.ready, timeout=15, interval=0.05)
                break
            except AssertionError:
                with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                    fh.seek(offset)
                    taken = "address already in use" in fh.read()
                if not taken or attempt == attempts - 1:
                    raise
                self.port = closed_port()  # another program took it first: another port
        self._started = True
        return self

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={self.directory}/prometheus.yml",
                 f"--storage.tsdb.path={self.directory}/data", f"--web.listen-address=127.0.0.1:{self.port}",
                 *self.args], stdout=subprocess.DEVNULL, stderr=log)

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}; see {self.directory}/prometheus.log")
        try:
            return http_get(self.url + "/-/ready", timeout=1)[0] == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        import json
        import urllib.parse

        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        status, _, body = http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=5)
        payload = json.loads(body)
        if status != 200:
            raise AssertionError(f"{expr}: {payload.get('errorType')}: {payload.get('error')}")
        return payload["data"]["result"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def prometheus_server(tmp_path):
    """Start a real Prometheus (scripts/test.sh installs it); stopped at the end of the test."""
    import shutil

    assert shutil.which("prometheus"), "the prometheus server is missing: run ./scripts/test.sh, which installs it"
    started: list[PrometheusServer] = []

    def start(config: dict | None = None, *args: str) -> PrometheusServer:
        directory = tmp_path / f"prometheus-{len(started)}"
        directory.mkdir()
        server = PrometheusServer(str(directory), config, args)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh: --dist loadfile --no-loadscope-reorder, files handed out in
    this order) the files marked ``slow``, a minute or more each, go first: started last, the longest
    would run on one worker while the others had nothing left to do."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: in file order otherwise


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked ``alone`` (a latency bound that another worker's load would
    break) runs while no other worker runs a test: other tests hold a shared lock from setup to
    teardown, an ``alone`` test an exclusive one, and a gate taken first keeps new tests from starting
    while it waits for those already running (a waiting ``alone`` test is never starved). The wait comes
    before pytest-timeout starts the test's clock. Without xdist every test runs alone anyway."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    from tests.support.artefacts import run_lock

    run = Path(item.config.option.basetemp).parent  # a worker's basetemp is <the run's>/gwN
    alone = item.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as held:
        with contextlib.ExitStack() as gate:
            gate.enter_context(run_lock(run, "gate"))
            held.enter_context(run_lock(run, "tests", shared=not alone))
            if alone:
                held.enter_context(gate.pop_all())  # the gate stays shut until this test is done
        yield


@pytest.fixture(scope="session")
def gpumon_wheel(tmp_path_factory) -> Path:
    """gpumon's wheel from this checkout, built once per run (tests/support/artefacts.py); read it, never change it."""
    from tests.support import artefacts

    return artefacts.gpumon_wheel(tmp_path_factory)


@pytest.fixture(scope="session")
def gpumon_wheelhouse(tmp_path_factory, gpumon_wheel) -> Path:
    """The wheels of gpumon's dependencies with every extra, for this interpreter, once per run."""
    from tests.support import artefacts

    return artefacts.local_wheelhouse(tmp_path_factory, gpumon_wheel)


@pytest.fixture(scope="session")
def bookworm_wheelhouse(tmp_path_factory, gpumon_wheel) -> Path:
    """gpumon's wheel and its dependencies' wheels for Debian 12's python3, once per run."""
    from tests.support import artefacts

    return artefacts.bookworm_wheelhouse(tmp_path_factory, gpumon_wheel)


@pytest.fixture(autouse=True)
def _never_the_real_imds(monkeypatch):
    """No test asks the link-local IMDS (169.254.169.254): in-process clients built from a default
    [azure] section get "unreachable" at once, as off Azure; subprocesses get a closed loopback port
    through clean_env. Tests that want IMDS run the loopback stand-in (tests.fakes.imds)."""
    from gpumon import imds

    real = imds.ImdsClient._exchange

    def exchange(self, path, body, timeout):
        if "169.254.169.254" in self.url:
            raise imds.ImdsError("unreachable", "tests never ask the real IMDS")
        return real(self, path, body, timeout)

    monkeypatch.setattr(imds.ImdsClient, "_exchange", exchange)
    # The shared clients are keyed by address: a stand-in of an earlier test on a port the OS hands out
    # again would otherwise answer this test from its cache (its VM id, its resource group).
    with imds._clients_lock:
        imds._clients.clear()

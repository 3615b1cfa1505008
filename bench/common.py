"""Plumbing shared by the benchmarks: processes, /proc readings, HTTP polling, results on disk.

Every figure that compares gpumon with a peer reads both processes the same way (``/proc/<pid>``),
so the ratio does not depend on how either measures itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


@dataclass
class Options:
    """What ``python -m bench`` was asked for; each benchmark reads the knobs it has."""

    smoke: bool = False
    """Tiny sizes: proves the harness works end to end in seconds; the numbers mean nothing."""
    out: str = RESULTS
    leak_seconds: float = 60.0
    """How long the memory benchmark watches RSS after warm-up (the issue's leak check wants 600)."""
    flips: int = 50
    quiet: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- processes


def picked_port() -> int:
    """A port free a moment ago, for a peer that cannot say which port it bound (node_exporter):
    another program may take it before the peer binds it. gpumon never needs one (:func:`gpumon_serving`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Endpoint:
    """Where a server a benchmark starts answers: a fixed ``fixed_port`` (node_exporter), or for gpumon
    the port it wrote to ``listen_file`` once bound (``--listen 127.0.0.1:0 --listen-file``), so no
    other program can take the port between choosing and binding it."""

    fixed_port: int = 0
    listen_file: str = ""

    def port(self, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> int:
        """The port; for gpumon, waited for until written (raises when ``proc`` exits first)."""
        if not self.listen_file:
            return self.fixed_port

        def written() -> int | None:
            with open(self.listen_file, encoding="utf-8") as fh:
                address = fh.read().strip()
            return int(address.rpartition(":")[2]) if address else None

        return int(wait_until(written, timeout, interval=0.002, alive=proc))


def gpumon_serving(directory: str, *args: str) -> tuple[list[str], Endpoint]:
    """``gpumon run ARGS`` on a port the kernel picks, and where to read which (under ``directory``)."""
    path = os.path.join(directory, f"listen-{uuid.uuid4().hex}")
    return (gpumon_command("run", "--listen", "127.0.0.1:0", "--listen-file", path, *args),
            Endpoint(listen_file=path))


def shown(cmd: Sequence[str]) -> str:
    """A gpumon command line for the results: ``run ...`` without the interpreter and the listen file."""
    args = list(cmd[2:])
    if "--listen-file" in args:
        at = args.index("--listen-file")
        del args[at:at + 2]
    return " ".join(args)


def node_exporter_serving(binary: str, sysfs: str) -> tuple[list[str], Endpoint]:
    port = picked_port()
    return node_exporter_command(binary, sysfs, port), Endpoint(fixed_port=port)


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any GPUMON_* or OTEL_* setting that would skew a run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMON_", "OTEL_"))}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def gpumon_command(*args: str) -> list[str]:
    """``gpumon ARGS`` through this interpreter, so the benchmark measures the checkout it runs from."""
    return [sys.executable, "-m", "gpumon", *args]


def spawn(cmd: Sequence[str], env: dict[str, str] | None = None, log: str | None = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    try:
        return subprocess.Popen(list(cmd), env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    finally:
        if log:
            out.close()


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if it does not go within ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


@contextlib.contextmanager
def running(cmd: Sequence[str], env: dict[str, str] | None = None, log: str | None = None
            ) -> Iterator[subprocess.Popen]:
    proc = spawn(cmd, env, log)
    try:
        yield proc
    finally:
        stop(proc)


def node_exporter_binary() -> str | None:
    return shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")


def node_exporter_command(binary: str, sysfs: str, port: int) -> list[str]:
    """node_exporter with only its infiniband collector, on the same tree gpumon reads."""
    return [binary, f"--web.listen-address=127.0.0.1:{port}", f"--path.sysfs={sysfs}",
            "--collector.disable-defaults", "--collector.infiniband"]


def prometheus_binary(opts: Options) -> str | None:
    """The Prometheus server the rule benchmarks run: ``--prometheus PATH``, else ``prometheus`` on PATH
    (Debian 12's is 2.42; a newer engine costs less per series, so a result names its version)."""
    chosen = opts.extra.get("prometheus")
    return str(chosen) if chosen else shutil.which("prometheus")


def tool_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    lines = (out.stdout or out.stderr).splitlines()
    return lines[0].strip() if lines else ""


# ----------------------------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of ``pid`` so far (clock ticks, usually 10 ms)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in bytes."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    return found


# ----------------------------------------------------------------------------------- HTTP


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.005,
               alive: subprocess.Popen | None = None) -> Any:
    """Poll ``predicate`` until truthy; raise at the deadline or when ``alive`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            raise RuntimeError(f"process {alive.args!r} exited with {alive.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {timeout} s")
        time.sleep(interval)


def wait_metrics(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None,
                 needle: bytes | tuple[bytes, ...] = b"") -> bytes:
    """Wait for a 200 on /metrics whose body contains ``needle`` (each of them); return the body."""
    url = f"http://127.0.0.1:{port}/metrics"
    needles = needle if isinstance(needle, tuple) else (needle,)

    def ready() -> bytes | None:
        status, body = http_get(url, timeout=2.0)
        return body if status == 200 and all(n in body for n in needles) else None

    return wait_until(ready, timeout, alive=proc)


def collector_runs(port: int, collector: str) -> float:
    """``gpumon_collector_runs_total`` of one collector, from the endpoint on ``port`` (0 when absent)."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    pattern = rb'^gpumon_collector_runs_total\{collector="' + re.escape(collector.encode()) + rb'"\} (\S+)$'
    match = re.search(pattern, body, re.M) if status == 200 else None
    return float(match.group(1)) if match else 0.0


def simulator_pickup(log: str, needle: str) -> float | None:
    """When the simulated host applied the control command whose text holds ``needle`` (its log line
    ``simulate: applied ...``, local time, written by ``gpumon run --simulate`` at ``info``)."""
    import datetime as dt

    with open(log, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if "simulate: applied" in line and needle in line:
                try:
                    return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    return None
    return None


def series_count(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


# ----------------------------------------------------------------------------------- numbers


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(round(q / 100.0 * len(ordered) + 0.5))))
    return ordered[rank - 1]


def slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through (xs, ys): (slope, intercept)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else 0.0
    return b, my - b * mx


def rnd(value: float, digits: int = 3) -> float:
    return float(f"{value:.{digits}g}") if value == value and value not in (float("inf"), float("-inf")) else value


# ----------------------------------------------------------------------------------- context


def machine() -> dict[str, Any]:
    """Where the figures came from: CPU model, cores, memory, Python, kernel."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    return {
        "cpu": model,
        "nproc": os.cpu_count(),
        "memory_gib": round(mem_kib / MIB, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def write_result(name: str, data: dict[str, Any], opts: Options) -> str:
    """``<out>/<name>.json``, written atomically, with the machine and the time it was measured."""
    os.makedirs(opts.out, exist_ok=True)
    payload = {"benchmark": name, "smoke": opts.smoke, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()),
               "machine": machine(), **data}
    path = os.path.join(opts.out, f"{name}.json")
    fd, tmp = tempfile.mkstemp(dir=opts.out, prefix=f".{name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2, sort_keys=False)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def say(opts: Options, text: str) -> None:
    if not opts.quiet:
        print(text, flush=True)

"""A real-shaped host at defaults: the whole daemon on a simulated ND H100 v5, the doubles' cost taken out.

``gpumon run --simulate nd-h100-v5`` runs, at defaults and at ``--interval 1``, in this process (the
daemon's own :class:`gpumon.daemon.Daemon`, every thread it starts, the Prometheus endpoint): the
process CPU over a quiet window (``time.process_time``: every thread, those that ended included)
less what is not gpumon's on a real host, each measured in the same window:

- the NVML double's own functions (each wrapped to add up its thread CPU): on a real host that is the
  driver's work, and the double is Python, many times what libnvidia-ml costs per call;
- the simulation's thread (it moves the workload and rewrites the sysfs counters once a second) and
  the IMDS stand-in (its server thread and each request's handler): on Azure the hypervisor's;
- this benchmark's own main thread (asleep).

What is left is gpumon's share of one core, the issue's figure. Both the raw and the net figure are
reported; the reading of sysfs is gpumon's and stays in.

The headline cases keep the InfiniBand tree as the issue's real-shaped host has it: static, read with
``pread`` as /sys is (the simulation still moves the GPUs). The ``*_moving_tree`` cases let the
simulation rewrite the counters every second, which makes every file a new one, opened per read: a
busier tree than a quiet host's, reported beside.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
from typing import Any

from bench.common import Options, rnd, say

TARGET_DEFAULT = 0.002
TARGET_1S = 0.01


class _Meter:
    """Thread CPU spent inside wrapped functions (a call inside another counts once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    def wrap(self, fn: Any) -> Any:
        meter = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(meter._local, "inside", False):
                return fn(*args, **kwargs)
            meter._local.inside = True
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                meter._local.inside = False
                with meter._lock:
                    meter.seconds += spent
                    meter.calls += 1

        return timed


def _thread_cpu(names: tuple[str, ...]) -> float:
    """CPU seconds of the live threads named ``names``."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name in names and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except OSError:
                pass
    return total


def share(opts: Options, interval: float | None, static_tree: bool = True) -> dict[str, Any]:
    """The net share; ``static_tree``: the InfiniBand tree as the issue's real-shaped host has it, its
    files never replaced and read with ``pread`` as on /sys (the simulation keeps moving the GPUs),
    else the simulation rewrites the counters every second and every file is opened per read (a
    rewritten file is a new one), a busier tree than a quiet host's."""
    from gpumon.cli import schemas
    from gpumon.config import load
    from gpumon.daemon import Daemon

    warm = 2.0 if opts.smoke else (25.0 if interval is None else 8.0)
    window = 3.0 if opts.smoke else 60.0
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-host-") as tmp:
        empty = os.path.join(tmp, "gpumon.toml")  # defaults, whatever /etc/gpumon holds
        open(empty, "w").close()
        flags: dict[str, Any] = {"simulate": "nd-h100-v5", "listen": "127.0.0.1:0"}
        if interval is not None:
            flags["interval"] = interval
        environ = {"GPUMON_DAEMON_STATE_DIR": os.path.join(tmp, "state")}
        if static_tree:
            environ["GPUMON_INFINIBAND_READ_MODE"] = "pread"
        config = load(schemas(), empty, environ, flags)
        daemon = Daemon(config)
        daemon.start()
        try:
            sim = daemon.ctx.simulation if daemon.ctx is not None else None
            assert sim is not None and sim.nvml is not None
            if static_tree:
                with sim._lock:
                    sim.fabric = None     # the tree as written at start, never replaced: pread is valid
            double, stand_in = _Meter(), _Meter()
            for name in dir(type(sim.nvml)):
                if name.startswith("nvml") and callable(getattr(type(sim.nvml), name)):
                    setattr(sim.nvml, name, double.wrap(getattr(sim.nvml, name)))
            imds = sim.azure.imds
            imds._handle = stand_in.wrap(imds._handle)  # each request's handler thread
            time.sleep(warm)  # imports, the first runs, thresholds, the health baseline
            outside = ("simulate", "imds-stand-in")
            p0, s0, d0, i0, m0 = (time.process_time(), _thread_cpu(outside), double.seconds, stand_in.seconds,
                                  time.thread_time())
            w0 = time.monotonic()
            time.sleep(window)
            p1, s1, d1, i1, m1 = (time.process_time(), _thread_cpu(outside), double.seconds, stand_in.seconds,
                                  time.thread_time())
            wall = time.monotonic() - w0
            calls = double.calls
        finally:
            daemon.stop()
    process, simulation, nvml, imds_cpu, main = p1 - p0, s1 - s0, d1 - d0, i1 - i0, m1 - m0
    net = process - simulation - nvml - imds_cpu - main
    return {"interval": interval or 10.0, "ib_tree": "static, pread" if static_tree else "moving, open per read",
            "window_seconds": rnd(wall, 1),
            "process_cpu_seconds": rnd(process, 4), "nvml_double_cpu_seconds": rnd(nvml, 4),
            "nvml_double_calls": calls, "simulation_cpu_seconds": rnd(simulation + imds_cpu, 4),
            "share_raw": rnd(process / wall, 6), "share_of_one_core": rnd(net / wall, 6)}


def run(opts: Options) -> dict[str, Any]:
    data = {"defaults": share(opts, None), "interval_1s": share(opts, 1.0),
            "defaults_moving_tree": share(opts, None, static_tree=False),
            "interval_1s_moving_tree": share(opts, 1.0, static_tree=False)}
    for key, value in data.items():
        value["target"] = TARGET_1S if key.startswith("interval_1s") else TARGET_DEFAULT
    for key, value in data.items():
        say(opts, f"real_host: ND H100 v5 (NVML double, IB tree {value['ib_tree']}), {key}: "
                  f"{value['share_of_one_core'] * 100:.3f} % of one core "
                  f"with the doubles' cost taken out ({value['share_raw'] * 100:.3f} % raw; target <= "
                  f"{value['target'] * 100:g} %)")
    return data


if __name__ == "__main__":
    import json

    print(json.dumps(run(Options()), indent=1))

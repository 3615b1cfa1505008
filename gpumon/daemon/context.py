"""The host a daemon reads: its name, the collectors' Context (a simulated host under the state
directory for ``--simulate``, with that host's own IMDS and KVP pool in the config) and the sinks'
SinkContext."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable

from gpumon import __version__
from gpumon.collectors.base import Context
from gpumon.config import Config, ConfigError
from gpumon.sinks.base import SinkContext


def hostname(config: Config) -> str:
    return config.daemon.hostname or socket.gethostname()


def make_context(config: Config, simulation_home: str | None = None, consume: bool = True) -> Context:
    """The collectors' view of the host; with ``simulate`` set, a simulated host under state_dir.
    Raises ConfigError for a sysfs root that was given and does not exist, or an unknown profile.

    ``simulation_home``: a one-shot command's simulated host takes its faults, boot id and saved
    state from there (a daemon's :func:`simulation_dir`) while its tree lives under state_dir;
    ``consume`` (``gpumon once``) applies the control files waiting there, otherwise it only looks."""
    d = config.daemon
    ctx = Context(hostname=hostname(config), sysfs_root=d.sysfs_root, state_dir=d.state_dir, config=config)
    if d.simulate:
        from gpumon.simulate import Simulation, UnknownProfile, host_profile

        try:
            host_profile(d.simulate)
        except UnknownProfile as exc:
            raise ConfigError(config.origin("daemon", "simulate"), "[daemon] simulate", str(exc)) from None
        base, owned = d.state_dir, None
        if not _writable(base):  # a read-only state directory: simulate in a directory of our own
            base = owned = tempfile.mkdtemp(prefix="gpumon-simulate-")
        try:
            simulation = Simulation(d.simulate, os.path.join(base, "simulate", d.simulate), hostname=ctx.hostname,
                                    home=simulation_home, consume=consume, read_only=not consume,
                                    owned_dir=owned)
        except BaseException:
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        ctx.simulation = simulation
        ctx.config = _simulated_azure(config, simulation)
        ctx.sysfs_root = simulation.sysfs_root
        ctx.state_dir = os.path.join(simulation.workdir, "state")
        if simulation_home is not None:  # the host's saved state is read, never written
            ctx.state_dir = os.path.join(simulation_home, "state")
            ctx.persist_state = False
        ctx.nvml = simulation.nvml
        os.makedirs(ctx.state_dir, exist_ok=True)
    else:
        _check_sysfs_root(config)
    return ctx


def _simulated_azure(config: Config, simulation) -> Config:
    """A simulated host's IMDS, KVP pool and kernel log, where the config does not name others."""
    out = config
    if "azure" in config.sections and "azure.imds_url" not in config.origins:
        out = out.replace("azure", imds_url=simulation.azure.imds_url)
    if "host_info" in config.sections and "host_info.kvp_pool" not in config.origins:
        out = out.replace("host_info", kvp_pool=simulation.azure.kvp_pool)
    if "kmsg" in config.sections and "kmsg.path" not in config.origins:
        out = out.replace("kmsg", path=simulation.kernel_log.path)
    return out


def simulation_dir(config: Config) -> str:
    """Where ``gpumon run --simulate PROFILE`` keeps its simulated host (tree, control directory,
    boot id, kept hardware faults): ``<state_dir>/simulate/<profile>``."""
    d = config.daemon
    return os.path.join(d.state_dir, "simulate", d.simulate)


def host_state_dir(config: Config) -> str:
    """Where ``gpumon run`` keeps this host's state: the state directory, or a simulated host's own
    under it (what ``gpumon health`` reads and ``gpumon health clear`` changes)."""
    d = config.daemon
    return os.path.join(simulation_dir(config), "state") if d.simulate else d.state_dir


def _check_sysfs_root(config: Config) -> None:
    """A root that was asked for and is not there is a mistake (a missing ``/host/sys`` mount), not
    a host without InfiniBand; the default ``/sys`` is always accepted."""
    where = config.origins.get("daemon.sysfs_root")
    root = config.daemon.sysfs_root
    if where is not None and not os.path.isdir(root):
        problem = "no such directory" if not os.path.exists(root) else "not a directory"
        raise ConfigError(where, "[daemon] sysfs_root", f"{root}: {problem}")


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def sink_context(config: Config, loop_alive: Callable[[], bool] = lambda: True) -> SinkContext:
    """``config``: the one in effect, ``make_context``'s (a simulated host's IMDS and KVP pool)."""
    return SinkContext(hostname=hostname(config), state_dir=config.daemon.state_dir, version=__version__,
                       loop_alive=loop_alive, config=config)

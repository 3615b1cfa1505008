"""Simulated hosts for ``--simulate PROFILE``, demos, dashboards development and the tests.

A profile pairs a synthetic NVML (:mod:`gpumon.simulate.nvml`, a stand-in for the ``pynvml`` module)
with a synthetic sysfs tree (:mod:`gpumon.simulate.sysfs`) written to disk under the state directory,
whose counters grow while the daemon runs. Faults are injected at run time by dropping JSON files
into ``<state_dir>/simulate/control/`` (see :meth:`Simulation.apply`), so an end-to-end test or a
person at a shell can provoke a flap, a port-down period, an XID or a lost GPU in a running daemon.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpumon.simulate import job

log = logging.getLogger("gpumon.simulate")
_sequence = itertools.count()


@dataclass(frozen=True)
class HostProfile:
    """A simulated host: which GPU model and how many, which IB tree."""

    description: str
    gpu_profile: str | None
    gpu_count: int
    ib_profile: str | None
    driver_version: str = "550.90.07"
    #: (low W, high W, Hz): the GPUs' power samples swing like a synchronous training step
    power_swing: tuple[float, float, float] | None = None
    #: the Azure VM size IMDS would report for such a host (what the health stage holds it to)
    vm_size: str = ""


HOSTS: dict[str, HostProfile] = {
    "nd-h100-v5": HostProfile("Azure ND H100 v5: 8 x H100 80GB HBM3, 8 x NDR 400 IB + mlx5_an0",
                              "h100-sxm5-80gb", 8, "nd-h100-v5", power_swing=(350.0, 700.0, 1.0),
                              vm_size="Standard_ND96isr_H100_v5"),
    "nd-gb200-v6": HostProfile("Azure ND GB200 v6: 4 x GB200 (NVLink 5 fabric), 2 x Grace (aarch64), "
                               "4 x NDR 400 IB + mlx5_an0", "gb200", 4, "nd-gb200-v6",
                               driver_version="570.133.20", power_swing=(600.0, 1200.0, 1.0),
                               vm_size="Standard_ND128isr_NDR_GB200_v6"),
    "nd-a100-v4": HostProfile("Azure ND A100 v4: 8 x A100 80GB SXM, 8 x HDR 200 IB + mlx5_an0",
                              "a100-sxm4-80gb", 8, "nd-a100-v4",
                              vm_size="Standard_ND96amsr_A100_v4"),  # 80 GB A100s: the NDm size
    "nv-a10-v5": HostProfile("Azure NVads A10 v5: 1 x A10, no InfiniBand", "a10", 1, None,
                             vm_size="Standard_NV36ads_A10_v5"),
    "hbv4": HostProfile("Azure HBv4: no GPU, 1 x NDR IB", None, 0, "hbv4", vm_size="Standard_HB176rs_v4"),
}


class UnknownProfile(ValueError):
    pass


def host_profile(name: str) -> HostProfile:
    """The profile named ``name``; the one place an unknown name is refused (the daemon turns it into
    an exit 2 naming ``[daemon] simulate``, before anything is created on disk)."""
    if name not in HOSTS:
        raise UnknownProfile(f"unknown simulation profile {name!r} (known: {', '.join(sorted(HOSTS))})")
    return HOSTS[name]


class Simulation:
    """The live state of one simulated host. ``start()`` begins growing counters every ``tick``."""

    def __init__(self, profile: str, workdir: str, tick: float = 1.0, hostname: str = "") -> None:
        self.host = host_profile(profile)
        self.profile = profile
        self.workdir = workdir
        self.sysfs_root = os.path.join(workdir, "sys")
        self.control_dir = os.path.join(workdir, "control")
        os.makedirs(self.control_dir, exist_ok=True)
        self.fabric: Any = None
        self.nvml: Any = None
        if self.host.ib_profile:
            from gpumon.simulate import sysfs

            self.fabric = sysfs.build_tree(self.host.ib_profile, self.sysfs_root)
        else:
            os.makedirs(self.sysfs_root, exist_ok=True)
        if self.host.gpu_profile:
            from gpumon.simulate import nvml

            self.nvml = nvml.FakeNVML(self.host.gpu_profile, self.host.gpu_count,
                                      driver_version=self.host.driver_version, power_swing=self.host.power_swing)
        #: who holds which GPU, as the control directory set it: dicts with ``gpu`` and any of
        #: ``namespace``, ``pod``, ``container``, ``job_id`` (read by the attribution collector)
        self.allocations: list[dict[str, Any]] = []
        #: jobs a ``stall`` control hung (their GPUs near idle until ``resume``)
        self.stalled: set[str] = set()
        from gpumon.simulate.azure import SimulatedAzure

        #: the VM's IMDS on loopback and its KVP pool (host_info and azure_events read them)
        self.azure = SimulatedAzure(workdir, hostname or socket.gethostname(), self.host.vm_size)
        self._tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _allocation(self, action: str, command: dict[str, Any]) -> None:
        """Called under ``_lock`` (from ``step``); the list is replaced whole, so readers on other
        threads see the old one or the new one, never half."""
        if action == "allocate":
            self.allocations = [*self.allocations, _allocation_of(command)]
        elif "gpu" in command:
            self.allocations = [a for a in self.allocations if a["gpu"] != int(command["gpu"])]
        else:
            self.allocations = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="simulate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.azure.close()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self.step(self._tick)
            except Exception:  # a full disk or EMFILE must not freeze the simulated host for good
                log.exception("simulate: step failed")

    def step(self, seconds: float, wall: float | None = None) -> None:
        """Advance the simulated host by ``seconds`` and apply any control files dropped meanwhile;
        GPUs held by a job follow its rhythm at wall-clock time ``wall`` (default: now)."""
        with self._lock:
            job.drive(self, time.time() if wall is None else wall)
            if self.fabric is not None:
                self.fabric.tick(seconds)
            if self.nvml is not None:
                self.nvml.tick(seconds)
            self._read_controls()

    def _read_controls(self) -> None:
        try:
            names = sorted(os.listdir(self.control_dir))
        except OSError:
            return
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.control_dir, name)
            try:
                with open(path, encoding="utf-8") as fh:
                    command = json.load(fh)
                self.apply(command)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("simulate: ignoring control file %s: %s", name, exc)
            finally:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def apply(self, command: dict[str, Any]) -> None:
        """Apply one fault. Actions:

        - ``{"action": "flap", "device": "mlx5_ib0", "port": 1}``: a flap shorter than any poll
          (``link_downed`` and ``carrier_changes`` grow, the state never shows it);
        - ``{"action": "port_down", "device": ..., "port": 1, "seconds": 30}``: the port goes DOWN
          and comes back after ``seconds`` (0 = stays down until ``port_up``);
        - ``{"action": "port_up", "device": ..., "port": 1}``;
        - ``{"action": "xid", "gpu": 3, "xid": 48}``: the GPU reports an XID event (XID 79 also
          makes it stop answering, as ``gpu_lost``);
        - ``{"action": "gpu_lost", "gpu": 2}``: every NVML call for that GPU raises GPU_IS_LOST;
        - ``{"action": "scheduled_event", "event_id": "E1", "type": "Freeze", "status": "Scheduled",
          "not_before_in": 900}``: an Azure Scheduled Event in the VM's IMDS (status ``Started``, then
          ``done`` to remove it);
        - ``{"action": "allocate", "gpu": 0, "namespace": "ml", "pod": "train-0", "container": "main"}``
          or ``{"action": "allocate", "gpu": 0, "job_id": "4242"}``: a pod or a Slurm job holds the GPU;
          ``{"action": "release", "gpu": 0}`` (no ``gpu``: every GPU) ends it;
        - ``{"action": "fabric", "gpu": 1, "health": {"route_unhealthy": "true"}}``: what the NVLink
          fabric call reports, in NVML's words: ``health`` maps a NVML_GPU_FABRIC_HEALTH_MASK_<field>
          to one of its values (``degraded_bw``: true/false, ``incorrect_configuration``:
          insufficient_nvlinks, ...), ``state`` is a NVML_GPU_FABRIC_STATE_* (``in_progress``),
          ``status`` a NVML_ERROR_* name or ``success``, ``summary`` a _HEALTH_SUMMARY_* name;
        - ``{"action": "throttle", "gpu": 5, "reason": "sw_power_cap", "factor": 0.7}``: clocks and
          activity drop to ``factor``, the reason (``sw_power_cap``, ``hw_thermal_slowdown``,
          ``hw_slowdown``) is on and its violation time grows; ``{"action": "restore", "gpu": 5}`` ends it;
        - ``{"action": "congest", "device": "mlx5_ib3", "port": 1, "factor": 0.5}``: the port's traffic
          drops to ``factor`` and its ``port_xmit_wait`` grows (``restore`` with ``device`` ends it);
        - ``{"action": "stall", "job_id": "4242"}`` / ``{"action": "resume", "job_id": "4242"}``: the
          job's GPUs here hang near idle (memory and processes held), then run again.
        """
        action = command["action"]
        if action in ("flap", "port_down", "port_up"):
            if self.fabric is None:
                raise ValueError(f"profile {self.profile} has no InfiniBand")
            device, port = str(command["device"]), int(command.get("port", 1))
            if action == "flap":
                self.fabric.flap(device, port)
            elif action == "port_down":
                self.fabric.set_down(device, port, float(command.get("seconds", 0)))
            else:
                self.fabric.set_up(device, port)
        elif action == "scheduled_event":
            self.azure.scheduled_event(command)
        elif action in ("allocate", "release"):
            self._allocation(action, command)
        elif action in job.ACTIONS:
            job.ACTIONS[action](self, command)
        elif action == "fabric":
            if self.nvml is None:
                raise ValueError(f"profile {self.profile} has no GPU")
            self.nvml.set_fabric(int(command["gpu"]), **fabric_change(command))
        elif action in ("xid", "gpu_lost"):
            if self.nvml is None:
                raise ValueError(f"profile {self.profile} has no GPU")
            if action == "xid" and int(command["xid"]) != 79:
                self.nvml.inject_xid(int(command["gpu"]), int(command["xid"]))
            else:  # XID 79 is the GPU falling off the bus: it stops answering too, as a real one does
                self.nvml.set_lost(int(command["gpu"]))
        else:
            raise ValueError(f"unknown action {action!r}")
        log.info("simulate: applied %s", command)


def _allocation_of(command: dict[str, Any]) -> dict[str, Any]:
    keys = ("namespace", "pod", "container", "job_id")
    out = {k: str(command.get(k, "")) for k in keys}
    if not (out["pod"] or out["job_id"]):
        raise ValueError("allocate needs a pod or a job_id")
    return {"gpu": int(command["gpu"]), **out}


def fabric_change(command: dict[str, Any]) -> dict[str, Any]:
    """The raw NVML values a ``fabric`` control command names (KeyError/AttributeError when it names
    no NVML constant, so a typo is logged and ignored like any bad control file)."""
    import pynvml

    def const(name: str) -> int:
        value = getattr(pynvml, name.upper(), None)
        if not isinstance(value, int):
            raise KeyError(f"no NVML constant {name.upper()}")
        return value

    change: dict[str, Any] = {}
    if "state" in command:
        change["state"] = const(f"NVML_GPU_FABRIC_STATE_{command['state']}")
    if "status" in command:
        status = str(command["status"])
        change["status"] = const("NVML_SUCCESS" if status == "success" else f"NVML_ERROR_{status}")
    if "summary" in command:
        change["summary"] = const(f"NVML_GPU_FABRIC_HEALTH_SUMMARY_{command['summary']}")
    if "health" in command:
        change["health"] = {field.upper(): const(f"NVML_GPU_FABRIC_HEALTH_MASK_{field}_{value}")
                            for field, value in dict(command["health"]).items()}
    return change


def control(workdir: str, command: dict[str, Any]) -> str:
    """Drop a control file for a running simulation (tests and the shell use this)."""
    control_dir = os.path.join(workdir, "control")
    os.makedirs(control_dir, exist_ok=True)
    # time first so commands apply in the order given; pid and a counter keep names unique
    name = f"{time.time_ns():020d}-{os.getpid()}-{next(_sequence):08d}"
    tmp = os.path.join(control_dir, f".{name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(command, fh)
    final = os.path.join(control_dir, f"{name}.json")
    os.replace(tmp, final)
    return final

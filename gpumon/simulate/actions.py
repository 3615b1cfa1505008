"""The control actions of a simulated host, in one table (:data:`ACTIONS`).

A person, a test or ``gpumon simulate`` drops ``{"action": NAME, ...}`` as a JSON file into the
simulated host's control directory (``<state_dir>/simulate/<profile>/control/``); the running
simulation applies it within one tick. Each :class:`Action` names its handler, the keys it needs, the
hardware it needs and an example (docs/simulate.md shows every one; tests/simulate/test_simulate_control.py
checks that it does). An action that changes the hardware for good (a lost GPU, a port held down, an
NVLink fabric fault) returns True from its handler: the simulation keeps it in ``hardware.json`` and
applies it again when the daemon restarts, until a ``reboot``.

To add an action: write ``_name(sim, command) -> bool`` and add one ``Action`` to the table (and a
line with its example to docs/simulate.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumon.simulate import job, kmsg

if TYPE_CHECKING:
    from gpumon.simulate import Simulation

Handler = Callable[["Simulation", dict[str, Any]], bool]


@dataclass(frozen=True)
class Action:
    name: str
    handler: Handler
    summary: str
    example: dict[str, Any]
    required: tuple[str, ...] = ()
    #: "gpu" or "ib": a profile without that hardware refuses the action
    needs: str = ""
    #: whether (some of) its effect is hardware state kept across a daemon restart until a reboot
    kept: str = ""
    optional: tuple[str, ...] = field(default=())


def _ib(sim: Simulation) -> Any:
    if sim.fabric is None:
        raise ValueError(f"profile {sim.profile} has no InfiniBand")
    return sim.fabric


def _gpus(sim: Simulation) -> Any:
    if sim.nvml is None:
        raise ValueError(f"profile {sim.profile} has no GPU")
    return sim.nvml


def _port(command: dict[str, Any]) -> tuple[str, int]:
    return str(command["device"]), int(command.get("port", 1))


def _flap(sim: Simulation, command: dict[str, Any]) -> bool:
    _ib(sim).flap(*_port(command))
    return False


def _port_down(sim: Simulation, command: dict[str, Any]) -> bool:
    seconds = float(command.get("seconds", 0))
    _ib(sim).set_down(*_port(command), seconds)
    return seconds <= 0  # held down until port_up (or a reboot) is hardware state; a timed one passes


def _port_up(sim: Simulation, command: dict[str, Any]) -> bool:
    device, port = _port(command)
    _ib(sim).set_up(device, port)
    sim.forget(lambda kept: kept["action"] == "port_down" and _port(kept) == (device, port))
    return False


def _xid(sim: Simulation, command: dict[str, Any]) -> bool:
    nvml, gpu, xid = _gpus(sim), int(command["gpu"]), int(command["xid"])
    _check_gpu(nvml, gpu)
    if xid != 79:
        if not sim.replaying:
            _print_xid(sim, gpu, xid)
            nvml.inject_xid(gpu, xid)
        return False
    return _gpu_lost(sim, command)


def _gpu_lost(sim: Simulation, command: dict[str, Any]) -> bool:
    """XID 79, the GPU falling off the bus: it stops answering too, as a real one does."""
    nvml, gpu = _gpus(sim), int(command["gpu"])
    _check_gpu(nvml, gpu)
    if not sim.replaying:  # after a daemon restart the GPU is still lost; no new XID
        _print_xid(sim, gpu, 79)
    nvml.set_lost(gpu, xid=not sim.replaying)
    return True


def _print_xid(sim: Simulation, gpu: int, xid: int) -> None:
    """The driver's kernel-log lines for an XID (XID 79 without a process, and its off-the-bus line)."""
    bus_id, _device, pid, name = sim.nvml.pci(gpu)
    sim.kernel_log.write(kmsg.xid_line(bus_id, xid, None if xid == 79 else pid, name), kmsg.WARNING)
    if xid == 79:
        sim.kernel_log.write(kmsg.off_bus_line(bus_id), kmsg.ERR)


def _aer(sim: Simulation, command: dict[str, Any]) -> bool:
    """AER errors at a GPU's or an HCA's function: its aer_dev_* counters grow and the kernel's AER
    report is printed (once per command, as the kernel reports the first error of a burst)."""
    if ("gpu" in command) == ("device" in command):
        raise ValueError("aer names a gpu or a device")
    if "gpu" in command:
        gpu = int(command["gpu"])
        _check_gpu(_gpus(sim), gpu)
        name = sim.pci.gpus[gpu]
    else:
        if str(command["device"]) not in sim.pci.hcas:
            raise ValueError(f"no HCA {command['device']} (this host has {', '.join(sim.pci.hcas) or 'none'})")
        name = sim.pci.hcas[str(command["device"])]
    count = int(command.get("count", 1))
    if not 1 <= count <= 1_000_000:
        raise ValueError("aer: count is 1 to 1000000")
    severity, kind = str(command["severity"]), str(command["type"])
    fn = sim.pci.count(name, severity, kind, count)
    for level, line in kmsg.aer_lines(fn.driver, fn.name, fn.ids, severity, kind):
        sim.kernel_log.write(line, level, device=fn.name)
    return False


def _fabric(sim: Simulation, command: dict[str, Any]) -> bool:
    nvml, gpu = _gpus(sim), int(command["gpu"])
    _check_gpu(nvml, gpu)
    nvml.set_fabric(gpu, **fabric_change(command))
    return True


def _mig(sim: Simulation, command: dict[str, Any]) -> bool:
    """MIG on the GPU with ``instances`` equal GPU instances (0: MIG off). Hardware state: it holds
    across a daemon restart; a reboot ends it (GPU instances do not survive one)."""
    nvml, gpu, instances = _gpus(sim), int(command["gpu"]), int(command.get("instances", 7))
    _check_gpu(nvml, gpu)
    if not 0 <= instances <= 7:   # seven slices: at most seven GPU instances (NVIDIA MIG user guide)
        raise ValueError("mig: instances is 0 to 7")
    nvml.set_mig(gpu, instances)
    sim.forget(lambda kept: kept["action"] == "mig" and int(kept["gpu"]) == gpu)
    return instances > 0


def _scheduled_event(sim: Simulation, command: dict[str, Any]) -> bool:
    sim.azure.scheduled_event(command)
    return False


def _allocation(sim: Simulation, command: dict[str, Any]) -> bool:
    """Runs under the simulation's lock (from ``step``); the list is replaced whole, so readers on
    other threads see the old one or the new one, never half."""
    if command["action"] == "allocate":
        allocation = _allocation_of(command)
        count = int(command.get("processes", 1))
        if not 1 <= count <= 64:
            raise ValueError("allocate: processes is 1 to 64")
        sim.allocations = [*sim.allocations, allocation]
        if sim.nvml is not None:
            _check_gpu(sim.nvml, allocation["gpu"])
            sim.nvml.run_processes(allocation["gpu"], [str(command.get("process", "python3"))] * count)
    else:
        gone = {a["gpu"] for a in sim.allocations if "gpu" not in command or a["gpu"] == int(command["gpu"])}
        sim.allocations = [a for a in sim.allocations if a["gpu"] not in gone]
        for gpu in sorted(gone) if sim.nvml is not None else ():
            sim.nvml.restore_processes(gpu)
    sim.write_processes()
    return False


def _reboot(sim: Simulation, command: dict[str, Any]) -> bool:
    sim.reboot()
    return False


def _check_gpu(nvml: Any, gpu: int) -> None:
    count = int(nvml.gpu_count)
    if not 0 <= gpu < count:
        raise ValueError(f"no GPU {gpu} (this host has {count})")


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



ACTIONS: dict[str, Action] = {a.name: a for a in (
    Action("flap", _flap, "a flap shorter than any poll: link_downed and carrier_changes grow, the port "
           "state never shows it", {"action": "flap", "device": "mlx5_ib0", "port": 1}, ("device",), "ib",
           optional=("port",)),
    Action("port_down", _port_down, "the port goes DOWN and comes back after `seconds` (0 or absent: stays "
           "down until port_up or reboot)", {"action": "port_down", "device": "mlx5_ib0", "port": 1,
                                               "seconds": 30}, ("device",), "ib",
           "when held (seconds 0)", ("port", "seconds")),
    Action("port_up", _port_up, "the port comes back up", {"action": "port_up", "device": "mlx5_ib0", "port": 1},
           ("device",), "ib", optional=("port",)),
    Action("xid", _xid, "the GPU reports an XID event; XID 79 also makes it stop answering (as gpu_lost)",
           {"action": "xid", "gpu": 3, "xid": 48}, ("gpu", "xid"), "gpu", "XID 79 (the GPU is lost)"),
    Action("aer", _aer, "PCIe AER errors at a GPU's (gpu) or an HCA's (device) PCI function: its "
           "aer_dev_<severity> counter of `type` (a kernel name: RxErr, BadTLP, BadDLLP, ..., CmpltTO, "
           "MalfTLP, ...) grows by `count` (default 1) and the kernel's AER report goes to the kernel log; "
           "counters stay until a reboot", {"action": "aer", "gpu": 3, "severity": "correctable", "type": "BadTLP"},
           ("severity", "type"), kept="the counts, until a reboot (aer.json)", optional=("gpu", "device", "count")),
    Action("gpu_lost", _gpu_lost, "every NVML call on the GPU answers GPU_IS_LOST (and XID 79 is reported)",
           {"action": "gpu_lost", "gpu": 2}, ("gpu",), "gpu", "yes"),
    Action("fabric", _fabric, "what the NVLink fabric call reports, in NVML's words: `health` maps a "
           "NVML_GPU_FABRIC_HEALTH_MASK_<field> to a value, `state` a NVML_GPU_FABRIC_STATE_*, `status` a "
           "NVML_ERROR_* name or success, `summary` a _HEALTH_SUMMARY_* name",
           {"action": "fabric", "gpu": 1, "health": {"route_unhealthy": "true"}}, ("gpu",), "gpu", "yes",
           ("health", "state", "status", "summary")),
    Action("mig", _mig, "MIG mode on with `instances` equal GPU instances (default 7, one slice and one "
           "compute instance each, GPU instance ids from 7); 0 turns it off. gpumon reads the layout at "
           "start and at each re-probe (`[nvml] reprobe_interval`)", {"action": "mig", "gpu": 0, "instances": 7},
           ("gpu",), "gpu", "until `instances` 0 or a reboot", ("instances",)),
    Action("scheduled_event", _scheduled_event, "an Azure Scheduled Event in the VM's IMDS (status Started, "
           "then done to remove it)", {"action": "scheduled_event", "event_id": "E1", "type": "Freeze",
                                       "status": "Scheduled", "not_before_in": 900}, ("event_id",),
           optional=("type", "status", "not_before_in", "duration", "source", "description")),
    Action("allocate", _allocation, "a Kubernetes pod (namespace, pod, container) or a Slurm job (job_id) "
           "holds the GPU and runs `processes` compute processes (default 1) named `process` (default "
           "python3) in place of the GPU's idle one", {"action": "allocate", "gpu": 0, "namespace": "ml",
                                                       "pod": "train-0", "container": "main"}, ("gpu",),
           optional=("namespace", "pod", "container", "job_id", "processes", "process")),
    Action("release", _allocation, "the GPU's holder and its processes end (no gpu: every GPU's)", {"action": "release", "gpu": 0},
           optional=("gpu",)),
    Action("reboot", _reboot, "the simulated host reboots: a new boot id (sticky health verdicts clear), "
           "every kept hardware fault repaired (lost GPUs answer, ports up, fabric healthy)",
           {"action": "reboot"}),
    Action("throttle", job.throttle, "clocks and activity drop to `factor`; the reason (sw_power_cap, "
           "hw_thermal_slowdown, hw_slowdown) is on and its violation time grows; restore ends it",
           {"action": "throttle", "gpu": 5, "reason": "sw_power_cap", "factor": 0.7}, ("gpu",), "gpu",
           optional=("reason", "factor")),
    Action("congest", job.congest, "the port's transmit queue waits: port_xmit_wait grows, its traffic drops "
           "to `factor`; restore with the device ends it",
           {"action": "congest", "device": "mlx5_ib3", "port": 1, "factor": 0.5}, ("device",), "ib",
           optional=("port", "factor")),
    Action("restore", job.restore, "ends a throttle (gpu) or a congestion (device, port)",
           {"action": "restore", "gpu": 5}, optional=("gpu", "device", "port")),
    Action("stall", job.stall, "the job's GPUs on this host hang near idle with memory and processes held "
           "(a hung collective)", {"action": "stall", "job_id": "4242"}, ("job_id",)),
    Action("resume", job.resume, "a stalled job runs again", {"action": "resume", "job_id": "4242"}, ("job_id",)),
)}


def check(command: dict[str, Any], gpu: bool, ib: bool) -> Action:
    """The action ``command`` names, after checking its keys and that the host has the hardware it
    needs (``gpumon simulate`` refuses a bad command before writing it). Raises ValueError."""
    name = command.get("action")
    action = ACTIONS.get(str(name))
    if action is None:
        raise ValueError(f"unknown action {name!r} (known: {', '.join(ACTIONS)})")
    missing = [key for key in action.required if key not in command]
    if missing:
        raise ValueError(f"{action.name} needs {', '.join(missing)} (e.g. {example_args(action)})")
    unknown = sorted(set(command) - {"action", *action.required, *action.optional})
    if unknown:
        raise ValueError(f"{action.name} takes no {', '.join(unknown)} (e.g. {example_args(action)})")
    if (action.needs == "gpu" and not gpu) or (action.needs == "ib" and not ib):
        raise ValueError(f"{action.name} needs a host with {'GPUs' if action.needs == 'gpu' else 'InfiniBand'}")
    return action


def example_args(action: Action) -> str:
    """The example as ``gpumon simulate`` arguments (``health.route_unhealthy=true`` for a nested key)."""
    def flat(prefix: str, value: Any) -> list[str]:
        if isinstance(value, dict):
            return [item for k, v in value.items() for item in flat(f"{prefix}.{k}" if prefix else k, v)]
        return [f"{prefix}={value}"]

    return " ".join([action.name, *flat("", {k: v for k, v in action.example.items() if k != "action"})])


def parse_assignments(action: str, pairs: list[str]) -> dict[str, Any]:
    """``ACTION key=value ...`` as a control command: integers and decimals become numbers, a dotted
    key nests (``health.route_unhealthy=true`` -> ``{"health": {"route_unhealthy": "true"}}``)."""
    command: dict[str, Any] = {"action": action}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not key=value")
        value: Any = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        *parents, last = key.split(".")
        node = command
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key!r}: {parent} is already a value")
        node[last] = value
    return command

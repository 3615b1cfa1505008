"""The step rhythm of a simulated training job, the same on every simulated host that runs it.

Synchronous data-parallel training runs every rank at one pace: a compute phase (GPUs busy, power
high) then a collective (NVLink and InfiniBand busy, power lower), over and over. The rhythm here is a
pure function of the job id and the wall clock, so separate ``--simulate`` processes holding GPUs of
the same job move in step without talking to each other, and a healthy job's GPUs look alike to a
straggler rule. What a GPU reports (utilization, clocks, power gauges) is an average over a sample
period, as NVML's are, so the level gauges carry is the step's average: :func:`level`; the power
samples the driver takes every 20 ms follow the phases: :func:`computing`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumon.simulate import Simulation

STALLED_LEVEL = 0.03
"""Activity of a GPU whose job hangs in a collective: memory and processes held, SMs nearly idle."""

IB_SHARE = 0.6
"""Fraction of line rate a job's InfiniBand ports carry at full activity."""


@dataclass(frozen=True)
class Rhythm:
    step_seconds: float   # one training step
    duty: float           # share of a step spent computing (the rest is the collective)
    level: float          # mean activity over a step
    wave_seconds: float   # period of a slow drift of the level (data loading, sequence lengths)
    wave_phase: float     # 0..1


def rhythm(job: str) -> Rhythm:
    """The job's rhythm, fixed by its id (sha256, so every process derives the same one)."""
    digest = hashlib.sha256(job.encode("utf-8")).digest()
    u = [b / 255.0 for b in digest[:5]]
    return Rhythm(step_seconds=0.8 + 0.8 * u[0], duty=0.7 + 0.1 * u[1], level=0.84 + 0.04 * u[2],
                  wave_seconds=300.0 + 300.0 * u[3], wave_phase=u[4])


def level(r: Rhythm, wall: float) -> float:
    """Mean activity of every GPU of the job at wall-clock time ``wall`` (seconds since the epoch)."""
    return r.level + 0.03 * math.sin(2 * math.pi * (wall / r.wave_seconds + r.wave_phase))


def computing(r: Rhythm, wall: float) -> bool:
    """True in the compute phase of the step under way at ``wall``; False in its collective."""
    return (wall % r.step_seconds) / r.step_seconds < r.duty


def job_key(allocation: dict[str, object]) -> str:
    """The job an allocation belongs to: its Slurm ``job_id``, else its pod's ``namespace/pod``."""
    job_id = str(allocation.get("job_id") or "")
    if job_id:
        return job_id
    return f"{allocation.get('namespace', '')}/{allocation.get('pod', '')}"


def drive(sim: Simulation, wall: float) -> None:
    """Set each job GPU's level from its job's rhythm at ``wall``, and the host's InfiniBand ports
    from the mean of them (the job's collectives cross every port); a GPU in no job wanders."""
    levels: dict[int, float] = {}
    rhythms: dict[int, Rhythm] = {}
    for allocation in sim.allocations:
        key = job_key(allocation)
        r = rhythm(key)
        rhythms[allocation["gpu"]] = r
        levels[allocation["gpu"]] = STALLED_LEVEL if key in sim.stalled else level(r, wall)
    if sim.nvml is not None:
        for gpu in range(sim.host.gpu_count):
            sim.nvml.set_job_load(gpu, levels.get(gpu), rhythms.get(gpu))
    if sim.fabric is not None:
        mean = sum(levels.values()) / len(levels) if levels else None
        for device, number in sim.fabric.port_keys:
            port = sim.fabric.port(device, number)
            if port.link_layer != "InfiniBand":
                continue
            if mean is not None:
                port.in_job, port.load = True, IB_SHARE * mean
            elif port.in_job:
                port.in_job, port.load = False, 0.35


# --- the control actions that slow or hang a job: handler(sim, command) -> whether it is kept hardware
# state (these are not: a daemon restart starts the host without them)

def _gpu(sim: Simulation, command: dict[str, Any]) -> int:
    if sim.nvml is None:
        raise ValueError(f"profile {sim.profile} has no GPU")
    gpu = int(command["gpu"])
    if not 0 <= gpu < sim.host.gpu_count:
        raise ValueError(f"no GPU {gpu} (the profile has {sim.host.gpu_count})")
    return gpu


def _port(sim: Simulation, command: dict[str, Any]) -> tuple[str, int]:
    if sim.fabric is None:
        raise ValueError(f"profile {sim.profile} has no InfiniBand")
    return str(command["device"]), int(command.get("port", 1))


def throttle(sim: Simulation, command: dict[str, Any]) -> bool:
    """``{"action": "throttle", "gpu": 5, "reason": "sw_power_cap", "factor": 0.7}``"""
    gpu = _gpu(sim, command)
    sim.nvml.throttle(gpu, str(command.get("reason", "sw_power_cap")), float(command.get("factor", 0.7)))
    return False


def restore(sim: Simulation, command: dict[str, Any]) -> bool:
    """``{"action": "restore", "gpu": 5}`` ends a throttle; with ``device`` (and ``port``), a congestion."""
    if "device" in command:
        sim.fabric.congest(*_port(sim, command), 1.0)
    else:
        sim.nvml.unthrottle(_gpu(sim, command))
    return False


def congest(sim: Simulation, command: dict[str, Any]) -> bool:
    """``{"action": "congest", "device": "mlx5_ib3", "port": 1, "factor": 0.5}``"""
    device, port = _port(sim, command)
    sim.fabric.congest(device, port, float(command.get("factor", 0.5)))
    return False


def stall(sim: Simulation, command: dict[str, Any]) -> bool:
    """``{"action": "stall", "job_id": "4242"}``: the job's GPUs here hang near idle, memory held."""
    sim.stalled = sim.stalled | {str(command["job_id"])}
    return False


def resume(sim: Simulation, command: dict[str, Any]) -> bool:
    """``{"action": "resume", "job_id": "4242"}``"""
    sim.stalled = sim.stalled - {str(command["job_id"])}
    return False


ACTIONS: dict[str, Callable[[Simulation, dict[str, Any]], bool]] = {
    "throttle": throttle, "restore": restore, "congest": congest, "stall": stall, "resume": resume}

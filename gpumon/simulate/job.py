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
from dataclasses import dataclass

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

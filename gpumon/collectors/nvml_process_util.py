"""Per-process utilization (opt-in ``[nvml] per_process``): SM, memory, encoder and decoder per PID.

The driver keeps utilization samples per process; ``nvmlDeviceGetProcessesUtilizationInfo`` (R550+)
or, on older drivers, ``nvmlDeviceGetProcessUtilization`` answers those newer than a timestamp, and
NOT_FOUND when there is none (no new sample: not an error). Each GPU keeps the newest timestamp it
read, so a sample is read once and never twice across runs; every sample since the last run is
averaged per PID. A real H100 (driver 580, tests/fixtures/nvml/h100_r580_processes.json) keeps only
the newest sample of each running process, samples every 200 ms, gives a period's sample only to the
process that had the GPU, and forgets a process when it ends: a value is the process's last sampling
period before the run (not an interval mean), and a process that ended between runs is not seen.

Cardinality is bounded per GPU: the ``per_process_top`` busiest PIDs get series of their own, the
rest are summed into one ``pid="other"`` series, however many processes come and go.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpumon.catalogue import gpu as CG
from gpumon.collectors import nvml_readings as M

INFO_FN = "nvmlDeviceGetProcessesUtilizationInfo"
LEGACY_FN = "nvmlDeviceGetProcessUtilization"
CALLS = (INFO_FN, LEGACY_FN)
"""The calls in the order they are tried: the second stands in where the first is refused."""
ENGINES = (("sm", "smUtil"), ("memory", "memUtil"), ("encoder", "encUtil"), ("decoder", "decUtil"))
OTHER = "other"
"""The ``pid`` and ``process`` of the remainder series: the processes beyond the top N, summed."""


@dataclass
class ProcessUtilState:
    """What one GPU remembers between runs."""

    #: The newest sample timestamp read (µs, the driver's clock); 0 before the first read.
    last_seen: int = 0
    #: pid -> name of the processes reported last run: a process that ended keeps its name.
    names: dict[int, str] = field(default_factory=dict)


def aggregate(samples: Iterable[Any], state: ProcessUtilState) -> dict[int, tuple[float, ...]]:
    """The mean utilization (0-1) per PID and engine of the samples newer than ``state.last_seen``;
    moves ``last_seen`` on to the newest one. Older samples (a driver answering one again) are skipped."""
    sums: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    newest = state.last_seen
    for s in samples:
        ts = int(s.timeStamp)
        if ts <= state.last_seen:
            continue
        newest = max(newest, ts)
        pid = int(s.pid)
        acc = sums.setdefault(pid, [0.0] * len(ENGINES))
        for i, (_, member) in enumerate(ENGINES):
            acc[i] += float(getattr(s, member))
        counts[pid] = counts.get(pid, 0) + 1
    state.last_seen = newest
    return {pid: tuple(min(1.0, v / counts[pid] / 100.0) for v in acc) for pid, acc in sums.items()}


def comm(proc_root: str, pid: int) -> str | None:
    """The process's name from ``<proc_root>/<pid>/comm``; None when unreadable (ended, or in
    another PID namespace: a container without ``hostPID`` sees none of the host's processes)."""
    try:
        with open(os.path.join(proc_root, str(pid), "comm"), encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def rows(per_pid: dict[int, tuple[float, ...]], state: ProcessUtilState, top: int,
         proc_root: str) -> list[M.Row]:
    """The top ``top`` PIDs (by SM, then memory, encoder, decoder) with their names, and the rest
    summed (each engine capped at 1) as one ``other`` series; names of this run kept for the next."""
    ranked = sorted(per_pid.items(), key=lambda kv: (tuple(-v for v in kv[1]), kv[0]))
    out: list[M.Row] = []
    names: dict[int, str] = {}
    for pid, util in ranked[:top]:
        name = comm(proc_root, pid)
        names[pid] = name if name is not None else state.names.get(pid, "")
        out.extend((CG.PROC_UTIL, (str(pid), names[pid], engine), value)
                   for (engine, _), value in zip(ENGINES, util))
    rest = ranked[top:]
    if rest:
        for i, (engine, _) in enumerate(ENGINES):
            out.append((CG.PROC_UTIL, (OTHER, OTHER, engine), min(1.0, sum(u[i] for _, u in rest))))
    state.names = names
    return out

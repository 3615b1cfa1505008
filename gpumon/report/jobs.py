"""What ``gpumon job`` prints: one job's GPUs worst first, or every job (``--list``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from gpumon.fleet.job import STALLED_ALERT, STRAGGLER_ALERT, JobSummary, Row
from gpumon.report import format_table
from gpumon.table import Table

WIDTH = 160


def _num(value: float, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if math.isnan(value) else f"{value * scale:{fmt}}{suffix}"


def verdict(row: Row) -> str:
    """The firing job alert says most; else the health verdict of the GPU and its node."""
    if STALLED_ALERT in row.alerts:
        return "stalled"
    if STRAGGLER_ALERT in row.alerts:
        return "straggler"
    return row.verdict


def _signal(row: Row) -> str:
    """The signal, and for a host's ports row the port it came from."""
    if not row.signal:
        return "-"
    return f"{row.signal} {row.device}/{row.port}" if row.device else row.signal


def job_table(job_id: str, rows: Sequence[Row], width: int = WIDTH) -> str:
    cells = tuple((row.host, row.gpu or "ports", verdict(row), _num(row.score, ".2f"), _signal(row),
                   _num(row.host_score, ".2f"), _num(row.activity, ".0f", 100, "%"), _num(row.power_watts, ".0f", 1, " W"),
                   _num(row.sm_clock_hertz, ".0f", 1e-6, " MHz"), _num(row.sm_clock_ratio, ".0f", 100, "%"),
                   _num(row.ib_transmit_bytes_per_second, ".1f", 8e-9, " Gb/s"), _num(row.ib_flaps, ".0f"))
                  for row in rows)
    hosts = len({row.instance for row in rows})
    gpus = sum(1 for row in rows if row.gpu)
    table = Table(f"job {job_id}: {hosts} host(s), {gpus} GPU(s), worst first",
                  ("HOST", "GPU", "VERDICT", "SCORE", "SIGNAL", "HOST SCORE", "ACTIVITY", "POWER", "SM CLOCK",
                   "OF MAX", "IB TX (HOST)", "FLAPS 1H"), cells)
    return format_table(table, width) + "\n"


def job_json(rows: Sequence[Row]) -> str:
    return json.dumps([row.as_dict() for row in rows], indent=2) + "\n"


def jobs_table(jobs: Sequence[JobSummary], width: int = WIDTH) -> str:
    cells = tuple((j.job_id, str(j.hosts), str(j.gpus), _num(j.worst_score, ".2f"), j.worst_signal or "-",
                   _where(j), ", ".join(j.alerts) or "-")
                  for j in jobs)
    table = Table(f"{len(jobs)} job(s), worst first", ("JOB", "HOSTS", "GPUS", "WORST SCORE", "SIGNAL", "WHERE",
                                                         "FIRING"), cells)
    return format_table(table, width) + "\n"


def _where(j: JobSummary) -> str:
    if not j.worst_instance:
        return "-"
    if j.worst_gpu:
        return f"{j.worst_instance} gpu {j.worst_gpu}"
    return f"{j.worst_instance} {j.worst_device}/{j.worst_port}" if j.worst_device else j.worst_instance


def jobs_json(jobs: Sequence[JobSummary]) -> str:
    return json.dumps([j.as_dict() for j in jobs], indent=2) + "\n"

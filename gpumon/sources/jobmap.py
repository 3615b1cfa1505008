"""A job-mapping directory in dcgm-exporter's ``--hpc-job-mapping-dir`` format.

One file per GPU, named by its index (``3``) or ``<index>.<gpu_instance>`` for a MIG instance
(``3.1``); each line one job id holding it (NVIDIA dcgm-exporter, internal/pkg/transformation/hpc.go:
names not matching ``^\\d+(\\.\\d+)?$`` are ignored). A Slurm prolog writes it and the epilog removes
it (``deploy/slurm/``).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

_NAME = re.compile(r"^(?P<gpu>\d+)(?:\.(?P<gi>\d+))?$")
_JOB = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_FILE_BYTES = 64 * 1024


@dataclass
class JobMap:
    """Job ids by ``(gpu index, gpu instance or None)``, and the files that could not be used."""

    jobs: dict[tuple[int, int | None], list[str]] = field(default_factory=dict)
    malformed: list[str] = field(default_factory=list)


def read_job_map(directory: str) -> JobMap:
    """Every mapping file in ``directory``; a malformed one is listed and skipped, the rest used."""
    out = JobMap()
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for name in names:
        match = _NAME.match(name)
        if not match:
            continue
        key = (int(match["gpu"]), int(match["gi"]) if match["gi"] is not None else None)
        jobs = _read_jobs(os.path.join(directory, name))
        if jobs is None:
            out.malformed.append(name)
        elif jobs:
            out.jobs[key] = jobs
    return out


def _read_jobs(path: str) -> list[str] | None:
    """The job ids in one file, or None if it is not a small regular text file of job ids."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO dropped here must not block the run
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        return None
    try:
        lines = [line.strip() for line in raw.decode("utf-8").splitlines()]
    except UnicodeDecodeError:
        return None
    jobs = [line for line in lines if line]
    if any(not _JOB.match(job) for job in jobs):
        return None
    return list(dict.fromkeys(jobs))

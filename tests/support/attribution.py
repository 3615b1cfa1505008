"""Reading workload attribution back from an exposition page."""

from __future__ import annotations

import re


def allocation_rows(page: str) -> set[tuple[str, ...]]:
    rows = set()
    for line in page.splitlines():
        if line.startswith("gpumon_gpu_allocation_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            rows.add((labels["gpu"], labels["namespace"], labels["pod"], labels["container"], labels["job_id"]))
    return rows

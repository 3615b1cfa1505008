"""A minimal stand-in for the job straggler rules, producing the contract's names from one signal.

``gpumon_job:straggler_score{job_id, instance, gpu, signal}`` is a robust score of SM activity: the
job's median less the GPU's activity, over the median absolute deviation (MAD) across the job's GPUs
(plus a floor of 0.01, so a perfectly even job does not divide by zero);
``gpumon_job_host:straggler_score{job_id, instance, signal}`` is the worst GPU of each host; the alert
``GpumonJobStraggler`` fires past THRESHOLD. ``gpumon job`` and bench/job_straggler.py read only these
names, so the shipped rules (deploy/prometheus/job-rules.yaml, docs/job-health.md) replace this file
where they exist: :func:`rule_files`.
"""

from __future__ import annotations

import os
import re

import yaml

from tests.conftest import REPO

SHIPPED = os.path.join(REPO, "deploy", "prometheus", "job-rules.yaml")
THRESHOLD = 5.0
ACTIVITY = "gpumon_job:gpu_activity:ratio"
_MEDIAN = f"quantile by (job_id) (0.5, {ACTIVITY})"
RULES = {"groups": [{"name": "gpumon-job-minimal", "interval": "1s", "rules": [
    {"record": ACTIVITY, "expr": 'max by (instance, gpu) (gpumon_gpu_activity_ratio{activity="sm"}) '
                                 "* on (instance, gpu) group_left (job_id) "
                                 'group by (instance, gpu, job_id) (gpumon_gpu_allocation_info{job_id!=""})'},
    {"record": "gpumon_job:straggler_score", "expr": (
        f"label_replace(({_MEDIAN} - on (job_id) group_right {ACTIVITY}) / on (job_id) group_left () "
        f"(quantile by (job_id) (0.5, abs({ACTIVITY} - on (job_id) group_left () {_MEDIAN})) + 0.01), "
        '"signal", "activity", "", "")')},
    {"record": "gpumon_job_host:straggler_score",
     "expr": "max by (job_id, instance, signal) (gpumon_job:straggler_score)"},
    {"alert": "GpumonJobStraggler", "expr": f"gpumon_job:straggler_score > {THRESHOLD:g}", "for": "1s"},
]}]}


def rule_files(directory: str) -> tuple[list[str], float]:
    """(rule files, straggler threshold) for a Prometheus that evaluates every second: the shipped
    rule files with 1 s groups and 1 s ``for:`` where job-rules.yaml exists, else the stand-in."""
    if not os.path.exists(SHIPPED):
        return [write(directory)], THRESHOLD
    paths, threshold = [], THRESHOLD
    for name in sorted(os.listdir(os.path.dirname(SHIPPED))):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(os.path.dirname(SHIPPED), name), encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
        if not isinstance(doc, dict) or "groups" not in doc:
            continue
        for group in doc["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = "1s"
                if rule.get("alert") == "GpumonJobStraggler":
                    found = re.search(r">\s*([0-9.]+)", str(rule["expr"]))
                    threshold = float(found.group(1)) if found else threshold
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(doc, fh)
        paths.append(path)
    return paths, threshold


def write(directory: str) -> str:
    """The stand-in rule file in ``directory``; its path."""
    path = os.path.join(directory, "job-rules-minimal.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(RULES, fh)
    return path

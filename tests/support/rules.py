"""The Prometheus rule files of deploy/prometheus/ read as data, and the metric names gpumon can
export: the rules, dashboards and alert tests check each other against them."""

from __future__ import annotations

import re

import yaml

from gpumon.catalogue import daemon as daemon_metrics
from gpumon.registry import available_collectors, collector_class
from gpumon.rulefiles import rule_files
from tests.conftest import REPO

RULE_FILES = rule_files(REPO)
"""Every rule file in deploy/prometheus/, so a new one is checked as the others are."""


def rules(kind: str) -> list[dict]:
    out = []
    for path in RULE_FILES:
        with open(path, encoding="utf-8") as fh:
            for group in yaml.safe_load(fh)["groups"]:
                out += [r for r in group["rules"] if kind in r]
    return out


def known_metrics() -> set[str]:
    """Every metric name gpumon can export (counters with and without _total), plus the recording rules."""
    names = {spec.name for spec in daemon_metrics.SELF_SPECS + daemon_metrics.HEALTH_SPECS}
    for name in available_collectors():
        names |= {spec.name for spec in collector_class(name).metrics()}
    names |= {r["record"] for r in rules("record")}
    return names | {"up"}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (words that look like gpumon series or recording rules)."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"\b((?:gpumon_|[a-z_]+:gpumon_)[a-z0-9_:]+|up)\b(?=\s*[{\[)]|\s*$|\s*[<>=!/*+-])",
                          expr))

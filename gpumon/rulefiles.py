"""The Prometheus rule files under deploy/prometheus/, read in one place: every generated copy of the
rules (the PrometheusRule, the Azure rule groups, the alert table in the docs) starts here, so a new rule
file is picked up by all of them without a list to update."""

from __future__ import annotations

import glob
import os
import re
from typing import Any

RULES_DIR = os.path.join("deploy", "prometheus")


def rule_files(root: str) -> list[str]:
    """The rule files in ``root``/deploy/prometheus, sorted: each ``*.yaml`` with a top-level ``groups:``
    (prometheus.yml, the server's own configuration, and the unit tests under tests/ are not)."""
    import yaml

    found = []
    for path in sorted(glob.glob(os.path.join(root, RULES_DIR, "*.yaml"))):
        with open(path, encoding="utf-8") as fh:
            document = yaml.safe_load(fh)
        if isinstance(document, dict) and "groups" in document:
            found.append(path)
    return found


def rule_groups(root: str) -> list[dict[str, Any]]:
    """Every group of every rule file, in file order; a group name used twice is an error, since
    Prometheus, the operator and Azure all address a group by its name."""
    import yaml

    groups: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for path in rule_files(root):
        with open(path, encoding="utf-8") as fh:
            for group in yaml.safe_load(fh)["groups"]:
                name = group["name"]
                if name in seen:
                    raise ValueError(f"rule group {name!r} is in both {seen[name]} and {path}")
                seen[name] = path
                groups.append(group)
    return groups


_DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?")
_SECONDS = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


def duration_seconds(text: str) -> float:
    """A Prometheus duration (``5m``, ``1h30m``, ``30s``) in seconds; ValueError for anything else."""
    match = _DURATION.fullmatch(text)
    if not text or not match:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(part) * unit for part, unit in zip(match.groups(), _SECONDS) if part)


def iso8601(seconds: float) -> str:
    """Whole seconds as an ISO 8601 duration (``PT5M``, ``PT1H30M``, ``P1D``), as Azure's rule groups take."""
    total = int(seconds)
    if total != seconds or total < 0:
        raise ValueError(f"{seconds} s is not a whole, non-negative number of seconds")
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    time = "".join(f"{n}{u}" for n, u in ((hours, "H"), (minutes, "M"), (secs, "S")) if n)
    text = "P" + (f"{days}D" if days else "") + (f"T{time}" if time else "")
    return text if text != "P" else "PT0S"

"""The Grafana dashboards of dashboards/grafana/ read as data, and a walk over their (nested) panels."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from tests.conftest import REPO

GRAFANA = os.path.join(REPO, "dashboards", "grafana")


def dashboards() -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(os.listdir(GRAFANA)):
        if name.endswith(".json"):
            with open(os.path.join(GRAFANA, name), encoding="utf-8") as fh:
                out[name] = json.load(fh)
    return out


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))

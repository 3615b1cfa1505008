"""Prometheus exposition: text format 0.0.4 and OpenMetrics 1.0, rendered from a Snapshot.

Rendering is the most expensive step of a run (see docs/performance.md), so a :class:`Renderer`
keeps each series' ``name{labels} `` prefix between snapshots and only formats the values anew.
The output stays byte-compatible with both formats (``promtool check metrics`` clean, ``# EOF``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gpumon.model import Labels, MetricFamily, MetricType

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def escape_label_value(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        value = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def series_prefix(name: str, labels: Labels) -> str:
    if not labels:
        return name + " "
    body = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels)
    return f"{name}{{{body}}} "


class Renderer:
    """Renders families to text 0.0.4 or OpenMetrics, caching per-series prefixes across calls.

    Not thread-safe: one renderer per rendering thread. The cache keeps only the series of the
    latest render, so a churning label set cannot grow it without bound.
    """

    def __init__(self) -> None:
        self._prefixes: dict[tuple[str, Labels], str] = {}
        self._headers: dict[tuple[str, bool], str] = {}

    def _header(self, fam: MetricFamily, openmetrics: bool) -> str:
        key = (fam.spec.name, openmetrics)
        header = self._headers.get(key)
        if header is None:
            header = _family_header(fam, openmetrics)
            self._headers[key] = header
        return header

    def render(self, families: Iterable[MetricFamily], openmetrics: bool = False) -> str:
        old, new = self._prefixes, {}
        parts: list[str] = []
        append = parts.append
        for fam in families:
            if not fam.samples:
                continue
            append(self._header(fam, openmetrics))
            name = fam.spec.name
            for labels, value in fam.samples:
                key = (name, labels)
                prefix = old.get(key)
                if prefix is None:
                    prefix = series_prefix(name, labels)
                new[key] = prefix
                append(prefix + format_value(value) + "\n")
        if openmetrics:
            append("# EOF\n")
        self._prefixes = new
        return "".join(parts)


def _family_header(fam: MetricFamily, openmetrics: bool) -> str:
    spec = fam.spec
    if not openmetrics:
        kind = "gauge" if spec.type is MetricType.INFO else spec.type.value
        return f"# HELP {spec.name} {escape_help(spec.help)}\n# TYPE {spec.name} {kind}\n"
    family = spec.name
    if spec.type is MetricType.COUNTER:
        family = family[: -len("_total")]
    elif spec.type is MetricType.INFO:
        family = family[: -len("_info")]
    lines = [f"# TYPE {family} {spec.type.value}\n"]
    if spec.unit and family.endswith("_" + spec.unit):
        lines.append(f"# UNIT {family} {spec.unit}\n")
    lines.append(f"# HELP {family} {escape_label_value(spec.help)}\n")
    return "".join(lines)

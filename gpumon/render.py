"""Prometheus exposition: text format 0.0.4 and OpenMetrics 1.0, rendered from a Snapshot.

Rendering is the most expensive step of a run (see docs/performance.md), so a :class:`Renderer`
keeps each family's text between snapshots and renders again only a family whose samples changed;
within it, each series' ``name{labels} `` prefix is kept and only the values are formatted anew.
The output stays byte-compatible with both formats (``promtool check metrics`` clean, ``# EOF``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

from gpumon.model import Labels, MetricFamily, MetricSpec, MetricType, Sample

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
    """Renders families to text 0.0.4 or OpenMetrics, caching each family's text and series prefixes.

    Not thread-safe: one renderer per rendering thread. The cache keeps only the families of the
    latest render, so a churning label set cannot grow it without bound.
    """

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, bool], _Block] = {}

    @property
    def _prefixes(self) -> dict[tuple[str, Labels], str]:
        """Every cached series prefix, by (name, labels): what the cache holds, for inspection."""
        return {(block.spec.name, labels): prefix for block in self._blocks.values()
                for labels, prefix in zip(block.labels, block.prefixes)}

    def render(self, families: Iterable[MetricFamily], openmetrics: bool = False) -> str:
        old, blocks = self._blocks, {}
        parts: list[str] = []
        for fam in families:
            samples = fam.samples
            if not samples:
                continue
            key = (fam.spec.name, openmetrics)
            block = old.get(key)
            if block is None or (block.spec is not fam.spec and block.spec != fam.spec):
                block = _Block(fam.spec, _family_header(fam, openmetrics)).again(samples)
            elif block.samples is not samples and block.samples != samples:
                block = block.again(samples)  # same family, new values: only the values are formatted
            blocks[key] = block
            parts.append(block.text)
        if openmetrics:
            parts.append("# EOF\n")
        self._blocks = blocks
        return "".join(parts)


class _ValueLines(dict[float, str]):
    """Whole value -> its text and the line's newline. Many values repeat (0, 1, states, clocks,
    temperatures) and a lookup, done in C through ``map``, costs a fraction of formatting one;
    bounded, so a stream of distinct values (counters) cannot grow it: it starts again when full.
    Fractions, NaN and infinities are formatted each time and never kept."""

    MAX = 1024

    def __missing__(self, value: float) -> str:
        if not value.is_integer():  # a measured fraction rarely comes back: formatted, not kept
            return f"{value!r}\n" if value - value == 0.0 else format_value(value) + "\n"  # finite?
        if not -1e15 < value < 1e15:
            return format_value(value) + "\n"
        text = f"{int(value)}\n"
        if len(self) >= self.MAX:
            self.clear()
        self[value] = text
        return text


_VALUE_LINES = _ValueLines()


class _Block:
    """One family's rendered text and the ``name{labels} `` prefix of each of its series, in the
    order of the samples last rendered (a run that brings the same series in the same order, the
    usual case, reuses them without a lookup)."""

    __slots__ = ("spec", "header", "samples", "labels", "prefixes", "text")

    def __init__(self, spec: MetricSpec, header: str) -> None:
        self.spec, self.header = spec, header
        self.samples: tuple[Sample, ...] | None = None
        self.labels: tuple[Labels, ...] = ()
        self.prefixes: tuple[str, ...] = ()
        self.text = ""

    def again(self, samples: tuple[Sample, ...]) -> _Block:
        """This family rendered with ``samples``: a new block, so a cached one is never changed."""
        block = _Block(self.spec, self.header)
        labels = tuple(map(_LABELS, samples))
        if labels == self.labels:
            prefixes = self.prefixes
        else:
            known = dict(zip(self.labels, self.prefixes))
            name = self.spec.name
            prefixes = tuple(known.get(key) or series_prefix(name, key) for key in labels)
        values = map(_VALUE_LINES.__getitem__, map(_VALUE, samples))
        block.samples, block.labels, block.prefixes = samples, labels, prefixes
        block.text = self.header + "".join(map(operator.add, prefixes, values))
        return block


_LABELS = operator.itemgetter(0)
_VALUE = operator.itemgetter(1)


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

#!/usr/bin/env python3
"""Renders a gpumon Grafana dashboard to a PNG from a live Prometheus, without Grafana.

    # a picture of one dashboard from any Prometheus that scrapes gpumon (last 60 minutes)
    python dashboards/preview.py --prometheus http://localhost:9090 \\
        --dashboard dashboards/grafana/gpumon-node.json --minutes 60 --out node.png

    # the pictures in docs/: a simulated ND H100 v5 host with injected faults, scraped for 4 minutes
    python dashboards/preview.py --simulate --minutes 4 --out docs/images

The pictures in the documentation should show what the dashboards really show, so the renderer runs each
panel's own queries (variables and Grafana's built-ins substituted the way Grafana would) and draws the
results on the panel's gridPos: time series as lines, stats as big numbers, tables as text, heatmaps,
state timelines and bar gauges. It approximates Grafana's dark theme; it is not Grafana.

``--simulate`` starts ``gpumon run --simulate nd-h100-v5`` and the Debian ``prometheus`` on loopback
(scrape every 5 s, the recording rules of deploy/prometheus/recording-rules.yaml evaluated every 5 s
instead of 30 s so that a few minutes give them shape), injects link flaps, a port down period, a port
that stays down and XIDs through the simulation's control files, then renders the three dashboards.
Everything it starts is stopped and its temporary directory removed.

Needs matplotlib (``pip install matplotlib``), which gpumon itself does not depend on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, Normalize, to_rgba
    from matplotlib.patches import FancyBboxPatch, Rectangle
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    from PIL import Image
except ImportError:  # pragma: no cover - depends on the machine
    sys.exit("dashboards/preview.py draws with matplotlib, which gpumon does not install: pip install matplotlib")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAFANA_DIR = os.path.join(REPO, "dashboards", "grafana")
RECORDING_RULES = os.path.join(REPO, "deploy", "prometheus", "recording-rules.yaml")
PICTURES = {
    "gpumon-fleet.json": "dashboard-fleet.png",
    "gpumon-node.json": "dashboard-node.png",
    "gpumon-infiniband-fabric.json": "dashboard-infiniband-fabric.png",
}

# ------------------------------------------------------------------------------------------ theme

BG = "#111217"
PANEL = "#181b1f"
BORDER = "#2b2d32"
TEXT = "#ccccdc"
MUTED = "#8e8e9c"
GRID = "#2a2d33"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0",
           "#37872d", "#fade2a", "#447ebc", "#c15c17", "#890f02", "#0a437c", "#6d1f62", "#584477"]
NAMED = {"green": "#73bf69", "red": "#f2495c", "orange": "#ff9830", "yellow": "#fade2a", "blue": "#5794f2",
         "purple": "#b877d9", "transparent": PANEL, "text": TEXT}
GR_YL_RD = LinearSegmentedColormap.from_list("GrYlRd", ["#37872d", "#73bf69", "#fade2a", "#ff9830", "#e02f44"])

# Grafana's grid: 24 columns, 30 px rows, 8 px gaps.
WIDTH_PX = 1600
ROW_PX = 30
GAP_PX = 8
HEADER_PX = 56
PAD_PX = 10
DPI = 100
CHAR_PX = 6.0  # mean width of a 7 pt character, for cutting text to fit


def color(name: str | None) -> str:
    if not name:
        return NAMED["green"]
    return NAMED.get(name, name)


# ------------------------------------------------------------------------------------------ units


SI = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
IEC = [(2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")]


def _scaled(value: float, scale: float, prefixes: list[tuple[float, str]], suffix: str,
            decimals: int | None, space: bool = True) -> str:
    for factor, prefix in prefixes:
        if scale >= factor:
            return f"{_num(value / factor, decimals)}{' ' if space else ''}{prefix}{suffix}"
    return f"{_num(value, decimals)}{' ' if space else ''}{suffix}"


def _num(value: float, decimals: int | None) -> str:
    if decimals is None:
        magnitude = abs(value)
        decimals = 0 if magnitude >= 100 or magnitude == int(magnitude) else 1 if magnitude >= 10 else 2
    text = f"{value:.{decimals}f}"
    return "0" if text in ("-0", "-0.0", "-0.00") else text


def fmt(value: float | None, unit: str, decimals: int | None = None, scale: float | None = None) -> str:
    """A value as Grafana writes it for ``unit``; ``scale`` picks the prefix (an axis' largest tick)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    s = abs(value) if scale is None else abs(scale)
    if unit == "percentunit":
        return f"{_num(value * 100, decimals)}%"
    if unit == "percent":
        return f"{_num(value, decimals)}%"
    if unit == "watt":
        return _scaled(value, s, SI, "W", decimals)
    if unit == "celsius":
        return f"{_num(value, decimals)} °C"
    if unit == "Bps":
        return _scaled(value, s, SI, "B/s", decimals)
    if unit == "bytes":
        return _scaled(value, s, IEC, "B", decimals)
    if unit == "hertz":
        return _scaled(value, s, SI, "Hz", decimals)
    if unit == "cps":
        return _scaled(value, s, SI, "c/s", decimals)
    if unit == "s":
        for factor, name in ((86400, "day"), (3600, "hour"), (60, "min")):
            if s >= factor:
                return f"{_num(value / factor, decimals)} {name}"
        return f"{_num(value, decimals)} s"
    if unit == "dateTimeAsIso":
        return dt.datetime.fromtimestamp(value / 1000).strftime("%Y-%m-%d %H:%M:%S")
    return _scaled(value, s, [(1e12, "T"), (1e9, "B"), (1e6, "Mil"), (1e3, "K")], "", decimals, space=False)


def axis_formatter(unit: str, ax: Any, which: str = "y") -> FuncFormatter:
    """Tick labels with one prefix for the whole axis and as many decimals as the tick step needs."""

    def label(value: float, _pos: int) -> str:
        lo, hi = ax.get_ylim() if which == "y" else ax.get_xlim()
        ticks = [t for t in (ax.get_yticks() if which == "y" else ax.get_xticks()) if lo <= t <= hi]
        scale = max((abs(t) for t in ticks), default=abs(value)) or 1.0
        step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else scale
        factor = 100.0 if unit == "percentunit" else _prefix_factor(unit, scale)
        decimals = max(0, min(3, -math.floor(math.log10(step * factor)) if step * factor > 0 else 0))
        return fmt(value, unit, decimals, scale)

    return FuncFormatter(label)


def _prefix_factor(unit: str, scale: float) -> float:
    prefixes = IEC if unit == "bytes" else SI
    if unit in ("watt", "Bps", "bytes", "hertz", "cps", "none", ""):
        for factor, _ in prefixes:
            if scale >= factor:
                return 1.0 / factor
    if unit == "s":
        for factor in (86400, 3600, 60):
            if scale >= factor:
                return 1.0 / factor
    return 1.0


# ------------------------------------------------------------------------------------------ Prometheus


class PrometheusError(RuntimeError):
    pass


@dataclass
class Series:
    labels: dict[str, str]
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class Prometheus:
    """The two query endpoints the renderer needs."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _get(self, path: str, params: dict[str, str]) -> Any:
        address = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(address, timeout=30) as resp:
                payload = json.load(resp)
        except urllib.error.HTTPError as err:
            try:
                payload = json.load(err)
            except ValueError:
                raise PrometheusError(f"{address}: HTTP {err.code}") from None
            raise PrometheusError(f"{params.get('query')}: {payload.get('error', err)}") from None
        except (urllib.error.URLError, OSError) as err:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {getattr(err, 'reason', err)}") from None
        if payload.get("status") != "success":
            raise PrometheusError(f"{params.get('query')}: {payload.get('error')}")
        return payload["data"]

    def instant(self, expr: str, at: float) -> list[Series]:
        data = self._get("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})
        if data["resultType"] == "scalar":
            return [Series({}, [data["result"][0]], [float(data["result"][1])])]
        return [Series(r["metric"], [r["value"][0]], [float(r["value"][1])]) for r in data["result"]]

    def range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        data = self._get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                  "step": f"{step:g}"})
        return [Series(r["metric"], [float(t) for t, _ in r["values"]], [float(v) for _, v in r["values"]])
                for r in data["result"]]

    def label_values(self, selector: str, label: str) -> list[str]:
        found = self.instant(f"count by ({label}) ({selector})", time.time())
        return sorted({s.labels[label] for s in found if label in s.labels}, key=_natural)


def _natural(text: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


# ------------------------------------------------------------------------------------------ queries


@dataclass
class TimeRange:
    start: float
    end: float
    scrape_interval: float

    @property
    def step(self) -> float:
        """Grafana's $__interval for a panel about 1000 px wide, never below the scrape interval."""
        return max(self.scrape_interval, math.ceil((self.end - self.start) / 1000))

    def builtins(self) -> dict[str, str]:
        seconds = int(round(self.end - self.start))
        rate = int(max(self.step + self.scrape_interval, 4 * self.scrape_interval))
        return {"$__rate_interval": f"{rate}s", "$__range_s": str(seconds), "$__range": f"{seconds}s",
                "$__interval": f"{int(self.step)}s"}


def resolve_variables(dashboard: dict[str, Any], prom: Prometheus,
                      chosen: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Values for the dashboard's variables, as regexes for the queries and as text for the header.

    A multi-value variable with *All* becomes its allValue; a single-value one (the Node dashboard's
    host) takes the first value Prometheus lists. ``chosen`` (from ``--var``) wins.
    """
    regex: dict[str, str] = {}
    shown: dict[str, str] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        name = var["name"]
        if var["type"] != "query":
            continue
        if name in chosen:
            regex[name] = chosen[name]
            shown[name] = chosen[name]
            continue
        if var.get("includeAll") and var.get("allValue"):
            regex[name] = var["allValue"]
            shown[name] = "All"
            continue
        m = re.fullmatch(r"label_values\((.+), *(\w+)\)", var.get("definition", ""))
        if not m:
            raise ValueError(f"variable {name}: cannot read {var.get('definition')!r}; pass --var {name}=VALUE")
        values = prom.label_values(substitute(m.group(1), regex, {}), m.group(2))
        if not values:
            raise ValueError(f"variable {name}: Prometheus lists no values for {var['definition']}")
        regex[name] = re.escape(values[0])
        shown[name] = values[0]
    return regex, shown


def substitute(expr: str, variables: dict[str, str], builtins: dict[str, str]) -> str:
    for name in sorted(builtins, key=len, reverse=True):
        expr = expr.replace(name, builtins[name])
    for name in sorted(variables, key=len, reverse=True):
        value = variables[name].replace("\\", "\\\\")  # a regex inside a PromQL string literal
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def legend(series: Series, fmt_string: str) -> str:
    if fmt_string:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: series.labels.get(m.group(1), ""), fmt_string).strip()
    name = series.labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(series.labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest else name or "value"


# ------------------------------------------------------------------------------------------ drawing


class Canvas:
    """Maps Grafana grid units to figure coordinates and draws the panel frames."""

    def __init__(self, grid_height: int, title: str, subtitle: str) -> None:
        self.height_px = HEADER_PX + grid_height * (ROW_PX + GAP_PX) + PAD_PX
        self.col_px = (WIDTH_PX - 2 * PAD_PX + GAP_PX) / 24
        self.fig = plt.figure(figsize=(WIDTH_PX / DPI, self.height_px / DPI), dpi=DPI, facecolor=BG)
        self.text(PAD_PX, 14, title, size=14, weight="bold")
        self.text(PAD_PX, 36, subtitle, size=8.5, color=MUTED)

    def box(self, grid: dict[str, int]) -> tuple[float, float, float, float]:
        """Pixel box (left, top, width, height) of a gridPos."""
        left = PAD_PX + grid["x"] * self.col_px
        top = HEADER_PX + grid["y"] * (ROW_PX + GAP_PX)
        return left, top, grid["w"] * self.col_px - GAP_PX, grid["h"] * (ROW_PX + GAP_PX) - GAP_PX

    def rect(self, left: float, top: float, width: float, height: float) -> list[float]:
        """Figure fraction rectangle [left, bottom, width, height] of a pixel box."""
        return [left / WIDTH_PX, 1 - (top + height) / self.height_px, width / WIDTH_PX, height / self.height_px]

    def text(self, x: float, y: float, s: str, **kw: Any) -> None:
        kw.setdefault("color", TEXT)
        kw.setdefault("size", 9)
        kw.setdefault("va", "top")
        self.fig.text(x / WIDTH_PX, 1 - y / self.height_px, s, **kw)

    def frame(self, grid: dict[str, int], title: str) -> tuple[float, float, float, float]:
        """Draws the panel background and title; returns the pixel box left for the content."""
        left, top, width, height = self.box(grid)
        x, y, w, h = self.rect(left, top, width, height)
        self.fig.patches.append(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.002",
                                               transform=self.fig.transFigure, facecolor=PANEL,
                                               edgecolor=BORDER, linewidth=0.8, zorder=-1))
        self.text(left + 8, top + 7, shorten(title, int(width / 6.5)), size=9, weight="bold")
        return left + 8, top + 26, width - 16, height - 32

    def axes(self, left: float, top: float, width: float, height: float, **kw: Any) -> Any:
        ax = self.fig.add_axes(self.rect(left, top, max(width, 1), max(height, 1)), **kw)
        ax.set_facecolor(PANEL)
        return ax


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 1, 1)] + "…"


def style_axes(ax: Any) -> None:
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(colors=MUTED, labelsize=7, length=0, pad=3)
    ax.grid(True, color=GRID, linewidth=0.6)
    ax.set_axisbelow(True)


def time_axis(ax: Any, tr: TimeRange) -> None:
    ax.set_xlim(mdates.date2num(dt.datetime.fromtimestamp(tr.start)), mdates.date2num(dt.datetime.fromtimestamp(tr.end)))
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if tr.end - tr.start < 900 else "%H:%M"))


def to_dates(times: list[float]) -> Any:
    return np.array([mdates.date2num(dt.datetime.fromtimestamp(t)) for t in times])


def with_gaps(series: Series, step: float) -> tuple[list[float], list[float]]:
    """Breaks the line where Prometheus returned no sample for a step (Grafana's spanNulls off)."""
    times: list[float] = []
    values: list[float] = []
    for t, v in zip(series.times, series.values):
        if times and t - times[-1] > 1.5 * step:
            times.append(times[-1] + step)
            values.append(float("nan"))
        times.append(t)
        values.append(v)
    return times, values


def no_data(canvas: Canvas, box: tuple[float, float, float, float], text: str = "No data") -> None:
    left, top, width, height = box
    canvas.text(left + width / 2, top + height / 2 - 6, text, size=10, color=MUTED, ha="center")


def thresholds(p: dict[str, Any]) -> list[tuple[float | None, str]]:
    steps = p.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    return [(s.get("value"), s.get("color", "green")) for s in steps] or [(None, "green")]


def threshold_color(p: dict[str, Any], value: float) -> str:
    chosen = "green"
    for limit, name in thresholds(p):
        if limit is None or value >= limit:
            chosen = name
    return color(chosen)


def mapping_for(mappings: list[dict[str, Any]], value: float) -> dict[str, Any] | None:
    key = _num(value, 0) if value == int(value) else str(value)
    for m in mappings:
        if m.get("type") == "value" and key in m.get("options", {}):
            return m["options"][key]
    return None


@dataclass
class Context:
    prom: Prometheus
    tr: TimeRange
    variables: dict[str, str]

    def expr(self, target: dict[str, Any]) -> str:
        return substitute(target["expr"], self.variables, self.tr.builtins())

    def range(self, target: dict[str, Any]) -> list[Series]:
        return self.prom.range(self.expr(target), self.tr.start, self.tr.end, self.tr.step)

    def instant(self, target: dict[str, Any]) -> list[Series]:
        return self.prom.instant(self.expr(target), self.tr.end)


def defaults(p: dict[str, Any]) -> dict[str, Any]:
    return p.get("fieldConfig", {}).get("defaults", {})


def overrides_for(p: dict[str, Any], name: str) -> dict[str, Any]:
    """The override properties of the field (series or column) with this display name."""
    props: dict[str, Any] = {}
    for o in p.get("fieldConfig", {}).get("overrides", []):
        if o.get("matcher", {}).get("id") == "byName" and o["matcher"].get("options") == name:
            props.update({prop["id"]: prop.get("value") for prop in o.get("properties", [])})
    return props


def draw_stat(canvas: Canvas, p: dict[str, Any], ctx: Context, box: tuple[float, float, float, float]) -> None:
    series = [s for t in p["targets"] for s in ctx.instant(t)]
    if not series:
        no_data(canvas, box)
        return
    value = series[0].values[-1]
    d = defaults(p)
    text = fmt(value, d.get("unit", "none"), d.get("decimals"))
    shade = threshold_color(p, value)
    left, top, width, height = box
    if p.get("options", {}).get("colorMode") == "background":
        ax = canvas.axes(left - 8, top - 26, width + 16, height + 32)
        ax.set_axis_off()
        ax.add_patch(Rectangle((0, 0), 1, 1, transform=ax.transAxes, facecolor=shade, alpha=0.85, linewidth=0))
        # the title again, on the coloured background
        canvas.text(left, top - 19, shorten(p["title"], int(width / 6.5)), size=9, weight="bold", color="white")
        ink = "white"
    else:
        ink = shade
    size = min(30.0, height / 2.0, width / max(len(text), 1) * 1.2)
    canvas.text(left + width / 2, top + height / 2 - size * 0.7, text, size=size, weight="bold", color=ink,
                ha="center")


def draw_timeseries(canvas: Canvas, p: dict[str, Any], ctx: Context, box: tuple[float, float, float, float]) -> None:
    d = defaults(p)
    custom = d.get("custom", {})
    unit = d.get("unit", "none")
    lines: list[tuple[str, Series]] = []
    for t in p["targets"]:
        for s in ctx.range(t):
            lines.append((legend(s, t.get("legendFormat", "")), s))
    if not lines:
        no_data(canvas, box)
        return
    lines.sort(key=lambda item: _natural(item[0]))
    left, top, width, height = box
    right_legend = p["gridPos"]["w"] >= 12
    legend_w = min(300.0, width * 0.36) if right_legend else 0.0
    legend_h = 0.0 if right_legend else min(3, math.ceil(len(lines) / 3)) * 13 + 4
    ax = canvas.axes(left + 46, top + 2, width - 50 - legend_w, height - 18 - legend_h)
    style_axes(ax)
    time_axis(ax, ctx.tr)
    bars = custom.get("drawStyle") == "bars"
    fill = custom.get("fillOpacity", 10) / 100
    entries: list[tuple[str, str, str, Series]] = []
    for i, (name, s) in enumerate(lines):
        props = overrides_for(p, name)
        shade = PALETTE[i % len(PALETTE)]
        if isinstance(props.get("color"), dict) and props["color"].get("fixedColor"):
            shade = color(props["color"]["fixedColor"])
        style = "--" if props.get("custom.lineStyle", {}).get("fill") == "dash" else "-"
        times, values = with_gaps(s, ctx.tr.step)
        x = to_dates(times)
        y = np.array(values, dtype=float)
        if bars:
            width_days = ctx.tr.step / 86400 * 0.8 / max(len(lines), 1)
            ax.bar(x + i * width_days, y, width=width_days, color=shade, alpha=max(fill, 0.6), linewidth=0)
        else:
            ax.plot(x, y, color=shade, linewidth=1.0, linestyle=style)
            if style == "-" and fill > 0:
                ax.fill_between(x, y, 0, color=shade, alpha=fill * 0.6, linewidth=0)
        entries.append((name, shade, style, s))
    lo, hi = ax.get_ylim()
    if d.get("min") is not None:
        lo = d["min"]
    if d.get("max") is not None:
        hi = d["max"]
    if hi <= lo:
        hi = lo + 1
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_locator(MaxNLocator(5))
    ax.yaxis.set_major_formatter(axis_formatter(unit, ax))
    if right_legend:
        draw_legend_table(canvas, entries, unit, left + width - legend_w + 6, top, legend_w - 6, height - 4)
    else:
        draw_legend_rows(canvas, entries, left + 4, top + height - legend_h + 2, width - 4)


def draw_legend_table(canvas: Canvas, entries: list[tuple[str, str, str, Series]], unit: str,
                      left: float, top: float, width: float, height: float) -> None:
    """Grafana's table legend: name, last value, maximum."""
    rows = max(int((height - 14) // 13), 1)
    name_w = width - 120
    canvas.text(left + name_w, top, "Last *", size=7, color=MUTED, ha="right")
    canvas.text(left + width - 4, top, "Max", size=7, color=MUTED, ha="right")
    shown = entries if len(entries) <= rows else entries[: rows - 1]
    for i, (name, shade, style, s) in enumerate(shown):
        y = top + 14 + i * 13
        last = next((v for v in reversed(s.values) if not math.isnan(v)), None)
        peak = max((v for v in s.values if not math.isnan(v)), default=None)
        canvas.text(left, y, "━" if style == "-" else "╍", size=7, color=shade)
        canvas.text(left + 12, y, shorten(name, int((name_w - 70) / 4.4)), size=7)
        canvas.text(left + name_w, y, fmt(last, unit), size=7, ha="right")
        canvas.text(left + width - 4, y, fmt(peak, unit), size=7, ha="right")
    if len(shown) < len(entries):
        canvas.text(left + 12, top + 14 + len(shown) * 13, f"+ {len(entries) - len(shown)} more", size=7,
                    color=MUTED)


def draw_legend_rows(canvas: Canvas, entries: list[tuple[str, str, str, Series]], left: float, top: float,
                     width: float) -> None:
    per_row = 3
    slot = width / per_row
    limit = 3 * per_row
    shown = entries if len(entries) <= limit else entries[: limit - 1]
    for i, (name, shade, style, _s) in enumerate(shown):
        x = left + (i % per_row) * slot
        y = top + (i // per_row) * 13
        canvas.text(x, y, "━" if style == "-" else "╍", size=7, color=shade)
        canvas.text(x + 12, y, shorten(name, int((slot - 16) / 4.6)), size=7)
    if len(shown) < len(entries):
        i = len(shown)
        canvas.text(left + (i % per_row) * slot + 12, top + (i // per_row) * 13,
                    f"+ {len(entries) - len(shown)} more", size=7, color=MUTED)


def draw_heatmap(canvas: Canvas, p: dict[str, Any], ctx: Context, box: tuple[float, float, float, float]) -> None:
    """Grafana's calculated heatmap: per time step, how many series fall in each of N value buckets."""
    series = [s for t in p["targets"] for s in ctx.range(t)]
    values = [v for s in series for v in s.values if not math.isnan(v)]
    if not values:
        no_data(canvas, box)
        return
    options = p.get("options", {})
    buckets = int(options.get("calculation", {}).get("yBuckets", {}).get("value", 20))
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    steps = sorted({t for s in series for t in s.times})
    index = {t: i for i, t in enumerate(steps)}
    counts = np.zeros((buckets, len(steps)))
    for s in series:
        for t, v in zip(s.times, s.values):
            b = min(int((v - lo) / (hi - lo) * buckets), buckets - 1)
            counts[b, index[t]] += 1
    left, top, width, height = box
    ax = canvas.axes(left + 46, top + 2, width - 50 - 36, height - 18)
    style_axes(ax)
    ax.grid(False)
    x0 = mdates.date2num(dt.datetime.fromtimestamp(steps[0] - ctx.tr.step / 2))
    x1 = mdates.date2num(dt.datetime.fromtimestamp(steps[-1] + ctx.tr.step / 2))
    cmap = plt.get_cmap(options.get("color", {}).get("scheme", "Oranges")).copy()
    cmap.set_bad(PANEL)
    image = ax.imshow(np.ma.masked_equal(counts, 0), aspect="auto", origin="lower", extent=(x0, x1, lo, hi),
                      cmap=cmap, norm=Normalize(0, max(counts.max(), 1)), interpolation="nearest")
    time_axis(ax, ctx.tr)
    ax.yaxis.set_major_locator(MaxNLocator(5))
    ax.yaxis.set_major_formatter(axis_formatter(options.get("yAxis", {}).get("unit", defaults(p).get("unit", "")), ax))
    cax = canvas.axes(left + width - 28, top + 2, 6, height - 18)
    bar = canvas.fig.colorbar(image, cax=cax)
    bar.outline.set_visible(False)
    cax.tick_params(colors=MUTED, labelsize=6, length=0)


def draw_state(canvas: Canvas, p: dict[str, Any], ctx: Context, box: tuple[float, float, float, float]) -> None:
    """status-history and state-timeline: one row per series, coloured by value mapping or by a scale."""
    d = defaults(p)
    rows: list[tuple[str, Series]] = []
    for t in p["targets"]:
        rows.extend((legend(s, t.get("legendFormat", "")), s) for s in ctx.range(t))
    if not rows:
        no_data(canvas, box)
        return
    rows.sort(key=lambda item: _natural(item[0]))
    steps = sorted({t for _, s in rows for t in s.times})
    index = {t: i for i, t in enumerate(steps)}
    image = np.zeros((len(rows), len(steps), 4))
    image[:, :] = to_rgba(PANEL)
    mappings = d.get("mappings", [])
    continuous = d.get("color", {}).get("mode", "").startswith("continuous")
    norm = Normalize(d.get("min", 0), d.get("max", 1))
    seen: dict[str, str] = {}
    for r, (_name, s) in enumerate(rows):
        for t, v in zip(s.times, s.values):
            m = mapping_for(mappings, v)
            if m is not None:
                shade = color(m.get("color"))
                if m.get("color") != "transparent":
                    seen.setdefault(m.get("text", str(v)), shade)
            elif continuous:
                shade = GR_YL_RD(norm(v))
            else:
                shade = threshold_color(p, v)
            image[r, index[t]] = to_rgba(shade)
    left, top, width, height = box
    label_w = min(150.0, width * 0.3)
    legend_h = 14 if seen else 0
    ax = canvas.axes(left + label_w, top + 2, width - label_w - 4, height - 18 - legend_h)
    style_axes(ax)
    ax.grid(False)
    x0 = mdates.date2num(dt.datetime.fromtimestamp(steps[0] - ctx.tr.step / 2))
    x1 = mdates.date2num(dt.datetime.fromtimestamp(steps[-1] + ctx.tr.step / 2))
    ax.imshow(image, aspect="auto", extent=(x0, x1, len(rows) - 0.5, -0.5), interpolation="nearest")
    # a thin gap between rows, as Grafana draws them
    for r in range(len(rows) - 1):
        ax.axhline(r + 0.5, color=PANEL, linewidth=2)
    time_axis(ax, ctx.tr)
    every = max(1, math.ceil(len(rows) * 10 / max(height - 18 - legend_h, 1)))  # 10 px a label at least
    ax.set_yticks(range(0, len(rows), every))
    ax.set_yticklabels([shorten(n, int(label_w / CHAR_PX)) for n, _ in rows[::every]], fontsize=7)
    if seen:
        x = left + label_w
        for text, shade in seen.items():
            canvas.text(x, top + height - 12, "■", size=7, color=shade)
            canvas.text(x + 10, top + height - 12, text, size=7)
            x += 18 + 5.5 * len(text)
    elif continuous:
        canvas.text(left + width - 4, top - 18,
                    f"{fmt(norm.vmin, d.get('unit', 'none'))} (green) … {fmt(norm.vmax, d.get('unit', 'none'))} (red)",
                    size=7, color=MUTED, ha="right")


def draw_bargauge(canvas: Canvas, p: dict[str, Any], ctx: Context, box: tuple[float, float, float, float]) -> None:
    d = defaults(p)
    unit = d.get("unit", "none")
    items: list[tuple[str, float]] = []
    for t in p["targets"]:
        items.extend((legend(s, t.get("legendFormat", "")), s.values[-1]) for s in ctx.instant(t))
    if not items:
        no_data(canvas, box)
        return
    items.sort(key=lambda item: -item[1])
    top_value = d.get("max") if d.get("max") is not None else max(v for _, v in items) or 1.0
    left, top, width, height = box
    slot = min(height / len(items), 30.0)
    bar_h = max(slot - 13, 4)
    value_w = 70
    for i, (name, value) in enumerate(items):
        y = top + i * slot
        canvas.text(left, y, shorten(name, int(width / 5)), size=7)
        ax = canvas.axes(left, y + 11, width - value_w, bar_h)
        ax.set_axis_off()
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.add_patch(Rectangle((0, 0), 1, 1, facecolor="#22252b", linewidth=0, zorder=0))
        share = max(0.0, min(value / top_value if top_value else 0.0, 1.0))
        shade = threshold_color(p, value)
        ramp = LinearSegmentedColormap.from_list("ramp", [to_rgba(shade, 0.35), to_rgba(shade, 1.0)])
        if share > 0:
            ax.imshow(np.linspace(0, 1, 64).reshape(1, -1), cmap=ramp, aspect="auto",
                      extent=(0, share, 0, 1), interpolation="bilinear", zorder=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        canvas.text(left + width, y + 11 + bar_h / 2 - 6, fmt(value, unit, d.get("decimals")), size=8,
                    color=shade, ha="right", weight="bold")


def table_frame(p: dict[str, Any], ctx: Context) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows the way Grafana's table format, merge and organize transformations give them."""
    targets = p["targets"]
    multi = len(targets) > 1
    rows: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    labels: set[str] = set()
    value_cols: list[str] = []
    for t in targets:
        col = f"Value #{t['refId']}" if multi else "Value"
        value_cols.append(col)
        for s in ctx.instant(t):
            key_labels = {k: v for k, v in s.labels.items() if k != "__name__" or not multi}
            key = tuple(sorted(key_labels.items()))
            row = rows.setdefault(key, dict(key_labels))
            row["Time"] = s.times[-1]
            row[col] = s.values[-1]
            labels.update(key_labels)
    organize = next((tr["options"] for tr in p.get("transformations", []) if tr["id"] == "organize"), {})
    hidden = {k for k, v in organize.get("excludeByName", {}).items() if v}
    rename = organize.get("renameByName", {})
    columns = [c for c in ["Time", *sorted(labels, key=lambda c: (c != "__name__", c)), *value_cols] if c not in hidden]
    table = [{rename.get(c, c): r.get(c) for c in columns} for r in rows.values()]
    columns = [rename.get(c, c) for c in columns]
    sort = p.get("options", {}).get("sortBy")
    if sort:
        key = sort[0]["displayName"]
        table.sort(key=lambda r: (r.get(key) is None, -(r.get(key) or 0) if sort[0].get("desc") else r.get(key) or 0))
    else:
        table.sort(key=lambda r: [_natural(str(r.get(c, ""))) for c in columns])
    return columns, table


def fit_columns(natural: list[int], room: float) -> list[float]:
    """Column widths (characters). When the columns do not all fit, long ones are cut to 20 characters and
    the columns that still do not fit are left out on the right, as Grafana scrolls them out of view."""
    if sum(natural) <= room:
        return [float(n) for n in natural]
    widths: list[float] = []
    for n in (min(n, 20) for n in natural):
        if sum(widths) + n > room:
            if room - sum(widths) >= 8:
                widths.append(room - sum(widths))
            break
        widths.append(float(n))
    return widths or [room]


def draw_table(canvas: Canvas, p: dict[str, Any], ctx: Context, box: tuple[float, float, float, float]) -> None:
    columns, rows = table_frame(p, ctx)
    if not rows:
        no_data(canvas, box)
        return
    d = defaults(p)
    left, top, width, height = box
    line = 15.0
    fits = max(int((height - line) // line), 1)
    shown = rows if len(rows) <= fits else rows[: fits - 1]
    cells: list[list[tuple[str, str | None]]] = []
    for r in shown:
        out = []
        for c in columns:
            v = r.get(c)
            props = overrides_for(p, c)
            unit = props.get("unit", d.get("unit", "none"))
            mappings = props.get("mappings", d.get("mappings", []))
            background = None
            if isinstance(v, float):
                m = mapping_for(mappings, v) if mappings else None
                if m is not None:
                    text = m.get("text", fmt(v, unit))
                    if props.get("custom.cellOptions", {}).get("type") == "color-background":
                        background = color(m.get("color"))
                else:
                    text = fmt(v, unit, props.get("decimals", d.get("decimals")))
            else:
                text = "" if v is None else str(v)
            out.append((text, background))
        cells.append(out)
    widths = fit_columns([max([len(c)] + [len(row[i][0]) for row in cells]) + 2 for i, c in enumerate(columns)],
                         width / CHAR_PX)
    scale = width / sum(widths)
    if len(widths) < len(columns):
        canvas.text(left + width, top - 19, f"{len(columns) - len(widths)} more columns →", size=7, color=MUTED,
                    ha="right")
        columns = columns[: len(widths)]
    xs = [left + sum(widths[:i]) * scale for i in range(len(widths))]
    for i, c in enumerate(columns):
        canvas.text(xs[i] + 3, top, shorten(c, int(widths[i] * scale / CHAR_PX)), size=7, color=MUTED, weight="bold")
    ax = canvas.axes(left, top + 12, width, 1)
    ax.set_axis_off()
    ax.axhline(0.5, color=BORDER, linewidth=1)
    for j, row in enumerate(cells):
        y = top + line * (j + 1)
        for i, (text, background) in enumerate(row[: len(columns)]):
            if background:
                box_ax = canvas.axes(xs[i], y - 1, widths[i] * scale - 2, line - 2)
                box_ax.set_axis_off()
                box_ax.add_patch(Rectangle((0, 0), 1, 1, transform=box_ax.transAxes, facecolor=background,
                                           alpha=0.8, linewidth=0))
            canvas.text(xs[i] + 3, y + 1, shorten(text, int(widths[i] * scale / CHAR_PX)), size=7,
                        color="white" if background else TEXT)
    if len(shown) < len(rows):
        canvas.text(left + 3, top + line * (len(shown) + 1) + 1, f"… {len(rows) - len(shown)} more rows",
                    size=7, color=MUTED)


DRAW: dict[str, Callable[[Canvas, dict[str, Any], Context, tuple[float, float, float, float]], None]] = {
    "stat": draw_stat,
    "timeseries": draw_timeseries,
    "table": draw_table,
    "heatmap": draw_heatmap,
    "status-history": draw_state,
    "state-timeline": draw_state,
    "bargauge": draw_bargauge,
}


def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from walk(p.get("panels", []))


def render(dashboard: dict[str, Any], prom: Prometheus, tr: TimeRange, out: str,
           chosen: dict[str, str] | None = None, note: str = "") -> list[str]:
    """Draws the dashboard to ``out``; returns the panels whose queries failed (drawn as errors)."""
    variables, shown = resolve_variables(dashboard, prom, chosen or {})
    panels = list(walk(dashboard["panels"]))
    grid_height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    start = dt.datetime.fromtimestamp(tr.start).strftime("%Y-%m-%d %H:%M:%S")
    end = dt.datetime.fromtimestamp(tr.end).strftime("%H:%M:%S")
    picked = "   ".join(f"{k}: {v}" for k, v in shown.items())
    subtitle = f"{start} to {end}   {picked}" + (f"   ({note})" if note else "")
    canvas = Canvas(grid_height, dashboard.get("title", ""), subtitle)
    ctx = Context(prom, tr, variables)
    failed = []
    for p in panels:
        if p["type"] == "row":
            left, top, width, _ = canvas.box(p["gridPos"])
            canvas.text(left, top + 8, p.get("title", ""), size=11, weight="bold")
            continue
        box = canvas.frame(p["gridPos"], p.get("title", ""))
        draw = DRAW.get(p["type"])
        if draw is None:
            no_data(canvas, box, f"({p['type']} panels are not drawn)")
            continue
        try:
            draw(canvas, p, ctx, box)
        except PrometheusError as err:
            failed.append(f"{p.get('title')}: {err}")
            no_data(canvas, box, "query error")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    canvas.fig.canvas.draw()
    image = Image.fromarray(np.asarray(canvas.fig.canvas.buffer_rgba())).convert("RGB")
    plt.close(canvas.fig)
    # 256 colours are plenty for a dashboard and make the file a third of the size
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, optimize=True)
    return failed


# ------------------------------------------------------------------------------------------ simulation


def free_port() -> int:
    """A port free now, for Prometheus, which cannot say which port it got for :0 (gpumon can)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None,
               log: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: exited with {proc.returncode}" + (f"; see {_tail(log)}" if log else ""))
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready within {timeout:.0f} s" + (f"; {_tail(log)}" if log else ""))


def _tail(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return "".join(fh.readlines()[-10:])


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def fault_plan(duration: float) -> list[tuple[float, str, dict[str, Any]]]:
    """(seconds after start, what, control command): a flapping port, a port down for a while and back,
    a port that stays down, one more flap, XIDs (79: fallen off the bus; 48: double-bit ECC)."""
    flap = {"action": "flap", "port": 1}
    return [
        (0.20 * duration, "flap mlx5_ib1", {**flap, "device": "mlx5_ib1"}),
        (0.22 * duration, "flap mlx5_ib1", {**flap, "device": "mlx5_ib1"}),
        (0.30 * duration, "XID 48 on GPU 5", {"action": "xid", "gpu": 5, "xid": 48}),
        (0.35 * duration, "mlx5_ib3 down", {"action": "port_down", "device": "mlx5_ib3", "port": 1,
                                            "seconds": round(0.25 * duration)}),
        (0.45 * duration, "flap mlx5_ib1", {**flap, "device": "mlx5_ib1"}),
        (0.50 * duration, "flap mlx5_ib1", {**flap, "device": "mlx5_ib1"}),
        (0.52 * duration, "flap mlx5_ib2", {**flap, "device": "mlx5_ib2"}),
        (0.55 * duration, "flap mlx5_ib1", {**flap, "device": "mlx5_ib1"}),
        (0.60 * duration, "flap mlx5_ib1", {**flap, "device": "mlx5_ib1"}),
        (0.65 * duration, "XID 79 on GPU 3", {"action": "xid", "gpu": 3, "xid": 79}),
        (0.75 * duration, "mlx5_ib6 down", {"action": "port_down", "device": "mlx5_ib6", "port": 1, "seconds": 0}),
    ]


def recording_rules_every(seconds: int, path: str) -> None:
    """A copy of the recording rules evaluated every ``seconds`` (the group's own interval is 30 s)."""
    with open(RECORDING_RULES, encoding="utf-8") as fh:
        text = fh.read()
    text, found = re.subn(r"(?m)^(\s*interval:\s*)\S+", rf"\g<1>{seconds}s", text)
    if not found:
        raise RuntimeError(f"{RECORDING_RULES}: no group interval to change")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def simulate(minutes: float, out_dir: str, keep: bool) -> int:
    from gpumon.simulate import control  # here: rendering alone does not need gpumon importable

    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        sys.exit("--simulate needs the prometheus server on PATH (Debian: apt-get install prometheus)")
    interval = 5
    tmp = tempfile.mkdtemp(prefix="gpumon-preview-")
    state = os.path.join(tmp, "state")
    exporter = prometheus = None
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON_")}
        env["GPUMON_DAEMON_STATE_DIR"] = state
        exporter_log = os.path.join(tmp, "gpumon.log")
        listen_file = os.path.join(tmp, "gpumon.listen")  # the port gpumon got for 127.0.0.1:0
        with open(exporter_log, "wb") as log:
            exporter = subprocess.Popen(
                [sys.executable, "-m", "gpumon", "run", "--simulate", "nd-h100-v5", "--listen", "127.0.0.1:0",
                 "--listen-file", listen_file, "--interval", str(interval)],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_until(lambda: os.path.exists(listen_file), 60, "gpumon", exporter, exporter_log)
        with open(listen_file, encoding="utf-8") as fh:
            port = int(fh.read().strip().rpartition(":")[2])
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/healthz"), 60, "gpumon", exporter, exporter_log)

        rules = os.path.join(tmp, "recording-rules.yaml")
        recording_rules_every(interval, rules)
        config = os.path.join(tmp, "prometheus.yml")
        with open(config, "w", encoding="utf-8") as fh:
            json.dump({  # JSON is YAML
                "global": {"scrape_interval": f"{interval}s", "scrape_timeout": f"{interval - 1}s",
                           "evaluation_interval": f"{interval}s"},
                "rule_files": [rules],
                "scrape_configs": [{"job_name": "gpumon", "static_configs": [
                    {"targets": [f"127.0.0.1:{port}"], "labels": {"cluster": "sim"}}]}],
            }, fh, indent=2)
        prom_port = free_port()
        prom_log = os.path.join(tmp, "prometheus.log")
        with open(prom_log, "wb") as log:
            prometheus = subprocess.Popen(
                [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{prom_port}"
        wait_until(lambda: answers(f"{url}/-/ready"), 60, "prometheus", prometheus, prom_log)
        prom = Prometheus(url)
        wait_until(lambda: bool(prom.instant('up{job="gpumon"} == 1', time.time())), 60, "first scrape",
                   prometheus, prom_log)
        start = time.time()
        duration = minutes * 60
        workdir = os.path.join(state, "simulate", "nd-h100-v5")
        print(f"gpumon on :{port}, prometheus on {url}; running {minutes:g} min", file=sys.stderr)
        for at, what, command in fault_plan(duration):
            delay = start + at - time.time()
            if delay > 0:
                time.sleep(delay)
            control(workdir, command)
            print(f"  {time.time() - start:5.0f} s  {what}", file=sys.stderr)
        remaining = start + duration - time.time()
        if remaining > 0:
            time.sleep(remaining)
        # two more rounds of scrape and rule evaluation, so the last faults are in every series
        time.sleep(2 * interval)
        tr = TimeRange(start - interval, time.time(), interval)
        failed = []
        for name, picture in PICTURES.items():
            with open(os.path.join(GRAFANA_DIR, name), encoding="utf-8") as fh:
                dashboard = json.load(fh)
            out = os.path.join(out_dir, picture)
            failed += [f"{name}: {f}" for f in render(dashboard, prom, tr, out,
                                                      note="simulated ND H100 v5, rendered by dashboards/preview.py")]
            print(f"wrote {out} ({os.path.getsize(out) // 1024} KiB)", file=sys.stderr)
        for f in failed:
            print(f"query failed: {f}", file=sys.stderr)
        return 1 if failed else 0
    finally:
        stop(prometheus)
        stop(exporter)
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true",
                        help="run a simulated host and Prometheus, inject faults, render all three dashboards")
    parser.add_argument("--prometheus", metavar="URL", help="Prometheus to query (without --simulate)")
    parser.add_argument("--dashboard", metavar="FILE", help="dashboard JSON (without --simulate)")
    parser.add_argument("--minutes", type=float, default=4.0,
                        help="with --simulate: how long to run; otherwise: the time range up to now (default 4)")
    parser.add_argument("--scrape-interval", type=float, default=15.0, metavar="S",
                        help="the Prometheus scrape interval, for $__rate_interval (default 15; --simulate: 5)")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=REGEX",
                        help="set a dashboard variable instead of All / the first value")
    parser.add_argument("--out", required=True, help="PNG file, or with --simulate a directory")
    parser.add_argument("--keep", action="store_true", help="with --simulate: keep the temporary directory")
    args = parser.parse_args(argv)
    if args.simulate:
        return simulate(args.minutes, args.out, args.keep)
    if not args.prometheus or not args.dashboard:
        parser.error("give --prometheus and --dashboard, or --simulate")
    chosen = {}
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--var {item}: expected NAME=REGEX")
        chosen[name] = value
    with open(args.dashboard, encoding="utf-8") as fh:
        dashboard = json.load(fh)
    end = time.time()
    tr = TimeRange(end - args.minutes * 60, end, args.scrape_interval)
    try:
        failed = render(dashboard, Prometheus(args.prometheus), tr, args.out, chosen)
    except (PrometheusError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for f in failed:
        print(f"query failed: {f}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

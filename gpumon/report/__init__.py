"""What ``gpumon once`` prints: a table for a person, JSON for tools, the exposition for promtool.

The table's sections for the built-in collectors are in :mod:`gpumon.report.tables`; a plugin's
collector may build its own in its class's ``summarize``.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable

from gpumon import registry
from gpumon.health.faultcodes import nhc_line
from gpumon.health.stage import Verdict, age_text
from gpumon.model import Snapshot
from gpumon.render import Renderer
from gpumon.table import Table

WIDTH = 100


def as_json(snapshot: Snapshot) -> str:
    return json.dumps(snapshot.as_dict(), indent=2, sort_keys=False)


def as_prometheus(snapshot: Snapshot) -> str:
    return Renderer().render(snapshot.families)


def format_table(table: Table, width: int = WIDTH) -> str:
    """Columns sized to their content; the last column is cut so a row never passes ``width``."""
    rows = [tuple(str(c) for c in row) for row in table.rows]
    widths = [len(c) for c in table.columns]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = [table.title]

    def line(cells: Iterable[str]) -> str:
        text = "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        return text if len(text) <= width else text[: width - 1] + "…"

    lines.append(line(table.columns))
    lines.extend(line(row) for row in rows)
    if not rows:
        lines.append("(none)")
    return "\n".join(lines)


def as_table(snapshot: Snapshot, width: int = WIDTH) -> str:
    when = dt.datetime.fromtimestamp(snapshot.time, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    parts = [f"gpumon on {snapshot.host} at {when}"]
    for status in snapshot.collectors:
        if not status.ok:
            continue
        summarize = _summarizer(status.name)
        if summarize is None:
            continue
        try:
            table = summarize(snapshot)
        except Exception as exc:  # the table is a convenience; the collector's data is still good
            table = Table(f"{status.name}: summary failed ({type(exc).__name__}: {exc})", (), ())
        if table is not None:
            parts.append(format_table(table, width))
    events = Table("Events", ("time", "severity", "kind", "subject", "message"), tuple(
        (dt.datetime.fromtimestamp(e.time, dt.timezone.utc).strftime("%H:%M:%S"), e.severity.value, e.kind,
         " ".join(f"{k}={v}" for k, v in e.subject.items()), e.message)
        for e in snapshot.events))
    parts.append(format_table(events, width))
    collectors = Table("Collectors", ("collector", "status", "time", "detail"), tuple(
        (c.name, "ok" if c.ok else ("unavailable" if not c.available else "FAILED"),
         f"{c.duration_seconds * 1000:.1f} ms" if c.ok or c.available else "-", c.error)
        for c in snapshot.collectors))
    parts.append(format_table(collectors, width))
    return "\n\n".join(parts) + "\n"


def _summarizer(name: str) -> Callable[[Snapshot], Table | None] | None:
    """The collector ``name``'s section: the report's own table function for a built-in, else the
    collector class's ``summarize`` (a plugin's hook); None when the class cannot be loaded."""
    # Imported here, not at the top: the table functions import the built-in collectors' modules
    # (their metric specs), which only ``gpumon once --format table`` needs.
    from gpumon.report import tables

    own = tables.table_for(name)
    if own is not None:
        return own
    try:
        return registry.collector_class(name).summarize
    except (registry.UnknownPlugin, registry.BrokenPlugin):
        return None


def health_json(verdict: Verdict) -> str:
    return json.dumps(verdict.as_dict(), indent=2) + "\n"


def health_nhc(verdict: Verdict, host: str) -> str:
    """``gpumon health --format nhc``: NHC's own lines, as distributed NHC collects them per host:
    ``<host> | Healthy``, or one ``ERROR:  nhc:  Health check failed:  ...`` line per finding."""
    doc = verdict.as_dict()
    if not doc["findings"]:
        return f"{host} | Healthy\n"
    return "".join(f"{host} | {nhc_line(f['rule'], f['reason'])}\n" for f in doc["findings"])


def health_table(verdict: Verdict, width: int = WIDTH) -> str:
    """``gpumon health``: the verdict in one line, then each finding and what to do about it."""
    doc = verdict.as_dict()
    head = f"{doc['status'].upper()}  action: {doc['action']}" + (f"  (held to: {doc['sku']})" if doc["sku"] else "")
    columns = ("rule", "subject", "severity", "action", "sticky", "age", "reason")

    def row(f: dict) -> tuple[str, ...]:
        age = age_text(f.get("age_seconds", 0.0)) + (" restored" if f.get("restored") else "")
        return (f["rule"], " ".join(f"{k}={v}" for k, v in f["subject"].items()) or "node", f["severity"],
                f["action"], "yes" if f["sticky"] else "no", age,
                f"{f['stale']} (was: {f['reason']})" if f.get("stale") else f["reason"])

    out = head + "\n\n" + format_table(Table("Findings", columns, tuple(row(f) for f in doc["findings"])), width)
    if doc["stale"]:
        out += ("\n\n" + format_table(Table("Stale (about hardware this host no longer has; not counted; "
                                           "'gpumon health clear RULE' removes them)", columns,
                                           tuple(row(f) for f in doc["stale"])), width))
    if any(f.get("restored") for f in doc["findings"] + doc["stale"]):
        out += ("\n\nrestored: carried over a restart of the daemon from its state directory and not seen "
                "since (a sticky verdict stays until cleared or the host reboots)")
    return out + "\n"

"""What gpumon puts out, dumped with the volatile values normalised: the guard that a restructuring
changes no series, label, help text, OTel name or unit, Azure column, dcgm-exporter name or generated doc.

For every ``--simulate`` profile: the ``gpumon once --format prometheus`` page, the dcgm-exporter
compat page, the OpenTelemetry metric each sample goes to (name, unit, instrument, attributes) and the
Azure Monitor rows (tables and columns) of one interval. Then the catalogue itself: every declared
metric with its hints, the OpenTelemetry table of docs/metrics.md, the dcgm-exporter table, the DCR
template and the column tables of docs/azure-monitor.md. Values that move with time (sample values,
timestamps, durations, process ids, temporary paths) become ``<v>``; names, label sets, HELP and TYPE
stay as they are.

    python -m tests.support.outputs_dump          # exit 1 and show the difference when the fixture is stale
    python -m tests.support.outputs_dump --write  # rewrite tests/fixtures/outputs/ from the current code

``tests/test_outputs_unchanged.py`` runs the comparison.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "outputs")
PROFILES = ("nd-h100-v5", "nd-gb200-v6", "nd-a100-v4", "nv-a10-v5", "hbv4")
HOST = "guard-host"
"""The host name every dump is made under (the simulated host's name would otherwise be this machine's)."""

V = "<v>"
PYTHON = "<python>"
_SAMPLE = re.compile(r"^([^#\s][^ ]*(?:\{.*\})?) (\S+)( \S+)?$")
_VOLATILE_LABEL = re.compile(r'((?:pid|boot_id|start_time|version|path|state_dir)="[^"]*")')


def _series(line: str) -> str:
    """A sample line with its value (and timestamp) as ``<v>``; HELP, TYPE and blank lines as they are."""
    match = _SAMPLE.match(line)
    if match is None:
        return line
    return f"{match.group(1)} {V}"


def _page(text: str) -> list[str]:
    return [_series(line) for line in text.splitlines()]


def _snapshot(profile: str) -> Any:
    """One ``gpumon once --simulate PROFILE`` collection, as ``cmd_once`` makes it (a temporary state
    directory, the health stage on), under the fixed host name."""
    from gpumon import cli, daemon

    config = cli.load_config(cli.build_parser().parse_args(["once", "--simulate", profile]))
    tmp = tempfile.mkdtemp(prefix="gpumon-guard-")
    try:
        config = config.replace("daemon", state_dir=tmp, hostname=HOST)
        ctx = daemon.make_context(config)
        plan = daemon.plan_collectors(ctx.config, ctx)
        return daemon.collect_once(config, plan, ctx, health=daemon.health_stage(config, ctx, persist=False))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plain(value: Any) -> Any:
    """An attribute or column value: strings stay (identity), numbers and times become ``<v>``."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", value):
            return V  # a row id
        if re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z?", value) or value.startswith(tempfile.gettempdir()):
            return V
        return value
    return V


def _otel(snapshot: Any) -> list[str]:
    from gpumon.sinks.otel.mapping import Identity, attributes, routes

    identity = Identity.from_families((f.name, [dict(s.labels) for s in f.samples]) for f in snapshot.families)
    out = []
    for fam in sorted(snapshot.families, key=lambda f: f.name):
        for sample in fam.samples:
            labels = dict(sample.labels)
            for metric in routes(fam.spec):
                if not metric.takes(labels):
                    continue
                attrs = {k: _plain(v) for k, v in attributes(metric, labels, identity)}
                out.append(f"{fam.name}{_braces(labels)} -> {metric.name} [{metric.unit}] {metric.kind.value} "
                           f"{json.dumps(attrs, sort_keys=True)}")
    return out


def _braces(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _azure(snapshot: Any) -> list[str]:
    from gpumon.sinks.azure_monitor.rows import RowBuilder

    rows = RowBuilder(HOST)
    now = time.monotonic()
    rows.add(snapshot, now)
    rows.add(snapshot, now + 1.0)
    out = [f"unmapped: {sorted(rows.unmapped)}"]
    for table, built in sorted(rows.close_interval(time.time(), 60.0).items()):
        for row in built:
            plain = {k: _plain(v) for k, v in row.items()}
            out.append(f"{table} {json.dumps(plain, sort_keys=True)}")
    for event in snapshot.events:
        out.append(f"event {json.dumps({k: _plain(v) for k, v in rows.event_row(event).items()}, sort_keys=True)}")
    return out


def _dcgm(snapshot: Any) -> list[str]:
    from gpumon.sinks.prometheus.dcgm_compat import DcgmCompat

    return _page(DcgmCompat(HOST).render(snapshot))


def profile_dump(profile: str) -> str:
    from gpumon import report

    snapshot = _snapshot(profile)
    sections: list[tuple[str, Callable[[], list[str]]]] = [
        ("prometheus", lambda: _page(report.as_prometheus(snapshot))),
        ("dcgm-exporter compat", lambda: _dcgm(snapshot)),
        ("opentelemetry", lambda: _otel(snapshot)),
        ("azure monitor rows", lambda: _azure(snapshot)),
        ("events", lambda: [f"{e.kind} {e.severity.value} {json.dumps(dict(e.subject), sort_keys=True)}"
                            for e in snapshot.events]),
        ("collectors", lambda: [f"{c.name} ok={c.ok} available={c.available}" for c in snapshot.collectors]),
    ]
    return _join(sections)


_RACING = re.compile(r'function\\?"?[=:] ?\\?"(nvmlEvent|nvmlDeviceRegisterEvents|nvmlDeviceGetSupportedEventTypes)')
"""NVML calls of the XID event thread, which may or may not have made them when the collection ends."""


def _join(sections: list[tuple[str, Callable[[], list[str]]]]) -> str:
    out = []
    for title, make in sections:
        out += [f"==== {title}", *(line for line in make() if not _RACING.search(line)), ""]
    text = _VOLATILE_LABEL.sub(lambda m: m.group(1).split("=")[0] + f'="{V}"', "\n".join(out))
    # gpumon_build_info names the interpreter running the dump: any supported Python gives the same
    return text.replace(f'"{platform.python_version()}"', f'"{PYTHON}"')


def _describe(spec: Any) -> list[str]:
    from gpumon.sinks.azure_monitor.rows import column_hints
    from gpumon.sinks.otel.mapping import routes

    lines = [f"{spec.name} {spec.type.value} unit={str(spec.unit)!r} labels={list(spec.labels)}", f"  help: {spec.help}"]
    for metric in routes(spec):
        lines.append(f"  otel: {metric!r}")
    for hint in column_hints([spec]):
        lines.append(f"  azure: {hint!r}")
    return lines


def _azure_generator() -> Any:
    spec = importlib.util.spec_from_file_location("gpumon_guard_azure_generate",
                                                  os.path.join(REPO, "deploy", "azure", "generate.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def catalogue_dump() -> str:
    from gpumon.confdoc import declared_specs, otel_table
    from gpumon.sinks.prometheus import dcgm_compat

    generate = _azure_generator()
    sections: list[tuple[str, Callable[[], list[str]]]] = [
        ("declared metrics", lambda: [line for spec in declared_specs() for line in _describe(spec)]),
        ("opentelemetry table (docs/metrics.md)", lambda: otel_table().splitlines()),
        ("dcgm-exporter table (docs/dcgm-exporter.md)", lambda: dcgm_compat.markdown_table().splitlines()),
        ("dcr template (deploy/azure/azuredeploy.json)", lambda: generate.render().splitlines()),
        ("column tables (docs/azure-monitor.md)", lambda: generate.render_docs_section().splitlines()),
    ]
    return _join(sections)


def dumps() -> dict[str, str]:
    """File name under tests/fixtures/outputs -> its text, from the current code."""
    out = {"catalogue.txt": catalogue_dump()}
    for profile in PROFILES:
        out[f"{profile}.txt"] = profile_dump(profile)
    return out


def differences(wanted: dict[str, str]) -> list[str]:
    """A unified diff per fixture that differs from ``wanted`` (empty: nothing changed)."""
    out = []
    for name, text in wanted.items():
        path = os.path.join(FIXTURES, name)
        try:
            with open(path, encoding="utf-8") as fh:
                old = fh.read()
        except FileNotFoundError:
            old = ""
        if old != text:
            out.append("".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                    f"fixture/{name}", f"now/{name}", n=1)))
    return out


def main(argv: list[str]) -> int:
    for key in [k for k in os.environ if k.startswith("GPUMON_")]:
        del os.environ[key]
    wanted = dumps()
    if "--write" in argv:
        os.makedirs(FIXTURES, exist_ok=True)
        for name, text in wanted.items():
            with open(os.path.join(FIXTURES, name), "w", encoding="utf-8") as fh:
                fh.write(text)
        return 0
    diffs = differences(wanted)
    for diff in diffs:
        sys.stdout.write(diff)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

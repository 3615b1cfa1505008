"""Finds collectors and sinks: the built-ins, plus any installed under the entry-point groups
``gpumon.collectors`` and ``gpumon.sinks`` (so a third party adds one without touching gpumon).

Classes are imported only when asked for, so a heavy sink SDK is never loaded unless that sink runs.
The plugin contract is enforced here, loudly: an entry point whose name is a built-in's is ignored
with an error naming it and its distribution (the built-in keeps running), and a third-party
collector that declares or returns a metric under gpumon's own ``gpumon_`` prefix is refused.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from gpumon.log_once import LogOnce

if TYPE_CHECKING:
    from gpumon.collectors.base import Collector
    from gpumon.model import Collection, MetricSpec
    from gpumon.sinks.base import Sink

log = logging.getLogger("gpumon.registry")

COLLECTORS_GROUP = "gpumon.collectors"
SINKS_GROUP = "gpumon.sinks"

RESERVED_PREFIX = "gpumon_"
"""Metric names gpumon's own collectors, self-metrics and health stage use; no plugin may emit one."""

BUILTIN_COLLECTORS: dict[str, str] = {
    "nvml": "gpumon.collectors.nvml:NvmlCollector",
    "xid": "gpumon.collectors.xid:XidCollector",
    "infiniband": "gpumon.collectors.infiniband:InfinibandCollector",
    "linkflap": "gpumon.collectors.linkflap:LinkflapCollector",
    "kmsg": "gpumon.collectors.kmsg:KmsgCollector",
    "aer": "gpumon.collectors.aer:AerCollector",
    "attribution": "gpumon.collectors.attribution:AttributionCollector",
    "azure_events": "gpumon.collectors.azure_events:AzureEventsCollector",
    "host_info": "gpumon.collectors.host_info:HostInfoCollector",
}

BUILTIN_SINKS: dict[str, str] = {
    "prometheus": "gpumon.sinks.prometheus:PrometheusSink",
    "otel": "gpumon.sinks.otel:OtelSink",
    "azure_monitor": "gpumon.sinks.azure_monitor:AzureMonitorSink",
    "remote_write": "gpumon.sinks.remote_write:RemoteWriteSink",
}

_BUILTINS = {COLLECTORS_GROUP: BUILTIN_COLLECTORS, SINKS_GROUP: BUILTIN_SINKS}


class UnknownPlugin(KeyError):
    pass


class BrokenPlugin(ImportError):
    """A plugin is registered but its module fails to import (a third-party bug, a missing file)."""


class RefusedPlugin(BrokenPlugin):
    """A plugin imports but breaks the contract (it declares a metric under gpumon's own prefix)."""


@dataclass(frozen=True)
class Conflict:
    """An entry point that cannot be used because its name is taken."""

    group: str
    name: str
    target: str
    distribution: str
    taken_by: str

    def __str__(self) -> str:
        kind = "collector" if self.group == COLLECTORS_GROUP else "sink"
        return (f"plugin '{self.name}' ({self.target}, from {self.distribution}) is ignored: "
                f"'{self.name}' is already the {kind} {self.taken_by}; rename its entry point "
                f"in group {self.group}")


_reported = LogOnce(log)
"""Entry-point conflicts and plugins' reserved families, each logged once per process."""
_plugin_classes: set[type] = set()
"""Collector classes loaded from a third party's entry point: the ones :func:`screen` checks."""
_plugin_classes_lock = threading.Lock()


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unknown distribution"
    return f"{dist.metadata['Name']} {dist.version}"


def _scan(group: str) -> tuple[dict[str, str], list[Conflict]]:
    builtins = _BUILTINS[group]
    found = dict(builtins)
    conflicts = []
    for ep in entry_points(group=group):
        if ep.name in found:
            if found[ep.name] == ep.value:
                continue  # the same target seen twice (a path listed twice on sys.path)
            owner = "built-in" if ep.name in builtins else "plugin"
            conflicts.append(Conflict(group, ep.name, ep.value, _distribution(ep),
                                      f"{owner} {found[ep.name]}"))
            continue
        found[ep.name] = ep.value
    return found, conflicts


def _targets(group: str) -> dict[str, str]:
    found, conflicts = _scan(group)
    for conflict in conflicts:
        _reported.error(conflict, "%s", conflict)
    return found


def conflicts() -> list[Conflict]:
    """Every entry point ignored because its name is taken, for ``gpumon check``."""
    return _scan(COLLECTORS_GROUP)[1] + _scan(SINKS_GROUP)[1]


def _load(target: str):
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:
        raise BrokenPlugin(f"{target}: {type(exc).__name__}: {exc}") from exc


def _installed(target: str) -> bool:
    """Built-ins another part of the code base has not landed yet are simply not offered."""
    module = target.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # a.b whose parent a is missing raises; let _load report it as broken
        return True


def is_builtin(name: str) -> bool:
    """Whether the collector ``name`` is one of gpumon's own (a plugin cannot take a built-in's name)."""
    return name in BUILTIN_COLLECTORS


def reserved(spec: MetricSpec | str) -> bool:
    """Whether a metric name is gpumon's own to use."""
    name = spec if isinstance(spec, str) else spec.name
    return name.startswith(RESERVED_PREFIX)


def _refusal(plugin: str, names: list[str]) -> str:
    return (f"collector plugin '{plugin}' declares {', '.join(sorted(names))}: the "
            f"'{RESERVED_PREFIX}' prefix is gpumon's own (its collectors, self-metrics and health "
            f"series); name the plugin's metrics after the plugin")


def _checked_collector(name: str, cls: type[Collector]) -> type[Collector]:
    try:
        declared = list(cls.metrics())
    except Exception as exc:
        raise BrokenPlugin(f"collector plugin '{name}': metrics() raised {type(exc).__name__}: {exc}") from exc
    clashing = [spec.name for spec in declared if reserved(spec)]
    if clashing:
        raise RefusedPlugin(_refusal(name, clashing))
    return cls


def collector_class(name: str) -> type[Collector]:
    """The collector's class. A third-party one whose declared metrics use gpumon's own prefix
    raises :class:`RefusedPlugin`; one that does not import raises :class:`BrokenPlugin`."""
    targets = _targets(COLLECTORS_GROUP)
    if name not in targets or not _installed(targets[name]):
        raise UnknownPlugin(name)
    cls = _load(targets[name])
    if is_builtin(name):
        return cls
    _checked_collector(name, cls)
    with _plugin_classes_lock:
        _plugin_classes.add(cls)
    return cls


def sink_class(name: str) -> type[Sink]:
    """The sink's class. Sink modules import their SDK lazily, so this is cheap."""
    targets = _targets(SINKS_GROUP)
    if name not in targets or not _installed(targets[name]):
        raise UnknownPlugin(name)
    return _load(targets[name])


def available_collectors() -> list[str]:
    targets = _targets(COLLECTORS_GROUP)
    return sorted(n for n, t in targets.items() if _installed(t))


def available_sinks() -> list[str]:
    targets = _targets(SINKS_GROUP)
    return sorted(n for n, t in targets.items() if _installed(t))


def screen(collector: Collector, result: Collection) -> Collection:
    """A third-party collector's run without the families it returned under gpumon's own prefix
    (one it did not declare; a declared one is refused at load). Each dropped family is counted as
    the collector's ``reserved_metric_name`` error and logged once. A collector not loaded from an
    entry point (a built-in, one a test builds) passes untouched."""
    if type(collector) not in _plugin_classes:
        return result
    name = collector.name
    kept = []
    for fam in result.families:
        if not reserved(fam.spec):
            kept.append(fam)
            continue
        result.count_error("reserved_metric_name")
        _reported.error(("screened", name, fam.name), "%s; its samples are dropped",
                        _refusal(name, [fam.name]).replace("declares", "returned"))
    result.families = kept
    return result

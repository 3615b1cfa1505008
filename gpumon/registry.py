"""Finds collectors and sinks: the built-ins, plus any installed under the entry-point groups
``gpumon.collectors`` and ``gpumon.sinks`` (so a third party adds one without touching gpumon).

Classes are imported only when asked for, so a heavy sink SDK is never loaded unless that sink runs.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumon.collectors.base import Collector
    from gpumon.sinks.base import Sink

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


class UnknownPlugin(KeyError):
    pass


class BrokenPlugin(ImportError):
    """A plugin is registered but its module fails to import (a third-party bug, a missing file)."""


def _targets(group: str, builtins: dict[str, str]) -> dict[str, str]:
    found = dict(builtins)
    for ep in entry_points(group=group):
        found.setdefault(ep.name, ep.value)
    return found


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


def collector_class(name: str) -> type[Collector]:
    targets = _targets("gpumon.collectors", BUILTIN_COLLECTORS)
    if name not in targets or not _installed(targets[name]):
        raise UnknownPlugin(name)
    return _load(targets[name])


def sink_class(name: str) -> type[Sink]:
    """The sink's class. Sink modules import their SDK lazily, so this is cheap."""
    targets = _targets("gpumon.sinks", BUILTIN_SINKS)
    if name not in targets or not _installed(targets[name]):
        raise UnknownPlugin(name)
    return _load(targets[name])


def available_collectors() -> list[str]:
    targets = _targets("gpumon.collectors", BUILTIN_COLLECTORS)
    return sorted(n for n, t in targets.items() if _installed(t))


def available_sinks() -> list[str]:
    targets = _targets("gpumon.sinks", BUILTIN_SINKS)
    return sorted(n for n, t in targets.items() if _installed(t))

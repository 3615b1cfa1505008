"""Everything a third-party collector or sink imports: the one public module of the plugin contract.

A collector subclasses :class:`Collector`, declares its metrics (:class:`MetricSpec`) and returns one
:class:`Collection` per ``collect()``; a sink subclasses :class:`Sink` and turns each
:class:`Snapshot` into its wire format. Both are registered under the entry-point groups
``gpumon.collectors`` and ``gpumon.sinks``. Names imported from here keep working across releases;
gpumon's other modules are its own business. ``docs/architecture.md`` shows a complete plugin.
"""

from __future__ import annotations

from gpumon import registry
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.config import Config, ConfigError, Option, Section, SectionSchema
from gpumon.model import (
    AzureInstance,
    Collection,
    CollectorStatus,
    Event,
    HostIdentity,
    Labels,
    MetricFamily,
    MetricSpec,
    MetricType,
    Sample,
    Severity,
    Snapshot,
    StateReason,
)
from gpumon.sinks.base import CheckResult, Sink, SinkContext, SinkDependencyMissing, SinkHealth
from gpumon.table import Table

COLLECTOR_GROUP = registry.COLLECTORS_GROUP
"""The entry-point group a collector is registered under: ``name = "package.module:Class"``."""
SINK_GROUP = registry.SINKS_GROUP
"""The entry-point group a sink is registered under."""

__all__ = [
    "COLLECTOR_GROUP",
    "SINK_GROUP",
    "Availability",
    "AzureInstance",
    "CheckResult",
    "Collection",
    "Collector",
    "CollectorStatus",
    "CollectorUnavailable",
    "Config",
    "ConfigError",
    "Context",
    "Event",
    "HostIdentity",
    "Labels",
    "MetricFamily",
    "MetricSpec",
    "MetricType",
    "Option",
    "Sample",
    "Section",
    "SectionSchema",
    "Severity",
    "StateReason",
    "Sink",
    "SinkContext",
    "SinkDependencyMissing",
    "SinkHealth",
    "Snapshot",
    "Table",
]

"""The one data model every collector produces and every sink reads.

Collectors return :class:`Collection` objects; the loop folds the latest good one of each collector
into an immutable :class:`Snapshot`. Nothing here knows about a wire format.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpumon.catalogue.hints import AzureHint, OtelMetric  # pure types, importing nothing of gpumon

Labels = tuple[tuple[str, str], ...]
"""Label pairs in a fixed order: hashable, so renderers can cache per-series text."""

_LABEL_SETS: dict[tuple[tuple[str, ...], tuple[str, ...]], Labels] = {}
_LABEL_SETS_MAX = 8192


def label_set(names: tuple[str, ...], values: tuple[str, ...]) -> Labels:
    """The label pairs of ``names`` and ``values``, the same tuple each time they are asked for: a
    series that comes back run after run then compares (loop, renderer, sinks) by identity rather
    than pair by pair, and its pairs are not built again. Bounded: a churning label set (process
    ids) cannot grow it; it starts again when full. Safe from any thread (one dict operation each)."""
    key = (names, values)
    labels = _LABEL_SETS.get(key)
    if labels is None:
        if len(_LABEL_SETS) >= _LABEL_SETS_MAX:
            _LABEL_SETS.clear()
        labels = _LABEL_SETS[key] = tuple(zip(names, values))
    return labels


class MetricType(str, enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    INFO = "info"


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class StateReason(str, enum.Enum):
    """Why a collector is not ok: the ``reason`` label of ``gpumon_collector_state``, a fixed
    vocabulary so a label never carries free text (paths, error codes) that would multiply series.
    Given where the failure is raised (``Availability.cause``, ``CollectorUnavailable.cause``)."""

    NONE = "none"
    """Goes with ``ok``."""
    NO_SOURCE = "no_source"
    """The host has no such source (no GPUs, no HCA, no AER statistics)."""
    LIBRARY_NOT_FOUND = "library_not_found"
    DRIVER_NOT_LOADED = "driver_not_loaded"
    NO_PERMISSION = "no_permission"
    INIT_FAILED = "init_failed"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ERROR = "error"
    """Anything else, and what a plugin that gives no cause raises."""


@dataclass(frozen=True)
class MetricSpec:
    """What a metric is. ``name`` is the exposed Prometheus name: counters end in ``_total``,
    info metrics in ``_info`` (value 1, identity in the labels).

    ``unit`` is the Prometheus unit word; gpumon's own metrics (:mod:`gpumon.catalogue`) give a
    :class:`gpumon.catalogue.units.Unit`, a word that carries its UCUM code for OpenTelemetry, and a
    plugin's may give a plain word. ``otel`` and ``azure`` are the hints a sink needs to map it
    (:mod:`gpumon.catalogue.hints`): the OpenTelemetry metric(s) it maps to and the Log Analytics
    columns it fills. Without them the sink's generic mapping applies (a mechanical OTel name;
    generic ``GpuMonMetrics_CL`` rows). They do not take part in equality."""

    name: str
    type: MetricType
    help: str
    unit: str = ""
    labels: tuple[str, ...] = ()
    otel: tuple[OtelMetric, ...] = field(default=(), compare=False, repr=False)
    azure: tuple[AzureHint, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.type is MetricType.COUNTER and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end in _total")
        if self.type is MetricType.INFO and not self.name.endswith("_info"):
            raise ValueError(f"info metric {self.name!r} must end in _info")

    def sample(self, value: float, *label_values: str) -> Sample:
        """A sample with this spec's labels, values given in ``labels`` order."""
        if len(label_values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {label_values}")
        return Sample(label_set(self.labels, label_values), float(value))


class Sample(NamedTuple):
    labels: Labels
    value: float

    def label(self, name: str) -> str | None:
        for key, value in self.labels:
            if key == name:
                return value
        return None


@dataclass(frozen=True)
class MetricFamily:
    spec: MetricSpec
    samples: tuple[Sample, ...]

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Event:
    """Something that happened once (a flap, an XID): logged, and sent by sinks that carry events."""

    kind: str
    severity: Severity
    subject: Mapping[str, str]
    message: str
    attributes: Mapping[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "kind": self.kind,
            "severity": self.severity.value,
            "subject": dict(self.subject),
            "message": self.message,
            "attributes": dict(self.attributes),
        }


@dataclass
class Collection:
    """One run of one collector: its samples, the events it saw, and the faults it counted.

    ``errors`` maps a short reason (``"parse"``, ``"read"``, ``"nvml_not_supported"``) to how many
    times it happened in this run; the loop keeps the running totals.
    """

    families: list[MetricFamily] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, spec: MetricSpec, samples: Iterable[Sample]) -> None:
        samples = tuple(samples)
        if samples:
            self.families.append(MetricFamily(spec, samples))

    def count_error(self, reason: str, n: int = 1) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + n


@dataclass(frozen=True)
class CollectorStatus:
    name: str
    ok: bool
    duration_seconds: float
    error: str = ""
    available: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "duration_seconds": self.duration_seconds,
            "error": self.error or None,
        }


@dataclass(frozen=True)
class AzureInstance:
    """The VM's IMDS compute metadata (api-version 2021-02-01 keys), as data: what the identity
    provider learns and every consumer of the host identity reads."""

    vm_id: str
    vm_size: str
    location: str
    name: str
    resource_id: str
    vmss_name: str = ""
    aks: bool = False
    zone: str = ""
    subscription_id: str = ""
    resource_group: str = ""
    placement_group_id: str = ""
    platform_fault_domain: str = ""

    @classmethod
    def from_compute(cls, doc: dict) -> AzureInstance:
        tags = doc.get("tagsList") or []
        aks = any(t.get("name", "").startswith("aks-managed") for t in tags if isinstance(t, dict))
        return cls(
            vm_id=str(doc.get("vmId", "")),
            vm_size=str(doc.get("vmSize", "")),
            location=str(doc.get("location", "")),
            name=str(doc.get("name", "")),
            resource_id=str(doc.get("resourceId", "")),
            vmss_name=str(doc.get("vmScaleSetName", "")),
            aks=aks or str(doc.get("resourceGroupName", "")).upper().startswith("MC_"),
            zone=str(doc.get("zone", "")),
            subscription_id=str(doc.get("subscriptionId", "")),
            resource_group=str(doc.get("resourceGroupName", "")),
            placement_group_id=str(doc.get("placementGroupId", "")),
            platform_fault_domain=str(doc.get("platformFaultDomain", "")),
        )


@dataclass(frozen=True)
class HostIdentity:
    """Who this host is, as the identity provider (``gpumon.identity``) last learnt it; the loop
    stamps it on every Snapshot, so the sinks and the health stage read it instead of asking IMDS.

    ``asked``: the provider has looked at least once (before that nothing is known, not even
    absence). ``instance``: IMDS's answer (None: none yet, or none here). ``off_azure``: nothing
    answers at the IMDS address. ``physical_host``: the Hyper-V KVP pool's PhysicalHostName."""

    instance: AzureInstance | None = None
    physical_host: str = ""
    asked: bool = False
    off_azure: bool = False

    def vm_size(self) -> str | None:
        """The VM size; "" off Azure (the health baseline); None while unknown (no answer yet, or a
        failure that is not "off Azure": asked again)."""
        if self.instance is not None:
            return self.instance.vm_size
        return "" if self.off_azure else None


@dataclass(frozen=True)
class Snapshot:
    """Everything sinks see at one moment. ``events`` holds only events new since the last snapshot.
    ``identity``: the host identity the loop stamped (None on a snapshot built without a loop)."""

    host: str
    time: float
    families: tuple[MetricFamily, ...]
    events: tuple[Event, ...]
    collectors: tuple[CollectorStatus, ...]
    seq: int = 0
    identity: HostIdentity | None = None

    def family(self, name: str) -> MetricFamily | None:
        for fam in self.families:
            if fam.name == name:
                return fam
        return None

    def as_dict(self) -> dict[str, Any]:
        """The ``gpumon once --format json`` shape of the interface contract."""
        return {
            "host": self.host,
            "time": self.time,
            "metrics": [
                {
                    "name": fam.spec.name,
                    "type": fam.spec.type.value,
                    "unit": fam.spec.unit,
                    "help": fam.spec.help,
                    "samples": [{"labels": dict(s.labels), "value": s.value} for s in fam.samples],
                }
                for fam in self.families
            ],
            "events": [e.as_dict() for e in self.events],
            "collectors": [c.as_dict() for c in self.collectors],
        }

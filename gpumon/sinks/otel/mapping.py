"""How a gpumon (Prometheus-named) metric becomes an OpenTelemetry metric.

A spec's ``otel`` hint (:mod:`gpumon.catalogue`), on its declaration, says which OpenTelemetry
hardware semantic convention a metric maps to (``hw.gpu.utilization``, ``hw.network.io`` ...).
Everything else is mapped mechanically: ``gpumon_<domain>_<rest>[_<unit>][_total]`` becomes
``gpumon.<domain>.<rest>`` with a UCUM unit derived from the spec's unit, so a metric a collector adds
tomorrow still exports correctly. Pure data and string work: nothing here imports the OpenTelemetry
SDK, nor a collector (the docs table is made from the declared metrics by :mod:`gpumon.confdoc`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpumon.catalogue import gpu as gpu_metrics
from gpumon.catalogue import infiniband as ib_metrics
from gpumon.catalogue.hints import Domain, Kind, OtelMetric
from gpumon.catalogue.lookup import otel_hints
from gpumon.catalogue.units import Unit
from gpumon.model import MetricSpec, MetricType

__all__ = ["Domain", "Kind", "OtelMetric", "routes", "resolve", "attributes", "markdown_table"]

GPU_INFO = gpu_metrics.INFO_SPEC.name
IB_PORT_INFO = ib_metrics.SPEC_INFO.name

# Label values renamed where the attribute has a convention of its own.
VALUE_MAPS: dict[str, dict[str, str]] = {
    "network.io.direction": {"rx": "receive", "tx": "transmit", "receive": "receive", "transmit": "transmit"},
    "hw.gpu.task": {"gpu": "general"},
    # nvmlDeviceGetTemperatureThreshold: slowdown is where the GPU throttles, shutdown where it powers off
    "hw.limit_type": {"shutdown": "high.critical", "slowdown": "throttled", "gpu_max": "max",
                      "memory_max": "max"},
}
VALUE_FORMATS: dict[tuple[str, str], str] = {
    ("xid", "error.type"): "xid_{}",
}
_THRESHOLD_SENSOR = {"memory_max": "memory"}
"""The sensor a temperature threshold belongs to, where it is not the GPU die's."""

# A plugin's unit word -> UCUM (gpumon's own metrics carry theirs: catalogue.units.Unit). Anything
# else becomes an annotation ``{word}``.
UNITS: dict[str, str] = {
    "bytes": "By",
    "seconds": "s",
    "watts": "W",
    "joules": "J",
    "celsius": "Cel",
    "hertz": "Hz",
    "ratio": "1",
    "volts": "V",
    "amperes": "A",
    "percent": "%",
    "bytes_per_second": "By/s",
    "bytes_per_sec": "By/s",
    "packets": "{packet}",
    "errors": "{error}",
    "events": "{event}",
    "ticks": "{tick}",
}

# Name suffixes that state the unit; stripped from the mechanical name (the unit says it).
_UNIT_SUFFIXES = ("bytes_per_second", "bytes", "seconds", "watts", "joules", "celsius", "hertz", "ratio",
                  "volts", "amperes", "percent")


def ucum(spec: MetricSpec) -> str:
    """The UCUM unit of ``spec``: its typed unit's (every metric of gpumon's declares one, so nothing is
    guessed from its name); for a plugin's plain unit word, that word in UCUM (``bytes`` -> ``By``,
    else ``{word}``), and without one ``{info}``, ``{event}`` (a counter) or ``{count}``. The
    conventions keep ``1`` for fractions; a count is ``{thing}``, which the OTLP -> Prometheus
    translation leaves out of the name."""
    if isinstance(spec.unit, Unit):
        return spec.unit.ucum
    word = spec.unit.strip().lower()
    if word:
        if word in UNITS:
            return UNITS[word]
        if word.startswith("{") or word in ("1", "By", "s", "W", "J", "Cel", "Hz", "By/s"):
            return spec.unit.strip()
        return "{" + word + "}"
    if spec.type is MetricType.INFO:
        return "{info}"
    return "{event}" if spec.type is MetricType.COUNTER else "{count}"


def mechanical_name(name: str) -> str:
    """``gpumon_ib_port_symbol_errors_total`` -> ``gpumon.ib.port_symbol_errors``."""
    stem = name.removeprefix("gpumon_").removesuffix("_total")
    for suffix in _UNIT_SUFFIXES:
        if stem.endswith("_" + suffix) and len(stem) > len(suffix) + 1:
            stem = stem[: -len(suffix) - 1]
            break
    domain, _, rest = stem.partition("_")
    return f"gpumon.{domain}.{rest}" if rest else f"gpumon.{domain}"


def _domain_for(spec: MetricSpec) -> Domain:
    labels = set(spec.labels)
    if "uuid" in labels:
        return Domain.GPU
    if {"device", "port"} <= labels:
        return Domain.NETWORK
    return Domain.NONE


_KIND = {MetricType.GAUGE: Kind.GAUGE, MetricType.COUNTER: Kind.COUNTER, MetricType.INFO: Kind.GAUGE}


def routes(spec: MetricSpec) -> tuple[OtelMetric, ...]:
    """Every OpenTelemetry metric ``spec``'s samples go to: its ``otel`` hints, else the mechanical one."""
    explicit = otel_hints(spec)
    if explicit:
        return explicit
    return (OtelMetric(mechanical_name(spec.name), ucum(spec), _KIND[spec.type],
                       _domain_for(spec)),)


def resolve(spec: MetricSpec) -> OtelMetric:
    """The main OpenTelemetry metric for ``spec`` (the first of its routes)."""
    return routes(spec)[0]


# Identity labels of the _info series -> hw.* attributes.
_GPU_INFO_ATTRS = (
    ("model", "hw.model"), ("name", "hw.model"),
    ("driver_version", "hw.driver_version"), ("driver", "hw.driver_version"),
    ("vbios_version", "hw.firmware_version"), ("vbios", "hw.firmware_version"),
    ("serial", "hw.serial_number"), ("serial_number", "hw.serial_number"),
)
_IB_INFO_ATTRS = (
    ("hca_type", "hw.model"), ("board_id", "hw.model"), ("model", "hw.model"),
    ("fw_version", "hw.firmware_version"), ("fw_ver", "hw.firmware_version"),
    ("firmware", "hw.firmware_version"),
    ("firmware_version", "hw.firmware_version"),
    # the node GUID names the adapter the way a WWNN does (the convention's example)
    ("node_guid", "hw.network.physical_address"),
)


@dataclass
class Identity:
    """hw.* attributes per GPU and per IB port, gathered from the ``_info`` series of one snapshot."""

    gpus: dict[str, tuple[tuple[str, str], ...]]
    ports: dict[tuple[str, str], tuple[tuple[str, str], ...]]

    @classmethod
    def from_families(cls, families: Iterable[tuple[str, Iterable[Mapping[str, str]]]]) -> Identity:
        gpus: dict[str, tuple[tuple[str, str], ...]] = {}
        ports: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
        for name, label_sets in families:
            if name == GPU_INFO:
                for labels in label_sets:
                    key = labels.get("uuid") or labels.get("gpu", "")
                    gpus[key] = _pick(labels, _GPU_INFO_ATTRS)
            elif name == IB_PORT_INFO:
                for labels in label_sets:
                    ports[(labels.get("device", ""), labels.get("port", ""))] = _pick(labels, _IB_INFO_ATTRS)
        return cls(gpus, ports)


def _pick(labels: Mapping[str, str], table: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {}
    for label, attr in table:
        value = labels.get(label)
        if value and attr not in out:
            out[attr] = value
    return tuple(out.items())


_GPU_IDENTITY = ("gpu", "uuid")
_PORT_IDENTITY = ("device", "port")


def gpu_id(labels: Mapping[str, str]) -> str:
    """A GPU's hw.id: its UUID (stable across reboots and re-enumeration), else ``gpu<index>``."""
    return labels.get("uuid") or f"gpu{labels.get('gpu', '')}"


def port_id(labels: Mapping[str, str]) -> str:
    """An RDMA port's hw.id: ``<device>:<port>``."""
    return f"{labels.get('device', '')}:{labels.get('port', '')}"


def _join_attributes(domain: Domain, labels: Mapping[str, str]) -> dict[str, Any]:
    """What a gpumon.* point needs to join the hw.* series of its GPU or port: hw.id and hw.type, and
    ``direction`` in the convention's ``network.io.direction`` values. Its own labels stay."""
    out: dict[str, Any] = {}
    for key, value in labels.items():
        if key == "direction":
            out["network.io.direction"] = VALUE_MAPS["network.io.direction"].get(value, value)
        else:
            out[key] = value
    if domain is Domain.GPU:
        out["hw.id"], out["hw.type"] = gpu_id(labels), "gpu"
    elif domain is Domain.NETWORK:
        out["hw.id"], out["hw.type"] = port_id(labels), "network"
    return out


def _component_attributes(domain: Domain, labels: Mapping[str, str], identity: Identity) -> dict[str, Any]:
    """hw.id, hw.type, hw.name (and the _info series' hw.* facts) of the component a point describes."""
    out: dict[str, Any] = {}
    if domain is Domain.NETWORK:
        device, port = labels.get("device", ""), labels.get("port", "")
        out["hw.id"] = port_id(labels)
        out["hw.type"] = "network"
        out["hw.name"] = f"{device} port {port}"
        if device.startswith("mlx"):
            out["hw.vendor"] = "NVIDIA"
        out.update(identity.ports.get((device, port), ()))
        return out
    index, uuid, parent = labels.get("gpu", ""), labels.get("uuid", ""), gpu_id(labels)
    if domain is Domain.GPU_TEMPERATURE:
        sensor = labels.get("sensor") or _THRESHOLD_SENSOR.get(labels.get("threshold", ""), "gpu")
        out["hw.id"] = f"{parent}:temperature:{sensor}"
        out["hw.type"] = "temperature"
        out["hw.name"] = f"gpu{index} {sensor} temperature"
        out["hw.parent"] = parent
        out["hw.sensor_location"] = sensor
    elif domain is Domain.GPU_FAN:
        out["hw.id"] = f"{parent}:fan"
        out["hw.type"] = "fan"
        out["hw.name"] = f"gpu{index} fan"
        out["hw.parent"] = parent
    else:
        out["hw.id"] = parent
        out["hw.type"] = "gpu"
        out["hw.name"] = f"gpu{index}"
        out["hw.vendor"] = "NVIDIA"
        out.update(identity.gpus.get(uuid) or identity.gpus.get(index) or ())
    return out


PROCESS_PID = os.getpid()

HOLDER_ATTRIBUTES = (("namespace", "k8s.namespace.name"), ("pod", "k8s.pod.name"),
                     ("container", "k8s.container.name"), ("job_id", "gpumon.job.id"))
"""Attribution label -> attribute: the Kubernetes semantic conventions, and gpumon's own for the job."""
HOLDER_LABELS = frozenset(label for label, _ in HOLDER_ATTRIBUTES)


def holder_attributes(values: Mapping[str, Any]) -> dict[str, str]:
    """Who holds a GPU, as attributes; empty values are left out, so an unheld GPU's series keep the
    identity they have without attribution. A container with no pod is a container id read from a
    cgroup (no kubelet): ``container.id``, not a Kubernetes name."""
    out = {attr: str(values[label]) for label, attr in HOLDER_ATTRIBUTES if values.get(label)}
    if "k8s.container.name" in out and "k8s.pod.name" not in out:
        out["container.id"] = out.pop("k8s.container.name")
    return out


def attributes(metric: OtelMetric, labels: Mapping[str, str], identity: Identity) -> tuple[tuple[str, Any], ...]:
    """The point attributes for one sample: hw.* identity for semantic-convention metrics; the
    Prometheus labels plus hw.id / hw.type for the rest (so they join the hw.* series and still join
    on ``gpu``/``uuid``/``device``/``port``)."""
    selected = {k for k, _ in metric.select}
    holders: dict[str, str] = {}
    if "gpu" in labels and not HOLDER_LABELS.isdisjoint(labels):
        holders = holder_attributes(labels)
        selected |= HOLDER_LABELS
    labels = {k: v for k, v in labels.items() if k not in selected}
    if metric.domain is Domain.PROCESS:
        out: dict[str, Any] = {**labels, "process.pid": PROCESS_PID}
    elif not metric.semconv:
        out = _join_attributes(metric.domain, labels)
        if metric.label_map:
            out.update(_renamed(metric, labels))
            for key, _ in metric.label_map:
                out.pop(key, None)
    elif metric.domain is Domain.NONE:
        out = dict(labels)
    else:
        identity_labels = _PORT_IDENTITY if metric.domain is Domain.NETWORK else _GPU_IDENTITY
        out = _component_attributes(metric.domain, labels, identity)
        renamed = dict(metric.label_map)
        out.update((k, v) for k, v in labels.items() if k not in renamed and k not in identity_labels)
        out.update(_renamed(metric, labels))
    out.update(metric.attributes)
    out.update(holders)
    return tuple(out.items())


def _renamed(metric: OtelMetric, labels: Mapping[str, str]) -> dict[str, str]:
    """The labels that have a convention, under the convention's name and values."""
    out = {}
    for label, attr in metric.label_map:
        if label in labels:
            value = labels[label]
            fmt = VALUE_FORMATS.get((label, attr))
            out[attr] = fmt.format(value) if fmt else VALUE_MAPS.get(attr, {}).get(value, value)
    return out


# ---------------------------------------------------------------------------------------- the docs table
_MD_CELL = re.compile(r"\|")


def markdown_table(specs: Iterable[MetricSpec]) -> str:
    """The Prometheus -> OpenTelemetry mapping as a Markdown table, for ``docs/metrics.md``: one row per
    route, so a metric split by a label value has a row for each name."""
    rows = ["| Prometheus | OpenTelemetry | Instrument | Unit | Attributes |", "|---|---|---|---|---|"]
    seen: set[str] = set()
    for spec in sorted(specs, key=lambda s: s.name):
        if spec.name in seen:
            continue
        seen.add(spec.name)
        for metric in routes(spec):
            attrs = describe_attributes(metric, spec)
            rows.append(f"| `{spec.name}`{_describe_select(metric)} | `{metric.name}` | "
                        f"{_instrument(metric)} | `{metric.unit}` | {_MD_CELL.sub('/', attrs)} |")
    return "\n".join(rows)


def _describe_select(metric: OtelMetric) -> str:
    picks = [f"`{k}={v}`" for k, v in metric.select] + [f"`{k}!={v}`" for k, v in metric.exclude]
    return f" ({', '.join(picks)})" if picks else ""


def _instrument(metric: OtelMetric) -> str:
    text = {
        Kind.GAUGE: "Gauge",
        Kind.COUNTER: "Counter (cumulative monotonic sum)",
        Kind.UPDOWN: "UpDownCounter (cumulative sum)",
        Kind.STATUS: "UpDownCounter (cumulative sum), one point per `hw.state`",
        Kind.STATUS_INVERTED: "UpDownCounter (cumulative sum), one point per `hw.state`",
    }[metric.kind]
    return text + (", one point per `cpu.mode`" if metric.cpu_modes else "")


_DOMAIN_DOC = {
    Domain.GPU: "`hw.type=gpu`, `hw.id`=uuid, `hw.name`, `hw.vendor`, `hw.model` ...",
    Domain.GPU_TEMPERATURE: "`hw.type=temperature`, `hw.id`=uuid:temperature:sensor, `hw.parent`=uuid, "
                            "`hw.sensor_location`",
    Domain.GPU_FAN: "`hw.type=fan`, `hw.id`=uuid:fan, `hw.parent`=uuid",
    Domain.NETWORK: "`hw.type=network`, `hw.id`=device:port, `hw.name`, `hw.model`, "
                    "`hw.network.physical_address` ...",
    Domain.PROCESS: "`process.pid`",
}
_JOIN_DOC = {Domain.GPU: "`hw.type=gpu`, `hw.id`=uuid", Domain.NETWORK: "`hw.type=network`, `hw.id`=device:port"}


def describe_attributes(metric: OtelMetric, spec: MetricSpec) -> str:
    parts: list[str] = []
    if metric.semconv or metric.domain is Domain.PROCESS:
        parts.append(_DOMAIN_DOC.get(metric.domain, ""))
        identity = {"gpu", "uuid"} if metric.domain in (Domain.GPU, Domain.GPU_TEMPERATURE, Domain.GPU_FAN) else (
            {"device", "port"} if metric.domain is Domain.NETWORK else set())
    else:
        parts.append(_JOIN_DOC.get(metric.domain, ""))
        identity = set()
    parts.extend(f"`{k}={v}`" for k, v in metric.attributes)
    renamed = dict(metric.label_map)
    if not metric.semconv:
        renamed.setdefault("direction", "network.io.direction")
    selected = {k for k, _ in metric.select}
    if "gpu" in spec.labels:
        renamed.update((k, v) for k, v in HOLDER_ATTRIBUTES if k in spec.labels)
    for label in spec.labels:
        if label in identity or label in selected or f"`{renamed.get(label)}`" in parts[0]:
            continue
        parts.append(f"`{renamed[label]}` (from `{label}`)" if label in renamed else f"`{label}`")
    if metric.kind in (Kind.STATUS, Kind.STATUS_INVERTED):
        parts.append("`hw.state` (ok, failed)")
    if metric.cpu_modes:
        parts.append("`cpu.mode` (user, system)")
    return ", ".join(p for p in parts if p) or "-"


"""How a gpumon (Prometheus-named) metric becomes an OpenTelemetry metric.

One table keyed by the Prometheus name says which OpenTelemetry hardware semantic convention a
metric maps to (``hw.gpu.utilization``, ``hw.network.io`` ...). Everything else is mapped
mechanically: ``gpumon_<domain>_<rest>[_<unit>][_total]`` becomes ``gpumon.<domain>.<rest>`` with a
UCUM unit derived from the spec's unit, so a metric a collector adds tomorrow still exports
correctly. Pure data and string work: nothing here imports the OpenTelemetry SDK.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpumon.model import MetricSpec, MetricType


class Kind(str, enum.Enum):
    """The OpenTelemetry instrument a metric is exported as."""

    GAUGE = "gauge"
    """Gauge data points."""
    COUNTER = "counter"
    """Cumulative, monotonic Sum."""
    UPDOWN = "updowncounter"
    """Cumulative, non-monotonic Sum (hw.gpu.memory.usage, hw.network.up ...)."""
    STATUS = "status"
    """A 0/1 health gauge exported as ``hw.status`` (non-monotonic Sum): one point per ``hw.state``."""
    STATUS_INVERTED = "status_inverted"
    """As STATUS, from a gauge that is 1 when the component failed (``gpumon_gpu_lost``)."""


class Domain(str, enum.Enum):
    """Which hardware component a series describes, so the right hw.* attributes are attached."""

    NONE = ""
    GPU = "gpu"
    GPU_TEMPERATURE = "gpu_temperature"
    NETWORK = "network"


@dataclass(frozen=True)
class OtelMetric:
    """The OpenTelemetry side of one Prometheus metric."""

    name: str
    unit: str
    kind: Kind
    domain: Domain = Domain.NONE
    attributes: tuple[tuple[str, str], ...] = ()
    """Fixed attributes added to every point (``network.io.direction=receive``)."""
    label_map: tuple[tuple[str, str], ...] = ()
    """Prometheus label -> attribute name, for labels that have a convention (``xid`` -> ``error.type``)."""
    description: str = ""
    """Used instead of the spec's help where several Prometheus metrics share one OpenTelemetry name."""
    semconv: bool = False


GPU_INFO = "gpumon_gpu_info"
IB_PORT_INFO = "gpumon_ib_port_info"

_RX = (("network.io.direction", "receive"),)
_TX = (("network.io.direction", "transmit"),)
_ERRORS_DESC = "Errors encountered by the hardware component."

# The explicit part of the mapping. Several Prometheus metrics may share an OpenTelemetry name as long
# as their attributes tell their points apart (received/transmitted -> one hw.network.io).
TABLE: dict[str, OtelMetric] = {
    # GPU: hw.gpu.* and the common hw.* metrics with hw.type=gpu
    "gpumon_gpu_utilization_ratio": OtelMetric(
        "hw.gpu.utilization", "1", Kind.GAUGE, Domain.GPU, label_map=(("engine", "hw.gpu.task"),),
        description="Fraction of time the GPU's engines were busy (hw.gpu.task: general, encoder, decoder).",
        semconv=True),
    "gpumon_gpu_memory_used_bytes": OtelMetric(
        "hw.gpu.memory.usage", "By", Kind.UPDOWN, Domain.GPU, semconv=True),
    "gpumon_gpu_memory_total_bytes": OtelMetric(
        "hw.gpu.memory.limit", "By", Kind.UPDOWN, Domain.GPU, semconv=True),
    "gpumon_gpu_pcie_bytes_total": OtelMetric(
        "hw.gpu.io", "By", Kind.COUNTER, Domain.GPU, label_map=(("direction", "network.io.direction"),),
        semconv=True),
    "gpumon_gpu_power_watts": OtelMetric("hw.power", "W", Kind.GAUGE, Domain.GPU, semconv=True),
    "gpumon_gpu_energy_joules_total": OtelMetric("hw.energy", "J", Kind.COUNTER, Domain.GPU, semconv=True),
    "gpumon_gpu_temperature_celsius": OtelMetric(
        "hw.temperature", "Cel", Kind.GAUGE, Domain.GPU_TEMPERATURE,
        label_map=(("sensor", "hw.sensor_location"),), semconv=True),
    "gpumon_gpu_xid_errors_total": OtelMetric(
        "hw.errors", "{error}", Kind.COUNTER, Domain.GPU, label_map=(("xid", "error.type"),),
        description=_ERRORS_DESC, semconv=True),
    "gpumon_gpu_ecc_errors_total": OtelMetric(
        "hw.errors", "{error}", Kind.COUNTER, Domain.GPU, label_map=(("type", "error.type"),),
        description=_ERRORS_DESC, semconv=True),
    "gpumon_gpu_pcie_replay_total": OtelMetric(
        "hw.errors", "{error}", Kind.COUNTER, Domain.GPU, (("error.type", "pcie_replay"),),
        description=_ERRORS_DESC, semconv=True),
    "gpumon_gpu_lost": OtelMetric("hw.status", "1", Kind.STATUS_INVERTED, Domain.GPU, semconv=True,
                                  description="Operational status of the component, one point per hw.state."),
    # InfiniBand ports: hw.network.* and the common hw.* metrics with hw.type=network
    "gpumon_ib_port_data_received_bytes_total": OtelMetric(
        "hw.network.io", "By", Kind.COUNTER, Domain.NETWORK, _RX,
        description="Bytes received and transmitted by the port.", semconv=True),
    "gpumon_ib_port_data_transmitted_bytes_total": OtelMetric(
        "hw.network.io", "By", Kind.COUNTER, Domain.NETWORK, _TX,
        description="Bytes received and transmitted by the port.", semconv=True),
    "gpumon_ib_port_packets_received_total": OtelMetric(
        "hw.network.packets", "{packet}", Kind.COUNTER, Domain.NETWORK, _RX,
        description="Packets received and transmitted by the port.", semconv=True),
    "gpumon_ib_port_packets_transmitted_total": OtelMetric(
        "hw.network.packets", "{packet}", Kind.COUNTER, Domain.NETWORK, _TX,
        description="Packets received and transmitted by the port.", semconv=True),
    "gpumon_ib_port_up": OtelMetric("hw.network.up", "1", Kind.UPDOWN, Domain.NETWORK, semconv=True),
    "gpumon_ib_port_rate_bytes_per_second": OtelMetric(
        "hw.network.bandwidth.limit", "By/s", Kind.UPDOWN, Domain.NETWORK, semconv=True),
    # The process_* self-metrics, in the process.* semantic conventions
    "process_cpu_seconds_total": OtelMetric("process.cpu.time", "s", Kind.COUNTER, semconv=True),
    "process_resident_memory_bytes": OtelMetric("process.memory.usage", "By", Kind.UPDOWN, semconv=True),
    "process_virtual_memory_bytes": OtelMetric("process.memory.virtual", "By", Kind.UPDOWN, semconv=True),
    "process_open_fds": OtelMetric(
        "process.unix.file_descriptor.count", "{file_descriptor}", Kind.UPDOWN, semconv=True),
}

# The IB PMA error counters: hw.errors with hw.type=network, told apart by error.type (and direction).
for _stem, _etype, _direction in (
    ("symbol_errors", "symbol", ""),
    ("receive_errors", "receive", "receive"),
    ("receive_remote_physical_errors", "remote_physical", "receive"),
    ("receive_switch_relay_errors", "switch_relay", "receive"),
    ("receive_constraint_errors", "constraint", "receive"),
    ("transmit_constraint_errors", "constraint", "transmit"),
    ("local_link_integrity_errors", "local_link_integrity", ""),
    ("excessive_buffer_overrun_errors", "excessive_buffer_overrun", ""),
):
    TABLE[f"gpumon_ib_port_{_stem}_total"] = OtelMetric(
        "hw.errors", "{error}", Kind.COUNTER, Domain.NETWORK,
        (("error.type", _etype),) + ((("network.io.direction", _direction),) if _direction else ()),
        description=_ERRORS_DESC, semconv=True)

# Label values renamed where the attribute has a convention of its own.
VALUE_MAPS: dict[str, dict[str, str]] = {
    "network.io.direction": {"rx": "receive", "tx": "transmit", "receive": "receive", "transmit": "transmit"},
    "hw.gpu.task": {"gpu": "general"},
}
VALUE_FORMATS: dict[tuple[str, str], str] = {
    ("xid", "error.type"): "xid_{}",
    ("type", "error.type"): "ecc_{}",
}

# Prometheus/spec unit words -> UCUM. Anything else becomes an annotation ``{word}``.
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
# Words that, ending a unit-less counter's name, say what is counted.
_COUNT_WORDS = {"errors": "{error}", "error": "{error}", "packets": "{packet}", "events": "{event}",
                "flaps": "{flap}", "resets": "{reset}", "retries": "{retry}", "drops": "{packet}",
                "discards": "{packet}", "calls": "{call}",
                "dropped": "{packet}", "downed": "{event}", "recoveries": "{event}"}


def ucum(unit: str, name: str = "", kind: MetricType | None = None) -> str:
    """The UCUM unit for a spec's unit word (``bytes`` -> ``By``); unit-less counters get ``{thing}``."""
    word = unit.strip().lower()
    if word:
        if word in UNITS:
            return UNITS[word]
        if word.startswith("{") or word in ("1", "By", "s", "W", "J", "Cel", "Hz", "By/s"):
            return unit.strip()
        return "{" + word + "}"
    stem = name.removesuffix("_total")
    for suffix in _UNIT_SUFFIXES:
        if stem.endswith("_" + suffix):
            return UNITS[suffix]
    if kind is MetricType.COUNTER:
        return _COUNT_WORDS.get(stem.rsplit("_", 1)[-1], "1")
    return "1"


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


def resolve(spec: MetricSpec) -> OtelMetric:
    """The OpenTelemetry metric for ``spec``: the table's entry, else the mechanical mapping."""
    explicit = TABLE.get(spec.name)
    if explicit is not None:
        return explicit
    return OtelMetric(
        mechanical_name(spec.name), ucum(spec.unit, spec.name, spec.type), _KIND[spec.type], Domain.NONE
    )


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


def attributes(metric: OtelMetric, labels: Mapping[str, str], identity: Identity) -> tuple[tuple[str, str], ...]:
    """The point attributes for one sample: hw.* identity for semantic-convention metrics, the
    Prometheus labels unchanged for the rest (so ``gpu``/``uuid``/``device``/``port`` still join)."""
    if metric.domain is Domain.NONE:
        out = dict(labels)
    else:
        renamed = dict(metric.label_map)
        identity_labels = _PORT_IDENTITY if metric.domain is Domain.NETWORK else _GPU_IDENTITY
        out = {}
        if metric.domain is Domain.NETWORK:
            device, port = labels.get("device", ""), labels.get("port", "")
            out["hw.id"] = f"{device}:{port}"
            out["hw.type"] = "network"
            out["hw.name"] = f"{device} port {port}"
            if device.startswith("mlx"):
                out["hw.vendor"] = "NVIDIA"
            out.update(identity.ports.get((device, port), ()))
        else:
            index, uuid = labels.get("gpu", ""), labels.get("uuid", "")
            gpu_id = uuid or f"gpu{index}"
            info = dict(identity.gpus.get(uuid) or identity.gpus.get(index) or ())
            if metric.domain is Domain.GPU_TEMPERATURE:
                sensor = labels.get("sensor") or dict(metric.attributes).get("hw.sensor_location", "gpu")
                out["hw.id"] = f"{gpu_id}:temperature:{sensor}"
                out["hw.type"] = "temperature"
                out["hw.name"] = f"gpu{index} {sensor} temperature"
                out["hw.parent"] = gpu_id
            else:
                out["hw.id"] = gpu_id
                out["hw.type"] = "gpu"
                out["hw.name"] = f"gpu{index}"
                out["hw.vendor"] = "NVIDIA"
                out.update(info)
        for key, value in labels.items():
            if key in renamed:
                attr = renamed[key]
                fmt = VALUE_FORMATS.get((key, attr))
                out[attr] = fmt.format(value) if fmt else VALUE_MAPS.get(attr, {}).get(value, value)
            elif key not in identity_labels:
                out[key] = value
    out.update(metric.attributes)
    return tuple(out.items())


# ---------------------------------------------------------------------------------------- the docs table
_MD_CELL = re.compile(r"\|")


def markdown_table(specs: Iterable[MetricSpec]) -> str:
    """The Prometheus -> OpenTelemetry mapping as a Markdown table, for ``docs/metrics.md``."""
    rows = ["| Prometheus | OpenTelemetry | Instrument | Unit | Attributes |", "|---|---|---|---|---|"]
    seen: set[str] = set()
    for spec in sorted(specs, key=lambda s: s.name):
        if spec.name in seen:
            continue
        seen.add(spec.name)
        metric = resolve(spec)
        attrs = describe_attributes(metric, spec)
        rows.append(f"| `{spec.name}` | `{metric.name}` | {_instrument(metric.kind)} | `{metric.unit}` | "
                    f"{_MD_CELL.sub('/', attrs)} |")
    return "\n".join(rows)


def _instrument(kind: Kind) -> str:
    return {
        Kind.GAUGE: "Gauge",
        Kind.COUNTER: "Counter (cumulative monotonic sum)",
        Kind.UPDOWN: "UpDownCounter (cumulative sum)",
        Kind.STATUS: "UpDownCounter (cumulative sum), one point per `hw.state`",
        Kind.STATUS_INVERTED: "UpDownCounter (cumulative sum), one point per `hw.state`",
    }[kind]


def describe_attributes(metric: OtelMetric, spec: MetricSpec) -> str:
    parts: list[str] = []
    if metric.domain is Domain.GPU:
        parts.append("`hw.type=gpu`, `hw.id`=uuid, `hw.name`, `hw.vendor`, `hw.model` ...")
    elif metric.domain is Domain.GPU_TEMPERATURE:
        parts.append("`hw.type=temperature`, `hw.id`, `hw.parent`=uuid")
    elif metric.domain is Domain.NETWORK:
        parts.append("`hw.type=network`, `hw.id`=device:port, `hw.name`, `hw.model` ...")
    parts.extend(f"`{k}={v}`" for k, v in metric.attributes)
    identity = {"gpu", "uuid"} if metric.domain in (Domain.GPU, Domain.GPU_TEMPERATURE) else (
        {"device", "port"} if metric.domain is Domain.NETWORK else set())
    renamed = dict(metric.label_map)
    for label in spec.labels:
        if label in identity:
            continue
        parts.append(f"`{renamed[label]}` (from `{label}`)" if label in renamed else f"`{label}`")
    if metric.kind in (Kind.STATUS, Kind.STATUS_INVERTED):
        parts.append("`hw.state` (ok, failed)")
    return ", ".join(parts) or "-"


def declared_specs() -> list[MetricSpec]:
    """Every metric the installed collectors and the daemon's self-metrics declare."""
    from gpumon import registry, selfmetrics

    specs: dict[str, MetricSpec] = {s.name: s for s in selfmetrics.SPECS}
    for name in registry.available_collectors():
        try:
            cls = registry.collector_class(name)
        except (ImportError, registry.UnknownPlugin):  # a plugin that does not import is not documented
            continue
        for spec in cls.metrics():
            specs.setdefault(spec.name, spec)
    return sorted(specs.values(), key=lambda s: s.name)


if __name__ == "__main__":  # python -m gpumon.sinks.otel_mapping > table.md: the table in docs/metrics.md
    print(markdown_table(declared_specs()))

"""dcgm-exporter's names, served beside gpumon's own (``[prometheus] compat = "dcgm-exporter"``).

People moving from dcgm-exporter have dashboards and alert rules written against ``DCGM_FI_*``.
This module turns a Snapshot's gpumon families into dcgm-exporter's default counter set
(:mod:`gpumon.catalogue.dcgm`: ``etc/default-counters.csv`` of NVIDIA/dcgm-exporter) with its
units (MHz, C, W, mJ, %, MiB), its labels (``gpu``, ``UUID``, ``pci_bus_id``, ``device`` =
``nvidia<N>``, ``modelName``, ``Hostname``, ``DCGM_FI_DRIVER_VERSION``; ``namespace``/``pod``/
``container`` or ``hpc_job`` when attributed), and its
semantics where they differ from gpumon's (``DCGM_FI_DEV_XID_ERRORS`` is the last XID seen, with
``err_code``). The table is data in the catalogue: one row per DCGM field, naming the gpumon metric it comes from.

MIG, as dcgm-exporter 4.5.3-4.8.2 (commit d5e5f51) serves it with its default ``--devices f``
(pkg/cmd/app.go: "monitor all GPU instances in MIG mode, all GPUs if MIG mode is disabled";
internal/pkg/devicemonitoring/device_monitoring.go, monitorAllGPUInstances): a GPU with MIG
instances has no series of its own, one per GPU instance instead, labelled ``GPU_I_PROFILE`` (the
instance's profile, DCGM_FI_DEV_NAME of the instance: internal/pkg/deviceinfo/device_info.go,
populateMigProfileNames) and ``GPU_I_ID`` (NVML's GPU instance id, NvmlInstanceId:
internal/pkg/collector/gpu_collector.go, toMetric), placed after ``modelName``
(internal/pkg/rendermetrics/render_metrics.go). Device-wide fields (clocks, temperatures, power,
energy, PCIe, NVLink, remapped rows, XID) repeat the GPU's value on each instance (issues #317 and
PR #736 show ``DCGM_FI_DEV_MEMORY_TEMP``/``GPU_TEMP`` so); framebuffer and profiling fields are the
instance's own; ``DCGM_FI_DEV_*_UTIL`` are blank under MIG and so absent (issues #50, #105). Pods
and jobs are matched to the instance they hold (internal/pkg/transformation/hpc.go: files named
``<GPU>.<GPU_I_ID>``; collector/types.go GetIDOfType).

Rendered as text on its own (dcgm-exporter's counters do not end in ``_total``, which gpumon's
model requires), appended to the Prometheus page.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpumon.attribution_labels import ALLOCATION_FAMILY
from gpumon.catalogue.dcgm import FIELDS, MIB, XID_FIELD, XID_HELP, XID_SOURCE, Field
from gpumon.catalogue.gpu import INFO_SPEC, MIG_INFO
from gpumon.model import MetricFamily, Sample, Snapshot
from gpumon.render import escape_help, format_value, series_prefix

Key = tuple[str, str]
"""One series' entity: the GPU index and its GPU instance id ("" for a whole GPU)."""
Values = dict[Key, tuple[float, tuple[tuple[str, str], ...]]]


@dataclass(frozen=True)
class _Entity:
    """The identity labels dcgm-exporter puts on every series of one GPU (or GPU instance), in its order."""

    labels: tuple[tuple[str, str], ...]
    owners: tuple[tuple[tuple[str, str], ...], ...]  # one label set per pod or job holding it


class DcgmCompat:
    """Renders the dcgm-exporter families of a snapshot; keeps the last XID per GPU between calls."""

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        self._xid_totals: dict[tuple[str, str], float] = {}
        self._last_xid: dict[str, int] = {}

    def render(self, snapshot: Snapshot) -> str:
        by_name = {fam.name: fam for fam in snapshot.families}
        entities = self._entities(by_name)
        if not entities:
            return ""
        self._track_xids(by_name.get(XID_SOURCE.name))
        parts: list[str] = []
        for spec in FIELDS:
            per_gpu = _values(by_name.get(spec.source.name), spec)
            per_instance = _instance_values(by_name, spec)
            values: Values = {}
            for key in entities:
                gpu, gi = key
                if not gi or spec.scope == "gpu":
                    if gpu in per_gpu:
                        values[key] = (per_gpu[gpu], ())
                elif key in per_instance:
                    values[key] = (per_instance[key], ())
            if values:
                parts.append(self._family(spec.name, spec.type, spec.help, values, entities))
        xids: Values = {}
        for key in entities:
            code = self._last_xid.get(key[0], 0)
            xids[key] = (float(code), (("err_code", str(code)),))
        parts.append(self._family(XID_FIELD, "gauge", XID_HELP, xids, entities))
        return "".join(parts)

    def _family(self, name: str, kind: str, help_text: str, values: Values, entities: Mapping[Key, _Entity]) -> str:
        lines = [f"# HELP {name} {escape_help(help_text)}\n# TYPE {name} {kind}\n"]
        for key, (value, extra) in values.items():
            ident = entities[key]
            for owner in ident.owners or ((),):
                lines.append(series_prefix(name, ident.labels + extra + owner) + format_value(value) + "\n")
        return "".join(lines) if len(lines) > 1 else ""

    def _entities(self, by_name: Mapping[str, MetricFamily]) -> dict[Key, _Entity]:
        """A GPU without MIG instances is one entity; a GPU with them is one entity per GPU instance
        (dcgm-exporter's default ``--devices f``), labelled ``GPU_I_PROFILE`` and ``GPU_I_ID``."""
        info = by_name.get(INFO_SPEC.name)
        if info is None:
            return {}
        owners = _owners(by_name.get(ALLOCATION_FAMILY))
        instances = _instances(by_name.get(MIG_INFO.name))
        out: dict[Key, _Entity] = {}
        for sample in info.samples:
            lab = dict(sample.labels)
            gpu = lab.get("gpu", "")
            head = (("gpu", gpu), ("UUID", lab.get("uuid", "")), ("pci_bus_id", lab.get("pci_bus_id", "")),
                    ("device", f"nvidia{gpu}"), ("modelName", lab.get("model", "")))
            tail = (("Hostname", self.hostname), ("DCGM_FI_DRIVER_VERSION", lab.get("driver_version", "")))
            # MIG on with no GPU instance yet is served as a whole GPU, as dcgm-exporter's flex mode
            # does (device_monitoring.go: "If the GPU Instance count is 0 ... adding GPU")
            if gpu not in instances:
                out[(gpu, "")] = _Entity(head + tail, tuple(owners.get((gpu, ""), ())))
                continue
            for gi, profile in sorted(instances[gpu].items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
                mig = (("GPU_I_PROFILE", profile), ("GPU_I_ID", gi))
                out[(gpu, gi)] = _Entity(head + mig + tail, tuple(owners.get((gpu, gi), ())))
        return out

    def _track_xids(self, fam: MetricFamily | None) -> None:
        """The last XID per GPU: the one whose count went up (the highest code when several did,
        or at the first look, when the order is unknown)."""
        if fam is None:
            return
        risen: dict[str, int] = {}
        for sample in fam.samples:
            gpu, xid = sample.label("gpu") or "", sample.label("xid") or ""
            key = (gpu, xid)
            if sample.value > self._xid_totals.get(key, 0.0) and xid.isdigit():
                risen[gpu] = max(risen.get(gpu, -1), int(xid))
            self._xid_totals[key] = sample.value
        self._last_xid.update(risen)


def _values(fam: MetricFamily | None, spec: Field) -> dict[str, float]:
    """Per GPU index: the field's value (scaled, summed over ``sum_over``)."""
    if fam is None:
        return {}
    out: dict[str, float] = {}
    summed: set[tuple[str, str]] = set()
    for sample in fam.samples:
        if not _matches(sample, spec.match):
            continue
        gpu = sample.label("gpu")
        if gpu is None:
            continue
        if spec.sum_over:
            # with [attribution] labels on, a GPU's series come once per holder: count each part once
            part = (gpu, sample.label(spec.sum_over) or "")
            if part not in summed:
                summed.add(part)
                out[gpu] = out.get(gpu, 0.0) + sample.value * spec.scale
        else:
            out.setdefault(gpu, sample.value * spec.scale)
    return out


def _per_instance(fam: MetricFamily | None, match: Iterable[tuple[str, str]] = ()) -> dict[Key, float]:
    """Per (GPU, GPU instance): the first matching sample (the instance's compute instances share
    its memory and GPM answers per GPU instance)."""
    out: dict[Key, float] = {}
    for sample in fam.samples if fam is not None else ():
        if _matches(sample, match):
            out.setdefault((sample.label("gpu") or "", sample.label("gpu_instance") or ""), sample.value)
    return out


def _instance_values(by_name: Mapping[str, MetricFamily], spec: Field) -> dict[Key, float]:
    """Per GPU instance: the field's value from gpumon's MIG series (scaled), if it has one."""
    if spec.mig_source is None:
        return {}
    values = _per_instance(by_name.get(spec.mig_source.name), spec.mig_match)
    minus = _per_instance(by_name.get(spec.mig_minus.name)) if spec.mig_minus is not None else {}
    return {key: (value - minus.get(key, 0.0)) * spec.scale for key, value in values.items()
            if not spec.mig_minus or key in minus}


def _instances(fam: MetricFamily | None) -> dict[str, dict[str, str]]:
    """Per GPU index: its GPU instances and their profiles, from ``gpumon_gpu_mig_info``."""
    out: dict[str, dict[str, str]] = {}
    for sample in fam.samples if fam is not None else ():
        gpu, gi = sample.label("gpu") or "", sample.label("gpu_instance") or ""
        if gi:
            out.setdefault(gpu, {}).setdefault(gi, sample.label("profile") or "")
    return out


def _matches(sample: Sample, match: Iterable[tuple[str, str]]) -> bool:
    return all(sample.label(k) == v for k, v in match)


def _owners(fam: MetricFamily | None) -> dict[Key, list[tuple[tuple[str, str], ...]]]:
    """Who holds each GPU (or GPU instance), as dcgm-exporter labels it: ``pod``/``namespace``/
    ``container`` for Kubernetes, ``hpc_job`` for a job (one series per holder, as dcgm-exporter
    copies them)."""
    out: dict[Key, list[tuple[tuple[str, str], ...]]] = {}
    if fam is None:
        return out
    for sample in fam.samples:
        lab = dict(sample.labels)
        key = (lab.get("gpu", ""), lab.get("gpu_instance", ""))
        owner: tuple[tuple[str, str], ...]
        if lab.get("pod"):
            owner = (("pod", lab["pod"]), ("namespace", lab.get("namespace", "")),
                     ("container", lab.get("container", "")))
        elif lab.get("job_id"):
            owner = (("hpc_job", lab["job_id"]),)
        else:
            continue
        if owner not in out.setdefault(key, []):
            out[key].append(owner)
    return out


def markdown_table() -> str:
    """The name-by-name table of docs/dcgm-exporter.md (kept in sync by a test)."""
    rows = ["| dcgm-exporter | type | gpumon source | conversion | under MIG, per GPU instance |",
            "|---|---|---|---|---|"]
    for f in FIELDS:
        conversion = {1.0: "as is", 1e-6: "Hz to MHz", 1000.0: "J to mJ", 100.0: "ratio to %",
                      1 / MIB: "bytes to MiB"}.get(f.scale, f"x {f.scale:g}")
        if f.sum_over:
            conversion += f", summed over `{f.sum_over}`"
        rows.append(f"| `{f.name}` | {f.type} | {_source(f.source.name, f.match)} | {conversion} | {_under_mig(f)} |")
    rows.append(f"| `{XID_FIELD}` | gauge | `{XID_SOURCE.name}` | the last XID whose count rose "
                "(0 before any), label `err_code` | the GPU's, on each instance |")
    return "\n".join(rows) + "\n"


def _source(family: str, match: Iterable[tuple[str, str]]) -> str:
    labels = ", ".join(f'{k}="{v}"' for k, v in match)
    return f"`{family}{{{labels}}}`" if labels else f"`{family}`"


def _under_mig(f: Field) -> str:
    """The table's MIG column: where a GPU instance's value comes from."""
    if f.scope == "gpu":
        return "the GPU's, on each instance"
    if f.mig_source is None:
        return "absent"
    source = _source(f.mig_source.name, f.mig_match)
    return f"{source} minus `{f.mig_minus.name}`" if f.mig_minus is not None else source


if __name__ == "__main__":  # python -m gpumon.sinks.prometheus.dcgm_compat: the table in docs/dcgm-exporter.md
    print(markdown_table(), end="")

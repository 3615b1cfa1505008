"""Who holds a GPU, put where a reader needs it: on per-GPU series, on GPU events, in sink columns.

The attribution collector publishes one ``gpumon_gpu_allocation_info`` series per holder. Users of
dcgm-exporter expect ``namespace``/``pod``/``container`` on every GPU series instead (``[attribution]
labels = true``), and an XID event is only actionable when it names the job it hit. These functions
derive both from the snapshot's allocation family; they are pure (the caches below only remember
earlier answers) and know no collector, so the loop and any sink can call them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence

from gpumon.catalogue import host as host_metrics
from gpumon.model import Event, Labels, MetricFamily, MetricSpec, Sample

ALLOCATION_FAMILY = host_metrics.ALLOCATION.name
"""The attribution collector's join series (declared in the catalogue)."""
LABELS = ("namespace", "pod", "container", "job_id")
"""The attribution labels, in the order they are appended to a series."""
_UNHELD: Labels = tuple((name, "") for name in LABELS)
_MEMO_LIMIT = 50_000
"""Label sets remembered per allocation set; a bound, never reached by a real host (about 2,500)."""


@dataclasses.dataclass(frozen=True)
class Holding:
    """One holder of a GPU: the MIG GPU instance it holds ("" for the whole GPU) and its labels."""

    gpu_instance: str
    labels: Labels


class Holders:
    """The allocation set of one snapshot, indexed by GPU, with the answers already computed for it."""

    def __init__(self, allocation: MetricFamily | None) -> None:
        by_gpu: dict[str, list[Holding]] = {}
        for sample in allocation.samples if allocation is not None else ():
            gpu = sample.label("gpu")
            if gpu is None:
                continue
            labels = tuple((name, sample.label(name) or "") for name in LABELS)
            by_gpu.setdefault(gpu, []).append(Holding(sample.label("gpu_instance") or "", labels))
        self.by_gpu: dict[str, tuple[Holding, ...]] = {g: tuple(h) for g, h in by_gpu.items()}
        self._series: dict[Labels, tuple[Labels, ...]] = {}
        self._families: dict[int, tuple[MetricFamily, MetricFamily]] = {}

    def of(self, gpu: str, gpu_instance: str | None = None) -> tuple[Holding, ...]:
        """Who holds ``gpu``; with a MIG ``gpu_instance``, its holders and the whole GPU's."""
        held = self.by_gpu.get(gpu, ())
        if not gpu_instance:
            return held
        return tuple(h for h in held if h.gpu_instance in (gpu_instance, ""))

    def copies(self, labels: Labels) -> tuple[Labels, ...]:
        """The label sets one per-GPU series becomes: one per distinct holder, or one unheld."""
        found = self._series.get(labels)
        if found is None:
            gi = gpu = None
            for key, value in labels:
                if key == "gpu":
                    gpu = value
                elif key == "gpu_instance":
                    gi = value
            suffixes = dict.fromkeys(h.labels for h in self.of(gpu or "", gi)) or {_UNHELD: None}
            found = tuple(labels + suffix for suffix in suffixes)
            if len(self._series) >= _MEMO_LIMIT:
                self._series.clear()
            self._series[labels] = found
        return found

    def relabelled(self, families: Sequence[MetricFamily]) -> tuple[MetricFamily, ...]:
        """``families`` with the attribution labels on the per-GPU ones. The loop hands the same
        family object again until its collector runs anew: the answer of the last call is reused."""
        previous, now = self._families, {}
        out = []
        for fam in families:
            if not _per_gpu(fam):
                out.append(fam)
                continue
            known = previous.get(id(fam))
            if known is None or known[0] is not fam:
                known = (fam, MetricFamily(_spec_with_labels(fam.spec), tuple(
                    Sample(copy, s.value) for s in fam.samples for copy in self.copies(s.labels))))
            now[id(fam)] = known
            out.append(known[1])
        self._families = now
        return tuple(out)


_lock = threading.Lock()
_cache: dict[tuple[Sample, ...], Holders] = {}
_specs: dict[MetricSpec, MetricSpec] = {}


def holders(allocation: MetricFamily | None) -> Holders:
    """The :class:`Holders` of an allocation set, built once per distinct set (a few are kept)."""
    key = allocation.samples if allocation is not None else ()
    with _lock:
        found = _cache.get(key)
        if found is None:
            if len(_cache) >= 4:
                _cache.pop(next(iter(_cache)))
            found = _cache[key] = Holders(allocation)
        return found


def _spec_with_labels(spec: MetricSpec) -> MetricSpec:
    found = _specs.get(spec)
    if found is None or found.otel is not spec.otel or found.azure is not spec.azure:  # hints: no part of ==
        found = _specs[spec] = dataclasses.replace(spec, labels=spec.labels + LABELS)
    return found


def _per_gpu(family: MetricFamily) -> bool:
    """Whether ``family`` describes GPUs (has a ``gpu`` label) and does not name holders already."""
    if family.name == ALLOCATION_FAMILY or any(name in family.spec.labels for name in LABELS):
        return False
    if "gpu" in family.spec.labels:
        return True
    return bool(family.samples) and family.samples[0].label("gpu") is not None


def relabel(families: Sequence[MetricFamily], allocation: MetricFamily | None) -> tuple[MetricFamily, ...]:
    """``[attribution] labels = true``: every per-GPU family gets ``namespace``, ``pod``, ``container``
    and ``job_id``, one copy of a series per holder of its GPU (of its MIG instance where the series
    has a ``gpu_instance``), empty for a GPU nobody holds. Other families are returned as they are."""
    return holders(allocation).relabelled(families)


def joined(held: Iterable[Holding]) -> dict[str, str]:
    """The holders as one value per label, comma-joined in holder order (the i-th entry of every
    label is the i-th holder); a label no holder has is left out."""
    rows = list(dict.fromkeys(h.labels for h in held))
    out = {}
    for i, name in enumerate(LABELS):
        values = [row[i][1] for row in rows]
        if any(values):
            out[name] = ",".join(values)
    return out


def enrich(events: Sequence[Event], allocation: MetricFamily | None) -> tuple[Event, ...]:
    """Events about a GPU (a ``gpu`` in their subject) get the holders' ``namespace``, ``pod``,
    ``container`` and ``job_id`` as attributes and at the end of their message; events about a
    GPU nobody holds, about no GPU, or already enriched are returned as they are."""
    index = holders(allocation)
    return tuple(_enriched(event, index) for event in events)


def _enriched(event: Event, index: Holders) -> Event:
    gpu = event.subject.get("gpu")
    if gpu is None or any(name in event.attributes for name in LABELS):
        return event
    values = joined(index.of(str(gpu), event.subject.get("gpu_instance")))
    if not values:
        return event
    return dataclasses.replace(event, attributes={**event.attributes, **values},
                               message=f"{event.message} ({_describe(values)})")


def _describe(values: Mapping[str, str]) -> str:
    return " ".join(f"{name}={value}" for name, value in values.items())

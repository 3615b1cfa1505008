"""PCIe AER error counters of every GPU and RDMA HCA PCI function and of the bridges above them.

Reads ``aer_dev_{correctable,nonfatal,fatal}`` (and a root port's ``aer_rootport_total_err_*``) through
:mod:`gpumon.sources.pci_aer`. Series are few by default: the three totals per function, and a per-type
series only once that type has counted (``per_type``). Functions are labelled with ``pci_bus_id`` in
NVML's form (``00000000:3B:00.0``, as ``gpumon_gpu_info`` has it) so the GPU's series join on it, and an
HCA also with ``device`` as the InfiniBand series have it. A host without AER (no files) is
unavailable, not failing; one bad file costs its own values, counted and logged once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from gpumon.catalogue.host import (
    AER_BY_TYPE as BY_TYPE,
)
from gpumon.catalogue.host import (
    AER_ROOT as ROOT,
)
from gpumon.catalogue.host import (
    AER_TOTAL as TOTAL,
)
from gpumon.catalogue.host import (
    PCI_FUNCTION_INFO as INFO,
)
from gpumon.collectors.base import Availability, Collector, Context
from gpumon.config import Option, Section, SectionSchema
from gpumon.log_once import COUNTED, LogOnce
from gpumon.model import Collection, MetricSpec, Sample, StateReason
from gpumon.sources import pci_aer
from gpumon.sources.ib_sysfs import Fault, read_mode_cached
from gpumon.sources.pci import nvml_bus_id

log = logging.getLogger("gpumon.collectors.aer")

REDISCOVER = 3600.0
"""Seconds between walks of the PCI tree (a hot-plugged VF shows up within this)."""



@dataclass(frozen=True)
class AerSettings:
    interval: float
    per_type: str


OPTIONS = SectionSchema(
    "aer",
    "PCIe AER counters of the GPUs, HCAs and the PCIe switch ports above them.",
    (
        Option("interval", float, 0.0, "Seconds between reads; 0 uses [daemon] interval.", min=0.0, max=3600.0),
        Option("per_type", str, "nonzero",
               "Per-type series: nonzero (only types that have counted), all, or none.",
               choices=("nonzero", "all", "none")),
    ),
    AerSettings,
)


class AerCollector(Collector):
    name = "aer"
    description = "PCIe AER error counters of GPUs, HCAs and the bridges above them."
    options = OPTIONS
    settings: AerSettings

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        self._functions: list[pci_aer.Reader] = []
        self._discovered = -REDISCOVER
        self.cached = read_mode_cached("auto", ctx.sysfs_root)
        """Keep each file open and pread it: on a real sysfs, where a file is never replaced."""
        self._log_once = LogOnce(log, suffix=COUNTED)

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (TOTAL, BY_TYPE, ROOT, INFO)

    def probe(self) -> Availability:
        functions = pci_aer.discover(self.ctx.sysfs_root)
        if not functions:
            return Availability(False, "no NVIDIA GPU or RDMA HCA PCI function under "
                                f"{os.path.join(self.ctx.sysfs_root, 'bus', 'pci', 'devices')}",
                                cause=StateReason.NO_SOURCE)
        if not any(pci_aer.has_aer(f) for f in functions):
            return Availability(False, "no AER statistics (kernel without CONFIG_PCIEAER, or functions "
                                "without the AER capability)", cause=StateReason.NO_SOURCE)
        return Availability(True)

    def _watched(self) -> list[pci_aer.Reader]:
        now = time.monotonic()
        if now - self._discovered >= REDISCOVER:
            self.close()
            self._functions = [pci_aer.Reader(f, self.cached) for f in pci_aer.discover(self.ctx.sysfs_root)
                               if pci_aer.has_aer(f)]
            self._discovered = now
        return self._functions

    def close(self) -> None:
        for reader in self._functions:
            reader.close()
        self._functions = []

    def collect(self) -> Collection:
        out = Collection()
        totals: list[Sample] = []
        types: list[Sample] = []
        roots: list[Sample] = []
        info: list[Sample] = []
        vanished = False
        for reader in self._watched():
            try:
                stats, root = reader.read()
            except (Fault, pci_aer.BadStats) as exc:
                vanished = vanished or (isinstance(exc, Fault) and exc.reason == "vanished")
                self._fault(out, reader.fn, exc)
                continue
            if reader.samples is None or reader.changed:
                reader.samples = self._samples(reader.fn, stats, root)
            f_info, f_totals, f_types, f_roots = reader.samples
            info.append(f_info)
            totals += f_totals
            types += f_types
            roots += f_roots
        if vanished:
            self._discovered = -REDISCOVER  # a function went away: walk the tree again next run
        out.add(TOTAL, totals)
        out.add(BY_TYPE, types)
        out.add(ROOT, roots)
        out.add(INFO, info)
        return out

    def _samples(self, fn: pci_aer.Function, stats: dict[str, dict[str, int]],
                 root: dict[str, int]) -> tuple[Sample, list[Sample], list[Sample], list[Sample]]:
        """One function's samples (info, totals, per type, root port), made again only when one of
        its files changed."""
        labels = (nvml_bus_id(fn.name), fn.role, fn.device)
        info = INFO.sample(1, *labels, nvml_bus_id(fn.parent) if fn.parent else "", fn.name)
        totals: list[Sample] = []
        types: list[Sample] = []
        for severity, counts in stats.items():
            total = counts.get(pci_aer.TOTALS[severity])
            if total is not None:
                totals.append(TOTAL.sample(total, *labels, severity))
            types.extend(BY_TYPE.sample(n, *labels, severity, name) for name, n in counts.items()
                         if name != pci_aer.TOTALS[severity] and self._keep(n))
        roots = [ROOT.sample(n, labels[0], severity) for severity, n in root.items()]
        return info, totals, types, roots

    def _keep(self, count: int) -> bool:
        return self.settings.per_type == "all" or (self.settings.per_type == "nonzero" and count > 0)

    def _fault(self, out: Collection, fn: pci_aer.Function, exc: Exception) -> None:
        reason = "parse" if isinstance(exc, pci_aer.BadStats) else "read"
        out.count_error(reason)
        self._log_once.warning((fn.name, reason), "AER of %s: %s", fn.name, exc)

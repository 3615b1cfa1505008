"""Which Azure VM this is and where it sits: ``gpumon_host_info`` from IMDS compute metadata and the
Hyper-V KVP pool.

Placement is what a fleet operator groups by when something goes wrong on several hosts at once:
the same placement group (one InfiniBand fabric), fault domain, or physical host. IMDS gives size,
region, zone, scale set, placement group and fault domain (cached by the shared client, re-read every
``[azure] compute_refresh``); the physical host's name only the KVP pool has. Either alone is enough
for the series; neither makes the collector unavailable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpumon import imds
from gpumon.catalogue.host import (
    HOST_INFO as INFO,
)
from gpumon.catalogue.host import (
    HOST_LABELS as LABELS,
)
from gpumon.collectors.base import Availability, Collector, Context
from gpumon.config import Option, Section, SectionSchema
from gpumon.imds import AzureInstance, ImdsError
from gpumon.log_once import COUNTED, LogOnce
from gpumon.model import Collection, MetricSpec, StateReason
from gpumon.sources import kvp

log = logging.getLogger("gpumon.collectors.host_info")



@dataclass(frozen=True)
class HostInfoSettings:
    interval: float
    kvp_pool: str


OPTIONS = SectionSchema(
    "host_info",
    "Azure VM identity and placement (IMDS compute metadata, Hyper-V KVP pool).",
    (
        Option("interval", float, 60.0, "Seconds between runs (IMDS is asked only every "
               "[azure] compute_refresh; the KVP pool is read every run).", min=1.0, max=86400.0),
        Option("kvp_pool", str, kvp.DEFAULT_POOL,
               "The Hyper-V KVP pool the host writes (pool 3); empty to not read it (/host/var/lib/hyperv/"
               ".kvp_pool_3 in a container that mounts the host's /var/lib/hyperv)."),
    ),
    HostInfoSettings,
)


class HostInfoCollector(Collector):
    name = "host_info"
    description = "Azure VM identity and placement: size, region, zone, scale set, placement group, host."
    options = OPTIONS
    settings: HostInfoSettings

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        azure = ctx.config.sections.get("azure")
        self._client = imds.configured(azure)
        self._log_once = LogOnce(log, suffix=COUNTED)

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (INFO,)

    def interval(self, default: float) -> float:
        """Identity changes rarely: its own slow pace, whatever the daemon's."""
        return self.settings.interval

    def probe(self) -> Availability:
        on, why = self._client.on_azure()
        if on:
            return Availability(True)
        if self.settings.kvp_pool:
            try:
                kvp.read_pool(self.settings.kvp_pool)
                return Availability(True)
            except OSError:
                pass
        return Availability(False, f"{why}; no Hyper-V KVP pool at {self.settings.kvp_pool or '(not read)'}",
                            cause=StateReason.ERROR)

    def check(self) -> Availability:
        """IMDS answering but refusing (403 from a proxy in the way): every run would count it."""
        try:
            self._client.instance()
        except ImdsError as exc:
            if exc.reason in ("unreachable", "timeout"):  # off Azure: the probe found the KVP pool
                return Availability(True)
            return Availability(False, imds.run_verdict(exc, imds.COMPUTE_PATH, self.name),
                                retry=exc.reason == "throttled")
        return Availability(True)

    def collect(self) -> Collection:
        coll = Collection()
        instance = self._instance(coll)
        host = self._physical_host(coll)
        if instance is not None or host:
            coll.add(INFO, (INFO.sample(1, *_labels(instance, host)),))
        return coll

    def _instance(self, coll: Collection) -> AzureInstance | None:
        try:
            return self._client.instance()
        except ImdsError as exc:  # the client logs it once
            coll.count_error(f"imds_{exc.reason}")
            return None

    def _physical_host(self, coll: Collection) -> str:
        if not self.settings.kvp_pool:
            return ""
        try:
            return kvp.physical_host(kvp.read_pool(self.settings.kvp_pool))
        except FileNotFoundError:
            return ""
        except OSError as exc:
            coll.count_error("kvp_read")
            self._log_once.warning("kvp", "KVP pool %s: %s", self.settings.kvp_pool, exc)
            return ""


def _labels(instance: AzureInstance | None, host: str) -> tuple[str, ...]:
    if instance is None:
        return ("",) * (len(LABELS) - 1) + (host,)
    return (instance.vm_size, instance.location, instance.zone, instance.vmss_name, instance.vm_id,
            instance.placement_group_id, instance.platform_fault_domain, host)

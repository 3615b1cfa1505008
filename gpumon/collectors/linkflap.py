"""The fast link-state watcher: reads only what is cheap, often, and exports the flap verdicts.

Every second (by default) it reads each port's ``state`` and ``phys_state`` and the port's netdev
``carrier_changes`` (a plain kernel counter: no firmware query), feeds them to the shared
:class:`gpumon.flaps.FlapDetector`, and exports the flap counts, the flapping flag and the
``ib_link_*`` events. ``link_downed`` reaches the same detector from the ``infiniband`` collector
on its slower counter interval, so a flap seen both ways counts once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from gpumon.catalogue.infiniband import (
    SPEC_DOWN,
    SPEC_FLAPPING,
    SPEC_FLAPS,
    SPEC_LAST,
    SPEC_LAST_DOWN,
    SPEC_SIGNALS,
    SPEC_WINDOW,
)
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.config import Config, Option, Section, SectionSchema
from gpumon.flaps import SIGNALS, PortFlapStatus, shared_detector
from gpumon.model import Collection, MetricFamily, MetricSpec, Sample, StateReason
from gpumon.sources import ib_sysfs
from gpumon.sources.ib_sysfs import (
    DEVICE_OPTIONS,
    PHYS_STATE_NAMES,
    STATE_NAMES,
    Attr,
    Fault,
    FaultLog,
    PortPaths,
    Signature,
    class_dir,
    device_filter,
    discover,
    parse_counter,
    parse_state,
    read_mode_cached,
    tree_signature,
)

DEVICE_LABELS = ("device", "port")

log = logging.getLogger("gpumon.collectors.linkflap")

@dataclass(frozen=True)
class LinkflapSettings:
    watch_interval: float
    flap_threshold: int
    flap_window: float
    carrier_changes: bool
    include_devices: str
    """Deprecated copies of [infiniband]'s device keys: see :func:`device_settings`."""
    exclude_devices: str
    read_mode: str


OPTIONS = SectionSchema(
    "linkflap",
    "The fast port-state watcher and the link-flap rule.",
    (
        Option("watch_interval", float, 1.0,
               "Seconds between state reads. Each read of state/phys_state queries the port, so keep "
               "it at 0.5 s or more on large hosts.", min=0.05, max=3600.0),
        Option("flap_threshold", int, 5, "Flaps within flap_window that make a port flapping.",
               min=1, max=100000),
        Option("flap_window", float, 86400.0, "Seconds of the flap window (kept across restarts).",
               min=60.0, max=30 * 86400.0),
        Option("carrier_changes", bool, True,
               "Also read the port netdev's carrier_changes (no firmware query): catches a flap "
               "shorter than any poll within one watch interval."),
        *(replace(opt, help=f"Deprecated, still honoured by the watcher for this release: set "
                            f"[infiniband] {opt.key}, which serves both collectors.")
          for opt in DEVICE_OPTIONS),
    ),
    LinkflapSettings,
)


@dataclass(frozen=True)
class DeviceSettings:
    """[infiniband]'s device filter and read mode, which serve both collectors."""

    include_devices: str
    exclude_devices: str
    read_mode: str


DEVICE_SCHEMA = SectionSchema("infiniband", "The device keys of [infiniband].", DEVICE_OPTIONS, DeviceSettings)
"""[infiniband]'s device keys alone (this module does not import the infiniband collector's)."""


def device_settings(ctx: Context, cfg: Section | None, own: LinkflapSettings) -> DeviceSettings:
    """The device filter and read mode from [infiniband], which serves both collectors; a [linkflap]
    copy that was set (``own``, parsed from ``cfg``) still wins for this release, with a warning that
    names the key to use."""
    config = ctx.config
    shared = config.sections.get("infiniband")
    keys = [opt.key for opt in DEVICE_OPTIONS]
    found = DEVICE_SCHEMA.settings_of({key: shared[key] for key in keys if key in shared}
                                      if shared is not None else None)
    kept: dict[str, Any] = {}
    for key in keys:
        if cfg is not None and _set_here(config, cfg, key):
            log.warning("[linkflap] %s is deprecated: set [infiniband] %s instead (it applies to both "
                        "collectors); the [linkflap] value is used for now", key, key)
            kept[key] = getattr(own, key)
    return replace(found, **kept)


def _set_here(config: Config, cfg: Section | None, key: str) -> bool:
    """Whether [linkflap] ``key`` was set by the user (a file, a variable), not left at its default
    (a collector built alone, with no config around it: whatever its section holds)."""
    if cfg is None or key not in cfg:
        return False
    return not config.sections or f"linkflap.{key}" in config.origins


@dataclass
class _Watched:
    paths: PortPaths
    labels: tuple[tuple[str, str], ...]
    state: Attr
    phys_state: Attr
    carrier: Attr | None
    signal_labels: tuple[tuple[tuple[str, str], ...], ...] = ()
    """``labels`` plus each of SIGNALS, made once: the same tuples every run compare by identity."""

    def __post_init__(self) -> None:
        self.signal_labels = tuple(self.labels + (("signal", signal),) for signal in SIGNALS)


class LinkflapCollector(Collector):
    name = "linkflap"
    description = "Fast InfiniBand port-state watcher: link flaps, flapping ports, down periods."
    options = OPTIONS
    settings: LinkflapSettings

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        device = device_settings(ctx, cfg, self.settings)
        self._wanted = device_filter(device.include_devices, device.exclude_devices)
        self._cached = read_mode_cached(device.read_mode, ctx.sysfs_root)
        self._detector = shared_detector(ctx)
        self._configured = False
        self._faults = FaultLog(log)
        self._signature: Signature | None = None
        self._stale = True
        self._ports: list[_Watched] = []
        #: The statuses and ports the last export was made from, and the families it made.
        self._exported: tuple[list[PortFlapStatus], list[_Watched], list[MetricFamily]] = ([], [], [])

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (SPEC_FLAPS, SPEC_SIGNALS, SPEC_WINDOW, SPEC_FLAPPING, SPEC_LAST, SPEC_DOWN, SPEC_LAST_DOWN)

    def interval(self, default: float) -> float:
        """The watcher keeps its own pace, whatever the daemon's interval."""
        return self.settings.watch_interval

    def probe(self) -> Availability:
        available, reason, cause = ib_sysfs.probe_tree(self.ctx.sysfs_root)
        return Availability(available, reason, cause=cause)

    def close(self) -> None:
        for port in self._ports:
            for attr in (port.state, port.phys_state, port.carrier):
                if attr is not None:
                    attr.close()
        self._ports = []
        self._stale = True

    def _rediscover(self) -> None:
        self.close()
        ports = []
        for paths in discover(self.ctx.sysfs_root, self._wanted):
            carrier = None
            if self.settings.carrier_changes:
                for ndir in paths.netdev_dirs:
                    path = os.path.join(ndir, "carrier_changes")
                    if os.path.exists(path):
                        carrier = Attr(path, self._cached)
                        break
            self._detector.identify(paths.key, paths.node_guid)
            ports.append(_Watched(
                paths, (("device", paths.device), ("port", paths.port)),
                Attr(os.path.join(paths.port_dir, "state"), self._cached),
                Attr(os.path.join(paths.port_dir, "phys_state"), self._cached),
                carrier))
        self._ports = ports

    def collect(self) -> Collection:
        coll = Collection()
        signature = tree_signature(self.ctx.sysfs_root)
        if not signature:
            self.close()
            self._signature = signature
            raise CollectorUnavailable(f"no InfiniBand devices under {class_dir(self.ctx.sysfs_root)}",
                                       StateReason.NO_SOURCE)
        if self._stale or signature != self._signature:
            self._rediscover()
            self._signature = signature
        self._stale = False
        detector = self._detector
        if not self._configured:
            # On the first run, not at construction: a reload that is built but then rejected must
            # leave the running watcher's rule alone (the detector is shared across reloads).
            detector.configure(self.settings.flap_threshold, self.settings.flap_window)
            self._configured = True
        for port in self._ports:
            state = self._read(coll, port.state, lambda t: parse_state(t, STATE_NAMES))
            phys = self._read(coll, port.phys_state, lambda t: parse_state(t, PHYS_STATE_NAMES))
            carrier = self._read(coll, port.carrier, parse_counter) if port.carrier is not None else None
            detector.observe(port.paths.key, time.monotonic(), state=state, phys_state=phys,
                             carrier_changes=carrier)
        self._export(coll)
        coll.events.extend(detector.drain_events())
        for reason, count in detector.drain_errors().items():
            coll.count_error(reason, count)
        return coll

    def _read(self, coll: Collection, attr: Attr, parse) -> int | None:
        try:
            return parse(attr.read())
        except Fault as fault:
            self._faults.report(coll, fault, attr.path)
            if fault.reason == "vanished":
                self._stale = True
            return None

    def _export(self, coll: Collection) -> None:
        """The ports' flap series; the same families as the last run while no port's status changed
        (most seconds on a healthy host): nothing is made again, and the loop sees the same samples."""
        statuses = [self._detector.status(port.paths.key) for port in self._ports]
        if statuses != self._exported[0] or self._ports is not self._exported[1]:
            self._exported = (statuses, self._ports, self._families(statuses))
        coll.families.extend(self._exported[2])

    def _families(self, statuses: list[PortFlapStatus]) -> list[MetricFamily]:
        flaps, signals, window, flapping, last, down, last_down = ([] for _ in range(7))
        for port, st in zip(self._ports, statuses):
            labels = port.labels
            flaps.append(Sample(labels, float(st.flaps_total)))
            for signal, signal_labels in zip(SIGNALS, port.signal_labels):
                signals.append(Sample(signal_labels, float(st.signal_counts.get(signal, 0))))
            window.append(Sample(labels, float(st.window_flaps)))
            flapping.append(Sample(labels, 1.0 if st.flapping else 0.0))
            if st.last_flap_timestamp is not None:
                last.append(Sample(labels, st.last_flap_timestamp))
            down.append(Sample(labels, st.down_seconds))
            if st.last_down_seconds is not None:
                last_down.append(Sample(labels, st.last_down_seconds))
        made = Collection()
        for spec, samples in ((SPEC_FLAPS, flaps), (SPEC_SIGNALS, signals), (SPEC_WINDOW, window),
                              (SPEC_FLAPPING, flapping), (SPEC_LAST, last), (SPEC_DOWN, down),
                              (SPEC_LAST_DOWN, last_down)):
            made.add(spec, samples)
        return made.families

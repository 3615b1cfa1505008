"""InfiniBand (and RoCE) port counters from ``<sysfs-root>/class/infiniband``.

Per port: identity, state, rate, every PMA counter in ``counters/`` (in base units) and every driver
counter in ``hw_counters/``. Sticky narrow counters are flagged when saturated; one unreadable or
absurd file costs that one value (counted, logged once), never the run. ``link_downed`` also feeds
the shared flap detector (:mod:`gpumon.flaps`), whose results the ``linkflap`` watcher exports.

Each attribute is opened once and re-read with ``pread`` (each read of a ``counters/`` file is a
firmware query already; open/close would only add to it). That is valid on sysfs, where an attribute
is never replaced; on any other filesystem (fixtures, ``--simulate``) files are opened per read.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpumon.cadence import due
from gpumon.catalogue import infiniband as C
from gpumon.catalogue.infiniband import (
    SPEC_HW,
    SPEC_INFO,
    SPEC_PHYS,
    SPEC_PMA_OTHER,
    SPEC_RATE,
    SPEC_SATURATED,
    SPEC_STATE,
    SPEC_UP,
)
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.config import Option, Section, SectionSchema
from gpumon.flaps import is_up, shared_detector
from gpumon.model import Collection, Labels, MetricSpec, Sample, StateReason
from gpumon.sources import ib_sysfs
from gpumon.sources.ib_sysfs import (
    HW_NOT_COUNTERS,
    PHYS_STATE_NAMES,
    PMA_BY_FILE,
    STATE_NAMES,
    Attr,
    Fault,
    FaultLog,
    Parsed,
    PortPaths,
    Signature,
    class_dir,
    counter_width,
    device_filter,
    discover,
    list_attrs,
    parse_counter,
    parse_rate,
    parse_state,
    read_mode_cached,
    saturated,
    tree_signature,
)

log = logging.getLogger("gpumon.collectors.infiniband")



@dataclass(frozen=True)
class PmaCounter:
    """Which metric one ``counters/`` file is read into; its width and scale are the source's (ib_sysfs)."""

    file: str
    spec: MetricSpec

    @property
    def metric(self) -> str:
        return self.spec.name

    @property
    def width(self) -> int:
        return PMA_BY_FILE[self.file].width

    @property
    def scale(self) -> int:
        return PMA_BY_FILE[self.file].scale


PMA_COUNTERS: tuple[PmaCounter, ...] = (
    PmaCounter("port_xmit_data", C.DATA_TRANSMITTED),
    PmaCounter("port_rcv_data", C.DATA_RECEIVED),
    PmaCounter("port_xmit_packets", C.PACKETS_TRANSMITTED),
    PmaCounter("port_rcv_packets", C.PACKETS_RECEIVED),
    PmaCounter("unicast_xmit_packets", C.UNICAST_TRANSMITTED),
    PmaCounter("unicast_rcv_packets", C.UNICAST_RECEIVED),
    PmaCounter("multicast_xmit_packets", C.MULTICAST_TRANSMITTED),
    PmaCounter("multicast_rcv_packets", C.MULTICAST_RECEIVED),
    PmaCounter("symbol_error", C.SYMBOL_ERRORS),
    PmaCounter("link_error_recovery", C.LINK_ERROR_RECOVERIES),
    PmaCounter("link_downed", C.LINK_DOWNED),
    PmaCounter("port_rcv_errors", C.RECEIVE_ERRORS),
    PmaCounter("port_rcv_remote_physical_errors", C.RECEIVE_REMOTE_PHYSICAL_ERRORS),
    PmaCounter("port_rcv_switch_relay_errors", C.RECEIVE_SWITCH_RELAY_ERRORS),
    PmaCounter("port_xmit_discards", C.TRANSMIT_DISCARDS),
    PmaCounter("port_xmit_constraint_errors", C.TRANSMIT_CONSTRAINT_ERRORS),
    PmaCounter("port_rcv_constraint_errors", C.RECEIVE_CONSTRAINT_ERRORS),
    PmaCounter("local_link_integrity_errors", C.LOCAL_LINK_INTEGRITY_ERRORS),
    PmaCounter("excessive_buffer_overrun_errors", C.EXCESSIVE_BUFFER_OVERRUN_ERRORS),
    PmaCounter("VL15_dropped", C.VL15_DROPPED),
    PmaCounter("port_xmit_wait", C.TRANSMIT_WAIT),
)
PMA_SPECS = {c.file: c.spec for c in PMA_COUNTERS}

# ---------------------------------------------------------------------------------------- collector


@dataclass
class _CounterFile:
    name: str
    attr: Attr
    width: int
    spec: MetricSpec | None
    scale: int
    hw: bool
    raw: bytes | None = None
    """The bytes behind ``value`` and the samples below; None until read, and after any fault."""
    value: int = 0
    sample: Sample | None = None
    stuck: Sample | None = None
    """The saturated series' sample while the counter is stuck at its width's maximum."""

    def read(self, labels: Labels) -> int:
        """The counter's value, its samples made again only when its bytes changed; raises Fault."""
        raw = self.attr.read_bytes()
        if raw != self.raw:
            self.raw = None
            value = parse_counter(raw.decode("utf-8", "replace"), self.width)
            series = labels if self.spec is not None else labels + (("counter", self.name),)
            self.sample = Sample(series, float(value * self.scale))
            self.stuck = Sample(labels + (("counter", self.name),), 1.0) if saturated(value, self.width) else None
            self.raw, self.value = raw, value
        return self.value


@dataclass
class _Port:
    paths: PortPaths
    labels: Labels
    info: Sample
    state: Attr
    phys_state: Attr
    rate: Attr
    counters: list[_CounterFile] = field(default_factory=list)
    link_downed: _CounterFile | None = None
    parsed: tuple[Parsed, Parsed, Parsed] = ()  # type: ignore[assignment]
    """state, phys_state and rate with their last values (set in __post_init__)."""

    def __post_init__(self) -> None:
        self.parsed = (Parsed(self.state, lambda t: parse_state(t, STATE_NAMES)),
                       Parsed(self.phys_state, lambda t: parse_state(t, PHYS_STATE_NAMES)),
                       Parsed(self.rate, parse_rate))

    def attrs(self) -> list[Attr]:
        return [self.state, self.phys_state, self.rate] + [c.attr for c in self.counters]


HW_COUNTER_SECONDS = 10.0
"""hw_counters/ is read at most this often (the default interval): its driver counters (out_of_buffer,
CNPs, retries) are read with rate() over minutes, and at a fast interval they were more than half of
every run's reads (29 of 51 files per port). counters/ (the PMA counters, link_downed for flaps),
state and rate are read every run."""


@dataclass(frozen=True)
class InfinibandSettings:
    interval: float
    include_devices: str
    exclude_devices: str
    hw_counters: bool
    read_mode: str


OPTIONS = SectionSchema(
    "infiniband",
    "InfiniBand/RoCE port counters from sysfs.",
    (
        Option("interval", float, 0.0,
               "Seconds between counter runs; 0 uses [daemon] interval (10 s by default). Each "
               "counters/ read is a firmware query, so this need not be fast: flaps are caught by the "
               "linkflap watcher.", min=0.0, max=3600.0),
        *ib_sysfs.DEVICE_OPTIONS[:2],
        Option("hw_counters", bool, True,
               "Also export every driver counter in hw_counters/ (about 22-31 series per port)."),
        ib_sysfs.DEVICE_OPTIONS[2],
    ),
    InfinibandSettings,
)


def probe_tree(sysfs_root: str) -> Availability:
    """Whether ``<sysfs_root>/class/infiniband`` lists devices; shared with the link-flap watcher."""
    available, reason, cause = ib_sysfs.probe_tree(sysfs_root)
    return Availability(available, reason, cause=cause)


class InfinibandCollector(Collector):
    name = "infiniband"
    description = "InfiniBand/RoCE port state, rate, PMA counters and mlx5 hw_counters from sysfs."
    options = OPTIONS
    settings: InfinibandSettings
    implies = ("linkflap",)

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        self._wanted = device_filter(self.settings.include_devices, self.settings.exclude_devices)
        self._cached = read_mode_cached(self.settings.read_mode, ctx.sysfs_root)
        self._faults = FaultLog(log)
        self._signature: Signature | None = None
        self._stale = True
        self._ports: list[_Port] = []
        self._watching: tuple[tuple[str, str], ...] | None = None
        self._identity_faults = 0
        self._detector = shared_detector(ctx)
        self._hw_read_at: float | None = None
        self._clock = time.monotonic

    # ------------------------------------------------------------------ contract

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (SPEC_INFO, SPEC_STATE, SPEC_PHYS, SPEC_UP, SPEC_RATE, *PMA_SPECS.values(),
                SPEC_PMA_OTHER, SPEC_HW, SPEC_SATURATED)

    def probe(self) -> Availability:
        return probe_tree(self.ctx.sysfs_root)

    def close(self) -> None:
        for port in self._ports:
            for attr in port.attrs():
                attr.close()
        self._ports = []
        self._stale = True

    def collect(self) -> Collection:
        coll = Collection()
        signature = tree_signature(self.ctx.sysfs_root)
        if signature is None or not signature:
            self.close()
            self._signature = signature
            where = class_dir(self.ctx.sysfs_root)
            raise CollectorUnavailable(
                f"no {where} (no InfiniBand driver loaded)" if signature is None else f"{where} has no devices",
                StateReason.DRIVER_NOT_LOADED if signature is None else StateReason.NO_SOURCE)
        if self._stale or signature != self._signature:
            complete = self._rediscover(coll)
            self._signature = signature
            self._stale = not complete
        self._read_ports(coll)
        return coll

    # ------------------------------------------------------------------ discovery

    def _rediscover(self, coll: Collection) -> bool:
        """Walk the tree again; False when an identity file could not be read for a reason that may
        pass (a FIFO, EIO), so the next run tries again instead of keeping a blank identity."""
        self.close()
        ports: list[_Port] = []
        statics: dict[str, dict[str, str]] = {}
        self._identity_faults = 0
        for paths in discover(self.ctx.sysfs_root, self._wanted):
            self._detector.identify(paths.key, paths.node_guid)
            if paths.device not in statics:
                statics[paths.device] = {
                    name: self._read_static(coll, os.path.join(paths.device_dir, name))
                    for name in ("fw_ver", "board_id", "hca_type")
                }
                # discovery read node_guid already; read it again only to report why it is blank
                statics[paths.device]["node_guid"] = paths.node_guid or self._read_static(
                    coll, os.path.join(paths.device_dir, "node_guid"))
            ports.append(self._build_port(coll, paths, statics[paths.device]))
        self._ports = ports
        watching = tuple(p.paths.key for p in ports)
        if watching != self._watching:
            self._watching = watching
            log.info("infiniband: watching %d port(s): %s", len(ports),
                     ", ".join(f"{d}/{p}" for d, p in watching) or "none")
        return not self._identity_faults

    def _read_static(self, coll: Collection, path: str) -> str:
        try:
            text = Attr(path, cached=False).read().strip()
        except Fault as fault:
            self._faults.report(coll, fault, path)
            if fault.reason == "read":
                self._identity_faults += 1
            return ""
        return text

    def _build_port(self, coll: Collection, paths: PortPaths, static: dict[str, str]) -> _Port:
        pdir = paths.port_dir
        link_layer = self._read_static(coll, os.path.join(pdir, "link_layer"))
        labels: Labels = (("device", paths.device), ("port", paths.port))
        info = SPEC_INFO.sample(1, paths.device, paths.port, link_layer, static["fw_ver"],
                                static["board_id"], static["hca_type"], static["node_guid"],
                                ",".join(paths.netdevs))
        port = _Port(paths, labels, info, Attr(os.path.join(pdir, "state"), self._cached),
                     Attr(os.path.join(pdir, "phys_state"), self._cached),
                     Attr(os.path.join(pdir, "rate"), self._cached))
        for name in list_attrs(os.path.join(pdir, "counters")):
            known = PMA_BY_FILE.get(name)
            cf = _CounterFile(name, Attr(os.path.join(pdir, "counters", name), self._cached),
                              counter_width(name, hw=False), PMA_SPECS.get(name),
                              known.scale if known else 1, hw=False)
            port.counters.append(cf)
            if name == "link_downed":
                port.link_downed = cf
        if self.settings.hw_counters:
            for name in list_attrs(os.path.join(pdir, "hw_counters")):
                if name in HW_NOT_COUNTERS:
                    continue
                port.counters.append(_CounterFile(
                    name, Attr(os.path.join(pdir, "hw_counters", name), self._cached),
                    counter_width(name, hw=True), None, 1, hw=True))
        return port

    # ------------------------------------------------------------------ reading

    def _read_ports(self, coll: Collection) -> None:
        state_s: list[Sample] = []
        phys_s: list[Sample] = []
        up_s: list[Sample] = []
        rate_s: list[Sample] = []
        info_s: list[Sample] = []
        per_spec: dict[str, list[Sample]] = {name: [] for name in PMA_SPECS}
        other_s: list[Sample] = []
        hw_s: list[Sample] = []
        sat_s: list[Sample] = []
        now = self._clock()
        hw_due = due(self._hw_read_at, now, HW_COUNTER_SECONDS)
        if hw_due:
            self._hw_read_at = now
        for port in self._ports:
            labels = port.labels
            info_s.append(port.info)
            state, phys, rate = (self._value(coll, parsed) for parsed in port.parsed)
            if state is not None:
                state_s.append(Sample(labels, float(state)))
            if phys is not None:
                phys_s.append(Sample(labels, float(phys)))
            if state is not None:
                up_s.append(Sample(labels, 1.0 if is_up(state, phys) else 0.0))
            if rate is not None:
                rate_s.append(Sample(labels, rate))
            link_downed: int | None = None
            for cf in port.counters:
                if cf.hw and not hw_due and cf.raw is not None:
                    value = cf.value      # between hw_counters/ reads its last value stands in
                else:
                    try:
                        value = cf.read(labels)
                    except Fault as fault:
                        self._fault(coll, fault, cf.attr.path)
                        continue
                if cf.stuck is not None:
                    sat_s.append(cf.stuck)
                assert cf.sample is not None  # read() made it
                (per_spec[cf.name] if cf.spec is not None else hw_s if cf.hw else other_s).append(cf.sample)
                if cf is port.link_downed:
                    link_downed = value
            if link_downed is not None:
                self._detector.observe(port.paths.key, now, link_downed=link_downed,
                                       link_downed_saturated=saturated(link_downed, 8))
        coll.add(SPEC_INFO, info_s)
        coll.add(SPEC_STATE, state_s)
        coll.add(SPEC_PHYS, phys_s)
        coll.add(SPEC_UP, up_s)
        coll.add(SPEC_RATE, rate_s)
        for name, spec in PMA_SPECS.items():
            coll.add(spec, per_spec[name])
        coll.add(SPEC_PMA_OTHER, other_s)
        coll.add(SPEC_HW, hw_s)
        coll.add(SPEC_SATURATED, sat_s)

    def _value(self, coll: Collection, parsed: Parsed) -> Any:
        """One parsed attribute's value, or None (the fault counted and logged once)."""
        try:
            return parsed.get()
        except Fault as fault:
            self._fault(coll, fault, parsed.attr.path)
            return None

    def _fault(self, coll: Collection, fault: Fault, path: str) -> None:
        self._faults.report(coll, fault, path)
        if fault.reason == "vanished":
            self._stale = True  # a file or device went away: walk the tree again next run

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

import errno
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context, Table
from gpumon.config import Option, Section, SectionSchema, regex_check
from gpumon.flaps import is_up, shared_detector
from gpumon.model import Collection, Labels, MetricSpec, MetricType, Sample, Snapshot

log = logging.getLogger("gpumon.collectors.infiniband")

READ_SIZE = 4096
U64_MAX = (1 << 64) - 1
MAX_RATE_GBPS = 100_000.0
"""Anything faster than 100 Tb/s is a garbled file, not a link."""

STATE_NAMES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATE_NAMES = {0: "NoStateChange", 1: "Sleep", 2: "Polling", 3: "Disabled",
                    4: "PortConfigurationTraining", 5: "LinkUp", 6: "LinkErrorRecovery", 7: "PhyTest"}

DEVICE_LABELS = ("device", "port")
COUNTER_LABELS = ("device", "port", "counter")


@dataclass(frozen=True)
class PmaCounter:
    """How one ``counters/`` file is exported."""

    file: str
    metric: str
    width: int
    help: str
    unit: str = ""
    scale: int = 1


PMA_COUNTERS: tuple[PmaCounter, ...] = (
    PmaCounter("port_xmit_data", "gpumon_ib_port_data_transmitted_bytes_total", 64,
               "Bytes transmitted on all VLs (port_xmit_data x 4: the file counts 4-octet words).",
               "bytes", 4),
    PmaCounter("port_rcv_data", "gpumon_ib_port_data_received_bytes_total", 64,
               "Bytes received on all VLs (port_rcv_data x 4: the file counts 4-octet words).",
               "bytes", 4),
    PmaCounter("port_xmit_packets", "gpumon_ib_port_packets_transmitted_total", 64,
               "Packets transmitted on all VLs."),
    PmaCounter("port_rcv_packets", "gpumon_ib_port_packets_received_total", 64,
               "Packets received on all VLs."),
    PmaCounter("unicast_xmit_packets", "gpumon_ib_port_unicast_packets_transmitted_total", 64,
               "Unicast packets transmitted."),
    PmaCounter("unicast_rcv_packets", "gpumon_ib_port_unicast_packets_received_total", 64,
               "Unicast packets received."),
    PmaCounter("multicast_xmit_packets", "gpumon_ib_port_multicast_packets_transmitted_total", 64,
               "Multicast packets transmitted."),
    PmaCounter("multicast_rcv_packets", "gpumon_ib_port_multicast_packets_received_total", 64,
               "Multicast packets received."),
    PmaCounter("symbol_error", "gpumon_ib_port_symbol_errors_total", 16,
               "Minor link errors detected on one or more physical lanes (16-bit, sticky)."),
    PmaCounter("link_error_recovery", "gpumon_ib_port_link_error_recoveries_total", 8,
               "Successful link retrains after an error (8-bit, sticky)."),
    PmaCounter("link_downed", "gpumon_ib_port_link_downed_total", 8,
               "Failed link recoveries that took the link down: the flap counter (8-bit, sticky)."),
    PmaCounter("port_rcv_errors", "gpumon_ib_port_receive_errors_total", 16,
               "Packets received with errors (16-bit, sticky)."),
    PmaCounter("port_rcv_remote_physical_errors", "gpumon_ib_port_receive_remote_physical_errors_total",
               16, "Packets received marked with the EBP delimiter (bad upstream; 16-bit, sticky)."),
    PmaCounter("port_rcv_switch_relay_errors", "gpumon_ib_port_receive_switch_relay_errors_total", 16,
               "Packets discarded because they could not be forwarded by the switch relay (16-bit)."),
    PmaCounter("port_xmit_discards", "gpumon_ib_port_transmit_discards_total", 16,
               "Outbound packets discarded because the port was down or congested (16-bit, sticky)."),
    PmaCounter("port_xmit_constraint_errors", "gpumon_ib_port_transmit_constraint_errors_total", 8,
               "Packets not transmitted because of outbound raw filtering constraints (8-bit)."),
    PmaCounter("port_rcv_constraint_errors", "gpumon_ib_port_receive_constraint_errors_total", 8,
               "Packets discarded because of inbound raw filtering constraints (8-bit)."),
    PmaCounter("local_link_integrity_errors", "gpumon_ib_port_local_link_integrity_errors_total", 4,
               "Times local physical errors exceeded the threshold (4-bit, sticky)."),
    PmaCounter("excessive_buffer_overrun_errors",
               "gpumon_ib_port_excessive_buffer_overrun_errors_total", 4,
               "Consecutive flow-control update periods with buffer overrun (4-bit, sticky)."),
    PmaCounter("VL15_dropped", "gpumon_ib_port_vl15_dropped_total", 16,
               "Subnet management packets (VL15) dropped for lack of buffers (16-bit, sticky)."),
    PmaCounter("port_xmit_wait", "gpumon_ib_port_transmit_wait_ticks_total", 32,
               "Ticks during which the port had data to send but no flow-control credits: "
               "congestion (32-bit, sticky; tick length is implementation defined).", "ticks"),
)
PMA_BY_FILE = {c.file: c for c in PMA_COUNTERS}

MLX5_QUEUE_COUNTERS: tuple[str, ...] = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer",
    "out_of_sequence", "packet_seq_err", "req_cqe_error", "req_cqe_flush_error",
    "req_remote_access_errors", "req_remote_invalid_request", "req_rnr_retries_exceeded",
    "req_transport_retries_exceeded", "resp_cqe_error", "resp_cqe_flush_error",
    "resp_local_length_error", "resp_remote_access_errors", "rnr_nak_retry_err",
    "rx_atomic_requests", "rx_dct_connect", "rx_read_requests", "rx_write_requests",
)
"""The mlx5 queue (q) counters in hw_counters/, on every port (32-bit)."""
MLX5_ROCE_COUNTERS: tuple[str, ...] = (
    "np_cnp_sent", "np_ecn_marked_roce_packets", "roce_adp_retrans", "roce_adp_retrans_to",
    "roce_slow_restart", "roce_slow_restart_cnps", "roce_slow_restart_trans", "rp_cnp_handled",
    "rp_cnp_ignored", "rx_icrc_encapsulated",
)
"""The mlx5 congestion/RoCE counters in hw_counters/, on Ethernet (RoCE) ports (64-bit;
``rx_icrc_encapsulated`` is an extended PPCNT counter, not a queue counter)."""
HW_COUNTER_WIDTHS: dict[str, int] = dict.fromkeys(MLX5_QUEUE_COUNTERS, 32)
"""mlx5 queue counters are 32-bit; any other hw counter is taken as 64-bit."""
HW_NOT_COUNTERS = frozenset({"lifespan"})

SPEC_INFO = MetricSpec(
    "gpumon_ib_port_info", MetricType.INFO,
    "Identity of an RDMA port; value 1. netdev lists the port's network interfaces, comma separated.",
    labels=("device", "port", "link_layer", "fw_version", "board_id", "hca_type", "node_guid", "netdev"))
SPEC_STATE = MetricSpec(
    "gpumon_ib_port_state", MetricType.GAUGE,
    "Logical port state as the kernel numbers it: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.",
    labels=DEVICE_LABELS)
SPEC_PHYS = MetricSpec(
    "gpumon_ib_port_phys_state", MetricType.GAUGE,
    "Physical port state: 1 Sleep, 2 Polling, 3 Disabled, 4 PortConfigurationTraining, 5 LinkUp, "
    "6 LinkErrorRecovery, 7 PhyTest.", labels=DEVICE_LABELS)
SPEC_UP = MetricSpec(
    "gpumon_ib_port_up", MetricType.GAUGE,
    "1 when the port is ACTIVE and its physical link is LinkUp, else 0.", labels=DEVICE_LABELS)
SPEC_RATE = MetricSpec(
    "gpumon_ib_port_rate_bytes_per_second", MetricType.GAUGE,
    "Negotiated link rate (the rate file's Gb/s x 10^9 / 8).", "bytes_per_second", DEVICE_LABELS)
SPEC_PMA_OTHER = MetricSpec(
    "gpumon_ib_port_pma_other_total", MetricType.COUNTER,
    "A counters/ file this version of gpumon does not know by name, exported raw.",
    labels=COUNTER_LABELS)
SPEC_HW = MetricSpec(
    "gpumon_ib_hw_stat_total", MetricType.COUNTER,
    "A driver counter from hw_counters/ (whatever the firmware offers), named by the counter label.",
    labels=COUNTER_LABELS)
SPEC_SATURATED = MetricSpec(
    "gpumon_ib_port_saturated", MetricType.GAUGE,
    "1 for a counter stuck at the maximum of its width: it no longer counts (reset it with "
    "perfquery -R). Only stuck counters have a series.", labels=COUNTER_LABELS)
PMA_SPECS = {c.file: MetricSpec(c.metric, MetricType.COUNTER, c.help, c.unit, DEVICE_LABELS)
             for c in PMA_COUNTERS}

# ---------------------------------------------------------------------------------------- reading


class Fault(Exception):
    """One value could not be had; ``reason`` becomes the ``reason`` label of the error counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def classify_oserror(exc: OSError) -> str:
    """A short, bounded reason for an OS error on one attribute."""
    code = exc.errno
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return "unsupported"
    if code in (errno.EACCES, errno.EPERM):
        return "permission"
    if code in (errno.ENOENT, errno.ENODEV, errno.ENXIO):
        return "vanished"
    return "read"


class Attr:
    """One sysfs attribute: opened once, re-read with pread; reopened after any error."""

    __slots__ = ("path", "fd", "cached")

    def __init__(self, path: str, cached: bool) -> None:
        self.path = path
        self.fd: int | None = None
        self.cached = cached

    def read(self) -> str:
        """The attribute's text; raises :class:`Fault`."""
        try:
            if not self.cached:
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    data = os.pread(fd, READ_SIZE, 0)
                finally:
                    os.close(fd)
            else:
                if self.fd is None:
                    self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                data = os.pread(self.fd, READ_SIZE, 0)
        except OSError as exc:
            self.close()
            raise Fault(classify_oserror(exc), exc.strerror or str(exc)) from None
        return data.decode("utf-8", "replace")

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


_DIGITS = re.compile(r"[0-9]+")
_STATE = re.compile(r"([0-9]+)(?::[ \t]*(?:[A-Za-z_ ]*|<unknown>))?")
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?) Gb/sec(?: \([^)]*\))?")


def parse_counter(text: str, width: int = 64) -> int:
    """A counter file's value; ``width`` bounds what is believable."""
    value = text.strip()
    if not value:
        raise Fault("empty", "empty file")
    if value.startswith("N/A"):
        raise Fault("no_pma", value)
    if not _DIGITS.fullmatch(value):
        raise Fault("parse", f"not a counter: {value[:40]!r}")
    if len(value) > 20 or int(value) > (1 << width) - 1:
        raise Fault("absurd", f"{value[:40]} exceeds a {width}-bit counter")
    return int(value)


def parse_state(text: str, names: dict[int, str]) -> int:
    """``"4: ACTIVE"`` -> 4. An id the kernel does not define is absurd."""
    value = text.strip()
    if not value:
        raise Fault("empty", "empty file")
    match = _STATE.fullmatch(value)
    if match is None:
        raise Fault("parse", f"not a port state: {value[:40]!r}")
    if len(match.group(1)) > 3 or int(match.group(1)) not in names:
        raise Fault("absurd", f"unknown state id in {value[:40]!r}")
    return int(match.group(1))


def parse_rate(text: str) -> float:
    """``"400 Gb/sec (4X NDR)"`` -> bytes per second."""
    value = text.strip()
    if not value:
        raise Fault("empty", "empty file")
    match = _RATE.fullmatch(value)
    if match is None:
        raise Fault("parse", f"not a link rate: {value[:40]!r}")
    gbps = float(match.group(1))
    if gbps > MAX_RATE_GBPS:
        raise Fault("absurd", f"rate {gbps} Gb/s")
    return gbps * 1e9 / 8


class FaultLog:
    """Counts every fault in the run's Collection and logs each (file, reason) once per process."""

    def __init__(self, logger: logging.Logger, limit: int = 10_000) -> None:
        self._log = logger
        self._seen: set[tuple[str, str]] = set()
        self._limit = limit

    def report(self, coll: Collection, fault: Fault, path: str) -> None:
        coll.count_error(fault.reason)
        key = (path, fault.reason)
        if key not in self._seen and len(self._seen) < self._limit:
            self._seen.add(key)
            self._log.warning("%s: %s (%s; reported once, counted every time)", path, fault, fault.reason)


def on_sysfs(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ``path`` lives on a sysfs mount, where attributes are never replaced (pread is safe)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split()
                if "-" not in parts[6:]:
                    continue
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, parts[parts.index("-", 6) + 1]
    except (OSError, IndexError):
        return False
    return fstype == "sysfs"


def read_mode_cached(mode: str, sysfs_root: str) -> bool:
    if mode == "pread":
        return True
    if mode == "open":
        return False
    return on_sysfs(os.path.join(sysfs_root, "class"))


# ---------------------------------------------------------------------------------------- discovery


@dataclass
class PortPaths:
    """Where one port's files are; what the watcher and the collector both need."""

    device: str
    port: str
    device_dir: str
    port_dir: str
    netdevs: tuple[str, ...] = ()
    netdev_dirs: tuple[str, ...] = ()
    node_guid: str = ""
    """The HCA's identity: device names are not stable across reboots, the GUID is."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.device, self.port)


def class_dir(sysfs_root: str) -> str:
    return os.path.join(sysfs_root, "class", "infiniband")


def device_filter(include: str, exclude: str) -> Callable[[str], bool]:
    inc = re.compile(include) if include else None
    exc = re.compile(exclude) if exclude else None

    def wanted(name: str) -> bool:
        return (inc is None or inc.search(name) is not None) and (exc is None or exc.search(name) is None)

    return wanted


Signature = tuple[tuple[str, str, tuple[str, ...]], ...]


def tree_signature(sysfs_root: str) -> Signature | None:
    """Cheap fingerprint of the device set (names, link targets, netdev names); None when the class
    is absent.

    A VF re-plugged under the same name comes back at another link target, so it changes too; an
    IPoIB netdev that appears after the HCA (ib_ipoib loaded late, a udev rename) changes it as well.
    """
    base = class_dir(sysfs_root)
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    result = []
    for name in names:
        try:
            target = os.readlink(os.path.join(base, name))
        except OSError:
            target = ""
        try:
            netdevs = tuple(sorted(os.listdir(os.path.join(base, name, "device", "net"))))
        except OSError:
            netdevs = ()
        result.append((name, target, netdevs))
    return tuple(result)


def _netdevs(device_dir: str, port: str, port_count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The port's netdevs: all of ``device/net`` on a one-port HCA, else matched on ``dev_port``."""
    net = os.path.join(device_dir, "device", "net")
    try:
        names = sorted(os.listdir(net))
    except OSError:
        return (), ()
    chosen = []
    for name in names:
        if port_count > 1:
            try:
                with open(os.path.join(net, name, "dev_port"), encoding="ascii") as fh:
                    if int(fh.read().strip()) + 1 != int(port):
                        continue
            except (OSError, ValueError):
                continue
        chosen.append(name)
    return tuple(chosen), tuple(os.path.join(net, n) for n in chosen)


def discover(sysfs_root: str, wanted: Callable[[str], bool]) -> list[PortPaths]:
    """Every port of every wanted device; a device that vanishes mid-walk is skipped."""
    base = class_dir(sysfs_root)
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return []
    found: list[PortPaths] = []
    for device in devices:
        if not wanted(device):
            continue
        device_dir = os.path.join(base, device)
        try:
            ports = sorted(
                (p for p in os.listdir(os.path.join(device_dir, "ports")) if p.isdigit()), key=int)
        except OSError:
            continue
        node_guid = _read_small(os.path.join(device_dir, "node_guid"))
        for port in ports:
            netdevs, netdev_dirs = _netdevs(device_dir, port, len(ports))
            found.append(PortPaths(device, port, device_dir, os.path.join(device_dir, "ports", port),
                                   netdevs, netdev_dirs, node_guid))
    return found


def _read_small(path: str) -> str:
    """A short identity file's stripped text; empty when unreadable (the info series reports why)."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read(256).strip()
    except OSError:
        return ""


def _listdir(path: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path) if not n.startswith("."))
    except OSError:
        return []


# ---------------------------------------------------------------------------------------- collector


@dataclass
class _CounterFile:
    name: str
    attr: Attr
    width: int
    spec: MetricSpec | None
    scale: int
    hw: bool


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

    def attrs(self) -> list[Attr]:
        return [self.state, self.phys_state, self.rate] + [c.attr for c in self.counters]


OPTIONS = SectionSchema(
    "infiniband",
    "InfiniBand/RoCE port counters from sysfs.",
    (
        Option("interval", float, 0.0,
               "Seconds between counter runs; 0 uses [daemon] interval (10 s by default). Each "
               "counters/ read is a firmware query, so this need not be fast: flaps are caught by the "
               "linkflap watcher.", min=0.0, max=3600.0),
        Option("include_devices", str, "",
               "Regular expression (searched, so anchor it: `^mlx5_ib[0-9]+$`); only matching devices "
               "are collected. Empty means all.", check=regex_check),
        Option("exclude_devices", str, "",
               "Regular expression; matching devices are skipped (e.g. `^mlx5_an` to drop the Azure "
               "Ethernet VF).", check=regex_check),
        Option("hw_counters", bool, True,
               "Also export every driver counter in hw_counters/ (about 22-31 series per port)."),
        Option("read_mode", str, "auto",
               "`pread` keeps each file open and re-reads it; `open` opens it per read; `auto` uses "
               "pread on a real sysfs and open anywhere else (fixtures and simulations replace files).",
               choices=("auto", "pread", "open")),
    ),
)


def probe_tree(sysfs_root: str) -> Availability:
    """Whether ``<sysfs_root>/class/infiniband`` lists devices; shared with the link-flap watcher."""
    base = class_dir(sysfs_root)
    if not os.path.isdir(base):
        return Availability(False, f"no {base} (no InfiniBand driver loaded)")
    try:
        devices = os.listdir(base)
    except OSError as exc:
        return Availability(False, f"cannot list {base}: {exc.strerror or exc}")
    if not devices:
        return Availability(False, f"{base} has no devices (no RDMA-capable NIC)")
    return Availability(True, f"{len(devices)} device(s) under {base}")


class InfinibandCollector(Collector):
    name = "infiniband"
    description = "InfiniBand/RoCE port state, rate, PMA counters and mlx5 hw_counters from sysfs."
    options = OPTIONS
    implies = ("linkflap",)

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        self._wanted = device_filter(OPTIONS.value(cfg, "include_devices"), OPTIONS.value(cfg, "exclude_devices"))
        self._hw = bool(OPTIONS.value(cfg, "hw_counters"))
        self._cached = read_mode_cached(OPTIONS.value(cfg, "read_mode"), ctx.sysfs_root)
        self._faults = FaultLog(log)
        self._signature: Signature | None = None
        self._stale = True
        self._ports: list[_Port] = []
        self._detector = shared_detector(ctx)

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
                f"no {where} (no InfiniBand driver loaded)" if signature is None
                else f"{where} has no devices")
        if self._stale or signature != self._signature:
            self._rediscover(coll)
            self._signature = signature
        self._stale = False
        self._read_ports(coll)
        return coll

    # ------------------------------------------------------------------ discovery

    def _rediscover(self, coll: Collection) -> None:
        self.close()
        ports: list[_Port] = []
        statics: dict[str, dict[str, str]] = {}
        for paths in discover(self.ctx.sysfs_root, self._wanted):
            self._detector.identify(paths.key, paths.node_guid)
            if paths.device not in statics:
                statics[paths.device] = {
                    name: self._read_static(coll, os.path.join(paths.device_dir, name))
                    for name in ("fw_ver", "board_id", "hca_type", "node_guid")
                }
            ports.append(self._build_port(coll, paths, statics[paths.device]))
        self._ports = ports
        log.info("infiniband: watching %d port(s): %s", len(ports),
                 ", ".join(f"{p.paths.device}/{p.paths.port}" for p in ports) or "none")

    def _read_static(self, coll: Collection, path: str) -> str:
        try:
            text = Attr(path, cached=False).read().strip()
        except Fault as fault:
            self._faults.report(coll, fault, path)
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
        for name in _listdir(os.path.join(pdir, "counters")):
            known = PMA_BY_FILE.get(name)
            cf = _CounterFile(name, Attr(os.path.join(pdir, "counters", name), self._cached),
                              known.width if known else 64, PMA_SPECS[name] if known else None,
                              known.scale if known else 1, hw=False)
            port.counters.append(cf)
            if name == "link_downed":
                port.link_downed = cf
        if self._hw:
            for name in _listdir(os.path.join(pdir, "hw_counters")):
                if name in HW_NOT_COUNTERS:
                    continue
                port.counters.append(_CounterFile(
                    name, Attr(os.path.join(pdir, "hw_counters", name), self._cached),
                    HW_COUNTER_WIDTHS.get(name, 64), None, 1, hw=True))
        return port

    # ------------------------------------------------------------------ reading

    def _read_ports(self, coll: Collection) -> None:
        state_s: list[Sample] = []
        phys_s: list[Sample] = []
        up_s: list[Sample] = []
        rate_s: list[Sample] = []
        info_s: list[Sample] = []
        per_spec: dict[str, list[Sample]] = {}
        other_s: list[Sample] = []
        hw_s: list[Sample] = []
        sat_s: list[Sample] = []
        for port in self._ports:
            labels = port.labels
            info_s.append(port.info)
            state = phys = None
            try:
                state = parse_state(port.state.read(), STATE_NAMES)
                state_s.append(Sample(labels, float(state)))
            except Fault as fault:
                self._fault(coll, fault, port.state.path)
            try:
                phys = parse_state(port.phys_state.read(), PHYS_STATE_NAMES)
                phys_s.append(Sample(labels, float(phys)))
            except Fault as fault:
                self._fault(coll, fault, port.phys_state.path)
            if state is not None:
                up_s.append(Sample(labels, 1.0 if is_up(state, phys) else 0.0))
            try:
                rate_s.append(Sample(labels, parse_rate(port.rate.read())))
            except Fault as fault:
                self._fault(coll, fault, port.rate.path)
            link_downed: int | None = None
            for cf in port.counters:
                try:
                    value = parse_counter(cf.attr.read(), cf.width)
                except Fault as fault:
                    self._fault(coll, fault, cf.attr.path)
                    continue
                if cf.width < 64 and value == (1 << cf.width) - 1:
                    sat_s.append(Sample(labels + (("counter", cf.name),), 1.0))
                if cf.spec is not None:
                    per_spec.setdefault(cf.name, []).append(Sample(labels, float(value * cf.scale)))
                elif cf.hw:
                    hw_s.append(Sample(labels + (("counter", cf.name),), float(value)))
                else:
                    other_s.append(Sample(labels + (("counter", cf.name),), float(value)))
                if cf is port.link_downed:
                    link_downed = value
            if link_downed is not None:
                self._detector.observe(port.paths.key, time.monotonic(), link_downed=link_downed,
                                       link_downed_saturated=link_downed == 255)
        coll.add(SPEC_INFO, info_s)
        coll.add(SPEC_STATE, state_s)
        coll.add(SPEC_PHYS, phys_s)
        coll.add(SPEC_UP, up_s)
        coll.add(SPEC_RATE, rate_s)
        for name, spec in PMA_SPECS.items():
            coll.add(spec, per_spec.get(name, ()))
        coll.add(SPEC_PMA_OTHER, other_s)
        coll.add(SPEC_HW, hw_s)
        coll.add(SPEC_SATURATED, sat_s)

    def _fault(self, coll: Collection, fault: Fault, path: str) -> None:
        self._faults.report(coll, fault, path)
        if fault.reason == "vanished":
            self._stale = True  # a file or device went away: walk the tree again next run

    # ------------------------------------------------------------------ table

    @classmethod
    def summarize(cls, snapshot: Snapshot) -> Table | None:
        info = snapshot.family(SPEC_INFO.name)
        if info is None:
            return None

        def by_port(name: str) -> dict[tuple[str | None, str | None], float]:
            fam = snapshot.family(name)
            if fam is None:
                return {}
            return {(s.label("device"), s.label("port")): s.value for s in fam.samples}

        state = by_port(SPEC_STATE.name)
        rate = by_port(SPEC_RATE.name)
        rx = by_port(PMA_SPECS["port_rcv_data"].name)
        tx = by_port(PMA_SPECS["port_xmit_data"].name)
        flaps = by_port("gpumon_ib_link_flaps_total")
        errors: dict[tuple[str | None, str | None], list[str]] = {}
        for counter in PMA_COUNTERS:
            if counter.scale != 1 or "packets" in counter.file:
                continue
            if counter.file == "port_xmit_wait":
                continue
            for key, value in by_port(counter.metric).items():
                if value:
                    errors.setdefault(key, []).append(f"{_ERROR_SHORT.get(counter.file, counter.file)}={value:g}")
        rows = []
        for sample in info.samples:
            key = (sample.label("device"), sample.label("port"))
            layer = "ETH" if sample.label("link_layer") == "Ethernet" else "IB"
            state_id = state.get(key)
            errs = " ".join(errors.get(key, [])) or "-"
            if len(errs) > 34:
                errs = errs[:31] + "..."
            rows.append((
                f"{key[0]}/{key[1]}",
                (sample.label("netdev") or "-")[:12],
                f"{layer} {STATE_NAMES.get(int(state_id), '?') if state_id is not None else '?'}",
                f"{rate[key] * 8 / 1e9:g}G" if key in rate else "?",
                _human(rx.get(key)),
                _human(tx.get(key)),
                f"{flaps[key]:g}" if key in flaps else "-",
                errs,
            ))
        return Table("InfiniBand ports", ("port", "netdev", "state", "rate", "rx", "tx", "flaps", "errors"),
                     tuple(rows))


_ERROR_SHORT = {
    "symbol_error": "sym", "link_error_recovery": "recov", "link_downed": "downed",
    "port_rcv_errors": "rcv_err", "port_rcv_remote_physical_errors": "rcv_rphys",
    "port_rcv_switch_relay_errors": "relay", "port_xmit_discards": "discards",
    "port_xmit_constraint_errors": "xconstr", "port_rcv_constraint_errors": "rconstr",
    "local_link_integrity_errors": "integrity", "excessive_buffer_overrun_errors": "overrun",
    "VL15_dropped": "vl15",
}


def _human(value: float | None) -> str:
    if value is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(value) < 1000 or unit == "PB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1000
    return f"{value:.1f}PB"  # pragma: no cover - loop always returns

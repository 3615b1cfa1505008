"""InfiniBand sysfs (``<sysfs-root>/class/infiniband``): where the ports are, how to read their files,
what the values mean. A library in the manner of node_exporter's procfs: it knows the source and its
quirks, and no metric names; the ``infiniband`` and ``linkflap`` collectors both build on it.

Quirks it owns: counters narrower than 64 bits saturate (sticky) rather than wrap; ``port_xmit_data``
and ``port_rcv_data`` count 4-octet words; old kernels print ``N/A (no PMA)`` and new ones fail the
read with EINVAL/ENOSYS; any file may be garbled, absent or (in a broken tree) a FIFO, which must
never block a reader. Each attribute is opened once and re-read with ``pread`` on a real sysfs, where
an attribute is never replaced; anywhere else (fixtures, ``--simulate``) files are opened per read.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumon.config import Option, regex_check
from gpumon.model import Collection, StateReason

READ_SIZE = 4096
U64_MAX = (1 << 64) - 1
MAX_RATE_GBPS = 100_000.0
"""Anything faster than 100 Tb/s is a garbled file, not a link."""

STATE_NAMES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATE_NAMES = {0: "NoStateChange", 1: "Sleep", 2: "Polling", 3: "Disabled",
                    4: "PortConfigurationTraining", 5: "LinkUp", 6: "LinkErrorRecovery", 7: "PhyTest"}

DEVICE_OPTIONS: tuple[Option, ...] = (
    Option("include_devices", str, "",
           "Regular expression (searched, so anchor it: `^mlx5_ib[0-9]+$`); only matching devices "
           "are collected and watched (infiniband and linkflap). Empty means all.", check=regex_check),
    Option("exclude_devices", str, "",
           "Regular expression; matching devices are skipped by infiniband and linkflap (e.g. `^mlx5_an` "
           "to drop the Azure Ethernet VF).", check=regex_check),
    Option("read_mode", str, "auto",
           "`pread` keeps each file open and re-reads it; `open` opens it per read; `auto` uses "
           "pread on a real sysfs and open anywhere else (fixtures and simulations replace files). "
           "Applies to infiniband and linkflap.", choices=("auto", "pread", "open")),
)
"""How this host's IB tree is read: one setting for every collector that reads it, kept in
``[infiniband]``."""

# ---------------------------------------------------------------------------------------- catalogue


@dataclass(frozen=True)
class PmaFile:
    """One ``counters/`` (PMA) file: its width in bits and the factor to its base unit."""

    file: str
    width: int
    scale: int = 1


PMA_FILES: tuple[PmaFile, ...] = (
    PmaFile("port_xmit_data", 64, 4),  # 4-octet words
    PmaFile("port_rcv_data", 64, 4),
    PmaFile("port_xmit_packets", 64),
    PmaFile("port_rcv_packets", 64),
    PmaFile("unicast_xmit_packets", 64),
    PmaFile("unicast_rcv_packets", 64),
    PmaFile("multicast_xmit_packets", 64),
    PmaFile("multicast_rcv_packets", 64),
    PmaFile("symbol_error", 16),
    PmaFile("link_error_recovery", 8),
    PmaFile("link_downed", 8),
    PmaFile("port_rcv_errors", 16),
    PmaFile("port_rcv_remote_physical_errors", 16),
    PmaFile("port_rcv_switch_relay_errors", 16),
    PmaFile("port_xmit_discards", 16),
    PmaFile("port_xmit_constraint_errors", 8),
    PmaFile("port_rcv_constraint_errors", 8),
    PmaFile("local_link_integrity_errors", 4),
    PmaFile("excessive_buffer_overrun_errors", 4),
    PmaFile("VL15_dropped", 16),
    PmaFile("port_xmit_wait", 32),
)
PMA_BY_FILE = {c.file: c for c in PMA_FILES}

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


def saturated(value: int, width: int) -> bool:
    """A counter narrower than 64 bits stuck at its maximum: sticky, it no longer counts."""
    return width < 64 and value == (1 << width) - 1


def counter_width(name: str, hw: bool) -> int:
    """Bits of a ``counters/`` (``hw=False``) or ``hw_counters/`` file; unknown ones are taken as 64."""
    if hw:
        return HW_COUNTER_WIDTHS.get(name, 64)
    known = PMA_BY_FILE.get(name)
    return known.width if known else 64


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
        return self.read_bytes().decode("utf-8", "replace")

    def read_bytes(self) -> bytes:
        """The attribute's bytes, undecoded: a reader that compares them with the previous read parses
        only what changed. Raises :class:`Fault`."""
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
        return data

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


class Parsed:
    """An attribute and its last parsed value: the value is parsed again only when the bytes changed
    (most counters of a healthy port do not move between runs)."""

    __slots__ = ("attr", "parse", "raw", "value")

    def __init__(self, attr: Attr, parse: Callable[[str], Any]) -> None:
        self.attr, self.parse = attr, parse
        self.raw: bytes | None = None
        self.value: Any = None

    def get(self) -> Any:
        """The parsed value; raises :class:`Fault` (on every read that fails, as an uncached one)."""
        raw = self.attr.read_bytes()
        if raw != self.raw:
            self.raw = None
            self.value = self.parse(raw.decode("utf-8", "replace"))
            self.raw = raw
        return self.value


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


Signature = tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]


def tree_signature(sysfs_root: str) -> Signature | None:
    """Cheap fingerprint of the device set (names, link targets, netdev names, port names); None when
    the class is absent.

    A VF re-plugged under the same name comes back at another link target, so it changes too; an
    IPoIB netdev that appears after the HCA (ib_ipoib loaded late, a udev rename) changes it as well,
    and so does a port that goes away and comes back unchanged.
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
        link, net, ports_dir = _signature_paths(base, name)
        try:
            target = os.readlink(link)
        except OSError:
            target = ""
        try:
            netdevs = tuple(sorted(os.listdir(net)))
        except OSError:
            netdevs = ()
        try:
            ports = tuple(sorted(os.listdir(ports_dir)))
        except OSError:
            ports = ()
        result.append((name, target, netdevs, ports))
    return tuple(result)


@functools.lru_cache(maxsize=256)
def _signature_paths(base: str, name: str) -> tuple[str, str, str]:
    """The three paths the signature looks at for one device, joined once (it runs every collection)."""
    link = os.path.join(base, name)
    return link, os.path.join(link, "device", "net"), os.path.join(link, "ports")


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
                if int(read_small(os.path.join(net, name, "dev_port"))) + 1 != int(port):
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
        try:
            node_guid = read_small(os.path.join(device_dir, "node_guid"))
        except OSError:
            node_guid = ""  # the info series reports why
        for port in ports:
            netdevs, netdev_dirs = _netdevs(device_dir, port, len(ports))
            found.append(PortPaths(device, port, device_dir, os.path.join(device_dir, "ports", port),
                                   netdevs, netdev_dirs, node_guid))
    return found


def read_small(path: str, size: int = 256) -> str:
    """A short identity file's stripped text, opened non-blocking like every attribute: a FIFO or a
    device node where a sysfs file should be must not hold the thread. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return os.read(fd, size).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def list_attrs(path: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path) if not n.startswith("."))
    except OSError:
        return []


def probe_tree(sysfs_root: str) -> tuple[bool, str, StateReason]:
    """Whether ``<sysfs_root>/class/infiniband`` lists devices, the sentence that says so, and why not."""
    base = class_dir(sysfs_root)
    if not os.path.isdir(base):
        return False, f"no {base} (no InfiniBand driver loaded)", StateReason.DRIVER_NOT_LOADED
    try:
        devices = os.listdir(base)
    except OSError as exc:
        return False, f"cannot list {base}: {exc.strerror or exc}", _listing_cause(exc)
    if not devices:
        return False, f"{base} has no devices (no RDMA-capable NIC)", StateReason.NO_SOURCE
    return True, f"{len(devices)} device(s) under {base}", StateReason.NONE


def _listing_cause(exc: OSError) -> StateReason:
    """Refused (EACCES, EPERM), gone between the look and the listing (ENOENT), or anything else."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return StateReason.NO_PERMISSION
    return StateReason.NO_SOURCE if exc.errno == errno.ENOENT else StateReason.ERROR

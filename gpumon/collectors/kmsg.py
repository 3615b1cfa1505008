"""Driver messages from the kernel log (``/dev/kmsg``): XIDs, NVSwitch SXIDs, mlx5 health and port
events, IPoIB/netdev carrier changes.

Each run reads every record the kernel has added since the last one, without blocking
(:mod:`gpumon.sources.kmsg`), recognises the driver lines (:mod:`gpumon.sources.driver_log`) and turns
them into events (with the raw line) and counters. The first start begins at the end of the log; a
restart resumes after the last record handled (position and boot id in the state directory), and
records the ring buffer overwrote meanwhile are counted as lost.

An XID that NVML's event API also reported (the ``xid`` collector) counts once: kernel-log XIDs are
held for a short grace period and dropped when the shared :class:`gpumon.xid_ledger.XidLedger` says
NVML had it. Without the ``xid`` collector the kernel log is the source of every XID.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gpumon.catalogue.host import (
    KMSG_LOST as LOST,
)
from gpumon.catalogue.host import (
    KMSG_RECORDS as RECORDS,
)
from gpumon.catalogue.host import (
    KMSG_XIDS as XIDS,
)
from gpumon.catalogue.host import (
    SXIDS,
)
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.collectors.nvml_tables import xid_info
from gpumon.config import Option, Section, SectionSchema
from gpumon.log_once import COUNTED, LogOnce
from gpumon.model import Collection, Event, MetricSpec, Severity, StateReason
from gpumon.sources import driver_log
from gpumon.sources.kmsg import BOOT_ID_PATH, DEFAULT_PATH, FIRST_START, Batch, KmsgReader, Record
from gpumon.sources.pci import nvml_bus_id, sysfs_name
from gpumon.xid_ledger import XidLedger, shared_ledger

log = logging.getLogger("gpumon.collectors.kmsg")

GRACE = 2.0
"""Seconds a kernel-log XID waits for NVML's copy of it before it counts as the kernel log's own."""
MAX_PER_RUN = 100_000
CHUNK = 1_000
"""Records read and handled at a time within a run."""
STATE_FILE = "kmsg.json"
KERNEL = 0
"""The kernel's own facility (LOG_KERN): a process writing to /dev/kmsg gets LOG_USER or the one its
``<N>`` prefix names, never 0, so only facility 0 records can be driver lines."""
NETDEV = re.compile(r"[\w.:-]{1,15}", re.ASCII)
"""A name that can be a netdev (IFNAMSIZ - 1 characters, no ``/``): the name becomes a sysfs path."""

KINDS = ("xid", "gpu_off_bus", "sxid", "mlx5_health", "mlx5_port_module", "mlx5_port_module_error",
         "mlx5_pcie_power", "netdev_link_up", "netdev_link_down", "netdev_link_ready", "other", "userspace")



@dataclass(frozen=True)
class KmsgSettings:
    interval: float
    path: str
    first_start: str


OPTIONS = SectionSchema(
    "kmsg",
    "Driver messages from the kernel log (/dev/kmsg; needs root or CAP_SYSLOG).",
    (
        Option("interval", float, 0.0, "Seconds between reads; 0 uses [daemon] interval.", min=0.0, max=3600.0),
        Option("path", str, DEFAULT_PATH, "The kernel log device."),
        Option("first_start", str, "end",
               "Where to begin with no saved position: end (new records only), cleared (after the last "
               "dmesg --clear) or all (every record still in the ring buffer).", choices=tuple(FIRST_START)),
    ),
    KmsgSettings,
)

_SEVERITY = {"gpu_off_bus": Severity.CRITICAL, "mlx5_health": Severity.ERROR,
             "mlx5_port_module_error": Severity.WARNING, "mlx5_pcie_power": Severity.WARNING,
             "netdev_link_down": Severity.WARNING}


class KmsgCollector(Collector):
    name = "kmsg"
    description = "XID, SXID, mlx5 and IPoIB messages from the kernel log."
    options = OPTIONS
    settings: KmsgSettings

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        state_file = os.path.join(ctx.state_dir, STATE_FILE) if ctx.state_dir else None
        sim = ctx.simulation
        simulated = sim is not None and self.settings.path == sim.kernel_log.path
        # a simulated host's log belongs to its own boots (a simulated reboot starts it again)
        self.reader = KmsgReader(self.settings.path, state_file, self.settings.first_start,
                                 boot_id_path=sim.boot_id_path if simulated else BOOT_ID_PATH)
        self.ledger: XidLedger = shared_ledger(ctx)
        self._records: Counter[str] = Counter(dict.fromkeys(KINDS, 0))
        self._lost = 0
        self._xids: Counter[tuple[str, str]] = Counter()
        self._sxids: Counter[tuple[str, str, str]] = Counter()
        self._pending: list[tuple[Record, driver_log.DriverMessage]] = []
        self._log_once = LogOnce(log, suffix=COUNTED)
        self._ib_by_pci: dict[str, str] = {}
        self._ipoib: set[str] = set()
        """IPoIB netdevs seen (only those: every other name is asked again, so pod churn's veths
        leave nothing behind)."""
        self._boot_wall = time.time() - time.monotonic()

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (RECORDS, LOST, XIDS, SXIDS)

    def probe(self) -> Availability:
        try:
            os.close(os.open(self.settings.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as exc:
            return Availability(False, _reason(self.settings.path, exc), cause=_cause(exc))
        return Availability(True)

    def collect(self) -> Collection:
        out = Collection()
        taken = 0
        while True:  # in chunks, so that a busy interval's records do not all live at once
            try:
                batch = self.reader.read(min(CHUNK, MAX_PER_RUN - taken))
            except OSError as exc:
                self.reader.close()
                if not taken:
                    raise CollectorUnavailable(_reason(self.settings.path, exc), _cause(exc)) from None
                break  # what was read counts; the next run opens the log again (or fails)
            self._take(batch, out)
            taken += len(batch.records)
            if not batch.more or taken >= MAX_PER_RUN:
                break
        self._settle(out, time.time())
        self._save()
        self._publish(out)
        return out

    # --- records -------------------------------------------------------------------------------------

    def _take(self, batch: Batch, out: Collection) -> None:
        self._lost += batch.lost
        if batch.lost:
            self._log_once.warning("lost", "kernel log: %d records were overwritten before they were read",
                                   batch.lost)
        for raw in batch.garbled:
            out.count_error("garbled")
            self._log_once.warning("garbled", "kernel log: record not in the dev-kmsg format: %r", raw[:120])
        for record in batch.records:
            self._handle(record, out)

    def _handle(self, record: Record, out: Collection) -> None:
        if record.facility != KERNEL:  # written by a process: anyone with the device can say "Xid"
            self._records["userspace"] += 1
            return
        msg = driver_log.recognise(record.message)
        if msg is None:
            self._records["other"] += 1
            if record.message.startswith("NVRM: Xid") or (record.message.startswith("nvidia-nvswitch")
                                                           and ": SXid (" in record.message):
                out.count_error("unrecognised_driver_line")
                self._log_once.warning("unrecognised", "kernel log: driver line in an unknown format: %s",
                                       record.message)
            return
        if msg.kind == "netdev_link_ready" and not self._is_ipoib(str(msg.attrs["netdev"])):
            self._records["other"] += 1
            return
        self._records[msg.kind] += 1
        if msg.kind == "xid":
            self._pending.append((record, msg))
        else:
            out.events.append(self._event(record, msg))

    def _settle(self, out: Collection, now: float) -> None:
        """Decide the held XIDs whose grace period is over: NVML's, or the kernel log's own."""
        keep = []
        for record, msg in self._pending:
            when = self._wall(record)
            if now - when < GRACE:
                keep.append((record, msg))
                continue
            xid = int(msg.attrs["xid"])
            bus = nvml_bus_id(msg.pci)
            if self.ledger.claim_kernel(bus, xid, when):
                self._xids[(bus, str(xid))] += 1
                out.events.append(self._event(record, msg))
        self._pending = keep

    def _event(self, record: Record, msg: driver_log.DriverMessage) -> Event:
        bus = nvml_bus_id(msg.pci) if msg.pci else ""
        subject = {"pci_bus_id": bus} if bus else {}
        attrs: dict[str, Any] = {**msg.attrs, "line": record.message, "source": "kmsg", "seq": record.seq}
        if msg.kind == "xid":
            info = xid_info(int(msg.attrs["xid"]))
            attrs["meaning"] = info.meaning
            return Event("gpu_xid", info.severity, subject,
                         f"GPU at {bus} XID {msg.attrs['xid']}: {info.meaning}", attrs, self._wall(record))
        if msg.kind == "sxid":
            self._sxids[(str(msg.attrs["switch"]), bus, str(msg.attrs["sxid"]))] += 1
            severity = Severity.ERROR if msg.attrs["fatal"] else Severity.WARNING
            return Event("nvswitch_sxid", severity, {**subject, "switch": str(msg.attrs["switch"])},
                         f"{msg.attrs['switch']} SXID {msg.attrs['sxid']}", attrs, self._wall(record))
        device = self._ib_device(msg.pci) if msg.pci else ""
        if device:
            subject["device"] = device
        if "netdev" in msg.attrs:
            subject["netdev"] = str(msg.attrs["netdev"])
        return Event(msg.kind, _SEVERITY.get(msg.kind, Severity.INFO), subject, record.message, attrs,
                     self._wall(record))

    def _wall(self, record: Record) -> float:
        """Wall time of a record: the log clock counts from boot like CLOCK_MONOTONIC."""
        return self._boot_wall + record.usec / 1e6

    # --- names -------------------------------------------------------------------------------------

    def _ib_device(self, pci: str) -> str:
        """The RDMA device on this PCI function (``mlx5_ib0``), so events join the IB series."""
        name = sysfs_name(pci)
        if name not in self._ib_by_pci:
            base = os.path.join(self.ctx.sysfs_root, "class", "infiniband")
            try:
                for dev in os.listdir(base):
                    target = os.path.basename(os.path.realpath(os.path.join(base, dev, "device")))
                    self._ib_by_pci[target] = dev
            except OSError:
                pass
            self._ib_by_pci.setdefault(name, "")
        return self._ib_by_pci[name]

    def _is_ipoib(self, netdev: str) -> bool:
        """ARPHRD_INFINIBAND (32) in ``class/net/<netdev>/type``: an IPoIB interface. The name comes
        from a log line: one that is no netdev name, or a path that is no regular file, is not IPoIB."""
        if netdev in self._ipoib:
            return True
        if not NETDEV.fullmatch(netdev) or netdev in (".", ".."):
            return False
        path = os.path.join(self.ctx.sysfs_root, "class", "net", netdev, "type")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False  # not there (yet): ask again next time
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            ipoib = os.read(fd, 64).strip() == b"32"
        except OSError:
            return False
        finally:
            os.close(fd)
        if ipoib:
            if len(self._ipoib) >= 1024:
                self._ipoib.clear()
            self._ipoib.add(netdev)
        return ipoib

    # --- output ------------------------------------------------------------------------------------

    def _save(self) -> None:
        if not self.ctx.persist_state:  # a one-shot command: the daemon's position stays where it is
            return
        seq = min(r.seq for r, _ in self._pending) - 1 if self._pending else None
        try:
            self.reader.save(seq)
        except OSError as exc:
            self._log_once.warning("save", "kernel log: cannot save the read position (%s); a restart starts at "
                                   "the end", exc)

    def _publish(self, out: Collection) -> None:
        out.add(RECORDS, [RECORDS.sample(n, kind) for kind, n in sorted(self._records.items())])
        out.add(LOST, [LOST.sample(self._lost)])
        out.add(XIDS, [XIDS.sample(n, bus, xid) for (bus, xid), n in sorted(self._xids.items())])
        out.add(SXIDS, [SXIDS.sample(n, *key) for key, n in sorted(self._sxids.items())])

    def inherit(self, previous: Collector) -> None:
        """After a reload: keep the totals, the position and the XIDs still waiting for NVML."""
        if not isinstance(previous, KmsgCollector):
            return
        self._records.update(previous._records)
        self._lost += previous._lost
        self._xids.update(previous._xids)
        self._sxids.update(previous._sxids)
        if self.settings.path != previous.settings.path:
            self._pending = previous._pending + self._pending
            return
        if self.reader.fd is not None:
            return  # this reader resumed from the saved position, before the oldest waiting XID, and
            # reads those again: carrying them as well would count them twice
        self._pending = previous._pending + self._pending
        if previous.reader.fd is not None:
            self.reader, previous.reader = previous.reader, self.reader
        elif previous.reader.last_seq is not None:  # closed already: go on after its last record
            self.reader.resume_after(previous.reader.last_seq)

    def close(self) -> None:
        self.reader.close()


def _cause(exc: OSError) -> StateReason:
    """Refused (needs root or CAP_SYSLOG), else an error: a missing kernel log included."""
    return StateReason.NO_PERMISSION if exc.errno in (errno.EACCES, errno.EPERM) else StateReason.ERROR


def _reason(path: str, exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"cannot read {path}: {exc.strerror} (needs root or CAP_SYSLOG)"
    if exc.errno in (errno.ENOENT, errno.ENODEV, errno.ENXIO):
        return f"no kernel log at {path}"
    return f"cannot read {path}: {exc.strerror or exc}"

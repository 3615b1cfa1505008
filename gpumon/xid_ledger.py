"""One XID, counted once, whether NVML's event API or the kernel log (or both) reported it.

The ``xid`` collector notes every XID its NVML event thread receives; the ``kmsg`` collector, reading
the same XID from the driver's ``NVRM: Xid`` line a moment later, asks :meth:`XidLedger.claim_kernel`
and reports the line as an XID only when NVML did not. The two collectors stay independent: each
reaches the ledger through :meth:`gpumon.collectors.base.Context.get_shared`, and with no ``xid``
collector running (no NVML, or its events unsupported) the ledger is empty and the kernel log is the
source of every XID.

GPUs are keyed on (domain, bus, device) of their PCI address: NVRM prints no function number.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from gpumon.sources.pci import parts

WINDOW = 30.0
"""Seconds either side within which an NVML XID and a kernel-log XID of the same GPU and number are
the same event (the driver emits both from one error; the log's clock is converted to wall time)."""
MAX_KEPT = 10_000

Key = tuple[int, int, int, int]


def _key(bus_id: str, xid: int) -> Key | None:
    p = parts(bus_id)
    return None if p is None else (p[0], p[1], p[2], int(xid))


class XidLedger:
    """Thread-safe: the NVML event thread writes, the kmsg collector's thread reads."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._nvml: dict[Key, deque[float]] = {}
        self._kept = 0

    def note_nvml(self, bus_id: str, xid: int, when: float) -> None:
        """NVML reported ``xid`` on the GPU at ``bus_id`` at wall time ``when``."""
        key = _key(bus_id, xid)
        if key is None:
            return
        with self._lock:
            if self._kept >= MAX_KEPT:
                self._prune(when)
            self._nvml.setdefault(key, deque()).append(when)
            self._kept += 1

    def claim_kernel(self, bus_id: str, xid: int, when: float) -> bool:
        """True when the kernel-log XID is new (NVML did not report it within the window); a match
        is consumed, so two identical XIDs in quick succession still count twice."""
        key = _key(bus_id, xid)
        if key is None:
            return True
        with self._lock:
            times = self._nvml.get(key)
            if not times:
                return True
            for t in list(times):
                if abs(t - when) <= self.window:
                    times.remove(t)
                    self._kept -= 1
                    return False
            return True

    def _prune(self, now: float) -> None:
        for key in list(self._nvml):
            times = self._nvml[key]
            while times and times[0] < now - 2 * self.window:
                times.popleft()
                self._kept -= 1
            if not times:
                del self._nvml[key]


def shared_ledger(ctx: Any) -> XidLedger:
    """The daemon's one ledger (``ctx`` is a :class:`gpumon.collectors.base.Context`)."""
    return ctx.get_shared("xid_ledger", XidLedger)


def bus_id_of(session: Any, dev: Any) -> str:
    """The GPU's NVML ``busId``, asked once and kept on the device (a GPU that fell off the bus no
    longer answers, so the xid collector asks while it still does, at event registration)."""
    cached = dev.extra.get("pci_bus_id")
    if cached is not None:
        return cached
    try:
        bus = session.call("nvmlDeviceGetPciInfo_v3", dev.handle).busId
        text = bus.decode() if isinstance(bus, bytes) else str(bus)
    except Exception:  # noqa: BLE001 - no bus id: this GPU's XIDs cannot be matched, nothing worse
        return ""
    dev.extra["pci_bus_id"] = text
    return text

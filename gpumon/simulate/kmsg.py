"""A simulated host's kernel log: the lines a real host's drivers print when a fault happens, kept as
``/dev/kmsg`` hands them out, so the ``kmsg`` collector reads it as it reads the device.

The file (``<home>/kmsg``) holds one record after another in the format of linux
Documentation/ABI/testing/dev-kmsg: ``prio,seq,usec,flags;message\\n`` then `` KEY=VALUE`` dictionary
lines (a ``dev_printk`` adds ``SUBSYSTEM`` and ``DEVICE``; linux drivers/base/core.c
``dev_printk_emit``/``set_dev_info``: ``DEVICE=+<subsystem>:<device name>``). ``seq`` runs on across
daemon restarts and starts at 0 with a new boot (a ``reboot``: the file begins again); ``usec`` is this
machine's monotonic clock, the clock the kernel stamps records with. Each record is one ``write`` to a
file opened with ``O_APPEND``, so a reader never sees half of one.

The message texts are the drivers' (each function cites its source); tests/fixtures/kmsg/driver_lines.txt
holds real lines of each kind and :mod:`gpumon.sources.driver_log` recognises them.
"""

from __future__ import annotations

import os
import re
import threading
import time

from gpumon.simulate.files import replace_file
from gpumon.sources.pci import parts, sysfs_name

FACILITY_KERN = 0
ERR, WARNING, INFO = 3, 4, 6
"""Levels (linux include/linux/kern_levels.h): KERN_ERR, KERN_WARNING, KERN_INFO."""
_HEADER = re.compile(rb"^[0-9]+,([0-9]+),", re.MULTILINE)


class KernelLog:
    """Appends records to a simulated host's kernel log; ``fresh``: a new boot, the log starts empty."""

    def __init__(self, path: str, fresh: bool = False, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self._lock = threading.Lock()
        self._seq = 0
        if read_only:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if fresh:
            self.reboot()
        else:
            self._seq = _next_seq(path)
            if not os.path.exists(path):
                self.reboot()

    def reboot(self) -> None:
        """A new boot: an empty log, sequence numbers from 0 (replaced whole: a reader of the old
        boot's file reads no more from it)."""
        if self.read_only:
            return
        with self._lock:
            replace_file(self.path, b"")
            self._seq = 0

    def write(self, message: str, level: int = INFO, device: str = "") -> None:
        """One kernel record; ``device``: the PCI function (sysfs name) a ``dev_printk`` names."""
        if self.read_only:
            return
        with self._lock:
            text = f"{FACILITY_KERN << 3 | level},{self._seq},{time.monotonic_ns() // 1000},-;{message}\n"
            if device:
                text += f" SUBSYSTEM=pci\n DEVICE=+pci:{device}\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
            self._seq += 1


def _next_seq(path: str) -> int:
    """The sequence number after the log's last record (0 for none)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return 0
    seqs = _HEADER.findall(data)
    return int(seqs[-1]) + 1 if seqs else 0


# -- the drivers' lines --------------------------------------------------------------------------------

def xid_line(bus_id: str, xid: int, pid: int | None, name: str) -> str:
    """The NVIDIA driver's XID line: ``NVRM: Xid (PCI:DDDD:BB:SS): N, pid=P, name=C, <text>`` (the
    device as domain:bus:slot; ``pid='<unknown>', name=<unknown>`` when no process caused it):
    docs.nvidia.com/deploy/xid-errors and tests/fixtures/kmsg/driver_lines.txt [X]."""
    domain, bus, slot = (parts(bus_id) or (0, 0, 0, 0))[:3]
    who = f"pid={pid}, name={name}" if pid else "pid='<unknown>', name=<unknown>"
    return f"NVRM: Xid (PCI:{domain:04x}:{bus:02x}:{slot:02x}): {xid}, {who}, {XID_TEXT.get(xid, 'Graphics Exception')}"


XID_TEXT = {
    13: "Graphics Exception: ESR 0x404600=0x80000002",
    31: "Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_3c000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000008",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, "
        "subpartition 0.",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    74: "NVLink: fatal error detected on link 4",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
}
"""What follows ``name=`` for the XIDs a simulation is asked for most (texts as the fixture's lines and
the XID catalogue print them); any other XID gets a generic text."""


def off_bus_line(bus_id: str) -> str:
    """``NVRM: GPU DDDD:BB:SS.F: GPU has fallen off the bus.`` (tests/fixtures/kmsg/driver_lines.txt [X])."""
    return f"NVRM: GPU {sysfs_name(bus_id)}: GPU has fallen off the bus."


def netdev_lines(pci: str, netdev: str, up: bool, ethernet: bool) -> list[str]:
    """What a port's carrier change prints: on an Ethernet port mlx5e's line (linux
    drivers/net/ethernet/mellanox/mlx5/core/en_main.c ``netdev_info(netdev, "Link up"/"Link down")``:
    ``mlx5_core <BDF> <netdev>: Link up``; IPoIB prints no carrier line of its own), and on any port
    coming up addrconf's ``IPv6: ADDRCONF(NETDEV_CHANGE): <netdev>: link becomes ready`` (linux
    net/ipv6/addrconf.c)."""
    lines = [f"mlx5_core {pci} {netdev}: Link {'up' if up else 'down'}"] if ethernet else []
    if up:
        lines.append(f"IPv6: ADDRCONF(NETDEV_CHANGE): {netdev}: link becomes ready")
    return lines


# PCIe AER (linux drivers/pci/pcie/aer.c, dev_fmt "AER: "): aer_print_port_info's "<severity> error
# message received from <BDF>" (here from the function itself: a simulated Azure VM's functions sit on
# their own virtual buses, no root port above them) then aer_print_error's lines, at KERN_WARNING for a
# correctable error and KERN_ERR otherwise.
AER_SEVERITY = {"correctable": "Corrected", "nonfatal": "Uncorrected (Non-Fatal)", "fatal": "Uncorrected (Fatal)"}
"""aer.c aer_error_severity_string."""
AER_TYPES = {
    "correctable": {"RxErr": (0, "Physical Layer"), "BadTLP": (6, "Data Link Layer"),
                    "BadDLLP": (7, "Data Link Layer"), "Rollover": (8, "Data Link Layer"),
                    "Timeout": (12, "Data Link Layer"), "NonFatalErr": (13, "Transaction Layer"),
                    "CorrIntErr": (14, "Transaction Layer"), "HeaderOF": (15, "Transaction Layer")},
    "uncorrectable": {"Undefined": (0, "Data Link Layer"), "DLP": (4, "Data Link Layer"),
                      "SDES": (5, "Data Link Layer"), "TLP": (12, "Transaction Layer"),
                      "FCP": (13, "Transaction Layer"), "CmpltTO": (14, "Transaction Layer"),
                      "CmpltAbrt": (15, "Transaction Layer"), "UnxCmplt": (16, "Transaction Layer"),
                      "RxOF": (17, "Transaction Layer"), "MalfTLP": (18, "Transaction Layer"),
                      "ECRC": (19, "Transaction Layer"), "UnsupReq": (20, "Transaction Layer"),
                      "ACSViol": (21, "Transaction Layer"), "UncorrIntErr": (22, "Transaction Layer"),
                      "BlockedTLP": (23, "Transaction Layer"), "AtomicOpBlocked": (24, "Transaction Layer"),
                      "TLPBlockedErr": (25, "Transaction Layer"), "PoisonTLPBlocked": (26, "Transaction Layer")},
}
"""Error type -> (status bit, layer): the names of aer.c aer_correctable_error_string and
aer_uncorrectable_error_string (also the line names of the aer_dev_* files, in that order), the bits of
include/uapi/linux/pci_regs.h PCI_ERR_COR_* / PCI_ERR_UNC_*, the layer by aer.c AER_GET_LAYER_ERROR
(RxErr physical; BadTLP to Timeout and DLP, SDES data link; the rest transaction)."""


def aer_types(severity: str) -> dict[str, tuple[int, str]]:
    return AER_TYPES["correctable" if severity == "correctable" else "uncorrectable"]


def aer_lines(driver: str, fn: str, ids: str, severity: str, kind: str) -> list[tuple[int, str]]:
    """(level, message) of the kernel's report of one AER error of ``kind`` at function ``fn`` (sysfs
    name) bound to ``driver``, ``ids`` its ``vendor:device``."""
    bit, layer = aer_types(severity)[kind]
    level = WARNING if severity == "correctable" else ERR
    agent = "Receiver ID" if severity == "correctable" or kind in ("DLP", "SDES", "MalfTLP", "ECRC") else "Requester ID"
    mask = 0x0000E000 if severity == "correctable" else 0x00400000
    return [(INFO, f"{driver} {fn}: AER: {AER_SEVERITY[severity]} error message received from {fn}"),
            (level, f"{driver} {fn}: PCIe Bus Error: severity={AER_SEVERITY[severity]}, type={layer}, ({agent})"),
            (level, f"{driver} {fn}:   device [{ids}] error status/mask={1 << bit:08x}/{mask:08x}"),
            (level, f"{driver} {fn}:    [{bit:2d}] {kind:<22s} (First)")]

"""PCIe Advanced Error Reporting counters from sysfs, for the GPUs, the RDMA HCAs and the bridges above them.

linux Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats: ``/sys/bus/pci/devices/<BDF>/``
``aer_dev_correctable``, ``aer_dev_fatal`` and ``aer_dev_nonfatal`` hold one ``<Name> <count>`` line per
error type (a name may hold spaces: split at the last one), the last being ``TOTAL_ERR_COR``,
``TOTAL_ERR_FATAL`` or ``TOTAL_ERR_NONFATAL``; a root port also has ``aer_rootport_total_err_cor``,
``_fatal`` and ``_nonfatal`` (one integer each: errors reported to it by the devices below). A kernel
without AER support, or a function without the capability, has none of these files.

GPUs are found as NVIDIA (vendor ``0x10de``) display controllers (class ``0x0300xx`` VGA, ``0x0302xx``
3D) in ``bus/pci/devices``; HCAs through ``class/infiniband/<dev>/device``; the bridges (switch ports,
root port) by walking each one's real path up the PCI hierarchy. Knows files, no metric names.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from gpumon.sources.ib_sysfs import Attr, Parsed

SEVERITIES = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal", "fatal": "aer_dev_fatal"}
TOTALS = {"correctable": "TOTAL_ERR_COR", "nonfatal": "TOTAL_ERR_NONFATAL", "fatal": "TOTAL_ERR_FATAL"}
ROOT_PORT = {"correctable": "aer_rootport_total_err_cor", "nonfatal": "aer_rootport_total_err_nonfatal",
             "fatal": "aer_rootport_total_err_fatal"}
NVIDIA = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")
_BDF = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
MAX_COUNT = (1 << 64) - 1


class BadStats(ValueError):
    """A file whose content is not ``<Name> <count>`` lines."""


@dataclass(frozen=True)
class Function:
    """One PCI function to watch: ``name`` as sysfs names it, ``role`` gpu|hca|bridge, ``device`` the
    RDMA device name of an HCA, ``parent`` the bridge above it (sysfs name; "" at the top)."""

    name: str
    role: str
    path: str
    device: str = ""
    parent: str = ""


def parse_stats(text: str) -> dict[str, int]:
    """``{"RxErr": 0, ..., "TOTAL_ERR_COR": 2}`` from one aer_dev_* file; raises :class:`BadStats`."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, value = line.rstrip().rpartition(" ")
        if not name or not value.isdigit() or int(value) > MAX_COUNT:
            raise BadStats(f"not '<name> <count>': {line[:60]!r}")
        counts[name.strip()] = int(value)
    if not counts:
        raise BadStats("empty file")
    return counts


def parse_count(text: str) -> int:
    """One ``aer_rootport_total_err_*`` value."""
    value = text.strip()
    if not value.isdigit() or int(value) > MAX_COUNT:
        raise BadStats(f"not a count: {value[:40]!r}")
    return int(value)


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as fh:
        return fh.read()


def _gpus(devices: str) -> list[str]:
    found = []
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return []
    for name in names:
        try:
            if _read(os.path.join(devices, name, "vendor")).strip() != NVIDIA:
                continue
            if _read(os.path.join(devices, name, "class")).strip().lower().startswith(GPU_CLASSES):
                found.append(name)
        except OSError:
            continue
    return found


def _hcas(sysfs_root: str) -> dict[str, str]:
    """sysfs function name -> RDMA device name."""
    base = os.path.join(sysfs_root, "class", "infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return {}
    return {os.path.basename(os.path.realpath(os.path.join(base, n, "device"))): n for n in names}


def _lineage(path: str) -> list[str]:
    """Real paths of the bridges above a function, nearest first (the parents named like a BDF)."""
    chain = []
    parent = os.path.dirname(path)
    while _BDF.fullmatch(os.path.basename(parent)):
        chain.append(parent)
        parent = os.path.dirname(parent)
    return chain


def discover(sysfs_root: str) -> list[Function]:
    """The GPUs and HCAs, then every bridge above them once."""
    devices = os.path.join(sysfs_root, "bus", "pci", "devices")
    hcas = _hcas(sysfs_root)
    endpoints: list[tuple[str, str, str]] = [(n, "gpu", "") for n in _gpus(devices)]
    endpoints += [(n, "hca", dev) for n, dev in sorted(hcas.items()) if _BDF.fullmatch(n)]
    found: dict[str, Function] = {}
    for name, role, device in endpoints:
        path = os.path.realpath(os.path.join(devices, name))
        if not os.path.isdir(path):
            path = os.path.realpath(os.path.join(sysfs_root, "class", "infiniband", device, "device"))
        chain = _lineage(path)
        found[name] = Function(name, role, path, device, os.path.basename(chain[0]) if chain else "")
        for i, bridge in enumerate(chain):
            bname = os.path.basename(bridge)
            up = os.path.basename(chain[i + 1]) if i + 1 < len(chain) else ""
            found.setdefault(bname, Function(bname, "bridge", bridge, "", up))
    return list(found.values())


def has_aer(fn: Function) -> bool:
    return any(os.path.exists(os.path.join(fn.path, f)) for f in (*SEVERITIES.values(), *ROOT_PORT.values()))


class Reader:
    """One function's AER files, those present when it was found: each kept open and re-read with
    pread on a real sysfs (``cached``), opened per read elsewhere; a file is parsed again only when
    its bytes changed, so a run costs a pread per file, not an open() and a parse."""

    def __init__(self, fn: Function, cached: bool) -> None:
        self.fn = fn
        self._stats = [(severity, Parsed(Attr(path, cached), _parser(parse_stats, file)))
                       for severity, file in SEVERITIES.items()
                       if os.path.exists(path := os.path.join(fn.path, file))]
        self._root = [(severity, Parsed(Attr(path, cached), _parser(parse_count, file)))
                      for severity, file in ROOT_PORT.items()
                      if os.path.exists(path := os.path.join(fn.path, file))]
        self._all = self._stats + self._root
        self.changed = True
        self.samples: Any = None
        """What the collector made of the last read (its own cache, kept with the function)."""

    def read(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """(per severity the file's counts, root-port totals); raises ib_sysfs.Fault (an unreadable
        file) or :class:`BadStats` naming the file in its message. ``changed`` says afterwards
        whether any file's bytes differ from the previous read."""
        before = [parsed.raw for _severity, parsed in self._all]
        self.changed = True
        out = ({severity: parsed.get() for severity, parsed in self._stats},
               {severity: parsed.get() for severity, parsed in self._root})
        self.changed = any(raw is None or raw is not parsed.raw for raw, (_s, parsed) in zip(before, self._all))
        return out

    def close(self) -> None:
        for _severity, parsed in self._all:
            parsed.attr.close()


def _parser(parse: Any, file: str) -> Any:
    """``parse`` with the file's name in its BadStats message."""
    return lambda text: _named(parse, text, file)


def _named(parser, text: str, file: str):  # noqa: ANN001, ANN202 - a parse with the file in its error
    try:
        return parser(text)
    except BadStats as exc:
        raise BadStats(f"{file}: {exc}") from None

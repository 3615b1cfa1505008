"""A simulated host's PCI functions with their AER counters, laid out as the kernel lays them out, so
the ``aer`` collector reads them as it reads ``/sys/bus/pci/devices``.

Each GPU and HCA function has ``vendor``, ``device`` and ``class`` (linux Documentation/ABI/testing/
sysfs-bus-pci) and ``aer_dev_correctable``, ``aer_dev_nonfatal``, ``aer_dev_fatal`` (linux
Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats: one ``<Name> <count>`` line per error type
in the kernel's order, then ``TOTAL_ERR_COR`` / ``TOTAL_ERR_NONFATAL`` / ``TOTAL_ERR_FATAL``), with a
link in ``bus/pci/devices``. An Azure VM sees each passed-through GPU and each HCA virtual function on a
PCI domain of its own under Hyper-V's virtual PCI bus, with no bridge or root port above it
(``devices/pci<domain>:00/<function>``), so the simulated profiles have none either.

The counters since boot are kept in ``aer.json`` beside the host's boot id (a daemon restart keeps
them, as the kernel does; a ``reboot`` zeroes them).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from gpumon.simulate.files import replace_file
from gpumon.simulate.kmsg import AER_TYPES

log = logging.getLogger("gpumon.simulate")

CLASSES = {"gpu": "0x030200", "InfiniBand": "0x020700", "Ethernet": "0x020000"}
"""PCI class codes (PCI Code and ID Assignment spec): 3D controller (an SXM GPU, as NVIDIA's data-centre
GPUs report), InfiniBand controller, Ethernet controller."""
FILES = {"correctable": ("aer_dev_correctable", "TOTAL_ERR_COR", "correctable"),
         "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL", "uncorrectable"),
         "fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL", "uncorrectable")}
STATE_FILE = "aer.json"


@dataclass
class Function:
    """One PCI function: its sysfs name, the driver bound to it and ``vendor:device``."""

    name: str
    driver: str
    ids: str
    counts: dict[str, dict[str, int]] = field(default_factory=dict)


class PciTree:
    """The functions of one simulated host under ``sysfs_root``; ``state``: where the counters since
    boot ``boot_id`` are kept (read, and written unless ``read_only``)."""

    def __init__(self, sysfs_root: str, state: str, boot_id: str, read_only: bool = False) -> None:
        self.root = sysfs_root
        self.state = state
        self.read_only = read_only
        self.boot_id = boot_id
        self.functions: dict[str, Function] = {}
        self.gpus: dict[int, str] = {}
        """GPU index -> its function's sysfs name."""
        self.hcas: dict[str, str] = {}
        """RDMA device name -> its function's sysfs name."""

    def add(self, name: str, path: str, driver: str, vendor: int, device: int, cls: str) -> Function:
        """A function at ``path`` (below the tree's ``devices``, made if missing)."""
        os.makedirs(path, exist_ok=True)
        _write(os.path.join(path, "vendor"), f"0x{vendor:04x}\n")
        _write(os.path.join(path, "device"), f"0x{device:04x}\n")
        _write(os.path.join(path, "class"), f"{cls}\n")
        links = os.path.join(self.root, "bus", "pci", "devices")
        os.makedirs(links, exist_ok=True)
        link = os.path.join(links, name)
        if not os.path.islink(link):
            os.symlink(os.path.relpath(path, links), link)
        fn = Function(name, driver, f"{vendor:04x}:{device:04x}",
                      {sev: dict.fromkeys(AER_TYPES[kind], 0) for sev, (_f, _t, kind) in FILES.items()})
        self.functions[name] = fn
        return fn

    def start(self) -> None:
        """The counters kept for this boot, then every file written."""
        for name, counts in self._load().items():
            fn = self.functions.get(name)
            for severity, types in counts.items() if fn else ():
                for kind, n in types.items():
                    if kind in fn.counts.get(severity, {}):  # type: ignore[union-attr]
                        fn.counts[severity][kind] = int(n)  # type: ignore[union-attr]
        for fn in self.functions.values():
            self._write(fn)

    def count(self, name: str, severity: str, kind: str, n: int = 1) -> Function:
        """``n`` errors of ``kind`` at function ``name``; ValueError for a severity or type the kernel
        does not have."""
        if severity not in FILES:
            raise ValueError(f"aer: severity is one of {', '.join(FILES)}, not {severity!r}")
        fn = self.functions[name]
        if kind not in fn.counts[severity]:
            raise ValueError(f"aer: a {severity} error is one of {', '.join(fn.counts[severity])}, not {kind!r}")
        fn.counts[severity][kind] += n
        self._write(fn)
        self._save()
        return fn

    def reboot(self, boot_id: str) -> None:
        self.boot_id = boot_id
        for fn in self.functions.values():
            for types in fn.counts.values():
                for kind in types:
                    types[kind] = 0
            self._write(fn)
        self._save()

    def _write(self, fn: Function) -> None:
        path = os.path.realpath(os.path.join(self.root, "bus", "pci", "devices", fn.name))
        if not os.path.isdir(path):  # an HCA taken away (its tree removed): nothing to count on
            return
        for severity, (file, total, _kind) in FILES.items():
            types = fn.counts[severity]
            lines = [f"{kind} {n}" for kind, n in types.items()] + [f"{total} {sum(types.values())}"]
            _write(os.path.join(path, file), "\n".join(lines) + "\n")

    def _load(self) -> dict[str, dict[str, dict[str, int]]]:
        try:
            with open(self.state, encoding="utf-8") as fh:
                doc = json.load(fh)
            return dict(doc["functions"]) if doc.get("boot_id") == self.boot_id else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("simulate: ignoring %s: %s", self.state, exc)
            return {}

    def _save(self) -> None:
        if self.read_only:
            return
        counts = {fn.name: {sev: {k: n for k, n in types.items() if n} for sev, types in fn.counts.items()}
                  for fn in self.functions.values()}
        _write(self.state, json.dumps({"version": 1, "boot_id": self.boot_id, "functions": counts}, sort_keys=True))


def _write(path: str, text: str) -> None:
    replace_file(path, text)

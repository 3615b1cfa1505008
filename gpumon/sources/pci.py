"""PCI addresses in the forms the kernel and NVML print them, and one form to compare them in.

sysfs names a function ``0000:3b:00.0`` (4 hex digits of domain, lower case); NVML's ``busId`` (and so
``gpumon_gpu_info{pci_bus_id}``) is ``00000000:3B:00.0`` (8 digits, upper case: nvml.h
``NVML_DEVICE_PCI_BUS_ID_FMT "%08X:%02X:%02X.0"``); NVRM Xid lines print ``0000:3b:00`` (no function).
"""

from __future__ import annotations

import re
from functools import lru_cache

_ADDRESS = re.compile(r"(?:PCI:)?([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.([0-7]))?")


@lru_cache(maxsize=1024)
def parts(address: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function); a missing function is 0 (NVRM's Xid lines omit it).

    This and the two forms below are remembered (the last 1,024 addresses each): a host has a few
    dozen, and a busy kernel log names them again and again."""
    m = _ADDRESS.fullmatch(address.strip())
    if m is None:
        return None
    return int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4) or "0")


@lru_cache(maxsize=1024)
def nvml_bus_id(address: str) -> str:
    """The address as NVML (and ``gpumon_gpu_info{pci_bus_id}``) writes it, so series join on it;
    unparsable text is returned unchanged."""
    p = parts(address)
    if p is None:
        return address
    return f"{p[0]:08X}:{p[1]:02X}:{p[2]:02X}.{p[3]:X}"


@lru_cache(maxsize=1024)
def sysfs_name(address: str) -> str:
    """The address as sysfs names the function directory (``0000:3b:00.0``)."""
    p = parts(address)
    if p is None:
        return address
    return f"{p[0]:04x}:{p[1]:02x}:{p[2]:02x}.{p[3]:x}"

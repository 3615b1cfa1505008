"""What the GPU and network drivers' kernel-log lines say: NVRM Xid, NVSwitch SXid, mlx5_core health
and port-module events, and IPoIB/netdev carrier changes. Knows message formats, no metric names.

Formats (each with where it was taken from):

- NVRM Xid, ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.``;
  drivers since R470 may print ``pid='<unknown>', name=<unknown>``; older ones omit ``PCI:`` and the
  pid/name (``NVRM: Xid (0000:03:00): 14, Channel 00000001``). The address has no function number.
  On GB200 the NVLink errors arrive as Xids 144-150
  (``NVRM: Xid (PCI:0008:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 (0x...)``).
  Source: docs.nvidia.com/deploy/xid-errors; leptonai/gpud components/accelerator/nvidia/xid.
- ``NVRM: GPU at PCI:0000:3b:00: GPU-<uuid>`` and ``NVRM: GPU 0000:3b:00.0: GPU has fallen off the
  bus.`` (same sources).
- NVSwitch SXid (Hopper and earlier): ``nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal,
  Link 32 ...`` (docs.nvidia.com/deploy/xid-errors; gpud components/accelerator/nvidia/sxid).
- mlx5_core, through ``dev_err``/``dev_info`` and so prefixed ``mlx5_core <BDF>: `` (plus
  ``<netdev>`` for netdev messages) and, for ``mlx5_core_err``, ``<func>:<line>:(pid <n>): ``: health
  (``poll_health:...: device's health compromised - reached miss count``, ``Fatal error <n>
  detected``, ``synd 0x<n>: ...``, ``Health issue observed ...``), ``Port module event[error]: module
  <m>, <status>, <error>`` and ``Port module event: module <m>, <status>``, ``Detected insufficient
  power on the PCIe slot (<n>W)``, ``<netdev>: Link up|down``. Source: linux
  drivers/net/ethernet/mellanox/mlx5/core/{events,health,en_main}.c, mlx5_core.h.
- ``IPv6: ADDRCONF(NETDEV_CHANGE): <netdev>: link becomes ready`` (linux net/ipv6/addrconf.c, on
  kernels before 6.6 where it became a debug message).

Every format is matched at the start of the message, on the text as /dev/kmsg hands it out (the
kernel escapes non-printable bytes as ``\\xNN``, Documentation/ABI/testing/dev-kmsg): a record that
merely quotes a driver line (``tmpfs: Unknown parameter 'NVRM: Xid (PCI:...): 79'``) is no driver
line, and an escaped newline in a process name cannot split a line in two. Only the value of a field
(the process ``name=``) is unescaped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpumon.sources.kmsg import unescape

_PCI = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
_XID = re.compile(rf"^NVRM: Xid \((?:PCI:)?(?P<pci>{_PCI})\): (?P<xid>[0-9]{{1,5}})(?P<rest>.*)$")
_PID = re.compile(r"^, pid=(?P<pid>'<unknown>'|<unknown>|[0-9]+)(?:, name=(?P<name>[^,]*))?")
# The graphics processing cluster an XID 13 or 31 names, where the driver prints one: "Graphics SM Warp
# Exception on (GPC 1, TPC 3, SM 0): ..." (XID 13, and XID 31 on some drivers; NVIDIA's XID catalog and
# the NVRM lines gpud and NVSentinel test with) and "MMU Fault: ENGINE GRAPHICS GPC1 GPCCLIENT_T1_8"
# (XID 31, read from a real H100 host: tests/fixtures/kmsg/driver_lines.txt [R]). "ENGINE GRAPHICS
# GPCCLIENT_T1_0" names no GPC.
_GPC = re.compile(r"\(GPC (?P<a>[0-9]{1,3})[,)]|\bGPC(?P<b>[0-9]{1,3}) ")
_OFF_BUS = re.compile(rf"^NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>{_PCI}): GPU has fallen off the bus")
_SXID = re.compile(rf"^(?P<switch>nvidia-nvswitch[0-9]+): SXid \((?:PCI:)?(?P<pci>{_PCI})\): "
                   r"(?P<sxid>[0-9]{1,6}), (?P<rest>.*)$")
_MLX5 = re.compile(rf"^mlx5_core (?P<pci>{_PCI})(?: (?P<netdev>[^:\s]+))?: "
                   r"(?:[A-Za-z0-9_]+:[0-9]+:(?:\(pid [0-9]+\):)? ?)?(?P<text>.*)$")
_MODULE = re.compile(r"Port module event(?P<error>\[error\])?: module (?P<module>[0-9]+), (?P<status>[^,]+)"
                     r"(?:, (?P<detail>.*))?$")
_HEALTH = re.compile(r"health compromised|^Fatal error [0-9]+ detected|^synd 0x[0-9a-fA-F]+|"
                     r"Health issue observed|unrecoverable hardware error")
_LINK = re.compile(r"^Link (?P<state>up|down)\b")
_POWER = re.compile(r"Detected insufficient power on the PCIe slot \((?P<watts>[0-9]+)W\)")
_READY = re.compile(r"^IPv6: ADDRCONF\(NETDEV_CHANGE\): (?P<netdev>\S+): link becomes ready")


@dataclass(frozen=True)
class DriverMessage:
    """A recognised line: ``kind`` and what it names. ``pci`` is as printed (see
    :func:`gpumon.sources.pci.canonical` to compare addresses)."""

    kind: str
    pci: str = ""
    attrs: dict[str, str | int] = field(default_factory=dict)


def recognise(message: str) -> DriverMessage | None:
    """The driver message in one kernel-log line (as /dev/kmsg escapes it), or None for anything else."""
    if message.startswith("NVRM: "):
        return _nvrm(message)
    if message.startswith("mlx5_core "):
        return _mlx5(message)
    if message.startswith("nvidia-nvswitch"):
        return _sxid(message)
    if message.startswith("IPv6: ADDRCONF"):
        m = _READY.match(message)
        return DriverMessage("netdev_link_ready", "", {"netdev": m.group("netdev")}) if m else None
    return None


def _nvrm(message: str) -> DriverMessage | None:
    m = _XID.match(message)
    if m is not None:
        attrs: dict[str, str | int] = {"xid": int(m.group("xid"))}
        rest = m.group("rest")
        p = _PID.match(rest)
        if p is not None:
            if p.group("pid").isdigit():
                attrs["pid"] = int(p.group("pid"))
            name = unescape((p.group("name") or "").strip())
            if name and name != "<unknown>":
                attrs["process"] = name
            rest = rest[p.end():]
        attrs["detail"] = rest.lstrip(", ").strip()
        g = _GPC.search(rest)
        if g is not None:
            attrs["gpc"] = int(g.group("a") or g.group("b"))
        return DriverMessage("xid", m.group("pci"), attrs)
    m = _OFF_BUS.match(message)
    if m is not None:
        return DriverMessage("gpu_off_bus", m.group("pci"))
    return None


def _sxid(message: str) -> DriverMessage | None:
    m = _SXID.match(message)
    if m is None:
        return None
    rest = m.group("rest")
    fatal = rest.split(",", 1)[0].strip().lower() == "fatal"
    return DriverMessage("sxid", m.group("pci"), {"sxid": int(m.group("sxid")), "switch": m.group("switch"),
                                                  "fatal": int(fatal), "detail": rest.strip()})


def _mlx5(message: str) -> DriverMessage | None:
    m = _MLX5.match(message)
    if m is None:
        return None
    pci, text = m.group("pci"), m.group("text").strip()
    netdev = m.group("netdev") or ""
    module = _MODULE.search(text)
    if module is not None:
        attrs: dict[str, str | int] = {"module": int(module.group("module")), "status": module.group("status").strip()}
        if module.group("detail"):
            attrs["error"] = module.group("detail").strip()
        return DriverMessage("mlx5_port_module_error" if module.group("error") else "mlx5_port_module", pci, attrs)
    if _HEALTH.search(text):
        return DriverMessage("mlx5_health", pci, {"detail": text})
    power = _POWER.search(text)
    if power is not None:
        return DriverMessage("mlx5_pcie_power", pci, {"watts": int(power.group("watts"))})
    link = _LINK.match(text)
    if link is not None and netdev:
        return DriverMessage(f"netdev_link_{link.group('state')}", pci, {"netdev": netdev})
    return None

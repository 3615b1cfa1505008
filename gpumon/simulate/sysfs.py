"""Synthetic InfiniBand sysfs trees: the real layout (symlinks included) with counters that grow.

:func:`build_tree` writes a tree for a host profile under ``root`` (the directory that plays
``/sys``) and returns a :class:`Fabric` that advances it: counters grow with traffic, 32-bit and
narrower PMA counters stick at their maximum as real HCAs do, and flaps or port-down periods can be
injected. Tests, benchmarks, and ``gpumon run --simulate`` all use it.

Every write replaces the file (temporary file + ``os.replace``), so a reader never sees a half
written value; a reader that keeps descriptors open must therefore re-open files on a tree like
this (the collectors detect a non-sysfs tree and do).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

from gpumon.simulate.files import replace_file
from gpumon.sources.ib_sysfs import MLX5_QUEUE_COUNTERS, MLX5_ROCE_COUNTERS

# Bit widths of the PMA counters (IBA PortCounters/PortCountersExtended as mlx5 exposes them).
PMA_WIDTHS: dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_wait": 32,
    "port_xmit_data": 64,
    "port_rcv_data": 64,
    "port_xmit_packets": 64,
    "port_rcv_packets": 64,
    "unicast_xmit_packets": 64,
    "unicast_rcv_packets": 64,
    "multicast_xmit_packets": 64,
    "multicast_rcv_packets": 64,
}

# mlx5 hw_counters: queue (q) counters are 32-bit, the congestion/RoCE ones 64-bit.
HW_COUNTERS_IB = MLX5_QUEUE_COUNTERS
HW_COUNTERS_ROCE = MLX5_ROCE_COUNTERS
HW_WIDTHS: dict[str, int] = {**dict.fromkeys(HW_COUNTERS_IB, 32), **dict.fromkeys(HW_COUNTERS_ROCE, 64)}

STATE_NAMES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_NAMES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp",
              6: "LinkErrorRecovery", 7: "Phy Test"}

XMIT_WAIT_TICKS = 4e6
"""``port_xmit_wait`` ticks per second a port starved of credits all the time adds. The tick length is
implementation defined (IBA vol. 1, PortXmitWait); the value keeps the 32-bit counter short of
sticking at its maximum for over half an hour at a congestion factor of 0.5."""

NO_PMA = "N/A (no PMA)"


@dataclass(frozen=True)
class _HcaModel:
    hca_type: str
    fw_ver: str
    board_id: str


CX6 = _HcaModel("MT4123", "20.31.1014", "MT_0000000223")
CX7 = _HcaModel("MT4129", "28.39.1002", "MT_0000000838")
CX5_VF = _HcaModel("MT4126", "16.31.1014", "MT_0000000010")
CX7_VF = _HcaModel("MT4130", "28.39.1002", "MT_0000000839")


@dataclass(frozen=True)
class _Profile:
    ib_devices: int
    ib_naming: str  # "azure" -> mlx5_ibN / ibN, "plain" -> mlx5_N / ibN
    ib_rate_gbps: int
    ib_rate_text: str
    ib_model: _HcaModel
    an0_rate_gbps: int = 0
    an0_rate_text: str = ""
    an0_model: _HcaModel = CX5_VF
    no_pma: bool = False
    saturated: bool = False
    hw_counters: bool = True


PROFILES: dict[str, _Profile] = {
    "nd-a100-v4": _Profile(8, "azure", 200, "200 Gb/sec (4X HDR)", CX6, 40, "40 Gb/sec (4X QDR)", CX5_VF),
    "nd-h100-v5": _Profile(8, "azure", 400, "400 Gb/sec (4X NDR)", CX7, 100, "100 Gb/sec (4X EDR)", CX7_VF),
    # ND GB200 v6: 4 x NDR 400 Quantum-2 CX7 InfiniBand per VM (Azure's size page)
    "nd-gb200-v6": _Profile(4, "azure", 400, "400 Gb/sec (4X NDR)", CX7, 100, "100 Gb/sec (4X EDR)", CX7_VF),
    "hbv4": _Profile(1, "azure", 400, "400 Gb/sec (4X NDR)", CX7, 100, "100 Gb/sec (4X EDR)", CX7_VF),
    "plain-mlx5": _Profile(1, "plain", 200, "200 Gb/sec (4X HDR)", CX6),
    "old-kernel-no-pma": _Profile(1, "plain", 100, "100 Gb/sec (4X EDR)", CX6, no_pma=True),
    "saturated-link-downed": _Profile(1, "azure", 400, "400 Gb/sec (4X NDR)", CX7, saturated=True),
    "no-hw-counters": _Profile(1, "plain", 200, "200 Gb/sec (4X HDR)", CX6, hw_counters=False),
}


class UnknownTreeProfile(ValueError):
    pass


@dataclass
class Port:
    """The simulated truth of one port; the files under ``ports/<n>/`` are written from it."""

    device: str
    number: int
    link_layer: str
    rate_gbps: int
    rate_text: str
    netdev: str
    counters: dict[str, int]
    hw: dict[str, int]
    no_pma: bool = False
    up: bool = True
    down_left: float = 0.0
    """Seconds of ticks until a timed port-down ends; 0 with ``up`` False means until set_up."""
    carrier_changes: int = 2  # the kernel's carrier_changes is carrier_up_count + carrier_down_count
    carrier_up: int = 1
    carrier_down: int = 1
    load: float = 0.35
    """Fraction of line rate the simulated job pushes through the port."""
    in_job: bool = False
    """A job's collectives drive the port: ``load`` follows the job's level, with little noise."""
    congestion: float = 1.0
    """Below 1 the port is congested (:meth:`Fabric.congest`): its traffic is multiplied by it and
    ``port_xmit_wait`` grows with the credit-starved share of the time."""


@dataclass
class Device:
    name: str
    pci: str
    model: _HcaModel
    node_guid: str
    ports: dict[int, Port] = field(default_factory=dict)
    present: bool = True


class Fabric:
    """A live simulated fabric under ``root``. Not thread-safe: one thread drives it."""

    def __init__(self, root: str, profile: str, devices: list[Device], hw_counters: bool, seed: int = 1) -> None:
        self.root = root
        self.profile = profile
        self.devices = {d.name: d for d in devices}
        self.hw_counters = hw_counters
        self._rng = random.Random(seed)
        self._written: dict[str, str] = {}
        #: called with (device, port, up) whenever a port's carrier goes down or up (the simulated
        #: host prints the driver's lines in its kernel log)
        self.on_carrier: Callable[[Device, Port, bool], None] | None = None

    def _put(self, path: str, text: str) -> None:
        """Write only what changed: a tick on a 36-port tree stays cheap."""
        if self._written.get(path) != text:
            _write(path, text)
            self._written[path] = text

    # ----------------------------------------------------------------- paths

    def device_dir(self, device: str) -> str:
        d = self.devices[device]
        return os.path.join(self.root, "devices", _pci_bus(d.pci), d.pci, "infiniband", device)

    def port_dir(self, device: str, port: int = 1) -> str:
        return os.path.join(self.device_dir(device), "ports", str(port))

    def netdev_dir(self, device: str, port: int = 1) -> str:
        d = self.devices[device]
        return os.path.join(self.root, "devices", _pci_bus(d.pci), d.pci, "net", d.ports[port].netdev)

    def port(self, device: str, port: int = 1) -> Port:
        try:
            return self.devices[device].ports[port]
        except KeyError:
            raise KeyError(f"no simulated port {device}/{port}") from None

    @property
    def port_keys(self) -> list[tuple[str, int]]:
        return [(d.name, n) for d in self.devices.values() for n in d.ports]

    # ----------------------------------------------------------------- writing

    def write_all(self) -> None:
        for device in self.devices.values():
            if device.present:
                self._write_device(device)

    def _write_device(self, d: Device) -> None:
        ddir = self.device_dir(d.name)
        pci_dir = os.path.dirname(os.path.dirname(ddir))
        os.makedirs(ddir, exist_ok=True)
        self._put(os.path.join(ddir, "fw_ver"), d.model.fw_ver)
        self._put(os.path.join(ddir, "board_id"), d.model.board_id)
        self._put(os.path.join(ddir, "hca_type"), d.model.hca_type)
        self._put(os.path.join(ddir, "node_guid"), d.node_guid)
        self._put(os.path.join(ddir, "sys_image_guid"), d.node_guid)
        self._put(os.path.join(ddir, "node_type"), "1: CA")
        self._put(os.path.join(pci_dir, "vendor"), "0x15b3")
        _symlink(os.path.relpath(pci_dir, ddir), os.path.join(ddir, "device"))
        class_ib = os.path.join(self.root, "class", "infiniband")
        os.makedirs(class_ib, exist_ok=True)
        _symlink(os.path.relpath(ddir, class_ib), os.path.join(class_ib, d.name))
        for p in d.ports.values():
            self._write_port_static(d, p)
            self._write_port(p)

    def _write_port_static(self, d: Device, p: Port) -> None:
        pdir = self.port_dir(d.name, p.number)
        os.makedirs(os.path.join(pdir, "counters"), exist_ok=True)
        self._put(os.path.join(pdir, "link_layer"), p.link_layer)
        self._put(os.path.join(pdir, "lid"), "0x0" if p.link_layer == "Ethernet" else f"0x{p.number + 0x20:x}")
        self._put(os.path.join(pdir, "sm_lid"), "0x0" if p.link_layer == "Ethernet" else "0x1")
        self._put(os.path.join(pdir, "cap_mask"), "0xa659e848")
        if self.hw_counters:
            os.makedirs(os.path.join(pdir, "hw_counters"), exist_ok=True)
            self._put(os.path.join(pdir, "hw_counters", "lifespan"), "10")
        ndir = self.netdev_dir(d.name, p.number)
        os.makedirs(ndir, exist_ok=True)
        self._put(os.path.join(ndir, "dev_port"), str(p.number - 1))
        self._put(os.path.join(ndir, "type"), "32" if p.link_layer == "InfiniBand" else "1")
        self._put(os.path.join(ndir, "mtu"), "4092" if p.link_layer == "InfiniBand" else "1500")
        class_net = os.path.join(self.root, "class", "net")
        os.makedirs(class_net, exist_ok=True)
        _symlink(os.path.relpath(ndir, class_net), os.path.join(class_net, p.netdev))

    def _write_port(self, p: Port) -> None:
        pdir = self.port_dir(p.device, p.number)
        state, phys = (4, 5) if p.up else (1, 2)
        self._put(os.path.join(pdir, "state"), f"{state}: {STATE_NAMES[state]}")
        self._put(os.path.join(pdir, "phys_state"), f"{phys}: {PHYS_NAMES[phys]}")
        self._put(os.path.join(pdir, "rate"), p.rate_text)
        for name, value in p.counters.items():
            self._put(os.path.join(pdir, "counters", name), NO_PMA if p.no_pma else str(value))
        if self.hw_counters:
            for name, value in p.hw.items():
                self._put(os.path.join(pdir, "hw_counters", name), str(value))
        ndir = self.netdev_dir(p.device, p.number)
        self._put(os.path.join(ndir, "carrier_changes"), str(p.carrier_changes))
        self._put(os.path.join(ndir, "carrier_up_count"), str(p.carrier_up))
        self._put(os.path.join(ndir, "carrier_down_count"), str(p.carrier_down))
        self._put(os.path.join(ndir, "operstate"), "up" if p.up else "down")
        self._put(os.path.join(ndir, "carrier"), "1" if p.up else "0")

    def _flush(self, p: Port) -> None:
        if self.devices[p.device].present:
            self._write_port(p)

    # ----------------------------------------------------------------- behaviour

    def tick(self, seconds: float) -> None:
        """Advance time: traffic and the odd error grow the counters; timed port-downs run out."""
        if seconds <= 0:
            return
        for d in self.devices.values():
            for p in d.ports.values():
                if not p.up and p.down_left > 0:
                    p.down_left -= seconds
                    if p.down_left <= 0:
                        self._bring_up(p)
                        self._carrier(p, True)
                if p.up:
                    self._grow(p, seconds)
                self._flush(p)

    def _grow(self, p: Port, seconds: float) -> None:
        rng = self._rng
        noise = rng.uniform(0.98, 1.02) if p.in_job else rng.uniform(0.8, 1.2)
        load = max(0.0, min(1.0, p.load * noise * p.congestion))
        octets = int(p.rate_gbps * 1e9 / 8 * load * seconds)
        words = octets // 4
        packets = max(1, octets // 4096)
        add = self._add
        add(p, "port_xmit_data", words)
        add(p, "port_rcv_data", int(words * rng.uniform(0.9, 1.1)))
        add(p, "port_xmit_packets", packets)
        add(p, "port_rcv_packets", packets)
        add(p, "unicast_xmit_packets", packets)
        add(p, "unicast_rcv_packets", packets)
        add(p, "multicast_xmit_packets", int(seconds))
        add(p, "multicast_rcv_packets", int(seconds))
        if p.in_job or p.congestion < 1.0:
            # steady in a job; a congested port waits for credits the share of the time it cannot send
            wait = octets / 64 * 0.0005 * rng.uniform(0.95, 1.05) + (1.0 - p.congestion) * XMIT_WAIT_TICKS * seconds
            add(p, "port_xmit_wait", int(wait))
        else:
            add(p, "port_xmit_wait", int(octets // 64 * rng.uniform(0.0, 0.05)))
        if not p.in_job:   # a healthy job's links are clean: an error there is a fault (set_counter)
            if rng.random() < 0.02 * seconds:
                add(p, "symbol_error", 1)
            if rng.random() < 0.005 * seconds:
                add(p, "port_rcv_errors", 1)
        if self.hw_counters and p.hw:
            if p.link_layer == "InfiniBand":
                self._add_hw(p, "rx_write_requests", packets // 8)
                self._add_hw(p, "rx_read_requests", packets // 32)
                self._add_hw(p, "out_of_sequence", int(rng.random() < 0.1 * seconds))
                self._add_hw(p, "local_ack_timeout_err", int(rng.random() < 0.01 * seconds))
            else:
                self._add_hw(p, "np_ecn_marked_roce_packets", int(packets * 0.001))
                self._add_hw(p, "rp_cnp_handled", int(packets * 0.0005))

    @staticmethod
    def _add(p: Port, name: str, amount: int) -> None:
        if name in p.counters and amount > 0:
            p.counters[name] = min(p.counters[name] + amount, (1 << PMA_WIDTHS[name]) - 1)

    @staticmethod
    def _add_hw(p: Port, name: str, amount: int) -> None:
        if name in p.hw and amount > 0:
            p.hw[name] = min(p.hw[name] + amount, (1 << HW_WIDTHS[name]) - 1)

    def congest(self, device: str, port: int = 1, factor: float = 0.5) -> None:
        """The port's traffic drops to ``factor`` of its share and ``port_xmit_wait`` grows (1 undoes it)."""
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"congest factor must be in (0, 1], got {factor}")
        self.port(device, port).congestion = factor

    def flap(self, device: str, port: int = 1) -> None:
        """A flap shorter than any poll: the state never shows it, the counters do."""
        p = self.port(device, port)
        self._add(p, "link_downed", 1)  # a failed recovery; a successful retrain is link_error_recovery
        p.carrier_changes += 2
        p.carrier_down += 1
        p.carrier_up += 1
        self._flush(p)
        self._carrier(p, False)
        self._carrier(p, True)

    def set_down(self, device: str, port: int = 1, seconds: float = 0.0) -> None:
        """DOWN/Polling until ``seconds`` of ticks have passed (0: until :meth:`set_up`)."""
        p = self.port(device, port)
        if p.up:
            p.up = False
            self._add(p, "link_downed", 1)
            p.carrier_changes += 1
            p.carrier_down += 1
            self._carrier(p, False)
        p.down_left = max(0.0, seconds)
        self._flush(p)

    def set_up(self, device: str, port: int = 1) -> None:
        p = self.port(device, port)
        if not p.up:
            self._bring_up(p)
            self._carrier(p, True)
        self._flush(p)

    def _carrier(self, p: Port, up: bool) -> None:
        if self.on_carrier is not None:
            self.on_carrier(self.devices[p.device], p, up)

    @staticmethod
    def _bring_up(p: Port) -> None:
        p.up = True
        p.down_left = 0.0
        p.carrier_changes += 1
        p.carrier_up += 1

    def set_counter(self, device: str, port: int, name: str, value: int) -> None:
        """Set one counter (an admin reset, or a test's chosen value) and write it."""
        p = self.port(device, port)
        if name in p.counters:
            p.counters[name] = value
        elif name in p.hw:
            p.hw[name] = value
        elif name == "carrier_changes":
            p.carrier_changes = value
        else:
            raise KeyError(f"{device}/{port} has no counter {name!r}")
        self._written.clear()  # rewrite even over a test's hand-made fault
        self._flush(p)

    def unplug(self, device: str) -> None:
        """The device vanishes (VF hot-remove during host maintenance): its PCI directory goes."""
        d = self.devices[device]
        if not d.present:
            return
        d.present = False
        for link in [os.path.join(self.root, "class", "infiniband", device)] + [
            os.path.join(self.root, "class", "net", p.netdev) for p in d.ports.values()
        ]:
            try:
                os.unlink(link)
            except FileNotFoundError:
                pass
        pci_dir = os.path.join(self.root, "devices", _pci_bus(d.pci), d.pci)
        shutil.rmtree(pci_dir, ignore_errors=True)
        self._written = {k: v for k, v in self._written.items() if not k.startswith(pci_dir + os.sep)}

    def replug(self, device: str) -> None:
        d = self.devices[device]
        if d.present:
            return
        d.present = True
        self._write_device(d)


def build_tree(profile: str, root: str, ports: int | None = None, seed: int = 1) -> Fabric:
    """Write the tree of ``profile`` under ``root`` (which plays ``/sys``) and return its Fabric.

    ``ports`` sets the number of InfiniBand devices (one port each) for scaling benchmarks; the
    Ethernet ``mlx5_an0`` of the Azure profiles is kept beside them.
    """
    try:
        spec = PROFILES[profile]
    except KeyError:
        raise UnknownTreeProfile(f"unknown sysfs profile {profile!r} (known: {', '.join(sorted(PROFILES))})") from None
    count = spec.ib_devices if ports is None else ports
    if count < 0:
        raise ValueError("ports must be >= 0")
    rng = random.Random(seed)
    devices: list[Device] = []
    for i in range(count):
        name = f"mlx5_ib{i}" if spec.ib_naming == "azure" else f"mlx5_{i}"
        pci = f"{0x0101 + i:04x}:00:00.0"
        device = Device(name, pci, spec.ib_model, _guid(0x00155DFFFE340000 + 0x100 * i + 0x3A))
        port = Port(name, 1, "InfiniBand", spec.ib_rate_gbps, spec.ib_rate_text, f"ib{i}",
                    _initial_counters(rng, spec.ib_rate_gbps), _initial_hw(rng, HW_COUNTERS_IB),
                    no_pma=spec.no_pma)
        if spec.saturated and i == 0:
            port.counters["link_downed"] = 255
            port.counters["port_xmit_discards"] = 65535
            port.counters["port_xmit_wait"] = (1 << 32) - 1
        device.ports[1] = port
        devices.append(device)
    if spec.an0_rate_gbps:
        pci = "7870:00:02.0"
        device = Device("mlx5_an0", pci, spec.an0_model, _guid(0x00155DFFFE3400FF))
        device.ports[1] = Port("mlx5_an0", 1, "Ethernet", spec.an0_rate_gbps, spec.an0_rate_text,
                               "enP30832s1", _initial_counters(rng, spec.an0_rate_gbps),
                               _initial_hw(rng, HW_COUNTERS_IB + HW_COUNTERS_ROCE), load=0.05)
        devices.append(device)
    fabric = Fabric(root, profile, devices, spec.hw_counters, seed=seed)
    fabric.write_all()
    return fabric


def _initial_counters(rng: random.Random, rate_gbps: int) -> dict[str, int]:
    """A port that has been up for a day or so: traffic counters large, error counters small."""
    uptime = rng.uniform(3600, 86400)
    words = int(rate_gbps * 1e9 / 8 * 0.2 * uptime) // 4
    packets = words * 4 // 4096
    values = dict.fromkeys(PMA_WIDTHS, 0)
    values.update(
        port_xmit_data=words, port_rcv_data=int(words * 1.01),
        port_xmit_packets=packets, port_rcv_packets=packets,
        unicast_xmit_packets=packets, unicast_rcv_packets=packets,
        multicast_xmit_packets=int(uptime), multicast_rcv_packets=int(uptime),
        port_xmit_wait=rng.randrange(0, 1 << 28), symbol_error=rng.randrange(0, 3),
    )
    return values


def _initial_hw(rng: random.Random, names: tuple[str, ...]) -> dict[str, int]:
    values = dict.fromkeys(names, 0)
    for name in ("rx_write_requests", "rx_read_requests"):
        if name in values:
            values[name] = rng.randrange(1 << 20, 1 << 30)
    return values


def _guid(value: int) -> str:
    text = f"{value:016x}"
    return ":".join(text[i:i + 4] for i in range(0, 16, 4))


def _pci_bus(pci: str) -> str:
    return f"pci{pci.split(':')[0]}:00"


def _write(path: str, text: str) -> None:
    """Replace the file so a reader sees the old or the new value, never a torn one."""
    replace_file(path, text + "\n", "ascii")


def _symlink(target: str, link: str) -> None:
    try:
        if os.readlink(link) == target:
            return
        os.unlink(link)
    except FileNotFoundError:
        pass
    except OSError:
        # Something else is in the way (a test's fault injection): leave it.
        return
    os.symlink(target, link)

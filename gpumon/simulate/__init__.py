"""Simulated hosts for ``--simulate PROFILE``, demos, dashboards development and the tests.

A profile pairs a synthetic NVML (:mod:`gpumon.simulate.nvml`, a stand-in for the ``pynvml`` module)
with a synthetic sysfs tree (:mod:`gpumon.simulate.sysfs`) written to disk under the state directory,
whose counters grow while the daemon runs. The simulated host lives in
``<state_dir>/simulate/<profile>/``: ``sys/`` (the tree), ``state/`` (the daemon's state for that
host), ``boot_id`` (the host's boot id, as /proc/sys/kernel/random/boot_id), ``hardware.json`` (the
injected hardware faults a daemon restart keeps), ``kmsg`` (the host's kernel log, as /dev/kmsg hands
it out: :mod:`gpumon.simulate.kmsg`), ``aer.json`` (the PCIe AER counters since boot of the functions
in ``sys/``: :mod:`gpumon.simulate.pci`) and ``control/``, where JSON files dropped by a
person, a test or ``gpumon simulate`` provoke a flap, a port-down period, an XID, a lost GPU, a
PCIe AER error or a reboot in a running daemon (the actions: :data:`gpumon.simulate.actions.ACTIONS`, docs/simulate.md).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumon.simulate import job
from gpumon.simulate.actions import ACTIONS
from gpumon.simulate.files import replace_file

log = logging.getLogger("gpumon.simulate")
_sequence = itertools.count()


@dataclass(frozen=True)
class HostProfile:
    """A simulated host: which GPU model and how many, which IB tree."""

    description: str
    gpu_profile: str | None
    gpu_count: int
    ib_profile: str | None
    driver_version: str = "550.90.07"
    #: (low W, high W, Hz): the GPUs' power samples swing like a synchronous training step
    power_swing: tuple[float, float, float] | None = None
    #: the Azure VM size IMDS would report for such a host (what the health stage holds it to)
    vm_size: str = ""


HOSTS: dict[str, HostProfile] = {
    "nd-h100-v5": HostProfile("Azure ND H100 v5: 8 x H100 80GB HBM3, 8 x NDR 400 IB + mlx5_an0",
                              "h100-sxm5-80gb", 8, "nd-h100-v5", power_swing=(350.0, 700.0, 1.0),
                              vm_size="Standard_ND96isr_H100_v5"),
    "nd-gb200-v6": HostProfile("Azure ND GB200 v6: 4 x GB200 (NVLink 5 fabric), 2 x Grace (aarch64), "
                               "4 x NDR 400 IB + mlx5_an0", "gb200", 4, "nd-gb200-v6",
                               driver_version="570.133.20", power_swing=(600.0, 1200.0, 1.0),
                               vm_size="Standard_ND128isr_NDR_GB200_v6"),
    "nd-a100-v4": HostProfile("Azure ND A100 v4: 8 x A100 80GB SXM, 8 x HDR 200 IB + mlx5_an0",
                              "a100-sxm4-80gb", 8, "nd-a100-v4",
                              vm_size="Standard_ND96amsr_A100_v4"),  # 80 GB A100s: the NDm size
    "nv-a10-v5": HostProfile("Azure NVads A10 v5: 1 x A10, no InfiniBand", "a10", 1, None,
                             vm_size="Standard_NV36ads_A10_v5"),
    "hbv4": HostProfile("Azure HBv4: no GPU, 1 x NDR IB", None, 0, "hbv4", vm_size="Standard_HB176rs_v4"),
}


class UnknownProfile(ValueError):
    pass


def host_profile(name: str) -> HostProfile:
    """The profile named ``name``; the one place an unknown name is refused (the daemon turns it into
    an exit 2 naming ``[daemon] simulate``, before anything is created on disk)."""
    if name not in HOSTS:
        raise UnknownProfile(f"unknown simulation profile {name!r} (known: {', '.join(sorted(HOSTS))})")
    return HOSTS[name]


HARDWARE_FILE = "hardware.json"
KMSG_FILE = "kmsg"
AER_FILE = "aer.json"
BOOT_ID_FILE = "boot_id"


class Simulation:
    """The live state of one simulated host. ``start()`` begins growing counters every ``tick``.

    ``home`` (default ``workdir``) holds ``control/``, ``boot_id`` and ``hardware.json``; ``gpumon
    once`` builds its tree in a temporary ``workdir`` but reads the faults of the host at ``home``.
    ``consume``: apply (and remove) the control files waiting there now; ``read_only``: never write
    ``home`` (``gpumon check`` and ``gpumon health`` look, they do not change the host).
    ``owned_dir``: a temporary directory holding ``workdir`` that :meth:`stop` removes (the daemon
    simulates in one when its state directory is read-only)."""

    def __init__(self, profile: str, workdir: str, tick: float = 1.0, hostname: str = "",
                 home: str | None = None, consume: bool = True, read_only: bool = False,
                 owned_dir: str | None = None) -> None:
        self.host = host_profile(profile)
        self.profile = profile
        self.workdir = workdir
        self.home = home or workdir
        self.owned_dir = owned_dir
        self.sysfs_root = os.path.join(workdir, "sys")
        self.control_dir = os.path.join(self.home, "control")
        self.boot_id_path = os.path.join(self.home, BOOT_ID_FILE)
        self.read_only = read_only
        if not read_only:
            try:
                os.makedirs(self.control_dir, exist_ok=True)
            except OSError as exc:  # a state directory given to ``gpumon once`` that it may not write
                log.warning("simulate: cannot write %s (%s); the host's faults are read, not changed",
                            self.control_dir, exc)
                self.read_only = True
        self.fabric: Any = None
        self.nvml: Any = None
        if self.host.ib_profile:
            from gpumon.simulate import sysfs

            self.fabric = sysfs.build_tree(self.host.ib_profile, self.sysfs_root)
        else:
            os.makedirs(self.sysfs_root, exist_ok=True)
        if self.host.gpu_profile:
            from gpumon.simulate import nvml

            self.nvml = nvml.FakeNVML(self.host.gpu_profile, self.host.gpu_count,
                                      driver_version=self.host.driver_version, power_swing=self.host.power_swing)
        #: the host's /proc as far as GPU processes go: ``<pid>/comm`` of each running GPU process
        #: (the NVML collector reads process names here under simulation)
        self.proc_root = os.path.join(workdir, "proc")
        self.write_processes()
        #: who holds which GPU, as the control directory set it: dicts with ``gpu`` and any of
        #: ``namespace``, ``pod``, ``container``, ``job_id`` (read by the attribution collector)
        self.allocations: list[dict[str, Any]] = []
        #: jobs a ``stall`` control hung (their GPUs near idle until ``resume``)
        self.stalled: set[str] = set()
        from gpumon.simulate.azure import SimulatedAzure

        #: the VM's IMDS on loopback and its KVP pool (host_info and azure_events read them)
        self.azure = SimulatedAzure(workdir, hostname or socket.gethostname(), self.host.vm_size)
        self._tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: the hardware faults in effect (control commands), kept in ``hardware.json`` until a reboot
        self.kept: list[dict[str, Any]] = []
        #: True while ``hardware.json`` is applied again at start: no new events (XIDs) are posted
        self.replaying = False
        #: called after a ``reboot`` (the daemon starts its view of the host over, as a real reboot
        #: restarts it); from the simulation's thread, so it must only signal
        self.on_reboot: Callable[[], None] | None = None
        self._fresh_boot = False
        self.boot_id = self._boot()
        from gpumon.simulate.kmsg import KernelLog

        #: the host's kernel log (the kmsg collector reads it as it reads /dev/kmsg)
        #: (a throwaway host, whose home is its own workdir, has one too: empty)
        self.kernel_log = KernelLog(os.path.join(self.home, KMSG_FILE), fresh=self._fresh_boot,
                                    read_only=self.read_only and self.home != self.workdir)
        if self.fabric is not None:
            self.fabric.on_carrier = self._carrier
        self.pci = self._pci_tree()
        self._restore_hardware()
        if consume and not read_only:
            with self._lock:
                self._read_controls()

    # -- the host's lasting state -----------------------------------------------------------------
    def _boot(self) -> str:
        from gpumon.sources.kmsg import boot_id

        current = boot_id(self.boot_id_path)
        if not current:  # a host simulated for the first time: it booted with the machine it runs on
            current = boot_id() or str(uuid.uuid4())
            self._write(BOOT_ID_FILE, current + "\n")
            self._fresh_boot = True
        return current

    def _restore_hardware(self) -> None:
        """Apply ``hardware.json`` again: a lost GPU stays lost across a daemon restart, as on a real host."""
        path = os.path.join(self.home, HARDWARE_FILE)
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
            kept = doc["kept"] if doc.get("boot_id") == self.boot_id else []
            if not isinstance(kept, list):
                raise ValueError("'kept' is not a list")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("simulate: ignoring %s: %s", path, exc)
            return
        self.replaying = True
        try:
            for command in kept:
                try:
                    if ACTIONS[command["action"]].handler(self, command):
                        self.kept.append(command)
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    log.warning("simulate: dropping kept fault %s: %s", command, exc)
        finally:
            self.replaying = False
        if kept:
            log.info("simulate: the host's hardware faults since boot %s apply again: %s", self.boot_id,
                     ", ".join(json.dumps(c, sort_keys=True) for c in self.kept))

    def _save_hardware(self) -> None:
        self._write(HARDWARE_FILE, json.dumps({"version": 1, "boot_id": self.boot_id, "kept": self.kept},
                                              sort_keys=True))

    def _write(self, name: str, text: str) -> None:
        if self.read_only:
            return
        os.makedirs(self.home, exist_ok=True)
        path = os.path.join(self.home, name)
        replace_file(path, text)

    def _pci_tree(self) -> Any:
        """The GPUs' and HCAs' PCI functions with their AER counters (:mod:`gpumon.simulate.pci`)."""
        from gpumon.simulate.pci import CLASSES, PciTree
        from gpumon.sources.pci import sysfs_name

        tree = PciTree(self.sysfs_root, os.path.join(self.home, AER_FILE), self.boot_id, self.read_only)
        for gpu in range(self.nvml.gpu_count if self.nvml is not None else 0):
            bus_id, device_id = self.nvml.pci(gpu)[:2]
            name = sysfs_name(bus_id)
            path = os.path.join(self.sysfs_root, "devices", f"pci{name.split(':')[0]}:00", name)
            tree.add(name, path, "nvidia", device_id & 0xFFFF, device_id >> 16, CLASSES["gpu"])
            tree.gpus[gpu] = name
        for device in self.fabric.devices.values() if self.fabric is not None else ():
            path = os.path.join(self.sysfs_root, "devices", f"pci{device.pci.split(':')[0]}:00", device.pci)
            # the PCI device id of a ConnectX is its MT number (MT4129: 0x1021, ConnectX-7)
            link_layer = next(iter(device.ports.values())).link_layer if device.ports else "InfiniBand"
            tree.add(device.pci, path, "mlx5_core", 0x15B3, int(device.model.hca_type[2:]), CLASSES[link_layer])
            tree.hcas[device.name] = device.pci
        tree.start()
        return tree

    def _carrier(self, device: Any, port: Any, up: bool) -> None:
        """A port's carrier changed: the lines its drivers print (not while faults are re-applied)."""
        if self.replaying:
            return
        from gpumon.simulate.kmsg import INFO, netdev_lines

        for line in netdev_lines(device.pci, port.netdev, up, port.link_layer == "Ethernet"):
            self.kernel_log.write(line, INFO)

    def write_processes(self) -> None:
        """``<proc_root>/<pid>/comm`` for the GPU processes running now; those of ended ones go."""
        if self.nvml is None:
            return
        names = self.nvml.process_names()
        try:
            os.makedirs(self.proc_root, exist_ok=True)
            for entry in os.listdir(self.proc_root):
                if entry.isdigit() and int(entry) not in names:
                    shutil.rmtree(os.path.join(self.proc_root, entry), ignore_errors=True)
            for pid, name in names.items():
                os.makedirs(os.path.join(self.proc_root, str(pid)), exist_ok=True)
                with open(os.path.join(self.proc_root, str(pid), "comm"), "w", encoding="utf-8") as fh:
                    fh.write(name + "\n")
        except OSError as exc:  # a read-only workdir: names are unknown, the PIDs still exported
            log.warning("simulate: cannot write process names under %s (%s)", self.proc_root, exc)

    def forget(self, match: Callable[[dict[str, Any]], bool]) -> None:
        """Drop the kept faults ``match`` selects (a ``port_up`` ends a held ``port_down``)."""
        before = len(self.kept)
        self.kept = [c for c in self.kept if not match(c)]
        if len(self.kept) != before and not self.replaying:
            self._save_hardware()

    def reboot(self) -> None:
        """A new boot id (the health stage clears its sticky verdicts on it) and repaired hardware."""
        self.boot_id = str(uuid.uuid4())
        self._write(BOOT_ID_FILE, self.boot_id + "\n")
        self.kernel_log.reboot()
        self.pci.reboot(self.boot_id)
        self.kept = []
        self._save_hardware()
        if self.nvml is not None:
            self.nvml.repair()
        if self.fabric is not None:
            for device, port in self.fabric.port_keys:
                self.fabric.set_up(device, port)
        log.info("simulate: the host rebooted (boot id %s); its hardware faults are repaired", self.boot_id)
        if self.on_reboot is not None:
            self.on_reboot()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="simulate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.azure.close()
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
            self.owned_dir = None

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self.step(self._tick)
            except Exception:  # a full disk or EMFILE must not freeze the simulated host for good
                log.exception("simulate: step failed")

    def step(self, seconds: float, wall: float | None = None) -> None:
        """Advance the simulated host by ``seconds`` and apply any control files dropped meanwhile;
        GPUs held by a job follow its rhythm at wall-clock time ``wall`` (default: now)."""
        with self._lock:
            job.drive(self, time.time() if wall is None else wall)
            if self.fabric is not None:
                self.fabric.tick(seconds)
            if self.nvml is not None:
                self.nvml.tick(seconds)
            if not self.read_only:
                self._read_controls()

    def _read_controls(self) -> None:
        try:
            names = sorted(os.listdir(self.control_dir))
        except OSError:
            return
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.control_dir, name)
            try:
                with open(path, encoding="utf-8") as fh:
                    command = json.load(fh)
            except FileNotFoundError:  # another process on the same host (``gpumon once``) took it
                continue
            except (OSError, ValueError) as exc:
                log.warning("simulate: ignoring control file %s: %s", name, exc)
            else:
                try:
                    self.apply(command)
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    log.warning("simulate: ignoring control file %s: %s", name, exc)
            try:
                os.unlink(path)
            except OSError:
                pass

    def apply(self, command: dict[str, Any]) -> None:
        """Apply one control command (the actions and their keys: :data:`gpumon.simulate.actions.ACTIONS`);
        a bad one raises ValueError, KeyError or TypeError and changes nothing kept."""
        if not isinstance(command, dict):
            raise TypeError("a control command is a JSON object")
        action = ACTIONS.get(str(command.get("action")))
        if action is None:
            raise ValueError(f"unknown action {command.get('action')!r} (known: {', '.join(ACTIONS)})")
        if action.handler(self, command) and command not in self.kept:
            self.kept.append(command)
            self._save_hardware()
        log.info("simulate: applied %s", command)


def control(workdir: str, command: dict[str, Any]) -> str:
    """Drop a control file for a running simulation (tests and the shell use this)."""
    control_dir = os.path.join(workdir, "control")
    os.makedirs(control_dir, exist_ok=True)
    # time first so commands apply in the order given; pid and a counter keep names unique
    name = f"{time.time_ns():020d}-{os.getpid()}-{next(_sequence):08d}"
    tmp = os.path.join(control_dir, f".{name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(command, fh)
    final = os.path.join(control_dir, f"{name}.json")
    os.replace(tmp, final)
    return final

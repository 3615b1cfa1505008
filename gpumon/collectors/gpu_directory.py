"""The GPUs the NVML collector last saw, shared with collectors that need them without NVML calls.

The attribution collector maps kubelet device ids (GPU and MIG UUIDs) and process ids to GPU
indexes. Asking NVML again would add calls per GPU per run; importing the NVML collector would tie
two collectors together. So the NVML collector publishes what it read each run here (through
``Context.get_shared(KEY, GpuDirectory)``) and readers take the latest copy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

KEY = "gpu_directory"


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_instance: int | None = None  # the MIG GPU instance the process runs in, when MIG is on


@dataclass(frozen=True)
class GpuEntry:
    """One GPU: ``index`` as the ``gpu`` label shows it, its UUID and PCI bus id, its MIG devices
    as ``(gpu_instance, MIG UUID)`` pairs and the compute processes NVML reported on it."""

    index: str
    uuid: str
    pci_bus_id: str = ""
    mig: tuple[tuple[int, str], ...] = ()
    processes: tuple[GpuProcess, ...] = ()


class GpuDirectory:
    """The latest list of GPUs, replaced whole by each NVML run; safe to read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gpus: tuple[GpuEntry, ...] = ()
        self._at: float | None = None
        self._first = threading.Event()

    def publish(self, gpus: tuple[GpuEntry, ...]) -> None:
        with self._lock:
            self._gpus, self._at = gpus, time.monotonic()
        self._first.set()

    def wait_first(self, timeout: float) -> bool:
        """Wait for the NVML collector's first run (collectors start together)."""
        return self._first.wait(timeout)

    def latest(self) -> tuple[tuple[GpuEntry, ...], float | None]:
        """The GPUs and the monotonic time they were read (None before the first NVML run)."""
        with self._lock:
            return self._gpus, self._at

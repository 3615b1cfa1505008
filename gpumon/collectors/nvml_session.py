"""One NVML session shared by the ``nvml`` and ``xid`` collectors.

NVML is initialised once per process (``nvmlInit`` is reference counted by the library, but two
collectors racing to init and shut down is a source of bugs), the device list is discovered once per
initialisation, every call is counted for ``gpumon_nvml_calls_total``, and a GPU found lost by either
collector is lost for both. Initialisation failures (no library, no driver, version mismatch while the
driver is being updated) make the session unavailable and are retried with exponential backoff.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml_tables import error_kind, error_name
from gpumon.model import Event, Severity

log = logging.getLogger("gpumon.nvml")

BACKOFF_MIN = 1.0
BACKOFF_MAX = 300.0


def nvml_code(exc: BaseException) -> int | None:
    """The NVML return code carried by a pynvml exception, or None for anything else."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def handle_key(handle: Any) -> int:
    """A hashable identity for a device handle (a ctypes pointer: two objects, same address)."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def text(value: Any) -> str:
    """pynvml returns str from most string getters but bytes from struct char arrays."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


@dataclass
class Device:
    index: int
    handle: Any
    uuid: str
    lost: bool = False
    lost_reason: str = ""
    lost_since: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def labels(self) -> tuple[str, str]:
        return (str(self.index), self.uuid)


class NvmlSession:
    """The shared NVML state. Thread-safe; never holds its lock across an NVML call that may hang,
    except ``nvmlInit`` itself (a hung init leaves the session "initialising", which callers see as
    unavailable rather than blocking on it)."""

    def __init__(self, lib: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._lib = lib
        self._clock = clock
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.ready = False
        self.generation = 0
        self.reason = "NVML not initialised yet"
        #: False while the last failure says this is no GPU host (no libnvidia-ml, no nvidia-ml-py);
        #: True when the library is there but init failed (driver not loaded, version mismatch).
        self.retryable = False
        self._backoff = BACKOFF_MIN
        self._next_try = 0.0
        self.devices: list[Device] = []
        self._by_handle: dict[int, Device] = {}
        self._lost_events: list[Event] = []
        self._refs = 0
        self._in_flight = 0
        self.driver_version = ""
        self.cuda_version = ""

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def lib(self) -> Any:
        if self._lib is None:
            import pynvml  # lazy: the module is only needed where NVML is used

            self._lib = pynvml
        return self._lib

    def acquire(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        """Drop one user; the last one shuts NVML down unless a call is still hung inside it."""
        with self._lock:
            self._refs = max(0, self._refs - 1)
            if self._refs or not self.ready:
                return
            self.ready = False
            self.reason = "NVML session closed"
            busy = self._in_flight > 0
        if busy:
            log.warning("NVML call still in flight at shutdown; not calling nvmlShutdown")
            return
        try:
            self.lib.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - shutdown errors change nothing
            log.debug("nvmlShutdown: %s", exc)

    def ensure(self) -> None:
        """Initialise NVML if needed; raise CollectorUnavailable with the reason while it cannot be."""
        if self.ready:
            return
        if not self._init_lock.acquire(blocking=False):
            raise CollectorUnavailable("NVML initialisation in progress")
        try:
            if self.ready:
                return
            now = self._clock()
            if now < self._next_try:
                raise CollectorUnavailable(self.reason)
            try:
                lib = self.lib
            except ImportError:
                self._fail("nvidia-ml-py (module pynvml) is not installed", now, retryable=False)
                raise CollectorUnavailable(self.reason) from None
            try:
                self._count("nvmlInit")
                lib.nvmlInit()
                self._discover(lib)
            except CollectorUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - any NVML failure leaves us unavailable
                code = nvml_code(exc)
                reason = f"NVML init failed: {exc}" + (f" ({error_name(code)})" if code else "")
                self._fail(reason, now, retryable=error_name(code) != "library_not_found")
                raise CollectorUnavailable(self.reason) from None
            with self._lock:
                self.ready = True
                self.generation += 1
                self._backoff = BACKOFF_MIN
                self.reason = ""
            log.info("NVML initialised: %d GPU(s), driver %s", len(self.devices), self.driver_version)
        finally:
            self._init_lock.release()

    def _fail(self, reason: str, now: float, retryable: bool) -> None:
        if reason != self.reason:
            if retryable:
                log.warning("%s; retrying with backoff", reason)
            else:  # no GPU host: the daemon says once that the collector is unavailable
                log.debug("%s", reason)
        self.reason = reason
        self.retryable = retryable
        self._next_try = now + self._backoff
        self._backoff = min(BACKOFF_MAX, self._backoff * 2)

    def invalidate(self, reason: str) -> None:
        """NVML stopped working mid-run (driver unloaded): unavailable until a re-init succeeds."""
        with self._lock:
            if not self.ready:
                return
            self.ready = False
            self.reason = reason
            self._next_try = self._clock() + self._backoff
        log.warning("%s; re-initialising NVML with backoff", reason)
        try:
            self.lib.nvmlShutdown()
        except Exception:  # noqa: BLE001 - the library is likely gone already
            pass

    def _discover(self, lib: Any) -> None:
        count = self.call("nvmlDeviceGetCount")
        devices = []
        for index in range(count):
            handle = self.call("nvmlDeviceGetHandleByIndex", index)
            uuid = text(self.call("nvmlDeviceGetUUID", handle))
            devices.append(Device(index, handle, uuid))
        try:
            self.driver_version = text(self.call("nvmlSystemGetDriverVersion"))
        except Exception:  # noqa: BLE001 - identity detail only
            self.driver_version = ""
        try:
            cuda = int(self.call("nvmlSystemGetCudaDriverVersion"))
            self.cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:  # noqa: BLE001 - identity detail only
            self.cuda_version = ""
        with self._lock:
            self.devices = devices
            self._by_handle = {handle_key(d.handle): d for d in devices}

    # --- calls -------------------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def call(self, name: str, *args: Any) -> Any:
        """Call ``pynvml.<name>(*args)``, counted. Exceptions pass through unchanged."""
        fn = getattr(self.lib, name)
        with self._lock:
            self.calls[name] += 1
            self._in_flight += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._in_flight -= 1

    def device_for(self, handle: Any) -> Device | None:
        return self._by_handle.get(handle_key(handle))

    # --- lost GPUs ---------------------------------------------------------------------------------

    def mark_lost(self, device: Device, reason: str, attributes: dict[str, Any] | None = None) -> bool:
        """Record a GPU as lost; True the first time (the caller then knows an event was queued)."""
        with self._lock:
            if device.lost:
                return False
            device.lost = True
            device.lost_reason = reason
            device.lost_since = self._clock()
            attrs = {"reason": reason, **(attributes or {})}
            self._lost_events.append(Event(
                "gpu_lost", Severity.CRITICAL, {"gpu": str(device.index), "uuid": device.uuid},
                f"GPU {device.index} ({device.uuid}) is lost: {reason}", attrs))
        log.error("GPU %d (%s) lost: %s", device.index, device.uuid, reason)
        return True

    def mark_recovered(self, device: Device) -> None:
        with self._lock:
            if not device.lost:
                return
            device.lost = False
            device.lost_reason = ""
            self._lost_events.append(Event(
                "gpu_recovered", Severity.INFO, {"gpu": str(device.index), "uuid": device.uuid},
                f"GPU {device.index} ({device.uuid}) answers again"))
        log.warning("GPU %d (%s) answers again", device.index, device.uuid)

    def drain_lost_events(self) -> list[Event]:
        with self._lock:
            events, self._lost_events = self._lost_events, []
        return events


def shared_session(ctx: Context) -> NvmlSession:
    """The session of this daemon (one per Context), built on ``ctx.nvml`` when a double is set."""
    return ctx.get_shared("nvml", lambda: NvmlSession(ctx.nvml))


def classify(exc: BaseException) -> tuple[str, int | None]:
    """(kind, code) for an exception raised by a pynvml call; non-NVML exceptions are transient."""
    code = nvml_code(exc)
    if code is None:
        return "transient", None
    return error_kind(code), code

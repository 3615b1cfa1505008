"""One NVML session shared by the ``nvml`` and ``xid`` collectors.

NVML is initialised once per process (``nvmlInit`` is reference counted by the library, but two
collectors racing to init and shut down is a source of bugs), the device list is discovered once per
initialisation, every call is counted for ``gpumon_nvml_calls_total``, and a GPU found lost by either
collector is lost for both. Initialisation failures (no library, no driver, version mismatch while the
driver is being updated) make the session unavailable and are retried with exponential backoff.

One GPU that does not answer at discovery does not take the others down: it is kept, marked lost, and
asked again like any lost GPU; one NVML refuses to this process (no permission) is left out, said once.
``nvmlShutdown`` is never called while another thread is inside NVML (the XID thread nearly always is):
it is deferred until the last call in flight returns, so every ``nvmlInit`` is still matched.
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

from gpumon.backoff import NO_JITTER, Backoff
from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml_tables import FUNCTION_NOT_FOUND, error_kind, error_name, unusable_cause
from gpumon.log_once import LogOnce
from gpumon.model import Event, Severity, StateReason

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


def driver_major(version: str) -> int:
    """The branch of a driver version string (``"550.90.07"`` -> 550); 0 when it cannot be read."""
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        return 0


def text(value: Any) -> str:
    """pynvml returns str from most string getters but bytes from struct char arrays."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


UNKNOWN_UUID = ""
"""The ``uuid`` label of a GPU whose UUID NVML could not read at discovery (it answered nothing): empty,
so Prometheus shows the series without a uuid and OTel falls back to ``gpu<index>`` for ``hw.id``."""


@dataclass
class Device:
    index: int
    handle: Any   # None when even nvmlDeviceGetHandleByIndex failed at discovery
    uuid: str
    lost: bool = False
    lost_since: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def labels(self) -> tuple[str, str]:
        return (str(self.index), self.uuid)

    @property
    def name(self) -> str:
        """How log lines and events name the GPU."""
        return f"GPU {self.index} ({self.uuid})" if self.uuid else f"GPU {self.index}"


class NvmlSession:
    """The shared NVML state. Thread-safe; never holds its lock across an NVML call that may hang,
    except ``nvmlInit`` itself (a hung init leaves the session "initialising", which callers see as
    unavailable rather than blocking on it)."""

    def __init__(self, lib: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._lib = lib
        self._clock = clock
        self.clock = clock
        """The monotonic clock of back-off and loss times; the collectors on this session share it."""
        self._lock = threading.Lock()
        self._no_shutdown = threading.Condition(self._lock)
        """Signalled when an ``nvmlShutdown`` ends: ``call`` does not enter NVML while one runs."""
        self._shutting_down = 0
        self._init_lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.ready = False
        self.generation = 0
        self.reason = "NVML not initialised yet"
        self.cause = StateReason.ERROR
        """Why, for ``gpumon_collector_state``, beside ``reason``'s words."""
        #: False while the last failure says this is no GPU host (no libnvidia-ml, no nvidia-ml-py);
        #: True when the library is there but init failed (driver not loaded, version mismatch).
        self.retryable = False
        #: Re-initialisation waits 1 s doubling to 300 s, without jitter (one host, a local library).
        self._backoff = Backoff(BACKOFF_MIN, BACKOFF_MAX, jitter=NO_JITTER)
        self._next_try = 0.0
        self.devices: list[Device] = []
        self._by_handle: dict[int, Device] = {}
        self._lost_events: list[Event] = []
        self._refs = 0
        self._in_flight = 0
        self._pending_shutdowns = 0
        self.driver_version = ""
        self.driver_major = 0
        self.cuda_version = ""
        #: GPUs nvmlDeviceGetCount counts but this process may not use (index -> reason), left out.
        self.skipped: dict[int, str] = {}
        self._errors: Counter[str] = Counter()
        self._log_once = LogOnce(log)
        #: Bumped whenever a lost GPU answers again, so the XID thread re-registers it.
        self.recoveries = 0
        self._no_temperature_v = False

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
        """Drop one user; the last one shuts NVML down (once no call is in flight)."""
        with self._lock:
            self._refs = max(0, self._refs - 1)
            if self._refs or not self.ready:
                return
            self.ready = False
            self.reason, self.cause = "NVML session closed", StateReason.ERROR
        self._shutdown("session closed")

    def _shutdown(self, why: str) -> None:
        """Match one ``nvmlInit``: now when no other thread is inside NVML, else when the last call in
        flight returns (``call`` does it). A call hung for good means NVML is never shut down, which is
        better than tearing the library down under it."""
        with self._lock:
            if self._in_flight > 0:
                self._pending_shutdowns += 1
                log.info("NVML call in flight (%s); nvmlShutdown deferred until it returns", why)
                return
            self._shutting_down += 1   # in the same critical section: no call can slip in between
        self._gated_shutdown(1)

    def _gated_shutdown(self, times: int) -> None:
        """Run ``times`` shutdowns announced in ``_shutting_down`` (by the caller, under the lock), then
        let calls waiting in ``call`` go on."""
        try:
            for _ in range(times):
                self._nvml_shutdown()
        finally:
            with self._lock:
                self._shutting_down -= times
                self._no_shutdown.notify_all()

    def _nvml_shutdown(self) -> None:
        try:
            self.lib.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - shutdown errors change nothing
            log.debug("nvmlShutdown: %s", exc)

    def ensure(self) -> None:
        """Initialise NVML if needed; raise CollectorUnavailable with the reason while it cannot be."""
        if self.ready:
            return
        if not self._init_lock.acquire(blocking=False):
            raise CollectorUnavailable("NVML initialisation in progress", StateReason.INIT_FAILED)
        try:
            if self.ready:
                return
            now = self._clock()
            if now < self._next_try:
                raise CollectorUnavailable(self.reason, self.cause)
            try:
                lib = self.lib
            except ImportError:
                self._fail("nvidia-ml-py (module pynvml) is not installed", now, retryable=False,
                           cause=StateReason.LIBRARY_NOT_FOUND)
                raise CollectorUnavailable(self.reason, self.cause) from None
            self._run_pending_shutdowns()
            inited = False
            try:
                self._count("nvmlInit")
                lib.nvmlInit()
                inited = True
                self._discover(lib)
            except Exception as exc:  # noqa: BLE001 - any NVML failure leaves us unavailable
                if inited:   # discovery failed as a whole: give back what nvmlInit took
                    self._shutdown("discovery failed")
                code = nvml_code(exc)
                reason = f"NVML init failed: {exc}" + (f" ({error_name(code)})" if code else "")
                self._fail(reason, now, retryable=code is None or error_name(code) != "library_not_found",
                           cause=unusable_cause(code, StateReason.INIT_FAILED))
                raise CollectorUnavailable(self.reason, self.cause) from None
            with self._lock:
                self.ready = True
                self.generation += 1
                self._backoff.succeeded()
                self.reason = ""
            log.info("NVML initialised: %d GPU(s), driver %s", len(self.devices), self.driver_version)
        finally:
            self._init_lock.release()

    def _fail(self, reason: str, now: float, retryable: bool, cause: StateReason) -> None:
        if reason != self.reason:
            if retryable:
                log.warning("%s; retrying with backoff", reason)
            else:  # no GPU host: the daemon says once that the collector is unavailable
                log.debug("%s", reason)
        self.reason, self.cause = reason, cause
        self.retryable = retryable
        self._next_try = now + self._backoff.failed(now)

    def _run_pending_shutdowns(self) -> None:
        """Before a new ``nvmlInit``: the shutdowns deferred meanwhile, if nothing is in flight now, so
        the library really starts over (a driver reload needs that)."""
        with self._lock:
            if self._in_flight > 0:
                return
            pending, self._pending_shutdowns = self._pending_shutdowns, 0
            self._shutting_down += pending
        if pending:
            self._gated_shutdown(pending)

    def invalidate(self, reason: str, cause: StateReason = StateReason.ERROR) -> None:
        """NVML stopped working mid-run (driver unloaded): unavailable until a re-init succeeds."""
        with self._lock:
            if not self.ready:
                return
            self.ready = False
            self.reason, self.cause = reason, cause
            self._next_try = self._clock() + self._backoff.next_delay()
        log.warning("%s; re-initialising NVML with backoff", reason)
        self._shutdown("invalidated")

    def _discover(self, lib: Any) -> None:
        """Every GPU NVML counts, each on its own: one that fails does not fail the others."""
        count = int(self.call("nvmlDeviceGetCount"))
        devices: list[Device] = []
        failed: list[tuple[Device, str]] = []
        skipped: dict[int, str] = {}
        for index in range(count):
            handle: Any = None
            what = "nvmlDeviceGetHandleByIndex"
            try:
                handle = self.call(what, index)
                what = "nvmlDeviceGetUUID"
                uuid = text(self.call(what, handle))
            except Exception as exc:  # noqa: BLE001 - classified below
                kind, code = classify(exc)
                if kind == "unavailable":
                    raise            # NVML itself is gone: the whole discovery fails
                reason = f"{what}: {exc}"
                self._count_error(code)
                if kind == "unsupported":   # e.g. NO_PERMISSION: not ours to watch
                    skipped[index] = reason
                    self._log_once.warning((index, reason), "GPU %d left out: NVML refuses it to this process "
                                           "(%s)", index, reason)
                    continue
                device = Device(index, handle, UNKNOWN_UUID)
                failed.append((device, reason))
                devices.append(device)
                continue
            devices.append(Device(index, handle, uuid))
        try:
            self.driver_version = text(self.call("nvmlSystemGetDriverVersion"))
        except Exception:  # noqa: BLE001 - identity detail only
            self.driver_version = ""
        self.driver_major = driver_major(self.driver_version)
        try:
            cuda = int(self.call("nvmlSystemGetCudaDriverVersion"))
            self.cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:  # noqa: BLE001 - identity detail only
            self.cuda_version = ""
        with self._lock:
            self.devices = devices
            self.skipped = skipped
            self._by_handle = {handle_key(d.handle): d for d in devices if d.handle is not None}
        for device, reason in failed:
            self.mark_lost(device, f"not answering at discovery ({reason})")

    def _count_error(self, code: int | None) -> None:
        with self._lock:
            self._errors[f"nvml_{error_name(code)}" if code is not None else "nvml_error"] += 1

    def drain_errors(self) -> Counter[str]:
        """Errors met outside a collector's run (discovery), for the next run to count."""
        with self._lock:
            errors, self._errors = self._errors, Counter()
        return errors

    # --- calls -------------------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def call(self, name: str, *args: Any) -> Any:
        """Call ``pynvml.<name>(*args)``, counted. Exceptions pass through unchanged."""
        fn = getattr(self.lib, name)
        with self._lock:
            if self._shutting_down and not self._no_shutdown.wait_for(lambda: not self._shutting_down, 10.0):
                log.warning("nvmlShutdown has not returned in 10 s; calling %s anyway", name)
            self.calls[name] += 1
            self._in_flight += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._in_flight -= 1
                pending = self._pending_shutdowns if self._in_flight == 0 else 0
                self._pending_shutdowns -= pending
                self._shutting_down += pending
            if pending:   # the shutdowns deferred while this call was inside NVML
                self._gated_shutdown(pending)

    def device_for(self, handle: Any) -> Device | None:
        return self._by_handle.get(handle_key(handle))

    def probe(self, handle: Any) -> None:
        """Raise what NVML raises for a call that reaches the GPU (GPU_IS_LOST, ...); return when it
        answered, even "not supported". The GPU temperature: every driver has one of its two calls
        (``nvmlDeviceGetTemperatureV`` from R570 on, the deprecated ``nvmlDeviceGetTemperature``
        before)."""
        names = ["nvmlDeviceGetTemperature"]
        if not self._no_temperature_v:
            names.insert(0, "nvmlDeviceGetTemperatureV")
        for name in names:
            try:
                self.call(name, handle, 0)   # NVML_TEMPERATURE_GPU
                return
            except Exception as exc:  # noqa: BLE001 - classified below
                kind, code = classify(exc)
                if code == FUNCTION_NOT_FOUND and name == "nvmlDeviceGetTemperatureV":
                    self._no_temperature_v = True
                    continue
                if kind == "unsupported":
                    return
                raise

    # --- lost GPUs ---------------------------------------------------------------------------------

    def mark_lost(self, device: Device, reason: str, attributes: dict[str, Any] | None = None) -> bool:
        """Record a GPU as lost; True the first time (the caller then knows an event was queued)."""
        with self._lock:
            if device.lost:
                return False
            device.lost = True
            device.lost_since = self._clock()
            attrs = {"reason": reason, **(attributes or {})}
            self._lost_events.append(Event(
                "gpu_lost", Severity.CRITICAL, {"gpu": str(device.index), "uuid": device.uuid},
                f"{device.name} is lost: {reason}", attrs))
        log.error("%s lost: %s", device.name, reason)
        return True

    def mark_recovered(self, device: Device, handle: Any = None, uuid: str = "") -> None:
        """The GPU answers again, through ``handle`` (a new one after a reset) and with ``uuid`` (read
        for the first time when discovery could not)."""
        with self._lock:
            if not device.lost:
                return
            if handle is not None:
                if device.handle is not None:
                    self._by_handle.pop(handle_key(device.handle), None)
                device.handle = handle
                self._by_handle[handle_key(handle)] = device
            if uuid:
                device.uuid = uuid
            device.lost = False
            self.recoveries += 1
            self._lost_events.append(Event(
                "gpu_recovered", Severity.INFO, {"gpu": str(device.index), "uuid": device.uuid},
                f"{device.name} answers again"))
        log.warning("%s answers again", device.name)

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

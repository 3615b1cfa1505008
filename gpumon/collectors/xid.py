"""XID errors and GPU-unavailable / recovery-action events, from a thread blocked on NVML's event set.

XIDs are events, not states: polling misses them. A dedicated thread waits on ``nvmlEventSetWait_v2``
with a short timeout (so ``close()`` returns promptly) and queues what it sees; each ``collect()``
drains the queue into ``gpu_xid`` events (with the XID's meaning and severity) and keeps
``gpumon_gpu_xid_errors_total{gpu,uuid,xid}`` counting for the life of the process, so an XID is
never "the last value of a gauge". XID 79 and the GPU-unavailable event mark the GPU lost for the
``nvml`` collector too (the session is shared).

A lost GPU in the event set makes every wait answer GPU_IS_LOST: the thread then finds which GPU no
longer answers, marks it lost, and rebuilds the set without it (and again with it once it recovers), so
the other GPUs' XIDs keep coming. After a reload the new collector takes over the old one's totals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gpumon.catalogue.gpu import (
    RECOVERY_TOTAL,
    THREAD_UP,
    XID_TOTAL,
)
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.collectors.nvml_session import Device, NvmlSession, classify, shared_session
from gpumon.collectors.nvml_tables import (
    EVENT_GPU_RECOVERY_ACTION,
    EVENT_GPU_UNAVAILABLE,
    EVENT_XID,
    NO_INSTANCE,
    RECOVERY_ACTIONS,
    TIMEOUT,
    error_name,
    xid_info,
)
from gpumon.config import Option, Section, SectionSchema
from gpumon.model import Collection, Event, MetricSpec, Severity, StateReason
from gpumon.xid_ledger import bus_id_of, shared_ledger

log = logging.getLogger("gpumon.xid")

WAIT_MS = 500
"""Event wait timeout: how long close() may wait for the thread; an idle wakeup (a TIMEOUT raised
through pynvml and classified) costs about 0.3 ms of CPU on a cold cache, so twice a second, not five
times (an event still returns the wait at once)."""
ERROR_PAUSE = 1.0
XID_GPU_LOST = 79

@dataclass(frozen=True)
class XidSettings:
    interval: float


OPTIONS = SectionSchema(
    "xid",
    "XID errors and GPU-lost events from NVML's event API (a thread of its own).",
    (
        Option("interval", float, 0.0, "How often queued events are published; 0 uses [daemon] interval.",
               min=0.0, max=3600.0),
    ),
    XidSettings,
)


@dataclass(frozen=True)
class _Seen:
    time: float
    device: Device
    event_type: int
    data: int
    gpu_instance: int
    compute_instance: int


class XidCollector(Collector):
    name = "xid"
    description = "XID errors, GPU-unavailable and recovery-action events from NVML."
    options = OPTIONS
    settings: XidSettings

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        self.session: NvmlSession = shared_session(ctx)
        self.session.acquire()
        self._lock = threading.Lock()
        self._queue: list[_Seen] = []
        self._counts: Counter[tuple[int, str, int]] = Counter()
        self._recovery: Counter[tuple[int, str, str]] = Counter()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._watching = threading.Event()
        self._generation = -1
        self._closed = False
        self._errors: Counter[str] = Counter()
        self._said_no_members = False
        self._ledger = shared_ledger(ctx)  # so the kmsg collector counts an XID NVML reported only once

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (XID_TOTAL, RECOVERY_TOTAL, THREAD_UP)

    def probe(self) -> Availability:
        try:
            self.session.ensure()
        except CollectorUnavailable as exc:
            return Availability(False, str(exc), retry=self.session.retryable, cause=exc.cause)
        return Availability(True) if self.session.devices else \
            Availability(False, "NVML reports no GPUs", cause=StateReason.NO_SOURCE)

    # --- the thread ----------------------------------------------------------------------------------

    def _start(self) -> None:
        """(Re)start the watcher for the current NVML session generation."""
        self._stop_thread()
        self._stop = threading.Event()
        self._generation = self.session.generation
        self._thread = threading.Thread(target=self._watch, args=(self._stop, self._generation),
                                        name="gpumon-xid", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2 * WAIT_MS / 1000.0 + 0.5)
            if self._thread.is_alive():
                log.warning("XID thread stuck inside NVML; abandoned")
            self._thread = None
        self._watching.clear()

    def _watch(self, stop: threading.Event, generation: int) -> None:
        """Build an event set of the GPUs that answer and wait on it; rebuild it when a GPU in it is
        lost or a lost one recovers. Ends on stop, when NVML goes away, or when no GPU takes events."""
        s = self.session
        while not stop.is_set():
            try:
                event_set = s.call("nvmlEventSetCreate")
            except Exception as exc:  # noqa: BLE001 - no events at all: say so, collector keeps running
                self._note_error(exc, "nvmlEventSetCreate")
                return
            rebuild = False
            recoveries = s.recoveries  # before registering: a GPU that recovers meanwhile is re-registered
            try:
                members = self._register(event_set)
                if not members:
                    log.log(logging.DEBUG if self._said_no_members else logging.WARNING,
                            "no GPU accepts XID event registration; XIDs will not be reported")
                    self._said_no_members = True
                    return
                self._watching.set()
                rebuild = self._wait(stop, generation, event_set, members, recoveries)
            finally:
                self._watching.clear()
                try:
                    s.call("nvmlEventSetFree", event_set)
                except Exception:  # noqa: BLE001 - the set dies with the process anyway
                    pass
            if not rebuild:
                return
            log.info("XID event set rebuilt without the lost GPU(s) / with the recovered one(s)")

    def _wait(self, stop: threading.Event, generation: int, event_set: Any, members: list[Device],
              recoveries: int) -> bool:
        """Wait on one event set; True when it must be rebuilt, False to end the thread."""
        s = self.session
        while not stop.is_set():
            if not s.ready or s.generation != generation:
                return False          # NVML is being re-initialised: collect() starts a new thread
            if s.recoveries != recoveries:
                self._drain(event_set)
                return True           # a lost GPU answers again: register it too
            try:
                data = s.call("nvmlEventSetWait_v2", event_set, WAIT_MS)
            except Exception as exc:  # noqa: BLE001 - classified below
                kind, code = classify(exc)
                if code == TIMEOUT:   # nothing happened
                    continue
                self._note_error(exc, "nvmlEventSetWait_v2")
                if kind == "unavailable":
                    return False
                if kind == "lost":    # a GPU in the set is lost: every wait says so until it leaves
                    self._mark_lost_members(members, exc)
                    stop.wait(ERROR_PAUSE if not any(d.lost for d in members) else 0)
                    return True
                stop.wait(ERROR_PAUSE)
                continue
            self._enqueue(data)
        return False

    def _drain(self, event_set: Any) -> None:
        """Take what the set already holds before it is freed."""
        while True:
            try:
                data = self.session.call("nvmlEventSetWait_v2", event_set, 0)
            except Exception:  # noqa: BLE001 - TIMEOUT: empty; anything else: nothing more to take
                return
            self._enqueue(data)

    def _mark_lost_members(self, members: list[Device], exc: BaseException) -> None:
        """The wait does not say which GPU is lost: ask each member with a call that reaches it."""
        for dev in members:
            if dev.lost:
                continue
            try:
                self.session.probe(dev.handle)
            except Exception as probe_exc:  # noqa: BLE001 - classified below
                kind, _ = classify(probe_exc)
                if kind == "lost":
                    self.session.mark_lost(dev, f"nvmlEventSetWait_v2: {exc}; {probe_exc}")

    def _register(self, event_set: Any) -> list[Device]:
        """Register every GPU that answers for XIDs plus the newer event types where the driver has
        them; the GPUs registered."""
        wanted = EVENT_XID | EVENT_GPU_UNAVAILABLE | EVENT_GPU_RECOVERY_ACTION
        registered: list[Device] = []
        for dev in self.session.devices:
            if dev.lost or dev.handle is None:
                continue
            mask = wanted
            try:
                mask = wanted & int(self.session.call("nvmlDeviceGetSupportedEventTypes", dev.handle))
            except Exception as exc:  # noqa: BLE001 - fall back to asking for XIDs alone
                kind, _ = classify(exc)
                if kind == "lost":
                    self.session.mark_lost(dev, f"nvmlDeviceGetSupportedEventTypes: {exc}")
                    continue
                mask = EVENT_XID
            if not mask & EVENT_XID:
                log.warning("GPU %d does not support XID events", dev.index)
                continue
            try:
                self.session.call("nvmlDeviceRegisterEvents", dev.handle, mask, event_set)
                registered.append(dev)
                bus_id_of(self.session, dev)  # asked while the GPU answers: after XID 79 it will not
            except Exception as exc:  # noqa: BLE001 - one GPU refusing must not stop the others
                kind, _ = classify(exc)
                if kind == "lost":
                    self.session.mark_lost(dev, f"nvmlDeviceRegisterEvents: {exc}")
                else:
                    log.warning("GPU %d: XID event registration failed: %s", dev.index, exc)
                self._note_error(exc, "nvmlDeviceRegisterEvents", log_it=False)
        return registered

    def _note_error(self, exc: BaseException, what: str, log_it: bool = True) -> None:
        _, code = classify(exc)
        reason = f"nvml_{error_name(code)}" if code is not None else "nvml_error"
        with self._lock:
            first = self._errors[reason] == 0
            self._errors[reason] += 1
        if log_it and first:
            log.warning("%s failed: %s", what, exc)

    def _enqueue(self, data: Any) -> None:
        dev = self.session.device_for(data.device)
        if dev is None:
            self._note_error(Exception("event from an unknown device handle"), "event")
            return
        seen = _Seen(time.time(), dev, int(data.eventType), int(data.eventData),
                     int(getattr(data, "gpuInstanceId", NO_INSTANCE)),
                     int(getattr(data, "computeInstanceId", NO_INSTANCE)))
        if seen.event_type & EVENT_XID:
            self._ledger.note_nvml(bus_id_of(self.session, dev), seen.data, seen.time)
        if seen.event_type & EVENT_XID and seen.data == XID_GPU_LOST:
            self.session.mark_lost(dev, "XID 79: GPU has fallen off the bus", {"xid": XID_GPU_LOST})
        elif seen.event_type & EVENT_GPU_UNAVAILABLE:
            self.session.mark_lost(dev, "GPU unavailable event", {"event_data": seen.data})
        with self._lock:
            self._queue.append(seen)
        self.run_soon()  # an XID reaches the page, the health verdict and the sinks within a second

    # --- collect -------------------------------------------------------------------------------------

    def collect(self) -> Collection:
        self.session.ensure()
        if self._thread is None or self._generation != self.session.generation or not self._thread.is_alive():
            self._start()
        out = Collection()
        with self._lock:  # the totals change only under the lock: a reload's inherit() may read them
            queue, self._queue = self._queue, []
            errors, self._errors = self._errors, Counter()
            out.events.extend(self._event(seen) for seen in queue)
            xids, recoveries = sorted(self._counts.items()), sorted(self._recovery.items())
        for reason, n in errors.items():
            out.count_error(reason, n)
        out.events.extend(self.session.drain_lost_events())
        out.add(XID_TOTAL, [XID_TOTAL.sample(n, str(i), uuid, str(x)) for (i, uuid, x), n in xids])
        out.add(RECOVERY_TOTAL, [RECOVERY_TOTAL.sample(n, str(i), uuid, a) for (i, uuid, a), n in recoveries])
        out.add(THREAD_UP, [THREAD_UP.sample(1.0 if self._watching.is_set() else 0.0)])
        return out

    def _event(self, seen: _Seen) -> Event:
        dev = seen.device
        subject = {"gpu": str(dev.index), "uuid": dev.uuid}
        if seen.event_type & EVENT_XID:
            info = xid_info(seen.data)
            self._counts[(dev.index, dev.uuid, seen.data)] += 1
            attrs: dict[str, Any] = {"xid": seen.data, "meaning": info.meaning}
            if info.action:
                attrs["action"] = info.action
            if seen.gpu_instance != NO_INSTANCE:   # GI 0 is a real MIG instance
                attrs["gpu_instance"] = seen.gpu_instance
                attrs["compute_instance"] = seen.compute_instance
            return Event("gpu_xid", info.severity, subject,
                         f"GPU {dev.index} XID {seen.data}: {info.meaning}", attrs, time=seen.time)
        if seen.event_type & EVENT_GPU_RECOVERY_ACTION:
            action, severity = RECOVERY_ACTIONS.get(seen.data, (f"action_{seen.data}", Severity.ERROR))
            self._recovery[(dev.index, dev.uuid, action)] += 1
            return Event("gpu_recovery_action", severity, subject,
                         f"GPU {dev.index}: driver requests recovery action {action}",
                         {"action": action, "code": seen.data}, time=seen.time)
        return Event("gpu_unavailable", Severity.CRITICAL, subject,
                     f"GPU {dev.index}: driver reports the GPU unavailable",
                     {"event_type": seen.event_type, "event_data": seen.data}, time=seen.time)

    def inherit(self, previous: Collector) -> None:
        """After a reload: keep counting from the old instance's totals, and publish what it had seen
        but not yet published, so gpumon_gpu_xid_errors_total does not reset."""
        if not isinstance(previous, XidCollector):
            return
        with previous._lock:
            queue, previous._queue = previous._queue, []
            errors, previous._errors = previous._errors, Counter()
            counts, recovery = Counter(previous._counts), Counter(previous._recovery)
        with self._lock:
            self._queue[:0] = queue
            self._errors.update(errors)
            self._counts.update(counts)
            self._recovery.update(recovery)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_thread()
        self.session.release()

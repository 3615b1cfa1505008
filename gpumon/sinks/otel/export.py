"""The OpenTelemetry sink's senders, one per signal, each driven by its own
:class:`~gpumon.sinks.delivery.Uploader` (so a slow metrics export never delays an XID's log record):
encode a batch, send it, classify the answer as an :class:`~gpumon.sinks.delivery.Outcome` and count
it. The waiting, the backoff and the last try at stop are the Uploader's.

- metrics: the latest snapshot, from a :class:`~gpumon.sinks.queues.LatestSlot`. A failed export is
  retried with whatever snapshot is latest by then (the values are cumulative); one superseded that
  way, refused, or failed at stop has its points counted dropped.
- logs: events from a :class:`~gpumon.sinks.queues.BoundedQueue`, up to 512 a request. A failed batch
  is kept and retried; refused (or throttled without RetryInfo ``THROTTLED_LOG_ATTEMPTS`` times) it
  is dropped and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from gpumon.log_once import LogOnce
from gpumon.model import Event, Snapshot
from gpumon.sinks.common import DeliveryCounters, redact_url
from gpumon.sinks.delivery import Outcome
from gpumon.sinks.otel.encoding import MetricEncoder, encode_logs
from gpumon.sinks.otel.settings import SignalSettings
from gpumon.sinks.otel.transport import THROTTLED_LOG_ATTEMPTS, SendResult, make_transport, send
from gpumon.sinks.queues import BoundedQueue, Held, Taken

__all__ = ["LOG_BATCH", "Exporting", "LogsSender", "MetricsSender"]

log = logging.getLogger("gpumon.sinks.otel")

LOG_BATCH = 512
"""Log records in one export request at most."""


class Exporting:
    """What both senders read from the sink: the resource (refined once by the Azure detection,
    which the first export of each signal waits for, a little longer than an IMDS call may take),
    the version, and the stop deadline (set at stop: every send is then the last try, bounded by it)."""

    def __init__(self, version: str, resource: dict[str, str], ready_wait: float) -> None:
        self.version = version
        self._resource = resource
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self.ready_wait = ready_wait
        self.stop_deadline: float | None = None

    @property
    def resource(self) -> dict[str, str]:
        with self._lock:
            return dict(self._resource)

    def set_resource(self, resource: dict[str, str]) -> None:
        with self._lock:
            self._resource = resource

    def timeout(self, configured: float) -> float | None:
        """The request's timeout: the configured one (None), or at stop what is left of the deadline."""
        if self.stop_deadline is None:
            return None
        return max(0.05, min(configured, self.stop_deadline - time.monotonic()))


def _retry(result: SendResult, ack: bool) -> Outcome:
    """A failed export: back off before the next (the server's Retry-After, a configuration fault's floor)."""
    return Outcome(ack=ack, retry=True, retry_after=result.retry_after, config=result.config)


class _Sender:
    """One signal's transport, counters and log lines."""

    signal = ""

    def __init__(self, state: Exporting, settings: SignalSettings, transport: Any, counters: DeliveryCounters,
                 log_once: LogOnce) -> None:
        self._state = state
        self._settings = settings
        self._transport = transport
        self.counters = counters
        self._log_once = log_once
        self._waited = False
        self._detail = ""

    def _first_wait(self) -> None:
        """The first export waits for the Azure attributes: the resource identifies the exporter."""
        if not self._waited:
            self._state.ready.wait(self._state.ready_wait)
            self._waited = True

    def _transmit(self, request: Any) -> SendResult:
        """Send through the transport (built anew when a previous fault discarded it); a fault in the
        transport itself is a failed, retryable attempt, never the end of the uploader's thread."""
        transport = self._transport
        try:
            if transport is None:
                transport = self._transport = make_transport(self._settings, self._state.version)
            return send(transport, request, self._state.timeout(self._settings.timeout))
        except Exception as exc:  # noqa: BLE001 - the thread must outlive it and retry with backoff
            self._transport = None
            if transport is not None:
                try:
                    transport.close()
                except Exception:  # noqa: BLE001 - closing a broken transport
                    pass
            return SendResult(False, True, f"transport: {type(exc).__name__}: {exc}")

    def _count(self, result: SendResult, items: int) -> None:
        """Count an export's outcome; log a recovery, and a rejection once."""
        if result.ok:
            if self.counters.consecutive_failures:
                log.info("otel: %s export to %s recovered", self.signal, redact_url(self._settings.endpoint))
            self._log_once.clear(f"failed-{self.signal}")
            self.counters.succeeded(items - result.rejected)
            self.counters.dropped_items(result.rejected)
            if result.rejected:
                self._log_once.warning(f"rejected-{self.signal}", "otel: the collector rejected %d %s items",
                                       result.rejected, self.signal)
            return
        self._detail = result.detail
        self.counters.failed_attempt(1, result.detail)  # gpumon_sink_failed_total counts requests

    def retrying(self, delay: float) -> None:
        """The Uploader backs off after a failure: say so once, until an export goes through."""
        self._log_once.warning(f"failed-{self.signal}", "otel: %s export to %s failed (%s); retrying with backoff, "
                               "next in %.2f s", self.signal, redact_url(self._settings.endpoint), self._detail,
                               delay)

    def fault(self, exc: Exception) -> Outcome:
        """A round raised outside the send (a bug): counted as a failed attempt, retried."""
        self._detail = f"{type(exc).__name__}: {exc}"
        self.counters.failed_attempt(1, self._detail)
        return Outcome(ack=False, retry=True)

    def close(self) -> None:
        """The uploader's thread ends: so does the connection it used."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None


class MetricsSender(_Sender):
    """The latest snapshot as one ExportMetricsServiceRequest."""

    signal = "metrics"

    def __init__(self, state: Exporting, settings: SignalSettings, transport: Any, counters: DeliveryCounters,
                 log_once: LogOnce) -> None:
        super().__init__(state, settings, transport, counters, log_once)
        self._encoder = MetricEncoder(state.version)
        self._pending: tuple[Snapshot, int] | None = None
        """A snapshot that failed and awaits its retry, with its points."""

    def send(self, batch: Held[Snapshot]) -> Outcome:
        self._first_wait()
        snapshot, last = batch.item, self._state.stop_deadline is not None
        if self._pending is not None and self._pending[0] is not snapshot:
            self.counters.dropped_items(self._pending[1])  # superseded by a newer snapshot: given up
        self._pending = None
        try:
            request, points = self._encoder.encode(snapshot, self._state.resource)
        except Exception as exc:  # noqa: BLE001 - a bad value must not kill the export thread
            self._log_once.warning("encode", "otel: could not encode a snapshot: %s", exc)
            return Outcome(ack=True)
        result = self._transmit(request)
        self._count(result, points)
        if result.ok:
            return Outcome(ack=True, delivered=True)
        if result.retryable and not last:
            self._pending = (snapshot, points)  # the retry sends whatever is latest by then
            return _retry(result, ack=False)
        self.counters.dropped_items(points)
        return _retry(result, ack=True)


class LogsSender(_Sender):
    """Queued events as ExportLogsServiceRequests."""

    signal = "logs"

    def __init__(self, state: Exporting, settings: SignalSettings, transport: Any, counters: DeliveryCounters,
                 log_once: LogOnce, queue: BoundedQueue[Event]) -> None:
        super().__init__(state, settings, transport, counters, log_once)
        self._queue = queue
        self._throttled = 0
        """Attempts of the head batch answered RESOURCE_EXHAUSTED without RetryInfo."""

    def send(self, batch: Taken[Event]) -> Outcome:
        self._first_wait()
        try:
            request = encode_logs(list(batch.items), self._state.resource, self._state.version)
        except Exception as exc:  # noqa: BLE001 - an attribute that will not encode
            self._log_once.warning("encode-logs", "otel: could not encode events: %s", exc)
            result = SendResult(False, False, f"encode: {exc}")
        else:
            result = self._transmit(request)
        keep = not result.ok and (result.retryable
                                  or (result.throttled and self._throttled + 1 < THROTTLED_LOG_ATTEMPTS))
        self._throttled = self._throttled + 1 if keep and not result.retryable else 0
        if keep:  # what publish() evicted of the batch meanwhile is not retried
            self.counters.dropped_items(self._queue.release(batch))
        elif not result.ok:
            self.counters.dropped_items(len(batch.items))
        self._count(result, len(batch.items))
        if result.ok:
            return Outcome(ack=True, delivered=True)
        return _retry(result, ack=not keep)

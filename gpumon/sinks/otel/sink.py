"""The OtelSink: ``publish`` swaps in the latest snapshot and queues its events; one thread exports
metrics and one exports logs, each with its own backoff, so a slow metrics export never delays an
XID's log record."""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpumon.backoff import Backoff
from gpumon.config import readable_file_check
from gpumon.identity import azure_settings
from gpumon.log_once import LogOnce
from gpumon.model import Event, Snapshot
from gpumon.sinks import azure_host
from gpumon.sinks.base import CheckResult, Sink, SinkContext, SinkHealth
from gpumon.sinks.common import (
    DeliveryCounters,
    has_new_results,
    redact_url,
)
from gpumon.sinks.otel.encoding import MetricEncoder, encode_logs, pb_modules
from gpumon.sinks.otel.resource import azure_attributes, resource_attributes
from gpumon.sinks.otel.settings import (
    GRPC,
    IMDS_ALIASES,
    OPTIONS,
    SIGNALS,
    OtelSettings,
    SignalSettings,
    resolve_settings,
)
from gpumon.sinks.otel.transport import THROTTLED_LOG_ATTEMPTS, SendResult, make_transport, send

if TYPE_CHECKING:
    from gpumon.config import Section


log = logging.getLogger("gpumon.sinks.otel")


class OtelSink(Sink):
    """OTLP metrics (hardware semantic conventions) and events as log records."""

    name = "otel"
    description = "OpenTelemetry OTLP export (http/protobuf or gRPC) of metrics and events."
    options = OPTIONS
    settings: OtelSettings
    requires = ("google.protobuf", "opentelemetry.proto")
    extra = "otel"
    config_backoff_min = 30.0
    """Seconds at least before retrying after a configuration fault (a redirect not followed)."""

    def __init__(self, ctx: SinkContext, cfg: Section | None = None, environ: Mapping[str, str] | None = None
                 ) -> None:
        super().__init__(ctx, cfg)
        self._environ = os.environ if environ is None else environ
        self._lock = threading.Lock()
        self._wake_metrics = threading.Condition(self._lock)
        self._wake_logs = threading.Condition(self._lock)
        self._stopping = False
        self._latest: Snapshot | None = None
        self._events: collections.deque[tuple[int, Event]] = collections.deque()
        """Queued events with their sequence numbers (from 1), oldest first."""
        self._event_seq = 0
        self._in_flight = 0
        """Sequence number of the last event of the batch being sent; 0 when none is."""
        self._metrics = DeliveryCounters()
        self._logs = DeliveryCounters()
        self._resource: dict[str, str] = {}
        self._resource_ready = threading.Event()
        self._threads: list[threading.Thread] = []
        self._settings: dict[str, SignalSettings] = {}
        self._transports: dict[str, Any] = {}
        """Built by start(), so that a certificate that will not load fails start-up, not a thread."""
        self._started = False
        self._log_once = LogOnce(log)

    # -- lifecycle

    def _resolve(self) -> dict[str, SignalSettings]:
        signals = SIGNALS if self.settings.logs else ("metrics",)
        return {s: resolve_settings(self.settings, s, self._environ) for s in signals}

    def start(self) -> None:
        self.ensure_dependencies()
        self._settings = self._resolve()
        if any(s.protocol == GRPC for s in self._settings.values()):
            try:
                import grpc  # noqa: F401
            except ImportError as exc:
                raise RuntimeError("otel protocol grpc needs grpcio: pip install 'gpumon-exporter[otel]'") from exc
        pb_modules()  # fail start-up now, not on the first export, if the protobuf classes do not load
        self._transports = self._make_transports()
        try:
            self._resource = resource_attributes(self.ctx, self.settings.resource_attributes, self._environ)
        except BaseException:
            for transport in self._transports.values():
                transport.close()
            raise
        if self._overrides is None:
            self._resource_ready.set()
        self._threads = [threading.Thread(target=self._metrics_loop, name="otel-metrics", daemon=True)]
        if "logs" in self._settings:
            self._threads.append(threading.Thread(target=self._logs_loop, name="otel-logs", daemon=True))
        self._started = True
        for thread in self._threads:
            thread.start()
        where = ", ".join(f"{s.signal} -> {redact_url(s.endpoint)}" for s in self._settings.values())
        log.info("otel: exporting over %s (%s)", self._settings["metrics"].protocol, where)

    def _make_transports(self) -> dict[str, Any]:
        """One transport per signal; raises RuntimeError naming the signal, the endpoint and the files
        when one cannot be built (a certificate or key missing, unreadable or not PEM)."""
        built: dict[str, Any] = {}
        try:
            for signal, settings in self._settings.items():
                files = [(key, path) for key, path in (
                    ("certificate", settings.certificate), ("client_certificate", settings.client_certificate),
                    ("client_key", settings.client_key)) if path]
                for key, path in files:  # the OTEL_* variables name files no config check has seen
                    problem = readable_file_check(path)
                    if problem:
                        raise RuntimeError(f"otel {signal} {key}: {problem}")
                try:
                    built[signal] = make_transport(settings, self.ctx.version)
                except Exception as exc:
                    named = ", ".join(f"{key} {path}" for key, path in files)
                    raise RuntimeError(f"otel {signal} export to {redact_url(settings.endpoint)}: cannot set up the "
                                       f"transport{f' ({named})' if named else ''}: {exc}") from exc
        except BaseException:
            for transport in built.values():
                transport.close()
            raise
        return built

    def _send(self, signal: str, transport: Any, request: Any, timeout: float | None) -> tuple[Any, SendResult]:
        """Send through ``transport`` (built anew when a previous fault discarded it); a fault in the
        transport itself is a failed, retryable attempt, never the end of the export thread."""
        try:
            if transport is None:
                transport = make_transport(self._settings[signal], self.ctx.version)
            return transport, send(transport, request, timeout)
        except Exception as exc:  # noqa: BLE001 - the thread must outlive it and retry with backoff
            if transport is not None:
                try:
                    transport.close()
                except Exception:  # noqa: BLE001 - closing a broken transport
                    pass
            return None, SendResult(False, True, f"transport: {type(exc).__name__}: {exc}")

    @functools.cached_property
    def _overrides(self) -> dict[str, Any] | None:
        """None: no Azure detection (``azure_detect`` off, or ``imds_url`` set empty); else the deprecated
        IMDS keys set (the identity provider honours them). Worked out, and a set key warned about, when
        ``gpumon run`` first asks (not by ``gpumon check``)."""
        if not self.settings.azure_detect:
            return None
        return azure_host.imds_overrides(self.ctx, self.name, self.settings, OPTIONS, IMDS_ALIASES)

    def identity_overrides(self) -> dict[str, Any] | None:
        return self._overrides

    def _take_identity(self, snapshot: Snapshot) -> None:
        """Once, from the first snapshot whose identity the provider has looked up (called with the
        lock held): the resource identifies the exporter, it does not follow it around."""
        identity = snapshot.identity
        if self._overrides is None or self._resource_ready.is_set() or identity is None or not identity.asked:
            return
        detected = azure_attributes(identity.instance, identity.physical_host)
        if detected:
            self._resource = resource_attributes(self.ctx, self.settings.resource_attributes, self._environ,
                                                 detected)
        if identity.instance is not None:
            log.info("otel: on Azure (%s, %s)", detected.get("host.type", "?"), detected.get("cloud.region", "?"))
        self._resource_ready.set()

    def _detect_wait(self) -> float:
        """How long the first export waits for the Azure attributes: one IMDS request and a little."""
        if self._overrides is None:
            return 0.0
        return azure_settings(self.ctx.config, self._overrides).imds_timeout + 0.5

    def publish(self, snapshot: Snapshot) -> None:
        """Keep the snapshot and queue its events; the export threads do the rest."""
        with self._lock:
            self._take_identity(snapshot)
            self._latest = snapshot
            if snapshot.events and "logs" in self._settings:
                limit = self.settings.max_queued_records
                for event in snapshot.events:
                    if len(self._events) >= limit:
                        seq, _ = self._events.popleft()
                        if seq > self._in_flight:  # one being sent is counted by its send's outcome
                            self._logs.dropped += 1
                    self._event_seq += 1
                    self._events.append((self._event_seq, event))
                self._wake_logs.notify()
            self._wake_metrics.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is pending once (within ``timeout``) and let the threads go."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopping = True
            self._stop_deadline = deadline
            self._wake_metrics.notify_all()
            self._wake_logs.notify_all()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("otel: export still in progress at shutdown (%s); abandoning it", ", ".join(alive))

    # -- export loops

    def _final_timeout(self, configured: float) -> float:
        return max(0.05, min(configured, getattr(self, "_stop_deadline", 0) - time.monotonic()))

    def _metrics_loop(self) -> None:
        settings = self._settings["metrics"]
        transport = self._transports.get("metrics")
        encoder = MetricEncoder(self.ctx.version)
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        interval = self.settings.interval
        self._resource_ready.wait(self._detect_wait())
        exported: Snapshot | None = None
        pending: tuple[Snapshot, int] | None = None  # a snapshot that failed and awaits its retry
        next_tick = time.monotonic() + interval

        def is_fresh(snapshot: Snapshot | None) -> bool:
            if snapshot is None:
                return False
            return snapshot is not exported if interval else has_new_results(snapshot, exported)

        try:
            while True:
                with self._lock:
                    while True:
                        now = time.monotonic()
                        due = max(backoff.not_before, next_tick if interval else 0.0)
                        fresh = is_fresh(self._latest)
                        if self._stopping or (fresh and now >= due):
                            break
                        self._wake_metrics.wait(max(0.01, due - now) if fresh else None)
                    stopping, snapshot, resource = self._stopping, self._latest, dict(self._resource)
                if snapshot is None or not is_fresh(snapshot):
                    if stopping:
                        return
                    continue
                if interval:
                    next_tick = max(next_tick + interval, time.monotonic())
                if pending is not None and pending[0] is not snapshot:
                    with self._lock:  # superseded by a newer snapshot: its points are given up
                        self._metrics.dropped += pending[1]
                pending = None
                try:
                    request, points = encoder.encode(snapshot, resource)
                except Exception as exc:  # noqa: BLE001 - a bad value must not kill the export thread
                    self._log_once.warning("encode", "otel: could not encode a snapshot: %s", exc)
                    exported = snapshot
                    continue
                timeout = self._final_timeout(settings.timeout) if stopping else None
                transport, result = self._send("metrics", transport, request, timeout)
                exported = snapshot
                self._account(self._metrics, result, points, backoff, "metrics", settings)
                if not result.ok and result.retryable and not stopping:
                    exported = None  # the retry sends whatever is latest by then
                    pending = (snapshot, points)
                elif not result.ok:
                    with self._lock:
                        self._metrics.dropped += points
                if stopping:
                    return
        finally:
            if transport is not None:
                transport.close()

    def _logs_loop(self) -> None:
        settings = self._settings["logs"]
        transport = self._transports.get("logs")
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        throttled = 0  # attempts of the head batch answered RESOURCE_EXHAUSTED without RetryInfo
        self._resource_ready.wait(self._detect_wait())
        try:
            while True:
                with self._lock:
                    while True:
                        now = time.monotonic()
                        if self._stopping or (self._events and now >= backoff.not_before):
                            break
                        self._wake_logs.wait(max(0.01, backoff.not_before - now) if self._events else None)
                    stopping = self._stopping
                    batch = [self._events[i] for i in range(min(512, len(self._events)))]
                    self._in_flight = batch[-1][0] if batch else 0
                    resource = dict(self._resource)
                if not batch:
                    return  # stopping and nothing left
                timeout = self._final_timeout(settings.timeout) if stopping else None
                try:
                    request = encode_logs([event for _, event in batch], resource, self.ctx.version)
                except Exception as exc:  # noqa: BLE001 - an attribute that will not encode
                    self._log_once.warning("encode-logs", "otel: could not encode events: %s", exc)
                    result = SendResult(False, False, f"encode: {exc}")
                else:
                    transport, result = self._send("logs", transport, request, timeout)
                keep = not result.ok and (result.retryable
                                          or (result.throttled and throttled + 1 < THROTTLED_LOG_ATTEMPTS))
                throttled = throttled + 1 if keep and not result.retryable else 0
                with self._lock:
                    self._in_flight = 0
                    # publish() may have evicted part of the batch meanwhile: what is left of it is the
                    # head of the queue up to the batch's last sequence number, not len(batch) entries
                    last = batch[-1][0]
                    left = 0
                    while left < len(self._events) and self._events[left][0] <= last:
                        left += 1
                    if keep:
                        self._logs.dropped += len(batch) - left  # evicted while in flight: not retried
                    else:
                        for _ in range(left):
                            self._events.popleft()
                        if not result.ok:
                            self._logs.dropped += len(batch)
                    if stopping and not result.ok:  # one attempt at shutdown: give the rest up
                        self._logs.dropped += len(self._events)
                        self._events.clear()
                    done = stopping and not self._events
                    self._account_locked(self._logs, result, len(batch), backoff, "logs", settings)
                if done:
                    return
        finally:
            if transport is not None:
                transport.close()

    def _account(self, counters: DeliveryCounters, result: SendResult, items: int, backoff: Backoff,
                 signal: str, settings: SignalSettings) -> None:
        """Count an export's outcome, schedule a retry, and log state changes once (not every cycle)."""
        with self._lock:
            self._account_locked(counters, result, items, backoff, signal, settings)

    def _account_locked(self, counters: DeliveryCounters, result: SendResult, items: int, backoff: Backoff,
                        signal: str, settings: SignalSettings) -> None:
        """``_account`` for a caller that holds the lock, so that its own bookkeeping and these counters
        change together."""
        if result.ok:
            if counters.consecutive_failures:
                log.info("otel: %s export to %s recovered", signal, redact_url(settings.endpoint))
            self._log_once.clear(f"failed-{signal}")
            counters.succeeded(items - result.rejected)
            counters.dropped += result.rejected
            backoff.succeeded()
            if result.rejected:
                self._log_once.warning(f"rejected-{signal}", "otel: the collector rejected %d %s items",
                                       result.rejected, signal)
            return
        counters.failed_attempt(1, result.detail)  # gpumon_sink_failed_total counts requests
        delay = backoff.failed(time.monotonic(), result.retry_after,
                               self.config_backoff_min if result.config else None)
        self._log_once.warning(f"failed-{signal}", "otel: %s export to %s failed (%s); retrying with backoff, "
                               "next in %.2f s", signal, redact_url(settings.endpoint), result.detail, delay)

    # -- reporting

    def health(self) -> SinkHealth:
        with self._lock:
            m, lg = self._metrics, self._logs
            # metrics: up only after a first accepted export; logs are sent only when events happen,
            # so they only hold the sink down while their latest attempt failed
            up = self._started and m.up and not lg.consecutive_failures
            detail = m.last_error or lg.last_error
            return SinkHealth(
                up=up,
                exported=m.sent + lg.sent,
                failed=m.failed + lg.failed,
                dropped=m.dropped + lg.dropped,
                detail=detail,
                extra={
                    "queued_records": float(len(self._events)),
                    "consecutive_failures": float(max(m.consecutive_failures, lg.consecutive_failures)),
                    "exported_data_points": float(m.sent),
                    "exported_log_records": float(lg.sent),
                },
            )

    def check(self) -> list[CheckResult]:
        """Send an empty export request per signal: proves address, TLS, headers and protocol."""
        try:
            settings = self._resolve()
        except ValueError as exc:
            return [CheckResult("otel", False, str(exc))]
        if self.missing_dependencies():
            return [CheckResult("otel", False, f"needs: pip install 'gpumon-exporter[{self.extra}]'")]
        pb = pb_modules()
        results = []
        for signal, s in settings.items():
            item = f"otel {signal}"
            try:
                transport = make_transport(s, self.ctx.version)
            except Exception as exc:  # noqa: BLE001 - bad certificate path, grpc missing
                results.append(CheckResult(item, False, f"{redact_url(s.endpoint)}: {exc}"))
                continue
            empty = (pb.metrics_service.ExportMetricsServiceRequest() if signal == "metrics"
                     else pb.logs_service.ExportLogsServiceRequest())
            started = time.monotonic()
            try:
                result = send(transport, empty, min(s.timeout, 5.0))
            finally:
                transport.close()
            took = (time.monotonic() - started) * 1000
            if result.ok:
                results.append(CheckResult(item, True, f"{s.protocol} {redact_url(s.endpoint)} accepted an empty "
                                                       f"export in {took:.0f} ms"))
            else:
                results.append(CheckResult(item, False, f"{s.protocol} {redact_url(s.endpoint)}: {result.detail}"))
        return results

"""The OtelSink: ``publish`` puts the latest snapshot in a slot and queues its events; one shared
:class:`~gpumon.sinks.delivery.Uploader` exports metrics and one exports logs (the senders of
:mod:`.export`), each with its own backoff, so a slow metrics export never delays an XID's log
record."""

from __future__ import annotations

import functools
import logging
import os
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
from gpumon.sinks.common import DeliveryCounters, has_new_results, redact_url
from gpumon.sinks.delivery import BatchSize, Uploader
from gpumon.sinks.otel.encoding import pb_modules
from gpumon.sinks.otel.export import LOG_BATCH, Exporting, LogsSender, MetricsSender
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
from gpumon.sinks.otel.transport import make_transport, send
from gpumon.sinks.queues import BoundedQueue, LatestSlot

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
        interval = self.settings.interval
        self._slot: LatestSlot[Snapshot] = LatestSlot(
            lambda new, sent: new is not sent if interval else has_new_results(new, sent), interval)
        self._events: BoundedQueue[Event] = BoundedQueue(self.settings.max_queued_records)
        self._metrics = DeliveryCounters()
        self._logs = DeliveryCounters()
        self._exporting = Exporting(ctx.version, {}, 0.0)
        self._uploaders: list[Uploader[Any]] = []
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
            self._exporting.set_resource(resource_attributes(self.ctx, self.settings.resource_attributes,
                                                             self._environ))
        except BaseException:
            for transport in self._transports.values():
                transport.close()
            raise
        if self._overrides is None:
            self._ready()
        else:  # the first export waits for the Azure attributes the loop's snapshots bring
            self._exporting.ready_wait = azure_settings(self.ctx.config, self._overrides).imds_timeout + 0.5
        self._uploaders = [self._uploader(MetricsSender(self._exporting, self._settings["metrics"],
                                                        self._transports.get("metrics"), self._metrics,
                                                        self._log_once), self._slot, 1)]
        if "logs" in self._settings:
            self._uploaders.append(self._uploader(LogsSender(self._exporting, self._settings["logs"],
                                                             self._transports.get("logs"), self._logs,
                                                             self._log_once, self._events),
                                                  self._events, LOG_BATCH))
        self._started = True
        for uploader in self._uploaders:
            uploader.start()
        where = ", ".join(f"{s.signal} -> {redact_url(s.endpoint)}" for s in self._settings.values())
        log.info("otel: exporting over %s (%s)", self._settings["metrics"].protocol, where)

    def _uploader(self, sender: MetricsSender | LogsSender, queue: Any, records: int) -> Uploader[Any]:
        """One signal's uploader: the sink's backoff policy, and at stop one last try of what is pending."""
        return Uploader(f"otel-{sender.signal}", queue, sender,
                        Backoff(self.settings.backoff_initial, self.settings.backoff_max),
                        size=BatchSize(records=records), config_floor=self.config_backoff_min,
                        retrying=sender.retrying, last_try=True, on_exit=sender.close)

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
        """Once, from the first snapshot whose identity the provider has looked up: the resource
        identifies the exporter, it does not follow it around."""
        identity = snapshot.identity
        if self._overrides is None or self._exporting.ready.is_set() or identity is None or not identity.asked:
            return
        detected = azure_attributes(identity.instance, identity.physical_host)
        if detected:
            self._exporting.set_resource(resource_attributes(self.ctx, self.settings.resource_attributes,
                                                             self._environ, detected))
        if identity.instance is not None:
            log.info("otel: on Azure (%s, %s)", detected.get("host.type", "?"), detected.get("cloud.region", "?"))
        self._ready()

    def _ready(self) -> None:
        """The resource is final: exports may begin, the first one an ``interval`` from now."""
        self._slot.start_ticks()
        self._exporting.ready.set()

    def publish(self, snapshot: Snapshot) -> None:
        """Keep the snapshot and queue its events; the uploaders do the rest."""
        self._take_identity(snapshot)
        self._slot.put(snapshot)
        if snapshot.events and "logs" in self._settings:
            self._logs.dropped_items(self._events.put(snapshot.events))
        for uploader in self._uploaders:
            uploader.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is pending once (within ``timeout``) and let the uploaders go; events that could
        not be sent then are counted dropped."""
        deadline = time.monotonic() + timeout
        self._exporting.stop_deadline = deadline
        self._slot.last_try()
        for uploader in self._uploaders:
            uploader.begin_stop()
        for uploader in self._uploaders:
            uploader.stop(deadline)
        alive = [u.name for u in self._uploaders if u.running]
        if alive:
            log.warning("otel: export still in progress at shutdown (%s); abandoning it", ", ".join(alive))
        elif self._started:
            self._logs.dropped_items(self._events.clear())

    # -- reporting

    def health(self) -> SinkHealth:
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
                "queued_records": float(self._events.pending()),
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

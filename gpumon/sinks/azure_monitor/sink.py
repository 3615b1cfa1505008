"""Azure Monitor Logs Ingestion: GPU and IB rows per interval and one row per event, through a spool.

``publish`` (the loop's thread) folds each snapshot into per-GPU and per-port statistics
(:mod:`gpumon.sinks.azure_monitor.rows`) and, at each ``upload_interval`` boundary and for every event at
once, appends rows to the on-disk spool (:mod:`gpumon.sinks.spool`) and wakes the shared uploader
(:class:`gpumon.sinks.delivery.Uploader`), whose thread hands what the spool holds to
:meth:`AzureMonitorSink.send`; that sends it with ``LogsIngestionClient`` and classifies the answer
(:mod:`.classify`), and the uploader acknowledges it only after the service said 204, so an outage or a
kill -9 re-sends rather than loses (each row carries a ``RowId`` to de-duplicate in KQL). Backoff
honours ``Retry-After``, and the first failure that is not about the rows (429, 5xx, timeout,
401/403/404) ends the batch: its later chunks wait for the retry. A 400/413 chunk is bisected until the
rejected rows are isolated and written to ``deadletter.jsonl`` (:mod:`.deadletter`),
unless the 400 is about the request itself (the stream, DCR or api-version named in the service's
error, or the first, a middle and the last rows refused alone with the code the whole request got):
that, like 401/403/404, is a configuration fault, retried slowly with the rows kept and a message
that says what to fix. An error in the uploader's own I/O (the spool) is counted and retried, never fatal.

The Azure SDK is imported only in ``start()`` and ``check()``: a host without the ``azure`` extra
never pays for it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from gpumon.backoff import Backoff
from gpumon.config import Config, ConfigError
from gpumon.log_once import LogOnce
from gpumon.model import Snapshot
from gpumon.sinks import azure_host
from gpumon.sinks.azure_identity import make_credential
from gpumon.sinks.azure_monitor.classify import (
    ROW_STATUS,
    Classifier,
    UploadResult,
    error_code,
    error_text,
    http_status,
    names_target,
    status_verdict,
)
from gpumon.sinks.azure_monitor.deadletter import write_dead_letter
from gpumon.sinks.azure_monitor.options import (
    IMDS_ALIASES,
    OPTIONS,
    AzureMonitorSettings,
    directory_problem,
    target_problem,
)
from gpumon.sinks.azure_monitor.rows import EVENTS, GPU, IB, METRICS, TABLES, RowBuilder, host_values
from gpumon.sinks.base import CheckResult, Sink, SinkContext, SinkHealth
from gpumon.sinks.common import DeliveryCounters
from gpumon.sinks.delivery import BatchSize, Outcome, Uploader
from gpumon.sinks.spool import Batch, Spool, SpoolError

log = logging.getLogger("gpumon.sinks.azure_monitor")

_BATCH = BatchSize(records=2000)
"""Rows read from the spool for one round (one ``upload`` per stream)."""
_UPLOADER_FAULT = "uploader error:"
_LONGEST_WAIT = 3600.0
"""The longest Retry-After honoured (the backoff itself stops at ``backoff_max``)."""
_REASONS_REMEMBERED = 256
"""Distinct reasons logged once before they are all forgotten (a server's error text is open-ended)."""


class _StopBatch(Exception):
    """Raised from ``on_error`` so the SDK sends no further chunk after a retryable failure."""


class AzureMonitorSink(Sink):
    name = "azure_monitor"
    description = "Rows to Azure Monitor Logs (Logs Ingestion API) through a durable spool."
    options = OPTIONS
    settings: AzureMonitorSettings
    requires = ("azure.monitor.ingestion", "azure.identity")
    extra = "azure"
    backoff_min = 1.0
    backoff_max = 300.0
    config_backoff_min = 30.0
    """Seconds between retries: doubling from ``backoff_min`` (``config_backoff_min`` after a 401/403/404
    or a token failure, which a person has to fix) up to ``backoff_max``, ±20 % jitter, unless
    Retry-After says (then exactly that, at most an hour). Read when the uploader starts."""

    def __init__(self, ctx: SinkContext, cfg: Any = None, *, credential: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ctx, cfg)
        self._credential = credential
        self._clock = clock
        self._client: Any = None
        self._spool: Spool | None = None
        self._builder = RowBuilder(ctx.hostname, self.settings.omit_zero_increases,
                                   self.settings.static_every, generic=bool(self.settings.stream_metrics))
        self._streams = {GPU: self.settings.stream_gpu, IB: self.settings.stream_infiniband,
                         EVENTS: self.settings.stream_events}
        if self.settings.stream_metrics:
            self._streams[METRICS] = self.settings.stream_metrics
        self._lock = threading.Lock()
        self._window_start: float | None = None
        self._stopping = threading.Event()
        """Set at stop."""
        self._uploader: Uploader | None = None
        self._counters = DeliveryCounters()
        """``last_error`` is the reason the sink is down (empty: up); ``dropped`` counts rows rejected
        for good and rows the spool could not take (the spool's own drops are added in health())."""
        self._log_once = LogOnce(log, limit=_REASONS_REMEMBERED)
        self._classifier = Classifier(self.settings, self._counters, self._log_once)
        self._delivered: set[str] = set()

    # -- set-up ---------------------------------------------------------------------------------

    @property
    def spool_dir(self) -> str:
        return self.settings.spool_dir or os.path.join(self.ctx.state_dir, "spool", "azure_monitor")

    @classmethod
    def validate(cls, config: Config) -> None:
        """Missing or malformed target settings and an unusable spool directory are config mistakes:
        exit 2 naming the key and the file (or variable) it came from, before anything starts."""
        opt = OPTIONS.settings_of(config.sections.get(cls.name))

        def where(key: str) -> str:
            return config.origins.get(f"{cls.name}.{key}", config.source)

        problem = target_problem(opt)
        if problem is not None:
            raise ConfigError(where(problem[0]), f"[{cls.name}] {problem[0]}", problem[1])
        spool_dir = opt.spool_dir or os.path.join(config.daemon.state_dir, "spool", cls.name)
        reason = directory_problem(spool_dir)
        if reason is not None:
            source = where("spool_dir") if opt.spool_dir else config.origins.get("daemon.state_dir",
                                                                                     config.source)
            suffix = "" if opt.spool_dir else " (the default, under [daemon] state_dir)"
            raise ConfigError(source, f"[{cls.name}] spool_dir", f"{spool_dir}: {reason}{suffix}")

    def _require_target(self) -> None:
        problem = target_problem(self.settings)
        if problem is not None:
            raise ConfigError("[azure_monitor]", problem[0], problem[1])

    def make_credential(self) -> Any:
        """The azure-identity credential named in config (or the one given to the constructor)."""
        if self._credential is not None:
            return self._credential
        return make_credential(self.settings, "[azure_monitor]")

    def _make_client(self, credential: Any) -> Any:
        from azure.core.pipeline.policies import HttpLoggingPolicy
        from azure.monitor.ingestion import LogsIngestionClient

        # The SDK logs every request at INFO; keep that under our own logger, quiet unless asked.
        http_log = logging.getLogger("gpumon.sinks.azure_monitor.http")
        if http_log.level == logging.NOTSET:
            http_log.setLevel(logging.WARNING)
        return LogsIngestionClient(
            self.settings.endpoint, credential,
            http_logging_policy=HttpLoggingPolicy(logger=http_log),
            credential_scopes=[self.settings.audience.rstrip("/") + "/.default"],
            retry_total=0,  # the uploader thread owns retries, so stop() is never stuck in a sleep
            connection_verify=self.settings.ca_file or True,
            connection_timeout=self.settings.timeout,
            read_timeout=self.settings.timeout,
        )

    def start(self) -> None:
        self.ensure_dependencies()
        self._require_target()
        try:
            self._spool = Spool(self.spool_dir, self.settings.spool_max_bytes)
        except SpoolError as exc:
            raise ConfigError("[azure_monitor]", "spool_dir", str(exc)) from None
        self._client = self._make_client(self.make_credential())
        backoff = Backoff(self.backoff_min, self.backoff_max, jitter=(0.8, 1.2), retry_after_max=_LONGEST_WAIT,
                          retry_after_exact=True)
        self._uploader = Uploader("azure-monitor-upload", self._spool, self, backoff, size=_BATCH,
                                  config_floor=self.config_backoff_min, clock=self._clock, idle_resets=True,
                                  after_round=self._spool_works)
        self._uploader.start()
        stats = self._spool.stats()
        log.info("azure_monitor: sending to %s (DCR %s), %d rows spooled from before",
                 self.settings.endpoint, self.settings.dcr_immutable_id, stats.records)

    @functools.cached_property
    def _overrides(self) -> dict[str, Any] | None:
        """None: ``imds_url`` set empty, the rows carry no host columns; else the deprecated keys set
        (worked out, and a set key warned about, when ``gpumon run`` first asks, not by ``gpumon check``)."""
        return azure_host.imds_overrides(self.ctx, self.name, self.settings, OPTIONS, IMDS_ALIASES)

    def identity_overrides(self) -> dict[str, Any] | None:
        """The rows' host columns come from ``Snapshot.identity`` unless ``imds_url`` is set empty."""
        return self._overrides

    def _take_identity(self, snapshot: Snapshot) -> None:
        """The rows' host columns from the identity the loop stamped (the provider looks again every
        ``gpumon.identity.REFRESH`` seconds); kept as they are while it has not looked yet."""
        identity = snapshot.identity
        if identity is not None and identity.asked and self._overrides is not None:
            self._builder.vm = host_values(identity.instance, identity.physical_host)

    # -- the loop's side ------------------------------------------------------------------------

    def publish(self, snapshot: Snapshot) -> None:
        """Fold in the snapshot; spool event rows now and interval rows at a boundary. Never raises."""
        try:
            with self._lock:
                now = self._clock()
                if self._window_start is None:
                    self._window_start = now
                self._take_identity(snapshot)
                self._builder.add(snapshot, now)
                records = [self._record(EVENTS, self._builder.event_row(e)) for e in snapshot.events]
                elapsed = now - self._window_start
                if elapsed >= self.settings.upload_interval:
                    records += self._interval_records(snapshot.time, elapsed)
                    self._window_start = now
            if records:
                self._append(records)
        except Exception as exc:  # a sink must never take the loop down
            self._log_once.error(("publish", type(exc).__name__),
                                 "azure_monitor: publish failed (logged once per kind): %s", exc, exc_info=True)

    def _interval_records(self, wall_time: float, seconds: float) -> list[bytes]:
        rows = self._builder.close_interval(wall_time, seconds)
        return [self._record(key, row) for key in (GPU, IB, METRICS) for row in rows[key]]

    @staticmethod
    def _record(key: str, row: dict[str, Any]) -> bytes:
        return json.dumps({"s": key, "r": row}, separators=(",", ":")).encode()

    def _append(self, records: list[bytes]) -> None:
        if self._spool is None:
            return
        try:
            self._spool.append(records)
        except OSError as exc:
            self._counters.dropped_items(len(records))
            self._log_once.error("append", "azure_monitor: cannot write the spool %s: %s (rows dropped and "
                                 "counted)", self.spool_dir, exc)
            return
        if self._uploader is not None:
            self._uploader.notify()

    # -- the uploader's side: send and classify ----------------------------------------------------

    def send(self, batch: Batch) -> Outcome:
        """Upload one batch of spooled rows (the uploader's thread); the uploader acknowledges it when
        every row went or was dead-lettered. Backoff: doubling from ``backoff_min`` (from
        ``config_backoff_min`` for a configuration fault), Retry-After as the delay."""
        outcome = self._deliver(batch.records)
        if outcome.ok:
            self._delivered.clear()
            return Outcome(ack=True, delivered=True)
        return Outcome(ack=False, retry=True, retry_after=outcome.delay, config=outcome.config_fault)

    def fault(self, exc: Exception) -> Outcome:
        """Count a round that raised (spool I/O such as EIO or ENOSPC, or a bug); log each kind once
        (with the traceback when it is not disk I/O). The uploader retries it with backoff."""
        self._counters.failed_attempt(1)
        where = f"spool {self.spool_dir}" if isinstance(exc, OSError) else type(exc).__name__
        reason = f"{_UPLOADER_FAULT} {where}: {exc}; retrying"
        if not isinstance(exc, OSError):
            self._log_once.error(reason, "azure_monitor: %s", reason, exc_info=exc)
        self._classifier.note(reason, logging.ERROR)  # (not logged again when logged with its traceback above)
        return Outcome(ack=False, retry=True)

    def _spool_works(self) -> None:
        """After a round that did not raise: an uploader fault is no longer the reason the sink is down."""
        if self._counters.last_error.startswith(_UPLOADER_FAULT):
            self._counters.last_error = ""

    def _deliver(self, records: tuple[bytes, ...]) -> UploadResult:
        by_stream: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            try:
                doc = json.loads(record)
                by_stream.setdefault(doc["s"], []).append(doc["r"])
            except (ValueError, KeyError, TypeError) as exc:
                key = "raw:" + hashlib.sha1(record).hexdigest()
                if key not in self._delivered:
                    self._delivered.add(key)
                    self._dead_letter("?", {"record": record.decode("utf-8", "replace")}, f"unreadable: {exc}")
        for key, rows in by_stream.items():
            stream = self._streams.get(key)
            todo = [r for r in rows if r.get("RowId") not in self._delivered]
            if stream is None and key == METRICS:  # generic rows turned off: spooled ones go quietly
                self._delivered.update(r["RowId"] for r in todo if r.get("RowId") is not None)
                self._counters.dropped_items(len(todo))
                continue
            if stream is None:
                for row in todo:
                    self._dead_letter(key, row, "no stream configured for this table")
                continue
            if not todo:
                continue
            outcome = self._upload(stream, todo)
            if not outcome.ok:
                if key == METRICS and outcome.stream_missing:
                    self._generic_rows_off(stream, todo)
                    continue  # the other tables' rows still go: a DCR older than this gpumon blocks nothing
                return outcome
        return UploadResult(True)

    def _generic_rows_off(self, stream: str, rows: list[dict[str, Any]]) -> None:
        """The DCR has no stream for the generic metric rows (deployed before it existed): stop making
        them, drop these (counted as rejected) and say how to get them, once."""
        self._streams.pop(METRICS, None)
        self._builder.generic = False
        for row in rows:
            if row.get("RowId") is not None:
                self._delivered.add(row["RowId"])
        self._counters.dropped_items(len(rows))
        log.error("azure_monitor: the DCR %s has no stream %s for generic metric rows (a template deployed "
                  "before this gpumon); they are off until restart, the other tables are sent: redeploy "
                  "deploy/azure/azuredeploy.json to get them, or set [azure_monitor] stream_metrics = \"\" "
                  "to silence this", self.settings.dcr_immutable_id, stream)

    def _upload(self, stream: str, rows: list[dict[str, Any]], probe: bool = True) -> UploadResult:
        """Send rows; isolate rejected rows by bisection. Not ok = retry the whole batch later."""
        from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

        failures = self._send(stream, rows)
        refused = []
        worst: UploadResult | None = None
        for error, chunk in failures:
            self._counters.failed_attempt(1)
            status = http_status(error)
            if isinstance(error, HttpResponseError) and status in ROW_STATUS:
                refused.append((error, status, chunk))
            elif worst is None:
                worst = self._classifier.classify(error, status, stream, ClientAuthenticationError)
        if worst is not None:  # the batch is retried anyway: isolating rows now would only add requests
            return worst
        for error, status, chunk in refused:
            outcome = self._refused(stream, chunk, error, status, probe)
            if not outcome.ok:
                return outcome
        return UploadResult(True)

    def _send(self, stream: str, rows: list[dict[str, Any]]) -> list[tuple[BaseException, list[dict[str, Any]]]]:
        """One ``upload``: mark what went through delivered; return (error, rows) per failed chunk.

        After a failure that is not about rows (429, 5xx, no connection, 401/403/404) no further chunk
        is sent: a throttled DCR is not sent more, and Retry-After holds for the whole batch. The
        failure then carries every row from its chunk on, none of which went out."""
        failures: list[tuple[BaseException, list[dict[str, Any]]]] = []

        def on_error(err: Any) -> None:
            failures.append((err.error, list(err.failed_logs)))
            if http_status(err.error) not in ROW_STATUS:
                raise _StopBatch

        try:
            self._client.upload(self.settings.dcr_immutable_id, stream, rows, on_error=on_error)
        except _StopBatch:
            error, chunk = failures[-1]
            # The SDK hands back the very row objects; failing that, count all as unsent (re-sent).
            first = next((i for i, r in enumerate(rows) if chunk and r is chunk[0]), 0)
            failures[-1] = (error, rows[first:])
        except Exception as exc:  # on_error catches per chunk; this is a failure before any chunk
            failures.append((exc, rows))
        failed_ids = {r.get("RowId") for _, chunk in failures for r in chunk}
        sent = [r for r in rows if r.get("RowId") not in failed_ids]
        if sent:
            # as _dead_letter: a row without a RowId (None) must not mark every other such row delivered
            self._delivered.update(r["RowId"] for r in sent if r.get("RowId") is not None)
            self._counters.succeeded(len(sent))
        return failures

    def _refused(self, stream: str, chunk: list[dict[str, Any]], error: BaseException, status: int | None,
                 probe: bool) -> UploadResult:
        """A 400/413 chunk: a request-level 400 keeps every row; otherwise bisect down to the bad rows."""
        if status == 400 and names_target(error):
            return self._classifier.request_fault(stream, error)
        if len(chunk) == 1:
            self._dead_letter(stream, chunk[0], f"HTTP {status}: {error_text(error)}")
            return UploadResult(True)
        if status == 400 and probe:
            verdict = self._probe(stream, chunk, error)
            if verdict is not None:
                return verdict
        todo = [r for r in chunk if r.get("RowId") not in self._delivered]
        half = len(todo) // 2
        for part in (todo[:half], todo[half:]):
            if part:
                outcome = self._upload(stream, part, probe=False)
                if not outcome.ok:
                    return outcome
        return UploadResult(True)

    def _probe(self, stream: str, chunk: list[dict[str, Any]], error: BaseException) -> UploadResult | None:
        """Send the first, a middle and the last row alone. All three refused with the code the whole
        request got means the request is at fault (stream, DCR, schema), not its rows; None means:
        isolate the bad rows. Fewer than three rows are always isolated: two bad rows around good ones
        must not hold the good ones back."""
        from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

        if len(chunk) < 3 and not names_target(error):
            return None
        code = error_code(error)
        for row in (chunk[0], chunk[len(chunk) // 2], chunk[-1]):
            failures = self._send(stream, [row])
            if not failures:
                return None
            err = failures[0][0]
            self._counters.failed_attempt(1)
            status = http_status(err)
            if not isinstance(err, HttpResponseError) or status not in ROW_STATUS:
                return self._classifier.classify(err, status, stream, ClientAuthenticationError)
            if status == 400 and names_target(err):
                return self._classifier.request_fault(stream, err)
            if status != 400 or error_code(err) != code:
                return None
        return self._classifier.request_fault(stream, error, every_row=True)

    def _dead_letter(self, stream: str, row: dict[str, Any], reason: str) -> None:
        """Write a rejected row aside; its RowId counts as delivered so a retried batch skips it."""
        self._counters.dropped_items(1)
        if row.get("RowId") is not None:
            self._delivered.add(row["RowId"])
        write_dead_letter(self.spool_dir, stream, row, reason)

    # -- shutdown and health --------------------------------------------------------------------

    def stop(self, timeout: float = 5.0) -> None:
        """Spool the partial interval, give the uploader until ``timeout`` to drain, then leave.

        Whatever is not delivered by then stays in the spool for the next start.
        """
        deadline = self._clock() + timeout
        with self._lock:
            records: list[bytes] = []
            if self._window_start is not None:
                elapsed = self._clock() - self._window_start
                records = self._interval_records(time.time(), elapsed)
                self._window_start = None
        if records:
            self._append(records)
        if self._uploader is not None:
            self._uploader.stop(deadline)
        elif self._spool is not None:
            self._spool.close()
        self._stopping.set()

    def health(self) -> SinkHealth:
        stats = self._spool.stats() if self._spool is not None else None
        c = self._counters
        extra = {
            "spool_bytes": float(stats.bytes if stats else 0),
            "rows_queued": float(stats.records if stats else 0),
            "last_success_timestamp_seconds": c.last_success_time,
            "unmapped_metrics": float(self._builder.unmapped_count),
        }
        dropped = (stats.dropped if stats else 0) + c.dropped
        spool_error = stats.error if stats else ""
        up = self._uploader is not None and self._uploader.running and not c.last_error and not spool_error
        return SinkHealth(up=up, exported=c.sent, failed=c.failed, dropped=dropped,
                          detail=spool_error or c.last_error, extra=extra)

    # -- gpumon check ---------------------------------------------------------------------------

    def check(self) -> list[CheckResult]:
        """Token, then an empty upload to each stream: one verdict per failure, nothing sent."""
        item = self.name
        try:
            self.ensure_dependencies()
            self._require_target()
        except Exception as exc:
            return [CheckResult(item, False, str(exc))]
        from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

        try:
            credential = self.make_credential()
        except ConfigError as exc:
            return [CheckResult(item, False, str(exc))]
        audience = self.settings.audience.rstrip("/")
        try:
            credential.get_token(audience + "/.default")
        except ClientAuthenticationError as exc:
            return [CheckResult(f"{item} token", False,
                                f"no token from {self._classifier.identity_hint()}: {error_text(exc)}. "
                                "Is an identity assigned to this VM / is the pod's service account federated?")]
        except Exception as exc:
            return [CheckResult(f"{item} token", False, f"token request failed: {type(exc).__name__}: {exc}")]
        results = [CheckResult(f"{item} token", True, f"token for {audience} from {self._classifier.identity_hint()}")]
        client = self._make_client(credential)
        dcr = self.settings.dcr_immutable_id
        for key in (GPU, IB, EVENTS):
            stream = self._streams[key]
            label = f"{item} {TABLES[key]}"
            try:
                client.upload(dcr, stream, io.BytesIO(b"[]"))
                results.append(CheckResult(label, True, f"stream {stream} on DCR {dcr} accepts uploads"))
            except HttpResponseError as exc:
                if exc.status_code == 400 and not names_target(exc):
                    # Authorised and routed; what the service makes of an empty body is not documented,
                    # so only a 400 that names the stream, DCR or api-version fails the check.
                    results.append(CheckResult(label, True, f"stream {stream} on DCR {dcr} reachable and "
                                               f"authorised (the empty probe was refused: {error_text(exc)})"))
                    continue
                results.append(CheckResult(label, False, status_verdict(
                    exc.status_code, dcr, stream, self._classifier.identity_hint(), error_text(exc), audience)))
            except Exception as exc:
                results.append(CheckResult(label, False, f"{self.settings.endpoint} unreachable: "
                                           f"{type(exc).__name__}: {error_text(exc)}"))
        try:
            client.close()
        except Exception:
            pass
        return results


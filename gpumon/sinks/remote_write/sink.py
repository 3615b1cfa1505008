"""The ``remote_write`` sink: every snapshot's samples to a Prometheus remote-write 1.0 receiver.

``publish`` (the loop's thread) encodes the snapshot into one snappy-compressed WriteRequest
(:mod:`.encoding`, about a millisecond for an ND H100 v5 host) and appends it to an on-disk spool
(:mod:`gpumon.sinks.spool`); the shared uploader (:class:`gpumon.sinks.delivery.Uploader`) hands the
spool's records to :meth:`RemoteWriteSink.send` one at a time, in order, and acknowledges each only
once the receiver took it, so an outage or a restart re-sends rather than loses, within the spool's
bound. This module encodes, sends and classifies; faults, each counted and logged once per kind:

- no connection, a timeout (whole-request deadline), 5xx, 408, 429, a 1xx as the final answer: the
  record stays, retried with backoff and jitter, Retry-After honoured;
- 413: the smallest body refused is remembered (:mod:`.limits`) and every request at least that
  large is split in halves before it is sent; the first 413 after a success splits at once, each
  further one backs off first, so a receiver that answers 413 to everything gets a bounded rate of
  requests. A single series larger than a refused body is dropped and counted. When some parts went
  and another did not, the parts that did not go are spooled as new records and the original
  acknowledged, so nothing is sent twice;
- 401, 403, 404, 407, token failures, an invalid header and a redirect not followed (only 307/308 to
  the same origin are) are configuration faults: the record stays and is retried slowly (a role
  assignment can take 30 minutes to reach an Azure Monitor workspace);
- any other 4xx (400 for out-of-order or duplicate samples): dropped and counted, never retried; the
  sink is down until a request goes through.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpumon import __version__
from gpumon.backoff import Backoff
from gpumon.config import ConfigError, Option, SectionSchema, readable_file_check
from gpumon.log_once import LogOnce
from gpumon.model import Snapshot
from gpumon.sinks.azure_identity import make_credential
from gpumon.sinks.base import CheckResult, Sink, SinkContext, SinkHealth
from gpumon.sinks.common import (
    DeliveryCounters,
    has_new_results,
    header_list_check,
    read_regular_file,
    redact_url,
)
from gpumon.sinks.delivery import BatchSize, Outcome, Uploader
from gpumon.sinks.options import azure_credential_options, backoff_options, spool_options, tls_options
from gpumon.sinks.remote_write import encoding
from gpumon.sinks.remote_write.limits import BodyLimit
from gpumon.sinks.remote_write.transport import (
    HeaderError,
    Response,
    Transport,
    basic_authorization,
    tls_context,
)
from gpumon.sinks.spool import Batch, Spool, SpoolError

log = logging.getLogger("gpumon.sinks.remote_write")

AUTH = ("none", "basic", "bearer", "azure")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RECORD_HEAD = struct.Struct(">I")
"""A spool record: the request's sample count, then its body exactly as it is POSTed."""
_RETRY_STATUS = {408, 429}
_CONFIG_STATUS = {401, 403, 404, 407}
_SECRET_MAX = 64 << 10
"""Bytes a password or token file may hold."""
_TOKEN_MARGIN = 300.0
"""Seconds before a token's expiry at which a new one is asked for."""


def _pairs_check(items: list[str]) -> str | None:
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _LABEL_NAME.match(name.strip()) or name.strip().startswith("__"):
            return f"entries must be NAME=VALUE with a Prometheus label name (got {item!r})"
    return None


def _pairs(items: Sequence[str]) -> dict[str, str]:
    return {name.strip(): value.strip() for name, _, value in (item.partition("=") for item in items)}


@dataclass(frozen=True)
class RemoteWriteSettings:
    url: str
    interval: float
    job: str
    instance: str
    external_labels: tuple[str, ...]
    headers: tuple[str, ...] = field(repr=False)  # a secret: never in a repr
    timeout: float
    auth: str
    username: str
    password: str = field(repr=False)  # a secret: never in a repr
    password_file: str
    bearer_token_file: str
    ca_file: str
    cert_file: str
    key_file: str
    credential: str
    client_id: str
    tenant_id: str
    client_secret: str = field(repr=False)  # a secret: never in a repr
    audience: str
    spool_dir: str
    spool_max_bytes: int
    backoff_initial: float
    backoff_max: float


OPTIONS = SectionSchema(
    "remote_write",
    "Prometheus remote write 1.0: every sample of the page to Prometheus, Mimir, Thanos Receive, "
    "VictoriaMetrics, Grafana Cloud or an Azure Monitor workspace, through a durable spool.",
    (
        Option("url", str, "", "Receiver URL, e.g. http://prometheus:9090/api/v1/write or an Azure Monitor "
               "workspace's metrics ingestion endpoint .../dataCollectionRules/<dcr-immutable-id>/streams/"
               "Microsoft-PrometheusMetrics/api/v1/write?api-version=2023-04-24."),
        Option("interval", float, 0.0, "Seconds between the snapshots sent; 0 sends every new snapshot, so "
               "sending follows the collection interval.", min=0.0, max=3600.0),
        Option("job", str, "gpumon", "The `job` label every series gets (a scrape would add it)."),
        Option("instance", str, "", "The `instance` label every series gets; empty means the host name."),
        Option("external_labels", list, [], "More labels for every series as NAME=VALUE (cluster=..., "
               "region=...); a series' own label of the same name wins.", check=_pairs_check),
        Option("headers", list, [], "Extra request headers as NAME=VALUE (X-Scope-OrgID=tenant for Mimir). "
               "Values are never logged or printed.", check=header_list_check, secret=True),
        Option("timeout", float, 10.0, "Seconds one request may take in all: connect, send and answer.",
               min=0.1, max=600.0),
        Option("auth", str, "none", "`none`, `basic` (username, password or password_file), `bearer` "
               "(bearer_token_file) or `azure` (Entra ID token for an Azure Monitor workspace).", choices=AUTH),
        Option("username", str, "", "Basic auth user."),
        Option("password", str, "", "Basic auth password; prefer password_file or "
               "GPUMON_REMOTE_WRITE_PASSWORD. Never logged or printed.", secret=True),
        Option("password_file", str, "", "File holding the basic auth password (re-read on every request).",
               check=readable_file_check),
        Option("bearer_token_file", str, "", "File holding a bearer token (re-read on every request, so a "
               "rotated token is picked up).", check=readable_file_check),
        *tls_options("receiver"),
        *azure_credential_options("remote_write", "With auth = azure: "),
        *spool_options("remote_write", "requests"),
        *backoff_options(),
    ),
    RemoteWriteSettings,
)


def _record_samples(record: bytes) -> int:
    """The samples a spool record holds (its head), so that a record the spool drops is counted exactly."""
    return _RECORD_HEAD.unpack_from(record)[0] if len(record) >= _RECORD_HEAD.size else 0


_DONE = Outcome(ack=True)
_SPLIT_NOW = Outcome(ack=False)
"""``_post``'s answer to a first 413 about size: split the part and send the halves now."""
_BATCH = BatchSize(records=1, bytes=64 << 10)
"""One record (one request) per round."""
_DRAIN_MARGIN = 0.5
"""Seconds of the stop deadline kept for aborting the request in flight and joining the uploader."""


class RemoteWriteSink(Sink):
    name = "remote_write"
    description = "Prometheus remote write 1.0 (Prometheus, Mimir, Thanos, VictoriaMetrics, Azure Monitor)."
    options = OPTIONS
    settings: RemoteWriteSettings
    requires = ("cramjam",)
    extra = "remote_write"
    config_backoff_min = 30.0
    """Seconds before retrying after a configuration fault (401/403/404, no token)."""

    def __init__(self, ctx: SinkContext, cfg: Any = None, *, credential: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ctx, cfg)
        self._credential = credential
        self._clock = clock
        labels = {"job": self.settings.job, "instance": self.settings.instance or ctx.hostname}
        labels.update(_pairs(self.settings.external_labels))
        self._encoder = encoding.Encoder(labels)
        self._spool: Spool | None = None
        self._transport: Transport | None = None
        self._token: Any = None
        self._last_sent: float | None = None
        self._last_snapshot: Snapshot | None = None
        self._counters = DeliveryCounters()
        self._limit = BodyLimit()
        self._refusals_413 = 0
        """413 answers since the latest success: the first splits at once, each further one backs off."""
        self._log_once = LogOnce(log)
        self._backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max)
        self._uploader: Uploader | None = None
        self._delivered = False
        """A request of the record in hand went through: the backoff starts over."""

    # -- set-up ---------------------------------------------------------------------------------

    @property
    def spool_dir(self) -> str:
        return self.settings.spool_dir or os.path.join(self.ctx.state_dir, "spool", "remote_write")

    def _require(self) -> None:
        opt = self.settings
        if not opt.url.startswith(("http://", "https://")):
            raise ConfigError("[remote_write]", "url", "must be an http:// or https:// URL")
        if opt.auth == "azure" and not opt.url.startswith("https://"):
            raise ConfigError("[remote_write]", "url", "must be https:// with auth = azure")
        needs = {"basic": ("username",), "bearer": ("bearer_token_file",)}.get(opt.auth, ())
        for key in needs:
            if not getattr(opt, key):
                raise ConfigError("[remote_write]", key, f"is required with auth = {opt.auth}")
        for key in ("ca_file", "cert_file", "key_file", "password_file", "bearer_token_file"):
            path = getattr(opt, key)
            if path and not os.path.isfile(path):
                raise ConfigError("[remote_write]", key, f"no such file: {path}")
        if opt.key_file and not opt.cert_file:
            raise ConfigError("[remote_write]", "cert_file", "is required with key_file")

    def _make_transport(self) -> Transport:
        opt = self.settings
        context = None
        if opt.url.startswith("https://"):
            try:
                context = tls_context(opt.ca_file, opt.cert_file, opt.key_file)
            except (OSError, ValueError) as exc:
                raise ConfigError("[remote_write]", "cert_file" if opt.cert_file else "ca_file",
                                  f"cannot load: {exc}") from None
        if opt.auth == "azure" and self._credential is None:
            self._credential = make_credential(opt, "[remote_write]")
        return Transport(opt.url, opt.timeout, f"gpumon/{__version__}", self._authorization,
                         _pairs(opt.headers), context)

    def _authorization(self) -> str | None:
        """The Authorization header for the next request; raises when none can be had."""
        opt = self.settings
        if opt.auth == "basic":
            password = opt.password
            if opt.password_file:  # non-blocking, regular files only: a FIFO must not hang the uploader
                password = _secret_file(opt.password_file)
            return basic_authorization(opt.username, password)
        if opt.auth == "bearer":
            return "Bearer " + _secret_file(opt.bearer_token_file)
        if opt.auth == "azure":
            if self._token is None or self._token.expires_on - time.time() < _TOKEN_MARGIN:
                self._token = self._credential.get_token(opt.audience.rstrip("/") + "/.default")
            return "Bearer " + self._token.token
        return None

    def start(self) -> None:
        self.ensure_dependencies()
        self._require()
        if self.settings.auth == "azure":
            import azure.identity  # noqa: F401 - fail start-up now, not on the first upload
        try:
            self._spool = Spool(self.spool_dir, self.settings.spool_max_bytes, weigh=_record_samples)
        except SpoolError as exc:
            raise ConfigError("[remote_write]", "spool_dir", str(exc)) from None
        self._transport = self._make_transport()
        self._uploader = Uploader("remote-write-upload", self._spool, self, self._backoff, size=_BATCH,
                                  config_floor=self.config_backoff_min, clock=self._clock,
                                  drain_margin=_DRAIN_MARGIN)
        self._uploader.start()
        log.info("remote_write: sending to %s, %d requests spooled from before",
                 redact_url(self.settings.url), self._spool.stats().records)

    # -- the loop's side ------------------------------------------------------------------------

    def publish(self, snapshot: Snapshot) -> None:
        """Encode and spool the snapshot: one with a new collector run, or with ``interval`` the newest
        at most once per interval. Never raises."""
        if self._spool is None or self._uploader is None:
            return
        now = self._clock()
        interval = self.settings.interval
        if interval and self._last_sent is not None and now - self._last_sent < interval - 1e-3:
            return
        if not interval and not has_new_results(snapshot, self._last_snapshot):
            return  # the loop's re-publication of the same data (sink health, deadlines)
        self._last_sent, self._last_snapshot = now, snapshot
        try:
            record = self._record(snapshot)
            self._spool.append([record])
        except OSError as exc:
            self._counters.dropped_items(self._encoded_samples, f"spool: {exc}")
            self._log_once.warning("spool", "remote_write: cannot write the spool %s: %s (samples dropped "
                                   "and counted)", self.spool_dir, exc)
            return
        except Exception as exc:  # a sink must never take the loop down
            self._log_once.warning(f"publish:{type(exc).__name__}", "remote_write: publish failed: %r", exc)
            return
        self._log_once.clear("spool")
        self._uploader.notify()

    def _record(self, snapshot: Snapshot) -> bytes:
        body, samples = self._encoder.encode(snapshot.families, int(round(snapshot.time * 1000)))
        self._encoded_samples = samples
        return _RECORD_HEAD.pack(samples) + encoding.compress(body)

    _encoded_samples = 0

    # -- the uploader's side: send and classify ----------------------------------------------------

    def send(self, batch: Batch) -> Outcome:
        """Deliver one spool record (the uploader's thread)."""
        self._delivered = False
        return replace(self._deliver(batch), delivered=self._delivered)

    def fault(self, exc: Exception) -> Outcome:
        """A round that raised (spool I/O or a bug): counted, logged once per kind, retried."""
        self._counters.failed_attempt(0, f"uploader: {exc}")
        self._log_once.warning(f"round:{type(exc).__name__}", "remote_write: uploader error: %r", exc)
        return Outcome(ack=False, retry=True)

    def _deliver(self, batch: Batch) -> Outcome:
        record = batch.records[0]
        if len(record) < _RECORD_HEAD.size:
            self._counters.dropped_items(0, "unreadable spool record")
            return _DONE
        (samples,) = _RECORD_HEAD.unpack_from(record)
        return self._send(record[_RECORD_HEAD.size:], samples)

    def _send(self, body: bytes, samples: int) -> Outcome:
        """Send one record, split first into parts under the smallest body the receiver refused."""
        parts, went = self._fit([(body, samples)])
        # ``went``: some part was delivered or given up on, so the original cannot be kept as it is
        while parts:
            part, count = parts[0]
            outcome = self._post(part, count)
            if outcome is _SPLIT_NOW:  # a 413 about size: the limit is lower now, split again
                parts, dropped = self._fit(parts)
                went = went or dropped
                continue
            if not outcome.ack:
                if not went:
                    return outcome  # nothing went: the whole record stays as it is
                # what did not go is kept apart, appended before the uploader acknowledges the
                # original: a crash between the two re-sends, never loses
                assert self._spool is not None
                self._spool.append([_RECORD_HEAD.pack(n) + b for b, n in parts])
                return replace(outcome, ack=True)
            parts.pop(0)
            went = True
        return _DONE

    def _fit(self, parts: Sequence[tuple[bytes, int]]) -> tuple[list[tuple[bytes, int]], bool]:
        """``parts`` with each one the receiver refused a body as large as split in halves (before any
        request), and whether a single series still too large was dropped (counted)."""
        now = self._clock()
        out: list[tuple[bytes, int]] = []
        dropped = False
        stack = list(reversed(parts))
        while stack:
            body, samples = stack.pop()
            if self._limit.fits(len(body), now):
                out.append((body, samples))
                continue
            try:
                first, second = encoding.split_request(encoding.decompress(body))
            except ValueError:  # one series (its samples, staleness markers) larger than a refused body
                reason = (f"a single series of {len(body)} bytes is as large as a request {redact_url(self.settings.url)}"
                          f" refused with 413 ({self._limit.refused} bytes)")
                self._counters.refused(samples, reason)
                self._log_once.warning("413-series", "remote_write: %s, dropped (counted)", reason)
                dropped = True
                continue
            half = samples // 2  # one sample per series: the first half holds exactly half of them
            stack.append((encoding.compress(second), samples - half))
            stack.append((encoding.compress(first), half))
        return out, dropped

    def _post(self, body: bytes, samples: int) -> Outcome:
        """One request and what its answer means for the record."""
        assert self._transport is not None
        try:
            response = self._transport.post(body)
        except OSError as exc:
            return self._retry(samples, "unreachable", f"{type(exc).__name__}: {exc}")
        except HeaderError as exc:
            return self._retry(samples, "header", str(exc), config=True)
        except Exception as exc:  # the credential: azure-identity's ClientAuthenticationError and kin
            return self._retry(samples, "token", f"no token ({self.settings.credential}): {exc}", config=True)
        status = response.status
        if 200 <= status < 300:
            self._counters.succeeded(samples, self._clock())
            self._limit.was_accepted(len(body))
            self._refusals_413 = 0
            self._delivered = True
            self._log_once.clear()
            return _DONE
        if status == 413:
            about_size = self._limit.was_refused(len(body), self._clock())
            self._refusals_413 += 1
            if about_size and self._refusals_413 == 1:
                self._counters.failed_attempt(samples, _describe(response))
                return _SPLIT_NOW
            return self._retry(samples, "http 413", f"{_describe(response)} (splitting requests under "
                               f"{self._limit.refused} bytes)", response.retry_after)
        if 300 <= status < 400:
            return self._retry(samples, f"http {status}", response.redirect or _describe(response),
                               response.retry_after, config=True)
        if status >= 500 or status in _RETRY_STATUS or status < 200:
            return self._retry(samples, f"http {status}", _describe(response), response.retry_after)
        if status in _CONFIG_STATUS:
            return self._retry(samples, f"http {status}", _describe(response), response.retry_after, config=True)
        self._counters.refused(samples, _describe(response))
        self._log_once.warning(f"refused {status}", "remote_write: %s refused %d samples, dropped "
                               "(not retried): %s", redact_url(self.settings.url), samples, _describe(response))
        return _DONE

    def _retry(self, samples: int, key: str, reason: str, retry_after: float | None = None,
               config: bool = False) -> Outcome:
        """The record stays; the uploader backs off (from ``config_backoff_min`` for a config fault)."""
        self._counters.failed_attempt(samples, reason)
        self._log_once.warning(key, "remote_write: %s: %s; %s", redact_url(self.settings.url), reason,
                               "check the configuration; retrying slowly" if config else "retrying")
        return Outcome(ack=False, retry=True, retry_after=retry_after, config=config)

    # -- shutdown and health --------------------------------------------------------------------

    def stop(self, timeout: float = 5.0) -> None:
        """Give the uploader until ``timeout`` to send what is spooled; the rest waits on disk."""
        deadline = self._clock() + timeout
        transport = self._transport
        if self._uploader is not None:
            self._uploader.stop(deadline, transport.abort if transport is not None else None)
        elif self._spool is not None:
            self._spool.close()
        if transport is not None:
            transport.close()

    def health(self) -> SinkHealth:
        stats = self._spool.stats() if self._spool is not None else None
        c = self._counters
        lost = stats.dropped_weight if stats else 0  # samples of the records the spool dropped, exact
        extra = {"spool_bytes": float(stats.bytes if stats else 0),
                 "requests_queued": float(stats.records if stats else 0)}
        up = self._uploader is not None and self._uploader.running and c.consecutive_failures == 0
        return SinkHealth(up=up, exported=c.sent, failed=c.failed, dropped=c.dropped + lost,
                          detail=c.last_error, extra=extra)

    # -- gpumon check ---------------------------------------------------------------------------

    def check(self) -> list[CheckResult]:
        """POST an empty WriteRequest: reachability, TLS, credentials and the path, nothing stored."""
        try:
            self.ensure_dependencies()
            self._require()
            transport = self._make_transport()
        except Exception as exc:
            return [CheckResult(self.name, False, str(exc))]
        url = redact_url(self.settings.url)
        try:
            response = transport.post(encoding.compress(b""))
        except OSError as exc:
            return [CheckResult(self.name, False, f"{url} unreachable: {type(exc).__name__}: {exc}")]
        except HeaderError as exc:
            return [CheckResult(self.name, False, f"{url}: {exc}")]
        except Exception as exc:
            return [CheckResult(self.name, False, f"no token ({self.settings.credential}): {exc}")]
        finally:
            transport.close()
        if 200 <= response.status < 300:
            return [CheckResult(self.name, True, f"{url} accepts remote write (HTTP {response.status})")]
        return [CheckResult(self.name, False, f"{url}: {response.redirect or _describe(response)}")]


def _secret_file(path: str) -> str:
    """A password or token file's text, stripped; a file that is not UTF-8 is refused without
    quoting any of it (the codec's message would show a byte of the secret)."""
    try:
        return read_regular_file(path, _SECRET_MAX).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise HeaderError(f"{path} is not UTF-8 text (its content is not shown)") from None


def _describe(response: Response) -> str:
    """The status and the start of the answer (the transport redacted it and made it one line)."""
    return f"HTTP {response.status}" + (f": {response.text}" if response.text else "")

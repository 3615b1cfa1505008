"""What an answer from the Logs Ingestion service means: retry it, a configuration fault a person must
fix (401/403/404, a token refused, a 400 about the stream or DCR rather than a row), or rows to isolate
(400/413); and the message that says what to fix. The latest reason is kept for ``health()`` and each
distinct reason is logged once."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from gpumon.log_once import LogOnce
from gpumon.sinks.azure_monitor.options import AzureMonitorSettings
from gpumon.sinks.common import DeliveryCounters, retry_after_from_headers

MONITORING_METRICS_PUBLISHER = "3913510d-42f4-4e42-8a64-420c390055eb"

_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
_CONFIG_STATUS = {401, 403, 404}
ROW_STATUS = {400, 413}
"""Statuses that may be about some rows only: isolated by bisection, the rest of the batch goes on."""
_TARGET_CODE = re.compile(r"stream|api-?version|datacollectionrule|dcr", re.IGNORECASE)
_TARGET_MESSAGE = re.compile(r"api-version|\bstream\b[^.]{0,120}\bnot (?:declared|defined|found|present)",
                             re.IGNORECASE)
"""A 400 whose error code or message names the stream, the DCR or the api-version is about the
request (InvalidStream, InvalidApiVersion, ...): no row of it can go through, so none is dead-lettered."""


@dataclass
class UploadResult:
    """What became of an upload: ok (sent or dead-lettered), or why not and how long to wait."""

    ok: bool
    delay: float = 0.0
    config_fault: bool = False
    reason: str = ""
    stream_missing: bool = False
    """The DCR does not have the stream (404, or a 400 about the request itself)."""


class Classifier:
    """Turns a failed upload into a :class:`UploadResult` and keeps its reason in the sink's counters
    (``last_error``: why the sink is down), logging each distinct reason once."""

    def __init__(self, settings: AzureMonitorSettings, counters: DeliveryCounters, log_once: LogOnce) -> None:
        self.settings = settings
        self._counters = counters
        self._log_once = log_once

    def request_fault(self, stream: str, error: BaseException, every_row: bool = False) -> UploadResult:
        """A 400 for the request itself: keep the rows, say what to fix, retry slowly until it is fixed."""
        why = "rows sent alone are refused the same way: " if every_row else ""
        reason = (f"400 from stream {stream} on DCR {self.settings.dcr_immutable_id}: the request itself is "
                  f"refused, not a row ({why}{error_text(error)}); check the stream_* options and "
                  "dcr_immutable_id against the DCR (deploy/azure/ outputs) and redeploy the template if "
                  "this gpumon sends columns it lacks; rows stay in the spool and are retried")
        self.note(reason, logging.ERROR)
        headers = getattr(getattr(error, "response", None), "headers", None)
        return UploadResult(False, retry_after_from_headers(headers) or 0.0, True, reason, stream_missing=True)

    def classify(self, error: BaseException, status: int | None, stream: str, auth_error: type) -> UploadResult:
        dcr = self.settings.dcr_immutable_id
        headers = getattr(getattr(error, "response", None), "headers", None)
        if status in _CONFIG_STATUS:
            reason = status_verdict(status, dcr, stream, self.identity_hint(), error_text(error))
            self.note(reason, logging.ERROR)
            return UploadResult(False, retry_after_from_headers(headers) or 0.0, True, reason,
                                stream_missing=status == 404)
        if isinstance(error, auth_error):
            reason = f"cannot get a token ({self.settings.credential}): {error_text(error)}"
            self.note(reason, logging.ERROR)
            return UploadResult(False, 0.0, True, reason)
        if status is not None and status not in _RETRYABLE_STATUS:
            reason = f"HTTP {status} from stream {stream}: {error_text(error)}"
            self.note(reason, logging.WARNING)
            return UploadResult(False, retry_after_from_headers(headers) or 0.0, False, reason)
        if status is not None:
            reason = f"HTTP {status} from stream {stream}; retrying"
        else:
            reason = f"endpoint unreachable ({type(error).__name__}: {error_text(error)}); retrying"
        self.note(reason, logging.WARNING)
        return UploadResult(False, retry_after_from_headers(headers) or 0.0, False, reason)

    def identity_hint(self) -> str:
        kind = self.settings.credential
        if self.settings.client_id:
            return f"{kind} client id {self.settings.client_id}"
        return f"{kind} (system-assigned)" if kind == "managed_identity" else kind

    def note(self, reason: str, level: int) -> None:
        """Log each distinct reason once, not every retry; then keep it for health(), so that a
        health that names the reason means its log line is written."""
        self._log_once.log(level, reason, "azure_monitor: %s", reason)
        self._counters.last_error = reason


def status_verdict(status: int | None, dcr: str, stream: str, identity: str, text: str,
                   audience: str = "https://monitor.azure.com") -> str:
    if status == 401:
        return (f"401 token refused by the ingestion endpoint: wrong audience or tenant? The token must be "
                f"for {audience} ({text})")
    if status == 403:
        return (f"403 forbidden: {identity} lacks the role Monitoring Metrics Publisher "
                f"({MONITORING_METRICS_PUBLISHER}) on DCR {dcr}; assign it (deploy/azure/ does, given "
                f"principalId) and allow up to 30 minutes to propagate ({text})")
    if status == 404:
        return (f"404 not found: no DCR with immutable id {dcr} at this endpoint, or it declares no stream "
                f"{stream} (check dcr_immutable_id and the stream_* options against the template outputs) "
                f"({text})")
    if status == 400:
        return (f"400 bad request: stream {stream} on DCR {dcr} refused an empty upload; is the stream "
                f"declared in that DCR (check the stream_* options against the template outputs)? ({text})")
    return f"HTTP {status}: {text}"


def http_status(error: BaseException) -> int | None:
    return getattr(getattr(error, "response", None), "status_code", None)


def error_code(error: BaseException) -> str:
    """The service's ``error.code`` (azure-core parses the JSON error body), or ""."""
    return str(getattr(getattr(error, "error", None), "code", None) or "")


def names_target(error: BaseException) -> bool:
    """Whether a 400 says the stream, the DCR or the api-version is wrong rather than a row."""
    message = getattr(getattr(error, "error", None), "message", None) or error_text(error)
    return bool(_TARGET_CODE.search(error_code(error)) or _TARGET_MESSAGE.search(str(message)))


def error_text(error: BaseException) -> str:
    """A short reason: the service's error message when it sent one, never headers or tokens."""
    message = getattr(error, "message", None) or str(error)
    return " ".join(str(message).split())[:300]

"""Azure Instance Metadata Service (IMDS): the one client gpumon asks who this VM is and what the
platform has scheduled for it.

Every part of gpumon that asks (the ``host_info`` and ``azure_events`` collectors, the host identity
provider whose answer the sinks and the health stage read from each snapshot, the Azure GHR health
action) goes through :func:`client`, one shared :class:`ImdsClient` per IMDS address, so the
compute document is fetched once and kept (re-read every ``compute_refresh`` seconds), and "not on
Azure" is learnt once, by one short request, and kept too: off Azure nothing waits twice.

Faults (404, 500, a slow or malformed answer, 429 when more than 5 requests a second reach IMDS) are
raised as :class:`ImdsError` with a short ``reason`` that callers count; each reason is logged once
until a request succeeds again. After a 429 the client asks nothing for a second (or the
``Retry-After``): a throttled call fails at once instead of waiting.

The timeout bounds the whole request (connect, headers and body): an endpoint that trickles a byte
at a time cannot hold a caller longer. An answer that is not plain JSON (``Infinity``, ``NaN``, a
number beyond a float or an integer longer than 20 digits) is ``malformed``, not a crash later.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import logging
import math
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpumon.config import Option, SectionSchema
from gpumon.httpdates import parse_retry_after
from gpumon.log_once import LogOnce
from gpumon.model import AzureInstance  # the compute document as data: the model's

log = logging.getLogger("gpumon.imds")

IMDS_ENDPOINT = "http://169.254.169.254"
COMPUTE_PATH = "/metadata/instance/compute?api-version=2021-02-01"
EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
IMDS_URL = IMDS_ENDPOINT + COMPUTE_PATH
"""The compute document's full URL (the sinks' ``imds_url`` default)."""

MAX_BODY = 1 << 20
THROTTLE_PAUSE = 1.0
"""Seconds nothing is asked after a 429 without Retry-After (IMDS allows 5 requests a second)."""
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
MAX_INT_DIGITS = 20
"""The longest integer an IMDS document may hold (an int64 and its sign): IMDS's numbers are small."""
MAX_DURATION = 10 * 365 * 86400
"""The longest ``DurationInSeconds`` believed (ten years); IMDS's are seconds to minutes, or -1."""


def _url_check(value: str) -> str | None:
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// URL such as {IMDS_ENDPOINT} (got {value!r})"
    return None


@dataclass(frozen=True)
class AzureSettings:
    imds_url: str
    imds_timeout: float
    compute_refresh: float


OPTIONS = SectionSchema(
    "azure",
    "Azure platform context: the Instance Metadata Service (IMDS) every part of gpumon asks.",
    (
        Option("imds_url", str, IMDS_ENDPOINT,
               "IMDS address (scheme, host and port); the paths and api-versions are gpumon's. Requests "
               "never go through a proxy.", check=_url_check),
        Option("imds_timeout", float, 0.5,
               "Seconds one IMDS request may take. Off Azure the first request fails within this and "
               "the answer \"not on Azure\" is kept, so nothing waits twice.", min=0.05, max=60.0),
        Option("compute_refresh", float, 600.0,
               "Seconds the compute metadata (and a \"not on Azure\" answer) is kept before it is asked "
               "again.", min=10.0, max=86400.0),
    ),
    AzureSettings,
)


class ImdsError(Exception):
    """IMDS did not give a usable answer. ``reason`` is short and fixed, for counters:
    ``unreachable``, ``timeout``, ``http_error``, ``throttled`` or ``malformed``."""

    def __init__(self, reason: str, detail: str, status: int = 0) -> None:
        super().__init__(f"IMDS {reason}: {detail}")
        self.reason, self.detail, self.status = reason, detail, status


@dataclass(frozen=True)
class ScheduledEvent:
    """One entry of the Scheduled Events document. ``not_before`` is Unix time, None when the
    document's NotBefore is empty (the event has started) or unreadable; ``duration`` -1 is unknown."""

    event_id: str
    event_type: str
    status: str
    source: str
    resource_type: str
    resources: tuple[str, ...]
    not_before: float | None
    not_before_text: str
    description: str
    duration: int


@dataclass(frozen=True)
class ScheduledEvents:
    incarnation: int
    events: tuple[ScheduledEvent, ...]


def parse_not_before(text: str) -> float | None:
    """An RFC 1123 date (``Mon, 19 Sep 2016 18:29:47 GMT``) as Unix time; None if empty or unreadable."""
    if not text.strip():
        return None
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


def _integer(value: Any, name: str, low: int, high: int) -> int:
    """An integer field (as a JSON number or a string of digits) within ``[low, high]``, else
    ImdsError ``malformed``: ``Infinity``, ``1e400`` or 400 digits must not reach a counter."""
    if isinstance(value, bool):
        value = None
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and 0 < len(value.strip()) <= MAX_INT_DIGITS:
        with contextlib.suppress(ValueError):
            value = int(value.strip())
    if not isinstance(value, int) or not low <= value <= high:
        raise ImdsError("malformed", f"{name} is not an integer from {low} to {high} (got {str(value)[:40]!r})")
    return value


def _event(item: Any) -> ScheduledEvent:
    if not isinstance(item, dict) or not isinstance(item.get("EventId"), str) or not item["EventId"]:
        raise ImdsError("malformed", f"event without an EventId: {str(item)[:200]}")
    resources = item.get("Resources") or []
    duration = _integer(item.get("DurationInSeconds", -1), "DurationInSeconds", -1, MAX_DURATION)
    not_before = str(item.get("NotBefore") or "")
    return ScheduledEvent(
        event_id=item["EventId"], event_type=str(item.get("EventType", "")),
        status=str(item.get("EventStatus", "")), source=str(item.get("EventSource", "")),
        resource_type=str(item.get("ResourceType", "")),
        resources=tuple(str(r) for r in resources) if isinstance(resources, list) else (),
        not_before=parse_not_before(not_before), not_before_text=not_before,
        description=str(item.get("Description", "")), duration=duration)


def parse_scheduled_events(doc: Any) -> ScheduledEvents:
    """The documented shape ``{"DocumentIncarnation": int, "Events": [...]}``, else ImdsError."""
    if not isinstance(doc, dict) or not isinstance(doc.get("Events", []), list):
        raise ImdsError("malformed", "scheduled events document is not {DocumentIncarnation, Events[]}")
    incarnation = _integer(doc.get("DocumentIncarnation", 0), "DocumentIncarnation", 0, 2**63 - 1)
    return ScheduledEvents(incarnation, tuple(_event(item) for item in doc.get("Events", [])))


def base_url(url: str) -> str:
    """``scheme://host[:port]`` of any IMDS URL: a sink's full compute URL and ``[azure] imds_url``
    name the same IMDS, hence the same shared client."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range")
    return value


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def parse_json(raw: bytes) -> Any:
    """IMDS's JSON, strictly: no ``Infinity``/``NaN``, no float out of range, no integer longer than
    :data:`MAX_INT_DIGITS` digits (ValueError)."""
    return json.loads(raw, parse_constant=_no_constant, parse_float=_finite, parse_int=_short_int)



class ImdsClient:
    """One IMDS: cached compute metadata, cached absence, throttling, and log-once faults.

    Thread-safe: collectors and sinks call it from their own threads.
    """

    def __init__(self, url: str = IMDS_ENDPOINT, timeout: float = 0.5, refresh: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = base_url(url)
        self.timeout = timeout
        self.refresh = refresh
        self._clock = clock
        self._lock = threading.Lock()        # the compute cache and the absence verdict (never held over I/O)
        self._fetched = threading.Condition(self._lock)
        self._fetching = False
        """A compute request is in flight: other callers wait for its answer instead of asking too."""
        self._fetches = 0
        self._fetch_error: ImdsError | None = None
        """How the latest compute request failed; None when it succeeded."""
        self._state = threading.Lock()       # throttle bookkeeping
        self._instance: AzureInstance | None = None
        self._compute_at = -float("inf")
        self._absent_error: ImdsError | None = None
        self._throttled_until = -float("inf")
        self._log_once = LogOnce(log)

    # -- the wire ----------------------------------------------------------------------------------

    def request(self, path: str, body: Mapping[str, Any] | None = None, timeout: float | None = None,
                parse: Callable[[Any], Any] | None = None) -> Any:
        """GET (or POST ``body`` as JSON) ``path``; the parsed JSON answer (None for an empty one), read
        by ``parse`` when given: a document of the wrong shape is a fault logged once like the others."""
        now = self._clock()
        with self._state:
            if now < self._throttled_until:
                raise ImdsError("throttled", f"asked too often; waiting {self._throttled_until - now:.1f} s")
        try:
            doc = self._exchange(path, body, self.timeout if timeout is None else timeout)
            if parse is not None:
                doc = parse(doc)
        except ImdsError as exc:
            self._failed(path, exc)
            raise
        self._log_once.clear()
        return doc

    def _exchange(self, path: str, body: Mapping[str, Any] | None, timeout: float) -> Any:
        """One request, never through a proxy (IMDS must be asked directly), the whole of it (connect,
        headers, body) within ``timeout``: at the deadline the socket is shut, whatever it is doing."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Metadata": "true"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        parts = urllib.parse.urlsplit(self.url)
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        expired = threading.Event()

        def cut() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        deadline = threading.Timer(timeout, cut)
        deadline.daemon = True
        deadline.start()
        try:
            conn.request("GET" if data is None else "POST", path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read(MAX_BODY)
            if expired.is_set():
                raise TimeoutError("the deadline cut the answer short")
        except TimeoutError as exc:
            raise ImdsError("timeout", f"no whole answer within {timeout:g} s ({exc})") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if expired.is_set():
                raise ImdsError("timeout", f"no whole answer within {timeout:g} s") from None
            raise ImdsError("unreachable", f"{self.url}: {exc}") from None
        finally:
            deadline.cancel()
            conn.close()
        if response.status >= 400:
            raise self._http_error(response.status, response.reason, response.getheader("Retry-After"))
        if not 200 <= response.status < 300:  # a redirect or an interim answer: IMDS sends neither
            raise ImdsError("http_error", f"HTTP {response.status} {response.reason}", response.status)
        if not raw.strip():
            return None
        try:
            return parse_json(raw)
        except (ValueError, RecursionError) as exc:
            raise ImdsError("malformed", f"{path}: not JSON ({exc})") from None

    def _http_error(self, status: int, reason: str, retry_after: str | None) -> ImdsError:
        if status == 429:
            pause = _retry_after(retry_after)
            with self._state:
                self._throttled_until = self._clock() + pause
            return ImdsError("throttled", f"429 Too Many Requests; pausing {pause:g} s", 429)
        return ImdsError("http_error", f"HTTP {status} {reason}", status)

    def _failed(self, path: str, exc: ImdsError) -> None:
        where = path.partition('?')[0]
        self._log_once.warning(f"{where}:{exc.reason}", "%s (asking %s; logged once until IMDS answers again, "
                               "counted every time)", exc, where)

    # -- compute metadata --------------------------------------------------------------------------

    def instance(self) -> AzureInstance:
        """The VM's compute metadata, cached for ``refresh`` seconds. A failed refresh keeps the
        previous answer; with none, raises ImdsError (at once while "not on Azure" is cached).

        The request is made without the lock, one at a time: a caller that finds one in flight waits
        for its answer (or its error) rather than sending a second."""
        with self._lock:
            now = self._clock()
            if self._instance is not None and now - self._compute_at < self.refresh:
                return self._instance
            if self._absent_error is not None and now - self._compute_at < self.refresh:
                raise self._absent_error
            if self._fetching:
                if self._instance is not None:  # a refresh is in flight: the previous answer will do
                    return self._instance
                fetches = self._fetches
                while self._fetching and self._fetches == fetches:
                    self._fetched.wait()
                if self._instance is not None:
                    return self._instance
                if self._fetch_error is not None:
                    raise self._fetch_error
            self._fetching = True
        found: AzureInstance | None = None
        error: ImdsError | None = None
        try:
            doc = self.request(COMPUTE_PATH)
            if not isinstance(doc, dict):
                raise ImdsError("malformed", "compute metadata is not a JSON object")
            found = AzureInstance.from_compute(doc)
        except ImdsError as exc:
            error = exc
        finally:
            with self._lock:
                self._fetching = False
                self._fetches += 1
                self._fetch_error = error if found is None else None
                if found is not None:
                    self._instance, self._compute_at, self._absent_error = found, now, None
                elif error is not None and error.reason in ("unreachable", "timeout") and self._instance is None:
                    self._absent_error, self._compute_at = error, now  # no IMDS here: do not ask again soon
                previous = self._instance
                self._fetched.notify_all()
        if found is not None:
            return found
        if previous is not None:  # a failed refresh keeps the previous answer
            return previous
        assert error is not None
        raise error

    def on_azure(self) -> tuple[bool, str]:
        """Whether an IMDS answers here, from the cache where it can (one short probe at most):
        (True, "") when it answered at all, even with an error; else (False, why)."""
        try:
            self.instance()
        except ImdsError as exc:
            if exc.reason in ("unreachable", "timeout"):
                return False, f"not on Azure: no IMDS at {self.url} ({exc.detail})"
        return True, ""

    # -- Scheduled Events --------------------------------------------------------------------------

    def scheduled_events(self, timeout: float | None = None) -> ScheduledEvents:
        """The current Scheduled Events document (the first request enables the service)."""
        return self.request(EVENTS_PATH, timeout=timeout, parse=parse_scheduled_events)

    def acknowledge(self, event_ids: list[str], timeout: float | None = None) -> None:
        """Start the events now: POST ``{"StartRequests": [{"EventId": ...}]}``."""
        self.request(EVENTS_PATH, {"StartRequests": [{"EventId": e} for e in event_ids]}, timeout)


def run_verdict(exc: ImdsError, path: str, collector: str) -> str:
    """What ``gpumon check`` says when a request ``gpumon run`` will make every poll fails."""
    where = f"IMDS {exc.reason} asking {path.partition('?')[0]}: {exc.detail}"
    hint = ""
    if exc.status in (401, 403, 407):
        # gpumon asks IMDS directly (no proxy, `Metadata: true`), so a refusal comes from whatever
        # intercepts 169.254.169.254 on the way, or a VM where IMDS access is locked down.
        hint = ("; gpumon asks IMDS directly, never through a proxy: something on this host or VM "
                "intercepts 169.254.169.254 (a transparent proxy, a firewall rule) or IMDS access is "
                "locked down here")
    return (f"{where}{hint}. gpumon run will count gpumon_collector_errors_total{{collector=\"{collector}\","
            f"reason=\"imds_{exc.reason}\"}} on every poll and export nothing from IMDS")


def _retry_after(value: str | None) -> float:
    """Seconds to pause after a 429: Retry-After (delta-seconds or an HTTP-date), else one second, at
    most a minute."""
    seconds = parse_retry_after(value)
    return THROTTLE_PAUSE if seconds is None else min(seconds, 60.0)


_clients: dict[str, ImdsClient] = {}
_clients_lock = threading.Lock()


def client(url: str = IMDS_ENDPOINT, timeout: float | None = None, refresh: float | None = None) -> ImdsClient:
    """The shared client for the IMDS at ``url`` (any URL on it). A timeout or refresh given here
    replaces the client's (the latest configuration wins, as after a reload)."""
    key = base_url(url)
    with _clients_lock:
        shared = _clients.get(key)
        if shared is None:
            shared = _clients[key] = ImdsClient(key)
        if timeout is not None:
            shared.timeout = float(timeout)
        if refresh is not None:
            shared.refresh = float(refresh)
        return shared


def configured(section: Mapping[str, Any] | None) -> ImdsClient:
    """The shared client as ``[azure]`` configures it (defaults where the section is absent)."""
    settings = OPTIONS.settings_of(section)
    return client(settings.imds_url, settings.imds_timeout, settings.compute_refresh)

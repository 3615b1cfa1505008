"""What the sinks' requests and counts share: Retry-After from response headers, redirects followed
only to the same origin, request headers checked and their secrets kept out of messages, a
receiver's answer made fit for a log line, files read without blocking, the delivery counters, and
whether a snapshot holds a new collector run.

The delivery machine itself (queue or spool, the retry loop, the backoff wait, the stop with a
deadline) is :mod:`gpumon.sinks.delivery`'s, as the OpenTelemetry Collector's is its
``exporterhelper``. Logging a failure once is :mod:`gpumon.log_once`'s and the backoff is
:mod:`gpumon.backoff`'s (collectors need them too, and must not import a sink module). The health
actions' Kubernetes client takes Retry-After from here too.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumon.httpdates import parse_retry_after
from gpumon.model import Snapshot

__all__ = ["REDIRECT_FOLLOWED", "DeliveryCounters", "has_new_results", "header_list_check", "header_problem",
           "parse_retry_after", "read_regular_file", "receiver_text", "redact_url", "redirect_target",
           "retry_after_from_headers", "secrets_of"]

REDIRECT_FOLLOWED = (307, 308)
"""The only redirects a sink follows: they keep the method and the body (RFC 9110 15.4.8, RFC 9110
15.4.9), and only to the same origin (see :func:`redirect_target`)."""
MAX_REDIRECTS = 3
"""Redirects followed for one request, all within its one deadline."""
RECEIVER_TEXT_MAX = 300
"""Characters of a receiver's answer kept for the log, after redaction."""
_SECRET_MIN = 4
"""Shorter header values are not searched for in a receiver's answer: three characters are no
secret, and replacing them everywhere would garble the text."""
_NOT_PRINTABLE = re.compile(r"[^\x20-\x7e\u00a0-\ud7ff\ue000-\ufffc]+")
"""Control characters (a newline forges a log line), invalid bytes and other non-printables."""


def retry_after_from_headers(headers: Mapping[str, Any] | Any | None, now: float | None = None) -> float | None:
    """Seconds from ``retry-after-ms`` / ``x-ms-retry-after-ms`` (Azure) or ``Retry-After``."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("x-ms-retry-after-ms", 0.001)):
        raw = headers.get(name)
        if raw:
            try:
                return max(0.0, float(raw) * scale)
            except ValueError:
                pass
    return parse_retry_after(headers.get("Retry-After"), now)


def redact_url(url: str) -> str:
    """The URL without a ``user:password@`` part, for messages."""
    return re.sub(r"//[^/@]*@", "//", url, count=1)


def redirect_target(url: str, status: int, location: str | None) -> tuple[str | None, str]:
    """Where a redirect of a request to ``url`` may be followed: ``(target, "")``, or ``(None, why)``.

    Only 307 and 308 (same method, same body) to the same origin (scheme, host and port): any other
    redirect would send the body, and the credentials with it, somewhere the configuration did not
    name, or silently turn the POST into a GET that delivers nothing. The reason never holds the
    ``Location`` itself beyond its origin (a hostile server chooses it)."""
    if status not in REDIRECT_FOLLOWED:
        return None, f"HTTP {status} redirect (only 307/308 to the same origin are followed)"
    if not location:
        return None, f"HTTP {status} redirect without a Location"
    target = urllib.parse.urljoin(url, location.strip())
    if _origin(target) != _origin(url):
        return None, f"HTTP {status} redirect to another origin ({redact_url(_origin_text(target))}), not followed"
    return target, ""


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme.lower(), (parts.hostname or "").lower(), port if port is not None else default


def _origin_text(url: str) -> str:
    scheme, host, port = _origin(url)
    return sanitize_text(f"{scheme}://{host}:{port}", 120)


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP field name (RFC 9110 5.1, ``token``)."""
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
"""What a field value must not hold (RFC 9110 5.5): a CR or LF would end the header, a NUL is refused."""


def header_problem(item: str) -> str | None:
    """Why ``NAME=VALUE`` is not a request header gpumon can send, or None. The message names the
    header (as far as it reads as a name) and never shows the value: a header written
    ``Authorization: Bearer ...`` holds a credential however it is mistyped."""
    name, sep, value = item.partition("=")
    # a name followed by ':' or a space reads as a header name; a lone word may be the secret itself
    hint = re.match(r"\s*([!#$%&'*+.^_`|~0-9A-Za-z-]+)\s*[:\s]", item)
    named = f" {hint.group(1)!r}" if hint else ""
    if not sep:
        return f"entry{named} is not NAME=VALUE (write {hint.group(1) if hint else 'NAME'}=VALUE; " \
               "the entry is not shown)"
    if not _TOKEN.fullmatch(name.strip()):
        return f"entry{named} does not start with a valid header name before '=' (the entry is not shown)"
    if _CONTROL.search(value):
        return f"header {name.strip()!r}: the value holds a control character or a line break (not shown)"
    return None


def header_list_check(items: list[str]) -> str | None:
    """The config check of a ``headers`` option (``[otel]``, ``[remote_write]``): see :func:`header_problem`."""
    for item in items:
        problem = header_problem(item)
        if problem:
            return problem
    return None


def secrets_of(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """What must not appear in a message of a request sent with ``headers``: every value, and of an
    ``Authorization`` value its credentials alone (the token; for Basic, the password too)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    found: list[str] = []
    for name, value in pairs:
        value = value.strip()
        found.append(value)
        if name.lower() in ("authorization", "proxy-authorization"):
            scheme, _, credentials = value.partition(" ")
            credentials = credentials.strip()
            found.append(credentials)
            if scheme.lower() == "basic":
                try:
                    user, _, password = base64.b64decode(credentials, validate=True).decode("utf-8").partition(":")
                except (binascii.Error, UnicodeDecodeError):
                    continue
                found.append(password)
    # longest first: a token inside a longer value is replaced with it, not left half shown
    return tuple(sorted({f for f in found if len(f) >= _SECRET_MIN}, key=len, reverse=True))


def sanitize_text(text: str, limit: int = RECEIVER_TEXT_MAX) -> str:
    """``text`` on one line of printable characters, at most ``limit`` of them."""
    clean = " ".join(_NOT_PRINTABLE.sub(" ", text).split())
    return clean if len(clean) <= limit else clean[:limit] + "..."


def receiver_text(raw: bytes | str, secrets: Iterable[str] = (), limit: int = RECEIVER_TEXT_MAX) -> str:
    """A receiver's answer as the log may show it: the request's secrets (see :func:`secrets_of`)
    replaced by ``<redacted>`` wherever it echoes them, control characters and invalid bytes gone, one
    line, at most ``limit`` characters. An answer that is mostly not text (a protobuf, an image) is
    described, not shown."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not text.strip():
        return ""
    unprintable = sum(len(m) for m in _NOT_PRINTABLE.findall(text.replace("\n", " ").replace("\t", " ")
                                                            .replace("\r", " ")))
    if unprintable * 10 > len(text):
        return f"({len(raw)} bytes, not text)"
    for secret in secrets:
        text = text.replace(secret, "<redacted>")
    return sanitize_text(text, limit)


def read_regular_file(path: str, max_bytes: int = 1 << 20) -> bytes:
    """A file a sink reads while running (a password, a token, a certificate, the web config):
    opened without blocking, so a FIFO with no writer or a device does not hang the caller, and
    refused (OSError) unless it is a regular file no larger than ``max_bytes``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise OSError(f"{path} is larger than {max_bytes} bytes")
    return b"".join(chunks)


@dataclass
class DeliveryCounters:
    """What a sink sent, failed to send (and will retry) and dropped for good, in items.

    The methods may be called from any thread (the loop's publish and a sink's uploader both count)."""

    sent: int = 0
    failed: int = 0
    dropped: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    last_success_monotonic: float | None = None
    last_success_time: float = 0.0
    """Wall-clock time of the latest success (0 before the first): a ``*_last_success_timestamp_seconds``."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def up(self) -> bool:
        """Up only after a first success and while the latest attempt succeeded."""
        return self.last_success_monotonic is not None and self.consecutive_failures == 0

    def succeeded(self, items: int, now: float | None = None) -> None:
        with self._lock:
            self.sent += items
            self.consecutive_failures = 0
            self.last_error = ""
            self.last_success_monotonic = time.monotonic() if now is None else now
            self.last_success_time = time.time()

    def failed_attempt(self, items: int, error: str | None = None) -> None:
        """``items`` failed and will be retried; ``error`` (None: keep the latest) says why."""
        with self._lock:
            self.failed += items
            self.consecutive_failures += 1
            if error is not None:
                self.last_error = error

    def dropped_items(self, items: int, error: str = "") -> None:
        with self._lock:
            self.dropped += items
            if error:
                self.last_error = error

    def refused(self, items: int, error: str) -> None:
        """The receiver refused ``items`` for good (a 400 for out-of-order samples): dropped, and the
        sink is not up until a request goes through, so that a receiver refusing everything does not
        look like a healthy one."""
        with self._lock:
            self.dropped += items
            self.consecutive_failures += 1
            self.last_error = error


def has_new_results(new: Snapshot, old: Snapshot | None) -> bool:
    """Whether ``new`` carries a collector run that ``old`` did not.

    The loop re-publishes several times a second (sink health, deadlines); the data only changes
    when a collector finishes a run, which replaces that collector's status object. Exporting on
    that, and not on every publish, is what makes the export follow the collection interval.
    """
    if old is None:
        return True
    if new is old:
        return False
    if len(new.collectors) != len(old.collectors) or not new.collectors:
        return True
    return any(a is not b for a, b in zip(new.collectors, old.collectors, strict=True))

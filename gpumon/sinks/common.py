"""Plumbing every sink shares: Retry-After, delivery counters, and whether a snapshot holds a new
collector run.

One home for these, as the OpenTelemetry Collector has one ``exporterhelper``: a sink that needs to
honour a server's Retry-After and count what it sent, failed or dropped takes it from here rather
than writing its own loop. Logging a failure once is :mod:`gpumon.log_once`'s and the backoff is
:mod:`gpumon.backoff`'s (collectors need them too, and must not import a sink module).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumon.httpdates import parse_retry_after
from gpumon.model import Snapshot

__all__ = ["DeliveryCounters", "has_new_results", "parse_retry_after", "read_regular_file",
           "retry_after_from_headers"]


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

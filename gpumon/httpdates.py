"""HTTP's Retry-After, read one way for every client gpumon has (the sinks, the IMDS client): below
both sinks and sources, so that either can use it."""

from __future__ import annotations

import datetime
import email.utils
import time


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delta-seconds or an HTTP-date (RFC 9110 10.2.3).

    None when absent or unreadable; never negative (a date in the past means "now").
    """
    if value is None:
        return None
    value = str(value).strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if seconds == seconds else None  # NaN is unreadable
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT; a zone-less parse means "-0000"
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))

"""The shared sink plumbing: Retry-After in both forms, counters (log-once: test_log_once.py; backoff:
test_backoff.py)."""

from __future__ import annotations

import threading
import time

from gpumon.sinks.common import (
    DeliveryCounters,
    parse_retry_after,
    retry_after_from_headers,
)


def test_retry_after_delta_seconds() -> None:
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("-5") == 0.0


def test_retry_after_http_date_is_relative_to_now() -> None:
    now = 784111777.0  # Sun, 06 Nov 1994 08:49:37 GMT, the example of RFC 9110
    assert parse_retry_after("Sun, 06 Nov 1994 08:50:37 GMT", now=now) == 60.0
    assert parse_retry_after("Sun, 06 Nov 1994 08:48:37 GMT", now=now) == 0.0


def test_retry_after_unreadable_or_absent_is_none() -> None:
    for value in (None, "", "soon", "nan", "Sun, 99 Foo 1994"):
        assert parse_retry_after(value) is None, value


def test_retry_after_headers_prefer_azure_milliseconds() -> None:
    assert retry_after_from_headers({"retry-after-ms": "1500", "Retry-After": "9"}) == 1.5
    assert retry_after_from_headers({"Retry-After": "9"}) == 9.0
    assert retry_after_from_headers(None) is None


def test_counters_are_not_up_before_a_first_success() -> None:
    c = DeliveryCounters()
    assert not c.up
    c.failed_attempt(3, "timeout")
    assert not c.up and c.failed == 3
    c.succeeded(5, now=1.0)
    assert c.up and c.sent == 5 and c.last_error == ""
    c.dropped_items(2, "413")
    assert c.dropped == 2


def test_counters_keep_the_latest_error_unless_told_one_and_stamp_the_wall_clock() -> None:
    c = DeliveryCounters()
    assert c.last_success_time == 0.0
    c.failed_attempt(1, "HTTP 503")
    c.failed_attempt(1)
    assert (c.failed, c.consecutive_failures, c.last_error) == (2, 2, "HTTP 503")
    c.dropped_items(4)
    assert (c.dropped, c.last_error) == (4, "HTTP 503")
    before = time.time()
    c.succeeded(3)
    assert before <= c.last_success_time <= time.time() and c.last_error == ""


def test_counters_lose_no_count_to_threads_counting_at_once() -> None:
    c = DeliveryCounters()

    def count() -> None:
        for _ in range(20000):
            c.dropped_items(1)
            c.failed_attempt(1)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (c.dropped, c.failed) == (80000, 80000)


def test_the_azure_sink_and_the_imds_client_read_retry_after_from_the_one_parser() -> None:
    """A zone-less HTTP-date is GMT wherever the host's clock is set; one parser, one answer."""
    from gpumon import httpdates
    from gpumon.sinks import azure_monitor, common

    assert common.parse_retry_after is httpdates.parse_retry_after
    assert not hasattr(azure_monitor, "_retry_after")
    now = 784111777.0  # Sun, 06 Nov 1994 08:49:37 GMT
    assert httpdates.parse_retry_after("Sun, 06 Nov 1994 08:50:37", now=now) == 60.0

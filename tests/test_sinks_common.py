"""The shared sink plumbing: Retry-After in both forms, backoff with jitter, log-once, counters."""

from __future__ import annotations

import logging
import random

from gpumon.sinks.common import (
    Backoff,
    DeliveryCounters,
    LogOnce,
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


def test_backoff_doubles_with_jitter_up_to_the_cap_and_honours_retry_after() -> None:
    b = Backoff(initial=1.0, maximum=8.0, rng=random.Random(7))
    delays = [b.failed(0.0) for _ in range(6)]
    for i, d in enumerate(delays):
        nominal = min(8.0, 2.0 ** i)
        assert nominal / 2 <= d <= nominal
    assert b.failed(100.0, retry_after=30.0) == 8.0  # capped
    assert b.not_before == 108.0
    b.succeeded()
    assert (b.failures, b.not_before) == (0, 0.0)
    assert Backoff(1.0, 60.0).failed(0.0, retry_after=20.0) == 20.0


def test_log_once_logs_again_only_after_clear(caplog) -> None:
    once = LogOnce(logging.getLogger("gpumon.test"))
    with caplog.at_level(logging.WARNING, logger="gpumon.test"):
        assert once.warning("down", "down %s", 1)
        assert not once.warning("down", "down %s", 2)
        once.clear("down")
        assert once.warning("down", "down %s", 3)
    assert [r.getMessage() for r in caplog.records] == ["down 1", "down 3"]


def test_counters_are_not_up_before_a_first_success() -> None:
    c = DeliveryCounters()
    assert not c.up
    c.failed_attempt(3, "timeout")
    assert not c.up and c.failed == 3
    c.succeeded(5, now=1.0)
    assert c.up and c.sent == 5 and c.last_error == ""
    c.dropped_items(2, "413")
    assert c.dropped == 2


def test_the_azure_sink_and_the_imds_client_read_retry_after_from_the_one_parser() -> None:
    """A zone-less HTTP-date is GMT wherever the host's clock is set; one parser, one answer."""
    from gpumon import httpdates
    from gpumon.sinks import azure_monitor, common

    assert common.parse_retry_after is httpdates.parse_retry_after
    assert not hasattr(azure_monitor, "_retry_after")
    now = 784111777.0  # Sun, 06 Nov 1994 08:49:37 GMT
    assert httpdates.parse_retry_after("Sun, 06 Nov 1994 08:50:37", now=now) == 60.0

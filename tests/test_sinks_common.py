"""The shared sink plumbing: Retry-After in both forms, backoff with jitter, counters (log-once:
test_log_once.py)."""

from __future__ import annotations

import random
import threading
import time

from gpumon.sinks.common import (
    Backoff,
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


def test_backoff_keeps_doubling_from_a_configuration_fault_s_longer_wait() -> None:
    """A floor (a fault a person has to fix) raises the level; a later transient failure doubles it
    rather than starting over from ``initial``."""
    b = Backoff(initial=1.0, maximum=300.0, jitter=(1.0, 1.0))
    assert b.failed(0.0, floor=30.0) == 30.0
    assert b.failed(0.0) == 60.0
    assert [b.failed(0.0) for _ in range(3)] == [120.0, 240.0, 300.0]
    b.succeeded()
    assert (b.failures, b.nominal, b.failed(0.0)) == (0, 0.0, 1.0)


def test_backoff_jitter_spans_the_range_it_is_given() -> None:
    b = Backoff(initial=10.0, maximum=10.0, jitter=(0.8, 1.2), rng=random.Random(3))
    delays = [b.failed(0.0) for _ in range(2000)]
    assert all(8.0 <= d <= 12.0 for d in delays)
    assert min(delays) < 8.1 and max(delays) > 11.9


def test_backoff_can_take_retry_after_as_the_delay_even_when_shorter() -> None:
    exact = Backoff(initial=100.0, maximum=300.0, jitter=(1.0, 1.0), retry_after_max=3600.0,
                    retry_after_exact=True)
    assert exact.failed(0.0, retry_after=2.0) == 2.0  # shorter than the backoff's 100 s: honoured
    assert exact.failed(0.0, retry_after=7200.0) == 3600.0  # beyond maximum, up to retry_after_max
    assert exact.nominal == 200.0  # the backoff kept doubling meanwhile
    assert exact.failed(0.0, retry_after=0.0) == 300.0  # 0 is no Retry-After: the backoff's (capped) delay
    floor = Backoff(initial=100.0, maximum=300.0, jitter=(1.0, 1.0))
    assert floor.failed(0.0, retry_after=2.0) == 100.0  # by default it only lengthens the wait
    assert floor.failed(0.0, retry_after=7200.0) == 300.0


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

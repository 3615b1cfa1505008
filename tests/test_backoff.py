"""The one backoff (gpumon/backoff.py): doubling with jitter for the sinks and the health actions, a
floor, Retry-After, and the jitter-free mode of the NVML session's re-initialisation."""

from __future__ import annotations

import random

from gpumon.backoff import NO_JITTER, Backoff


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


def test_backoff_without_jitter_doubles_exactly_and_says_its_next_delay_without_recording_it() -> None:
    """The NVML session's re-initialisation: 1 s doubling to 300 s, no jitter."""
    b = Backoff(initial=1.0, maximum=300.0, jitter=NO_JITTER)
    assert b.next_delay() == 1.0 and b.failures == 0
    assert [b.failed(0.0) for _ in range(11)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0,
                                                  300.0, 300.0]
    assert (b.next_delay(), b.failures) == (300.0, 11)
    b.succeeded()
    assert (b.next_delay(), b.nominal) == (1.0, 0.0)

"""gpumon.cadence.due: a costly reading at most once per period, whatever the loop's small jitter."""

from __future__ import annotations

from gpumon.cadence import due


def test_first_ask_is_due():
    assert due(None, 123.0, 30.0)


def test_a_10_s_loop_reads_a_30_s_value_every_third_run_even_when_runs_come_early():
    last, read_at = None, []
    for run in range(10):
        now = run * 10.0 - (0.003 if run % 2 else 0.0)     # every other run a few ms early
        if due(last, now, 30.0):
            last = now
            read_at.append(run)
    assert read_at == [0, 3, 6, 9]


def test_a_fast_loop_waits_for_most_of_the_period():
    assert not due(100.0, 126.0, 30.0) and due(100.0, 127.0, 30.0)

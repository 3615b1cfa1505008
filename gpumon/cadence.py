"""When a costly reading is due again: at most once per period, inside a loop with its own interval."""

from __future__ import annotations

SLACK = 0.9
"""A period counts as passed at 90 % of it: runs come a little early or late."""


def due(last: float | None, now: float, period: float) -> bool:
    """True on the first ask (``last`` None) and once ``period`` seconds have passed since ``last``,
    give or take a tenth: a 10 s loop asking for 30 s reads every third run, not every fourth when a
    run comes a millisecond early."""
    return last is None or now - last >= period * SLACK

"""The one "logged once": a key logs the first time, again only after it was cleared; levels,
tracebacks, a suffix, a bound on open-ended keys, and lines attributed to their caller."""

from __future__ import annotations

import logging

from gpumon.log_once import COUNTED, LogOnce


def test_log_once_logs_again_only_after_clear(caplog) -> None:
    once = LogOnce(logging.getLogger("gpumon.test"))
    with caplog.at_level(logging.WARNING, logger="gpumon.test"):
        assert once.warning("down", "down %s", 1)
        assert not once.warning("down", "down %s", 2)
        once.clear("down")
        assert once.warning("down", "down %s", 3)
    assert [r.getMessage() for r in caplog.records] == ["down 1", "down 3"]


def test_keys_are_any_hashable_and_levels_are_the_callers(caplog) -> None:
    once = LogOnce(logging.getLogger("gpumon.test"))
    with caplog.at_level(logging.DEBUG, logger="gpumon.test"):
        assert once.log(logging.INFO, ("gpm", 0), "GPM off on GPU %d", 0)
        assert not once.log(logging.WARNING, ("gpm", 0), "again")
        assert once.error(("gpm", 1), "GPU %d", 1)
        assert once.info("i", "info")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "GPM off on GPU 0"), (logging.ERROR, "GPU 1"), (logging.INFO, "info")]
    assert ("gpm", 0) in once and ("gpm", 2) not in once
    once.clear()
    assert ("gpm", 0) not in once


def test_the_suffix_is_appended_and_the_line_names_its_caller(caplog) -> None:
    once = LogOnce(logging.getLogger("gpumon.test"), suffix=COUNTED)
    with caplog.at_level(logging.WARNING, logger="gpumon.test"):
        once.warning("k", "cannot read %s", "/x")
    (record,) = caplog.records
    assert record.getMessage() == "cannot read /x (logged once, counted every time)"
    assert record.funcName == "test_the_suffix_is_appended_and_the_line_names_its_caller"


def test_a_traceback_goes_with_the_first_line_only(caplog) -> None:
    once = LogOnce(logging.getLogger("gpumon.test"))
    with caplog.at_level(logging.ERROR, logger="gpumon.test"):
        for _ in range(2):
            try:
                raise ValueError("boom")
            except ValueError as exc:
                once.error("ValueError", "publish failed: %s", exc, exc_info=True)
    (record,) = caplog.records
    assert record.exc_info is not None and record.exc_info[0] is ValueError


def test_past_the_limit_every_key_is_forgotten(caplog) -> None:
    once = LogOnce(logging.getLogger("gpumon.test"), limit=2)
    with caplog.at_level(logging.WARNING, logger="gpumon.test"):
        for key in ("a", "b", "c", "a", "d", "a"):
            once.warning(key, key)
    # a, b, c remembered (3 > 2): d clears them first, so a is logged once more after d
    assert [r.getMessage() for r in caplog.records] == ["a", "b", "c", "d", "a"]

"""The spool's segment files, ``<dir>/seg-<16 digits>.log``, and how they are found again on open.

Segments are appended to and never rewritten. On open each unacknowledged one is checked record by
record: a torn tail on the newest (power loss mid-write) is cut off with a warning, a bad record in an
older one loses the rest of that segment (logged, counted as corrupt), and one wholly before the cursor
(acknowledged, a crash came before its deletion) is deleted."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from gpumon.sinks.spool.records import HEADER, scan

log = logging.getLogger("gpumon.sinks.spool")

SEGMENT_RE = re.compile(r"^seg-(\d{16})\.log$")


@dataclass
class Segment:
    """One segment file as the spool tracks it: its bytes and what of it is not yet acknowledged."""

    number: int
    path: str
    size: int = 0
    pending: int = 0
    """Records in this segment not yet acknowledged."""
    weight: int = 0
    """What the pending records hold, as the spool's ``weigh`` counts it (samples, rows)."""


def segment_path(directory: str, number: int) -> str:
    """``<directory>/seg-<number, 16 digits>.log``: names sort in the order segments were made."""
    return os.path.join(directory, f"seg-{number:016d}.log")


def segment_numbers(directory: str) -> list[int]:
    """The numbers of the segment files in ``directory``, oldest first."""
    return sorted(int(m.group(1)) for name in os.listdir(directory) if (m := SEGMENT_RE.match(name)))


def load(directory: str, numbers: list[int], cursor: tuple[int, int],
         weigh: Callable[[bytes], int]) -> tuple[list[Segment], tuple[int, int], int]:
    """The segments from ``cursor`` on, torn tails cut off: (segments, the cursor, corrupt segments).
    A cursor naming a segment that is gone points at the start of the nearest one there."""
    segments: list[Segment] = []
    corrupt = 0
    if numbers and (cursor[0] not in numbers):
        cursor = (numbers[0], 0) if cursor[0] < numbers[0] else (numbers[-1], 0)
    for number in numbers:
        if number < cursor[0]:  # acknowledged already; a crash came before its deletion
            unlink(segment_path(directory, number))
            continue
        path = segment_path(directory, number)
        with open(path, "rb") as fh:
            data = fh.read()
        start = cursor[1] if number == cursor[0] else 0
        if start > len(data):
            start = len(data)
        spans, good_end, bad = scan(data, start)
        if bad:
            if number == numbers[-1]:
                log.warning("spool: cutting a torn record off the end of %s (%d bytes)",
                            path, len(data) - good_end)
            else:
                log.error("spool: %s is corrupt after byte %d; the rest of it is lost", path, good_end)
                corrupt += 1
            with open(path, "r+b") as fh:
                fh.truncate(good_end)
                os.fsync(fh.fileno())
        weight = sum(weigh(data[a + HEADER.size:b]) for a, b in spans)
        segments.append(Segment(number, path, good_end, len(spans), weight))
    return segments, cursor, corrupt


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

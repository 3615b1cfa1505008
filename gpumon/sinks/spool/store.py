"""The spool itself: append on the loop's thread, read and acknowledge on the uploader's, give back
the oldest records when over the cap or on a full disk (the policy: :mod:`gpumon.sinks.spool`)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpumon.log_once import LogOnce
from gpumon.sinks.spool.cursor import DISK_FULL, CursorFile
from gpumon.sinks.spool.owner import SpoolError, lock
from gpumon.sinks.spool.records import decode, encode, read_span
from gpumon.sinks.spool.segments import Segment, fsync_dir, load, segment_numbers, segment_path, unlink

log = logging.getLogger("gpumon.sinks.spool")

MIN_SEGMENT_BYTES = 4096


@dataclass(frozen=True)
class Batch:
    """Records read from one segment, ``start``..``end`` bytes; hand it back to ``ack()``."""

    segment: int
    start: int
    end: int
    records: tuple[bytes, ...]


@dataclass(frozen=True)
class SpoolStats:
    bytes: int
    records: int
    dropped: int
    corrupt: int
    error: str = ""
    """Why the spool cannot write right now (disk full with nothing left to drop); empty when it can."""
    dropped_weight: int = 0
    """What the dropped records held, as ``weigh`` counts it: exact, counted when each is dropped."""
    cursor_error: str = ""
    """Why the read position cannot be saved right now (the directory made read-only). Records are
    still written and delivered, so this is no reason to call the sink down: only a restart would
    re-send what was delivered since."""


class Spool:
    """Append on one thread, read and acknowledge on another; all state changes under one lock.

    fsync never runs under that lock (except when a segment rolls over), so ``stats()`` and
    ``append()``, which the daemon's loop thread calls, do not wait on a slow disk."""

    def __init__(self, directory: str, max_bytes: int, segment_bytes: int | None = None,
                 weigh: Callable[[bytes], int] | None = None) -> None:
        if max_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"spool max_bytes must be at least {MIN_SEGMENT_BYTES}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(MIN_SEGMENT_BYTES, max_bytes // 8)
        self._weigh = weigh or (lambda _payload: 1)
        """What a record holds (a remote-write request's samples): kept per segment, so that a drop
        counts exactly what it lost, not an estimate from an average."""
        self._segment_limit = self.segment_bytes
        """Roll-over size; lowered after a full disk so that one drop gives back an eighth of it."""
        self._lock = threading.Lock()
        self._cursor_lock = threading.Lock()  # orders cursor-file writes; taken before _lock
        self._segments: list[Segment] = []
        self._cursor = (0, 0)
        self._fd: int | None = None
        self._dirty = False
        self._dropped = 0
        self._dropped_weight = 0
        self._reading: tuple[Batch, int] | None = None
        """The latest batch read and not yet acknowledged, with its weight. A drop of its segment leaves
        its weight to the consumer's outcome: delivered (acknowledged), or counted at the next read."""
        self._reading_dropped = False
        self._corrupt = 0
        self._error = ""
        self._full_log = LogOnce(log)
        self._cursor_file = CursorFile(directory)
        try:
            os.makedirs(directory, mode=0o750, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"cannot create spool directory {directory}: {exc.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise SpoolError(f"spool directory {directory} is not writable")
        self._owner = lock(directory)
        try:
            self._recover()
        except BaseException:
            self._release()
            raise

    # -- opening --------------------------------------------------------------------------------

    def _recover(self) -> None:
        numbers = segment_numbers(self.directory)
        cursor = self._cursor_file.read()
        self._segments, cursor, self._corrupt = load(self.directory, numbers, cursor, self._weigh)
        self._cursor = cursor if self._segments else (0, 0)
        if not self._segments:
            self._new_segment(1)
            return
        head = self._segments[0]
        if self._cursor[0] == head.number and self._cursor[1] > head.size:
            self._cursor = (head.number, head.size)  # a cut-off tail shortened the head segment
        self._open_active()
        consumed = self._pop_consumed()
        try:
            self._retire(consumed)
        except OSError as exc:  # e.g. a full disk: the next reopen finds the same segments to retire
            log.warning("spool: cannot retire acknowledged segments in %s: %s", self.directory, exc)

    def _open_active(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def _new_segment(self, number: int) -> None:
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        seg = Segment(number, segment_path(self.directory, number))
        fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._segments.append(seg)
        fsync_dir(self.directory)
        if len(self._segments) == 1 and self._cursor[0] < number:
            self._cursor = (number, 0)

    # -- producer -------------------------------------------------------------------------------

    def append(self, payloads: Iterable[bytes]) -> int:
        """Write records; return how many. Survives the process dying once this returns."""
        payloads = list(payloads)
        blob, count = encode(payloads)
        if not count:
            return 0
        weight = sum(self._weigh(payload) for payload in payloads)
        with self._lock:
            active = self._segments[-1]
            if active.size and active.size + len(blob) > self._segment_limit:
                self._new_segment(active.number + 1)
            made_room = self._ensure_room(blob, count, weight)
            gone = self._pop_consumed() + self._enforce_cap()
            written = count if not self._error else 0
        for path in gone:
            unlink(path)
        if gone or made_room:
            try:
                self._persist_cursor()
            except OSError as exc:  # the records are written; a reopen derives this cursor anyway
                log.warning("spool: cannot write the cursor in %s: %s", self.directory, exc)
        return written

    def _write(self, fd: int, data: bytes) -> int:
        """The spool's one write to a segment (a seam: tests give it a disk that fills up)."""
        return os.write(fd, data)

    def _write_active(self, blob: bytes, count: int, weight: int) -> None:
        """Append ``blob`` to the active segment (lock held); a failed write leaves no torn bytes."""
        active = self._segments[-1]
        assert self._fd is not None
        written = 0
        try:
            while written < len(blob):
                written += self._write(self._fd, blob[written:])
        except OSError:
            if written:
                os.ftruncate(self._fd, active.size)
            raise
        active.size += len(blob)
        active.pending += count
        active.weight += weight
        self._dirty = True

    def _ensure_room(self, blob: bytes, count: int, weight: int) -> bool:
        """Write the records, giving back the oldest of the spool while the disk is full (lock held).

        Returns whether segments were deleted (the cursor moved). When nothing is left to give back,
        the new records are dropped and counted, and ``_error`` says why until a write succeeds."""
        made_room = False
        while True:
            try:
                self._write_active(blob, count, weight)
            except OSError as exc:
                if exc.errno not in DISK_FULL:
                    raise
                if self._make_room(exc):
                    made_room = True
                    continue
                self._dropped += count
                self._dropped_weight += weight
                self._error = f"cannot write to {self.directory}: {exc.strerror}; new rows are dropped"
                self._full_log.warning("drop", "spool: %s (%d so far)", self._error, self._dropped)
                return made_room
            if self._error:
                log.info("spool: %s is writable again", self.directory)
            self._error = ""
            self._full_log.clear("drop")
            return made_room

    def _make_room(self, exc: OSError) -> bool:
        """Free disk space after ENOSPC (lock held): retire what was acknowledged, else drop the oldest
        unsent segment. False when the spool holds nothing more to give back."""
        held = sum(s.size for s in self._segments)
        self._segment_limit = min(self._segment_limit, max(MIN_SEGMENT_BYTES, held // 8))
        active = self._segments[-1]
        if len(self._segments) == 1:
            if not active.size:
                return False
            try:
                self._new_segment(active.number + 1)
            except OSError:
                return False
        paths = self._pop_consumed()
        if not paths:
            paths = [self._drop_oldest()]
            self._full_log.warning("full", "spool: disk full in %s (%s): dropping the oldest records "
                                   "first, counted in dropped", self.directory, exc.strerror)
        for path in paths:
            unlink(path)
        return True

    def _drop_oldest(self) -> str:
        """Give up on the oldest segment (lock held, a newer one exists); returns its path to unlink."""
        oldest = self._segments.pop(0)
        self._dropped += oldest.pending
        self._dropped_weight += oldest.weight
        if self._reading is not None and self._reading[0].segment == oldest.number and not self._reading_dropped:
            self._dropped_weight -= self._reading[1]  # in flight: its sending decides (see ``_reading``)
            self._reading_dropped = True
        self._cursor = (self._segments[0].number, 0)
        return oldest.path

    def _enforce_cap(self) -> list[str]:
        """Drop the oldest segments over the cap (lock held); returns their paths to unlink."""
        dropped = []
        while self._pending_bytes() > self.max_bytes:
            if len(self._segments) == 1:
                self._new_segment(self._segments[-1].number + 1)
            consumed = self._pop_consumed()  # holds no unsent record: gives nothing back, loses nothing
            if consumed:
                dropped += consumed
                continue
            pending = self._segments[0].pending
            dropped.append(self._drop_oldest())
            log.warning("spool full (%d bytes max): dropped %d oldest records", self.max_bytes, pending)
        return dropped

    def _pop_consumed(self) -> list[str]:
        """Take off the head segments read and acknowledged to their end while a newer one exists
        (lock held); the cursor moves to the next segment's start. Returns the paths to unlink."""
        paths = []
        while len(self._segments) > 1:
            head = self._segments[0]
            offset = self._cursor[1] if self._cursor[0] == head.number else 0
            if offset < head.size:
                break
            self._segments.pop(0)
            self._cursor = (self._segments[0].number, 0)
            paths.append(head.path)
        return paths

    def _retire(self, paths: list[str]) -> None:
        """Persist the cursor past retired segments, then delete them (lock not held)."""
        if not paths:
            return
        try:
            self._persist_cursor()  # before the unlink: a crash in between re-reads nothing twice
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            # Deleting first is safe too: on reopen a cursor naming a deleted segment means "the start
            # of the next one", which is where this one points. And it gives the disk room back.
            for path in paths:
                unlink(path)
            self._persist_cursor()
        for path in paths:
            unlink(path)
        fsync_dir(self.directory)

    def _pending_bytes(self) -> int:
        total = sum(s.size for s in self._segments)
        if self._segments and self._segments[0].number == self._cursor[0]:
            total -= self._cursor[1]
        return total

    def sync(self) -> None:
        """fsync what was appended (uploader thread): survives power loss from here on."""
        with self._lock:
            if self._fd is None or not self._dirty:
                return
            fd = os.dup(self._fd)  # a roll-over may close the active fd while this one syncs
            self._dirty = False
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- consumer -------------------------------------------------------------------------------

    def read(self, max_records: int = 5000, max_bytes: int = 4 << 20) -> Batch | None:
        """The next unacknowledged records (from one segment), or None when there are none."""
        with self._lock:
            self._forget_reading()
            consumed = self._pop_consumed()
        self._retire(consumed)
        with self._lock:
            if not self._segments:
                return None
            seg = self._segments[0]
            number, offset = self._cursor
            if seg.number != number:
                number, offset = seg.number, 0
            end = seg.size
            path = seg.path
            if offset >= end:
                return None
        try:
            data = read_span(path, offset, end, max_bytes)
        except FileNotFoundError:  # dropped by the producer meanwhile; the caller reads again
            return None
        records, pos = decode(data, max_records)
        if not records:
            return None
        batch = Batch(number, offset, offset + pos, tuple(records))
        weight = sum(self._weigh(record) for record in records)
        with self._lock:
            self._reading, self._reading_dropped = (batch, weight), False
            if all(seg.number != number for seg in self._segments):  # dropped while being read
                self._dropped_weight -= weight
                self._reading_dropped = True
        return batch

    def _forget_reading(self) -> None:
        """The batch in flight is read no more (lock held): dropped meanwhile and never acknowledged,
        it was lost, and is counted now."""
        if self._reading is not None and self._reading_dropped:
            self._dropped_weight += self._reading[1]
        self._reading, self._reading_dropped = None, False

    def ack(self, batch: Batch) -> None:
        """Mark a batch delivered (or given up on). Stale batches (already dropped) are ignored."""
        with self._lock:
            if self._reading is not None and self._reading[0] is batch:
                self._reading, self._reading_dropped = None, False  # delivered or given up by the caller
            if not self._segments or self._segments[0].number != batch.segment:
                return
            seg = self._segments[0]
            current = self._cursor[1] if self._cursor[0] == seg.number else 0
            if current != batch.start:
                return
            seg.pending -= len(batch.records)
            seg.weight -= sum(self._weigh(record) for record in batch.records)
            self._cursor = (seg.number, batch.end)
            finished = self._pop_consumed()
            if not any(s.pending for s in self._segments):
                self._full_log.clear("full")  # the backlog is gone: a later full disk is logged again
        try:
            if finished:
                self._retire(finished)
            else:
                self._persist_cursor()
        except OSError as exc:  # delivered all the same: the position lives on in memory
            self._full_log.warning("cursor", "spool: cannot save the read position in %s (%s): delivery goes "
                                   "on; a restart before it can be saved re-sends what was delivered since",
                                   self.directory, exc.strerror or exc)
            return
        if "cursor" in self._full_log:
            self._full_log.clear("cursor")
            log.info("spool: the read position in %s can be saved again", self.directory)

    def _persist_cursor(self) -> None:
        """Write the current cursor durably, outside the state lock; in place when the disk is full."""
        with self._cursor_lock:
            with self._lock:
                segment, offset = self._cursor
            self._cursor_file.write(segment, offset)

    # -- state ----------------------------------------------------------------------------------

    def stats(self) -> SpoolStats:
        with self._lock:
            return SpoolStats(self._pending_bytes(), sum(s.pending for s in self._segments),
                              self._dropped, self._corrupt, self._error,
                              dropped_weight=self._dropped_weight, cursor_error=self._cursor_file.error)

    def pending(self) -> int:
        """Records not yet acknowledged: what the uploader's drain at stop waits for."""
        return self.stats().records

    def due_in(self) -> float | None:
        """A record is due as soon as it is appended (the appender wakes the uploader)."""
        return None

    def _release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            os.close(owner)  # the kernel drops the flock with the last descriptor

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                if self._dirty:
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
            self._release()


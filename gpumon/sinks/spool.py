"""A bounded, crash-safe, on-disk FIFO of opaque records: what a sink writes before it uploads.

Layout: ``<dir>/seg-<16 digits>.log`` segment files, appended to and never rewritten, and
``<dir>/cursor`` (JSON ``{"segment": N, "offset": B}``, replaced atomically) marking what the
consumer has acknowledged. A record on disk is ``>II`` (payload length, CRC-32 of the payload)
followed by the payload, so a torn tail (power loss mid-write) is recognised and cut off on reopen
instead of being mistaken for data.

Durability policy, and why:
- ``append()`` hands the bytes to the kernel with one ``os.write`` on an ``O_APPEND`` descriptor.
  Once it returns, the records survive the *process* dying (kill -9, OOM): the page cache belongs
  to the kernel. This is the failure that happens daily, and it costs the caller no disk wait,
  which matters because the caller is the collector loop.
- ``sync()`` (called by the uploader thread, not the loop) fsyncs the active segment, so a power
  loss or kernel panic loses at most what was appended since the uploader last woke (the sink
  wakes it on every append, so normally nothing). Segment creation and deletion fsync the
  directory; the cursor is written to a temporary file, fsynced and renamed.
- Delivery is at-least-once: a crash between an upload and its ``ack()`` re-sends that batch.

Bounded: when the unacknowledged bytes pass ``max_bytes`` the *oldest* whole segment is deleted
and its unacknowledged records are counted in ``dropped``; segments are ``max_bytes / 8`` so one
drop gives back at most an eighth of the spool.

A full disk (ENOSPC, EDQUOT) is the spool's own problem, solved in place: the torn bytes are cut off,
a fully acknowledged active segment is replaced by a fresh one so it can be deleted, otherwise the
*oldest* segment holding unsent records is dropped (counted in ``dropped``), and the write is tried
again; from then on segments are an eighth of what the disk held, so the next drop gives back less.
Only when the spool holds nothing more to give are the new records dropped (counted) and ``stats()``
carries the error until a write succeeds. The cursor is replaced atomically when the disk has room and
rewritten in place (one sector, never a new block) when it has none.

A segment read and acknowledged to its end is retired (cursor moved to the next segment, file
deleted) as soon as a newer segment exists: on acknowledgement, when the producer starts a segment,
on ``read()`` and on reopen. Otherwise the cursor would stay at the end of a finished segment and
the consumer would never look at the next one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpumon.log_once import LogOnce

log = logging.getLogger("gpumon.sinks.spool")

_HEADER = struct.Struct(">II")
_SEGMENT_RE = re.compile(r"^seg-(\d{16})\.log$")
LOCK_FILE = "spool.lock"
"""Held (``flock``) by the one process that owns the spool: two daemons given one ``spool_dir`` would
send every record twice and retire each other's segments. The state directory's own lock covers the
default spool directories; this one covers a ``spool_dir`` named explicitly."""
MAX_RECORD_BYTES = 16 << 20
"""A record larger than this is refused: a length field beyond it means corruption on read."""
MIN_SEGMENT_BYTES = 4096
_CURSOR_BYTES = 64
"""The cursor JSON is padded to this size, so rewriting it in place on a full disk needs no new block."""
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class SpoolError(Exception):
    """The spool directory cannot be used (permissions, not a directory)."""


@dataclass
class _Segment:
    number: int
    path: str
    size: int = 0
    pending: int = 0
    """Records in this segment not yet acknowledged."""
    weight: int = 0
    """What the pending records hold, as the spool's ``weigh`` counts it (samples, rows)."""


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


def _scan(data: bytes, offset: int = 0) -> tuple[list[tuple[int, int]], int, bool]:
    """Walk records from ``offset``: ([(start, end)], last good end, whether the rest was bad)."""
    spans: list[tuple[int, int]] = []
    pos = offset
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            return spans, pos, True
        if zlib.crc32(data[pos + _HEADER.size:end]) != crc:
            return spans, pos, True
        spans.append((pos, end))
        pos = end
    return spans, pos, pos != len(data)


def _encode(payloads: Iterable[bytes]) -> tuple[bytes, int]:
    """Records framed for disk (length, CRC-32, payload) and how many there are."""
    parts = []
    count = 0
    for payload in payloads:
        if len(payload) > MAX_RECORD_BYTES:
            raise ValueError(f"spool record of {len(payload)} bytes is over the limit")
        parts.append(_HEADER.pack(len(payload), zlib.crc32(payload)))
        parts.append(payload)
        count += 1
    return b"".join(parts), count


def _fsync_dir(path: str) -> None:
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


class Spool:
    """Append on one thread, read and acknowledge on another; all state changes under one lock.

    fsync never runs under that lock (except when a segment rolls over), so ``stats()`` and
    ``append()``, which the daemon's loop thread calls, do not wait on a slow disk."""

    def __init__(self, directory: str, max_bytes: int, segment_bytes: int | None = None,
                 weigh: Callable[[bytes], int] | None = None) -> None:
        if max_bytes < 4096:
            raise ValueError("spool max_bytes must be at least 4096")
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
        self._segments: list[_Segment] = []
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
        self._cursor_error = ""
        self._full_log = LogOnce(log)
        try:
            os.makedirs(directory, mode=0o750, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"cannot create spool directory {directory}: {exc.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise SpoolError(f"spool directory {directory} is not writable")
        self._owner = _lock(directory)
        try:
            self._recover()
        except BaseException:
            self._release()
            raise

    # -- opening --------------------------------------------------------------------------------

    def _recover(self) -> None:
        numbers = sorted(int(m.group(1)) for name in os.listdir(self.directory)
                         if (m := _SEGMENT_RE.match(name)))
        cursor = self._read_cursor()
        if numbers and (cursor[0] not in numbers):
            cursor = (numbers[0], 0) if cursor[0] < numbers[0] else (numbers[-1], 0)
        for number in numbers:
            if number < cursor[0]:  # acknowledged already; a crash came before its deletion
                self._unlink(self._path(number))
                continue
            path = self._path(number)
            with open(path, "rb") as fh:
                data = fh.read()
            start = cursor[1] if number == cursor[0] else 0
            if start > len(data):
                start = len(data)
            spans, good_end, bad = _scan(data, start)
            if bad:
                if number == numbers[-1]:
                    log.warning("spool: cutting a torn record off the end of %s (%d bytes)",
                                path, len(data) - good_end)
                else:
                    log.error("spool: %s is corrupt after byte %d; the rest of it is lost", path, good_end)
                    self._corrupt += 1
                with open(path, "r+b") as fh:
                    fh.truncate(good_end)
                    os.fsync(fh.fileno())
            weight = sum(self._weigh(data[a + _HEADER.size:b]) for a, b in spans)
            self._segments.append(_Segment(number, path, good_end, len(spans), weight))
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

    def _read_cursor(self) -> tuple[int, int]:
        try:
            with open(os.path.join(self.directory, "cursor"), encoding="utf-8") as fh:
                doc = json.load(fh)
            return int(doc["segment"]), int(doc["offset"])
        except FileNotFoundError:
            return (0, 0)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("spool: unreadable cursor (%s); re-sending from the oldest segment", exc)
            return (0, 0)

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, f"seg-{number:016d}.log")

    def _open_active(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def _new_segment(self, number: int) -> None:
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        seg = _Segment(number, self._path(number))
        fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._segments.append(seg)
        _fsync_dir(self.directory)
        if len(self._segments) == 1 and self._cursor[0] < number:
            self._cursor = (number, 0)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    # -- producer -------------------------------------------------------------------------------

    def append(self, payloads: Iterable[bytes]) -> int:
        """Write records; return how many. Survives the process dying once this returns."""
        payloads = list(payloads)
        blob, count = _encode(payloads)
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
            self._unlink(path)
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
                if exc.errno not in _DISK_FULL:
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
            self._unlink(path)
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
            if exc.errno not in _DISK_FULL:
                raise
            # Deleting first is safe too: on reopen a cursor naming a deleted segment means "the start
            # of the next one", which is where this one points. And it gives the disk room back.
            for path in paths:
                self._unlink(path)
            self._persist_cursor()
        for path in paths:
            self._unlink(path)
        _fsync_dir(self.directory)

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
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(min(end - offset, max_bytes))
                if len(data) >= _HEADER.size:  # a first record bigger than max_bytes still goes
                    first = _HEADER.size + _HEADER.unpack_from(data, 0)[0]
                    if first > len(data) and first <= min(end - offset, MAX_RECORD_BYTES + _HEADER.size):
                        data += fh.read(first - len(data))
        except FileNotFoundError:  # dropped by the producer meanwhile; the caller reads again
            return None
        records: list[bytes] = []
        pos = 0
        while pos + _HEADER.size <= len(data) and len(records) < max_records:
            length, crc = _HEADER.unpack_from(data, pos)
            stop = pos + _HEADER.size + length
            if stop > len(data):
                break
            payload = data[pos + _HEADER.size:stop]
            if zlib.crc32(payload) != crc:  # written by us and checked on open: disk corruption
                break
            records.append(payload)
            pos = stop
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
            text = json.dumps({"segment": segment, "offset": offset}).ljust(_CURSOR_BYTES).encode()
            final = os.path.join(self.directory, "cursor")
            try:
                self._replace_cursor(final, text)
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    self._cursor_error = f"cannot write the cursor in {self.directory}: {exc.strerror}"
                    raise
                self._overwrite_cursor(final, text, exc)
            self._cursor_error = ""

    @staticmethod
    def _replace_cursor(final: str, text: bytes) -> None:
        tmp = final + ".tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            try:
                os.unlink(tmp)  # a half-written temporary file would only hold disk space
            except OSError:
                pass
            raise
        os.replace(tmp, final)

    def _overwrite_cursor(self, final: str, text: bytes, full: OSError) -> None:
        """Rewrite the existing cursor file in place: one 64-byte write inside a block it already owns."""
        try:
            fd = os.open(final, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self._cursor_error = f"cannot write the cursor in {self.directory}: {full.strerror}"
            raise full from None
        try:
            os.pwrite(fd, text, 0)
            os.fsync(fd)
        except OSError as exc:
            self._cursor_error = f"cannot write the cursor in {self.directory}: {exc.strerror}"
            raise
        finally:
            os.close(fd)

    # -- state ----------------------------------------------------------------------------------

    def stats(self) -> SpoolStats:
        with self._lock:
            return SpoolStats(self._pending_bytes(), sum(s.pending for s in self._segments),
                              self._dropped, self._corrupt, self._error,
                              dropped_weight=self._dropped_weight, cursor_error=self._cursor_error)

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


def _lock(directory: str) -> int | None:
    """Lock ``directory`` for this process (the descriptor holding the lock), or raise SpoolError
    naming the process that holds it. A lock file that cannot be made (a full disk) locks nothing
    rather than stopping the sink; the state directory's lock still covers the default spools."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        log.warning("spool: cannot create %s (%s): the spool is used without its lock", path,
                    exc.strerror or exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise SpoolError(f"spool directory {directory} is in use by another gpumon ({who}; lock {path}): "
                             "give each gpumon a spool_dir of its own") from None
        raise SpoolError(f"cannot lock spool directory {directory}: {exc.strerror or exc}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the PID is only for the message a second process prints
    return fd

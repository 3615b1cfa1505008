"""The kernel log as ``/dev/kmsg`` hands it out: one record per ``read()``, resumable by sequence number.

The ABI (linux Documentation/ABI/testing/dev-kmsg): each read returns exactly one record,
``prio,seq,usec,flags[,more];message\\n`` followed by zero or more dictionary lines that start with a
space (`` KEY=VALUE``); ``prio`` is ``facility << 3 | level``; non-printable bytes in the message are
escaped as ``\\xNN``; fields after ``flags`` may be added by future kernels and are ignored. A reader
that fell behind the ring buffer gets ``EPIPE`` once and then the oldest record still there: the gap in
``seq`` is the number of records lost. ``lseek`` takes ``SEEK_SET`` 0 (the oldest record),
``SEEK_END`` (after the newest) and ``SEEK_DATA`` (after the last ``dmesg --clear``).

This module knows that format and nothing of what the messages mean (:mod:`gpumon.sources.driver_log`).
Reading goes through a file-descriptor seam (``open_fd``, ``read``, ``lseek``) so the same code reads
the real device and, in tests, a ``SOCK_SEQPACKET`` pair that keeps record boundaries as the kernel does.
A regular file holding records as the device hands them out, one after another (a simulated host's
kernel log, :mod:`gpumon.simulate.kmsg`), is read one record per read as well (:class:`RecordFile`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

DEFAULT_PATH = "/dev/kmsg"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
READ_SIZE = 8192
"""CONSOLE_EXT_LOG_MAX: the kernel's largest formatted record; a smaller buffer gets EINVAL."""

FIRST_START = {"end": os.SEEK_END, "cleared": getattr(os, "SEEK_DATA", 3), "all": os.SEEK_SET}
"""Where a reader with no saved position starts: after the newest record, after the last
``dmesg --clear``, or at the oldest record still in the buffer."""

_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_HEADER = re.compile(rb"[0-9]{1,4},[0-9]{1,20},[0-9]{1,20},[^,;]*[^;]*;")
"""``prio,seq,usec,flags[,more];``: the header holds no ';', so the first one ends it (the message
may hold more)."""
_RECORD = re.compile(rb"([0-9]{1,4}),([0-9]{1,20}),([0-9]{1,20}),([^,;]*)[^;]*;([^\n]*)\n(.*\n)?\Z", re.DOTALL)
"""A whole record: header, message line, then dictionary lines (each ending in a newline)."""


class Garbled(ValueError):
    """A record that is not in the dev-kmsg format (truncated, binary junk)."""


class Record(NamedTuple):
    """One kernel log record (immutable; a named tuple because one is made per kernel-log line)."""

    seq: int
    level: int
    facility: int
    usec: int
    """Microseconds since boot on the kernel's log clock (CLOCK_MONOTONIC-like: stops in suspend)."""
    flags: str
    message: str
    """The message as the kernel escaped it (``\\xNN`` for a non-printable byte, a backslash included):
    a newline in it stays ``\\x0a``, so the text holds no control character and can be matched and
    logged as it is; :func:`unescape` a value cut out of it when its real bytes are wanted."""
    fields: dict[str, str]
    """Dictionary lines, e.g. ``SUBSYSTEM=pci``, ``DEVICE=+pci:0000:3b:00.0``."""


def unescape(text: str) -> str:
    """Undo the kernel's ``\\xNN`` escaping of non-printable bytes."""
    if "\\x" not in text:
        return text
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)


def parse(data: bytes) -> Record:
    """One record as read from /dev/kmsg; raises :class:`Garbled`."""
    m = _RECORD.match(data)
    if m is None:
        if _HEADER.match(data) is None:
            raise Garbled(f"no dev-kmsg header in {data[:60]!r}")
        raise Garbled(f"truncated record {data[:60]!r}")
    prio, seq, usec, flags, body, extra = m.groups()
    message = body.decode("utf-8", "replace")  # kept escaped: what is matched, shown and logged
    fields: dict[str, str] = {}
    if extra:
        for line in extra[:-1].decode("utf-8", "replace").split("\n"):
            if not line.startswith(" ") or "=" not in line:
                raise Garbled(f"bad dictionary line {line[:60]!r}")
            key, _, value = line[1:].partition("=")
            fields[key] = unescape(value)
    level = int(prio)
    return Record(int(seq), level & 7, level >> 3, int(usec), flags.decode("ascii", "replace"), message, fields)


def boot_id(path: str = BOOT_ID_PATH) -> str:
    """This boot's id ("" when unreadable): what was saved in another boot (a kernel-log position, whose
    sequence numbers restart at boot; a sticky health verdict, which a reboot clears) is set aside."""
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


@dataclass
class Batch:
    """What one :meth:`KmsgReader.read` found."""

    records: list[Record] = field(default_factory=list)
    lost: int = 0
    """Records overwritten before they were read (gaps in ``seq``, across restarts too)."""
    overruns: int = 0
    """EPIPE answers: how many times the reader fell behind the ring buffer."""
    garbled: list[bytes] = field(default_factory=list)
    more: bool = False
    """The per-call record limit was reached before the log was drained."""


class KmsgReader:
    """Non-blocking reader that starts at the end the first time and resumes after the last record
    it saw (same boot) across restarts, via a small JSON file."""

    def __init__(self, path: str = DEFAULT_PATH, state_file: str | None = None, first_start: str = "end",
                 boot_id_path: str = BOOT_ID_PATH, open_fd: Callable[[str], int] | None = None,
                 read: Callable[[int, int], bytes] = os.read,
                 lseek: Callable[[int, int, int], int] = os.lseek) -> None:
        if first_start not in FIRST_START:
            raise ValueError(f"first_start must be one of {', '.join(FIRST_START)}")
        self.path = path
        self.state_file = state_file
        self.first_start = first_start
        self.boot = boot_id(boot_id_path)
        self._open_fd = open_fd or _open_nonblocking
        self._read = read
        self._lseek = lseek
        self.fd: int | None = None
        self._file: RecordFile | None = None
        self.last_seq: int | None = None
        """Sequence number of the last record handed out (or skipped as already seen)."""
        self._resume_after: int | None = None
        self._carried: int | None = None

    def resume_after(self, seq: int) -> None:
        """Start after ``seq`` rather than at the saved position: a reload's new reader takes the
        place of the one it replaces, which may be ahead of what that one saved."""
        self._carried = self.last_seq = seq

    def open(self) -> None:
        """Open and position; raises OSError (EACCES/EPERM without root or CAP_SYSLOG)."""
        fd = self._open_fd(self.path)
        saved = self._carried if self._carried is not None else self._load()
        try:
            self._file = RecordFile() if stat.S_ISREG(os.fstat(fd).st_mode) else None
            if saved is not None:
                self._resume_after = self.last_seq = saved  # the default position is the oldest record
            elif self.first_start != "all":
                (self._file.lseek if self._file else self._lseek)(fd, 0, FIRST_START[self.first_start])
        except OSError:
            os.close(fd)
            raise
        self.fd = fd

    def _load(self) -> int | None:
        """The saved sequence number when it belongs to this boot, else None."""
        if not self.state_file:
            return None
        try:
            with open(self.state_file, encoding="utf-8") as fh:
                state = json.load(fh)
            if self.boot and state.get("boot_id") == self.boot:
                return int(state["seq"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None

    def save(self, seq: int | None = None) -> None:
        """Persist the position: ``seq`` (default the last record read) is the last record a restart
        skips. Atomic: a crash leaves the old or the new file."""
        seq = self.last_seq if seq is None else seq
        if not self.state_file or seq is None:
            return
        # a temporary name of its own: two processes saving at once never write into one file
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.state_file)}.",
                                   dir=os.path.dirname(self.state_file) or ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"boot_id": self.boot, "seq": seq}, fh)
            os.replace(tmp, self.state_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, limit: int = 100_000) -> Batch:
        """Every record available now (at most ``limit``), without blocking."""
        if self.fd is None:
            self.open()
        batch = Batch()
        read = self._file.read if self._file else self._read
        while len(batch.records) < limit:
            try:
                data = read(self.fd, READ_SIZE)  # type: ignore[arg-type]
            except BlockingIOError:
                return batch
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten: the next read returns the oldest left
                    batch.overruns += 1
                    continue
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not data:
                return batch
            self._take(data, batch)
        batch.more = True
        return batch

    def _take(self, data: bytes, batch: Batch) -> None:
        try:
            record = parse(data)
        except Garbled:
            batch.garbled.append(data)
            return
        if self._resume_after is not None:
            if record.seq <= self._resume_after:
                return  # seen before the restart
            self._resume_after = None
        if self.last_seq is not None and record.seq > self.last_seq + 1:
            batch.lost += record.seq - self.last_seq - 1
        self.last_seq = record.seq
        batch.records.append(record)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _open_nonblocking(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


class RecordFile:
    """Reads a regular file of dev-kmsg records as the device hands them out: one record per read
    (its message line and the dictionary lines after it, which start with a space), ``EAGAIN`` once
    drained (the device's answer to a non-blocking reader), records appended later on the next read.

    ``lseek``: ``SEEK_END`` goes past the last record, ``SEEK_SET`` and ``SEEK_DATA`` to the first (a
    file has no ``dmesg --clear``). A record whose last line is not written yet waits for it."""

    CHUNK = 65536

    def __init__(self) -> None:
        self._offset = 0
        """File offset of the first byte of ``_buffer``."""
        self._buffer = b""

    def lseek(self, fd: int, offset: int, whence: int) -> int:
        self._offset = os.fstat(fd).st_size if whence == os.SEEK_END else 0
        self._buffer = b""
        return self._offset

    def read(self, fd: int, size: int) -> bytes:
        while True:
            end = self._record_end(final=False)
            if end is None:
                chunk = os.pread(fd, self.CHUNK, self._offset + len(self._buffer))
                if chunk:
                    self._buffer += chunk
                    continue
                end = self._record_end(final=True)
                if end is None:
                    raise BlockingIOError(errno.EAGAIN, "no new record")
            record, self._buffer = self._buffer[:end], self._buffer[end:]
            self._offset += end
            return record

    def _record_end(self, final: bool) -> int | None:
        """Where the first whole record in the buffer ends; ``final``: nothing follows the buffer
        (so a record ending it is whole)."""
        buf = self._buffer
        end = buf.find(b"\n")
        while end >= 0:
            if end + 1 == len(buf):
                return end + 1 if final else None
            if buf[end + 1:end + 2] != b" ":
                return end + 1
            end = buf.find(b"\n", end + 1)
        return None

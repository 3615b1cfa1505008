"""The consumer's read position, ``<dir>/cursor``: JSON ``{"segment": N, "offset": B}``.

Replaced atomically (temporary file, fsync, rename) when the disk has room; rewritten in place when
it has none: the JSON is padded to ``CURSOR_BYTES``, one write inside a block the file already owns."""

from __future__ import annotations

import errno
import json
import logging
import os

log = logging.getLogger("gpumon.sinks.spool")

CURSOR_BYTES = 64
"""The cursor JSON is padded to this size, so rewriting it in place on a full disk needs no new block."""
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class CursorFile:
    """Reads and writes one spool's cursor file; ``error`` says why the last write failed (empty: it
    did not). The caller orders writes (one at a time)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, "cursor")
        self.error = ""
        """Why the read position cannot be saved right now (the directory made read-only)."""

    def read(self) -> tuple[int, int]:
        """(segment, offset); (0, 0), the oldest segment's start, when missing or unreadable."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                doc = json.load(fh)
            return int(doc["segment"]), int(doc["offset"])
        except FileNotFoundError:
            return (0, 0)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("spool: unreadable cursor (%s); re-sending from the oldest segment", exc)
            return (0, 0)

    def write(self, segment: int, offset: int) -> None:
        """Write the cursor durably; in place when the disk is full."""
        text = json.dumps({"segment": segment, "offset": offset}).ljust(CURSOR_BYTES).encode()
        try:
            _replace(self.path, text)
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                self.error = f"cannot write the cursor in {self.directory}: {exc.strerror}"
                raise
            self._overwrite(text, exc)
        self.error = ""

    def _overwrite(self, text: bytes, full: OSError) -> None:
        """Rewrite the existing cursor file in place: one 64-byte write inside a block it already owns."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self.error = f"cannot write the cursor in {self.directory}: {full.strerror}"
            raise full from None
        try:
            os.pwrite(fd, text, 0)
            os.fsync(fd)
        except OSError as exc:
            self.error = f"cannot write the cursor in {self.directory}: {exc.strerror}"
            raise
        finally:
            os.close(fd)


def _replace(final: str, text: bytes) -> None:
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

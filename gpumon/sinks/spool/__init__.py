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

Modules: :mod:`.store` (the :class:`Spool`: append, read, acknowledge, the cap and the full disk),
:mod:`.records` (the record framing), :mod:`.segments` (segment files, found and checked again on
open), :mod:`.cursor` (the read position's file) and :mod:`.owner` (one process per directory).

A segment read and acknowledged to its end is retired (cursor moved to the next segment, file
deleted) as soon as a newer segment exists: on acknowledgement, when the producer starts a segment,
on ``read()`` and on reopen. Otherwise the cursor would stay at the end of a finished segment and
the consumer would never look at the next one.
"""

from __future__ import annotations

from gpumon.sinks.spool.owner import LOCK_FILE, SpoolError
from gpumon.sinks.spool.records import MAX_RECORD_BYTES
from gpumon.sinks.spool.store import MIN_SEGMENT_BYTES, Batch, Spool, SpoolStats

__all__ = ["LOCK_FILE", "MAX_RECORD_BYTES", "MIN_SEGMENT_BYTES", "Batch", "Spool", "SpoolError", "SpoolStats"]

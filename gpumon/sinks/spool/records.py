"""The spool's on-disk record: ``>II`` (payload length, CRC-32 of the payload) then the payload.

The checksum lets a torn tail (power loss mid-write) be recognised and cut off on reopen instead of
being mistaken for data; a length beyond ``MAX_RECORD_BYTES`` means corruption."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

HEADER = struct.Struct(">II")
MAX_RECORD_BYTES = 16 << 20
"""A record larger than this is refused: a length field beyond it means corruption on read."""


def scan(data: bytes, offset: int = 0) -> tuple[list[tuple[int, int]], int, bool]:
    """Walk records from ``offset``: ([(start, end)], last good end, whether the rest was bad)."""
    spans: list[tuple[int, int]] = []
    pos = offset
    while pos + HEADER.size <= len(data):
        length, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            return spans, pos, True
        if zlib.crc32(data[pos + HEADER.size:end]) != crc:
            return spans, pos, True
        spans.append((pos, end))
        pos = end
    return spans, pos, pos != len(data)


def encode(payloads: Iterable[bytes]) -> tuple[bytes, int]:
    """Records framed for disk (length, CRC-32, payload) and how many there are."""
    parts = []
    count = 0
    for payload in payloads:
        if len(payload) > MAX_RECORD_BYTES:
            raise ValueError(f"spool record of {len(payload)} bytes is over the limit")
        parts.append(HEADER.pack(len(payload), zlib.crc32(payload)))
        parts.append(payload)
        count += 1
    return b"".join(parts), count


def read_span(path: str, offset: int, end: int, max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of ``path`` from ``offset`` (never past ``end``), or more when the first
    record alone is bigger: that one still goes. FileNotFoundError when the segment is gone."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read(min(end - offset, max_bytes))
        if len(data) >= HEADER.size:  # a first record bigger than max_bytes still goes
            first = HEADER.size + HEADER.unpack_from(data, 0)[0]
            if first > len(data) and first <= min(end - offset, MAX_RECORD_BYTES + HEADER.size):
                data += fh.read(first - len(data))
    return data


def decode(data: bytes, max_records: int) -> tuple[list[bytes], int]:
    """The whole records at the start of ``data`` (at most ``max_records``) and the bytes they span.
    A bad checksum stops there: the records were written by the spool and checked on open, so it is
    disk corruption."""
    records: list[bytes] = []
    pos = 0
    while pos + HEADER.size <= len(data) and len(records) < max_records:
        length, crc = HEADER.unpack_from(data, pos)
        stop = pos + HEADER.size + length
        if stop > len(data):
            break
        payload = data[pos + HEADER.size:stop]
        if zlib.crc32(payload) != crc:  # written by us and checked on open: disk corruption
            break
        records.append(payload)
        pos = stop
    return records, pos

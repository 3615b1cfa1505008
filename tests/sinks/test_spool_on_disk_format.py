"""The spool's bytes on disk are a contract with the previous release: a spool left by it is read back
after an upgrade, and a spool written now holds the same bytes. The format is the one
``gpumon.sinks.spool`` documents: ``seg-<16 digits>.log`` files of records, each ``>II`` (payload
length, CRC-32 of the payload) then the payload, and ``cursor``, JSON ``{"segment": N, "offset": B}``
padded with spaces to 64 bytes. The expected bytes are built here from that description, not with the
spool's own framing code."""

from __future__ import annotations

import json
import struct
import zlib

from gpumon.sinks.spool import Spool


def record(payload: bytes) -> bytes:
    return struct.pack(">II", len(payload), zlib.crc32(payload)) + payload


def cursor(segment: int, offset: int) -> bytes:
    return json.dumps({"segment": segment, "offset": offset}).ljust(64).encode()


def test_a_spool_writes_the_documented_records_and_cursor(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    assert spool.append([b'{"s":"gpu","r":{}}', b""]) == 2
    first = record(b'{"s":"gpu","r":{}}')
    assert (tmp_path / "seg-0000000000000001.log").read_bytes() == first + record(b"")

    batch = spool.read(max_records=1)
    assert batch is not None and batch.records == (b'{"s":"gpu","r":{}}',)
    spool.ack(batch)
    assert (tmp_path / "cursor").read_bytes() == cursor(1, len(first))
    spool.close()


def test_a_spool_left_by_the_previous_release_is_read_back(tmp_path):
    """An acknowledged segment a crash did not delete goes; the cursor's record and those before it
    are not sent again; a torn tail (power lost mid-write) is cut off; the rest comes back in order."""
    (tmp_path / "seg-0000000000000002.log").write_bytes(record(b"delivered"))
    sent, kept, torn = record(b"sent"), record(b"kept"), record(b"never finished")
    (tmp_path / "seg-0000000000000003.log").write_bytes(sent + kept)
    (tmp_path / "seg-0000000000000004.log").write_bytes(record(b"later") + record(b"last") + torn[:11])
    (tmp_path / "cursor").write_bytes(cursor(3, len(sent)))

    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    assert (tmp_path / "seg-0000000000000004.log").read_bytes() == record(b"later") + record(b"last")
    assert sorted(p.name for p in tmp_path.glob("seg-*")) == ["seg-0000000000000003.log",
                                                              "seg-0000000000000004.log"]
    out = []
    while (batch := spool.read()) is not None:
        out.extend(batch.records)
        spool.ack(batch)
    assert out == [b"kept", b"later", b"last"]
    stats = spool.stats()
    assert (stats.records, stats.dropped, stats.corrupt) == (0, 0, 0)  # a torn tail is no corruption
    spool.close()

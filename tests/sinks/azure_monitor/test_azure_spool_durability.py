"""The on-disk spool: FIFO order, acknowledgements, torn tails, the size cap, and kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gpumon.sinks.spool import Spool, SpoolError
from tests.conftest import REPO


def drain(spool: Spool) -> list[bytes]:
    out = []
    while (batch := spool.read(max_records=7)) is not None:
        out.extend(batch.records)
        spool.ack(batch)
    return out


def test_records_come_back_in_order_across_segments_and_reopen(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20, segment_bytes=4096)
    payloads = [f"row-{i:05d}".encode() * 20 for i in range(300)]
    for i in range(0, 300, 10):
        spool.append(payloads[i:i + 10])
    assert len([n for n in os.listdir(tmp_path) if n.startswith("seg-")]) > 3
    first = spool.read(max_records=50)
    spool.ack(first)
    spool.close()

    reopened = Spool(str(tmp_path), max_bytes=1 << 20, segment_bytes=4096)
    assert reopened.stats().records == 300 - len(first.records)
    assert list(first.records) + drain(reopened) == payloads
    assert reopened.stats().records == 0
    assert len([n for n in os.listdir(tmp_path) if n.startswith("seg-")]) == 1  # acked segments deleted


def test_unacknowledged_batch_is_read_again(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    spool.append([b"a", b"b"])
    batch = spool.read()
    assert spool.read().records == batch.records  # not acked: the same records again
    spool.close()
    assert drain(Spool(str(tmp_path), max_bytes=1 << 20)) == [b"a", b"b"]


def test_torn_tail_is_cut_and_appends_continue(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    spool.append([b"one", b"two"])
    spool.close()
    seg = next(p for p in tmp_path.iterdir() if p.name.startswith("seg-"))
    with open(seg, "ab") as fh:  # half a record, as a power cut mid-write leaves it
        fh.write(b"\x00\x00\x00\x10\x12\x34")
    spool = Spool(str(tmp_path), max_bytes=1 << 20)
    spool.append([b"three"])
    assert drain(spool) == [b"one", b"two", b"three"]


def test_corrupt_record_in_old_segment_loses_only_the_rest_of_that_segment(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=1 << 20, segment_bytes=4096)
    spool.append([b"x" * 1000 for _ in range(3)])
    spool.append([b"y" * 1000 for _ in range(5)])  # rotates
    spool.close()
    first = sorted(p for p in tmp_path.iterdir() if p.name.startswith("seg-"))[0]
    data = bytearray(first.read_bytes())
    data[1008 + 20] ^= 0xFF  # flip a byte inside the second record's payload
    first.write_bytes(bytes(data))
    spool = Spool(str(tmp_path), max_bytes=1 << 20, segment_bytes=4096)
    records = drain(spool)
    assert records == [b"x" * 1000] + [b"y" * 1000] * 5  # the two records after the damage are lost
    assert spool.stats().corrupt == 1


def test_full_spool_drops_oldest_first_and_counts_them(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=16384, segment_bytes=4096)
    for i in range(100):
        spool.append([f"{i:04d}".encode() * 50])  # 208 bytes per record on disk
    stats = spool.stats()
    assert stats.bytes <= 16384
    assert stats.dropped > 0
    assert stats.records + stats.dropped == 100
    left = drain(spool)
    assert left == [f"{i:04d}".encode() * 50 for i in range(100 - len(left), 100)]  # the newest survive


def test_ack_of_a_batch_dropped_meanwhile_is_ignored(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=8192, segment_bytes=4096)
    spool.append([b"old" * 300])
    stale = spool.read()
    for _ in range(12):
        spool.append([b"new" * 300])
    spool.ack(stale)  # the segment it came from is gone: nothing else may be skipped
    assert all(r == b"new" * 300 for r in drain(spool))
    assert spool.stats().dropped >= 1


def test_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SpoolError, match="cannot create spool directory"):
        Spool(str(blocker / "spool"), max_bytes=1 << 20)


CHILD = r"""
import sys
from gpumon.sinks.spool import Spool
spool = Spool(sys.argv[1], max_bytes=64 << 20, segment_bytes=65536)
i = 0
while True:
    spool.append([f"rec-{i + k:07d}".encode() * 8 for k in range(5)])
    i += 5
    print(i, flush=True)
"""


def test_records_appended_before_kill_9_survive(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    acknowledged = 0
    deadline = time.monotonic() + 20
    while acknowledged < 20000 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acknowledged = int(line)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    assert acknowledged > 0
    records = drain(Spool(str(tmp_path), max_bytes=64 << 20, segment_bytes=65536))
    assert len(records) >= acknowledged  # everything append() returned for is there, intact
    assert records == [f"rec-{i:07d}".encode() * 8 for i in range(len(records))]
    assert json.loads((tmp_path / "cursor").read_text())["segment"] >= 1


def _segments(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("seg-"))


def test_reading_moves_on_after_the_last_segment_was_fully_acknowledged(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=32768, segment_bytes=4096)
    record = b"r" * 1000  # 1,008 bytes on disk: four fill a segment
    for _ in range(4):
        spool.append([record])
        assert drain(spool) == [record]  # everything acknowledged: the cursor sits at the segment's end
    later = [f"later-{i:03d}".encode() * 100 for i in range(33)]  # rolls over, and past the cap if stuck
    for payload in later:
        spool.append([payload])
        batch = spool.read()
        assert batch is not None and batch.records == (payload,)  # the new segment is read at once
        spool.ack(batch)
    assert spool.stats().dropped == 0
    assert len(_segments(tmp_path)) == 1  # acknowledged segments are gone


def test_after_reopen_the_segment_following_a_fully_acknowledged_one_is_read(tmp_path):
    spool = Spool(str(tmp_path), max_bytes=32768, segment_bytes=4096)
    first = [b"a" * 1000 for _ in range(4)]
    spool.append(first)
    assert drain(spool) == first
    spool.append([b"b" * 1000])  # starts the next segment; nothing reads it before the restart
    spool.close()

    reopened = Spool(str(tmp_path), max_bytes=32768, segment_bytes=4096)
    assert reopened.stats().records == 1
    assert drain(reopened) == [b"b" * 1000]
    more = [f"c{i}".encode() * 400 for i in range(40)]  # well past the cap if nothing were read
    for payload in more:
        reopened.append([payload])
        assert drain(reopened) == [payload]
    assert reopened.stats().dropped == 0


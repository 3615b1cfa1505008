"""The dev-kmsg reader (linux Documentation/ABI/testing/dev-kmsg) on records in the exact kernel format,
fed through a SOCK_SEQPACKET pair: one record per write and per read, as the kernel hands them out,
EAGAIN when drained, and EPIPE (raised by the read seam, as the kernel's read() returns it) when the
ring buffer overwrote records; then the real /dev/kmsg of this machine when it is readable."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from gpumon.sources.kmsg import Garbled, KmsgReader, parse
from tests.conftest import wait_for
from tests.fakes.kmsg import OVERRUN, KernelLog


def test_records_with_dictionary_lines_escapes_and_future_fields(tmp_path):
    log = KernelLog(tmp_path)
    r = log.reader()
    r.open()
    assert log.seeks == [os.SEEK_END]       # a first start skips the backlog
    log.record(10, "mlx5_core 0000:5c:00.0: Port module event: module 0, Cable plugged", prio=30,
               usec=58_123_456, fields={"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:5c:00.0"})
    log.record(11, r"tab\x09inside and a backslash \x5c", extra=",future,fields")
    log.record(12, "a continued fragment", flags="c")
    batch = r.read()
    assert [x.seq for x in batch.records] == [10, 11, 12]
    first = batch.records[0]
    assert (first.facility, first.level, first.usec) == (3, 6, 58_123_456)
    assert first.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:5c:00.0"}
    assert batch.records[1].message == r"tab\x09inside and a backslash \x5c"   # kept as the kernel escaped it
    assert batch.records[2].flags == "c"
    assert batch.lost == 0 and not batch.garbled and not batch.more


def test_overrun_counts_the_overwritten_records_and_reading_goes_on(tmp_path):
    log = KernelLog(tmp_path)
    r = log.reader()
    log.record(100, "one")
    log.raw(OVERRUN)          # the reader fell behind: EPIPE, then the oldest record still there
    log.record(140, "after the gap")
    log.record(141, "next")
    batch = r.read()
    assert [x.seq for x in batch.records] == [100, 140, 141]
    assert (batch.overruns, batch.lost) == (1, 39)


def test_garbled_and_truncated_records_are_set_aside(tmp_path):
    log = KernelLog(tmp_path)
    r = log.reader()
    log.raw(b"\xff\xfe binary junk\n")
    log.raw(b"6,7,100,-;no newline: truncated")
    log.raw(b"6,8,100,-;bad dictionary\nNOSPACE=1\n")
    log.record(9, "fine")
    batch = r.read()
    assert len(batch.garbled) == 3
    assert [x.message for x in batch.records] == ["fine"]
    with pytest.raises(Garbled):
        parse(b"6,x,100,-;not a number\n")


def test_drained_log_returns_at_once_and_limit_leaves_the_rest(tmp_path):
    log = KernelLog(tmp_path)
    r = log.reader()
    started = time.monotonic()
    assert r.read().records == []
    assert time.monotonic() - started < 1.0     # EAGAIN, never a blocking read
    for seq in range(5):
        log.record(seq, f"m{seq}")
    assert len(r.read(limit=3).records) == 3
    assert [x.seq for x in r.read().records] == [3, 4]


def test_restart_resumes_after_the_saved_record_and_counts_what_was_overwritten(tmp_path):
    state = tmp_path / "kmsg.json"
    log = KernelLog(tmp_path)
    r = log.reader(state)
    log.record(5, "seen")
    r.read()
    r.save()
    r.close()
    assert json.loads(state.read_text())["seq"] == 5
    log.seeks.clear()
    again = log.reader(state)
    again.open()
    assert log.seeks == []                     # default position: the oldest record, then skip
    log.record(4, "old, seen before the restart")
    log.record(5, "seen")
    log.record(9, "new after a gap of three")
    batch = again.read()
    assert [x.seq for x in batch.records] == [9] and batch.lost == 3


def test_a_save_writes_through_a_temporary_file_of_its_own(tmp_path):
    state = tmp_path / "kmsg.json"
    (tmp_path / "kmsg.json.tmp").mkdir()        # a fixed temporary name another process holds
    log = KernelLog(tmp_path)
    r = log.reader(state)
    log.record(5, "seen")
    r.read()
    r.save()
    r.save(7)
    assert json.loads(state.read_text())["seq"] == 7
    assert sorted(os.listdir(tmp_path)) == ["boot_id", "kmsg.json", "kmsg.json.tmp"]


def test_a_position_saved_in_another_boot_is_not_used(tmp_path):
    state = tmp_path / "kmsg.json"
    state.write_text(json.dumps({"boot_id": "another-boot", "seq": 5000}))
    log = KernelLog(tmp_path)
    r = log.reader(state)
    r.open()
    assert log.seeks == [os.SEEK_END]
    log.record(3, "this boot")
    assert [x.seq for x in r.read().records] == [3]


def test_one_boot_id_for_the_kernel_log_and_the_health_state(tmp_path):
    from gpumon.health import state
    from gpumon.sources import kmsg

    path = tmp_path / "boot_id"
    path.write_text("8d1b7a5e-4f3c-4a57-9d0e-2f7c1b2a3e4d\n")
    assert state.boot_id is kmsg.boot_id
    assert state.boot_id(str(path)) == "8d1b7a5e-4f3c-4a57-9d0e-2f7c1b2a3e4d"
    assert state.boot_id(str(tmp_path / "none")) == ""


def test_the_real_kernel_log_when_readable():
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        pytest.skip(f"/dev/kmsg not readable here: {exc}")
    os.close(fd)
    r = KmsgReader()
    r.open()                                    # at the end: the backlog is skipped
    try:
        marker = f"gpumon-test-{uuid.uuid4()}"
        try:
            with open("/dev/kmsg", "w") as out:  # user-space records get facility user (1)
                out.write(f"<14>{marker}\n")
        except OSError:
            r.read()                            # read-only kernel log: the real ABI still parses
            return
        found = wait_for(lambda: [x for x in r.read().records if marker in x.message], timeout=5)
        assert found[0].facility == 1 and found[0].level == 6 and found[0].seq > 0
    finally:
        r.close()
    everything = KmsgReader(first_start="all")
    try:
        batch = everything.read(limit=200)
        assert batch.records and not batch.garbled
    finally:
        everything.close()


def test_the_message_stays_escaped_and_only_dictionary_values_are_unescaped(tmp_path):
    # dev-kmsg: "non-printable characters are escaped as \xNN" in the message and in dictionary values
    log = KernelLog(tmp_path)
    r = log.reader()
    log.record(1, r"NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a\x0aCRITICAL forged, Graphics Exception",
               fields={"SUBSYSTEM": r"pci\x0afake"})
    [record] = r.read().records
    assert "\n" not in record.message and r"name=a\x0aCRITICAL forged" in record.message
    assert record.fields == {"SUBSYSTEM": "pci\nfake"}


def test_a_regular_file_of_records_reads_one_record_per_read(tmp_path):
    """A file of records as the device hands them out (a simulated host's log): one record per read,
    dictionary lines with their record, EAGAIN when drained, appended records on a later read, a record
    still being written waits; SEEK_END starts after the last one."""
    path = tmp_path / "kmsg"
    boot = tmp_path / "boot_id"
    boot.write_text(str(uuid.uuid4()) + "\n")
    path.write_bytes(b"6,0,10,-;first\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n4,1,20,-;second\n")
    reader = KmsgReader(str(path), first_start="all", boot_id_path=str(boot))
    tail = KmsgReader(str(path), first_start="end", boot_id_path=str(boot))
    try:
        first, second = reader.read().records
        assert (first.seq, first.message, first.fields) == (0, "first", {"SUBSYSTEM": "pci",
                                                                          "DEVICE": "+pci:0000:3b:00.0"})
        assert (second.seq, second.level, second.message) == (1, 4, "second")
        assert tail.read().records == []
        with open(path, "ab") as fh:
            fh.write(b"6,2,30,-;third\n SUBSYSTEM=pc")          # a record whose last line is half written
        assert reader.read().records == [] and tail.read().records == []
        with open(path, "ab") as fh:
            fh.write(b"i\n6,3,40,-;fourth\n")
        assert [(r.message, r.fields) for r in reader.read().records] == [("third", {"SUBSYSTEM": "pci"}),
                                                                           ("fourth", {})]
        assert [r.seq for r in tail.read().records] == [2, 3]
    finally:
        reader.close()
        tail.close()

"""The spool on a disk that fills up: it frees room on its own, drops the oldest rows first and counts
them, and reports itself down only while it cannot write at all.

The disk is a real 256 KiB tmpfs where ``mount`` is permitted (root, as in CI). Where it is not, the
same tests run against a byte budget at the spool's one write seam (``Spool._write``); cursor writes
are then not limited.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
import uuid

import pytest

from gpumon.model import Event, Severity, Snapshot
from gpumon.sinks.azure_monitor import AzureMonitorSink
from gpumon.sinks.base import SinkContext
from gpumon.sinks.spool import Spool
from tests.conftest import wait_for
from tests.fakes.logs_ingestion import IngestionServer
from tests.fakes.tokens import FakeCredential

DISK_BYTES = 256 << 10
RECORD = 1000  # payload bytes; 1,008 on disk


class SmallDisk:
    """A directory on a small disk, and a ballast file that fills whatever room the spool leaves."""

    def __init__(self, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        os.makedirs(root)
        self.real = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", root],
                                   capture_output=True, timeout=10).returncode == 0
        self.ballast = os.path.join(root, "ballast")
        self.budget = DISK_BYTES
        open(self.ballast, "wb").close()  # made now: on a full disk even a new name may not fit
        if not self.real:
            monkeypatch.setattr(Spool, "_write", self._budget_write)

    def _used(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.root) for f in files)

    def _budget_write(self, fd: int, data: bytes) -> int:
        """Spool._write on a disk of ``budget`` bytes (set on the class: called as fd, data)."""
        room = self.budget - self._used()
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data[:room])

    def fill(self) -> None:
        """Take every byte left."""
        if not self.real:
            self.budget = self._used()
            return
        fd = os.open(self.ballast, os.O_WRONLY | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 512)
        except OSError as exc:  # the loop ends here, once: the disk is full
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def free(self) -> None:
        os.truncate(self.ballast, 0)
        self.budget = DISK_BYTES

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "--lazy", self.root], capture_output=True, timeout=10, check=True)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    small = SmallDisk(str(tmp_path / "disk"), monkeypatch)
    yield small
    small.close()


def rows(start: int, n: int) -> list[bytes]:
    return [f"{i:08d}".encode().ljust(RECORD, b".") for i in range(start, start + n)]


def drain(spool: Spool) -> list[bytes]:
    out = []
    while (batch := spool.read(max_records=50)) is not None:
        out.extend(batch.records)
        spool.ack(batch)
    return out


def test_full_disk_drops_the_oldest_rows_counts_them_and_keeps_taking_new_ones(disk):
    spool = Spool(os.path.join(disk.root, "spool"), max_bytes=64 << 20)  # the cap is far beyond the disk
    total = 1000  # about 1 MB into a 256 KiB disk
    for i in range(0, total, 5):
        assert spool.append(rows(i, 5)) == 5  # never refused: room is made
    stats = spool.stats()
    assert stats.error == ""
    assert stats.dropped > 0
    assert stats.records + stats.dropped == total
    left = drain(spool)
    assert left == rows(total - len(left), len(left))  # the newest survive, in order, none twice
    assert len(left) == stats.records
    spool.close()


def test_endpoint_back_after_a_full_disk_every_new_row_is_kept_and_none_resent_after_restart(disk):
    directory = os.path.join(disk.root, "spool")
    spool = Spool(directory, max_bytes=64 << 20)
    for i in range(0, 400, 10):  # the endpoint is down: the spool fills the disk and drops the oldest
        spool.append(rows(i, 10))
    assert spool.stats().dropped > 0
    disk.fill()  # someone else takes the rest of the disk meanwhile
    sent = drain(spool)  # the endpoint is back: everything held is sent and acknowledged
    assert sent == rows(400 - len(sent), len(sent)) and spool.stats().records == 0
    dropped = spool.stats().dropped
    for i in range(1000, 1100, 5):  # the incident: every new row was dropped here
        assert spool.append(rows(i, 5)) == 5
    stats = spool.stats()
    assert stats.error == "" and stats.dropped == dropped
    assert drain(spool) == rows(1000, 100)
    spool.close()
    reopened = Spool(directory, max_bytes=64 << 20)
    assert drain(reopened) == []  # a restart re-sends nothing
    reopened.close()


def test_nothing_left_to_drop_reports_down_and_counts_until_the_disk_has_room(disk):
    spool = Spool(os.path.join(disk.root, "spool"), max_bytes=64 << 20)
    disk.fill()
    assert spool.append(rows(0, 3)) == 0
    stats = spool.stats()
    assert stats.dropped == 3 and stats.records == 0
    assert os.strerror(errno.ENOSPC) in stats.error and disk.root in stats.error
    disk.free()
    assert spool.append(rows(3, 2)) == 2
    assert spool.stats().error == ""
    assert drain(spool) == rows(3, 2)
    spool.close()


def events(n: int) -> tuple[Event, ...]:
    return tuple(Event("ib_link_flap", Severity.WARNING, {"device": "mlx5_ib0", "port": "1"},
                       uuid.uuid4().hex * 8, {"i": i}) for i in range(n))


def test_sink_is_down_while_its_spool_cannot_write_and_up_again_after(disk):
    with IngestionServer() as server:
        cfg = {"endpoint": server.endpoint, "dcr_immutable_id": server.dcr_id, "ca_bundle": server.ca_path,
               "imds_url": "", "timeout": 2.0, "spool_dir": os.path.join(disk.root, "spool")}
        sink = AzureMonitorSink(SinkContext("node-1", disk.root, "test"), cfg, credential=FakeCredential())
        sink.backoff_min = sink.config_backoff_min = 0.1
        sink.start()
        try:
            sink.publish(Snapshot("node-1", time.time(), (), events(2), ()))
            assert server.wait_for(lambda s: len(s.rows("Custom-GpuMonEvents_CL")) == 2, timeout=10)
            wait_for(lambda: sink.health().extra["rows_queued"] == 0)
            disk.fill()
            sink.publish(Snapshot("node-1", time.time(), (), events(12), ()))  # more than a page: 7 KB
            health = sink.health()
            assert not health.up and health.dropped == 12
            assert os.strerror(errno.ENOSPC) in health.detail
            disk.free()
            sink.publish(Snapshot("node-1", time.time(), (), events(4), ()))
            assert server.wait_for(lambda s: len(s.rows("Custom-GpuMonEvents_CL")) == 6, timeout=10)
            health = wait_for(lambda: (h := sink.health()).up and h.extra["rows_queued"] == 0 and h)
            assert health.dropped == 12 and health.exported == 6 and health.detail == ""
        finally:
            sink.stop(2.0)
    shutil.rmtree(os.path.join(disk.root, "spool"), ignore_errors=True)

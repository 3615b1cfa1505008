"""The Hyper-V KVP pool reader: fixed 2560-byte records with junk after the NUL, read under a shared
fcntl lock that a writer in another process really holds."""

from __future__ import annotations

import os
import time

import pytest

from gpumon.sources import kvp
from tests.fakes.kvp import record, rewrite, writer_holding_the_lock

POOL = (record("VirtualMachineName", "gpu-node-0_3")
        + record("PhysicalHostName", "CH1-AZ01-R12-N07", junk=b"PhysicalHostName=stale")
        + bytes(kvp.RECORD_SIZE)  # a free slot
        + record("PhysicalHostNameFullyQualified", "CH1-AZ01-R12-N07.cloud.example")
        + b"partial record")


def test_records_parse_without_the_junk_after_each_nul():
    pool = kvp.parse_pool(POOL)
    assert pool == {"VirtualMachineName": "gpu-node-0_3", "PhysicalHostName": "CH1-AZ01-R12-N07",
                    "PhysicalHostNameFullyQualified": "CH1-AZ01-R12-N07.cloud.example"}
    assert kvp.physical_host(pool) == "CH1-AZ01-R12-N07"
    assert kvp.physical_host({"PhysicalHostNameFullyQualified": "h.example"}) == "h.example"
    assert kvp.physical_host({}) == ""


def test_read_pool_reads_a_real_file(tmp_path):
    path = tmp_path / ".kvp_pool_3"
    path.write_bytes(POOL)
    assert kvp.read_pool(str(path))["VirtualMachineName"] == "gpu-node-0_3"


def test_a_missing_pool_is_file_not_found_and_odd_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        kvp.read_pool(str(tmp_path / "absent"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(kvp.KvpError, match="not a regular file"):
        kvp.read_pool(str(fifo))
    big = tmp_path / "big"
    with open(big, "wb") as fh:
        fh.truncate(kvp.MAX_POOL_BYTES + 1)
    with pytest.raises(kvp.KvpError, match="too large"):
        kvp.read_pool(str(big))


def test_a_writer_holding_its_lock_is_waited_for_briefly_then_read_after_it_lets_go(tmp_path):
    path = tmp_path / ".kvp_pool_3"
    path.write_bytes(record("PhysicalHostName", "old-host"))
    with writer_holding_the_lock(str(path)) as writer:
        started = time.monotonic()
        with pytest.raises(kvp.KvpError, match="locked"):
            kvp.read_pool(str(path), lock_wait=0.2)
        assert 0.2 <= time.monotonic() - started < 2.0
        rewrite(writer, record("PhysicalHostName", "new-host"))
        assert kvp.physical_host(kvp.read_pool(str(path))) == "new-host"

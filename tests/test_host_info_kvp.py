"""The Hyper-V KVP pool reader: fixed 2560-byte records with junk after the NUL, read under a shared
fcntl lock that a writer in another process really holds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpumon.sources import kvp


def record(key: str, value: str, junk: bytes = b"\xa5") -> bytes:
    """One record as hv_kvp_daemon leaves it: NUL-terminated fields, old bytes after the NUL."""
    k, v = key.encode() + b"\0", value.encode() + b"\0"
    return (k + junk * kvp.KEY_SIZE)[:kvp.KEY_SIZE] + (v + junk * kvp.VALUE_SIZE)[:kvp.VALUE_SIZE]


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


WRITER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    size = int(sys.stdin.buffer.readline())
    os.pwrite(fd, sys.stdin.buffer.read(size), 0)
    fcntl.lockf(fd, fcntl.LOCK_UN)
    print("released", flush=True)
""")


@contextmanager
def writer_holding_the_lock(path: str) -> Iterator[subprocess.Popen]:
    """Another process (fcntl locks are per process) holding the pool's exclusive lock, as
    hv_kvp_daemon does while it rewrites the pool; ``rewrite`` makes it write and let go."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert writer.stdout.readline().strip() == b"locked"
        yield writer
        rewrite(writer, b"")
    finally:
        writer.kill()
        writer.wait(5)


def rewrite(writer: subprocess.Popen, data: bytes) -> None:
    if writer.poll() is not None or writer.stdin.closed:
        return
    writer.stdin.write(b"%d\n" % len(data) + data)
    writer.stdin.close()
    assert writer.stdout.readline().strip() == b"released"


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

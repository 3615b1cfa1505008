"""The Hyper-V KVP pool as hv_kvp_daemon writes it: fixed 2560-byte records (NUL-terminated key and
value, old bytes after the NUL), and a writer in another process holding the pool's fcntl lock
(fcntl locks are per process) while it rewrites the pool."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

from gpumon.sources import kvp


def record(key: str, value: str, junk: bytes = b"\xa5") -> bytes:
    """One record as hv_kvp_daemon leaves it: NUL-terminated fields, old bytes after the NUL."""
    k, v = key.encode() + b"\0", value.encode() + b"\0"
    return (k + junk * kvp.KEY_SIZE)[:kvp.KEY_SIZE] + (v + junk * kvp.VALUE_SIZE)[:kvp.VALUE_SIZE]


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

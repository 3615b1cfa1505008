"""The Hyper-V KVP pool the host writes into the guest: where an Azure VM learns its physical host.

``hv_kvp_daemon`` keeps each pool as a file of fixed 2560-byte records, a key of 512 bytes and a value
of 2048, each NUL-terminated with junk after the NUL, and rewrites it under an fcntl lock. Pool 3
(``/var/lib/hyperv/.kvp_pool_3``) holds what the host tells the guest: ``PhysicalHostName``,
``PhysicalHostNameFullyQualified``, ``VirtualMachineName``. Reads take a shared lock, trying without
blocking until a short deadline, so a daemon holding its lock never holds gpumon.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

DEFAULT_POOL = "/var/lib/hyperv/.kvp_pool_3"
KEY_SIZE = 512
VALUE_SIZE = 2048
RECORD_SIZE = KEY_SIZE + VALUE_SIZE
MAX_POOL_BYTES = 1 << 20
"""hv_kvp_daemon grows a pool by 200 records at a time; a pool this large is not one."""
LOCK_WAIT = 0.2
LOCK_POLL = 0.01


class KvpError(OSError):
    """The pool is there but cannot be read now: not a regular file, too large, or locked too long."""


def parse_pool(data: bytes) -> dict[str, str]:
    """Key -> value of every record; an empty key (a free slot) and a partial last record are skipped."""
    out: dict[str, str] = {}
    for start in range(0, len(data) - RECORD_SIZE + 1, RECORD_SIZE):
        key = _text(data[start:start + KEY_SIZE])
        if key:
            out[key] = _text(data[start + KEY_SIZE:start + RECORD_SIZE])
    return out


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace").strip()


def read_pool(path: str = DEFAULT_POOL, lock_wait: float = LOCK_WAIT) -> dict[str, str]:
    """The pool's records, read under a shared lock. FileNotFoundError where there is no pool
    (not Hyper-V, or no KVP daemon); KvpError where it cannot be read now."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KvpError(errno.EINVAL, "not a regular file", path)
        if st.st_size > MAX_POOL_BYTES:
            raise KvpError(errno.EFBIG, f"{st.st_size} bytes is too large for a KVP pool", path)
        _lock_shared(fd, path, lock_wait)
        try:
            return parse_pool(os.pread(fd, MAX_POOL_BYTES, 0))
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _lock_shared(fd: int, path: str, wait: float) -> None:
    """A shared POSIX record lock, as hv_kvp_daemon takes its own (F_SETLK), without blocking forever."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            if time.monotonic() >= deadline:
                raise KvpError(errno.EAGAIN, f"locked by its writer for more than {wait:g} s", path) from None
        time.sleep(LOCK_POLL)


def physical_host(pool: dict[str, str]) -> str:
    """The physical host's name: the short one, else the fully qualified one, else empty."""
    return pool.get("PhysicalHostName") or pool.get("PhysicalHostNameFullyQualified", "")

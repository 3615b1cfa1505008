"""One process owns a spool directory: an exclusive ``flock`` on ``<dir>/spool.lock``, which holds the
owner's PID for the message a second process prints. The kernel drops the lock with its holder."""

from __future__ import annotations

import errno
import fcntl
import logging
import os

log = logging.getLogger("gpumon.sinks.spool")

LOCK_FILE = "spool.lock"
"""Held (``flock``) by the one process that owns the spool: two daemons given one ``spool_dir`` would
send every record twice and retire each other's segments. The state directory's own lock covers the
default spool directories; this one covers a ``spool_dir`` named explicitly."""


class SpoolError(Exception):
    """The spool directory cannot be used (permissions, not a directory)."""


def lock(directory: str) -> int | None:
    """Lock ``directory`` for this process (the descriptor holding the lock), or raise SpoolError
    naming the process that holds it. A lock file that cannot be made (a full disk) locks nothing
    rather than stopping the sink; the state directory's lock still covers the default spools."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        log.warning("spool: cannot create %s (%s): the spool is used without its lock", path,
                    exc.strerror or exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise SpoolError(f"spool directory {directory} is in use by another gpumon ({who}; lock {path}): "
                             "give each gpumon a spool_dir of its own") from None
        raise SpoolError(f"cannot lock spool directory {directory}: {exc.strerror or exc}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the PID is only for the message a second process prints
    return fd

"""One ``gpumon run`` per state directory: an exclusive ``flock`` on ``<state_dir>/gpumon.lock``.

Two daemons sharing a state directory would both drain the same spool and rewrite the same flap
window. The kernel drops a ``flock`` when its holder dies, however it dies, so a lock file left by a
killed process never blocks the next start. The file holds the holder's PID, for the message the
second instance prints. It is never unlinked: removing a locked file lets a third process lock a new
inode while a second still waits on the old one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from gpumon.config import Config, ConfigError

LOCK_FILE = "gpumon.lock"

log = logging.getLogger("gpumon.statelock")


class StateDirBusy(ConfigError):
    """Another gpumon holds the state directory: bad usage, exit 2, naming the holder's PID."""


class StateLock:
    """An exclusive lock on one state directory, held until :meth:`release` or process exit."""

    def __init__(self, state_dir: str, fd: int | None) -> None:
        self.state_dir = state_dir
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # no stale PID for a reader; the kernel unlocks on close
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def acquire(config: Config) -> StateLock:
    """Lock ``[daemon] state_dir`` or raise :class:`StateDirBusy`. A directory gpumon cannot write
    holds no state to corrupt: it is logged and run without a lock rather than refused."""
    state_dir = config.daemon.state_dir
    path = os.path.join(state_dir, LOCK_FILE)
    try:
        os.makedirs(state_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ConfigError(config.origin("daemon", "state_dir"), "[daemon] state_dir",
                              f"cannot lock {path}: {exc.strerror or exc}") from None
        log.warning("state directory %s is not writable (%s): running without its lock, nothing will "
                    "persist across restarts", state_dir, exc.strerror)
        return StateLock(state_dir, None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read_pid(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(config.origin("daemon", "state_dir"), "[daemon] state_dir",
                              f"cannot lock {path}: {exc.strerror or exc}") from None
        who = f"pid {holder}" if holder else "a process that has not written its pid yet"
        raise StateDirBusy(config.origin("daemon", "state_dir"), "[daemon] state_dir",
                           f"{state_dir} is in use by another gpumon ({who}; lock {path})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return StateLock(state_dir, fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None

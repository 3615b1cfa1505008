"""Tell systemd how the daemon is doing (``Type=notify``), with the standard library only.

systemd hands a ``Type=notify`` service the address of a datagram socket in ``$NOTIFY_SOCKET``; the
service writes newline-separated ``KEY=VALUE`` assignments to it (the sd_notify(3) protocol). Without
the variable (run by hand, in a container, under another supervisor) every call here is a no-op that
returns False, so callers never need to ask whether they run under systemd.

How the daemon is meant to call it::

    notify("READY=1")          # once, after every sink has started (the Prometheus port is bound):
                               # `systemctl start` returns only then, and a unit ordered After= it
                               # can scrape at once.
    wd = Watchdog.from_environ()
    ...                        # in the loop, on every tick, only while the loop itself is healthy
    wd.tick()                  # (the same condition that makes /healthz answer 200), so a wedged
                               # loop stops pinging and systemd restarts it after WatchdogSec.
    reloading()                # on SIGHUP, before re-reading the config; then notify("READY=1")
                               # when the new config is in force (Type=notify-reload needs both).
    notify("STOPPING=1")       # first thing on SIGTERM, before sinks are flushed.

The loop should wake at least every ``Watchdog.interval`` seconds even when the collection interval is
longer, so the pings keep their cadence: ``timeout = min(next_collection, wd.next_due())``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

from gpumon.log_once import LogOnce

log = logging.getLogger(__name__)

_warned = LogOnce(log)
"""A broken notify socket would otherwise log on every watchdog ping."""


def socket_address(environ: Mapping[str, str] | None = None) -> str | bytes | None:
    """The address in ``$NOTIFY_SOCKET`` as ``socket.connect`` takes it, or None when unset.

    A leading ``@`` names a Linux abstract-namespace socket, which is spelled with a NUL byte.
    """
    env = os.environ if environ is None else environ
    raw = env.get("NOTIFY_SOCKET", "")
    if not raw:
        return None
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    # vsock: and relative paths are not something systemd hands a system service on these hosts.
    _warned.warning("address:" + raw, "NOTIFY_SOCKET=%r is not a path or an abstract socket; not notifying", raw)
    return None


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send one sd_notify message (e.g. ``"READY=1"``); True when it was handed to the socket.

    Never raises: a supervisor that went away must not take the daemon down with it.
    """
    address = socket_address(environ)
    if address is None:
        return False
    try:
        data = message.encode("utf-8")
    except UnicodeEncodeError:
        _warned.warning("encode", "sd_notify message is not valid text: %r", message)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sent = sock.send(data)
    except OSError as exc:
        _warned.warning(f"send:{address!r}:{exc.errno}", "sd_notify to %r failed: %s", address, exc)
        return False
    return sent == len(data)


def reloading(environ: Mapping[str, str] | None = None) -> bool:
    """Announce a config reload; send ``READY=1`` again once the new config is in force.

    ``MONOTONIC_USEC`` is what ``Type=notify-reload`` (systemd 253+) uses to match the reload it asked
    for; older systemd ignores the extra assignment.
    """
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}", environ)


def status(text: str, environ: Mapping[str, str] | None = None) -> bool:
    """One line shown by ``systemctl status`` (newlines would end the assignment, so they go)."""
    return notify("STATUS=" + " ".join(text.splitlines()), environ)


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings, or None when systemd asked for none.

    systemd sets ``WATCHDOG_USEC`` (the unit's WatchdogSec) and ``WATCHDOG_PID``; a PID that is not
    ours means the variables were inherited from a parent and are not for us. Pinging at half the
    timeout, as sd_watchdog_enabled(3) advises, leaves room for one late tick.
    """
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC", "").strip()
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        _warned.warning("usec:" + raw, "WATCHDOG_USEC=%r is not an integer; watchdog pings disabled", raw)
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID", "").strip()
    if owner:
        me = os.getpid() if pid is None else pid
        if not owner.isdigit() or int(owner) != me:
            return None
    return usec / 2_000_000


class Watchdog:
    """Rate-limits ``WATCHDOG=1`` so the loop can call :meth:`tick` as often as it likes."""

    def __init__(
        self,
        interval: float | None,
        environ: Mapping[str, str] | None = None,
        clock=time.monotonic,
    ) -> None:
        self.interval = interval
        self._environ = environ
        self._clock = clock
        self._last: float | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Watchdog:
        return cls(watchdog_interval(environ), environ)

    @property
    def enabled(self) -> bool:
        return self.interval is not None

    def next_due(self) -> float | None:
        """Seconds until the next ping is due (0 when overdue), or None with no watchdog."""
        if self.interval is None:
            return None
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self.interval - self._clock())

    def tick(self) -> bool:
        """Ping when a ping is due; True when one was sent."""
        if self.interval is None:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        return notify("WATCHDOG=1", self._environ)

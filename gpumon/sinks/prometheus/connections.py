"""The front's connections: each connection's phase and buffers (:class:`Conn`), the table of the
open ones by source with the never-spoken ones in accept order (:class:`Table`), the limits the front
keeps (:class:`Limits`, the descriptor budget :func:`connection_cap` works out), and what the
application answers with (:class:`Reply`, :class:`App`)."""

from __future__ import annotations

import logging
import os
import resource
import socket
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["BUSY", "FD_RESERVE", "HANDSHAKE", "HEAD", "HIGH_WATER", "IDLE_TIMEOUT", "WAIT_TLS", "App", "Conn",
           "Limits", "Reply", "Table", "connection_cap", "open_descriptors", "raise_nofile_limit"]

log = logging.getLogger("gpumon.sinks.prometheus")

WAIT_TLS, HANDSHAKE, HEAD, BUSY = range(4)
"""A connection's phase: TLS not started (nothing received), handshaking, reading a head, answering."""

FD_RESERVE = 256
"""Descriptors left to the rest of the daemon (sysfs reads, NVML, spool, sinks) at most."""
IDLE_TIMEOUT = 300.0
"""Seconds a connection that has sent nothing is kept while descriptors are plentiful."""
HIGH_WATER = 0.75
"""The share of ``max_connections`` above which connections silent for the first-byte timeout are
reaped (oldest first) rather than kept."""


def raise_nofile_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (an idle connection costs one descriptor);
    return the soft limit in effect. A refusal (a seccomp filter, a container) leaves it as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.debug("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, exc)
    return soft


def open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def connection_cap(configured: int) -> int:
    """Connections the front may hold: ``configured`` (0: no own cap) within the descriptors the
    soft limit leaves once the daemon's own and a reserve are counted."""
    soft = raise_nofile_limit()
    reserve = min(FD_RESERVE, soft // 4)
    by_fds = max(16, soft - open_descriptors() - reserve)
    return min(configured, by_fds) if configured > 0 else by_fds


@dataclass(frozen=True)
class Limits:
    first_byte_timeout: float
    request_timeout: float
    max_header_bytes: int
    max_connections: int
    """Connections held at once (from ``connection_cap``)."""
    per_source: int
    backlog: int
    idle_timeout: float = IDLE_TIMEOUT
    """How long a connection that has sent nothing is kept below the high-water mark."""
    high_water: float = HIGH_WATER

    @property
    def high_water_mark(self) -> int:
        """Connections above which silent ones past their first-byte deadline are reaped."""
        return max(1, int(self.max_connections * self.high_water))


class Reply:
    """An answer's bytes (head and body as separate chunks: the page is never copied) and whether
    the connection closes after it."""

    __slots__ = ("chunks", "close")

    def __init__(self, chunks: list[bytes], close: bool) -> None:
        self.chunks, self.close = chunks, close


class App(Protocol):
    def respond(self, conn: Conn, head: bytes) -> Reply | Callable[[], Reply]:
        """Answer a complete request head, or return a job to run on a worker thread."""

    def refuse(self, conn: Conn, status: int) -> Reply:
        """The error answer for a head the front refused (414, 431)."""


class Conn:
    """One accepted connection, as cheap as it can be while it waits."""

    __slots__ = ("sock", "fd", "source", "address", "state", "buf", "scanned", "deadline", "since",
                 "received", "out", "pos", "close_after", "closed", "tls", "events", "peeked")

    def __init__(self, sock: socket.socket, source: str, address: tuple, now: float, deadline: float) -> None:
        self.sock: socket.socket = sock
        self.fd = sock.fileno()
        self.source, self.address = source, address
        self.state = HEAD
        self.buf = bytearray()
        self.scanned = 0
        """Bytes of ``buf`` searched for the end of the head: a head trickled byte by byte costs O(n)."""
        self.deadline = deadline
        self.since = now
        self.received = 0
        """Bytes received in the connection's life (the eviction rank's numerator)."""
        self.out: list[bytes] = []
        self.pos = 0
        self.close_after = False
        self.closed = False
        self.tls = False
        self.events = 0
        self.peeked = 0
        """Bytes of a first TLS record seen (not read) so far."""


class Table:
    """The open connections, by source, with the never-spoken ones in accept order."""

    def __init__(self) -> None:
        self.conns: set[Conn] = set()
        self.by_source: dict[str, int] = {}
        self.silent: OrderedDict[Conn, None] = OrderedDict()
        """Connections that have not sent a byte yet, oldest first: the first to go under pressure."""

    def __len__(self) -> int:
        return len(self.conns)

    def add(self, conn: Conn) -> None:
        self.conns.add(conn)
        self.by_source[conn.source] = self.by_source.get(conn.source, 0) + 1
        self.silent[conn] = None

    def remove(self, conn: Conn) -> None:
        if conn not in self.conns:
            return
        self.conns.discard(conn)
        self.silent.pop(conn, None)
        left = self.by_source[conn.source] - 1
        if left:
            self.by_source[conn.source] = left
        else:
            del self.by_source[conn.source]

    def oldest_silent(self) -> Conn | None:
        for conn in self.silent:
            return conn
        return None

    def victim(self, now: float) -> Conn | None:
        """The connection that has sent the least for the longest, never one answering a request:
        the oldest silent one, else the lowest bytes-per-second over its life."""
        for conn in self.silent:
            return conn
        waiting = [conn for conn in self.conns if conn.state != BUSY]
        if not waiting:
            return None
        return min(waiting, key=lambda c: (c.received / max(now - c.since, 1e-3), c.since))

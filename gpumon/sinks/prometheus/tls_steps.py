"""The front's TLS steps: a client's first record awaited without OpenSSL state, then the wrap and
the handshake, within a budget per turn of the loop.

A mixin of :class:`~gpumon.sinks.prometheus.front.Front`, which owns the loop, the selector, the
deadlines and the connections; apart so that each module has one job. A trickled ClientHello is
peeked at (``MSG_PEEK``) and waited for with ``SO_RCVLOWAT``, so that it costs a descriptor and kernel
buffer, never OpenSSL's per-connection state (tens of KiB); a whole one is answered within the turn's
handshake budget or queued off the selector for the next turn.
"""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from gpumon.sinks.prometheus.connections import HANDSHAKE, HEAD, WAIT_TLS, Conn

log = logging.getLogger("gpumon.sinks.prometheus")

_HANDSHAKE_BUDGET = 0.005
"""Seconds of TLS steps per turn of the loop (a handshake with a client certificate takes some
milliseconds of CPU), taken after the turn's requests, answers and accepts: a request that became
ready meanwhile waits for about this, not for every handshake a flood has pending."""
TLS_RECORD = 5 + 16384 + 256
"""The most a client's first TLS record can be (a header and 2^14 bytes plus expansion)."""


class _Loop(Protocol):
    """What the TLS steps use of the front's loop."""

    _deferred: deque[tuple[Conn, int, int]]
    _may_handshake: bool
    _held: Conn | None
    tls: Callable[[], ssl.SSLContext | None]
    count: Callable[[str], None]

    def _watch(self, conn: Conn, events: int) -> None: ...
    def _dispatch(self, data: object, mask: int) -> None: ...
    def _close(self, conn: Conn, graceful: bool = True) -> None: ...
    def _spoke(self, conn: Conn) -> None: ...
    def _read(self, conn: Conn) -> None: ...
    def _defer(self, conn: Conn, mask: int) -> None: ...
    def _handshake(self, conn: Conn) -> None: ...
    def _tls_failed(self, conn: Conn, step: str, exc: Exception) -> None: ...


class TlsSteps:
    """The TLS states of a connection (``WAIT_TLS``, ``HANDSHAKE``) for the front's loop."""

    _deferred: deque[tuple[Conn, int, int]]
    """Connections with a TLS step ready that did not fit a turn's budget, off the selector."""
    _may_handshake: bool
    """Whether this turn's budget leaves room for a handshake step."""
    _held: Conn | None
    """A connection whose whole ClientHello came when the budget was spent: deferred by the caller."""

    def _handshake_steps(self: _Loop, ready: list[tuple[Conn, int]]) -> None:
        """TLS steps: a handshake step (a whole ClientHello to answer, or the next flight) costs
        milliseconds, so those waiting in the queue go first and this turn takes them for at most
        ``_HANDSHAKE_BUDGET`` (at least one); the rest are taken off the selector and queued, so
        that they are neither reported again each turn (a crowd of them would make every turn cost
        the whole crowd) nor lost. What costs microseconds (a peek at a ClientHello still arriving,
        a hang-up) is done at once."""
        queue, done = self._deferred, 0
        end = time.perf_counter() + _HANDSHAKE_BUDGET
        while queue and (not done or time.perf_counter() < end):
            conn, mask, events = queue.popleft()
            if not conn.closed:
                self._watch(conn, events)  # back on the selector
                self._dispatch(conn, mask)
                done += 1
        for conn, mask in ready:
            if conn.closed:
                continue
            self._may_handshake = not done or time.perf_counter() < end
            if conn.state == HANDSHAKE and not self._may_handshake:
                self._defer(conn, mask)
                continue
            self._held = None
            self._dispatch(conn, mask)
            if self._held is conn:
                self._defer(conn, mask)
            elif not conn.closed and conn.state != WAIT_TLS:
                done += 1
        self._may_handshake, self._held = True, None

    def _defer(self: _Loop, conn: Conn, mask: int) -> None:
        events = conn.events
        self._watch(conn, 0)
        self._deferred.append((conn, mask, events))

    def _start_tls(self: _Loop, conn: Conn) -> None:
        """Wrap the socket once the client's whole first TLS record (its ClientHello) has arrived:
        one that trickles it costs a descriptor and kernel buffer until its deadline, never
        OpenSSL's per-connection state (tens of KiB). ``SO_RCVLOWAT`` keeps the loop from waking
        for each byte; a hang-up still wakes it."""
        try:
            head = conn.sock.recv(TLS_RECORD, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn, graceful=False)
            return
        if len(head) <= conn.peeked:  # readable with nothing new: the client hung up
            self._close(conn, graceful=False)
            return
        if not conn.received:
            self._spoke(conn)  # it spoke: TLS bytes count as sent
        conn.received = len(head)
        need = 5 + int.from_bytes(head[3:5], "big") if len(head) >= 5 and head[0] == 0x16 else 5
        if len(head) < min(need, TLS_RECORD):
            conn.peeked = len(head)
            try:
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, need)
            except OSError:
                pass
            return
        if conn.peeked:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        if not self._may_handshake:  # a whole ClientHello, this turn's handshake budget spent
            self._held = conn
            return
        context = self.tls()
        if context is None:  # TLS turned off by a reload meanwhile
            conn.state = HEAD
            self._read(conn)
            return
        try:
            conn.sock = context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        except (ssl.SSLError, OSError) as exc:
            self._tls_failed(conn, "TLS", exc)
            return
        conn.tls = True
        conn.state = HANDSHAKE
        self._handshake(conn)

    def _tls_failed(self: _Loop, conn: Conn, step: str, exc: Exception) -> None:
        """A wrap or handshake that failed: counted, logged at debug (a scanner's garbage is not news), reset."""
        self.count("failures")
        log.debug("%s from %s failed: %s", step, conn.address[0], exc)
        self._close(conn, graceful=False)

    def _handshake(self: _Loop, conn: Conn) -> None:
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            self._watch(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as exc:
            self._tls_failed(conn, "TLS handshake", exc)
            return
        conn.state = HEAD
        self._watch(conn, selectors.EVENT_READ)
        self._read(conn)  # the request may be decrypted and waiting in the TLS buffer

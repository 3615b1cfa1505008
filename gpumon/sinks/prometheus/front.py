"""The endpoint's front: accepts, TLS handshakes and request heads in one selector loop.

A connection that has not sent a whole request head costs a file descriptor and one small object
here, no thread and no slot, so idle, stalled or trickling clients cannot crowd out a scraper, even
one behind the same address. Each connection has a deadline (handshake and first byte, then the
whole head, then the answer); only a complete head is handed to the application, which answers it in
the loop (a pre-rendered page needs no thread) or hands back a job for the worker pool (what must
block, such as a bcrypt check). The limit is file descriptors: the soft ``RLIMIT_NOFILE`` is raised
to the hard one, a reserve is kept for the rest of the daemon, and when the connections reach the
rest the one that has sent the least for the longest is closed for a newcomer, never one whose
request is complete. A connection that has sent nothing is not closed at its first-byte deadline
while the connections stay below a high-water mark of that budget (closing it only makes its client
reconnect, which costs more than the descriptor): it is kept up to ``IDLE_TIMEOUT``, like a
keep-alive idle timeout, and above the mark the ones silent for the first-byte timeout are reaped
oldest first. One that has started speaking keeps its handshake and head deadlines. Each turn
answers what is ready (requests, writes, accepts) before it takes TLS handshake steps, and spends
only a few milliseconds on those (a handshake with a client certificate takes some milliseconds of
CPU), queuing the rest: a handshake flood delays a ready request by about that, not by every
handshake it has pending.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import queue
import random
import selectors
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gpumon.log_once import LogOnce
from gpumon.sinks.prometheus.connections import (
    BUSY,
    HANDSHAKE,
    HEAD,
    WAIT_TLS,
    App,
    Conn,
    Limits,
    Reply,
    Table,
)
from gpumon.sinks.prometheus.tls_steps import TLS_RECORD, TlsSteps

log = logging.getLogger("gpumon.sinks.prometheus")

TLS_CHUNK = 16384
"""Bytes per TLS write: a write that would block must be retried with the same length."""
_ACCEPT_BATCH = 256
_EXPIRE_BATCH = 512
DEADLINE_SPREAD = 0.25
"""A connection's first-byte and head deadlines fall between the timeout and 1.25 times it: a crowd
that connected together (a flood) is not cut, and back, together, in one wave a scraper queues behind."""
_RECV = 65536

class Front(TlsSteps):
    """The loop: one thread, one selector, a heap of deadlines and a small worker pool."""

    def __init__(self, listener: socket.socket, app: App, limits: Limits,
                 tls: Callable[[], ssl.SSLContext | None], count: Callable[[str], None],
                 source_of: Callable[[str], str], workers: int = 2) -> None:
        self.listener, self.app, self.limits = listener, app, limits
        self.tls, self.count, self.source_of = tls, count, source_of
        self.slots = Table()
        self.selector = selectors.DefaultSelector()
        self._heap: list[tuple[float, int, Conn]] = []
        self._seq = itertools.count()
        self._done: queue.SimpleQueue[tuple[Conn, Reply | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._closing = threading.Event()
        self._limit_log = LogOnce(log)
        self._error_log = LogOnce(log)
        self._spare: int | None = self._open_spare()
        self._accept_paused_until = 0.0
        self._deferred = deque()  # the TLS steps' state (tls_steps.TlsSteps declares and uses it)
        self._may_handshake = True
        self._held = None
        self.refused = 0
        self.offloaded = 0
        """Requests answered on a worker (a bcrypt check)."""
        self._limit_refused = False
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self.thread = threading.Thread(target=self._run, name="prometheus-http", daemon=True)

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """Close every connection and the listener; returns within ``timeout``."""
        self._closing.set()
        self._wake()
        self.thread.join(timeout)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    @staticmethod
    def _open_spare() -> int | None:
        """A descriptor held back so that at the limit a connection can still be accepted and
        closed at once, rather than left in the backlog where it keeps the listener readable."""
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                now = time.monotonic()
                timeout = None  # idle: sleep until a connection, a worker's answer or stop
                if self._heap:
                    timeout = max(0.0, self._heap[0][0] - now)
                if self._accept_paused_until:
                    if now >= self._accept_paused_until:
                        self._accept_paused_until = 0.0
                        self.selector.register(self.listener, selectors.EVENT_READ, None)
                    else:
                        timeout = min(timeout or 0.05, 0.05)
                if self._deferred:
                    timeout = 0  # handshake steps wait their turn: poll, then take them
                handshakes = []
                for key, mask in self.selector.select(timeout):
                    data = key.data
                    if isinstance(data, Conn) and data.state in (WAIT_TLS, HANDSHAKE):
                        handshakes.append((data, mask))  # after what is ready to be answered
                    else:
                        self._dispatch(data, mask)
                self._handshake_steps(handshakes)
                now = time.monotonic()
                self._expire(now)
                if len(self.slots) > self.limits.high_water_mark:
                    self._reap(now)
        except Exception:
            log.exception("the Prometheus endpoint's loop failed")
        finally:
            self._shutdown()

    def _dispatch(self, data: object, mask: int) -> None:
        try:
            if data is None:
                self._accept()
            elif data is self._wake_r:
                self._drain_wake()
            elif isinstance(data, Conn) and not data.closed:
                self._ready(data, mask)
        except Exception:  # one connection's surprise must not take the endpoint down
            self.count("failures")
            self._error_log.error("loop", "the Prometheus endpoint failed on a connection; it "
                                  "was closed (logged once)", exc_info=True)
            if isinstance(data, Conn):
                self._close(data, graceful=False)

    def _shutdown(self) -> None:
        for conn in list(self.slots.conns):
            self._close(conn)
        for sock in (self.listener, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        self.selector.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- accept -------------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._at_fd_limit(exc)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                log.debug("accept failed: %s", exc)
                return
            self._admit(sock, address)

    def _at_fd_limit(self, exc: OSError) -> None:
        """Out of descriptors: refuse the waiting connection (accept it on the spare and close it),
        count it, log once. Open connections are not touched: established scrapes go on."""
        self._refuse_counted(f"out of file descriptors ({exc.strerror}): new connections are refused "
                             "until some close; established ones are served")
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
            try:
                sock, _ = self.listener.accept()
                sock.close()
            except OSError:
                pass
            self._spare = self._open_spare()
        if self._spare is None:  # nothing to accept with: stop polling the listener a moment
            self.selector.unregister(self.listener)
            self._accept_paused_until = time.monotonic() + 0.05

    def _refuse_counted(self, why: str) -> None:
        self.refused += 1
        self.count("failures")
        self._limit_refused = True
        self._limit_log.warning("limit", "connection refused: %s (logged once, counted every time as a "
                                "failure of the prometheus sink)", why)

    def _admit(self, sock: socket.socket, address: tuple) -> None:
        now = time.monotonic()
        source = self.source_of(address[0])
        slots = self.slots
        if len(slots) >= self.limits.max_connections:
            victim = None
            if slots.by_source.get(source, 0) < self.limits.per_source:
                victim = slots.victim(now)
            if victim is None:
                sock.close()
                self._refuse_counted(f"{len(slots)} connections open, the most the descriptor limit "
                                     "leaves ([prometheus] max_connections), none of them idle")
                return
            self._close(victim, graceful=False)
            self.count("evictions")
        elif self._limit_refused and len(slots) < self.limits.max_connections // 2:
            self._limit_refused = False  # well clear of the limit: the next time is logged again
            self._limit_log.clear()
        sock.setblocking(False)
        try:  # an answer is several writes (head, body, TLS records): with Nagle's algorithm the
            # second waits for the client's delayed ACK, 40 ms on each kept-alive scrape (Go sets it too)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        context = self.tls()
        conn = Conn(sock, source, address, now, now + _spread(self.limits.first_byte_timeout))
        slots.add(conn)
        self._push(conn)
        if context is not None:
            conn.state = WAIT_TLS  # no TLS state until the client speaks: an idle one costs an fd
            self._watch(conn, selectors.EVENT_READ)
            return
        self._read(conn)  # a scraper's request is often there already: answered without registering
        if not conn.closed and conn.state == HEAD:
            self._watch(conn, selectors.EVENT_READ)

    # -- per connection -----------------------------------------------------------------------

    def _watch(self, conn: Conn, events: int) -> None:
        if conn.events == events or conn.closed:
            return
        if not events:
            self.selector.unregister(conn.fd)
        elif not conn.events:
            self.selector.register(conn.fd, events, conn)
        else:
            self.selector.modify(conn.fd, events, conn)
        conn.events = events

    def _push(self, conn: Conn) -> None:
        heap = self._heap
        heapq.heappush(heap, (conn.deadline, next(self._seq), conn))
        if len(heap) > 4 * len(self.slots) + 1024:  # mostly superseded deadlines of closed connections
            heap[:] = [(c.deadline, next(self._seq), c) for c in self.slots.conns]  # in place: callers hold it
            heapq.heapify(heap)

    def _expire(self, now: float) -> None:
        """Close what is past its deadline, at most ``_EXPIRE_BATCH`` at a time, so that a crowd cut
        at once does not keep requests already in waiting."""
        heap = self._heap
        for _ in range(_EXPIRE_BATCH):
            if not heap or heap[0][0] > now:
                return
            deadline, _, conn = heapq.heappop(heap)
            if conn.closed or conn.deadline != deadline:
                continue  # superseded by a later deadline
            if conn.state == BUSY and not conn.out:
                conn.deadline = now + self.limits.request_timeout  # a worker has it: it answers
                self._push(conn)
                continue
            if self._keeps_silent(conn, now):
                conn.deadline = conn.since + self.limits.idle_timeout  # costs only its descriptor
                self._push(conn)
                continue
            if conn.received or conn.state == BUSY:
                self.count("failures")  # a trickled head or handshake, or a reader too slow
            self._close(conn, graceful=False)

    def _keeps_silent(self, conn: Conn, now: float) -> bool:
        """Whether a connection at its deadline that has sent nothing is kept: within the idle limit.
        Closing it would only make its client reconnect. Pressure is not judged here but by
        ``_reap``, oldest first: closing whichever deadline comes due would cut the newest (the
        spread puts a younger one's deadline before an older one's) and leave the oldest."""
        return (not conn.received and conn.state in (HEAD, WAIT_TLS) and not conn.buf
                and conn in self.slots.silent and now < conn.since + self.limits.idle_timeout)

    def _reap(self, now: float) -> None:
        """Above the high-water mark: close silent connections that have been silent for the
        first-byte timeout, the oldest first, until the connections are back at the mark (at most
        a batch per turn). ``silent`` is in accept order, so the first too young ends the scan."""
        slots, mark = self.slots, self.limits.high_water_mark
        cutoff = now - self.limits.first_byte_timeout
        for _ in range(_EXPIRE_BATCH):
            if len(slots) <= mark:
                return
            conn = slots.oldest_silent()
            if conn is None or conn.since > cutoff:
                return
            self._close(conn, graceful=False)

    def _spoke(self, conn: Conn) -> None:
        """A silent connection's first bytes: it is no longer silent, and a handshake or head it has
        started must finish within ``request_timeout`` however long it was kept idle."""
        self.slots.silent.pop(conn, None)
        deadline = time.monotonic() + _spread(self.limits.request_timeout)
        if deadline < conn.deadline:
            conn.deadline = deadline
            self._push(conn)

    def _ready(self, conn: Conn, mask: int) -> None:
        if conn.state == WAIT_TLS:
            self._start_tls(conn)
        elif conn.state == HANDSHAKE:
            self._handshake(conn)
        elif conn.state == HEAD:
            self._read(conn)
        elif conn.out:
            self._write(conn)

    def _read(self, conn: Conn) -> None:
        eof = False
        cap = self.limits.max_header_bytes + 4
        while len(conn.buf) <= cap:
            try:
                data = conn.sock.recv(_RECV)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except (ssl.SSLError, OSError):
                eof = True
                break
            if not data:
                eof = True
                break
            if not conn.received:
                self._spoke(conn)
            if not conn.buf:  # a request's first byte: the whole head has request_timeout from here
                conn.deadline = time.monotonic() + _spread(self.limits.request_timeout)
                self._push(conn)
            conn.received += len(data)
            conn.buf += data
            if len(data) < _RECV and not (conn.tls and conn.sock.pending()):  # type: ignore[attr-defined]
                break
        self._advance(conn, eof)

    def _advance(self, conn: Conn, eof: bool) -> None:
        """Hand a complete head on; refuse one past the cap; close a connection that hung up
        before finishing one (a half-closed one with a whole request is still answered)."""
        buf, limit = conn.buf, self.limits.max_header_bytes
        end = _head_end(buf, conn.scanned)
        if end < 0:
            conn.scanned = max(0, len(buf) - 3)
            if len(buf) >= limit:
                line_end = buf.find(b"\n", 0, limit + 1)
                self._reply(conn, self.app.refuse(conn, 414 if line_end < 0 else 431))
            elif eof:
                self._close(conn)
            return
        if end > limit:
            line_end = buf.find(b"\n", 0, limit + 1)
            self._reply(conn, self.app.refuse(conn, 414 if line_end < 0 else 431))
            return
        head = bytes(buf[:end])
        del buf[:end]
        conn.scanned = 0
        conn.close_after = eof
        conn.state = BUSY
        try:
            result = self.app.respond(conn, head)
        except Exception:
            self.count("failures")
            log.debug("error answering %s", conn.address[0], exc_info=True)
            self._close(conn, graceful=False)
            return
        if isinstance(result, Reply):
            self._reply(conn, result)
        else:
            self._watch(conn, 0)
            self._submit(conn, result)

    def _submit(self, conn: Conn, job: Callable[[], Reply]) -> None:
        self.offloaded += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="prometheus-worker")

        def run() -> None:
            try:
                reply: Reply | None = job()
            except Exception:
                log.debug("error answering %s", conn.address[0], exc_info=True)
                reply = None
            self._done.put((conn, reply))
            self._wake()

        self._pool.submit(run)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while True:
            try:
                conn, reply = self._done.get_nowait()
            except queue.Empty:
                return
            if conn.closed:
                continue
            if reply is None:
                self.count("failures")
                self._close(conn, graceful=False)
            else:
                self._reply(conn, reply)

    def _reply(self, conn: Conn, reply: Reply) -> None:
        conn.state = BUSY
        self.slots.silent.pop(conn, None)
        conn.out, conn.pos = [c for c in reply.chunks if c], 0
        conn.close_after = conn.close_after or reply.close
        conn.deadline = time.monotonic() + self.limits.request_timeout  # a reader too slow is cut
        self._push(conn)
        self._write(conn)

    def _write(self, conn: Conn) -> None:
        out = conn.out
        while out:
            chunk = memoryview(out[0])[conn.pos:]
            if conn.tls:
                chunk = chunk[:TLS_CHUNK]
            try:
                sent = conn.sock.send(chunk)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                self._watch(conn, selectors.EVENT_WRITE)
                return
            except ssl.SSLWantReadError:
                self._watch(conn, selectors.EVENT_READ)
                return
            except (ssl.SSLError, OSError):
                self._close(conn, graceful=False)
                return
            conn.pos += sent
            if conn.pos >= len(out[0]):
                out.pop(0)
                conn.pos = 0
        if conn.close_after:
            self._close(conn)
            return
        # kept alive: the next request has request_timeout to arrive
        conn.state = HEAD
        conn.deadline = time.monotonic() + self.limits.request_timeout
        self._push(conn)
        self._watch(conn, selectors.EVENT_READ)
        if conn.tls:  # a pipelined request may be decrypted and waiting in the TLS buffer
            self._read(conn)
        elif conn.buf:  # a pipelined request
            self._advance(conn, False)

    def _close(self, conn: Conn, graceful: bool = True) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.slots.remove(conn)
        if conn.events:
            try:
                self.selector.unregister(conn.fd)
            except (KeyError, ValueError):
                pass
            conn.events = 0
        # A polite close reads what was only peeked, so that it sends FIN, not RST. A cut one (a stalled
        # ClientHello at its deadline) is reset: no read, and no TIME_WAIT left for each one a flood makes.
        if graceful and conn.peeked and not conn.tls:
            try:
                conn.sock.recv(TLS_RECORD)
            except OSError:
                pass
        try:
            if graceful:  # FIN after the answer, so a client reading to EOF gets all of it
                socket.socket.shutdown(conn.sock, socket.SHUT_WR)
        except OSError:
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        conn.buf = bytearray()
        conn.out = []


def _spread(timeout: float) -> float:
    return timeout * (1.0 + DEADLINE_SPREAD * random.random())


def _head_end(buf: bytearray, start: int) -> int:
    """Index just past the blank line ending a request head, or -1: LF or CRLF line ends, as
    ``http.client`` parses them."""
    i = buf.find(b"\n", start)
    while i >= 0:
        j = i + 1
        if j < len(buf) and buf[j] == 0x0D:
            j += 1
        if j < len(buf) and buf[j] == 0x0A:
            return j + 1
        i = buf.find(b"\n", i + 1)
    return -1

"""The one delivery machine of the sinks: an :class:`Uploader` thread that reads a batch from the
sink's queue, hands it to the sink's ``send``, acknowledges it when the sink says so, and waits out
the backoff the outcome asks for.

The queue is the sink's choice (:class:`Queue`): the on-disk spool (:mod:`gpumon.sinks.spool`) of
remote write and Azure Monitor, or one of the in-memory queues of :mod:`gpumon.sinks.queues`, as the
OpenTelemetry sink's latest-snapshot slot and bounded event queue. A sink over it only encodes (on
the loop's thread), sends and classifies (one batch -> :class:`Outcome`). The retry loop, the backoff
(:class:`gpumon.backoff.Backoff`, the sink's policy: jitter, Retry-After as a floor or as the delay),
a round that raised, the stop within a deadline (drain what is queued, or cut the wait short and try
once more) and whether the thread still runs are here, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from gpumon.backoff import Backoff

__all__ = ["IDLE_WAIT", "BatchSize", "Outcome", "Queue", "Sender", "Uploader"]

IDLE_WAIT = 5.0
"""Seconds the uploader sleeps on an empty queue before it looks again (a wake ends it at once)."""

B = TypeVar("B")
B_contra = TypeVar("B_contra", contravariant=True)


class Queue(Protocol[B]):
    """Where an :class:`Uploader` reads its batches: the spool, or an in-memory queue."""

    def read(self, max_records: int = ..., max_bytes: int = ...) -> B | None:
        """The next batch not yet acknowledged, or None when nothing is due."""

    def ack(self, batch: B) -> None:
        """``batch`` is done with: it is not read again."""

    def pending(self) -> int:
        """Records not yet acknowledged (the drain at stop waits for none)."""

    def due_in(self) -> float | None:
        """Seconds until something held back becomes due (an export interval); None: only a wake."""

    def sync(self) -> None:
        """Make what was appended durable (nothing to do for a queue in memory)."""

    def close(self) -> None:
        """The uploader's thread is gone: release what the queue holds open."""


@dataclass(frozen=True)
class Outcome:
    """What became of one batch, as the sink classified it."""

    ack: bool
    """The batch is done with (delivered, or given up on and counted): acknowledged in the queue."""
    retry: bool = False
    """An attempt failed: back off before the next round (with ``ack``: the batch is done with, but
    the receiver still needs a rest, as after a split request whose rest was spooled anew)."""
    retry_after: float | None = None
    """The receiver's Retry-After, in seconds (0 or None: the backoff's own delay)."""
    config: bool = False
    """A fault a person must fix (401/403/404, no token): the backoff starts from its floor."""
    delivered: bool = False
    """Something went through in this round: the backoff starts over (before a retry is counted)."""


class Sender(Protocol[B_contra]):
    """What a sink gives its :class:`Uploader`."""

    def send(self, batch: B_contra) -> Outcome:
        """Deliver one batch read from the queue; classify the answer. May append to the queue
        (what must be sent again apart), never acknowledges."""

    def fault(self, exc: Exception) -> Outcome:
        """A round raised (spool I/O such as EIO or ENOSPC, or a bug): count and log it; the thread
        goes on."""


@dataclass(frozen=True)
class BatchSize:
    """How much one round reads from the queue."""

    records: int
    bytes: int = 4 << 20


class Uploader(Generic[B]):
    """One thread draining one queue through one :class:`Sender`.

    ``backoff`` is the sink's policy; ``config_floor`` the seconds a configuration fault waits at
    least; ``idle_resets``: an empty queue starts the backoff over (otherwise only a delivery does).
    ``drain_margin``: seconds of the stop deadline kept for ending the request in flight (``abort``)
    and joining the thread after the drain. ``after_round``: called after every round that did not
    raise (an empty one included), as a sink that reported a raising round clears that report.
    ``retrying``: called with the delay before each wait a failed round asks for (a sink's log line
    says when the next try is). ``last_try``: at stop, the backoff wait is cut short and what is
    queued is tried once more, a round after another while they deliver, instead of drained at the
    backoff's pace (what is not sent then is the sink's to count). ``on_exit``: called on the
    thread as it ends (a connection is closed by the thread that used it)."""

    def __init__(self, name: str, queue: Queue[B], sender: Sender[B], backoff: Backoff, *, size: BatchSize,
                 config_floor: float, clock: Callable[[], float] = time.monotonic,
                 idle_resets: bool = False, drain_margin: float = 0.0,
                 after_round: Callable[[], None] | None = None,
                 retrying: Callable[[float], None] | None = None, last_try: bool = False,
                 on_exit: Callable[[], None] | None = None) -> None:
        self.queue = queue
        self.backoff = backoff
        self._sender = sender
        self._size = size
        self._config_floor = config_floor
        self._clock = clock
        self._idle_resets = idle_resets
        self._drain_margin = drain_margin
        self._after_round = after_round
        self._retrying = retrying
        self._last_try = last_try
        self._on_exit = on_exit
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._cut = threading.Event()
        """Ends a backoff wait: set at stop (with ``last_try``, as soon as the stop begins)."""
        self._final = threading.Event()
        """``last_try`` and stopping: every round is a last try."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- the sink's side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        """Records were queued: look at the queue now."""
        self._wake.set()

    @property
    def name(self) -> str:
        return self._thread.name

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> threading.Event:
        """Set once :meth:`stop` gives up draining (a sink's own helper thread may wait on it)."""
        return self._stopping

    def begin_stop(self) -> None:
        """With ``last_try``: make the next round the last try now, without waiting (a sink with
        several uploaders lets them all try at once, then stops each)."""
        if self._last_try:
            self._final.set()
            self._cut.set()
            self._wake.set()

    def stop(self, deadline: float, abort: Callable[[], None] | None = None) -> None:
        """Let the thread send what is queued until ``deadline`` (less ``drain_margin``), then end
        it: ``abort`` ends a request in flight. Whatever a spool did not deliver stays on disk for
        the next start; the queue is closed when the thread is gone, else synced."""
        if self._thread.is_alive():
            if self._last_try:
                self.begin_stop()
                self._thread.join(max(0.0, deadline - self._drain_margin - self._clock()))
            else:
                self._wake.set()
                self._drain(deadline - self._drain_margin)
        self._stopping.set()
        self._cut.set()
        self._wake.set()
        if abort is not None:
            abort()
        if self._thread.ident is not None:  # started
            self._thread.join(max(0.0, deadline - self._clock()))
        if self._thread.is_alive():
            self.queue.sync()
        else:
            self.queue.close()

    def _drain(self, until: float) -> None:
        """Wait until every record is acknowledged (or ``until``, or the thread is gone)."""
        while self.queue.pending() and self._clock() < until and self._thread.is_alive():
            self._wake.set()
            time.sleep(0.02)  # polling the queue with a deadline; the uploader does the work

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        """Rounds until stopped; a round that raised is the sender's to count and is retried."""
        try:
            while not self._stopping.is_set():
                last = self._final.is_set()
                try:
                    outcome = self._round(last)
                except Exception as exc:  # queue I/O or a bug: the thread must outlive it
                    outcome = self._sender.fault(exc)
                else:
                    if self._after_round is not None:
                        self._after_round()
                delay = self._account(outcome)
                if delay and self._retrying is not None:
                    self._retrying(delay)
                if last and (outcome is None or not outcome.delivered):
                    return  # the last try: nothing left, or it did not go
                if delay and not self._final.is_set():
                    self._cut.wait(delay)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _round(self, last: bool = False) -> Outcome | None:
        """Send one batch and acknowledge it if the sender says so; None when there was none (after
        waiting idle, unless this is the last try)."""
        self._wake.clear()
        self.queue.sync()
        batch = self.queue.read(max_records=self._size.records, max_bytes=self._size.bytes)
        if batch is None:
            if not last:
                due = self.queue.due_in()
                self._wake.wait(timeout=IDLE_WAIT if due is None else min(IDLE_WAIT, max(due, 0.001)))
            return None
        outcome = self._sender.send(batch)
        if outcome.ack:
            self.queue.ack(batch)
        return outcome

    def _account(self, outcome: Outcome | None) -> float:
        """The backoff's verdict on a round: seconds to wait before the next one."""
        if outcome is None:
            if self._idle_resets:
                self.backoff.succeeded()
            return 0.0
        if outcome.delivered:
            self.backoff.succeeded()
        if not outcome.retry:
            return 0.0
        floor = self._config_floor if outcome.config else None
        return self.backoff.failed(self._clock(), outcome.retry_after, floor)

"""The one delivery machine of the spooled sinks: an :class:`Uploader` thread that reads a batch
from the sink's on-disk spool, hands it to the sink's ``send``, acknowledges it when the sink says
so, and waits out the backoff the outcome asks for.

A sink over it only encodes (into spool records, on the loop's thread), sends and classifies (one
batch -> :class:`Outcome`). Queueing, the retry loop, the backoff (:class:`gpumon.backoff.Backoff`,
the sink's policy: jitter, Retry-After as a floor or as the delay), a round that raised, the drain
at stop within a deadline and whether the thread still runs are here, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpumon.backoff import Backoff
from gpumon.sinks.spool import Batch, Spool, SpoolStats

__all__ = ["IDLE_WAIT", "BatchSize", "Outcome", "Sender", "Uploader"]

IDLE_WAIT = 5.0
"""Seconds the uploader sleeps on an empty spool before it looks again (a wake ends it at once)."""


@dataclass(frozen=True)
class Outcome:
    """What became of one batch, as the sink classified it."""

    ack: bool
    """The batch is done with (delivered, or given up on and counted): acknowledged in the spool."""
    retry: bool = False
    """An attempt failed: back off before the next round (with ``ack``: the batch is done with, but
    the receiver still needs a rest, as after a split request whose rest was spooled anew)."""
    retry_after: float | None = None
    """The receiver's Retry-After, in seconds (0 or None: the backoff's own delay)."""
    config: bool = False
    """A fault a person must fix (401/403/404, no token): the backoff starts from its floor."""
    delivered: bool = False
    """Something went through in this round: the backoff starts over (before a retry is counted)."""


class Sender(Protocol):
    """What a sink gives its :class:`Uploader`."""

    def send(self, batch: Batch) -> Outcome:
        """Deliver one batch read from the spool; classify the answer. May append to the spool
        (what must be sent again apart), never acknowledges."""

    def fault(self, exc: Exception) -> Outcome:
        """A round raised (spool I/O such as EIO or ENOSPC, or a bug): count and log it; the thread
        goes on."""


@dataclass(frozen=True)
class BatchSize:
    """How much one round reads from the spool."""

    records: int
    bytes: int = 4 << 20


class Uploader:
    """One thread draining one spool through one :class:`Sender`.

    ``backoff`` is the sink's policy; ``config_floor`` the seconds a configuration fault waits at
    least; ``idle_resets``: an empty spool starts the backoff over (otherwise only a delivery does).
    ``drain_margin``: seconds of the stop deadline kept for ending the request in flight (``abort``)
    and joining the thread after the drain. ``after_round``: called after every round that did not
    raise (an empty one included), as a sink that reported a raising round clears that report."""

    def __init__(self, name: str, spool: Spool, sender: Sender, backoff: Backoff, *, size: BatchSize,
                 config_floor: float, clock: Callable[[], float] = time.monotonic,
                 idle_resets: bool = False, drain_margin: float = 0.0,
                 after_round: Callable[[], None] | None = None) -> None:
        self.spool = spool
        self.backoff = backoff
        self._sender = sender
        self._size = size
        self._config_floor = config_floor
        self._clock = clock
        self._idle_resets = idle_resets
        self._drain_margin = drain_margin
        self._after_round = after_round
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- the sink's side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        """Records were appended: look at the spool now."""
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> threading.Event:
        """Set once :meth:`stop` gives up draining (a sink's own helper thread may wait on it)."""
        return self._stopping

    def stats(self) -> SpoolStats:
        return self.spool.stats()

    def stop(self, deadline: float, abort: Callable[[], None] | None = None) -> None:
        """Let the thread send what is spooled until ``deadline`` (less ``drain_margin``), then end
        it: ``abort`` ends a request in flight. Whatever is not delivered stays on disk for the next
        start; the spool is closed when the thread is gone, else synced."""
        if self._thread.is_alive():
            self._wake.set()
            self._drain(deadline - self._drain_margin)
        self._stopping.set()
        self._wake.set()
        if abort is not None:
            abort()
        if self._thread.ident is not None:  # started
            self._thread.join(max(0.0, deadline - self._clock()))
        if self._thread.is_alive():
            self.spool.sync()
        else:
            self.spool.close()

    def _drain(self, until: float) -> None:
        """Wait until every record is acknowledged (or ``until``, or the thread is gone)."""
        while self.spool.stats().records and self._clock() < until and self._thread.is_alive():
            self._wake.set()
            time.sleep(0.02)  # polling the spool with a deadline; the uploader does the work

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        """Rounds until stopped; a round that raised is the sender's to count and is retried."""
        while not self._stopping.is_set():
            try:
                outcome = self._round()
            except Exception as exc:  # spool I/O or a bug: the thread must outlive it
                outcome = self._sender.fault(exc)
            else:
                if self._after_round is not None:
                    self._after_round()
            delay = self._account(outcome)
            if delay:
                self._stopping.wait(delay)

    def _round(self) -> Outcome | None:
        """Send one batch and acknowledge it if the sender says so; None after waiting idle."""
        self._wake.clear()
        self.spool.sync()
        batch = self.spool.read(max_records=self._size.records, max_bytes=self._size.bytes)
        if batch is None:
            self._wake.wait(timeout=IDLE_WAIT)
            return None
        outcome = self._sender.send(batch)
        if outcome.ack:
            self.spool.ack(batch)
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

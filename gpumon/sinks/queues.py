"""The in-memory queues an :class:`~gpumon.sinks.delivery.Uploader` can drain, beside the on-disk
spool, for data that is not worth keeping across a restart:

- :class:`LatestSlot`, a queue of one: only the newest item is sent (a snapshot of cumulative
  values carries everything an older one had), at most once per interval when there is one;
- :class:`BoundedQueue`, the oldest items evicted when it is full (events), each item counted once:
  evicted while waiting (dropped), or by the outcome of the batch it left in.

Both are filled on the loop's thread and read on the uploader's; each holds its own lock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["BoundedQueue", "Held", "LatestSlot", "Taken"]

T = TypeVar("T")


@dataclass(frozen=True)
class Held(Generic[T]):
    """What a :class:`LatestSlot` read gives: the newest item."""

    item: T


class LatestSlot(Generic[T]):
    """A queue of one. ``put`` replaces what was there; ``read`` gives the item when ``fresh(item,
    sent)`` says it is worth sending after the latest acknowledged one (``sent``, None before the
    first) and, with an ``interval``, not before the next tick (ticks fall every ``interval`` seconds,
    taken at each read that gives an item). An item read and not acknowledged (a failed export) is
    read again, or whatever newer item replaced it. After :meth:`last_try` the interval no longer holds
    anything back."""

    def __init__(self, fresh: Callable[[T, T | None], bool], interval: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fresh = fresh
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._latest: T | None = None
        self._sent: T | None = None
        self._next_tick = clock() + interval
        self._last_try = False

    def put(self, item: T) -> None:
        with self._lock:
            self._latest = item

    def start_ticks(self) -> None:
        """The first tick falls one ``interval`` from now (the consumer is ready to send)."""
        with self._lock:
            self._next_tick = self._clock() + self._interval

    def last_try(self) -> None:
        """Stopping: the latest item is due now, whatever the interval."""
        with self._lock:
            self._last_try = True

    def _due(self) -> T | None:
        item = self._latest
        return item if item is not None and self._fresh(item, self._sent) else None

    def read(self, max_records: int = 1, max_bytes: int = 0) -> Held[T] | None:
        with self._lock:
            item = self._due()
            if item is None:
                return None
            if self._interval and not self._last_try:
                now = self._clock()
                if now < self._next_tick:
                    return None
                self._next_tick = max(self._next_tick + self._interval, now)
            return Held(item)

    def ack(self, batch: Held[T]) -> None:
        with self._lock:
            self._sent = batch.item

    def pending(self) -> int:
        with self._lock:
            return 0 if self._due() is None else 1

    def due_in(self) -> float | None:
        with self._lock:
            if not self._interval or self._last_try or self._due() is None:
                return None
            return max(0.0, self._next_tick - self._clock())

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Taken(Generic[T]):
    """A batch read from a :class:`BoundedQueue`: its items and the sequence number of the last."""

    items: tuple[T, ...]
    last: int


class BoundedQueue(Generic[T]):
    """At most ``limit`` items, oldest first; a ``put`` into a full queue evicts the oldest.

    Every item is counted once. One evicted while it waits is dropped, and ``put`` returns how many
    were. One evicted while the batch it is in is being sent is that batch's outcome's to count: the
    batch is removed by :meth:`ack` up to its last sequence number (never the newer items that took
    the evicted ones' places), or kept by :meth:`release`, which says how many of the batch were
    evicted meanwhile (they will not be sent again)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[int, T]] = collections.deque()
        """Items with their sequence numbers (from 1), oldest first."""
        self._seq = 0
        self._in_flight = 0
        """Sequence number of the last item of the batch being sent; 0 when none is."""

    def put(self, items: Iterable[T]) -> int:
        """Queue ``items``; the number of waiting items evicted to make room (dropped)."""
        dropped = 0
        with self._lock:
            for item in items:
                if len(self._items) >= self._limit:
                    seq, _ = self._items.popleft()
                    if seq > self._in_flight:  # one being sent is counted by its send's outcome
                        dropped += 1
                self._seq += 1
                self._items.append((self._seq, item))
        return dropped

    def read(self, max_records: int = 512, max_bytes: int = 0) -> Taken[T] | None:
        with self._lock:
            if not self._items:
                return None
            head = [self._items[i] for i in range(min(max_records, len(self._items)))]
            self._in_flight = head[-1][0]
            return Taken(tuple(item for _, item in head), head[-1][0])

    def _left_of(self, batch: Taken[T]) -> int:
        """How many of ``batch`` are still at the head of the queue."""
        left = 0
        while left < len(self._items) and self._items[left][0] <= batch.last:
            left += 1
        return left

    def ack(self, batch: Taken[T]) -> None:
        """``batch`` is done with: what is left of it leaves the queue."""
        with self._lock:
            self._in_flight = 0
            for _ in range(self._left_of(batch)):
                self._items.popleft()

    def release(self, batch: Taken[T]) -> int:
        """``batch`` stays to be sent again; the number of its items evicted while it was out."""
        with self._lock:
            self._in_flight = 0
            return len(batch.items) - self._left_of(batch)

    def clear(self) -> int:
        """Empty the queue; the number of items it held."""
        with self._lock:
            count = len(self._items)
            self._items.clear()
            return count

    def pending(self) -> int:
        with self._lock:
            return len(self._items)

    def due_in(self) -> float | None:
        return None

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

"""The in-memory queues the Uploader drains beside the spool: a latest-item slot (only the newest is
sent, at most once per interval, a failed one read again or superseded) and a bounded queue (the
oldest evicted, each item counted once, also when evicted while its batch is out); and the Uploader's
last try at stop, which cuts the backoff short and tries once more while rounds deliver."""

from __future__ import annotations

import threading
import time

from gpumon.backoff import NO_JITTER, Backoff
from gpumon.sinks.delivery import BatchSize, Outcome, Uploader
from gpumon.sinks.queues import BoundedQueue, Held, LatestSlot, Taken
from tests.conftest import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_slot_gives_only_the_newest_item_until_it_is_acknowledged():
    slot: LatestSlot[str] = LatestSlot(lambda new, sent: new != sent)
    assert slot.read() is None and slot.pending() == 0
    slot.put("a")
    slot.put("b")
    held = slot.read()
    assert held == Held("b") and slot.pending() == 1
    assert slot.read() == Held("b")  # not acknowledged (a failed export): read again
    slot.put("c")
    assert slot.read() == Held("c")  # or whatever replaced it
    slot.ack(Held("c"))
    assert slot.read() is None and slot.pending() == 0 and slot.due_in() is None


def test_the_slot_holds_an_item_back_until_the_next_tick_of_its_interval_unless_it_is_the_last_try():
    clock = Clock()
    slot: LatestSlot[int] = LatestSlot(lambda new, sent: new is not sent, interval=10.0, clock=clock)
    slot.put(1)
    assert slot.read() is None and slot.due_in() == 10.0
    clock.now += 3.0
    slot.start_ticks()  # the sender is ready only now: the first tick is an interval from here
    assert slot.due_in() == 10.0
    clock.now += 10.0
    assert slot.read() == Held(1)  # the tick is taken: the next falls 10 s on
    slot.put(2)
    clock.now += 4.0
    assert slot.read() is None and slot.due_in() == 6.0
    slot.last_try()
    assert slot.read() == Held(2) and slot.due_in() is None


def test_the_bounded_queue_counts_each_item_once_also_when_evicted_while_its_batch_is_out():
    queue: BoundedQueue[str] = BoundedQueue(3)
    assert queue.put("abc") == 0
    batch = queue.read(max_records=2)
    assert batch == Taken(("a", "b"), 2)
    assert queue.put("de") == 0  # a and b are out: their batch's outcome counts them
    assert queue.put("f") == 1  # c was waiting: dropped
    assert queue.release(batch) == 2  # kept for a retry, but both were evicted meanwhile
    assert queue.pending() == 3
    retry = queue.read(max_records=2)
    assert retry == Taken(("d", "e"), 5)
    queue.put("g")  # evicts d, which is out
    queue.ack(retry)  # what is left of the batch (e) leaves; g, which took d's place, stays
    assert queue.read() == Taken(("f", "g"), 7)
    assert queue.clear() == 2 and queue.pending() == 0


class Script:
    """A sender answering from a script (then: delivered), recording what it saw."""

    def __init__(self, script: list[Outcome]) -> None:
        self.script = list(script)
        self.seen: list[tuple[str, ...]] = []
        self.times: list[float] = []

    def send(self, batch: Taken[str]) -> Outcome:
        self.seen.append(batch.items)
        self.times.append(time.monotonic())
        return self.script.pop(0) if self.script else Outcome(ack=True, delivered=True)

    def fault(self, exc: Exception) -> Outcome:
        raise AssertionError(exc)


def test_the_last_try_cuts_the_backoff_short_and_sends_while_rounds_deliver():
    queue: BoundedQueue[str] = BoundedQueue(10)
    sender = Script([Outcome(ack=False, retry=True)])
    delays: list[float] = []
    exited = threading.Event()
    up = Uploader("test-last-try", queue, sender, Backoff(30.0, 60.0, jitter=NO_JITTER), size=BatchSize(records=1),
                  config_floor=0.0, retrying=delays.append, last_try=True, on_exit=exited.set)
    queue.put("ab")
    up.start()
    up.notify()
    wait_for(lambda: delays == [30.0])  # the first round failed: a 30 s wait begins
    started = time.monotonic()
    up.stop(time.monotonic() + 5)
    assert time.monotonic() - started < 2
    assert sender.seen == [("a",), ("a",), ("b",)]  # tried again at once, then the rest while it went
    assert queue.pending() == 0 and not up.running and exited.is_set()


def test_the_last_try_ends_at_the_first_round_that_does_not_deliver_and_leaves_the_rest_queued():
    queue: BoundedQueue[str] = BoundedQueue(10)
    sender = Script([Outcome(ack=False, retry=True), Outcome(ack=False, retry=True)])
    up = Uploader("test-last-try", queue, sender, Backoff(30.0, 60.0, jitter=NO_JITTER), size=BatchSize(records=1),
                  config_floor=0.0, last_try=True)
    queue.put("ab")
    up.start()
    up.notify()
    wait_for(lambda: len(sender.seen) == 1)
    up.stop(time.monotonic() + 5)
    assert sender.seen == [("a",), ("a",)]
    assert queue.pending() == 2 and not up.running  # the sink counts what is left

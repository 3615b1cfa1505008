"""The shared Uploader over a real on-disk spool: it hands batches to the sender in order,
acknowledges only what the sender says is done, waits the sink's Backoff (Retry-After included)
after a failure, outlives a round that raised, and at stop drains within the deadline, leaving what
did not go on disk for the next start."""

from __future__ import annotations

import threading
import time

from gpumon.backoff import NO_JITTER, Backoff
from gpumon.sinks.delivery import BatchSize, Outcome, Uploader
from gpumon.sinks.spool import Batch, Spool
from tests.conftest import wait_for


class Sender:
    """Answers each batch from a script of outcomes (then: delivered), recording what it saw."""

    def __init__(self, script: list[Outcome | Exception]) -> None:
        self.script = list(script)
        self.seen: list[tuple[bytes, ...]] = []
        self.times: list[float] = []
        self.faults: list[Exception] = []
        self.release = threading.Event()
        self.release.set()

    def send(self, batch: Batch) -> Outcome:
        self.release.wait(10)
        self.seen.append(batch.records)
        self.times.append(time.monotonic())
        step = self.script.pop(0) if self.script else Outcome(ack=True, delivered=True)
        if isinstance(step, Exception):
            raise step
        return step

    def fault(self, exc: Exception) -> Outcome:
        self.faults.append(exc)
        return Outcome(ack=False, retry=True)


def _uploader(tmp_path, sender: Sender, backoff: Backoff, **kw) -> Uploader:
    spool = Spool(str(tmp_path / "spool"), 1 << 20)
    return Uploader("test-upload", spool, sender, backoff, size=BatchSize(records=1), config_floor=0.3, **kw)


def test_failures_back_off_with_retry_after_and_only_done_batches_are_acknowledged(tmp_path):
    sender = Sender([Outcome(ack=False, retry=True), Outcome(ack=False, retry=True, retry_after=0.25),
                     OSError("EIO")])
    backoff = Backoff(0.05, 1.0, jitter=NO_JITTER)
    up = _uploader(tmp_path, sender, backoff)
    up.queue.append([b"a", b"b"])
    up.start()
    up.notify()
    wait_for(lambda: up.queue.stats().records == 0)
    assert sender.seen == [(b"a",), (b"a",), (b"a",), (b"a",), (b"b",)]
    gaps = [later - earlier for earlier, later in zip(sender.times, sender.times[1:], strict=False)]
    assert gaps[0] >= 0.05 - 0.01  # the backoff's first delay
    assert gaps[1] >= 0.25 - 0.01  # Retry-After lengthens it
    assert gaps[2] >= 0.2 - 0.01  # the raising round is retried after the doubled delay
    assert [str(e) for e in sender.faults] == ["EIO"]
    assert backoff.failures == 0  # the delivery started the backoff over
    up.stop(time.monotonic() + 2)
    assert not up.running


def test_a_config_fault_waits_from_the_floor(tmp_path):
    sender = Sender([Outcome(ack=False, retry=True, config=True)])
    up = _uploader(tmp_path, sender, Backoff(0.01, 5.0, jitter=NO_JITTER))
    up.queue.append([b"a"])
    up.start()
    wait_for(lambda: len(sender.seen) == 2)
    assert sender.times[1] - sender.times[0] >= 0.3 - 0.01
    up.stop(time.monotonic() + 2)


def test_stop_drains_within_its_deadline_and_leaves_the_rest_on_disk(tmp_path):
    sender = Sender([])
    up = _uploader(tmp_path, sender, Backoff(0.05, 1.0))
    up.start()
    up.queue.append([b"a", b"b", b"c"])
    up.notify()
    wait_for(lambda: up.queue.stats().records == 0)  # delivered while running

    sender.release.clear()  # the receiver hangs from here on
    up.queue.append([b"d", b"e"])
    up.notify()
    wait_for(lambda: len(sender.seen) == 3 and not sender.release.is_set())
    started = time.monotonic()
    up.stop(started + 0.3, abort=sender.release.set)  # abort: what ends a request in flight
    assert time.monotonic() - started < 1.0
    wait_for(lambda: not up.running)
    up.queue.close()  # the thread outlived the deadline: stop() synced the spool and left it open
    again = Spool(str(tmp_path / "spool"), 1 << 20)
    try:
        left = again.read()
        assert left is not None and left.records[-1] == b"e"  # not lost: sent again on the next start
    finally:
        again.close()

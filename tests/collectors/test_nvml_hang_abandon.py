"""A hung NVML call blocks collect() (no Python code can interrupt it); the thread can be abandoned and
close() still returns promptly. The daemon's deadline marks the collector down meanwhile. NVML is not
shut down under the hung call; the shutdown that matches nvmlInit comes once the call returns."""

from __future__ import annotations

import threading
import time

from gpumon.collectors.base import CollectorUnavailable, Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.xid import XidCollector
from gpumon.simulate.nvml import FakeNVML


def test_hung_call_blocks_collect_but_close_returns_promptly() -> None:
    fake = FakeNVML("h100-sxm5-80gb", 2)
    ctx = Context(hostname="test", nvml=fake)
    c = NvmlCollector(ctx)
    x = XidCollector(ctx)
    c.collect()
    x.collect()
    hang = fake.hang("nvmlDeviceGetUtilizationRates", gpu=1)
    done = threading.Event()

    def abandoned() -> None:
        try:
            c.collect()
        except CollectorUnavailable:   # NVML was shut down under its remaining calls: fine, it was closed
            pass
        done.set()

    worker = threading.Thread(target=abandoned, daemon=True)
    worker.start()
    try:
        assert hang.entered.wait(5)
        assert not done.is_set() and worker.is_alive()
        t0 = time.monotonic()
        c.close()
        x.close()
        assert time.monotonic() - t0 < 2.0
        assert worker.is_alive()                    # abandoned, not joined
        assert fake.calls["nvmlShutdown"] == 0      # never shut NVML down under a hung call
    finally:
        hang.release()
        worker.join(5)
    assert done.is_set()
    assert fake.calls["nvmlShutdown"] == 1          # ... and matched once the call returned


def test_hung_event_wait_does_not_block_close() -> None:
    fake = FakeNVML("a100-sxm4-80gb", 1)
    ctx = Context(hostname="test", nvml=fake)
    x = XidCollector(ctx)
    hang = fake.hang("nvmlEventSetWait_v2")
    x.collect()
    try:
        assert hang.entered.wait(5)
        t0 = time.monotonic()
        x.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        hang.release()

"""The kmsg collector reading a :class:`tests.fakes.kmsg.KernelLog`, and log timestamps in the
kernel's clock."""

from __future__ import annotations

import time

from gpumon.collectors.base import Context
from gpumon.collectors.kmsg import KmsgCollector
from tests.fakes.kmsg import KernelLog


def usec_ago(seconds: float) -> int:
    """A log timestamp ``seconds`` ago (the kernel's log clock runs like CLOCK_MONOTONIC)."""
    return int((time.monotonic() - seconds) * 1e6)


def rig(tmp_path, ctx: Context | None = None) -> tuple[KernelLog, KmsgCollector]:
    ctx = ctx or Context(hostname="test", state_dir=str(tmp_path), sysfs_root=str(tmp_path / "sys"))
    log = KernelLog(tmp_path)
    c = KmsgCollector(ctx)
    c.reader = log.reader(c.reader.state_file)
    return log, c

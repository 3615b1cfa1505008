"""The NVML collector and the XID watcher on the simulated NVML (:class:`gpumon.simulate.nvml.FakeNVML`)
with a clock the test moves."""

from __future__ import annotations

from typing import Any

from gpumon.collectors.base import Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.collectors.xid import XidCollector
from gpumon.config import Section
from gpumon.model import Collection
from gpumon.simulate.nvml import FakeNVML
from tests.conftest import wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig(profile: str = "h100-sxm5-80gb", count: int = 8, driver: str = "550.90.07",
        **opts: Any) -> tuple[FakeNVML, NvmlCollector, Clock]:
    fake = FakeNVML(profile, count, driver_version=driver)
    clock = Clock()
    ctx = Context(hostname="test", nvml=fake)
    ctx.get_shared("nvml", lambda: NvmlSession(fake, clock=clock))
    values = {o.key: o.default for o in NvmlCollector.options.options}
    values.update(opts)
    collector = NvmlCollector(ctx, Section("nvml", values))
    return fake, collector, clock


def names(out: Collection) -> set[str]:
    return {f.name for f in out.families}


def xid_counts(out: Collection) -> dict[tuple[str, str], float]:
    return {(s.label("gpu") or "", s.label("xid") or ""): s.value for f in out.families
            if f.name == "gpumon_gpu_xid_errors_total" for s in f.samples}


def assert_watched_again(fake: FakeNVML, x: XidCollector, gpu: int) -> None:
    """The GPU is back in a live event set, and an XID it reports is counted."""
    wait_for(lambda: any(gpu in s.registered for s in fake._sets.values() if not s.freed), 5)
    fake.inject_xid(gpu, 31)
    wait_for(lambda: xid_counts(x.collect()).get((str(gpu), "31")) == 1.0, 5)

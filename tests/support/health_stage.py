"""The health stage on a simulated ND H100 v5 with a clock the test moves: :func:`stage` builds one,
:func:`until` collects until an injected fault reaches the verdict."""

from __future__ import annotations

import threading

from gpumon.health.rules import Thresholds
from gpumon.health.stage import HealthSettings, HealthStage
from tests.fakes.simulated_host import SimulatedHost

ND_H100 = "Standard_ND96isr_H100_v5"


class Host(SimulatedHost):
    def __init__(self, tmp_path) -> None:
        super().__init__(str(tmp_path / "host"))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def stage(tmp_path, clock: Clock, vm_size: str = ND_H100, boot: str = "boot-1", **thresholds) -> HealthStage:
    settings = HealthSettings(Thresholds(**thresholds), hold_seconds=300.0, vm_size=vm_size)
    return HealthStage(str(tmp_path / "state"), settings, clock=clock, boot=boot)


def until(s: HealthStage, host, done):
    """Collect until ``done(result)``: an XID comes through NVML's event thread, so it can reach the
    snapshot a run after it was injected."""
    for _ in range(50):
        result = s.update(host.snapshot())
        if done(result):
            return result
        threading.Event().wait(0.02)
    raise AssertionError("the injected fault never reached the verdict")

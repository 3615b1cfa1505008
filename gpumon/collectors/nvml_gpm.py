"""GPM (GPU Performance Monitoring, Hopper and newer) sample buffers: allocated from NVML in pairs,
sampled alternately so that each run's metrics span the previous run's sample, read with one
``nvmlGpmMetricsGet``, and given back to NVML before they are dropped. What an NVML error means for
the GPU (drop the metric, mark the GPU lost) is the collector's to decide: errors propagate."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumon.collectors.nvml_session import NvmlSession

log = logging.getLogger("gpumon.nvml")


@dataclass
class GpmPair:
    """Two GPM sample buffers used alternately: each run's metrics span the previous run's sample."""

    samples: list[Any]
    sampler: str
    args: tuple[Any, ...]
    idx: int = 0
    taken: int = 0

    @property
    def valid(self) -> bool:
        return self.taken >= 2

    def sample(self, session: NvmlSession) -> None:
        """Take one sample into the next buffer; the pair becomes valid once two samples exist. On an
        NVML error (raised) the pair counts its samples from zero again."""
        try:
            session.call(self.sampler, *self.args, self.samples[self.idx])
        except Exception:
            self.taken = 0
            raise
        self.idx ^= 1
        self.taken += 1

    def read(self, session: NvmlSession, ids: list[int]) -> list[tuple[int, int, float]]:
        """The GPM metrics ``ids`` between the older sample and the one just taken, as
        (metric id, nvmlReturn, value) each (value 0 where nvmlReturn is not success); a failed call
        raises."""
        lib = session.lib
        mg = lib.c_nvmlGpmMetricsGet_t()
        mg.version = lib.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(ids)
        mg.sample1 = self.samples[self.idx]        # the older sample
        mg.sample2 = self.samples[self.idx ^ 1]    # the one just taken
        for i, mid in enumerate(ids):
            mg.metrics[i].metricId = mid
        session.call("nvmlGpmMetricsGet", mg)
        out = []
        for i, mid in enumerate(ids):
            code = int(mg.metrics[i].nvmlReturn)
            out.append((mid, code, float(mg.metrics[i].value) if code == 0 else 0.0))
        return out

    def free(self, session: NvmlSession) -> None:
        free_samples(session, self.samples)


def alloc_samples(session: NvmlSession, alloc: Callable[[], Any]) -> list[Any] | None:
    """Two sample buffers from ``alloc`` (which returns None where NVML refused one); None, with any
    buffer already allocated given back, when one could not be had."""
    samples: list[Any] = []  # pynvml's GPM sample handles
    for _ in range(2):
        sample = alloc()
        if sample is None:
            free_samples(session, samples)
            return None
        samples.append(sample)
    return samples


def free_samples(session: NvmlSession, samples: list[Any]) -> None:
    """Give the buffers back to NVML (a buffer NVML will not take back is lost either way)."""
    for sample in samples:
        try:
            session.call("nvmlGpmSampleFree", sample)
        except Exception as exc:  # noqa: BLE001 - a buffer NVML will not take back is lost either way
            log.debug("nvmlGpmSampleFree: %s", exc)
    samples.clear()

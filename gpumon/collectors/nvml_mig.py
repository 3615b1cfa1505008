"""The nvml collector's MIG instances and GPM sampling: the MIG devices found at each re-probe
(their memory and their GPM activity), and GPM sample pairs allocated, sampled and read per run
(a first run takes its second sample GPM_FIRST_SAMPLE_GAP seconds after the first)."""

from __future__ import annotations

from typing import Any

from gpumon.cadence import due
from gpumon.catalogue import gpu as CG
from gpumon.collectors import nvml_readings as M
from gpumon.collectors.nvml_gpm import GpmPair, alloc_samples
from gpumon.collectors.nvml_gpu import Gpu, GpuReader, Mig, code_error, mig_profile
from gpumon.collectors.nvml_session import classify, text
from gpumon.collectors.nvml_tables import GPM_ALL_IDS, GPM_NVLINK, GPM_PCIE, GPM_RATIOS, GPM_SLOW_IDS
from gpumon.model import Collection, MetricSpec

MIB = 1024.0 * 1024.0


class MigGpmReader(GpuReader):
    """Reads a GPU's MIG instances and GPM metrics."""

    def _setup_gpm(self, gpu: Gpu, out: Collection) -> None:
        if not self.settings.gpm or gpu.gpm is not None:
            return
        support = self._try(gpu, ("static", "gpm"), "nvmlGpmQueryDeviceSupport", gpu.dev.handle, out=out)
        if support is None or not support.isSupportedDevice:
            if support is not None:
                gpu.dropped[("static", "gpm")] = self._clock()
                self._log_once.info(("gpm", gpu.dev.index),
                                    "GPU %d: GPM profiling metrics not supported (pre-Hopper GPU)", gpu.dev.index)
            return
        samples = self._alloc_samples(gpu, out)
        if samples is not None:
            gpu.gpm = GpmPair(samples, "nvmlGpmSampleGet", (gpu.dev.handle,))

    def _alloc_samples(self, gpu: Gpu, out: Collection) -> list[Any] | None:
        return alloc_samples(self.session, lambda: self._try(gpu, ("static", "gpm_alloc"), "nvmlGpmSampleAlloc",
                                                             out=out))

    def _setup_mig(self, gpu: Gpu, mig_on: bool, out: Collection) -> None:
        gpu.mig = []
        if not mig_on:
            for pair in gpu.mig_gpm.values():
                self._free_samples(pair.samples)
            gpu.mig_gpm = {}
            return
        h = gpu.dev.handle
        count = self._try(gpu, ("static", "mig_count"), "nvmlDeviceGetMaxMigDeviceCount", h, out=out) or 0
        for i in range(int(count)):
            try:
                mh = self.session.call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
                gi = int(self.session.call("nvmlDeviceGetGpuInstanceId", mh))
                ci = int(self.session.call("nvmlDeviceGetComputeInstanceId", mh))
            except Exception as exc:  # noqa: BLE001 - an empty MIG slot answers NOT_FOUND
                kind, _ = classify(exc)
                if kind in ("lost", "unavailable"):
                    self._handle_error(gpu, ("static", "mig_dev", i), "nvmlDeviceGetMigDeviceHandleByIndex",
                                       exc, out)
                continue
            mig_uuid = self._try(gpu, ("static", "mig_uuid", i), "nvmlDeviceGetUUID", mh, out=out)
            name = self._try(gpu, ("static", "mig_name", i), "nvmlDeviceGetName", mh, out=out)
            gpu.mig.append(Mig(mh, gi, ci, text(mig_uuid or ""), mig_profile(text(name or ""))))
        present = {m.gpu_instance for m in gpu.mig}
        for gi in [gi for gi in gpu.mig_gpm if gi not in present]:   # an instance destroyed since
            self._free_samples(gpu.mig_gpm.pop(gi).samples)
        if self.settings.gpm and gpu.gpm is not None:
            for gi in sorted(present):
                if gi not in gpu.mig_gpm:
                    samples = self._alloc_samples(gpu, out)
                    if samples is not None:
                        gpu.mig_gpm[gi] = GpmPair(samples, "nvmlGpmMigSampleGet", (gpu.dev.handle, gi))

    def _mig_memory(self, gpu: Gpu, mig: Mig, out: Collection) -> list[M.Row]:
        key = ("call", "mig_memory", mig.gpu_instance, mig.compute_instance)
        if key in gpu.dropped:
            return []
        try:
            mem = self.session.call("nvmlDeviceGetMemoryInfo", mig.handle)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, key, "nvmlDeviceGetMemoryInfo (MIG)", exc, out)
            return []
        extra = (str(mig.gpu_instance), str(mig.compute_instance))
        return [(CG.MIG_MEM_TOTAL, extra, float(mem.total)), (CG.MIG_MEM_USED, extra, float(mem.used))]

    def _mig_gpm(self, gpu: Gpu, gi: int, pair: GpmPair, rows: list[M.Row], out: Collection) -> None:
        if ("gpm_mig", gi) in gpu.dropped:
            return
        self._gpm_sample(gpu, pair, out, key=("gpm_mig", gi))
        if not pair.valid:
            return
        for mig in gpu.mig:
            if mig.gpu_instance == gi:
                self._gpm_metrics(gpu, pair, rows, (str(gi), str(mig.compute_instance)), CG.MIG_ACTIVITY, out,
                                  ratios_only=True)
                break

    def _gpm_sample(self, gpu: Gpu, pair: GpmPair, out: Collection, key: Any = ("gpm",)) -> None:
        """Take one sample into the next buffer; the pair becomes valid once two samples exist."""
        try:
            pair.sample(self.session)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, key, pair.sampler, exc, out)
            if key in gpu.dropped and key == ("gpm",) and gpu.gpm is not None:
                self._free_samples(gpu.gpm.samples)
                gpu.gpm = None

    @staticmethod
    def _needs_second_sample(gpu: Gpu) -> bool:
        pairs = ([gpu.gpm] if gpu.gpm is not None else []) + list(gpu.mig_gpm.values())
        return any(p.taken == 1 for p in pairs)

    def _gpm_step(self, gpu: Gpu, rows: list[M.Row], out: Collection) -> None:
        """The second sample of a first run (no previous run to measure against)."""
        if gpu.gpm is not None and gpu.gpm.taken == 1:
            self._gpm_sample(gpu, gpu.gpm, out)
            if gpu.gpm is not None and gpu.gpm.valid:
                self._gpm_metrics(gpu, gpu.gpm, rows, (), CG.ACTIVITY, out)
        for gi, pair in gpu.mig_gpm.items():
            if pair.taken == 1:
                self._mig_gpm(gpu, gi, pair, rows, out)

    def _gpm_metrics(self, gpu: Gpu, pair: GpmPair, rows: list[M.Row], extra: tuple[str, ...],
                     ratio_spec: MetricSpec, out: Collection, ratios_only: bool = False) -> None:
        """The pair's metrics, the slow ones (GPM_SLOW_IDS) only once every SLOW_FIELD_SECONDS: between,
        their last rows stand in (each such read spans the last interval, as every GPM read does)."""
        now = self._clock()
        slow_due = due(gpu.gpm_slow_at.get(extra), now, M.SLOW_FIELD_SECONDS)
        ids = [mid for mid in GPM_ALL_IDS if ("gpm_metric", mid) not in gpu.dropped
               and (slow_due or mid not in GPM_SLOW_IDS)]
        if ratios_only:
            ratio_ids = {mid for mid, _ in GPM_RATIOS}
            ids = [mid for mid in ids if mid in ratio_ids]
        if not ids:
            return
        try:
            read = pair.read(self.session, ids)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, ("gpm_metrics",), "nvmlGpmMetricsGet", exc, out)
            return
        names = dict(GPM_RATIOS)
        pcie, nvlink = dict(GPM_PCIE), dict(GPM_NVLINK)
        slow_rows: list[M.Row] = []
        for mid, code, value in read:
            if code != 0:
                self._handle_error(gpu, ("gpm_metric", mid), f"GPM metric {mid}", code_error(code), out)
                continue
            target = slow_rows if mid in GPM_SLOW_IDS else rows
            if mid in names:
                target.append((ratio_spec, extra + (names[mid],), max(0.0, min(1.0, value / 100.0))))
            elif mid in pcie:
                target.append((CG.GPM_PCIE, (pcie[mid],), value * MIB))
            elif mid in nvlink:
                target.append((CG.GPM_NVLINK, (nvlink[mid],), value * MIB))
        if slow_due:
            gpu.gpm_slow_rows[extra] = slow_rows
            if all(code == 0 for mid, code, _ in read if mid in GPM_SLOW_IDS):
                gpu.gpm_slow_at[extra] = now      # else asked again next run
        rows.extend(gpu.gpm_slow_rows.get(extra, ()))

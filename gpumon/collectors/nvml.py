"""The NVML GPU collector: the whole GPU health picture through nvidia-ml-py, without DCGM.

Reads every GPU through one shared NVML session (:mod:`gpumon.collectors.nvml_session`), in three
tiers that bound the calls per GPU per run (:mod:`gpumon.collectors.nvml_readings`). A metric NVML
refuses for a GPU (not supported, no permission, function missing, deprecated, refused under MIG) is
dropped for that GPU and asked again only at the hourly re-probe. A GPU that is lost is reported by
``gpumon_gpu_lost`` and a ``gpu_lost`` event, its other series withdrawn, the other GPUs unaffected.
When the library or driver is missing the collector is unavailable and re-initialises with backoff.
GPM sample buffers are NVML allocations: every one dropped is freed first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from gpumon.catalogue import gpu as CG
from gpumon.collectors import nvml_process_util as PU
from gpumon.collectors import nvml_readings as M
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.collectors.gpu_directory import KEY as DIRECTORY_KEY
from gpumon.collectors.gpu_directory import GpuDirectory, GpuEntry
from gpumon.collectors.nvml_fabric import FABRIC_ITEM, FABRIC_LEGACY_ITEM, fabric_events
from gpumon.collectors.nvml_fields import FieldReader
from gpumon.collectors.nvml_gpu import Gpu, GpuLost, NvmlGone, NvmlSettings, field_value, mig_profile
from gpumon.collectors.nvml_mig import MigGpmReader
from gpumon.collectors.nvml_session import NvmlSession, classify, nvml_code, shared_session, text
from gpumon.collectors.nvml_tables import (
    NOT_FOUND,
    TOTAL_POWER_SAMPLES,
    union_value,
)
from gpumon.config import Option, Section, SectionSchema
from gpumon.log_once import LogOnce
from gpumon.model import Collection, MetricSpec, Sample, StateReason, label_set

log = logging.getLogger("gpumon.nvml")

__all__ = ["OPTIONS", "NvmlCollector", "NvmlSettings", "mig_profile"]

LOST_RETRY_SECONDS = 60.0
GPM_FIRST_SAMPLE_GAP = 0.1
#: Every stand-in call by key: the metric tier's and the fabric reader's legacy call.
FALLBACKS: dict[str, M.CallItem] = {**M.FALLBACK_CALLS, FABRIC_LEGACY_ITEM.key: FABRIC_LEGACY_ITEM}
FABRIC_KEYS = frozenset({FABRIC_ITEM.key, FABRIC_LEGACY_ITEM.key})


OPTIONS = SectionSchema(
    "nvml",
    "NVIDIA GPUs through NVML (nvidia-ml-py).",
    (
        Option("interval", float, 0.0, "Collection interval in seconds; 0 uses [daemon] interval.",
               min=0.0, max=3600.0),
        Option("per_process", bool, False,
               "Export memory per process (`gpumon_gpu_process_memory_bytes{pid}`) and SM, memory, "
               "encoder and decoder utilization per process (`gpumon_gpu_process_utilization_ratio"
               "{pid,process,engine}`): series per process, so off by default."),
        Option("per_process_top", int, 5,
               "Processes per GPU with utilization series of their own (the busiest); the others are "
               "summed into one `pid=\"other\"` series: at most (N + 1) x 4 series per GPU.", min=1, max=1000),
        Option("proc_root", str, "/proc",
               "Where the host's /proc is, for process names (in a container: hostPID, or the host's /proc "
               "mounted here, e.g. /host/proc)."),
        Option("gpm", bool, True, "Profiling metrics through GPM on Hopper and newer (no DCGM, no SYS_ADMIN)."),
        Option("nvlink_per_link", bool, False,
               "Export NVLink state, errors and bytes per link (18 links x 7 series per H100); the "
               "per-GPU NVLink totals are always exported."),
        Option("reprobe_interval", float, 3600.0,
               "Seconds before a metric NVML refused for a GPU is asked again, and between re-reads of "
               "static facts (identity, maxima, MIG layout).", min=60.0, max=86400.0),
        Option("max_calls_per_gpu", int, 8,
               "NVML calls per GPU per run in steady state. Fast values are read every run; slowly moving "
               "ones share what is left (at least one per run). 0 reads everything every run.",
               min=0, max=1000),
    ),
    NvmlSettings,
)


class NvmlCollector(FieldReader, MigGpmReader, Collector):
    name = "nvml"
    description = "NVIDIA GPUs through NVML: utilization, memory, power, clocks, ECC, NVLink, GPM, MIG."
    options = OPTIONS
    settings: NvmlSettings
    implies = ("xid",)

    def __init__(self, ctx: Context, cfg: Section | None = None) -> None:
        super().__init__(ctx, cfg)
        self.session: NvmlSession = shared_session(ctx)
        self._directory = ctx.get_shared(DIRECTORY_KEY, GpuDirectory)
        self.session.acquire()
        self._clock: Callable[[], float] = self.session.clock
        self._generation = -1
        self._gpus: list[Gpu] = []
        self._run = 0
        self._log_once = LogOnce(log)
        self._stop = threading.Event()
        self._closed = False
        self._busy = threading.Lock()   # held by collect(); close() frees GPM buffers only when free
        #: UUIDs of GPUs whose links answered different NVLink error totals: the driver reads those
        #: fields per link (scopeId), so the GPU total is their sum (see _nvlink_rows).
        self._nvlink_totals_per_link: set[str] = set()
        self._parse_ctx = M.ParseContext(per_process=self.settings.per_process)

    # --- plumbing ------------------------------------------------------------------------------------

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return CG.NVML_SPECS

    def probe(self) -> Availability:
        try:
            self.session.ensure()
        except CollectorUnavailable as exc:
            return Availability(False, str(exc), retry=self.session.retryable, cause=exc.cause)
        if not self.session.devices:
            return Availability(False, "NVML reports no GPUs", cause=StateReason.NO_SOURCE)
        return Availability(True, f"NVML initialised, {len(self.session.devices)} GPU(s)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        # a collect() hung inside NVML still holds its buffers: leave them (the process is ending)
        if self._busy.acquire(blocking=False):
            try:
                for gpu in self._gpus:
                    self._free_gpm(gpu)
            finally:
                self._busy.release()
        self.session.release()

    # --- the run -------------------------------------------------------------------------------------

    def collect(self) -> Collection:
        with self._busy:
            return self._collect()

    def _collect(self) -> Collection:
        self.session.ensure()
        out = Collection()
        if self._generation != self.session.generation:
            self._generation = self.session.generation
            for old in self._gpus:
                self._free_gpm(old)
            self._gpus = [Gpu(d) for d in self.session.devices]
            self._run = 0
        for reason, n in self.session.drain_errors().items():
            out.count_error(reason, n)
        self._run += 1
        now = self._clock()
        rows_by_spec: dict[MetricSpec, list[Sample]] = {}
        pending_gpm: list[tuple[Gpu, list[M.Row]]] = []

        def emit(gpu: Gpu, rows: list[M.Row]) -> None:
            for spec, extra, value in rows:
                rows_by_spec.setdefault(spec, []).append(Sample(label_set(spec.labels, gpu.dev.labels + extra),
                                                                float(value)))

        try:
            for gpu in self._gpus:
                if gpu.dev.lost and not self._retry_lost(gpu, now, out):
                    continue
                rows: list[M.Row] = []
                try:
                    self._collect_gpu(gpu, now, rows, out)
                    if self._needs_second_sample(gpu):
                        pending_gpm.append((gpu, rows))
                    else:
                        emit(gpu, rows)
                except GpuLost as lost:
                    self.session.mark_lost(gpu.dev, lost.reason)
            if pending_gpm and not self._stop.wait(GPM_FIRST_SAMPLE_GAP):
                for gpu, rows in pending_gpm:
                    try:
                        self._gpm_step(gpu, rows, out)
                        emit(gpu, rows)
                    except GpuLost as lost:
                        self.session.mark_lost(gpu.dev, lost.reason)
        except NvmlGone as gone:
            self.session.invalidate(str(gone), gone.cause)
            raise CollectorUnavailable(str(gone), gone.cause) from None

        for gpu in self._gpus:
            emit(gpu, [(CG.LOST, (), 1.0 if gpu.dev.lost else 0.0)])
        self._directory.publish(tuple(
            GpuEntry(str(g.dev.index), g.dev.uuid, g.info[1] if len(g.info) > 1 else "",
                     tuple((m.gpu_instance, m.uuid) for m in g.mig if m.uuid), g.processes)
            for g in self._gpus))  # a lost GPU is still held: the job it hurt is the one to name
        for spec in CG.NVML_SPECS:
            if spec in rows_by_spec:
                out.add(spec, rows_by_spec[spec])
        out.add(CG.CALLS, [CG.CALLS.sample(n, fn) for fn, n in sorted(self.session.calls.items())])
        out.events.extend(self.session.drain_lost_events())
        return out

    def _collect_gpu(self, gpu: Gpu, now: float, rows: list[M.Row], out: Collection) -> None:
        reprobe = self.settings.reprobe_interval
        if gpu.dropped:
            gpu.dropped = {k: t for k, t in gpu.dropped.items() if now - t < reprobe}
        if gpu.static_at < 0 or now - gpu.static_at >= reprobe:
            self._refresh_static(gpu, now, out)
        rows.append((CG.INFO_SPEC, gpu.info, 1.0))
        rows.extend(gpu.static_rows)

        calls = 0
        if self._fields(gpu, now, rows, out):
            calls += 1
        for item in self._active(gpu, list(M.FAST_CALLS) + self._field_fallbacks(gpu, fast=True)):
            calls += 1
            result = self._call_item(gpu, item, out)
            if result is None and self._fell_back(gpu, item):
                # refused just now (an older driver without the call): its stand-in answers this run
                calls += 1
                result = self._call_item(gpu, FALLBACKS[item.fallback], out)
            rows.extend(result or [])
        if self._power_samples(gpu, rows, out):
            calls += 1
        if self.settings.per_process:
            self._process_util(gpu, rows, out)   # asked every run, outside the budget: opt-in
        for mig in gpu.mig:
            rows.append((CG.MIG_INFO, (str(mig.gpu_instance), str(mig.compute_instance), mig.profile, mig.uuid),
                         1.0))
            rows.extend(self._mig_memory(gpu, mig, out))
        if gpu.gpm is not None:
            calls += 2
            self._gpm_sample(gpu, gpu.gpm, out)
        # slow tier: fill the budget left after the fast tier, oldest (weighted) first
        slow = list(self._active(gpu, self._slow_items(gpu)))
        budget = self.settings.max_calls_per_gpu
        slots = len(slow) if budget <= 0 else max(1, budget - calls)
        # an item never read yet (first run, after a re-probe or a recovery) is read now, budget or not
        slots = max(slots, sum(1 for it in slow if it.key not in gpu.slow_last))
        # stride order: each read moves an item's turn on by 1/weight, so over W runs (W = the sum of
        # the weights) an item of weight w is read w times per slot, exactly, whatever the phase
        now_turn = min((gpu.slow_turn.get(it.key, 0.0) for it in slow), default=0.0)
        slow.sort(key=lambda it: self._slow_order(gpu, it))
        for item in slow[:slots]:
            gpu.slow_last[item.key] = self._run
            gpu.slow_turn[item.key] = max(gpu.slow_turn.get(item.key, now_turn), now_turn) + 1.0 / max(item.weight, 1)
            result = self._call_item(gpu, item, out)
            if result is not None and item.key in FABRIC_KEYS:
                out.events.extend(fabric_events(gpu.dev, gpu.fabric_rows, result))
                gpu.fabric_rows = result
            if result is None:
                gpu.slow_cache.pop(item.key, None)
            else:
                gpu.slow_cache[item.key] = result
        active_keys = {it.key for it in slow}
        for key, cached in gpu.slow_cache.items():
            if key in active_keys:
                rows.extend(cached)
        if gpu.gpm is not None and gpu.gpm.valid:
            self._gpm_metrics(gpu, gpu.gpm, rows, (), CG.ACTIVITY, out)
        for gi, pair in gpu.mig_gpm.items():
            self._mig_gpm(gpu, gi, pair, rows, out)

    @staticmethod
    def _slow_order(gpu: Gpu, item: M.CallItem) -> tuple[float, int]:
        """Never read first, then the earliest turn; of equal turns the heavier item."""
        if item.key not in gpu.slow_last:
            return (float("-inf"), -item.weight)
        return (gpu.slow_turn.get(item.key, 0.0), -item.weight)

    def _slow_items(self, gpu: Gpu) -> list[M.CallItem]:
        items = list(M.SLOW_CALLS) + [FABRIC_ITEM] + self._field_fallbacks(gpu, fast=False)
        if self.settings.nvlink_per_link:
            for link in range(gpu.link_count):
                items.append(M.CallItem(
                    f"nvlink_crc_data_{link}", "nvmlDeviceGetNvLinkErrorCounter",
                    (link, M.NVLINK_ERROR_DL_CRC_DATA),
                    _link_error_parser(link)))
        return items

    @staticmethod
    def _field_fallbacks(gpu: Gpu, fast: bool) -> list[M.CallItem]:
        """Calls standing in for fields this GPU refused; power and energy stay in the fast tier."""
        keys: list[str] = []
        for fs in M.FIELDS:
            if (fs.fallback and ("field", fs.field_id, 0) in gpu.dropped and fs.fallback not in keys
                    and (fs.fallback in M.FAST_FALLBACKS) == fast):
                keys.append(fs.fallback)
        return [FALLBACKS[k] for k in keys]

    @staticmethod
    def _fell_back(gpu: Gpu, item: M.CallItem) -> bool:
        return bool(item.fallback) and ("call", item.key) in gpu.dropped \
            and ("call", item.fallback) not in gpu.dropped

    def _active(self, gpu: Gpu, items: Any) -> list[M.CallItem]:
        """The items not dropped for this GPU, with fallbacks standing in for dropped ones."""
        active = []
        for item in items:
            if ("call", item.key) not in gpu.dropped:
                active.append(item)
            elif item.fallback and ("call", item.fallback) not in gpu.dropped:
                active.append(FALLBACKS[item.fallback])
        return active

    # --- power samples -------------------------------------------------------------------------------

    def _power_samples(self, gpu: Gpu, rows: list[M.Row], out: Collection) -> bool:
        """Min, max and mean of the driver's power samples since the last run (one call; False when
        none was made). The first read only marks where the next interval starts: the buffer holds
        an unknown stretch of the past. NOT_FOUND (no sample since) leaves the series out this run."""
        key = ("call", "power_samples")
        if key in gpu.dropped:
            return False
        try:
            vtype, samples = self.session.call("nvmlDeviceGetSamples", gpu.dev.handle, TOTAL_POWER_SAMPLES,
                                               gpu.power_seen)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            if nvml_code(exc) != NOT_FOUND:
                self._handle_error(gpu, key, "nvmlDeviceGetSamples(TOTAL_POWER_SAMPLES)", exc, out)
            return True
        fresh = [(int(s.timeStamp), union_value(s.sampleValue, vtype)) for s in samples
                 if int(s.timeStamp) > gpu.power_seen]
        if not fresh:
            return True
        first = gpu.power_seen == 0
        gpu.power_seen = max(ts for ts, _ in fresh)
        if not first:
            watts = [mw * 1e-3 for _, mw in fresh]
            rows.extend([(CG.POWER_MIN, (), min(watts)), (CG.POWER_MAX, (), max(watts)),
                         (CG.POWER_MEAN, (), sum(watts) / len(watts))])
        return True

    # --- per-process utilization ---------------------------------------------------------------------

    def _proc_root(self) -> str:
        sim = self.ctx.simulation
        return str(sim.proc_root) if sim is not None else self.settings.proc_root

    def _process_util(self, gpu: Gpu, rows: list[M.Row], out: Collection) -> None:
        """Per-process utilization since the last run: the R550 call, or the legacy one where the
        driver refuses it (each refusal counted and logged once, asked again at the re-probe)."""
        for fn in PU.CALLS:
            key = ("call", fn)
            if key in gpu.dropped:
                continue
            try:
                samples = self.session.call(fn, gpu.dev.handle, gpu.proc_util.last_seen)
            except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
                if nvml_code(exc) == NOT_FOUND:
                    samples = []          # no sample newer than the last run's: not an error
                else:
                    self._handle_error(gpu, key, fn, exc, out)
                    if key in gpu.dropped:
                        continue          # refused: the next call stands in, this run already
                    return
            try:
                per_pid = PU.aggregate(samples, gpu.proc_util)
            except (TypeError, ValueError, AttributeError) as exc:
                out.count_error("nvml_parse")
                self._log_once.warning(("parse", fn), "%s returned %r: %s", fn, samples, exc)
                return
            rows.extend(PU.rows(per_pid, gpu.proc_util, self.settings.per_process_top, self._proc_root()))
            return

    # --- lost GPUs -----------------------------------------------------------------------------------

    def _retry_lost(self, gpu: Gpu, now: float, out: Collection) -> bool:
        """Ask a lost GPU again every minute; True when it answers (same UUID, or its first UUID when
        discovery could not read one) and is collected again."""
        if now - max(gpu.lost_checked, gpu.dev.lost_since) < LOST_RETRY_SECONDS:
            return False
        gpu.lost_checked = now
        try:
            handle = self.session.call("nvmlDeviceGetHandleByIndex", gpu.dev.index)
            uuid = text(self.session.call("nvmlDeviceGetUUID", handle))
            self.session.probe(handle)   # a call that reaches the GPU, on every driver
        except Exception as exc:  # noqa: BLE001 - still lost, or worse
            kind, code = classify(exc)
            if kind == "unavailable":
                raise NvmlGone(f"NVML became unusable ({exc})", code) from None
            return False
        if gpu.dev.uuid and uuid != gpu.dev.uuid:
            return False
        gpu.static_at = -1.0
        gpu.slow_fields_at = None
        gpu.gpm_slow_at.clear()
        gpu.gpm_slow_rows.clear()
        self._free_gpm(gpu)
        self.session.mark_recovered(gpu.dev, handle, uuid)
        return True

    # --- static facts --------------------------------------------------------------------------------

    def _refresh_static(self, gpu: Gpu, now: float, out: Collection) -> None:
        h = gpu.dev.handle
        gpu.static_at = now
        s = self.session
        name = self._try(gpu, ("static", "name"), "nvmlDeviceGetName", h, out=out)
        pci = self._try(gpu, ("static", "pci"), "nvmlDeviceGetPciInfo_v3", h, out=out)
        serial = self._try(gpu, ("static", "serial"), "nvmlDeviceGetSerial", h, out=out)
        vbios = self._try(gpu, ("static", "vbios"), "nvmlDeviceGetVbiosVersion", h, out=out)
        mig = self._try(gpu, ("static", "mig"), "nvmlDeviceGetMigMode", h, out=out)
        mig_on = bool(mig and mig[0] == 1)
        gpu.info = (text(name or ""), text(pci.busId) if pci is not None else "", text(serial or ""),
                    text(vbios or ""), s.driver_version, s.cuda_version,
                    "" if mig is None else ("enabled" if mig_on else "disabled"))
        rows: list[M.Row] = []
        for clock, label in ((M.CLOCK_SM, "sm"), (M.CLOCK_MEM, "memory"), (M.CLOCK_GRAPHICS, "graphics")):
            v = self._try(gpu, ("static", "max_clock", clock), "nvmlDeviceGetMaxClockInfo", h, clock, out=out)
            if v is not None:
                rows.append((CG.CLOCK_MAX, (label,), float(v) * 1e6))
        for fn, spec in (("nvmlDeviceGetMaxPcieLinkGeneration", CG.PCIE_GEN_MAX),
                         ("nvmlDeviceGetMaxPcieLinkWidth", CG.PCIE_WIDTH_MAX)):
            v = self._try(gpu, ("static", fn), fn, h, out=out)
            if v is not None:
                rows.append((spec, (), float(v)))
        for threshold, label in M.THRESHOLDS:
            v = self._try(gpu, ("static", "threshold", threshold), "nvmlDeviceGetTemperatureThreshold", h,
                          threshold, out=out)
            if v is not None:
                rows.append((CG.TEMP_THRESHOLD, (label,), float(v)))
        ecc = self._try(gpu, ("static", "ecc"), "nvmlDeviceGetEccMode", h, out=out)
        if ecc is not None:
            rows.append((CG.ECC_MODE, (), 1.0 if ecc[0] else 0.0))
        gpu.link_count = 0
        links = self._try(gpu, ("static", "links"), "nvmlDeviceGetFieldValues", h,
                          [M.FIELD_NVLINK_LINK_COUNT], out=out)
        if links is not None and links[0].nvmlReturn == 0:
            gpu.link_count = int(field_value(links[0]))
        if gpu.link_count:
            rows.append((CG.NVLINK_LINKS, (), float(gpu.link_count)))
        gpu.static_rows = rows
        self._setup_gpm(gpu, out)
        self._setup_mig(gpu, mig_on, out)


def _link_error_parser(link: int) -> M.Parser:
    return lambda v, _c: [(CG.NVLINK_LINK_ERRORS, (str(link), "crc_data"), float(v))]



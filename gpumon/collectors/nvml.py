"""The NVML GPU collector: the whole GPU health picture through nvidia-ml-py, without DCGM.

Reads every GPU through one shared NVML session (:mod:`gpumon.collectors.nvml_session`), in three
tiers that bound the calls per GPU per run (:mod:`gpumon.collectors.nvml_metrics`). A metric NVML
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
from dataclasses import dataclass, field
from typing import Any

from gpumon.cadence import due
from gpumon.catalogue import gpu as CG
from gpumon.collectors import nvml_metrics as M
from gpumon.collectors import nvml_process_util as PU
from gpumon.collectors.base import Availability, Collector, CollectorUnavailable, Context
from gpumon.collectors.gpu_directory import KEY as DIRECTORY_KEY
from gpumon.collectors.gpu_directory import GpuDirectory, GpuEntry, GpuProcess
from gpumon.collectors.nvml_fabric import FABRIC_ITEM, FABRIC_LEGACY_ITEM, fabric_events
from gpumon.collectors.nvml_gpm import GpmPair, alloc_samples, free_samples
from gpumon.collectors.nvml_session import Device, NvmlSession, classify, nvml_code, shared_session, text
from gpumon.collectors.nvml_tables import (
    GPM_ALL_IDS,
    GPM_NVLINK,
    GPM_PCIE,
    GPM_RATIOS,
    GPM_SLOW_IDS,
    NOT_FOUND,
    TOTAL_POWER_SAMPLES,
    error_name,
    union_value,
    unusable_cause,
)
from gpumon.config import Option, Section, SectionSchema
from gpumon.log_once import LogOnce
from gpumon.model import Collection, MetricSpec, Sample, StateReason, label_set

log = logging.getLogger("gpumon.nvml")

LOST_RETRY_SECONDS = 60.0
GPM_FIRST_SAMPLE_GAP = 0.1
MIB = 1024.0 * 1024.0
#: Every stand-in call by key: the metric tier's and the fabric reader's legacy call.
FALLBACKS: dict[str, M.CallItem] = {**M.FALLBACK_CALLS, FABRIC_LEGACY_ITEM.key: FABRIC_LEGACY_ITEM}
FABRIC_KEYS = frozenset({FABRIC_ITEM.key, FABRIC_LEGACY_ITEM.key})


@dataclass(frozen=True)
class NvmlSettings:
    interval: float
    per_process: bool
    per_process_top: int
    proc_root: str
    gpm: bool
    nvlink_per_link: bool
    reprobe_interval: float
    max_calls_per_gpu: int


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


class _GpuLost(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _NvmlGone(Exception):
    """NVML itself became unusable mid-run; ``cause`` from the NVML code that said so."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.cause = unusable_cause(code, StateReason.ERROR)


@dataclass
class _Mig:
    handle: Any
    gpu_instance: int
    compute_instance: int
    uuid: str = ""
    profile: str = ""   # the GPU instance profile, "1g.10gb"


@dataclass
class _Gpu:
    dev: Device
    static_at: float = -1.0
    info: tuple[str, ...] = ()
    static_rows: list[M.Row] = field(default_factory=list)
    link_count: int = 0
    gpm: GpmPair | None = None
    mig: list[_Mig] = field(default_factory=list)
    mig_gpm: dict[int, GpmPair] = field(default_factory=dict)
    dropped: dict[Any, float] = field(default_factory=dict)
    slow_cache: dict[str, list[M.Row]] = field(default_factory=dict)
    slow_last: dict[str, int] = field(default_factory=dict)
    #: The virtual time of each slow item's next turn (stride scheduling by weight).
    slow_turn: dict[str, float] = field(default_factory=dict)
    lost_checked: float = 0.0
    #: The compute processes of the latest processes call (a slow call: kept between its runs).
    processes: tuple[GpuProcess, ...] = ()
    #: Per-process utilization: the newest sample read and the names reported (per_process only).
    proc_util: PU.ProcessUtilState = field(default_factory=PU.ProcessUtilState)
    #: Timestamp (µs) of the newest power sample read; 0 before the first read.
    power_seen: int = 0
    #: The fabric rows of the last good read, what the next one is compared with for events.
    fabric_rows: list[M.Row] | None = None
    #: When the slow fields were last asked (None: not yet), and the rows they gave then.
    slow_fields_at: float | None = None
    slow_field_rows: list[M.Row] = field(default_factory=list)
    #: Per GPM pair (by its label values): when its slow metrics were last asked, and their rows.
    gpm_slow_at: dict[tuple[str, ...], float] = field(default_factory=dict)
    gpm_slow_rows: dict[tuple[str, ...], list[M.Row]] = field(default_factory=dict)
    #: Wrapping fields (FieldSpec.wraps): field id -> (last raw value, total so far).
    unwrapped: dict[int, tuple[float, float]] = field(default_factory=dict)


class NvmlCollector(Collector):
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
        self._gpus: list[_Gpu] = []
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
            self._gpus = [_Gpu(d) for d in self.session.devices]
            self._run = 0
        for reason, n in self.session.drain_errors().items():
            out.count_error(reason, n)
        self._run += 1
        now = self._clock()
        rows_by_spec: dict[MetricSpec, list[Sample]] = {}
        pending_gpm: list[tuple[_Gpu, list[M.Row]]] = []

        def emit(gpu: _Gpu, rows: list[M.Row]) -> None:
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
                except _GpuLost as lost:
                    self.session.mark_lost(gpu.dev, lost.reason)
            if pending_gpm and not self._stop.wait(GPM_FIRST_SAMPLE_GAP):
                for gpu, rows in pending_gpm:
                    try:
                        self._gpm_step(gpu, rows, out)
                        emit(gpu, rows)
                    except _GpuLost as lost:
                        self.session.mark_lost(gpu.dev, lost.reason)
        except _NvmlGone as gone:
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

    def _collect_gpu(self, gpu: _Gpu, now: float, rows: list[M.Row], out: Collection) -> None:
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
    def _slow_order(gpu: _Gpu, item: M.CallItem) -> tuple[float, int]:
        """Never read first, then the earliest turn; of equal turns the heavier item."""
        if item.key not in gpu.slow_last:
            return (float("-inf"), -item.weight)
        return (gpu.slow_turn.get(item.key, 0.0), -item.weight)

    def _slow_items(self, gpu: _Gpu) -> list[M.CallItem]:
        items = list(M.SLOW_CALLS) + [FABRIC_ITEM] + self._field_fallbacks(gpu, fast=False)
        if self.settings.nvlink_per_link:
            for link in range(gpu.link_count):
                items.append(M.CallItem(
                    f"nvlink_crc_data_{link}", "nvmlDeviceGetNvLinkErrorCounter",
                    (link, M.NVLINK_ERROR_DL_CRC_DATA),
                    _link_error_parser(link)))
        return items

    @staticmethod
    def _field_fallbacks(gpu: _Gpu, fast: bool) -> list[M.CallItem]:
        """Calls standing in for fields this GPU refused; power and energy stay in the fast tier."""
        keys: list[str] = []
        for fs in M.FIELDS:
            if (fs.fallback and ("field", fs.field_id, 0) in gpu.dropped and fs.fallback not in keys
                    and (fs.fallback in M.FAST_FALLBACKS) == fast):
                keys.append(fs.fallback)
        return [FALLBACKS[k] for k in keys]

    @staticmethod
    def _fell_back(gpu: _Gpu, item: M.CallItem) -> bool:
        return bool(item.fallback) and ("call", item.key) in gpu.dropped \
            and ("call", item.fallback) not in gpu.dropped

    def _active(self, gpu: _Gpu, items: Any) -> list[M.CallItem]:
        """The items not dropped for this GPU, with fallbacks standing in for dropped ones."""
        active = []
        for item in items:
            if ("call", item.key) not in gpu.dropped:
                active.append(item)
            elif item.fallback and ("call", item.fallback) not in gpu.dropped:
                active.append(FALLBACKS[item.fallback])
        return active

    # --- error handling ------------------------------------------------------------------------------

    def _handle_error(self, gpu: _Gpu, key: Any, what: str, exc: BaseException, out: Collection) -> None:
        """Turn one NVML failure into its outcome: drop, lost, unavailable, or absent this run."""
        kind, code = classify(exc)
        reason = f"nvml_{error_name(code)}" if code is not None else "nvml_error"
        if kind == "lost":
            out.count_error(reason)
            raise _GpuLost(f"{what}: {exc}")
        if kind == "unavailable":
            out.count_error(reason)
            raise _NvmlGone(f"NVML became unusable ({what}: {exc})", code)
        if kind == "unsupported":
            gpu.dropped[key] = self._clock()
            out.count_error(reason)
            self._log_once.info(("drop", key, code),
                                "GPU %d: %s not available (%s); dropped for each GPU that refuses it until the "
                                "re-probe", gpu.dev.index, what, exc)
            return
        out.count_error(reason)
        self._log_once.warning(("transient", key, code),
                               "GPU %d: %s failed (%s); the value is absent this run", gpu.dev.index, what, exc)

    def _call_item(self, gpu: _Gpu, item: M.CallItem, out: Collection) -> list[M.Row] | None:
        try:
            if item.read is not None:
                value = item.read(self.session, gpu.dev)
            else:
                value = self.session.call(item.fn, gpu.dev.handle, *item.args)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome, none escapes
            self._handle_error(gpu, ("call", item.key), item.fn, exc, out)
            return None
        try:
            self._parse_ctx.processes = None
            rows = item.parse(value, self._parse_ctx)
            if self._parse_ctx.processes is not None:
                gpu.processes = tuple(GpuProcess(pid, gi) for pid, gi in self._parse_ctx.processes)
            return rows
        except (TypeError, ValueError, AttributeError) as exc:
            out.count_error("nvml_parse")
            self._log_once.warning(("parse", item.key), "%s returned %r: %s", item.fn, value, exc)
            return None

    def _try(self, gpu: _Gpu, key: Any, fn: str, *args: Any, out: Collection) -> Any:
        """A static call: the value, or None when NVML refused (handled like any other call)."""
        if key in gpu.dropped:
            return None
        try:
            return self.session.call(fn, *args)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, key, fn, exc, out)
            return None

    # --- power samples -------------------------------------------------------------------------------

    def _power_samples(self, gpu: _Gpu, rows: list[M.Row], out: Collection) -> bool:
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

    def _process_util(self, gpu: _Gpu, rows: list[M.Row], out: Collection) -> None:
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

    def _retry_lost(self, gpu: _Gpu, now: float, out: Collection) -> bool:
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
                raise _NvmlGone(f"NVML became unusable ({exc})", code) from None
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

    def _refresh_static(self, gpu: _Gpu, now: float, out: Collection) -> None:
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
            gpu.link_count = int(_field_value(links[0]))
        if gpu.link_count:
            rows.append((CG.NVLINK_LINKS, (), float(gpu.link_count)))
        gpu.static_rows = rows
        self._setup_gpm(gpu, out)
        self._setup_mig(gpu, mig_on, out)

    def _setup_gpm(self, gpu: _Gpu, out: Collection) -> None:
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

    def _alloc_samples(self, gpu: _Gpu, out: Collection) -> list[Any] | None:
        return alloc_samples(self.session, lambda: self._try(gpu, ("static", "gpm_alloc"), "nvmlGpmSampleAlloc",
                                                             out=out))

    def _free_samples(self, samples: list[Any]) -> None:
        free_samples(self.session, samples)

    def _free_gpm(self, gpu: _Gpu) -> None:
        """Give back every GPM buffer of the GPU (before dropping them: NVML allocated them)."""
        if gpu.gpm is not None:
            self._free_samples(gpu.gpm.samples)
            gpu.gpm = None
        for pair in gpu.mig_gpm.values():
            self._free_samples(pair.samples)
        gpu.mig_gpm = {}

    def _setup_mig(self, gpu: _Gpu, mig_on: bool, out: Collection) -> None:
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
            gpu.mig.append(_Mig(mh, gi, ci, text(mig_uuid or ""), mig_profile(text(name or ""))))
        present = {m.gpu_instance for m in gpu.mig}
        for gi in [gi for gi in gpu.mig_gpm if gi not in present]:   # an instance destroyed since
            self._free_samples(gpu.mig_gpm.pop(gi).samples)
        if self.settings.gpm and gpu.gpm is not None:
            for gi in sorted(present):
                if gi not in gpu.mig_gpm:
                    samples = self._alloc_samples(gpu, out)
                    if samples is not None:
                        gpu.mig_gpm[gi] = GpmPair(samples, "nvmlGpmMigSampleGet", (gpu.dev.handle, gi))

    # --- fields --------------------------------------------------------------------------------------

    def _field_plan(self, gpu: _Gpu, slow_due: bool) -> list[tuple[int, int]]:
        driver = self.session.driver_major
        ids = [(fs.field_id, 0) for fs in M.FIELDS if fs.min_driver <= driver and (slow_due or not fs.slow)]
        if gpu.link_count:
            per_link = [M.FIELD_NVLINK_STATE, M.FIELD_NVLINK_TX_KIB, M.FIELD_NVLINK_RX_KIB]
            per_link += [fs.field_id for fs in M.NVLINK_TOTAL_FIELDS]
            if self.settings.nvlink_per_link:
                per_link += [fid for fid, _ in M.NVLINK_LINK_ERROR_FIELDS]
            ids += [(fid, link) for link in range(gpu.link_count) for fid in per_link]
        return [key for key in ids if ("field",) + key not in gpu.dropped]

    def _fields(self, gpu: _Gpu, now: float, rows: list[M.Row], out: Collection) -> bool:
        """One nvmlDeviceGetFieldValues call for every field-backed value; False when none was asked.
        The slow fields are in it once every SLOW_FIELD_SECONDS; between, their last rows stand in."""
        if ("call", "fields") in gpu.dropped:
            return False
        slow_due = due(gpu.slow_fields_at, now, M.SLOW_FIELD_SECONDS)
        plan = self._field_plan(gpu, slow_due)
        if not plan:
            return False
        try:
            values = self.session.call("nvmlDeviceGetFieldValues", gpu.dev.handle,
                                       [(fid, scope) for fid, scope in plan])
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, ("call", "fields"), "nvmlDeviceGetFieldValues", exc, out)
            if ("call", "fields") in gpu.dropped:
                # the whole call is unavailable: every field falls back to its call, if it has one
                for fs in M.FIELDS:
                    gpu.dropped.setdefault(("field", fs.field_id, 0), self._clock())
            return True
        got: dict[tuple[int, int], float] = {}
        for (fid, scope), fv in zip(plan, values):
            ret = int(fv.nvmlReturn)
            if ret != 0:
                err = _code_error(ret)
                self._handle_error(gpu, ("field", fid, scope), f"field {fid} (scope {scope})", err, out)
                continue
            got[(fid, scope)] = _field_value(fv)
        fresh_slow: list[M.Row] = []
        for fs in M.FIELDS:
            if (fs.field_id, 0) in got:
                value = got[(fs.field_id, 0)]
                if fs.wraps:
                    value = self._unwrap(gpu, fs, value)
                row = (fs.spec, fs.extra, value * fs.scale)
                (fresh_slow if fs.slow else rows).append(row)
        if slow_due:
            gpu.slow_field_rows = fresh_slow
            # a slow field that failed this time (and was not dropped) is asked again next run
            if all(key in got for key in plan if key[1] == 0 and key[0] in M.SLOW_FIELD_IDS):
                gpu.slow_fields_at = now
        rows.extend(gpu.slow_field_rows)
        if gpu.link_count:
            self._nvlink_rows(gpu, got, rows)
        return True

    @staticmethod
    def _unwrap(gpu: _Gpu, fs: M.FieldSpec, raw: float) -> float:
        """A total that only grows from a counter that wraps at ``fs.wraps``: right while the counter
        wraps at most once between two reads (the docs say what that means for PCIe bytes)."""
        last = gpu.unwrapped.get(fs.field_id)
        total = raw if last is None else last[1] + (raw - last[0]) % fs.wraps
        gpu.unwrapped[fs.field_id] = (raw, total)
        return total

    @staticmethod
    def _all_links(gpu: _Gpu, got: dict[tuple[int, int], float], fid: int) -> list[float] | None:
        """The per-link values of a field, or None unless every link not dropped answered: a total
        over some links only would look like a counter reset."""
        vals = [got[(fid, link)] for link in range(gpu.link_count) if (fid, link) in got]
        asked = sum(1 for link in range(gpu.link_count) if ("field", fid, link) not in gpu.dropped)
        return vals if vals and len(vals) == asked else None

    def _nvlink_rows(self, gpu: _Gpu, got: dict[tuple[int, int], float], rows: list[M.Row]) -> None:
        links = range(gpu.link_count)
        states = [got.get((M.FIELD_NVLINK_STATE, link)) for link in links]
        known = [s for s in states if s is not None]
        if known:
            rows.append((CG.NVLINK_ACTIVE, (), float(sum(1 for s in known if s == 1))))
        for fid, direction in ((M.FIELD_NVLINK_TX_KIB, "tx"), (M.FIELD_NVLINK_RX_KIB, "rx")):
            vals = self._all_links(gpu, got, fid)
            if vals is not None:
                rows.append((CG.NVLINK_BYTES, (direction,), sum(vals) * 1024.0))
        totals = {fs: self._all_links(gpu, got, fs.field_id) for fs in M.NVLINK_TOTAL_FIELDS}
        if any(vals and len(set(vals)) > 1 for vals in totals.values()):
            self._nvlink_totals_per_link.add(gpu.dev.uuid)
        per_link = gpu.dev.uuid in self._nvlink_totals_per_link
        for fs, vals in totals.items():
            if vals is None:
                continue
            # Every link answering the same count would mean a driver that ignores scopeId and gives
            # the GPU total each time; summing would multiply it. Once two links differ the values are
            # per link for good (the switch only ever makes the counter jump up, never back).
            total = sum(vals) if per_link else vals[0]
            rows.append((fs.spec, fs.extra, total * fs.scale))
        if not self.settings.nvlink_per_link:
            return
        for link in links:
            lk = str(link)
            if states[link] is not None:
                rows.append((CG.NVLINK_LINK_UP, (lk,), 1.0 if states[link] == 1 else 0.0))
            for fid, kind in M.NVLINK_LINK_ERROR_FIELDS:
                if (fid, link) in got:
                    rows.append((CG.NVLINK_LINK_ERRORS, (lk, kind), got[(fid, link)]))
            for fid, direction in ((M.FIELD_NVLINK_TX_KIB, "tx"), (M.FIELD_NVLINK_RX_KIB, "rx")):
                if (fid, link) in got:
                    rows.append((CG.NVLINK_LINK_BYTES, (lk, direction), got[(fid, link)] * 1024.0))

    # --- MIG -----------------------------------------------------------------------------------------

    def _mig_memory(self, gpu: _Gpu, mig: _Mig, out: Collection) -> list[M.Row]:
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

    def _mig_gpm(self, gpu: _Gpu, gi: int, pair: GpmPair, rows: list[M.Row], out: Collection) -> None:
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

    # --- GPM -----------------------------------------------------------------------------------------

    def _gpm_sample(self, gpu: _Gpu, pair: GpmPair, out: Collection, key: Any = ("gpm",)) -> None:
        """Take one sample into the next buffer; the pair becomes valid once two samples exist."""
        try:
            pair.sample(self.session)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, key, pair.sampler, exc, out)
            if key in gpu.dropped and key == ("gpm",) and gpu.gpm is not None:
                self._free_samples(gpu.gpm.samples)
                gpu.gpm = None

    @staticmethod
    def _needs_second_sample(gpu: _Gpu) -> bool:
        pairs = ([gpu.gpm] if gpu.gpm is not None else []) + list(gpu.mig_gpm.values())
        return any(p.taken == 1 for p in pairs)

    def _gpm_step(self, gpu: _Gpu, rows: list[M.Row], out: Collection) -> None:
        """The second sample of a first run (no previous run to measure against)."""
        if gpu.gpm is not None and gpu.gpm.taken == 1:
            self._gpm_sample(gpu, gpu.gpm, out)
            if gpu.gpm is not None and gpu.gpm.valid:
                self._gpm_metrics(gpu, gpu.gpm, rows, (), CG.ACTIVITY, out)
        for gi, pair in gpu.mig_gpm.items():
            if pair.taken == 1:
                self._mig_gpm(gpu, gi, pair, rows, out)

    def _gpm_metrics(self, gpu: _Gpu, pair: GpmPair, rows: list[M.Row], extra: tuple[str, ...],
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
                self._handle_error(gpu, ("gpm_metric", mid), f"GPM metric {mid}", _code_error(code), out)
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


def _link_error_parser(link: int) -> M.Parser:
    return lambda v, _c: [(CG.NVLINK_LINK_ERRORS, (str(link), "crc_data"), float(v))]


def _code_error(code: int) -> BaseException:
    """The real pynvml exception for a per-field/per-metric return code (same class a call raises)."""
    try:
        import pynvml

        return pynvml.NVMLError(code)
    except ImportError:  # pragma: no cover - pynvml is a dependency
        exc = Exception(f"NVML error {code}")
        exc.value = code  # type: ignore[attr-defined]
        return exc


def _field_value(fv: Any) -> float:
    """A c_nvmlFieldValue_t's value, read through the union member its valueType names."""
    return union_value(fv.value, fv.valueType)


def mig_profile(name: str) -> str:
    """The GPU instance profile in a MIG device's name: NVML names a MIG device after its parent and
    profile, "NVIDIA H100 80GB HBM3 MIG 1g.10gb", as ``nvidia-smi -L`` lists it ("MIG 3g.20gb Device
    0", NVIDIA/dcgm-exporter issue #105); empty when the name carries none."""
    _, sep, profile = name.rpartition(" MIG ")
    return profile.strip() if sep else ""

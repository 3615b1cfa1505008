"""What the nvml collector knows per GPU and how it reads one: its settings, the per-GPU state
(:class:`Gpu`), and :class:`GpuReader`, the error handling every NVML call of a run goes through.

The collector (:mod:`gpumon.collectors.nvml`) is built from readers on this base: the field values
and NVLink sums (:mod:`gpumon.collectors.nvml_fields`), MIG instances and GPM sampling
(:mod:`gpumon.collectors.nvml_mig`); each reads with :meth:`GpuReader._try`, ``_call_item`` and
``_handle_error``, which turn every NVML failure into its outcome (drop, lost, unavailable, absent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumon.collectors import nvml_process_util as PU
from gpumon.collectors import nvml_readings as M
from gpumon.collectors.gpu_directory import GpuProcess
from gpumon.collectors.nvml_gpm import GpmPair, free_samples
from gpumon.collectors.nvml_session import Device, NvmlSession, classify
from gpumon.collectors.nvml_tables import error_name, union_value, unusable_cause
from gpumon.log_once import LogOnce
from gpumon.model import Collection, StateReason


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


class GpuLost(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NvmlGone(Exception):
    """NVML itself became unusable mid-run; ``cause`` from the NVML code that said so."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.cause = unusable_cause(code, StateReason.ERROR)


@dataclass
class Mig:
    handle: Any
    gpu_instance: int
    compute_instance: int
    uuid: str = ""
    profile: str = ""   # the GPU instance profile, "1g.10gb"


@dataclass
class Gpu:
    dev: Device
    static_at: float = -1.0
    info: tuple[str, ...] = ()
    static_rows: list[M.Row] = field(default_factory=list)
    link_count: int = 0
    gpm: GpmPair | None = None
    mig: list[Mig] = field(default_factory=list)
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


class GpuReader:
    """The base of the nvml collector's readers: one NVML failure, one outcome. Declares what the
    collector gives every reader (its session, settings, clock and logged-once keys)."""

    session: NvmlSession
    settings: NvmlSettings
    _clock: Callable[[], float]
    _log_once: LogOnce
    _parse_ctx: M.ParseContext

    def _handle_error(self, gpu: Gpu, key: Any, what: str, exc: BaseException, out: Collection) -> None:
        """Turn one NVML failure into its outcome: drop, lost, unavailable, or absent this run."""
        kind, code = classify(exc)
        reason = f"nvml_{error_name(code)}" if code is not None else "nvml_error"
        if kind == "lost":
            out.count_error(reason)
            raise GpuLost(f"{what}: {exc}")
        if kind == "unavailable":
            out.count_error(reason)
            raise NvmlGone(f"NVML became unusable ({what}: {exc})", code)
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

    def _call_item(self, gpu: Gpu, item: M.CallItem, out: Collection) -> list[M.Row] | None:
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

    def _try(self, gpu: Gpu, key: Any, fn: str, *args: Any, out: Collection) -> Any:
        """A static call: the value, or None when NVML refused (handled like any other call)."""
        if key in gpu.dropped:
            return None
        try:
            return self.session.call(fn, *args)
        except Exception as exc:  # noqa: BLE001 - every NVML error has an outcome
            self._handle_error(gpu, key, fn, exc, out)
            return None

    def _free_samples(self, samples: list[Any]) -> None:
        free_samples(self.session, samples)

    def _free_gpm(self, gpu: Gpu) -> None:
        """Give back every GPM buffer of the GPU (before dropping them: NVML allocated them)."""
        if gpu.gpm is not None:
            self._free_samples(gpu.gpm.samples)
            gpu.gpm = None
        for pair in gpu.mig_gpm.values():
            self._free_samples(pair.samples)
        gpu.mig_gpm = {}


def code_error(code: int) -> BaseException:
    """The real pynvml exception for a per-field/per-metric return code (same class a call raises)."""
    try:
        import pynvml

        return pynvml.NVMLError(code)
    except ImportError:  # pragma: no cover - pynvml is a dependency
        exc = Exception(f"NVML error {code}")
        exc.value = code  # type: ignore[attr-defined]
        return exc


def field_value(fv: Any) -> float:
    """A c_nvmlFieldValue_t's value, read through the union member its valueType names."""
    return union_value(fv.value, fv.valueType)


def mig_profile(name: str) -> str:
    """The GPU instance profile in a MIG device's name: NVML names a MIG device after its parent and
    profile, "NVIDIA H100 80GB HBM3 MIG 1g.10gb", as ``nvidia-smi -L`` lists it ("MIG 3g.20gb Device
    0", NVIDIA/dcgm-exporter issue #105); empty when the name carries none."""
    _, sep, profile = name.rpartition(" MIG ")
    return profile.strip() if sep else ""

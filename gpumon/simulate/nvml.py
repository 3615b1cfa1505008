"""A stand-in for the ``pynvml`` module: simulated GPUs behind NVML's Python API.

:class:`FakeNVML` answers the calls gpumon makes with the same names, argument conventions and return
types as nvidia-ml-py (ctypes structures from pynvml itself, opaque handles as ctypes pointers, the
``list`` / ``tuple`` / ``nvmlFriendlyObject`` shapes pynvml returns), and raises the real
``pynvml.NVMLError_*`` classes. Constants, structures and exception classes are re-exported from the
installed pynvml; an NVML function the double does not implement raises ``NVMLError_FunctionNotFound``,
as a driver lacking it would.

Profiles: ``a100-sxm4-80gb`` (ND A100 v4), ``h100-sxm5-80gb`` (ND H100 v5: GPM, 18 NVLinks), ``a10``
(NVads A10 v5: no NVLink, no HBM temperature, a fan), ``gb200`` (ND GB200 v6: multi-node NVLink fabric).
Values move with :meth:`FakeNVML.tick`; power samples (:meth:`nvmlDeviceGetSamples`) follow the load or
a square-wave swing (:meth:`set_power_swing`), the fabric can be changed with :meth:`set_fabric`.

The driver matters as it does on a real host: ``driver_version`` (default 550.90.07, an R550 production
driver) decides which functions, event types and field ids exist. Before R570 there is no
``nvmlDeviceGetTemperatureV`` (FUNCTION_NOT_FOUND); before R565 no GPU-unavailable / recovery-action
events and no field 230; before R555 no PCIe byte counters (197/198); field ids 269-271 are the
clock-event counters from R580 on and power-smoothing values in R570/R575.

Faults for tests: :meth:`fail`, :meth:`fail_field`, :meth:`fail_gpm_metric`, :meth:`hang`,
:meth:`fail_init`, :meth:`set_lost`, :meth:`inject_xid`, :meth:`inject_event`, :meth:`set_mig`; workloads:
:meth:`run_processes` / :meth:`restore_processes` (per-process utilization samples follow them).
Every call is counted (:attr:`calls`, :meth:`calls_for_gpu`) so the benchmark can report calls per GPU;
GPM sample buffers are tracked (:meth:`gpm_samples_allocated`) so a test can assert none leaks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import random
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real

from gpumon.simulate import job

_DEVICE_BASE = 0x7E5700000000
_MIG_BASE = 0x7E5800000000
_SET_BASE = 0x7E5900000000
_SAMPLE_BASE = 0x7E5A00000000

_PURE_HELPERS = frozenset({"nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct", "nvmlExceptionClass"})


def _err(code: int) -> Exception:
    return _real.NVMLError(code)


def _addr(ptr: Any) -> int:
    try:
        return int(ctypes.cast(ptr, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT) from None


def _ptr(address: int, kind: Any) -> Any:
    return ctypes.cast(ctypes.c_void_p(address), kind)


# --- profiles ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_total: int           # bytes
    memory_reserved: int
    bar1_total: int
    power_limit_mw: int
    idle_power_mw: int
    sm_max_mhz: int
    mem_max_mhz: int
    pcie_gen: int
    pcie_width: int
    nvlinks: int
    gpm: bool
    hbm: bool
    fan: bool
    encoder: bool
    thresholds: dict[int, int]  # NVML_TEMPERATURE_THRESHOLD_* -> celsius
    vbios: str
    serial_prefix: str
    pci_device_id: int
    mig_capable: bool
    mig_instance_memory: int
    fabric: str = "none"   # "none": NOT_SUPPORTED; "nvswitch": Hopper + NVSwitch; "mnnvl": multi-node NVLink
    #: nvmlDeviceGetProcessUtilization answers; Blackwell answers NOT_SUPPORTED and only the
    #: nvmlDeviceGetProcessesUtilizationInfo path works (shared/reference/wave3.md section 3, [S10])
    legacy_process_util: bool = True
    #: The GPU instance profile of the double's equal MIG instances (one slice each), as the driver
    #: names it: nvidia-smi -L prints "MIG 1g.10gb Device 0" on an H100 80GB and DCGM labels the
    #: instance GPU_I_PROFILE="1g.10gb" (NVIDIA/dcgm-exporter issues #105, #317, PR #736).
    mig_instance_profile: str = ""


PROFILES: dict[str, GpuProfile] = {
    "h100-sxm5-80gb": GpuProfile(
        "NVIDIA H100 80GB HBM3", 81559 * 2**20, 480 * 2**20, 131072 * 2**20, 700_000, 72_000, 1980, 2619,
        5, 16, 18, True, True, False, False, {0: 95, 1: 89, 2: 95, 3: 87}, "96.00.DA.00.0C", "16516240",
        0x233010DE, True, 9856 * 2**20, mig_instance_profile="1g.10gb"),
    "a100-sxm4-80gb": GpuProfile(
        "NVIDIA A100-SXM4-80GB", 81920 * 2**20, 589 * 2**20, 131072 * 2**20, 400_000, 62_000, 1410, 1593,
        4, 16, 12, False, True, False, False, {0: 92, 1: 89, 2: 95, 3: 85}, "92.00.45.00.06", "13232110",
        0x20B210DE, True, 9856 * 2**20, mig_instance_profile="1g.10gb"),
    "a10": GpuProfile(
        "NVIDIA A10", 23028 * 2**20, 387 * 2**20, 32768 * 2**20, 150_000, 18_000, 1695, 6251,
        4, 16, 0, False, False, True, True, {0: 98, 1: 95, 3: 93}, "94.02.5C.00.02", "13224210",
        0x223610DE, False, 0),
    # ND GB200 v6: the model name as NVML reports it; 18 NVLink 5 links (1.8 TB/s per GPU); memory,
    # clocks, power limit and thresholds are plausible values, not read from a real board.
    "gb200": GpuProfile(
        "NVIDIA GB200", 189471 * 2**20, 1094 * 2**20, 262144 * 2**20, 1_200_000, 160_000, 2062, 3996,
        5, 16, 18, True, True, False, False, {0: 95, 1: 92, 2: 95, 3: 90}, "97.00.82.00.0F", "16550240",
        0x294110DE, True, 23040 * 2**20, fabric="mnnvl", legacy_process_util=False,
        mig_instance_profile="1g.23gb"),
}
PROFILES["h100-sxm5-80gb"] = dataclasses.replace(PROFILES["h100-sxm5-80gb"], fabric="nvswitch")

# Clock-event reason bits (nvmlClocksEventReason*)
_IDLE, _SW_POWER, _HW_SLOW, _SW_THERM, _HW_THERM = 0x1, 0x4, 0x8, 0x20, 0x40

THROTTLES: dict[str, tuple[int, tuple[int, ...]]] = {
    "sw_power_cap": (_SW_POWER, (74,)),
    "hw_thermal_slowdown": (_HW_THERM, (75, 270)),
    "hw_slowdown": (_HW_SLOW, (79,)),
}
"""What :meth:`FakeNVML.throttle` holds on per reason: the nvmlClocksEventReason* bit and the violation
fields that count the time (74 PERF_POLICY_POWER; 75 PERF_POLICY_THERMAL and, from R580, 270
CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN; nvml.h has no PERF_POLICY field for HW slowdown, whose causes are
the board's protection limits: 79 PERF_POLICY_RELIABILITY counts it here)."""

# GPM metric ids the double answers
_GPM_RATIO_IDS = (1, 2, 3, 5, 10, 11, 12, 13)

# What appeared in which driver branch (NVML change log). The fabric branches are this double's
# assumption (not verified): nvmlDeviceGetGpuFabricInfoV and its v2 struct from R550, v3 from R570.
# nvmlDeviceGetProcessesUtilizationInfo is in the R550 headers (wave3.md section 3): older drivers lack it.
_FUNCTION_SINCE: dict[str, int] = {"nvmlDeviceGetTemperatureV": 570, "nvmlDeviceGetGpuFabricInfoV": 550,
                                   "nvmlDeviceGetProcessesUtilizationInfo": 550}
_FABRIC_V3_SINCE = 570

# The driver's power sample buffer: one sample per period, a bounded ring. NVML documents neither size;
# an H100 with driver 580 samples every 20 ms and keeps 119 samples, 2.36 s
# (tests/fixtures/nvml/h100_r580.json, power_samples). Values are milliwatts as unsigned int
# (NVML_VALUE_TYPE_UNSIGNED_INT): the same record has them beside nvmlDeviceGetPowerUsage's mW.
_POWER_SAMPLE_US = 20_000
_POWER_SAMPLE_CAPACITY = 119
# Event types an H100 supports with driver 580: 0xFF9F (tests/fixtures/nvml/h100_r580.json): every type
# but 0x20 and 0x40; the GPU-unavailable and recovery-action bits (0x4000, 0x8000) exist from R565.
_BASE_EVENT_TYPES = 0x3F9F
_UTIL_PERIOD_US = 100_000
# Per-process utilization samples: one per driver sampling period, 200-400 ms apart on an H100 with
# driver 580 (wave3.md section 3); the double takes one every 250 ms. Only the newest sample of each
# PID is kept and answered, as both calls did there. Processes time-share the SMs: in each sample one
# process has the GPU (99 % SM on the real H100, the load here) and the others 0 %, as seen there.
_PROC_SAMPLE_US = 250_000
#: How long the driver still answers the last sample of a process that ended. NVML documents no such
#: time; this is the double's choice (long enough for a run at a 10 s interval to see it once).
_PROC_ENDED_KEEP_S = 30.0
#: The first PID the double gives a workload's processes (the default process of GPU i is 4000 + 10 i).
_WORKLOAD_PID_BASE = 200_000
"""The sampling period encoder/decoder utilization report on an H100, driver 580 (same record)."""
_EVENT_SINCE: dict[int, int] = {_real.nvmlEventTypeGpuUnavailableError: 565,
                                _real.nvmlEventTypeGpuRecoveryAction: 565}
_FIELD_SINCE: dict[int, int] = {197: 555, 198: 555, 230: 565, 269: 580, 270: 580, 271: 580}
# In R570/R575 the ids 269-271 were power-smoothing fields (renumbered in R580)
_R570_POWER_SMOOTHING = {269: 0, 270: 10, 271: 300000}


@dataclass
class _Mig:
    gpu_instance: int
    compute_instance: int
    memory_total: int
    used: int


@dataclass
class _Gpu:
    index: int
    profile: GpuProfile
    rng: random.Random
    uuid: str
    serial: str
    bus_id: str
    load: float = 0.85
    wander: float = 0.85          # the load's own random walk when no job drives it
    driven: float | None = None   # the job's activity level this tick (set_job_load), else None
    rhythm: Any = None            # the job's gpumon.simulate.job.Rhythm: power samples follow its steps
    throttle_bit: int = 0         # clock-event reason bit a throttle control holds on
    throttle_factor: float = 1.0  # clocks and activity are multiplied by it while throttled
    power_mw: float = 0.0
    energy_mj: float = 0.0
    temp: float = 45.0
    mem_temp: float = 50.0
    used: int = 0
    reasons: int = 0
    violation_ns: dict[int, float] = field(default_factory=dict)
    pcie_tx: float = 0.0
    pcie_rx: float = 0.0
    pcie_replay: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    remap: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    link_up: list[int] = field(default_factory=list)
    link_kib: list[list[float]] = field(default_factory=list)      # [link][tx, rx]
    link_err: list[list[int]] = field(default_factory=list)        # [link][replay, recovery, crc_flit, crc_data]
    fan: float = 0.35
    lost: bool = False
    recovery_action: int = 0
    mig: list[_Mig] | None = None
    processes: list[tuple[int, int]] = field(default_factory=list)
    #: pid -> process name (what /proc/<pid>/comm holds on the host), for every process ever run
    names: dict[int, str] = field(default_factory=dict)
    #: pid -> the driver's newest utilization sample (timestamp µs, sm, mem, enc, dec) in percent
    proc_samples: dict[int, tuple[int, int, int, int, int]] = field(default_factory=dict)
    #: pid -> simulated time the process ended (its last sample is still answered for a while)
    ended: dict[int, float] = field(default_factory=dict)
    power_samples: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=_POWER_SAMPLE_CAPACITY))
    sample_rng: random.Random = field(default_factory=random.Random)
    fabric: _Fabric | None = None


@dataclass
class _Fabric:
    """What nvmlGpuFabricInfo_v3_t reports for one GPU (raw NVML values)."""

    state: int
    status: int
    cluster_uuid: bytes
    clique_id: int
    health: dict[str, int]    # NVML_GPU_FABRIC_HEALTH_MASK_<field> suffix -> raw value
    summary: int

    def mask(self) -> int:
        value = 0
        for name, raw in self.health.items():
            value |= raw << getattr(_real, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{name}")
        return value


_FABRIC_HEALTHY = {"DEGRADED_BW": 2, "ROUTE_RECOVERY": 2, "ROUTE_UNHEALTHY": 2, "ACCESS_TIMEOUT_RECOVERY": 2,
                   "INCORRECT_CONFIGURATION": 1, "PARTITION_ASSIGNED": 1}
"""A registered GB200: every 2-bit field FALSE, configuration NONE, partition assigned (GFM_STATE is left
NOT_SUPPORTED, as older R570 drivers leave newer fields)."""


def _target(arg: Any) -> Any:
    """The struct behind ``ctypes.byref(s)`` or ``ctypes.pointer(s)``. pynvml hands the argument to C
    as is, so a struct passed by value reaches the driver as garbage: INVALID_ARGUMENT here."""
    obj = getattr(arg, "_obj", None)
    if obj is None and isinstance(arg, ctypes._Pointer):
        obj = arg.contents
    if not isinstance(obj, ctypes.Structure):
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    return obj


class _Fault:
    def __init__(self, function: str, code: int, gpu: int | None, times: int | None) -> None:
        self.function, self.code, self.gpu, self.remaining = function, code, gpu, times


class Hang:
    """A scripted hang: calls to ``function`` block until :meth:`release`. ``entered`` is set when a
    call is blocked, so a test can wait for it instead of sleeping."""

    def __init__(self, function: str, gpu: int | None) -> None:
        self.function, self.gpu = function, gpu
        self.entered = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def wait(self) -> None:
        self.entered.set()
        self._released.wait()

    @property
    def released(self) -> bool:
        return self._released.is_set()


class _EventSet:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: list[tuple[int, int, int, int, int]] = []   # (gpu, type, data, gi, ci)
        self.registered: dict[int, int] = {}                    # gpu -> event mask
        self.freed = False


def _api(device_arg: bool = True, index_arg: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Common entry for every simulated NVML function: count, check init, faults, hangs, lost GPUs.
    The GPU is the one of the handle in the first argument, or (``index_arg``) the index there."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__

        @functools.wraps(fn)
        def entry(self: FakeNVML, *args: Any, **kwargs: Any) -> Any:
            gpu = None
            if index_arg and args:
                gpu = args[0] if isinstance(args[0], int) and 0 <= args[0] < len(self._gpus) else None
            elif device_arg and args:
                gpu = self._gpu_of(args[0])
            self._enter(name, gpu)
            return fn(self, *args, **kwargs)

        return entry

    return wrap


class FakeNVML:
    """Simulated NVML with ``count`` GPUs of ``profile``; use it wherever the ``pynvml`` module is."""

    def __init__(self, profile: str = "h100-sxm5-80gb", count: int = 8, seed: int = 0,
                 driver_version: str = "550.90.07", cuda_version: int = 12040,
                 power_swing: tuple[float, float, float] | None = None) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown GPU profile {profile!r} (known: {', '.join(sorted(PROFILES))})")
        self.profile_name = profile
        self.profile = PROFILES[profile]
        self.driver_version = driver_version
        self.driver_major = int(driver_version.split(".", 1)[0])
        self.cuda_version = cuda_version
        self._lock = threading.RLock()
        self._inits = 0
        self._loaded = False
        self._init_faults: list[tuple[int, int | None]] = []
        self._faults: list[_Fault] = []
        self._field_faults: dict[tuple[int, int | None, int | None], int] = {}
        self._gpm_faults: dict[tuple[int, int | None], int] = {}
        self._hangs: list[Hang] = []
        self._sets: dict[int, _EventSet] = {}
        self._samples: dict[int, tuple[int, dict[int, float]] | None] = {}
        self._next_id = 1
        self.calls: Counter[str] = Counter()
        self.gpu_calls: Counter[tuple[str, int]] = Counter()
        self.time = 0.0
        self._epoch_us = int(time.time() * 1e6)   # power sample timestamps are CPU time in µs
        #: (low W, high W, Hz): a square wave the power samples follow instead of the load
        self.power_swing = power_swing
        self._seed = seed
        self._next_pid = _WORKLOAD_PID_BASE
        self._gpus = [self._make_gpu(i, seed) for i in range(count)]
        self.tick(0.0)

    @property
    def gpu_count(self) -> int:
        """How many GPUs the host has (without an NVML call, which the tests count)."""
        return len(self._gpus)

    # --- module-like surface -------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            value = getattr(_real, name)
        except AttributeError:
            raise AttributeError(f"pynvml has no attribute {name!r}") from None
        if (name.startswith("nvml") and callable(value) and not isinstance(value, type)
                and name not in _PURE_HELPERS):
            def missing(*_args: Any, **_kwargs: Any) -> Any:
                with self._lock:
                    self.calls[name] += 1
                raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)

            missing.__name__ = name
            return missing
        return value

    # --- construction and time -----------------------------------------------------------------------

    def _make_gpu(self, index: int, seed: int) -> _Gpu:
        p = self.profile
        rng = random.Random(seed * 1000 + index)
        uuid = "GPU-" + "-".join("".join(f"{rng.randrange(16):x}" for _ in range(n)) for n in (8, 4, 4, 4, 12))
        bus = f"{index + 1:08X}:00:00.0" if p.nvlinks else f"{0x1000 + index * 0x100:08X}:00:00.0"
        gpu = _Gpu(index, p, rng, uuid, f"{p.serial_prefix}{rng.randrange(10**5):05d}", bus)
        gpu.load = gpu.wander = 0.75 + 0.2 * rng.random()
        gpu.energy_mj = 3.6e9 * (5 + index)   # a few days since the driver was loaded
        gpu.used = int(p.memory_total * (0.6 + 0.3 * rng.random()))
        gpu.violation_ns = {fid: rng.random() * 3e12 for fid in (74, 75, 76, 77, 78, 79, 80, 81, 269, 270, 271)}
        gpu.pcie_tx, gpu.pcie_rx = rng.random() * 1e14, rng.random() * 1e14
        gpu.pcie_replay = rng.randrange(3)
        gpu.ecc = {(0, 0): rng.randrange(4), (1, 0): 0, (0, 1): rng.randrange(40), (1, 1): 0}
        gpu.link_up = [1] * p.nvlinks
        gpu.link_kib = [[rng.random() * 1e12, rng.random() * 1e12] for _ in range(p.nvlinks)]
        gpu.link_err = [[0, 0, rng.randrange(2), 0] for _ in range(p.nvlinks)]
        gpu.processes = [(4000 + index * 10, int(gpu.used * 0.97))]
        gpu.names[4000 + index * 10] = "python3"
        gpu.sample_rng = random.Random(seed * 1000 + index + 7919)   # apart: other values stay as they were
        gpu.fabric = self._make_fabric(seed)
        return gpu

    def _make_fabric(self, seed: int) -> _Fabric | None:
        """Hopper + NVSwitch completes registration with a zero cluster UUID, clique 0 and no health
        fields (torchcomms #1385, #936 saw it on H100); a multi-node NVLink GPU gets the rack's UUID."""
        kind = self.profile.fabric
        if kind == "nvswitch":
            return _Fabric(_real.NVML_GPU_FABRIC_STATE_COMPLETED, _real.NVML_SUCCESS, bytes(16), 0, {}, 0)
        if kind == "mnnvl":
            rack = random.Random(seed + 0x6B200)   # one NVL72 rack: the same UUID for every GPU of the VM
            return _Fabric(_real.NVML_GPU_FABRIC_STATE_COMPLETED, _real.NVML_SUCCESS, rack.randbytes(16), 32766,
                           dict(_FABRIC_HEALTHY), _real.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY)
        return None

    def tick(self, seconds: float) -> None:
        """Advance simulated time: load wanders, power follows load, counters grow."""
        with self._lock:
            start = self.time
            self.time += seconds
            for g in self._gpus:
                if g.lost:
                    continue
                p = g.profile
                if g.driven is None:
                    g.wander = min(1.0, max(0.05, g.wander + g.rng.uniform(-0.08, 0.08)))
                    g.load = g.wander * g.throttle_factor
                else:   # a job's GPUs share its level; a little noise of their own
                    g.load = min(1.0, max(0.01, g.driven * g.throttle_factor * g.rng.uniform(0.99, 1.01)))
                target = p.idle_power_mw + (p.power_limit_mw - p.idle_power_mw) * (0.15 + 0.85 * g.load)
                previous = g.power_mw
                noise = g.rng.uniform(0.95, 1.03) if g.driven is None else g.rng.uniform(0.99, 1.01)
                g.power_mw = min(p.power_limit_mw, max(p.idle_power_mw, target * noise))
                taken = self._take_power_samples(g, start, previous)
                if taken and g.rhythm is None:
                    g.power_mw = float(taken[-1])
                g.energy_mj += (sum(taken) / len(taken) if taken else g.power_mw) * seconds
                g.temp = 32 + 35 * g.load + g.rng.uniform(-1, 1)
                g.mem_temp = g.temp + 6 + g.rng.uniform(-1, 1)
                g.reasons = _SW_POWER if g.power_mw >= 0.97 * p.power_limit_mw else 0
                if g.load < 0.1:
                    g.reasons |= _IDLE
                g.reasons |= g.throttle_bit
                if g.reasons & _SW_POWER:
                    g.violation_ns[74] += seconds * 1e9
                for reason_bit, fields in THROTTLES.values():
                    if g.throttle_bit & reason_bit:
                        for fid in fields:
                            if fid != 74:   # 74 grew above with the SW power cap bit
                                g.violation_ns[fid] += seconds * 1e9
                g.pcie_tx += seconds * 2.0e9 * g.load
                g.pcie_rx += seconds * 3.0e9 * g.load
                for link in range(p.nvlinks):
                    if g.link_up[link]:
                        g.link_kib[link][0] += seconds * 20e6 * g.load   # ~20 GB/s per link
                        g.link_kib[link][1] += seconds * 20e6 * g.load
                if g.rng.random() < 0.01 * seconds:
                    g.ecc[(0, 0)] += 1
                    g.ecc[(0, 1)] += 1
                if p.fan:
                    g.fan = 0.3 + 0.4 * g.load
                self._take_process_samples(g)

    def _take_power_samples(self, g: _Gpu, start: float, previous: float) -> list[int]:
        """The samples the driver took between ``start`` and now (at most a buffer's worth): the swing
        when one is set, else a ramp from the previous power to the new one with a little noise."""
        first = int(round(start * 1e6)) // _POWER_SAMPLE_US + 1
        last = int(round(self.time * 1e6)) // _POWER_SAMPLE_US
        first = max(first, last - _POWER_SAMPLE_CAPACITY + 1)
        taken = []
        for k in range(first, last + 1):
            t = k * _POWER_SAMPLE_US / 1e6
            if g.rhythm is not None:   # the job's steps, by the wall clock: every host in phase
                wall = (self._epoch_us + k * _POWER_SAMPLE_US) / 1e6
                mw = g.power_mw * (1.1 if job.computing(g.rhythm, wall) else 0.7) * g.sample_rng.uniform(0.99, 1.01)
            elif self.power_swing is not None:
                low, high, hz = self.power_swing
                level = (high if (t * hz) % 1.0 < 0.5 else low) * 1e3
                mw = level * g.sample_rng.uniform(0.985, 1.0)
            else:
                frac = (k - first + 1) / (last - first + 1)
                mw = (previous + (g.power_mw - previous) * frac if previous else g.power_mw) \
                    * (g.sample_rng.uniform(0.98, 1.02) if k != last else 1.0)
            mw = min(g.profile.power_limit_mw, max(0.0, mw))
            g.power_samples.append((self._epoch_us + k * _POWER_SAMPLE_US, round(mw)))
            taken.append(round(mw))
        return taken

    # --- fault scripts -------------------------------------------------------------------------------

    def _take_process_samples(self, g: _Gpu) -> None:
        """The newest per-process sample at the current time: the running processes take turns on
        the SMs, one per sampling period (wave3.md section 3: 99 % / 0 % alternating samples)."""
        period = int(round(self.time * 1e6)) // _PROC_SAMPLE_US
        ts = self._epoch_us + period * _PROC_SAMPLE_US
        for pid, when in list(g.ended.items()):
            if self.time - when > _PROC_ENDED_KEEP_S:
                del g.ended[pid]
                g.proc_samples.pop(pid, None)
        running = [pid for pid, _ in g.processes]
        if not running or g.mig is not None:
            return
        busy = running[period % len(running)]
        for pid in running:
            last = g.proc_samples.get(pid)
            if last is not None and last[0] >= ts:
                continue
            on = pid == busy
            sm = min(99, round(100 * g.load)) if on else 0
            enc = round(10 * g.load) if on and g.profile.encoder else 0
            g.proc_samples[pid] = (ts, sm, round(60 * g.load) if on else 0, enc, 0)

    def run_processes(self, gpu: int, names: list[str], memory_share: float = 0.97) -> list[int]:
        """Replace the GPU's compute processes by new ones named ``names`` (new PIDs), sharing
        ``memory_share`` of the used memory; the old ones end. Returns the new PIDs."""
        with self._lock:
            g = self._gpus[gpu]
            self._end(g)
            pids = []
            for name in names:
                self._next_pid += 1
                pids.append(self._next_pid)
                g.names[self._next_pid] = name[:15]   # comm holds at most 15 characters (TASK_COMM_LEN 16)
            each = int(g.used * memory_share / max(1, len(pids)))
            g.processes = [(pid, each) for pid in pids]
            self._take_process_samples(g)
            return pids

    def restore_processes(self, gpu: int) -> None:
        """Back to the one default process of the GPU (a workload ended)."""
        with self._lock:
            g = self._gpus[gpu]
            self._end(g)
            pid = 4000 + g.index * 10
            g.processes = [(pid, int(g.used * 0.97))]
            g.ended.pop(pid, None)
            self._take_process_samples(g)

    def _end(self, g: _Gpu) -> None:
        for pid, _ in g.processes:
            g.ended[pid] = self.time

    def process_names(self) -> dict[int, str]:
        """pid -> name of every process running on any GPU (what /proc/<pid>/comm says)."""
        with self._lock:
            return {pid: g.names.get(pid, "") for g in self._gpus for pid, _ in g.processes}

    def pci(self, gpu: int) -> tuple[str, int, int | None, str]:
        """(NVML bus id, NVML pciDeviceId, PID and name of the GPU's first running process or None
        and "") of GPU ``gpu``: what its PCI function and the driver's kernel-log lines name."""
        with self._lock:
            g = self._gpus[gpu]
            pid = g.processes[0][0] if g.processes else None
            return g.bus_id, g.profile.pci_device_id, pid, g.names.get(pid, "") if pid is not None else ""

    def fail(self, function: str, code: int, gpu: int | None = None, times: int | None = None) -> None:
        """Make ``function`` raise ``NVMLError(code)`` (for one GPU, or all), ``times`` times or forever."""
        with self._lock:
            self._faults.append(_Fault(function, code, gpu, times))

    def fail_field(self, field_id: int, code: int, gpu: int | None = None, scope: int | None = None) -> None:
        """Make one field of nvmlDeviceGetFieldValues answer ``code`` in its own nvmlReturn."""
        with self._lock:
            self._field_faults[(field_id, gpu, scope)] = code

    def fail_gpm_metric(self, metric_id: int, code: int, gpu: int | None = None) -> None:
        with self._lock:
            self._gpm_faults[(metric_id, gpu)] = code

    def fail_init(self, code: int | None, times: int | None = None) -> None:
        """nvmlInit raises ``code`` (e.g. DRIVER_NOT_LOADED) ``times`` times or until cleared with None."""
        with self._lock:
            self._init_faults = [] if code is None else [(code, times)]

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._field_faults.clear()
            self._gpm_faults.clear()
            self._init_faults.clear()
        self.release_hangs()

    def hang(self, function: str, gpu: int | None = None) -> Hang:
        """Calls to ``function`` block until the returned :class:`Hang` is released."""
        h = Hang(function, gpu)
        with self._lock:
            self._hangs.append(h)
        return h

    def release_hangs(self) -> None:
        with self._lock:
            hangs, self._hangs = self._hangs, []
        for h in hangs:
            h.release()

    def set_lost(self, gpu: int, xid: bool = True) -> None:
        """The GPU falls off the bus: every call on it raises GPU_IS_LOST (and XID 79 is reported);
        a wait on an event set it is registered in answers GPU_IS_LOST once the queue is empty."""
        with self._lock:
            self._gpus[gpu].lost = True
            sets = list(self._sets.values())
        if xid:
            self._post(gpu, _real.nvmlEventTypeXidCriticalError, 79)
        for s in sets:
            with s.cond:
                s.cond.notify_all()

    def restore(self, gpu: int) -> None:
        with self._lock:
            self._gpus[gpu].lost = False

    def repair(self) -> None:
        """What a reboot of the host does to its GPUs: every one answers again and its NVLink fabric
        registers afresh (the simulated ``reboot`` control action)."""
        with self._lock:
            for g in self._gpus:
                g.lost = False
                g.fabric = self._make_fabric(self._seed)
                g.mig = None   # GPU instances do not survive a reboot (NVIDIA MIG user guide)

    def inject_xid(self, gpu: int, xid: int, gpu_instance: int = 0xFFFFFFFF,
                   compute_instance: int = 0xFFFFFFFF) -> None:
        self._post(gpu, _real.nvmlEventTypeXidCriticalError, xid, gpu_instance, compute_instance)

    def inject_event(self, gpu: int, event_type: int, data: int = 0) -> None:
        self._post(gpu, event_type, data)

    def set_recovery_action(self, gpu: int, action: int) -> None:
        with self._lock:
            self._gpus[gpu].recovery_action = action
        self._post(gpu, _real.nvmlEventTypeGpuRecoveryAction, action)

    def set_mig(self, gpu: int, instances: int = 7) -> None:
        """Enable MIG on a GPU with ``instances`` equal GPU instances (one compute instance each);
        0 disables MIG again."""
        with self._lock:
            g = self._gpus[gpu]
            if not g.profile.mig_capable:
                raise ValueError(f"{g.profile.name} has no MIG")
            g.mig = [_Mig(7 + i, 0, g.profile.mig_instance_memory, int(g.profile.mig_instance_memory * 0.4))
                     for i in range(instances)] or None

    def set_job_load(self, gpu: int, level: float | None, rhythm: Any = None) -> None:
        """From the next tick on the GPU works at a job's ``level`` (0..1) and its power samples follow
        the job's steps (``rhythm``, a :class:`gpumon.simulate.job.Rhythm`); ``None`` lets it wander."""
        with self._lock:
            g = self._gpus[gpu]
            g.driven, g.rhythm = level, rhythm if level is not None else None

    def throttle(self, gpu: int, reason: str, factor: float) -> None:
        """Hold the GPU's clocks (and so its activity) at ``factor`` of what they were, with
        ``reason`` (a key of :data:`THROTTLES`) on in the event reasons and its violation time growing."""
        if reason not in THROTTLES:
            raise ValueError(f"unknown throttle reason {reason!r} (known: {', '.join(sorted(THROTTLES))})")
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"throttle factor must be in (0, 1], got {factor}")
        with self._lock:
            g = self._gpus[gpu]
            g.throttle_bit, g.throttle_factor = THROTTLES[reason][0], factor

    def unthrottle(self, gpu: int) -> None:
        with self._lock:
            g = self._gpus[gpu]
            g.throttle_bit, g.throttle_factor = 0, 1.0

    def set_power_swing(self, low_w: float, high_w: float, hz: float = 1.0) -> None:
        """From the next tick on, power samples follow a ``hz`` square wave between the two levels."""
        with self._lock:
            self.power_swing = (low_w, high_w, hz)

    def set_fabric(self, gpu: int, state: int | None = None, status: int | None = None,
                   health: dict[str, int] | None = None, summary: int | None = None) -> None:
        """Change what the fabric call reports: raw NVML values (NVML_GPU_FABRIC_STATE_*, an
        nvmlReturn_t, NVML_GPU_FABRIC_HEALTH_MASK_<field> suffix -> value, _HEALTH_SUMMARY_*)."""
        with self._lock:
            f = self._gpus[gpu].fabric
            if f is None:
                raise ValueError(f"{self.profile.name} takes part in no NVLink fabric")
            for name in health or {}:
                getattr(_real, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{name}")   # an unknown field raises
            f.state = f.state if state is None else state
            f.status = f.status if status is None else status
            f.health.update(health or {})
            f.summary = f.summary if summary is None else summary

    def add_nvlink_errors(self, gpu: int, link: int, kind: str, count: int = 1) -> None:
        """Count NVLink errors on one link; ``kind`` is replay, recovery, crc_flit or crc_data."""
        with self._lock:
            self._gpus[gpu].link_err[link][("replay", "recovery", "crc_flit", "crc_data").index(kind)] += count

    def set_link_down(self, gpu: int, link: int) -> None:
        with self._lock:
            self._gpus[gpu].link_up[link] = 0

    def reset_calls(self) -> None:
        with self._lock:
            self.calls.clear()
            self.gpu_calls.clear()

    def calls_for_gpu(self, gpu: int) -> int:
        with self._lock:
            return sum(n for (_, g), n in self.gpu_calls.items() if g == gpu)

    def gpm_samples_allocated(self) -> int:
        """GPM sample buffers allocated and not yet freed."""
        with self._lock:
            return len(self._samples)

    def _post(self, gpu: int, event_type: int, data: int, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF) -> None:
        with self._lock:
            sets = [s for s in self._sets.values() if not s.freed and s.registered.get(gpu, 0) & event_type]
        for s in sets:
            with s.cond:
                s.queue.append((gpu, event_type, data, gi, ci))
                s.cond.notify_all()

    # --- the common entry ----------------------------------------------------------------------------

    def _gpu_of(self, handle: Any) -> int | None:
        address = _addr(handle)
        if _DEVICE_BASE <= address < _DEVICE_BASE + 0x1000 * len(self._gpus):
            return (address - _DEVICE_BASE) // 0x1000
        if _MIG_BASE <= address < _MIG_BASE + 0x1000 * len(self._gpus):
            return (address - _MIG_BASE) // 0x1000
        return None

    def _enter(self, name: str, gpu: int | None) -> None:
        with self._lock:
            self.calls[name] += 1
            if gpu is not None:
                self.gpu_calls[(name, gpu)] += 1
            if self.driver_major < _FUNCTION_SINCE.get(name, 0):   # pynvml finds no such symbol
                # ... in a library it loads at the first nvmlInit and keeps after nvmlShutdown
                raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND if self._loaded
                           else _real.NVML_ERROR_UNINITIALIZED)
            hang = next((h for h in self._hangs if h.function == name and h.gpu in (None, gpu)
                         and not h.released), None)
        if hang is not None:
            hang.wait()
        with self._lock:
            if name not in ("nvmlInit", "nvmlInitWithFlags") and self._inits <= 0:
                raise _err(_real.NVML_ERROR_UNINITIALIZED)
            for f in self._faults:
                if f.function == name and f.gpu in (None, gpu) and f.remaining != 0:
                    if f.remaining is not None:
                        f.remaining -= 1
                    raise _err(f.code)
            if gpu is not None and self._gpus[gpu].lost:
                raise _err(_real.NVML_ERROR_GPU_IS_LOST)

    def _device(self, handle: Any) -> _Gpu:
        gpu = self._gpu_of(handle)
        if gpu is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpus[gpu]

    def _mig(self, handle: Any) -> tuple[_Gpu, _Mig]:
        address = _addr(handle)
        if not _MIG_BASE <= address < _MIG_BASE + 0x1000 * len(self._gpus):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        g = self._gpus[(address - _MIG_BASE) // 0x1000]
        slot = address & 0xFFF
        if g.mig is None or slot >= len(g.mig):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g, g.mig[slot]

    @staticmethod
    def _is_mig_handle(handle: Any) -> bool:
        return _MIG_BASE <= _addr(handle) < _SET_BASE

    def _whole_gpu_only(self, g: _Gpu) -> None:
        """NVML refuses some whole-GPU queries while MIG is enabled."""
        if g.mig is not None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)

    # --- init and system -----------------------------------------------------------------------------

    @_api(False)
    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._lock:
            if self._init_faults:
                code, times = self._init_faults[0]
                if times is not None:
                    times -= 1
                    self._init_faults = [(code, times)] if times > 0 else []
                raise _err(code)
            self._inits += 1
            self._loaded = True

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @_api(False)
    def nvmlShutdown(self) -> None:
        with self._lock:
            self._inits = max(0, self._inits - 1)

    @_api(False)
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    @_api(False)
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion()

    @_api(False)
    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    @_api(False, index_arg=True)
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self._gpus):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return _ptr(_DEVICE_BASE + 0x1000 * index, _real.c_nvmlDevice_t)

    # --- identity ------------------------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetName(self, handle: Any) -> str:
        """A MIG device handle answers its parent's name and its GPU instance profile, as
        ``nvidia-smi -L`` lists it ("NVIDIA H100 80GB HBM3 MIG 1g.10gb")."""
        if self._is_mig_handle(handle):
            g, _ = self._mig(handle)
            return f"{g.profile.name} MIG {g.profile.mig_instance_profile}"
        return self._device(handle).profile.name

    @_api()
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        """A MIG device handle answers its own ``MIG-<uuid>`` (nvml.h: "For MIG devices, the UUID is
        of the form MIG-..."); here derived from the parent's UUID and the instance ids."""
        if self._is_mig_handle(handle):
            g, m = self._mig(handle)
            return "MIG-" + str(uuid.uuid5(uuid.NAMESPACE_OID, f"{g.uuid}/{m.gpu_instance}/{m.compute_instance}"))
        return self._device(handle).uuid

    @_api()
    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        return self._device(handle).serial

    @_api()
    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str:
        return self._device(handle).profile.vbios

    @_api()
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._device(handle).index

    @_api()
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._device(handle).index

    @_api()
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        g = self._device(handle)
        info = _real.nvmlPciInfo_t()
        domain, bus = int(g.bus_id[:8], 16), int(g.bus_id[9:11], 16)
        info.busIdLegacy = (_real.NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT % (domain & 0xFFFF, bus, 0)).encode()
        info.busId = g.bus_id.encode()
        info.domain, info.bus, info.device = domain, bus, 0
        info.pciDeviceId = g.profile.pci_device_id
        info.pciSubSystemId = 0x16C110DE
        return info

    # --- utilization, memory, temperature, power, clocks ---------------------------------------------

    @_api()
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        g = self._device(handle)
        self._whole_gpu_only(g)
        util = _real.c_nvmlUtilization_t()
        util.gpu = round(100 * g.load)
        util.memory = round(60 * g.load)
        return util

    @_api()
    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        g = self._device(handle)
        self._whole_gpu_only(g)
        if not g.profile.encoder:     # no NVENC: an H100 answers 0 (tests/fixtures/nvml/h100_r580.json)
            return [0, _UTIL_PERIOD_US]
        return [round(10 * g.load), _UTIL_PERIOD_US]

    @_api()
    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        g = self._device(handle)
        self._whole_gpu_only(g)
        return [0, _UTIL_PERIOD_US]

    @_api()
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        if self._is_mig_handle(handle):
            _, m = self._mig(handle)
            total, used, reserved = m.memory_total, m.used, 0
        else:
            g = self._device(handle)
            total, used, reserved = g.profile.memory_total, g.used, g.profile.memory_reserved
        if not version:
            mem = _real.c_nvmlMemory_t()
            mem.total, mem.used, mem.free = total, used + reserved, total - used - reserved
            return mem
        if version != _real.nvmlMemory_v2:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        mem2 = _real.c_nvmlMemory_v2_t()
        mem2.version = version
        mem2.total, mem2.reserved, mem2.used = total, reserved, used
        mem2.free = total - used - reserved
        return mem2

    @_api()
    def nvmlDeviceGetBAR1MemoryInfo(self, handle: Any) -> Any:
        g = self._device(handle)
        bar1 = _real.c_nvmlBAR1Memory_t()
        bar1.bar1Total = g.profile.bar1_total
        bar1.bar1Used = 33 * 2**20
        bar1.bar1Free = bar1.bar1Total - bar1.bar1Used
        return bar1

    @_api()
    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int, version: int = _real.nvmlTemperature_v1) -> int:
        if version != _real.nvmlTemperature_v1:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return round(self._device(handle).temp)

    @_api()
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return round(self._device(handle).temp)

    @_api()
    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        g = self._device(handle)
        if threshold not in g.profile.thresholds:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return g.profile.thresholds[threshold]

    @_api()
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return round(self._device(handle).power_mw)

    @_api()
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._device(handle).profile.power_limit_mw

    @_api()
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return int(self._device(handle).energy_mj)

    def _clock_mhz(self, g: _Gpu, clock: int, maximum: bool) -> int:
        p = g.profile
        if clock in (_real.NVML_CLOCK_SM, _real.NVML_CLOCK_GRAPHICS):
            top = p.sm_max_mhz
            if maximum:
                return top
            if g.reasons & _IDLE:
                return 345
            if g.throttle_bit:
                return round(top * g.throttle_factor)
            return round(top * (0.92 if g.reasons & _SW_POWER else 1.0))
        if clock == _real.NVML_CLOCK_MEM:
            return p.mem_max_mhz
        if clock == _real.NVML_CLOCK_VIDEO:
            return round(p.sm_max_mhz * 0.88)
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)

    @_api()
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        return self._clock_mhz(self._device(handle), type, False)

    @_api()
    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        return self._clock_mhz(self._device(handle), type, True)

    @_api()
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._device(handle).reasons

    @_api()
    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        g = self._device(handle)
        return 8 if g.reasons & _IDLE else 0

    @_api()
    def nvmlDeviceGetFanSpeed(self, handle: Any) -> int:
        g = self._device(handle)
        if not g.profile.fan:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return round(100 * g.fan)

    # --- PCIe, ECC, retirement, remapping ------------------------------------------------------------

    @_api()
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._device(handle).profile.pcie_gen

    @_api()
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._device(handle).profile.pcie_gen

    @_api()
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._device(handle).profile.pcie_width

    @_api()
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._device(handle).profile.pcie_width

    @_api()
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._device(handle).pcie_replay

    @_api()
    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        g = self._device(device)
        return round((2.0e6 if counter == _real.NVML_PCIE_UTIL_TX_BYTES else 3.0e6) * g.load)  # KB/s

    @_api()
    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        self._device(handle)
        return [_real.NVML_FEATURE_ENABLED, _real.NVML_FEATURE_ENABLED]

    @_api()
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        g = self._device(handle)
        if (errorType, counterType) not in g.ecc:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.ecc[(errorType, counterType)]

    @_api()
    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        self._device(device)
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)   # Ampere and newer remap rows instead

    @_api()
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        self._device(device)
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)

    @_api()
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        r = self._device(device).remap
        return (r[0], r[1], r[2], r[3])

    # --- NVLink --------------------------------------------------------------------------------------

    def _link(self, g: _Gpu, link: int) -> int:
        if not g.profile.nvlinks:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < g.profile.nvlinks:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return link

    @_api()
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        g = self._device(device)
        return g.link_up[self._link(g, link)]

    @_api()
    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        g = self._device(device)
        link = self._link(g, link)
        order = {_real.NVML_NVLINK_ERROR_DL_REPLAY: 0, _real.NVML_NVLINK_ERROR_DL_RECOVERY: 1,
                 _real.NVML_NVLINK_ERROR_DL_CRC_FLIT: 2, _real.NVML_NVLINK_ERROR_DL_CRC_DATA: 3}
        if counter not in order:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.link_err[link][order[counter]]

    # --- NVLink fabric --------------------------------------------------------------------------------

    def _fabric(self, g: _Gpu) -> _Fabric:
        if g.fabric is None:   # nvml.h: NOT_SUPPORTED "if the device doesn't support gpu fabric"
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return g.fabric

    @staticmethod
    def _fill_fabric(f: _Fabric, info: Any) -> None:
        ctypes.memmove(info.clusterUuid, f.cluster_uuid, len(f.cluster_uuid))
        info.state, info.status, info.cliqueId = f.state, f.status, f.clique_id
        if hasattr(info, "healthMask"):
            info.healthMask = f.mask()
        if hasattr(info, "healthSummary"):
            info.healthSummary = f.summary

    @_api()
    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        """The versioned call: the struct's ``version`` must be one this driver knows (v2; v3 from
        R570 here), and the struct must be as large as the version says (its low 24 bits)."""
        g = self._device(device)
        info = _target(gpuFabricInfo)
        known = {_real.nvmlGpuFabricInfo_v2}
        if self.driver_major >= _FABRIC_V3_SINCE:
            known.add(_real.nvmlGpuFabricInfo_v3)
        if int(getattr(info, "version", 0)) not in known:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if ctypes.sizeof(info) < info.version & 0xFFFFFF:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            self._fill_fabric(self._fabric(g), info)
        return _real.NVML_SUCCESS

    @_api()
    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any) -> int:
        """The deprecated call (c_nvmlGpuFabricInfo_t: no version, no health)."""
        g = self._device(device)
        info = _target(gpuFabricInfo)
        with self._lock:
            self._fill_fabric(self._fabric(g), info)
        return _real.NVML_SUCCESS

    # --- sample buffers ------------------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetSamples(self, device: Any, sampling_type: int, timeStamp: int) -> tuple[int, list[Any]]:
        """As pynvml returns it: ``(valueType, [c_nvmlSample_t, ...])`` of the samples newer than
        ``timeStamp`` (0: the whole buffer); NOT_FOUND when there is none. Only power is simulated."""
        g = self._device(device)
        if not 0 <= sampling_type < _real.NVML_SAMPLINGTYPE_COUNT:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if sampling_type != _real.NVML_TOTAL_POWER_SAMPLES:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            fresh = [(ts, mw) for ts, mw in g.power_samples if ts > timeStamp]
        if not fresh:
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        samples = (_real.c_nvmlSample_t * len(fresh))()
        for sample, (ts, mw) in zip(samples, fresh):
            sample.timeStamp = ts
            sample.sampleValue.uiVal = mw
        return _real.NVML_VALUE_TYPE_UNSIGNED_INT, samples[0:len(fresh)]

    # --- field values --------------------------------------------------------------------------------

    def _field(self, g: _Gpu, fid: int, scope: int) -> tuple[int, int, float]:
        """(nvmlReturn, valueType, value) for one field of one GPU."""
        p = g.profile
        ok, ull, dbl, uint = _real.NVML_SUCCESS, _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, \
            _real.NVML_VALUE_TYPE_DOUBLE, _real.NVML_VALUE_TYPE_UNSIGNED_INT
        unsupported = (_real.NVML_ERROR_NOT_SUPPORTED, ull, 0)
        if fid == 82:
            return (ok, uint, round(g.mem_temp)) if p.hbm else unsupported
        if fid == 83:
            return ok, ull, int(g.energy_mj)
        if fid in (185, 186):
            return ok, uint, round(g.power_mw)
        if fid in (190, 189, 188):
            return ok, uint, p.power_limit_mw
        if self.driver_major < _FIELD_SINCE.get(fid, 0):
            if fid in _R570_POWER_SMOOTHING and self.driver_major >= 570:
                return ok, uint, _R570_POWER_SMOOTHING[fid]
            return unsupported                      # a field id this driver does not know
        if fid in (193, 194, 195, 196):
            # T.Limit scale: degrees below the GPU's T.Limit point, signed; the point is the max operating
            # temperature. A real H100 (driver 580, nvidia-smi -q): "GPU Shutdown T.Limit Temp: -8 C",
            # "GPU Slowdown T.Limit Temp: -2 C", "GPU Max Operating T.Limit Temp: 0 C" and "Memory Max
            # Operating T.Limit Temp: 0 C" (memory counts from its own maximum)
            threshold = {193: 0, 194: 1, 195: 2, 196: 3}[fid]
            if threshold not in p.thresholds or 3 not in p.thresholds:
                return unsupported
            margin = 0 if fid == 195 else p.thresholds[3] - p.thresholds[threshold]
            return ok, _real.NVML_VALUE_TYPE_SIGNED_INT, margin
        if fid in g.violation_ns:
            return ok, ull, int(g.violation_ns[fid])
        if fid == 94:
            return ok, uint, g.pcie_replay
        if fid in (197, 198):
            # a 32-bit counter that wraps every 4 GiB: an H100 with driver 580 answers valueType
            # NVML_VALUE_TYPE_UNSIGNED_INT (tests/fixtures/nvml/h100_r580.json)
            return ok, uint, int(g.pcie_tx if fid == 197 else g.pcie_rx) % 2**32
        if fid in (3, 4, 5, 6):
            key = {3: (0, 0), 4: (1, 0), 5: (0, 1), 6: (1, 1)}[fid]
            return ok, ull, g.ecc[key]
        if fid in (29, 30, 31, 92, 93):
            return unsupported                      # page retirement is pre-Ampere
        if fid in (142, 143, 144, 145):
            return ok, ull, g.remap[fid - 142]       # unsigned long long on an H100, driver 580
        if fid == 230:
            return ok, uint, g.recovery_action
        if fid == 91:
            return (ok, uint, p.nvlinks) if p.nvlinks else unsupported
        if fid in (38, 45, 52, 59):   # "total for all lanes" of the link in scopeId
            if not p.nvlinks:
                return unsupported
            if not 0 <= scope < p.nvlinks:
                return _real.NVML_ERROR_INVALID_ARGUMENT, ull, 0
            return ok, ull, g.link_err[scope][{38: 2, 45: 3, 52: 0, 59: 1}[fid]]
        if fid in (165, 138, 139, 161, 162, 163):
            if not p.nvlinks:
                return unsupported
            if not 0 <= scope < p.nvlinks:
                return _real.NVML_ERROR_INVALID_ARGUMENT, ull, 0
            if fid == 165:
                return ok, uint, g.link_up[scope]
            if fid in (138, 139):
                return ok, ull, int(g.link_kib[scope][fid - 138])
            return ok, ull, g.link_err[scope][{161: 0, 162: 1, 163: 2}[fid]]
        return _real.NVML_ERROR_NOT_SUPPORTED, ull, dbl * 0

    @_api()
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        g = self._device(handle)
        values = (_real.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = int(time.time() * 1e6)
        for i, request in enumerate(fieldIds):
            try:
                fid, scope = request
            except TypeError:
                fid, scope = request, 0
            v = values[i]
            v.fieldId, v.scopeId, v.timestamp, v.latencyUsec = fid, scope, now_us, 0
            with self._lock:
                code = next((c for (f, gi, sc), c in self._field_faults.items()
                             if f == fid and gi in (None, g.index) and sc in (None, scope)), None)
                ret, vtype, value = self._field(g, fid, scope) if code is None else (code, 3, 0)
            v.nvmlReturn, v.valueType = ret, vtype
            if ret == _real.NVML_SUCCESS:
                member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                          6: "usVal"}[vtype]
                setattr(v.value, member, value)
        return values

    # --- processes and MIG ---------------------------------------------------------------------------

    @_api()
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        g = self._device(handle)
        procs = []
        for pid, mem in g.processes:
            info = _real.c_nvmlProcessInfo_v3_t()
            info.pid, info.usedGpuMemory = pid, mem
            info.gpuInstanceId = info.computeInstanceId = 0xFFFFFFFF
            obj = _real.nvmlStructToFriendlyObject(info)
            procs.append(obj)
        return procs

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self.nvmlDeviceGetComputeRunningProcesses(handle)

    def _process_samples(self, g: _Gpu, timeStamp: int) -> list[tuple[int, tuple[int, int, int, int, int]]]:
        """The newest sample of each PID newer than ``timeStamp``; NOT_FOUND when there is none
        (wave3.md section 3: not an error, common at short intervals). Under MIG the whole GPU's
        per-process samples are refused (NOT_SUPPORTED): NVML documents no per-instance answer and
        refuses the whole-GPU utilization calls under MIG; this is the double's assumption."""
        self._whole_gpu_only(g)
        with self._lock:
            fresh = sorted((pid, s) for pid, s in g.proc_samples.items() if s[0] > int(timeStamp))
        if not fresh:
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        return fresh

    @_api()
    def nvmlDeviceGetProcessesUtilizationInfo(self, handle: Any, timeStamp: int) -> list[Any]:
        """As pynvml returns it: a list of ``c_nvmlProcessUtilizationInfo_v1_t`` (the struct
        version ``ProcessesUtilizationInfo_v1`` is filled by pynvml itself)."""
        fresh = self._process_samples(self._device(handle), timeStamp)
        out = (_real.c_nvmlProcessUtilizationInfo_v1_t * len(fresh))()
        for s, (pid, (ts, sm, mem, enc, dec)) in zip(out, fresh):
            s.timeStamp, s.pid, s.smUtil, s.memUtil, s.encUtil, s.decUtil = ts, pid, sm, mem, enc, dec
            s.jpgUtil = s.ofaUtil = 0
        return out[0:len(fresh)]

    @_api()
    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """As pynvml returns it: a list of ``c_nvmlProcessUtilizationSample_t``; Blackwell answers
        NOT_SUPPORTED (wave3.md section 3)."""
        g = self._device(handle)
        if not g.profile.legacy_process_util:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        fresh = self._process_samples(g, timeStamp)
        out = (_real.c_nvmlProcessUtilizationSample_t * len(fresh))()
        for s, (pid, (ts, sm, mem, enc, dec)) in zip(out, fresh):
            s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil = pid, ts, sm, mem, enc, dec
        return out[0:len(fresh)]

    @_api()
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        g = self._device(device)
        if not g.profile.mig_capable:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        mode = _real.NVML_DEVICE_MIG_ENABLE if g.mig is not None else _real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @_api()
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        g = self._device(device)
        if not g.profile.mig_capable:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:    # zero while MIG is off (nvml.h; an H100 with MIG disabled answers 0)
            return 7 if g.mig else 0

    @_api()
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        g = self._device(device)
        if g.mig is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(g.mig):
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        return _ptr(_MIG_BASE + 0x1000 * g.index + index, _real.c_nvmlDevice_t)

    @_api()
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig(device)[1].gpu_instance

    @_api()
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig(device)[1].compute_instance

    # --- events --------------------------------------------------------------------------------------

    @_api(False)
    def nvmlEventSetCreate(self) -> Any:
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            self._sets[sid] = _EventSet()
        return _ptr(_SET_BASE + sid, _real.c_nvmlEventSet_t)

    def _set(self, event_set: Any) -> _EventSet:
        s = self._sets.get(_addr(event_set) - _SET_BASE)
        if s is None or s.freed:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return s

    def _event_types(self) -> int:
        types = _BASE_EVENT_TYPES
        for bit, since in _EVENT_SINCE.items():
            if self.driver_major >= since:
                types |= bit
        return types

    @_api()
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._device(handle)
        return self._event_types()

    @_api()
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        g = self._device(handle)
        s = self._set(eventSet)
        if eventTypes & ~self._event_types():   # "some of the requested event types" are not supported
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            s.registered[g.index] = s.registered.get(g.index, 0) | eventTypes

    @_api(False)
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Queued events first; then GPU_IS_LOST while a registered GPU is lost (the real library
        answers that on every wait until the set no longer holds it); INVALID_ARGUMENT for a set
        freed under the wait; TIMEOUT when nothing happened."""
        s = self._set(eventSet)
        deadline = time.monotonic() + timeoutms / 1000.0
        with s.cond:
            while not s.queue:
                if s.freed:
                    raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
                if any(self._gpus[gpu].lost for gpu in s.registered):
                    raise _err(_real.NVML_ERROR_GPU_IS_LOST)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _err(_real.NVML_ERROR_TIMEOUT)
                s.cond.wait(remaining)
            gpu, event_type, data, gi, ci = s.queue.pop(0)
        out = _real.c_nvmlEventData_t()
        out.device = _ptr(_DEVICE_BASE + 0x1000 * gpu, _real.c_nvmlDevice_t)
        out.eventType, out.eventData = event_type, data
        out.gpuInstanceId, out.computeInstanceId = gi, ci
        return out

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @_api(False)
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        s = self._set(eventSet)
        with s.cond:
            s.freed = True
            s.cond.notify_all()

    # --- GPM -----------------------------------------------------------------------------------------

    @_api()
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        g = self._device(device)
        support = _real.c_nvmlGpmSupport_t()
        support.version = _real.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1 if g.profile.gpm else 0
        return support

    @_api(False)
    def nvmlGpmSampleAlloc(self) -> Any:
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            self._samples[sid] = None
        return _ptr(_SAMPLE_BASE + sid, _real.c_nvmlGpmSample_t)

    @_api(False)
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        with self._lock:
            if self._samples.pop(_addr(gpmSample) - _SAMPLE_BASE, "missing") == "missing":
                raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)

    def _gpm_values(self, g: _Gpu, share: float) -> dict[int, float]:
        load = g.load * share
        return {1: 100 * min(1.0, g.load * 1.05), 2: 100 * load * 0.9, 3: 100 * load * 0.45,
                5: 100 * load * 0.6, 10: 100 * load * 0.55, 11: 100 * load * 0.02, 12: 100 * load * 0.2,
                13: 100 * load * 0.05, 20: 1900 * load, 21: 2850 * load,
                60: 19000 * load * g.profile.nvlinks / 18, 61: 19000 * load * g.profile.nvlinks / 18}

    def _store_sample(self, gpmSample: Any, gpu: int, values: dict[int, float]) -> None:
        sid = _addr(gpmSample) - _SAMPLE_BASE
        with self._lock:
            if sid not in self._samples:
                raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
            self._samples[sid] = (gpu, values)

    @_api()
    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        g = self._device(device)
        if not g.profile.gpm:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        self._store_sample(gpmSample, g.index, self._gpm_values(g, 1.0))
        return gpmSample

    @_api()
    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        g = self._device(device)
        if not g.profile.gpm or g.mig is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        if all(m.gpu_instance != gpuInstanceId for m in g.mig):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        self._store_sample(gpmSample, g.index, self._gpm_values(g, min(1.0, 3.0 / len(g.mig))))
        return gpmSample

    @_api(False)
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        if metricsGet.version != _real.NVML_GPM_METRICS_GET_VERSION:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        with self._lock:
            s1 = self._samples.get(_addr(metricsGet.sample1) - _SAMPLE_BASE)
            s2 = self._samples.get(_addr(metricsGet.sample2) - _SAMPLE_BASE)
            faults = dict(self._gpm_faults)
        if not s1 or not s2 or s1[0] != s2[0]:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu, v1, v2 = s1[0], s1[1], s2[1]
        with self._lock:
            self.gpu_calls[("nvmlGpmMetricsGet", gpu)] += 1   # attributed through its samples
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            mid = int(metric.metricId)
            code = faults.get((mid, gpu), faults.get((mid, None)))
            if code is None and mid not in v2:
                code = _real.NVML_ERROR_NOT_SUPPORTED
            if code is not None:
                metric.nvmlReturn = code
                continue
            metric.nvmlReturn = _real.NVML_SUCCESS
            metric.value = (v1[mid] + v2[mid]) / 2.0
        return metricsGet

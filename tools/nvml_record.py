"""Record what an NVML library answers to every call gpumon makes, as JSON.

Run on a real GPU host from a gpumon checkout (``python tools/nvml_record.py --out host.json``, or
``python -m tools.nvml_record``; the wheel does not ship it), it writes down the driver's own
answers: each call's outcome (a value's shape and value, or the NVML error code), every field id's
``nvmlReturn`` / ``valueType`` / value, the power-sample buffer, GPM metrics, the event types the
GPU supports, and how long each call takes. Run against :class:`FakeNVML`, it writes the double's
answers in the same form, so a test can hold the double to a real driver's record
(``tests/fixtures/nvml/``). The per-run calls and fields are the collector's own tables
(``nvml_readings`` and ``nvml_fabric``): one the collector adds is recorded without touching this
file. The static facts the collector reads at discovery are listed here (``STATIC_CALLS``).

``--events SECONDS`` also waits that long for NVML events (XIDs, ...) on every GPU and records each
one as the driver delivered it. ``--processes SECONDS`` instead records GPU 0's per-process calls over that
long while the GPU runs compute processes (started by the caller, e.g. ``scripts/gpu_load.py``): every
answer of both per-process utilization calls asked every ``--poll`` seconds, what an immediate second
call answers, the running-process list once a second, and how long an ended process's last sample is
still answered.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

if __package__ in (None, ""):  # run as ``python tools/nvml_record.py``: gpumon from this checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpumon.collectors import nvml_readings as M
from gpumon.collectors.nvml_fabric import FABRIC_ITEM, FABRIC_LEGACY_ITEM
from gpumon.collectors.nvml_gpm import GpmPair, alloc_samples, free_samples
from gpumon.collectors.nvml_process_util import ENGINES, INFO_FN, LEGACY_FN
from gpumon.collectors.nvml_session import NvmlSession, nvml_code
from gpumon.collectors.nvml_tables import GPM_ALL_IDS, NOT_FOUND, TIMEOUT, TOTAL_POWER_SAMPLES, union_value

TIMING_REPEATS = 20
"""Calls timed per item: the median of these is recorded (the first call of a kind can be slower)."""

POWER_BUFFER_WAIT = 5.0
"""Seconds to wait before reading the whole power-sample buffer again, to see how many samples it keeps."""

STATIC_CALLS: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("name", "nvmlDeviceGetName", ()),
    ("uuid", "nvmlDeviceGetUUID", ()),
    ("serial", "nvmlDeviceGetSerial", ()),
    ("vbios", "nvmlDeviceGetVbiosVersion", ()),
    ("pci", "nvmlDeviceGetPciInfo_v3", ()),
    ("mig_mode", "nvmlDeviceGetMigMode", ()),
    ("max_mig_devices", "nvmlDeviceGetMaxMigDeviceCount", ()),
    ("max_clock_graphics", "nvmlDeviceGetMaxClockInfo", (0,)),
    ("max_clock_sm", "nvmlDeviceGetMaxClockInfo", (1,)),
    ("max_clock_memory", "nvmlDeviceGetMaxClockInfo", (2,)),
    ("max_pcie_generation", "nvmlDeviceGetMaxPcieLinkGeneration", ()),
    ("max_pcie_width", "nvmlDeviceGetMaxPcieLinkWidth", ()),
    ("ecc_mode", "nvmlDeviceGetEccMode", ()),
    ("gpm_support", "nvmlGpmQueryDeviceSupport", ()),
    ("supported_events", "nvmlDeviceGetSupportedEventTypes", ()),
    ("nvlink_crc_data_link0", "nvmlDeviceGetNvLinkErrorCounter", (0, M.NVLINK_ERROR_DL_CRC_DATA)),
) + tuple((f"threshold_{label}", "nvmlDeviceGetTemperatureThreshold", (t,)) for t, label in M.THRESHOLDS)


def plain(value: Any, depth: int = 0) -> Any:
    """A JSON-able copy of what pynvml returned: structures as {field: value}, bytes as text,
    handles and pointers as the string ``"<pointer>"``."""
    if depth > 6:
        return "<deep>"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, ctypes.Structure | ctypes.Union):
        return {name: plain(getattr(value, name), depth + 1) for name, *_ in type(value)._fields_}
    if isinstance(value, ctypes.Array):
        items = list(value)
        return [plain(v, depth + 1) for v in items[:64]]
    if isinstance(value, ctypes._Pointer | ctypes.c_void_p):
        return "<pointer>"
    if isinstance(value, ctypes._SimpleCData):
        return plain(value.value, depth + 1)
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in list(value)[:64]]
    if hasattr(value, "__dict__"):   # pynvml's nvmlFriendlyObject
        return {k: plain(v, depth + 1) for k, v in sorted(vars(value).items())}
    return repr(value)


def _outcome(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Call ``fn`` ``repeats`` times: the first answer (or error code), the median wall time and the
    median CPU time of this thread, in µs (a driver that waits on the GPU's firmware takes wall time
    without CPU)."""
    times: list[float] = []
    cpu: list[float] = []
    first: dict[str, Any] | None = None
    for _ in range(max(1, repeats)):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        try:
            value = fn()
            result: dict[str, Any] = {"value": plain(value)}
        except Exception as exc:  # noqa: BLE001 - recording the error is the point
            code = nvml_code(exc)
            result = {"error": code if code is not None else repr(exc), "message": str(exc)}
        times.append((time.perf_counter() - t0) * 1e6)
        cpu.append((time.thread_time() - c0) * 1e6)
        if first is None:
            first = result
    assert first is not None
    first["us"] = round(statistics.median(times), 1)
    first["cpu_us"] = round(statistics.median(cpu), 1)
    return first


def _call_items() -> list[M.CallItem]:
    return [*M.FAST_CALLS, *M.SLOW_CALLS, *M.FALLBACK_CALLS.values(), FABRIC_ITEM, FABRIC_LEGACY_ITEM]


def record_device(session: NvmlSession, index: int, repeats: int,
                  sleep: Callable[[float], Any] = time.sleep) -> dict[str, Any]:
    device = session.devices[index]
    h = device.handle
    out: dict[str, Any] = {"index": index, "static": {}, "calls": {}}
    for key, fn, args in STATIC_CALLS:
        out["static"][key] = _outcome(partial(session.call, fn, h, *args), 1)
    for item in _call_items():
        entry = _outcome(partial(_call, session, device, item), repeats)
        entry["fn"] = item.fn
        out["calls"][item.key] = entry
    out["fields"] = _record_fields(session, h, repeats)
    out["power_samples"] = _record_power_samples(session, h, repeats, sleep)
    out["gpm"] = _record_gpm(session, h, repeats, sleep)
    return out


def _call(session: NvmlSession, device: Any, item: M.CallItem) -> Any:
    """One call of the collector's table, as the collector makes it."""
    if item.read is not None:
        return item.read(session, device)
    return session.call(item.fn, device.handle, *item.args)


def _record_fields(session: NvmlSession, h: Any, repeats: int) -> dict[str, Any]:
    ids = [(fs.field_id, 0) for fs in M.FIELDS] + [(M.FIELD_NVLINK_LINK_COUNT, 0)]
    per_link = [M.FIELD_NVLINK_STATE, M.FIELD_NVLINK_TX_KIB, M.FIELD_NVLINK_RX_KIB]
    per_link += [fs.field_id for fs in M.NVLINK_TOTAL_FIELDS] + [fid for fid, _ in M.NVLINK_LINK_ERROR_FIELDS]
    ids += [(fid, 0) for fid in per_link]
    t = _outcome(lambda: session.call("nvmlDeviceGetFieldValues", h, ids), repeats)
    values = session.call("nvmlDeviceGetFieldValues", h, ids)
    rows = []
    for (fid, scope), fv in zip(ids, values):
        ret = int(fv.nvmlReturn)
        row: dict[str, Any] = {"id": fid, "scope": scope, "nvmlReturn": ret, "valueType": int(fv.valueType)}
        if ret == 0:
            row["value"] = union_value(fv.value, int(fv.valueType))
        rows.append(row)
    alone = {str(fid): _outcome(partial(session.call, "nvmlDeviceGetFieldValues", h, [(fid, 0)]),
                                repeats)["us"] for fid, _ in ids}
    every_run = [(fs.field_id, 0) for fs in M.FIELDS if not fs.slow]
    fast = _outcome(lambda: session.call("nvmlDeviceGetFieldValues", h, every_run), repeats)
    return {"us_per_call": t["us"], "cpu_us_per_call": t["cpu_us"], "asked": len(ids), "values": rows,
            "us_per_field_alone": alone,
            "every_run_fields": {"asked": len(every_run), "us": fast["us"], "cpu_us": fast["cpu_us"]}}


def _record_power_samples(session: NvmlSession, h: Any, repeats: int, sleep: Callable[[float], Any]) -> dict[str, Any]:
    """Two reads 1 s apart, with the instant power reading between them, then the whole buffer again
    after a wait: the samples' unit (mW), spacing and how many the driver keeps are what the collector
    relies on."""
    try:
        vtype, samples = session.call("nvmlDeviceGetSamples", h, TOTAL_POWER_SAMPLES, 0)
    except Exception as exc:  # noqa: BLE001
        return {"error": nvml_code(exc), "message": str(exc)}
    last = max((int(s.timeStamp) for s in samples), default=0)
    usage_mw = _safe(lambda: int(session.call("nvmlDeviceGetPowerUsage", h)))
    sleep(1.0)
    try:
        _, fresh = session.call("nvmlDeviceGetSamples", h, TOTAL_POWER_SAMPLES, last)
        fresh_outcome: dict[str, Any] = {"count": len(fresh)}
        stamps = [int(s.timeStamp) for s in fresh]
    except Exception as exc:  # noqa: BLE001
        fresh_outcome, stamps = {"error": nvml_code(exc)}, []
    sleep(POWER_BUFFER_WAIT)
    whole = _safe(lambda: session.call("nvmlDeviceGetSamples", h, TOTAL_POWER_SAMPLES, 0)[1]) or []
    whole_stamps = [int(s.timeStamp) for s in whole]
    newest = max(whole_stamps, default=0)
    cost = _outcome(lambda: session.call("nvmlDeviceGetSamples", h, TOTAL_POWER_SAMPLES, newest - 200_000),
                    repeats)
    values = [union_value(s.sampleValue, vtype) for s in samples]
    steps = [b - a for a, b in zip(sorted(stamps), sorted(stamps)[1:])]
    return {
        "sampleValType": int(vtype), "count": len(samples),
        "first_timestamps_us": [int(s.timeStamp) for s in samples[:3]],
        "min": min(values, default=None), "max": max(values, default=None),
        "power_usage_mw": usage_mw, "after_1s": fresh_outcome,
        "median_step_us": statistics.median(steps) if steps else None,
        "call_last_200ms": {k: cost.get(k) for k in ("us", "cpu_us", "error")},
        "buffer_after_wait": {"wait_s": POWER_BUFFER_WAIT, "count": len(whole),
                              "span_us": (max(whole_stamps) - min(whole_stamps)) if whole_stamps else None},
    }


def _record_gpm(session: NvmlSession, h: Any, repeats: int, sleep: Callable[[float], Any]) -> dict[str, Any]:
    support = _safe(lambda: session.call("nvmlGpmQueryDeviceSupport", h))
    if support is None or not getattr(support, "isSupportedDevice", 0):
        return {"supported": False}
    samples = alloc_samples(session, lambda: session.call("nvmlGpmSampleAlloc"))
    if samples is None:
        return {"supported": True, "error": "nvmlGpmSampleAlloc"}
    pair = GpmPair(samples, "nvmlGpmSampleGet", (h,))
    try:
        pair.sample(session)
        sleep(1.0)
        pair.sample(session)
        got = pair.read(session, list(GPM_ALL_IDS))
        sample_cost = _outcome(lambda: session.call("nvmlGpmSampleGet", h, samples[0]), repeats)
        read_cost = _outcome(lambda: pair.read(session, list(GPM_ALL_IDS)), repeats)
        per_id = {str(mid): _outcome(partial(pair.read, session, [mid]), repeats)["cpu_us"]
                  for mid in GPM_ALL_IDS}
        return {"supported": True, "metrics": [{"id": mid, "nvmlReturn": code, "value": value}
                                               for mid, code, value in got],
                "metrics_get_cpu_us_per_id_alone": per_id,
                "sample_get": {k: sample_cost[k] for k in ("us", "cpu_us")},
                "metrics_get": {k: read_cost[k] for k in ("us", "cpu_us")}}
    except Exception as exc:  # noqa: BLE001
        return {"supported": True, "error": nvml_code(exc), "message": str(exc)}
    finally:
        free_samples(session, samples)


def record_events(session: NvmlSession, seconds: float) -> dict[str, Any]:
    """Wait ``seconds`` for events on every GPU (each GPU registered for every type it supports)."""
    es = session.call("nvmlEventSetCreate")
    registered: dict[int, Any] = {}
    for dev in session.devices:
        mask = _safe(partial(session.call, "nvmlDeviceGetSupportedEventTypes", dev.handle)) or 0
        try:
            session.call("nvmlDeviceRegisterEvents", dev.handle, int(mask), es)
            registered[dev.index] = mask
        except Exception as exc:  # noqa: BLE001
            registered[dev.index] = f"error {nvml_code(exc)}"
    timeout = _outcome(lambda: session.call("nvmlEventSetWait_v2", es, 1), 1)
    events: list[dict[str, Any]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data = session.call("nvmlEventSetWait_v2", es, 500)
        except Exception as exc:  # noqa: BLE001
            if nvml_code(exc) != TIMEOUT:
                events.append({"error": nvml_code(exc), "message": str(exc)})
            continue
        seen = session.device_for(data.device)
        events.append({"at": round(time.monotonic() - end + seconds, 3),
                       "gpu": seen.index if seen else None, "eventType": int(data.eventType),
                       "eventData": int(data.eventData), "gpuInstanceId": int(data.gpuInstanceId),
                       "computeInstanceId": int(data.computeInstanceId)})
    session.call("nvmlEventSetFree", es)
    return {"registered": registered, "empty_wait": timeout, "events": events}


PROCESS_POLL_S = 0.1
"""How often ``--processes`` asks each per-process utilization call: faster than the driver samples."""
FROM_ZERO_EVERY_S = 2.0
"""How often ``--processes`` also asks with ``lastSeenTimestamp`` 0: which PIDs the driver still keeps."""


def _sample(s: Any) -> dict[str, int]:
    row = {"pid": int(s.pid), "timeStamp": int(s.timeStamp)}
    for _, member in ENGINES:
        row[member] = int(getattr(s, member))
    for member in ("jpgUtil", "ofaUtil"):
        if hasattr(s, member):
            row[member] = int(getattr(s, member))
    return row


def _wall_us() -> int:
    """The wall clock in µs, recorded beside each answer to tell which clock ``timeStamp`` is on."""
    return int(time.time() * 1e6)


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def record_processes(session: NvmlSession, seconds: float, poll: float = PROCESS_POLL_S,
                     sleep: Callable[[float], Any] = time.sleep,
                     clock: Callable[[], float] = time.monotonic,
                     wall_us: Callable[[], int] = _wall_us,
                     comm: Callable[[int], str | None] = _comm) -> dict[str, Any]:
    """GPU 0's per-process answers over ``seconds`` (the workload is the caller's): each call's
    samples with the wall clock (µs) when they came, NOT_FOUND and error counts, the outcome of an
    immediate second call, ``lastSeenTimestamp`` 0 answers every ``FROM_ZERO_EVERY_S``, the
    running processes once a second, and each call's cost (median µs and CPU µs)."""
    h = session.devices[0].handle
    fns = (INFO_FN, LEGACY_FN)
    last = dict.fromkeys(fns, 0)
    out: dict[str, Any] = {
        "poll_s": poll, "window_s": seconds,
        "answers": {fn: [] for fn in fns}, "not_found": dict.fromkeys(fns, 0),
        "errors": {fn: {} for fn in fns}, "again": {fn: {} for fn in fns},
        "from_zero": [], "running": [], "comm": {},
    }

    def ask(fn: str, since: int) -> tuple[list[dict[str, int]] | None, int | None]:
        try:
            return [_sample(s) for s in session.call(fn, h, since)], None
        except Exception as exc:  # noqa: BLE001 - the code is what is recorded
            code = nvml_code(exc)
            return None, code if code is not None else -1

    start = clock()
    next_running = next_zero = 0.0
    while (at := clock() - start) < seconds:
        if at >= next_running:
            next_running = at + 1.0
            procs = _safe(lambda: session.call("nvmlDeviceGetComputeRunningProcesses", h))
            listed: list[dict[str, Any]] = [plain(p) for p in procs or []]
            out["running"].append({"at": round(at, 3), "processes": listed})
            for p in listed:
                pid = int(p["pid"])
                if str(pid) not in out["comm"]:
                    out["comm"][str(pid)] = comm(pid)
        if at >= next_zero:
            next_zero = at + FROM_ZERO_EVERY_S
            for fn in fns:
                got, code = ask(fn, 0)
                out["from_zero"].append({"at": round(at, 3), "fn": fn, "wall_us": wall_us(),
                                         "samples": got, "error": code})
        for fn in fns:
            got, code = ask(fn, last[fn])
            if got is None:
                if code == NOT_FOUND:
                    out["not_found"][fn] += 1
                else:
                    out["errors"][fn][str(code)] = out["errors"][fn].get(str(code), 0) + 1
                continue
            out["answers"][fn].append({"at": round(at, 3), "wall_us": wall_us(), "since": last[fn],
                                       "samples": got})
            last[fn] = max([last[fn], *(s["timeStamp"] for s in got)])
            _, again = ask(fn, last[fn])
            key = "samples" if again is None else str(again)
            out["again"][fn][key] = out["again"][fn].get(key, 0) + 1
        sleep(poll)
    out["cost"] = {
        "running": _cost(lambda: session.call("nvmlDeviceGetComputeRunningProcesses", h)),
        **{f"{fn}:since_last": _cost(partial(session.call, fn, h, last[fn])) for fn in fns},
        **{f"{fn}:since_0": _cost(partial(session.call, fn, h, 0)) for fn in fns},
    }
    return out


def _cost(fn: Callable[[], Any]) -> dict[str, Any]:
    got = _outcome(fn, TIMING_REPEATS)
    return {k: got[k] for k in ("us", "cpu_us", "error") if k in got}


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def record(lib: Any = None, repeats: int = TIMING_REPEATS, events: float = 0.0,
           sleep: Callable[[float], Any] = time.sleep, processes: float = 0.0,
           poll: float = PROCESS_POLL_S, clock: Callable[[], float] = time.monotonic,
           wall_us: Callable[[], int] = _wall_us) -> dict[str, Any]:
    """The whole record; ``sleep`` waits between reads (a double passes its own clock's tick, and
    ``clock`` its own time). With ``processes`` > 0, only GPU 0's per-process calls over that long."""
    session = NvmlSession(lib)
    session.acquire()
    try:
        session.ensure()
        if not session.ready:
            raise SystemExit(f"NVML not ready: {session.reason}")
        module = session.lib
        doc: dict[str, Any] = {
            "nvidia_ml_py": getattr(module, "__version__", "") or _dist_version(),
            "driver_version": session.driver_version, "cuda_version": session.cuda_version,
            "machine": platform.machine(), "kernel": platform.release(),
        }
        if processes > 0:
            h = session.devices[0].handle
            doc["gpu"] = {key: _outcome(partial(session.call, fn, h, *args), 1).get("value")
                          for key, fn, args in STATIC_CALLS if key in ("name", "mig_mode")}
            doc["processes"] = record_processes(session, processes, poll, sleep, clock, wall_us)
            return doc
        doc["devices"] = [record_device(session, d.index, repeats, sleep) for d in session.devices
                          if d.handle is not None]
        if events > 0:
            doc["events"] = record_events(session, events)
        return doc
    finally:
        session.release()


def _dist_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nvidia-ml-py")
    except metadata.PackageNotFoundError:
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/nvml_record.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="-", help="file to write (default: standard output)")
    p.add_argument("--repeats", type=int, default=TIMING_REPEATS, help="calls timed per item")
    p.add_argument("--events", type=float, default=0.0, help="seconds to wait for NVML events")
    p.add_argument("--processes", type=float, default=0.0, metavar="SECONDS",
                   help="record only GPU 0's per-process calls over SECONDS (start the workload first)")
    p.add_argument("--poll", type=float, default=PROCESS_POLL_S, help="seconds between per-process asks")
    p.add_argument("--simulate", metavar="PROFILE", help="record the NVML double with this GPU profile")
    args = p.parse_args(argv)
    lib: Any = None
    if args.simulate:
        from gpumon.simulate.nvml import FakeNVML

        fake = FakeNVML(args.simulate, 1, driver_version="580.159.04", cuda_version=13000)
        fake.tick(3.0)    # a real driver's buffers are full when it is asked
        if args.processes:
            fake.run_processes(0, ["python3", "python3"])
        lib, sleep, clock = fake, fake.tick, lambda: fake.time
        wall_us = fake.wall_us
    else:
        sleep, clock, wall_us = time.sleep, time.monotonic, _wall_us  # type: ignore[assignment]
    doc = record(lib, args.repeats, args.events, sleep, args.processes, args.poll, clock, wall_us)
    body = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if args.out == "-":
        sys.stdout.write(body)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

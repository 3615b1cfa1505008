"""Per-process utilization (``[nvml] per_process``): every driver sample read once, a process that
ended gone as the driver forgets it, the top-N bound under process churn, the legacy call where the
R550 one is missing, MIG, names from /proc, and nothing changed with the option off."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pynvml

from gpumon.collectors import nvml_process_util as PU
from gpumon.collectors.base import Context
from gpumon.collectors.nvml import NvmlCollector
from gpumon.collectors.nvml_session import NvmlSession
from gpumon.config import Section
from gpumon.model import Collection
from gpumon.simulate import Simulation
from gpumon.simulate.nvml import FakeNVML
from tests.support.nvml import Clock, rig

FAMILY = "gpumon_gpu_process_utilization_ratio"


def util(out: Collection, gpu: str = "0") -> dict[tuple[str, str, str], float]:
    """(pid, process, engine) -> value of one GPU's per-process utilization series."""
    return {(s.label("pid") or "", s.label("process") or "", s.label("engine") or ""): s.value
            for f in out.families if f.name == FAMILY for s in f.samples if s.label("gpu") == gpu}


def pids(out: Collection, gpu: str = "0") -> set[str]:
    return {pid for pid, _, _ in util(out, gpu)}


def run(fake: FakeNVML, gpu: int, names: list[str]) -> list[int]:
    """Start a workload's processes and let the idle process's last sample age out of the driver."""
    started = fake.run_processes(gpu, names)
    fake.tick(40)
    return started


def spy(fake: FakeNVML, fn: str) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each call of ``fn`` from now on: the timestamp asked and the (pid, timeStamp) answered."""
    seen: list[tuple[int, list[tuple[int, int]]]] = []
    real = getattr(fake, fn)

    def wrapped(handle: Any, ts: int) -> Any:
        try:
            got = real(handle, ts)
        except pynvml.NVMLError:
            seen.append((ts, []))
            raise
        seen.append((ts, [(int(s.pid), int(s.timeStamp)) for s in got]))
        return got

    setattr(fake, fn, wrapped)
    return seen


def test_each_driver_sample_is_read_once_and_none_is_skipped() -> None:
    fake, c, _ = rig(count=1, per_process=True)
    run(fake, 0, ["python3"] * 4)
    calls = spy(fake, PU.INFO_FN)
    answered: list[tuple[int, int]] = []
    for _ in range(6):
        fake.tick(10)
        c.collect()
    previous = 0
    for asked, got in calls:
        assert asked == previous          # each call asks from the newest sample of the one before
        answered += got
        previous = max([previous] + [ts for _, ts in got])
    assert len(answered) == len(set(answered)) == 6 * 4   # every run: each PID's newest, never twice
    c.close()


def test_samples_since_the_last_run_are_averaged_per_pid_and_older_ones_skipped() -> None:
    def sample(pid: int, ts: int, sm: int) -> Any:
        s = pynvml.c_nvmlProcessUtilizationSample_t()
        s.pid, s.timeStamp, s.smUtil, s.memUtil = pid, ts, sm, sm // 2
        return s

    state = PU.ProcessUtilState(last_seen=100)
    got = PU.aggregate([sample(7, 50, 99), sample(7, 150, 80), sample(7, 250, 40), sample(9, 200, 0)], state)
    assert got[7][0] == (80 + 40) / 200 and got[7][1] == (40 + 20) / 200   # the ts 50 one was read before
    assert got[9] == (0.0, 0.0, 0.0, 0.0) and state.last_seen == 250


def test_no_new_sample_is_not_an_error_and_leaves_the_series_out() -> None:
    fake, c, _ = rig(count=1, per_process=True)
    fake.tick(10)
    assert pids(c.collect())
    out = c.collect()                      # no time passed: NOT_FOUND, as an immediate second call
    assert not pids(out) and not out.errors
    c.close()


def test_a_process_that_ended_before_the_run_is_not_reported_as_the_driver_forgot_it(tmp_path: Path) -> None:
    # An H100 with driver 580 dropped an ended process's samples within 1.3 s of its end
    # (tests/fixtures/nvml/h100_r580_processes.json): a run after that cannot see it.
    fake, c, _ = rig(count=1, per_process=True, proc_root=str(tmp_path))
    (old,) = run(fake, 0, ["trainer"])
    (tmp_path / str(old)).mkdir()
    (tmp_path / str(old) / "comm").write_text("trainer\n")
    assert ((str(old), "trainer", "sm")) in util(c.collect())
    fake.tick(0.3)                         # it runs a little after the last run, then ends
    fake.restore_processes(0)              # ... and its /proc entry goes with it
    (tmp_path / str(old) / "comm").unlink()
    (tmp_path / str(old)).rmdir()
    fake.tick(1.0)
    assert pids(c.collect()) == {"4000"}   # the process that followed it, and nothing of the old one
    c.close()


def test_thousands_of_short_lived_processes_stay_within_the_bound() -> None:
    fake, c, _ = rig(count=2, per_process=True, per_process_top=3)
    seen: set[str] = set()
    for _ in range(30):
        fake.run_processes(0, ["worker"] * 100)   # 100 new PIDs each run, 3,000 in all
        fake.tick(2.0)                              # 10 sampling periods: 10 of them sampled
        out = c.collect()
        got = util(out)
        seen |= pids(out)
        assert len(got) <= (3 + 1) * 4 and "other" in pids(out)
        assert len(got) == len(set(got))
    assert len(seen) > 30                  # the PIDs did change; only the bound held
    assert all(len(g.proc_util.names) <= 3 for g in c._gpus)   # the name memory is bounded too
    c.close()


def test_top_n_keeps_the_busiest_and_sums_the_rest_into_other() -> None:
    per_pid = {1: (0.9, 0.5, 0.0, 0.0), 2: (0.05, 0.1, 0.0, 0.0), 3: (0.3, 0.2, 0.0, 0.0),
               4: (0.02, 0.01, 0.0, 0.1)}
    rows = PU.rows(per_pid, PU.ProcessUtilState(), 2, "/nonexistent")
    got = {(extra[0], extra[2]): v for _, extra, v in rows}
    assert {pid for pid, _ in got} == {"1", "3", "other"}
    assert abs(got[("other", "sm")] - 0.07) < 1e-9 and abs(got[("other", "decoder")] - 0.1) < 1e-9


def test_a_driver_without_the_r550_call_is_read_through_the_legacy_one_refusal_counted_once() -> None:
    errors = {}
    for on in (False, True):
        fake, c, _ = rig(count=2, driver="535.183.01", per_process=on)
        fake.tick(10)
        first = c.collect()
        errors[on] = first.errors.get("nvml_function_not_found", 0)
        if on:
            assert pids(first) == {"4000"} and pids(first, "1") == {"4010"}
            for _ in range(3):
                fake.tick(10)
                out = c.collect()
                assert pids(out) == {"4000"} and not out.errors.get("nvml_function_not_found")
            assert fake.calls[PU.INFO_FN] == 2 and fake.calls[PU.LEGACY_FN] == 8
        c.close()
    assert errors[True] - errors[False] == 2           # once per GPU, in the first run only


def test_a_gpu_refusing_both_calls_exports_nothing_and_is_not_asked_again() -> None:
    errors = {}
    for on in (False, True):
        fake, c, _ = rig("gb200", count=1, driver="535.183.01", per_process=on)
        fake.tick(10)
        out = c.collect()
        errors[on] = out.errors
        assert not pids(out)
        fake.tick(10)
        c.collect()
        c.close()
    assert fake.calls[PU.INFO_FN] == fake.calls[PU.LEGACY_FN] == 1
    for reason in ("nvml_function_not_found", "nvml_not_supported"):
        assert errors[True].get(reason, 0) - errors[False].get(reason, 0) == 1


def test_blackwell_answers_through_the_r550_call() -> None:
    fake, c, _ = rig("gb200", count=1, per_process=True)
    fake.tick(10)
    assert pids(c.collect()) == {"4000"} and fake.calls[PU.LEGACY_FN] == 0
    c.close()


def test_mig_enabled_mid_run_withdraws_that_gpu_only() -> None:
    fake, c, _ = rig(count=2, per_process=True)
    fake.tick(10)
    assert pids(c.collect()) == {"4000"}
    fake.tick(10)
    fake.set_mig(0, instances=3)
    out = c.collect()
    assert not pids(out) and pids(out, "1") == {"4010"}
    assert out.errors.get("nvml_not_supported", 0) >= 1
    c.close()


def test_names_come_from_proc_and_an_unreadable_one_is_empty(tmp_path: Path) -> None:
    fake, c, _ = rig(count=1, per_process=True, proc_root=str(tmp_path))
    a, b = run(fake, 0, ["python3", "hidden"])
    (tmp_path / str(a)).mkdir()
    (tmp_path / str(a) / "comm").write_text("python3\n")   # b: another PID namespace (no hostPID)
    names = {pid: name for pid, name, _ in util(c.collect())}
    assert names == {str(a): "python3", str(b): ""}
    c.close()


def test_with_per_process_off_the_calls_and_series_are_the_same_as_before() -> None:
    """Off: no per-process call and no per-process series, whatever the GPUs run; the other calls
    and series are exactly those of a collector with it on, less the opt-in ones."""
    results = {}
    for on in (False, True):
        fake, c, _ = rig(count=2, per_process=on)
        run(fake, 0, ["python3"] * 4)
        for _ in range(3):
            fake.tick(10)
            out = c.collect()
        calls = dict(fake.calls)
        results[on] = (calls, {(f.name, s.labels) for f in out.families for s in f.samples
                               if f.name != "gpumon_nvml_calls_total"})
        c.close()
    (off_calls, off_series), (on_calls, on_series) = results[False], results[True]
    assert PU.INFO_FN not in off_calls and PU.LEGACY_FN not in off_calls
    assert off_calls == {k: v for k, v in on_calls.items() if k not in PU.CALLS}
    opt_in = {FAMILY, "gpumon_gpu_process_memory_bytes"}
    assert off_series == {s for s in on_series if s[0] not in opt_in}
    assert not {s for s in off_series if s[0] in opt_in}


def test_a_simulated_workload_shows_named_processes(tmp_path: Path) -> None:
    sim = Simulation("nd-h100-v5", str(tmp_path))
    try:
        sim.apply({"action": "allocate", "gpu": 2, "namespace": "ml", "pod": "train-0", "processes": 4})
        ctx = Context(hostname="test", nvml=sim.nvml, simulation=sim)
        ctx.get_shared("nvml", lambda: NvmlSession(sim.nvml, clock=Clock()))
        values = {o.key: o.default for o in NvmlCollector.options.options}
        values["per_process"] = True
        c = NvmlCollector(ctx, Section("nvml", values))
        sim.step(1.0)
        got = util(c.collect(), "2")
        workers = {pid for pid, name, _ in got if name == "python3"}
        assert len(workers) == 4 and all(int(p) >= 200_000 for p in workers)
        sim.apply({"action": "release", "gpu": 2})
        sim.step(30.0)
        sim.step(1.0)
        assert not workers & pids(c.collect(), "2")
        c.close()
    finally:
        sim.stop()


def test_the_structs_are_pynvmls_as_the_collector_reads_them() -> None:
    """The members the collector reads exist on both sample structs (nvidia-ml-py names)."""
    for struct in (pynvml.c_nvmlProcessUtilizationInfo_v1_t, pynvml.c_nvmlProcessUtilizationSample_t):
        members = {name for name, _ in struct._fields_}
        assert {"pid", "timeStamp"} | {m for _, m in PU.ENGINES} <= members
    assert ctypes.sizeof(pynvml.c_nvmlProcessUtilizationInfo_v1_t) == 40


def test_attribution_labels_name_the_pod_holding_the_gpu_on_each_process_series() -> None:
    from gpumon.attribution_labels import relabel
    from gpumon.collectors.attribution import ALLOCATION
    from gpumon.model import MetricFamily

    fake, c, _ = rig(count=2, per_process=True)
    run(fake, 0, ["python3"] * 2)
    out = c.collect()
    c.close()
    held = MetricFamily(ALLOCATION, (ALLOCATION.sample(1.0, "0", "", "", "ml", "train-0", "main", ""),))
    (family,) = [f for f in relabel(out.families, held) if f.name == FAMILY]
    by_gpu = {(s.label("gpu"), s.label("pid")): (s.label("namespace"), s.label("pod")) for s in family.samples}
    assert {v for (gpu, _), v in by_gpu.items() if gpu == "0"} == {("ml", "train-0")}
    assert {v for (gpu, _), v in by_gpu.items() if gpu == "1"} == {("", "")}     # nobody holds GPU 1
    assert len({pid for gpu, pid in by_gpu if gpu == "0"}) == 2


def test_allocate_takes_a_process_count_and_name_and_refuses_a_bad_count(tmp_path: Path) -> None:
    import pytest

    from gpumon.simulate.actions import check, parse_assignments

    command = parse_assignments("allocate", ["gpu=1", "job_id=42", "processes=3", "process=vllm"])
    check(command, gpu=True, ib=True)
    sim = Simulation("nd-h100-v5", str(tmp_path))
    try:
        sim.apply(command)
        running = [pid for pid, _ in sim.nvml._gpus[1].processes]
        assert len(running) == 3
        assert all((tmp_path / "proc" / str(pid) / "comm").read_text() == "vllm\n" for pid in running)
        with pytest.raises(ValueError, match="processes"):
            sim.apply({"action": "allocate", "gpu": 2, "job_id": "43", "processes": 0})
        assert [a["gpu"] for a in sim.allocations] == [1]     # the bad one changed nothing
        sim.apply({"action": "release"})
        assert not any((tmp_path / "proc" / str(pid)).exists() for pid in running)
    finally:
        sim.stop()

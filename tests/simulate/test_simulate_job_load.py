"""A simulated job moves its GPUs in step across hosts, and each control that degrades it moves the
values it names: throttle, congest, stall/resume, restore."""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Iterator

import pynvml
import pytest

from gpumon.simulate import Simulation, control, job
from gpumon.simulate.nvml import THROTTLES

T0 = 1_800_000_000.0   # a wall-clock second; the rhythm is a function of it and the job id
JOB = "4242"


def start_job(sim: Simulation, job_id: str = JOB, gpus: range = range(8)) -> None:
    for gpu in gpus:
        control(sim.workdir, {"action": "allocate", "gpu": gpu, "job_id": job_id})
    sim.step(0.0, wall=T0)   # applies the control files


@pytest.fixture
def hosts(tmp_path) -> Iterator[list[Simulation]]:
    sims = [Simulation("nd-h100-v5", str(tmp_path / f"node{i}"), hostname=f"node{i}") for i in range(2)]
    for sim in sims:
        sim.nvml.nvmlInit()
    yield sims
    for sim in sims:
        sim.stop()


def run(sims: list[Simulation], start: float, seconds: int) -> None:
    for k in range(seconds):
        for sim in sims:
            sim.step(1.0, wall=start + k)


def util(sim: Simulation, gpu: int) -> int:
    n = sim.nvml
    return int(n.nvmlDeviceGetUtilizationRates(n.nvmlDeviceGetHandleByIndex(gpu)).gpu)


def sm_clock(sim: Simulation, gpu: int) -> int:
    n = sim.nvml
    return int(n.nvmlDeviceGetClockInfo(n.nvmlDeviceGetHandleByIndex(gpu), pynvml.NVML_CLOCK_SM))


def power_w(sim: Simulation, gpu: int) -> float:
    n = sim.nvml
    return float(n.nvmlDeviceGetPowerUsage(n.nvmlDeviceGetHandleByIndex(gpu))) / 1000


def field(sim: Simulation, gpu: int, fid: int) -> int:
    n = sim.nvml
    (value,) = n.nvmlDeviceGetFieldValues(n.nvmlDeviceGetHandleByIndex(gpu), [fid])
    assert value.nvmlReturn == pynvml.NVML_SUCCESS
    return int(value.value.ullVal)


def counter(sim: Simulation, device: str, name: str) -> int:
    with open(os.path.join(sim.fabric.port_dir(device), "counters", name), encoding="ascii") as fh:
        return int(fh.read())


def link_errors(sim: Simulation) -> list[int]:
    return [sim.fabric.port(f"mlx5_ib{i}").counters[c] for i in range(8) for c in ("symbol_error", "port_rcv_errors")]


def test_rhythm_is_a_function_of_job_id_and_wall_clock() -> None:
    r = job.rhythm(JOB)
    assert r == job.rhythm(JOB) and r != job.rhythm("4243")
    levels = [job.level(r, T0 + s) for s in range(0, 600, 10)]
    assert 0.8 < min(levels) < max(levels) < 0.92          # drifts, never idles, never hits the power cap
    phases = {job.computing(r, T0 + s / 50) for s in range(200)}
    assert phases == {True, False}                           # compute and collective both within 4 s


def test_healthy_job_moves_in_step_across_two_hosts(hosts) -> None:
    for sim in hosts:
        start_job(sim)
    errors = [link_errors(sim) for sim in hosts]   # a healthy job's links stay clean
    r = job.rhythm(JOB)
    for minute in range(3):   # the level drifts over minutes; both hosts follow it, together
        start = T0 + 1 + 120 * minute
        run(hosts, start, 3)
        expected = 100 * job.level(r, start + 2)
        values = [util(sim, gpu) for sim in hosts for gpu in range(8)]
        assert all(abs(v - expected) <= 2 for v in values), (expected, values)
        powers = [power_w(sim, gpu) for sim in hosts for gpu in range(8)]
        assert max(powers) / min(powers) < 1.05, powers
        assert {sm_clock(sim, gpu) for sim in hosts for gpu in range(8)} == {1980}
        ib = [sim.fabric.port(f"mlx5_ib{i}").load for sim in hosts for i in range(8)]
        assert [link_errors(sim) for sim in hosts] == errors
        assert max(ib) - min(ib) < 0.02 and abs(statistics.mean(ib) - job.IB_SHARE * expected / 100) < 0.02


def test_power_samples_follow_the_steps_by_the_wall_clock(hosts) -> None:
    """The driver's 20 ms power samples are high in the compute phase and low in the collective, at the
    same wall-clock instants on both hosts (started apart, so their sample buffers differ)."""
    for sim in hosts:
        start_job(sim)
        sim.step(2.0)   # wall clock now: the samples carry real CPU timestamps
    r = job.rhythm(JOB)
    for sim in hosts:
        n = sim.nvml
        _, samples = n.nvmlDeviceGetSamples(n.nvmlDeviceGetHandleByIndex(3), pynvml.NVML_TOTAL_POWER_SAMPLES, 0)
        mean_w = statistics.mean(s.sampleValue.uiVal for s in samples) / 1000
        phases = [(job.computing(r, s.timeStamp / 1e6), s.sampleValue.uiVal / 1000) for s in samples]
        assert {p for p, _ in phases} == {True, False}
        assert all(w > mean_w for p, w in phases if p) and all(w < mean_w for p, w in phases if not p)


@pytest.mark.parametrize("reason", sorted(THROTTLES))
def test_throttle_drops_clock_and_activity_and_grows_that_reasons_violation(hosts, reason) -> None:
    sim = hosts[0]
    start_job(sim)
    run([sim], T0 + 1, 2)
    bit, fields = THROTTLES[reason]
    before = {fid: field(sim, 5, fid) for fid in (74, 75, 79)}
    control(sim.workdir, {"action": "throttle", "gpu": 5, "reason": reason, "factor": 0.7})
    run([sim], T0 + 3, 11)   # the first step applies the control file; ten throttled seconds follow
    assert sm_clock(sim, 5) == round(1980 * 0.7) and sm_clock(sim, 4) == 1980
    assert abs(util(sim, 5) - 0.7 * util(sim, 4)) <= 3
    assert power_w(sim, 5) < 0.85 * power_w(sim, 4)
    n = sim.nvml
    assert n.nvmlDeviceGetCurrentClocksEventReasons(n.nvmlDeviceGetHandleByIndex(5)) & bit
    assert not n.nvmlDeviceGetCurrentClocksEventReasons(n.nvmlDeviceGetHandleByIndex(4)) & bit
    grown = {fid: (field(sim, 5, fid) - before[fid]) / 1e9 for fid in before}
    for fid, seconds in grown.items():
        if fid in fields:
            assert 9.5 <= seconds <= 10.5, (fid, seconds)
        else:
            assert seconds == 0, (fid, seconds)

    control(sim.workdir, {"action": "restore", "gpu": 5})
    run([sim], T0 + 20, 2)
    assert sm_clock(sim, 5) == 1980 and abs(util(sim, 5) - util(sim, 4)) <= 3
    assert not n.nvmlDeviceGetCurrentClocksEventReasons(n.nvmlDeviceGetHandleByIndex(5)) & bit


def test_throttle_of_a_gpu_in_no_job_holds_it_down_too(hosts) -> None:
    sim = hosts[0]
    sim.apply({"action": "throttle", "gpu": 2, "reason": "sw_power_cap", "factor": 0.5})
    run([sim], T0, 3)
    assert sm_clock(sim, 2) == 990
    assert util(sim, 2) <= 50


def test_congest_grows_port_xmit_wait_and_drops_its_traffic(hosts) -> None:
    sim = hosts[0]
    start_job(sim)
    run([sim], T0 + 1, 2)
    names = ("port_xmit_wait", "port_xmit_data")
    before = {d: {c: counter(sim, d, c) for c in names} for d in ("mlx5_ib3", "mlx5_ib2")}
    control(sim.workdir, {"action": "congest", "device": "mlx5_ib3", "port": 1, "factor": 0.5})
    sim.step(0.0, wall=T0 + 3)
    run([sim], T0 + 3, 10)
    grew = {d: {c: counter(sim, d, c) - before[d][c] for c in names} for d in before}
    assert 0.4 < grew["mlx5_ib3"]["port_xmit_data"] / grew["mlx5_ib2"]["port_xmit_data"] < 0.6
    assert grew["mlx5_ib3"]["port_xmit_wait"] > 5 * grew["mlx5_ib2"]["port_xmit_wait"] > 0

    control(sim.workdir, {"action": "restore", "device": "mlx5_ib3", "port": 1})
    sim.step(0.0, wall=T0 + 13)
    mid = {d: {c: counter(sim, d, c) for c in names} for d in before}
    run([sim], T0 + 13, 10)
    after = {d: {c: counter(sim, d, c) - mid[d][c] for c in names} for d in before}
    assert 0.9 < after["mlx5_ib3"]["port_xmit_data"] / after["mlx5_ib2"]["port_xmit_data"] < 1.1
    assert after["mlx5_ib3"]["port_xmit_wait"] < 2 * after["mlx5_ib2"]["port_xmit_wait"]


def test_stall_idles_the_jobs_gpus_with_memory_held_and_resume_runs_them_again(hosts) -> None:
    sim = hosts[0]
    start_job(sim, gpus=range(4))
    start_job(sim, job_id="7", gpus=range(4, 8))
    run([sim], T0 + 1, 2)
    n = sim.nvml
    handle = n.nvmlDeviceGetHandleByIndex(1)
    used = n.nvmlDeviceGetMemoryInfo(handle).used
    ib_before = counter(sim, "mlx5_ib0", "port_xmit_data")
    control(sim.workdir, {"action": "stall", "job_id": JOB})
    run([sim], T0 + 3, 5)
    assert all(util(sim, g) <= 5 for g in range(4)) and all(util(sim, g) >= 80 for g in range(4, 8))
    assert power_w(sim, 1) < 0.3 * power_w(sim, 6)
    assert n.nvmlDeviceGetMemoryInfo(handle).used == used
    assert n.nvmlDeviceGetComputeRunningProcesses(handle)
    assert n.nvmlDeviceGetCurrentClocksEventReasons(handle) & pynvml.nvmlClocksEventReasonGpuIdle
    stalled_rate = (counter(sim, "mlx5_ib0", "port_xmit_data") - ib_before) / 5

    control(sim.workdir, {"action": "resume", "job_id": JOB})
    run([sim], T0 + 8, 3)
    assert all(abs(util(sim, g) - util(sim, 6)) <= 3 for g in range(4))
    # the host's ports carry the mean of its two jobs: half of them stalled, about half the traffic
    resumed = counter(sim, "mlx5_ib0", "port_xmit_data")
    run([sim], T0 + 11, 5)
    assert (counter(sim, "mlx5_ib0", "port_xmit_data") - resumed) / 5 > 1.5 * stalled_rate


def test_release_ends_the_rhythm(hosts) -> None:
    sim = hosts[0]
    start_job(sim, gpus=range(2))
    control(sim.workdir, {"action": "release"})
    run([sim], T0 + 1, 2)
    assert all(not sim.fabric.port(f"mlx5_ib{i}").in_job for i in range(8))
    assert sim.nvml._gpus[0].driven is None


@pytest.mark.parametrize("command, message", [
    ({"action": "throttle", "gpu": 5, "reason": "too_hot", "factor": 0.7}, "unknown throttle reason 'too_hot'"),
    ({"action": "throttle", "gpu": 5, "factor": 1.5}, "throttle factor must be in (0, 1]"),
    ({"action": "throttle", "gpu": 9}, "no GPU 9"),
    ({"action": "congest", "device": "mlx5_ib9"}, "no simulated port mlx5_ib9/1"),
    ({"action": "stall"}, "'job_id'"),
])
def test_bad_job_controls_are_logged_and_change_nothing(hosts, caplog, command, message) -> None:
    sim = hosts[0]
    start_job(sim)
    control(sim.workdir, command)
    with caplog.at_level(logging.WARNING, logger="gpumon.simulate"):
        run([sim], T0 + 1, 2)
    assert message in caplog.text
    assert {sm_clock(sim, g) for g in range(8)} == {1980}
    assert os.listdir(sim.control_dir) == []
